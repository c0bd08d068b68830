//! envd's message types, hand-written serde mirrors of the `.proto` files kept in
//! `crates/proto/proto/envd/` (field names and numbers recorded there); `tests/proto_json.rs`
//! checks every .proto field has its counterpart here.

pub mod filesystem;
pub mod json;
pub mod process;
