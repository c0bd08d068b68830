//! envd's hand-written Connect message types (`vmon_envd::rpc`) against the `.proto` files in
//! `crates/proto/proto/envd/`: every field of every message must have a Rust counterpart with
//! the same proto3 JSON name (lowerCamelCase) and a compatible JSON type.
//!
//! The `.proto` files are read by a small parser of `message`, `enum`, `oneof` and field
//! declarations (no protoc needed). Requests are checked by deserializing, one field at a time,
//! a JSON object holding a sample of that field: the result must differ from the empty
//! message's (serde ignores unknown keys, so a field the Rust type lacks changes nothing).
//! Responses are checked by serializing populated Rust values and walking the JSON: every
//! field must show up, with the JSON type proto3 gives it. Every message of the `.proto`
//! files must be covered by one of the two.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use vmon_envd::rpc::{filesystem as fs, process as pr};

// ---------------------------------------------------------------------------------------------
// The .proto parser.

#[derive(Debug, Clone)]
enum Label {
    Single,
    Optional,
    Repeated,
    /// `map<key, value>`.
    Map(String, String),
}

#[derive(Debug, Clone)]
struct Field {
    name: String,
    /// The type as written (`string`, `ProcessConfig`, `google.protobuf.Timestamp`).
    ty: String,
    label: Label,
    /// The oneof it belongs to, if any.
    oneof: Option<String>,
}

impl Field {
    /// The proto3 JSON name: lowerCamelCase of the field name.
    fn json_name(&self) -> String {
        let mut out = String::new();
        let mut upper = false;
        for c in self.name.chars() {
            if c == '_' {
                upper = true;
            } else if upper {
                out.extend(c.to_uppercase());
                upper = false;
            } else {
                out.push(c);
            }
        }
        out
    }
}

#[derive(Debug, Default)]
struct Schema {
    /// Messages by full name (`process.ProcessEvent.EndEvent`).
    messages: BTreeMap<String, Vec<Field>>,
    /// Enums by full name, with their value names in declaration order.
    enums: BTreeMap<String, Vec<String>>,
}

fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut chars = line.chars().peekable();
        let mut cur = String::new();
        while let Some(c) = chars.next() {
            if c.is_alphanumeric() || c == '_' || c == '.' {
                cur.push(c);
                continue;
            }
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            match c {
                '/' if chars.peek() == Some(&'/') => break,
                '"' => {
                    // A quoted string (syntax, import) is one token.
                    let mut s = String::from('"');
                    for c in chars.by_ref() {
                        s.push(c);
                        if c == '"' {
                            break;
                        }
                    }
                    out.push(s);
                }
                c if c.is_whitespace() => {}
                c => out.push(c.to_string()),
            }
        }
        if !cur.is_empty() {
            out.push(cur);
        }
    }
    out
}

struct Parser {
    toks: Vec<String>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> &str {
        self.toks.get(self.pos).map(String::as_str).unwrap_or("")
    }

    fn next(&mut self) -> String {
        let t = self.peek().to_string();
        assert!(self.pos < self.toks.len(), "unexpected end of .proto");
        self.pos += 1;
        t
    }

    fn expect(&mut self, want: &str) {
        let got = self.next();
        assert_eq!(got, want, "expected {want:?} at token {}", self.pos);
    }

    fn skip_statement(&mut self) {
        while self.next() != ";" {}
    }

    fn skip_block(&mut self) {
        while self.next() != "{" {}
        let mut depth = 1;
        while depth > 0 {
            match self.next().as_str() {
                "{" => depth += 1,
                "}" => depth -= 1,
                _ => {}
            }
        }
    }

