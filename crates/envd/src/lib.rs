//! envd: the in-guest agent, wire-compatible with E2B's envd (Connect RPC + JSON, files HTTP).
//!
//! It also serves as the guest's PID 1 (`init`). It must never trust its caller beyond what the
//! access token and the requesting user's permissions allow.

pub mod init;
