//! The access token and `/files` URL signatures.

use base64::Engine;
use http::{HeaderMap, Response, StatusCode};
use sha2::{Digest, Sha256};

use crate::agent::Agent;
use crate::connect::{self, Body};

/// Compares without leaking where the first difference is (only whether the lengths differ).
pub fn same(a: &[u8], b: &[u8]) -> bool {
    bool::from(subtle::ConstantTimeEq::ct_eq(a, b))
}

pub fn header_token(headers: &HeaderMap) -> Option<&str> {
    headers.get("x-access-token").and_then(|v| v.to_str().ok())
}

/// True if no token is set or the request carries it in `X-Access-Token`.
pub fn token_ok(agent: &Agent, headers: &HeaderMap) -> bool {
    match agent.token() {
        None => true,
        Some(t) => header_token(headers).is_some_and(|h| same(h.as_bytes(), t.as_bytes())),
    }
}

/// A 401 with the JSON body the SDKs parse (`{code, message}`).
pub fn unauthorized(message: &str) -> Response<Body> {
    connect::json_response(
        StatusCode::UNAUTHORIZED,
        &serde_json::json!({ "code": 401, "message": message }),
    )
}

/// `v1_` + unpadded standard base64 of SHA-256("path:operation:username:token[:expiration]").
pub fn signature(
    path: &str,
    operation: &str,
    username: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let mut raw = format!("{path}:{operation}:{username}:{token}");
    if let Some(e) = expiration {
        raw.push_str(&format!(":{e}"));
    }
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// What `/files` needs to check a signature.
pub struct FileAuth<'a> {
    pub path: &'a str,
    pub username: &'a str,
    pub signature: Option<&'a str>,
    pub expiration: Option<&'a str>,
}

/// `/files` accepts the token header or a valid, unexpired signature for the operation.
pub fn check_files(
    agent: &Agent,
    headers: &HeaderMap,
    q: &FileAuth<'_>,
    operation: &str,
) -> Result<(), Response<Body>> {
    let Some(token) = agent.token() else {
        return Ok(());
    };
    if let Some(h) = header_token(headers) {
        return if same(h.as_bytes(), token.as_bytes()) {
            Ok(())
        } else {
            Err(unauthorized("invalid access token"))
        };
    }
    let Some(sig) = q.signature else {
        return Err(unauthorized("missing access token or signature"));
    };
    let expiration = match q.expiration {
        None | Some("") => None,
        Some(e) => match e.parse::<i64>() {
            Ok(e) => Some(e),
            Err(_) => return Err(unauthorized("invalid signature expiration")),
        },
    };
    if let Some(e) = expiration {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        if e < now {
            return Err(unauthorized("signature is already expired"));
        }
    }
    let want = signature(q.path, operation, q.username, &token, expiration);
    if same(want.as_bytes(), sig.as_bytes()) {
        Ok(())
    } else {
        Err(unauthorized("invalid signature"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_formula() {
        let s = signature("/a", "read", "", "tok", None);
        assert!(s.starts_with("v1_"));
        assert!(!s.ends_with('='));
        assert_ne!(s, signature("/a", "write", "", "tok", None));
        assert_ne!(s, signature("/a", "read", "", "tok", Some(1)));
    }

    #[test]
    fn same_is_equality() {
        assert!(same(b"s3cret", b"s3cret"));
        assert!(same(b"", b""));
        for other in [&b"s3creT"[..], b"s3cre", b"s3crett", b""] {
            assert!(!same(b"s3cret", other), "{other:?}");
        }
    }
}
