//! AWS Signature Version 4 for S3 requests sent with path-style URLs.
//!
//! The signature covers the method, the path, the query, the `host`, `x-amz-content-sha256`
//! and `x-amz-date` headers (plus any extra ones the caller signs) and the payload's hash,
//! which is either the body's sha256 or the literal `UNSIGNED-PAYLOAD` for streamed bodies.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The payload hash of a body that is streamed and not hashed up front.
pub const UNSIGNED_PAYLOAD: &str = "UNSIGNED-PAYLOAD";

/// The credentials and scope a request is signed with.
#[derive(Clone)]
pub struct Signer {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub region: String,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("access_key_id", &self.access_key_id)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

/// What is signed of one request.
pub struct ToSign<'a> {
    pub method: &'a str,
    /// The URI path, already encoded (see [`encode_path`]).
    pub path: &'a str,
    /// Query parameters, not encoded.
    pub query: &'a [(String, String)],
    /// `host[:port]` as sent.
    pub host: &'a str,
    /// Further headers to sign (lower-case names).
    pub headers: &'a [(String, String)],
    /// The body's lower-case hex sha256, or [`UNSIGNED_PAYLOAD`].
    pub payload_hash: &'a str,
    /// `YYYYMMDDTHHMMSSZ`.
    pub amz_date: &'a str,
}

/// Lower-case hex sha256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    // An HMAC takes a key of any length.
    let mut m = match Hmac::<Sha256>::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    };
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// RFC 3986 percent-encoding of everything but the unreserved characters (and `/` when
/// `keep_slash`), as SigV4's canonical forms want it.
pub fn uri_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            b'/' if keep_slash => out.push('/'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The encoded path of `/<bucket>/<key>` (or `/<bucket>` when `key` is empty).
pub fn encode_path(bucket: &str, key: &str) -> String {
    if key.is_empty() {
        format!("/{}", uri_encode(bucket, false))
    } else {
        format!("/{}/{}", uri_encode(bucket, false), uri_encode(key, true))
    }
}

/// The encoded, sorted query string (also what is sent, so both agree).
pub fn canonical_query(query: &[(String, String)]) -> String {
    let mut q: Vec<(String, String)> = query
        .iter()
        .map(|(k, v)| (uri_encode(k, false), uri_encode(v, false)))
        .collect();
    q.sort();
    q.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

impl Signer {
    /// The `Authorization` header's value for `req`.
    pub fn authorization(&self, req: &ToSign<'_>) -> String {
        let mut headers: Vec<(String, String)> = vec![
            ("host".into(), req.host.trim().to_string()),
            ("x-amz-content-sha256".into(), req.payload_hash.to_string()),
            ("x-amz-date".into(), req.amz_date.to_string()),
        ];
        headers.extend(
            req.headers
                .iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_string())),
        );
        headers.sort();
        let signed: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
        let signed = signed.join(";");
        let canonical_headers: String = headers.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
        let canonical = format!(
            "{}\n{}\n{}\n{}\n{}\n{}",
            req.method,
            req.path,
            canonical_query(req.query),
            canonical_headers,
            signed,
            req.payload_hash
        );
        let date = &req.amz_date[..req.amz_date.len().min(8)];
        let scope = format!("{date}/{}/s3/aws4_request", self.region);
        let string_to_sign = format!(
            "AWS4-HMAC-SHA256\n{}\n{scope}\n{}",
            req.amz_date,
            sha256_hex(canonical.as_bytes())
        );
        let k_date = hmac(
            format!("AWS4{}", self.secret_access_key).as_bytes(),
            date.as_bytes(),
        );
        let k_region = hmac(&k_date, self.region.as_bytes());
        let k_service = hmac(&k_region, b"s3");
        let k_signing = hmac(&k_service, b"aws4_request");
        let signature = hex::encode(hmac(&k_signing, string_to_sign.as_bytes()));
        format!(
            "AWS4-HMAC-SHA256 Credential={}/{scope},SignedHeaders={signed},Signature={signature}",
            self.access_key_id
        )
    }
}

/// `now` as SigV4's `x-amz-date`.
pub fn amz_date(now: time::OffsetDateTime) -> String {
    let now = now.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example_signer() -> Signer {
        // The example credentials of AWS's "Signature Calculations for the Authorization
        // Header" page of the S3 API reference.
        Signer {
            access_key_id: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            region: "us-east-1".into(),
        }
    }

    #[test]
    fn the_documented_get_object_example_signs_to_the_documented_signature() {
        // AWS's worked example: GET /test.txt of examplebucket, virtual-hosted, with
        // `Range: bytes=0-9`, an empty body, at 2013-05-24T00:00:00Z. The page states the
        // resulting signature f0e8bdb8…bdb41.
        let s = example_signer();
        let auth = s.authorization(&ToSign {
            method: "GET",
            path: "/test.txt",
            query: &[],
            host: "examplebucket.s3.amazonaws.com",
            headers: &[("range".into(), "bytes=0-9".into())],
            payload_hash: &sha256_hex(b""),
            amz_date: "20130524T000000Z",
        });
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,\
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,\
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
    }

    #[test]
    fn the_empty_body_hash_is_sha256_of_nothing() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn paths_and_queries_are_encoded_as_sigv4_wants() {
        assert_eq!(encode_path("b", "a b/c+d~e"), "/b/a%20b/c%2Bd~e");
        assert_eq!(encode_path("b", ""), "/b");
        let q = vec![
            ("prefix".to_string(), "x/y".to_string()),
            ("list-type".to_string(), "2".to_string()),
            ("uploads".to_string(), String::new()),
        ];
        assert_eq!(canonical_query(&q), "list-type=2&prefix=x%2Fy&uploads=");
    }

    #[test]
    fn amz_dates_are_utc_basic_format() {
        let t = time::macros::datetime!(2013-05-24 00:00:00 UTC);
        assert_eq!(amz_date(t), "20130524T000000Z");
        let t = time::macros::datetime!(2026-12-02 03:04:05 +02:00);
        assert_eq!(amz_date(t), "20261202T010405Z");
    }
}
