//! `package filesystem` messages (crates/proto/proto/envd/filesystem.proto), proto3 JSON.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::json;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FileType {
    #[serde(rename = "FILE_TYPE_UNSPECIFIED")]
    Unspecified,
    #[serde(rename = "FILE_TYPE_FILE")]
    File,
    #[serde(rename = "FILE_TYPE_DIRECTORY")]
    Directory,
    #[serde(rename = "FILE_TYPE_SYMLINK")]
    Symlink,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub file_type: FileType,
    pub path: String,
    #[serde(
        serialize_with = "json::i64_as_string",
        skip_serializing_if = "json::is_zero_i64"
    )]
    pub size: i64,
    #[serde(skip_serializing_if = "json::is_zero_u32")]
    pub mode: u32,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub permissions: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub owner: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub group: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub modified_time: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "json::is_false")]
    pub is_symlink: bool,
}

/// `StatRequest`, `MakeDirRequest`, `RemoveRequest`: `{path}`.
#[derive(Debug, Default, Deserialize)]
pub struct PathRequest {
    #[serde(default, deserialize_with = "json::de_string")]
    pub path: String,
}

/// `StatResponse`, `MakeDirResponse`, `MoveResponse`: `{entry}`.
#[derive(Debug, Serialize)]
pub struct EntryResponse {
    pub entry: EntryInfo,
}

#[derive(Debug, Default, Deserialize)]
pub struct MoveRequest {
    #[serde(default, deserialize_with = "json::de_string")]
    pub source: String,
    #[serde(default, deserialize_with = "json::de_string")]
    pub destination: String,
}

#[derive(Debug, Default, Deserialize)]
pub struct ListDirRequest {
    #[serde(default, deserialize_with = "json::de_string")]
    pub path: String,
    #[serde(default, deserialize_with = "json::de_u32")]
    pub depth: u32,
}

#[derive(Debug, Serialize)]
pub struct ListDirResponse {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub entries: Vec<EntryInfo>,
}

/// `WatchDirRequest` and `CreateWatcherRequest`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchRequest {
    #[serde(default, deserialize_with = "json::de_string")]
    pub path: String,
    #[serde(default, deserialize_with = "json::de_bool")]
    pub recursive: bool,
    #[serde(default, alias = "include_entry", deserialize_with = "json::de_bool")]
    pub include_entry: bool,
    #[serde(
        default,
        alias = "allow_network_mounts",
        deserialize_with = "json::de_bool"
    )]
    pub allow_network_mounts: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EventType {
    #[serde(rename = "EVENT_TYPE_CREATE")]
    Create,
    #[serde(rename = "EVENT_TYPE_WRITE")]
    Write,
    #[serde(rename = "EVENT_TYPE_REMOVE")]
    Remove,
    #[serde(rename = "EVENT_TYPE_RENAME")]
    Rename,
    #[serde(rename = "EVENT_TYPE_CHMOD")]
    Chmod,
}

#[derive(Debug, Clone, Serialize)]
pub struct FilesystemEvent {
    pub name: String,
    #[serde(rename = "type")]
    pub event_type: EventType,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

/// `WatchDirResponse` oneof (built and serialized at once, so its size does not matter).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum WatchDirResponse {
    Start(super::process::Empty),
    Filesystem(FilesystemEvent),
    Keepalive(super::process::Empty),
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateWatcherResponse {
    pub watcher_id: String,
}

/// `GetWatcherEventsRequest` and `RemoveWatcherRequest`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatcherRequest {
    #[serde(default, alias = "watcher_id", deserialize_with = "json::de_string")]
    pub watcher_id: String,
}

#[derive(Debug, Serialize)]
pub struct GetWatcherEventsResponse {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<FilesystemEvent>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn entry_info_is_proto3_json() {
        let e = EntryInfo {
            name: "a".into(),
            file_type: FileType::File,
            path: "/a".into(),
            size: 5,
            mode: 0o644,
            permissions: "-rw-r--r--".into(),
            owner: "root".into(),
            group: "root".into(),
            modified_time: Some("1970-01-01T00:00:00Z".into()),
            symlink_target: None,
            metadata: BTreeMap::new(),
            is_symlink: false,
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["size"], "5");
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["modifiedTime"], "1970-01-01T00:00:00Z");
        assert!(v.get("isSymlink").is_none());
        let w: WatchRequest =
            serde_json::from_str(r#"{"path":"/x","include_entry":true,"allowNetworkMounts":true}"#)
                .unwrap();
        assert!(w.include_entry && w.allow_network_mounts);
        let w: WatcherRequest = serde_json::from_str(r#"{"watcher_id":"w1"}"#).unwrap();
        assert_eq!(w.watcher_id, "w1");
    }
}