    fn file(&mut self, schema: &mut Schema) {
        let mut package = String::new();
        while self.pos < self.toks.len() {
            match self.peek() {
                "syntax" | "import" | "option" => self.skip_statement(),
                "package" => {
                    self.next();
                    package = self.next();
                    self.expect(";");
                }
                "message" => {
                    self.next();
                    let name = self.next();
                    self.message(schema, &format!("{package}.{name}"));
                }
                "enum" => {
                    self.next();
                    let name = self.next();
                    self.enumeration(schema, &format!("{package}.{name}"));
                }
                "service" => self.skip_block(),
                t => panic!("unexpected {t:?} at the top of a .proto"),
            }
        }
    }

    fn enumeration(&mut self, schema: &mut Schema, full: &str) {
        self.expect("{");
        let mut values = Vec::new();
        loop {
            match self.peek() {
                "}" => {
                    self.next();
                    break;
                }
                "option" | "reserved" => self.skip_statement(),
                _ => {
                    values.push(self.next());
                    self.skip_statement();
                }
            }
        }
        schema.enums.insert(full.to_string(), values);
    }

    fn message(&mut self, schema: &mut Schema, full: &str) {
        self.expect("{");
        let mut fields = Vec::new();
        self.body(schema, full, &mut fields, None);
        schema.messages.insert(full.to_string(), fields);
    }

    /// Declarations up to the closing `}` of a message or oneof.
    fn body(
        &mut self,
        schema: &mut Schema,
        full: &str,
        fields: &mut Vec<Field>,
        oneof: Option<&str>,
    ) {
        loop {
            match self.peek() {
                "}" => {
                    self.next();
                    return;
                }
                "message" => {
                    self.next();
                    let name = self.next();
                    self.message(schema, &format!("{full}.{name}"));
                }
                "enum" => {
                    self.next();
                    let name = self.next();
                    self.enumeration(schema, &format!("{full}.{name}"));
                }
                "oneof" => {
                    self.next();
                    let name = self.next();
                    self.expect("{");
                    self.body(schema, full, fields, Some(&name));
                }
                "option" | "reserved" | "extensions" => self.skip_statement(),
                _ => fields.push(self.field(oneof)),
            }
        }
    }

    fn field(&mut self, oneof: Option<&str>) -> Field {
        let mut label = Label::Single;
        let ty = match self.next().as_str() {
            "optional" => {
                label = Label::Optional;
                self.next()
            }
            "repeated" => {
                label = Label::Repeated;
                self.next()
            }
            "map" => {
                self.expect("<");
                let k = self.next();
                self.expect(",");
                let v = self.next();
                self.expect(">");
                label = Label::Map(k, v.clone());
                v
            }
            t => t.to_string(),
        };
        let name = self.next();
        self.expect("=");
        let _number = self.next();
        // Field options (`[json_name = ...]`) are not used by these files: refuse them rather
        // than check the wrong name.
        assert_eq!(
            self.peek(),
            ";",
            "field {name}: options are not supported here"
        );
        self.next();
        Field {
            name,
            ty,
            label,
            oneof: oneof.map(str::to_string),
        }
    }
}

fn schema() -> Schema {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/proto/envd");
    let mut schema = Schema::default();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "proto"))
        .collect();
    files.sort();
    assert!(files.len() >= 2, "no .proto files in {}", dir.display());
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        Parser {
            toks: tokens(&text),
            pos: 0,
        }
        .file(&mut schema);
    }
    schema
}

// ---------------------------------------------------------------------------------------------
// Types and samples.

enum Kind {
    Scalar(&'static str),
    Enum(String),
    Message(String),
    Timestamp,
}

impl Schema {
    /// Resolves a type name as protoc does: the innermost enclosing scope first.
    fn kind(&self, scope: &str, ty: &str) -> Kind {
        const SCALARS: &[&str] = &[
            "double", "float", "int32", "int64", "uint32", "uint64", "sint32", "sint64", "fixed32",
            "fixed64", "sfixed32", "sfixed64", "bool", "string", "bytes",
        ];
        if let Some(s) = SCALARS.iter().find(|s| **s == ty) {
            return Kind::Scalar(s);
        }
        if ty == "google.protobuf.Timestamp" {
            return Kind::Timestamp;
        }
        let mut at = scope.to_string();
        loop {
            let candidate = format!("{at}.{ty}");
            if self.messages.contains_key(&candidate) {
                return Kind::Message(candidate);
            }
            if self.enums.contains_key(&candidate) {
                return Kind::Enum(candidate);
            }
            match at.rfind('.') {
                Some(i) => at.truncate(i),
                None => panic!("type {ty} (in {scope}) is not defined"),
            }
        }
    }

