//! Proto3 JSON mapping rules that serde does not give for free.
//!
//! Output follows the canonical form (int64 as strings, bytes as standard base64, defaults
//! omitted); input is lenient the way protobuf's own parsers are (numbers or strings for integers,
//! either base64 alphabet, `null` meaning the default).

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serializer};

/// `bytes` fields: standard base64 with padding on output.
pub mod bytes_b64 {
    use super::*;

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s: Option<String> = Option::deserialize(d)?;
        match s {
            None => Ok(Vec::new()),
            Some(s) => decode_base64(&s).map_err(de::Error::custom),
        }
    }
}

/// Decodes base64 in either alphabet, padded or not, as proto3 JSON parsers accept.
pub fn decode_base64(s: &str) -> Result<Vec<u8>, String> {
    let trimmed = s.trim_end_matches('=');
    let engine = if trimmed.contains('-') || trimmed.contains('_') {
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
    } else {
        &base64::engine::general_purpose::STANDARD_NO_PAD
    };
    engine
        .decode(trimmed)
        .map_err(|e| format!("invalid base64: {e}"))
}

/// int64 output as a JSON string.
pub fn i64_as_string<S: Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&v.to_string())
}

pub fn is_zero_i64(v: &i64) -> bool {
    *v == 0
}

pub fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

pub fn is_zero_i32(v: &i32) -> bool {
    *v == 0
}

pub fn is_false(v: &bool) -> bool {
    !*v
}

/// Accepts a uint32 as a JSON number or a decimal string; `null` is 0.
pub fn de_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    Ok(de_opt_u32(d)?.unwrap_or(0))
}

/// Like [`de_u32`] but keeps "absent/null" distinct from 0.
pub fn de_opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Option<u32>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a uint32 as number or string")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(V)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            u32::try_from(v)
                .map(Some)
                .map_err(|_| E::custom("uint32 out of range"))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            u32::try_from(v)
                .map(Some)
                .map_err(|_| E::custom("uint32 out of range"))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            if v.fract() == 0.0 && (0.0..=u32::MAX as f64).contains(&v) {
                Ok(Some(v as u32))
            } else {
                Err(E::custom("uint32 out of range"))
            }
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            v.parse::<u32>()
                .map(Some)
                .map_err(|_| E::custom("invalid uint32 string"))
        }
    }
    d.deserialize_option(V)
}

/// A string field where `null` means "".
pub fn de_string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// A bool field where `null` means false.
pub fn de_bool<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// repeated string where `null` means empty.
pub fn de_strings<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(Option::<Vec<String>>::deserialize(d)?.unwrap_or_default())
}

/// map<string,string> where `null` means empty.
pub fn de_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    Ok(Option::<BTreeMap<String, String>>::deserialize(d)?.unwrap_or_default())
}

/// Parses an enum given by name or by number; `names` maps each name to its number.
pub fn de_enum<'de, D: Deserializer<'de>>(
    d: D,
    names: &'static [(&'static str, i32)],
) -> Result<i32, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    match v {
        serde_json::Value::Null => Ok(0),
        serde_json::Value::String(s) => names
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, v)| *v)
            .ok_or_else(|| de::Error::custom(format!("unknown enum value {s:?}"))),
        serde_json::Value::Number(n) => n
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .ok_or_else(|| de::Error::custom("enum number out of range")),
        _ => Err(de::Error::custom("enum must be a string or a number")),
    }
}

/// Formats a Unix time as a proto3 JSON Timestamp (RFC 3339, UTC, `Z`, 0/3/6/9 fraction digits).
pub fn timestamp(secs: i64, nanos: u32) -> String {
    let dt =
        time::OffsetDateTime::from_unix_timestamp(secs).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let base = format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
        dt.year(),
        u8::from(dt.month()),
        dt.day(),
        dt.hour(),
        dt.minute(),
        dt.second()
    );
    if nanos == 0 {
        format!("{base}Z")
    } else if nanos.is_multiple_of(1_000_000) {
        format!("{base}.{:03}Z", nanos / 1_000_000)
    } else if nanos.is_multiple_of(1_000) {
        format!("{base}.{:06}Z", nanos / 1_000)
    } else {
        format!("{base}.{nanos:09}Z")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_canonical() {
        assert_eq!(timestamp(0, 0), "1970-01-01T00:00:00Z");
        assert_eq!(
            timestamp(1_700_000_000, 5_000_000),
            "2023-11-14T22:13:20.005Z"
        );
        assert_eq!(timestamp(1, 1), "1970-01-01T00:00:01.000000001Z");
    }

    #[test]
    fn base64_either_alphabet() {
        assert_eq!(decode_base64("aGkK").unwrap(), b"hi\n");
        assert_eq!(decode_base64("_w==").unwrap(), vec![0xff]);
        assert_eq!(decode_base64("/w").unwrap(), vec![0xff]);
        assert!(decode_base64("!!").is_err());
    }
}
