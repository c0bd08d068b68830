//! What every route module shares: the request state ([`AppState`]), the extractors that
//! authenticate a request ([`Auth`] for a team's `X-API-Key`, [`Admin`] for the operator's
//! `X-Admin-Token`), and lenient body and query parsing with E2B-shaped errors. The route
//! modules (`http`, `admin`, `events`, `telemetry`) import these; this module imports none of
//! them.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::control::Control;
use crate::error::{ApiError, ApiResult};
use crate::ids;
use crate::records::Team;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub control: Arc<Control>,
    /// `X-Admin-Token` for the admin routes; `None` disables them.
    pub admin_token: Option<String>,
}

/// The authenticated team of a request (`X-API-Key`).
pub struct Auth(pub Team);

impl FromRequestParts<AppState> for Auth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> ApiResult<Self> {
        let key = parts
            .headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| ApiError::unauthorized("missing API key: send it in X-API-Key"))?;
        let team = state
            .control
            .records()
            .team_by_key_hash(&ids::hash_key(key))
            .await
            .map_err(|e| ApiError::records("looking up the API key failed", &e))?
            .ok_or_else(|| ApiError::unauthorized("invalid API key"))?;
        Ok(Auth(team))
    }
}

/// The operator (`X-Admin-Token`); the admin routes answer 404 when no token is set.
pub(crate) struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> ApiResult<Self> {
        let Some(expected) = &state.admin_token else {
            return Err(ApiError::not_found("no such endpoint"));
        };
        let sent = parts
            .headers
            .get("x-admin-token")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if ids::hash_key(sent) == ids::hash_key(expected) {
            Ok(Admin)
        } else {
            Err(ApiError::unauthorized("invalid admin token"))
        }
    }
}

/// A reader of the platform's Prometheus metrics (`GET /metrics`): the operator's token in
/// `X-Admin-Token`, or it or the config's `metrics_token` as `Authorization: Bearer` (what
/// Prometheus' `authorization` block sends). Without either token set the route answers 404.
pub(crate) struct MetricsReader;

impl FromRequestParts<AppState> for MetricsReader {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> ApiResult<Self> {
        let metrics = state.control.config().metrics_token.as_deref();
        let tokens: Vec<&str> = [state.admin_token.as_deref(), metrics]
            .into_iter()
            .flatten()
            .filter(|t| !t.is_empty())
            .collect();
        if tokens.is_empty() {
            return Err(ApiError::not_found("no such endpoint"));
        }
        let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
        let bearer = header("authorization").and_then(|v| {
            v.split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, t)| t.trim())
        });
        // Hashed before comparing, as for the admin token: the time taken says nothing of it.
        let admin_sent = header("x-admin-token").map(ids::hash_key);
        let bearer_sent = bearer.map(ids::hash_key);
        let admin = state.admin_token.as_deref().map(ids::hash_key);
        let ok = tokens
            .iter()
            .any(|t| bearer_sent.as_deref() == Some(&ids::hash_key(t)))
            || (admin.is_some() && admin_sent == admin);
        if ok {
            Ok(MetricsReader)
        } else {
            Err(ApiError::unauthorized(
                "the metrics need the admin token (X-Admin-Token) or a metrics token (Authorization: Bearer)",
            ))
        }
    }
}

/// Parses a JSON body leniently (unknown keys ignored; an empty body is `{}`) and answers
/// type errors with an E2B 400 instead of axum's plain-text rejection.
pub(crate) fn body<T: DeserializeOwned>(bytes: &Bytes) -> ApiResult<T> {
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    serde_json::from_slice(text)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// An integer query value as the document types it: an optional `-` and ASCII digits, nothing
/// else (no `+`, no spaces, no empty value), parsed into `T` (out of `T`'s range: `None`).
pub(crate) fn query_int<T: std::str::FromStr>(v: &str) -> Option<T> {
    let digits = v.strip_prefix('-').unwrap_or(v);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// The one value of a scalar query parameter: a key given twice with different values is a
/// 400 (a later valid value must not hide an earlier invalid one).
pub(crate) fn query_one<'a>(
    pairs: &'a [(String, String)],
    name: &str,
) -> ApiResult<Option<&'a str>> {
    let mut found: Option<&str> = None;
    for (_, v) in pairs.iter().filter(|(k, _)| k == name) {
        match found {
            Some(f) if f != v => {
                return Err(ApiError::bad_request(format!(
                    "query parameter {name} is given more than once"
                )))
            }
            _ => found = Some(v),
        }
    }
    Ok(found)
}

/// The pairs of a raw query string, in order (a key may repeat).
pub(crate) fn query_pairs(raw: Option<String>) -> ApiResult<Vec<(String, String)>> {
    serde_urlencoded::from_str::<Vec<(String, String)>>(raw.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("invalid query: {e}")))
}

#[cfg(test)]
mod tests {
    use super::query_int;

    #[test]
    fn only_plain_decimal_integers_are_query_integers() {
        assert_eq!(query_int::<i64>("42"), Some(42));
        assert_eq!(query_int::<i64>("-7"), Some(-7));
        assert_eq!(query_int::<u32>("0"), Some(0));
        for bad in ["", "-", "+1", " 1", "1 ", "1.5", "1e3", "0x10", "x", "--1"] {
            assert_eq!(query_int::<i64>(bad), None, "{bad:?}");
        }
        assert_eq!(query_int::<u32>("-1"), None, "a negative u32");
        assert_eq!(
            query_int::<i64>("99999999999999999999"),
            None,
            "out of range"
        );
    }
}
