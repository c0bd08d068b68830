pub mod admin;
pub mod api;
pub mod bench;
pub mod doctor;
pub mod image;
pub mod node;
pub mod proxy;
pub mod up;
