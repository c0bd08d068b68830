//! envd driven as a host process over real sockets. Run as root (the tests create a user).
#![allow(clippy::unwrap_used)]

mod harness;

mod auth;
mod files;
mod filesystem;
mod process;
mod protocol;
mod transfer;