    /// A non-default proto3 JSON value of one element of type `ty` (seen from `scope`).
    fn sample(&self, scope: &str, ty: &str, depth: usize) -> Value {
        match self.kind(scope, ty) {
            Kind::Scalar("string") => json!("s"),
            Kind::Scalar("bytes") => json!("aGk="),
            Kind::Scalar("bool") => json!(true),
            Kind::Scalar("int64" | "uint64" | "sint64" | "fixed64" | "sfixed64") => json!("5"),
            Kind::Scalar("double" | "float") => json!(1.5),
            Kind::Scalar(_) => json!(7),
            Kind::Timestamp => json!("1970-01-01T00:00:01Z"),
            Kind::Enum(e) => json!(self.enums[&e]
                .get(1)
                .cloned()
                .unwrap_or_else(|| panic!("enum {e} has no non-default value"))),
            Kind::Message(m) => self.message_sample(&m, depth + 1),
        }
    }

    fn field_sample(&self, scope: &str, f: &Field, depth: usize) -> Value {
        match &f.label {
            Label::Map(_, _) => json!({ "k": self.sample(scope, &f.ty, depth) }),
            Label::Repeated => json!([self.sample(scope, &f.ty, depth)]),
            Label::Single | Label::Optional => self.sample(scope, &f.ty, depth),
        }
    }

