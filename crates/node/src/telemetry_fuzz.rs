//! Property tests of what the node parses from guests: envd's `/metrics` answer (clamped into a
//! sample) and console lines.
//!
//! Bounded for CI: `PROPTEST_CASES` overrides the number of cases of every property.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::*;

fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

const KEYS: [&str; 9] = [
    "cpu_count",
    "cpu_used_pct",
    "mem_used",
    "mem_total",
    "mem_cache",
    "disk_used",
    "disk_total",
    "ts",
    "other",
];

/// Numbers of every JSON kind, at and around the edges.
fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        (0u64..8192).prop_map(Value::from),
        (-1000.0f64..1000.0).prop_map(Value::from),
        prop::sample::select(vec![
            0.0,
            -0.0,
            1e300,
            -1e300,
            u64::MAX as f64,
            f64::MAX,
            f64::MIN_POSITIVE,
            100.0000001,
        ])
        .prop_map(Value::from),
    ]
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 32, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(prop::sample::select(KEYS.to_vec()), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.into(), v)).collect())),
        ]
    })
}

/// An answer shaped like envd's, each field a number, something else, or absent.
fn metrics_object() -> impl Strategy<Value = Value> {
    let field =
        prop_oneof![6 => number().prop_map(Some), 1 => any_json().prop_map(Some), 1 => Just(None)];
    prop::collection::vec(field, KEYS.len()).prop_map(|fields| {
        let mut m = Map::new();
        for (k, v) in KEYS.iter().zip(fields) {
            if let Some(v) = v {
                m.insert(k.to_string(), v);
            }
        }
        Value::Object(m)
    })
}

/// What `uint` must make of a field: the integer when it is one, a positive finite float
/// truncated (saturating), and 0 for anything else.
fn expected_uint(v: Option<&Value>) -> u64 {
    match v {
        Some(Value::Number(n)) => n.as_u64().unwrap_or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f > 0.0)
                .map_or(0, |f| f as u64)
        }),
        _ => 0,
    }
}

fn check_sample(v: &Value, s: &MetricSample, now: i64) -> Result<(), TestCaseError> {
    prop_assert_eq!(s.timestamp_unix, now);
    prop_assert!(s.cpu_count <= 4096);
    prop_assert!(s.cpu_used_pct.is_finite());
    prop_assert!(
        (0.0..=100.0).contains(&s.cpu_used_pct),
        "{}",
        s.cpu_used_pct
    );
    prop_assert!(s.mem_used <= s.mem_total);
    prop_assert!(s.mem_cache <= s.mem_total);
    prop_assert!(s.disk_used <= s.disk_total);
    // Totals are taken as given; used and cache are the given value cut to the total.
    let f = |k: &str| expected_uint(v.get(k));
    prop_assert_eq!(s.mem_total, f("mem_total"));
    prop_assert_eq!(s.disk_total, f("disk_total"));
    prop_assert_eq!(s.mem_used, f("mem_used").min(s.mem_total));
    prop_assert_eq!(s.mem_cache, f("mem_cache").min(s.mem_total));
    prop_assert_eq!(s.disk_used, f("disk_used").min(s.disk_total));
    prop_assert_eq!(u64::from(s.cpu_count), f("cpu_count").min(4096));
    // A sane percentage survives to two decimals.
    if let Some(p) = v.get("cpu_used_pct").and_then(Value::as_f64) {
        if (0.0..=100.0).contains(&p) {
            prop_assert!(
                (f64::from(s.cpu_used_pct) - p).abs() <= 0.005 + 1e-4,
                "{} vs {}",
                s.cpu_used_pct,
                p
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(1024))]

    /// Any JSON value: not an object is no sample; an object is a sample whose every field
    /// is clamped to a sane range and otherwise faithful.
    #[test]
    fn any_answer_is_clamped(v in prop_oneof![metrics_object(), any_json()], now in any::<i64>()) {
        match parse_envd_metrics(&v, now) {
            None => prop_assert!(!v.is_object()),
            Some(s) => {
                prop_assert!(v.is_object());
                check_sample(&v, &s, now)?;
            }
        }
    }

    /// A clamped sample written to `metrics.jsonl` reads back as itself.
    #[test]
    fn clamped_samples_survive_the_file(v in metrics_object(), ts in any::<i64>()) {
        let Some(s) = parse_envd_metrics(&v, ts) else {
            return Err(TestCaseError::fail("an object gave no sample"));
        };
        let line = sample_json(&s).to_string();
        let back: Value = serde_json::from_str(&line).expect("our own line parses");
        prop_assert_eq!(back.get("ts").and_then(Value::as_i64), Some(ts));
        prop_assert_eq!(parse_envd_metrics(&back, ts), Some(s));
    }

    /// The bytes of an answer as the scraper handles them (bounded, then parsed): JSON or not,
    /// an error or a clamped sample, never a panic.
    #[test]
    fn answer_bytes_never_panic(
        bytes in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..256),
            metrics_object().prop_map(|v| v.to_string().into_bytes()),
            (metrics_object(), 0usize..64).prop_map(|(v, cut)| {
                let t = v.to_string().into_bytes();
                t[..t.len().saturating_sub(cut)].to_vec()
            }),
        ],
        now in any::<i64>(),
    ) {
        prop_assert!(bytes.len() <= MAX_METRICS_ANSWER);
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            if let Some(s) = parse_envd_metrics(&v, now) {
                check_sample(&v, &s, now)?;
            }
        }
    }

    /// Console lines from the guest: never a panic, and the entry is bounded (line, field
    /// count, key and value sizes) whatever the guest printed.
    #[test]
    fn console_lines_are_bounded(
        raw in prop_oneof![
            any::<String>(),
            any_json().prop_map(|v| v.to_string()),
            prop::collection::btree_map(
                prop_oneof![20 => "[a-z]{1,8}", 1 => (250usize..300).prop_map(|n| "k".repeat(n))],
                prop_oneof![20 => "[ -~]{0,12}", 1 => (4090usize..4200).prop_map(|n| "v".repeat(n))],
                0..80,
            )
            .prop_map(|m| json!(m).to_string()),
            (0usize..3, "[ -~]{0,40}").prop_map(|(n, s)| format!("[{}] {s}", " 1.5".repeat(n))),
        ],
    ) {
        let trimmed = raw.trim_end_matches(['\r', '\n']);
        if let Some((e, _)) = parse_line(&raw) {
            prop_assert!(e.line.len() <= MAX_LINE);
            prop_assert!(trimmed.starts_with(&e.line));
            prop_assert!(e.fields.len() <= MAX_FIELDS.max(1));
            for (k, v) in &e.fields {
                prop_assert!(k.len() <= 256);
                prop_assert!(v.len() <= MAX_FIELD_VALUE);
            }
        } else {
            prop_assert!(bounded(trimmed, MAX_LINE).trim().is_empty());
        }
    }
}
