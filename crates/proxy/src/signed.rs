//! Signed `/files` URLs that name no sandbox. With `E2B_SANDBOX_URL` set, an SDK's
//! `download_url()`/`upload_url()` are `<sandbox url>/files?path=…&signature=…`: the SDK
//! itself sends the sandbox in headers, but a browser or `urlopen` opening the URL sends
//! nothing but the query. The signature is a hash over the sandbox's envd access token, so it
//! names its sandbox after all: the proxy finds the one whose token makes it (envd then checks
//! it again, expiry included).

use base64::Engine;
use sha2::{Digest, Sha256};

/// What a signed `/files` request carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedFiles {
    path: String,
    username: String,
    operation: &'static str,
    signature: String,
    expiration: Option<String>,
}

impl SignedFiles {
    /// `Some` for a `/files` request with a `signature` (GET and HEAD read, POST and PUT
    /// write), parsed the way envd parses it.
    pub fn parse(method: &http::Method, uri: &http::Uri) -> Option<SignedFiles> {
        if uri.path() != "/files" {
            return None;
        }
        let operation = match *method {
            http::Method::GET | http::Method::HEAD => "read",
            http::Method::POST | http::Method::PUT => "write",
            _ => return None,
        };
        let (mut path, mut username, mut signature, mut expiration) =
            (String::new(), String::new(), None, None);
        for pair in uri
            .query()
            .unwrap_or("")
            .split('&')
            .filter(|p| !p.is_empty())
        {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = decode(v);
            match decode(k).as_str() {
                "path" => path = v,
                "username" => username = v,
                "signature" => signature = Some(v),
                "signature_expiration" => expiration = Some(v),
                _ => {}
            }
        }
        Some(SignedFiles {
            path,
            username,
            operation,
            signature: signature.filter(|s| !s.is_empty())?,
            expiration: expiration.filter(|e| !e.is_empty()),
        })
    }

    /// The signature as sent (`v1_…`).
    pub fn signature(&self) -> &str {
        &self.signature
    }

    /// Whether the sandbox with envd access token `token` made this signature.
    pub fn signed_with(&self, token: &str) -> bool {
        let mut raw = format!("{}:{}:{}:{token}", self.path, self.operation, self.username);
        if let Some(e) = &self.expiration {
            raw.push(':');
            raw.push_str(e);
        }
        let want = format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes()))
        );
        crate::constant_time_eq(want.as_bytes(), self.signature.as_bytes())
    }
}

/// `+` is a space, then `%XX` escapes (as envd decodes a query).
fn decode(s: &str) -> String {
    crate::percent_decode(&s.replace('+', " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sign(raw: &str) -> String {
        format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes()))
        )
    }

    #[test]
    fn finds_the_token_that_signed() {
        let sig = sign("/home/user/a b.txt:read:user:tok1:1700000000");
        let sig_q = sig.replace('+', "%2B").replace('/', "%2F");
        let uri: http::Uri = format!(
            "/files?path=%2Fhome%2Fuser%2Fa%20b.txt&username=user&signature={sig_q}&signature_expiration=1700000000"
        )
        .parse()
        .expect("uri");
        let s = SignedFiles::parse(&http::Method::GET, &uri).expect("signed");
        assert!(s.signed_with("tok1"));
        assert!(!s.signed_with("tok2"));
        // The same URL as an upload is another operation.
        let w = SignedFiles::parse(&http::Method::POST, &uri).expect("signed");
        assert!(!w.signed_with("tok1"));

        let no_exp = sign("/x:write::t");
        let uri: http::Uri = format!("/files?path=/x&signature={}", no_exp.replace('+', "%2B"))
            .parse()
            .expect("uri");
        assert!(SignedFiles::parse(&http::Method::POST, &uri)
            .expect("signed")
            .signed_with("t"));
    }

    #[test]
    fn only_signed_files_requests() {
        for (m, u) in [
            (http::Method::GET, "/files?path=/x"),
            (http::Method::GET, "/files?path=/x&signature="),
            (http::Method::GET, "/other?signature=v1_x"),
            (http::Method::DELETE, "/files?signature=v1_x"),
        ] {
            let uri: http::Uri = u.parse().expect("uri");
            assert_eq!(SignedFiles::parse(&m, &uri), None, "{m} {u}");
        }
    }
}
