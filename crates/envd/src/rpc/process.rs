//! `package process` messages (crates/proto/proto/envd/process.proto), proto3 JSON.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use super::json::{self, bytes_b64};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PtySize {
    #[serde(
        default,
        deserialize_with = "json::de_u32",
        skip_serializing_if = "json::is_zero_u32"
    )]
    pub cols: u32,
    #[serde(
        default,
        deserialize_with = "json::de_u32",
        skip_serializing_if = "json::is_zero_u32"
    )]
    pub rows: u32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pty {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<PtySize>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessConfig {
    #[serde(default, deserialize_with = "json::de_string")]
    pub cmd: String,
    #[serde(
        default,
        deserialize_with = "json::de_strings",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub args: Vec<String>,
    #[serde(
        default,
        deserialize_with = "json::de_map",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct ListRequest {}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListResponse {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<ProcessInfo>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartRequest {
    #[serde(default)]
    pub process: Option<ProcessConfig>,
    #[serde(default)]
    pub pty: Option<Pty>,
    #[serde(default)]
    pub tag: Option<String>,
    #[serde(default)]
    pub stdin: Option<bool>,
}

/// `ProcessSelector` oneof: pid or tag.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ProcessSelector {
    #[serde(default, deserialize_with = "json::de_opt_u32")]
    pub pid: Option<u32>,
    #[serde(default)]
    pub tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UpdateRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub pty: Option<Pty>,
}

/// `ProcessInput` oneof: stdin or pty bytes.
#[derive(Debug, Default, Deserialize)]
pub struct ProcessInput {
    #[serde(default, deserialize_with = "opt_bytes")]
    pub stdin: Option<Vec<u8>>,
    #[serde(default, deserialize_with = "opt_bytes")]
    pub pty: Option<Vec<u8>>,
}

fn opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
    let s: Option<String> = Option::deserialize(d)?;
    s.map(|s| json::decode_base64(&s).map_err(serde::de::Error::custom))
        .transpose()
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendInputRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

/// One message of the `StreamInput` client stream.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamInputRequest {
    #[serde(default)]
    pub start: Option<StreamInputStart>,
    #[serde(default)]
    pub data: Option<StreamInputData>,
    #[serde(default)]
    pub keepalive: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamInputStart {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamInputData {
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

pub const SIGNAL_NAMES: &[(&str, i32)] = &[
    ("SIGNAL_UNSPECIFIED", 0),
    ("SIGNAL_SIGTERM", 15),
    ("SIGNAL_SIGKILL", 9),
];

fn de_signal<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    json::de_enum(d, SIGNAL_NAMES)
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendSignalRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default, deserialize_with = "de_signal")]
    pub signal: i32,
}

/// `CloseStdinRequest` and `ConnectRequest` share this shape.
#[derive(Debug, Default, Deserialize)]
pub struct SelectorRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
}

/// An empty response message (`{}`).
#[derive(Debug, Default, Serialize)]
pub struct Empty {}

/// `StartResponse` / `ConnectResponse`: `{"event": ProcessEvent}`.
#[derive(Debug, Clone, Serialize)]
pub struct EventResponse {
    pub event: ProcessEvent,
}

/// `ProcessEvent` oneof.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    Start(StartEvent),
    Data(DataEvent),
    End(EndEvent),
    Keepalive(Empty2),
}

/// `{}` that is also `Clone`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Empty2 {}

#[derive(Debug, Clone, Serialize)]
pub struct StartEvent {
    pub pid: u32,
}

/// `DataEvent` oneof output.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    Stdout(#[serde(with = "bytes_b64")] Vec<u8>),
    Stderr(#[serde(with = "bytes_b64")] Vec<u8>),
    Pty(#[serde(with = "bytes_b64")] Vec<u8>),
}

impl DataEvent {
    pub fn len(&self) -> usize {
        match self {
            DataEvent::Stdout(b) | DataEvent::Stderr(b) | DataEvent::Pty(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    #[serde(skip_serializing_if = "json::is_zero_i32")]
    pub exit_code: i32,
    #[serde(skip_serializing_if = "json::is_false")]
    pub exited: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_as_oneofs() {
        let ev = EventResponse {
            event: ProcessEvent::Data(DataEvent::Stdout(b"hello\n".to_vec())),
        };
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"event":{"data":{"stdout":"aGVsbG8K"}}}"#
        );
        let ev = EventResponse {
            event: ProcessEvent::End(EndEvent {
                exit_code: 3,
                exited: true,
                status: "exit status 3".into(),
                error: None,
            }),
        };
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"event":{"end":{"exitCode":3,"exited":true,"status":"exit status 3"}}}"#
        );
        let ev = EventResponse {
            event: ProcessEvent::Keepalive(Empty2 {}),
        };
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"event":{"keepalive":{}}}"#
        );
    }

    #[test]
    fn requests_accept_sdk_json() {
        let r: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false,"pty":{"size":{"cols":"80","rows":24}}}"#,
        )
        .unwrap();
        let p = r.process.unwrap();
        assert_eq!(p.args.len(), 3);
        assert_eq!(r.stdin, Some(false));
        assert_eq!(r.pty.unwrap().size.unwrap().cols, 80);
        let s: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":12},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(s.signal, 9);
        let s: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":"12"},"signal":15}"#).unwrap();
        assert_eq!(s.signal, 15);
        assert_eq!(s.process.unwrap().pid, Some(12));
        let i: SendInputRequest =
            serde_json::from_str(r#"{"process":{"pid":12},"input":{"stdin":"aGkK"}}"#).unwrap();
        assert_eq!(i.input.unwrap().stdin.unwrap(), b"hi\n");
        assert!(serde_json::from_str::<SendSignalRequest>(r#"{"signal":"SIGNAL_NOPE"}"#).is_err());
    }
}