    /// A message with every field set (nested messages too, a few levels deep).
    fn message_sample(&self, full: &str, depth: usize) -> Value {
        let mut obj = serde_json::Map::new();
        if depth < 4 {
            for f in &self.messages[full] {
                obj.insert(f.json_name(), self.field_sample(full, f, depth));
            }
        }
        Value::Object(obj)
    }
}

// ---------------------------------------------------------------------------------------------
// Requests: deserialized one field at a time.

type Check = fn(&Value) -> Result<String, String>;

fn decode<T: DeserializeOwned + Debug>(v: &Value) -> Result<String, String> {
    serde_json::from_value::<T>(v.clone())
        .map(|t| format!("{t:?}"))
        .map_err(|e| e.to_string())
}

/// Proto request messages and the Rust types the server decodes them into.
fn requests() -> Vec<(&'static str, Check)> {
    vec![
        ("process.PTY", decode::<pr::Pty>),
        ("process.PTY.Size", decode::<pr::PtySize>),
        ("process.ProcessConfig", decode::<pr::ProcessConfig>),
        ("process.ListRequest", decode::<pr::ListRequest>),
        ("process.StartRequest", decode::<pr::StartRequest>),
        ("process.UpdateRequest", decode::<pr::UpdateRequest>),
        ("process.SendInputRequest", decode::<pr::SendInputRequest>),
        ("process.ProcessInput", decode::<pr::ProcessInput>),
        (
            "process.StreamInputRequest",
            decode::<pr::StreamInputRequest>,
        ),
        (
            "process.StreamInputRequest.StartEvent",
            decode::<pr::StreamInputStart>,
        ),
        (
            "process.StreamInputRequest.DataEvent",
            decode::<pr::StreamInputData>,
        ),
        ("process.StreamInputRequest.KeepAlive", decode::<Value>),
        ("process.SendSignalRequest", decode::<pr::SendSignalRequest>),
        ("process.CloseStdinRequest", decode::<pr::SelectorRequest>),
        ("process.ConnectRequest", decode::<pr::SelectorRequest>),
        ("process.ProcessSelector", decode::<pr::ProcessSelector>),
        ("filesystem.MoveRequest", decode::<fs::MoveRequest>),
        ("filesystem.MakeDirRequest", decode::<fs::PathRequest>),
        ("filesystem.RemoveRequest", decode::<fs::PathRequest>),
        ("filesystem.StatRequest", decode::<fs::PathRequest>),
        ("filesystem.ListDirRequest", decode::<fs::ListDirRequest>),
        ("filesystem.WatchDirRequest", decode::<fs::WatchRequest>),
        (
            "filesystem.CreateWatcherRequest",
            decode::<fs::WatchRequest>,
        ),
        (
            "filesystem.GetWatcherEventsRequest",
            decode::<fs::WatcherRequest>,
        ),
        (
            "filesystem.RemoveWatcherRequest",
            decode::<fs::WatcherRequest>,
        ),
    ]
}

/// Problems of request message `full` decoded by `check`.
fn check_request(schema: &Schema, full: &str, check: Check) -> Vec<String> {
    let mut problems = Vec::new();
    let empty = match check(&json!({})) {
        Ok(d) => d,
        Err(e) => return vec![format!("{full}: `{{}}` does not decode: {e}")],
    };
    for f in &schema.messages[full] {
        let name = f.json_name();
        let one = json!({ &name: schema.field_sample(full, f, 0) });
        match check(&one) {
            Ok(d) if d == empty => problems.push(format!(
                "{full}.{}: {one} decodes to the same value as {{}} (no field named {name:?}?)",
                f.name
            )),
            Ok(_) => {}
            Err(e) => problems.push(format!(
                "{full}.{}: {one} does not decode ({e}): the Rust type is not compatible",
                f.name
            )),
        }
    }
    problems
}

// ---------------------------------------------------------------------------------------------
// Responses: populated values serialized and walked.

fn entry(name: &str) -> fs::EntryInfo {
    fs::EntryInfo {
        name: name.into(),
        file_type: fs::FileType::Symlink,
        path: format!("/{name}"),
        size: 5,
        mode: 0o644,
        permissions: "-rw-r--r--".into(),
        owner: "root".into(),
        group: "root".into(),
        modified_time: Some("1970-01-01T00:00:01Z".into()),
        symlink_target: Some("/target".into()),
        metadata: BTreeMap::from([("k".to_string(), "v".to_string())]),
        is_symlink: true,
    }
}

fn fs_event() -> fs::FilesystemEvent {
    fs::FilesystemEvent {
        name: "a".into(),
        event_type: fs::EventType::Write,
        entry: Some(entry("a")),
    }
}

fn json_of<T: Serialize>(t: &T) -> Value {
    serde_json::to_value(t).unwrap()
}

/// Proto response messages and populated Rust values the server sends for them (several when
/// the message holds a oneof: one per arm).
fn responses() -> Vec<(&'static str, Vec<Value>)> {
    let config = pr::ProcessConfig {
        cmd: "/bin/bash".into(),
        args: vec!["-c".into()],
        envs: BTreeMap::from([("A".to_string(), "1".to_string())]),
        cwd: Some("/tmp".into()),
    };
    let events: Vec<Value> = [
        pr::ProcessEvent::Start(pr::StartEvent { pid: 3 }),
        pr::ProcessEvent::Data(pr::DataEvent::Stdout(b"o".to_vec())),
        pr::ProcessEvent::Data(pr::DataEvent::Stderr(b"e".to_vec())),
        pr::ProcessEvent::Data(pr::DataEvent::Pty(b"p".to_vec())),
        pr::ProcessEvent::End(pr::EndEvent {
            exit_code: -1,
            exited: true,
            status: "signal: killed".into(),
            error: Some("killed".into()),
        }),
        pr::ProcessEvent::Keepalive(pr::Empty2 {}),
    ]
    .into_iter()
    .map(|event| json_of(&pr::EventResponse { event }))
    .collect();
    let empty = vec![json_of(&pr::Empty {})];
    vec![
        (
            "process.ListResponse",
            vec![json_of(&pr::ListResponse {
                processes: vec![pr::ProcessInfo {
                    config,
                    pid: 3,
                    tag: Some("t".into()),
                }],
            })],
        ),
        ("process.StartResponse", events.clone()),
        ("process.ConnectResponse", events),
        ("process.UpdateResponse", empty.clone()),
        ("process.SendInputResponse", empty.clone()),
        ("process.StreamInputResponse", empty.clone()),
        ("process.SendSignalResponse", empty.clone()),
        ("process.CloseStdinResponse", empty.clone()),
        (
            "filesystem.StatResponse",
            vec![json_of(&fs::EntryResponse { entry: entry("s") })],
        ),
        (
            "filesystem.MakeDirResponse",
            vec![json_of(&fs::EntryResponse { entry: entry("d") })],
        ),
        (
            "filesystem.MoveResponse",
            vec![json_of(&fs::EntryResponse { entry: entry("m") })],
        ),
        ("filesystem.RemoveResponse", empty.clone()),
        (
            "filesystem.ListDirResponse",
            vec![json_of(&fs::ListDirResponse {
                entries: vec![entry("l")],
            })],
        ),
        (
            "filesystem.WatchDirResponse",
            vec![
                json_of(&fs::WatchDirResponse::Start(pr::Empty {})),
                json_of(&fs::WatchDirResponse::Filesystem(fs_event())),
                json_of(&fs::WatchDirResponse::Keepalive(pr::Empty {})),
            ],
        ),
        (
            "filesystem.CreateWatcherResponse",
            vec![json_of(&fs::CreateWatcherResponse {
                watcher_id: "w".into(),
            })],
        ),
        (
            "filesystem.GetWatcherEventsResponse",
            vec![json_of(&fs::GetWatcherEventsResponse {
                events: vec![fs_event()],
            })],
        ),
        ("filesystem.RemoveWatcherResponse", empty),
    ]
}

/// Every JSON object seen for each message, following message-typed fields down.
fn walk(
    schema: &Schema,
    full: &str,
    v: &Value,
    seen: &mut BTreeMap<String, Vec<Value>>,
    problems: &mut Vec<String>,
) {
    let Some(obj) = v.as_object() else {
        problems.push(format!("{full}: serialized as {v}, not an object"));
        return;
    };
    seen.entry(full.to_string()).or_default().push(v.clone());
    let fields = &schema.messages[full];
    for key in obj.keys() {
        if !fields.iter().any(|f| f.json_name() == *key) {
            problems.push(format!(
                "{full}: the Rust type sends {key:?}, which the .proto lacks"
            ));
        }
    }
    for f in fields {
        let Some(value) = obj.get(&f.json_name()) else {
            continue;
        };
        let elems: Vec<&Value> = match (&f.label, value) {
            (Label::Repeated, Value::Array(a)) => a.iter().collect(),
            (Label::Map(k, _), Value::Object(m)) => {
                if k != "string" {
                    problems.push(format!(
                        "{full}.{}: map keys of {k} are not checked",
                        f.name
                    ));
                }
                m.values().collect()
            }
            (Label::Repeated, _) => {
                problems.push(format!("{full}.{}: repeated but sent as {value}", f.name));
                continue;
            }
            (Label::Map(..), _) => {
                problems.push(format!("{full}.{}: a map but sent as {value}", f.name));
                continue;
            }
            _ => vec![value],
        };
        for e in elems {
            let ok = match schema.kind(full, &f.ty) {
                Kind::Scalar("string" | "bytes") | Kind::Timestamp => e.is_string(),
                Kind::Scalar("bool") => e.is_boolean(),
                Kind::Scalar("int64" | "uint64" | "sint64" | "fixed64" | "sfixed64") => {
                    e.as_str().is_some_and(|s| s.parse::<i128>().is_ok())
                }
                Kind::Scalar("int32" | "sint32" | "sfixed32") => e.as_i64().is_some(),
                Kind::Scalar("uint32" | "fixed32") => e.as_u64().is_some(),
                Kind::Scalar(_) => e.is_number(),
                Kind::Enum(en) => e
                    .as_str()
                    .is_some_and(|s| schema.enums[&en].iter().any(|n| n == s)),
                Kind::Message(m) => {
                    walk(schema, &m, e, seen, problems);
                    true
                }
            };
            if !ok {
                problems.push(format!(
                    "{full}.{}: sent as {e}, not proto3 JSON of {}",
                    f.name, f.ty
                ));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn the_parser_reads_what_it_should() {
    let s = schema();
    let end = &s.messages["process.ProcessEvent.EndEvent"];
    let names: Vec<String> = end.iter().map(Field::json_name).collect();
    assert_eq!(names, ["exitCode", "exited", "status", "error"]);
    let event = &s.messages["process.ProcessEvent"];
    assert!(event.iter().all(|f| f.oneof.as_deref() == Some("event")));
    assert_eq!(event.len(), 4);
    let config = &s.messages["process.ProcessConfig"];
    assert!(matches!(&config[2].label, Label::Map(k, v) if k == "string" && v == "string"));
    assert!(matches!(config[1].label, Label::Repeated));
    assert!(matches!(config[3].label, Label::Optional));
    assert_eq!(s.enums["filesystem.FileType"].len(), 4);
    assert!(matches!(
        s.kind("filesystem.EntryInfo", "google.protobuf.Timestamp"),
        Kind::Timestamp
    ));
    assert!(matches!(
        s.kind("process.StreamInputRequest", "StartEvent"),
        Kind::Message(m) if m == "process.StreamInputRequest.StartEvent"
    ));
}

#[test]
fn the_checks_catch_a_missing_field() {
    // A stand-in for a Rust type that lost a field: `PathRequest` has no `destination`.
    let s = schema();
    let problems = check_request(&s, "filesystem.MoveRequest", decode::<fs::PathRequest>);
    assert_eq!(problems.len(), 2, "{problems:#?}");
    // A response missing a field is caught by the coverage check of `every_field...` below;
    // here the walk must at least reject a wrongly typed one.
    let mut seen = BTreeMap::new();
    let mut walk_problems = Vec::new();
    walk(
        &s,
        "filesystem.EntryInfo",
        &json!({"name": "a", "size": 5, "type": "FILE_TYPE_NOPE"}),
        &mut seen,
        &mut walk_problems,
    );
    assert_eq!(walk_problems.len(), 2, "{walk_problems:#?}");
}

#[test]
fn every_proto_field_has_a_rust_counterpart() {
    let s = schema();
    let mut problems = Vec::new();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    for (full, check) in requests() {
        assert!(
            s.messages.contains_key(full),
            "{full} is not in the .proto files"
        );
        problems.extend(check_request(&s, full, check));
        covered.insert(full.to_string());
    }
    let mut seen: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for (full, values) in responses() {
        assert!(
            s.messages.contains_key(full),
            "{full} is not in the .proto files"
        );
        for v in &values {
            walk(&s, full, v, &mut seen, &mut problems);
        }
    }
    // Every field of every message a response reached must have been sent at least once.
    for (full, objects) in &seen {
        covered.insert(full.clone());
        for f in &s.messages[full] {
            let name = f.json_name();
            if !objects.iter().any(|o| o.get(&name).is_some()) {
                problems.push(format!("{full}.{}: no Rust value sends {name:?}", f.name));
            }
        }
    }
    for full in s.messages.keys() {
        if !covered.contains(full) {
            problems.push(format!(
                "{full}: no Rust type is checked against it (add it to requests() or responses())"
            ));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}
