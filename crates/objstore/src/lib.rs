//! A small S3 client: requests presigned (AWS Signature V4) and listings and multipart answers
//! parsed by `rusty-s3`, sent over hyper with path-style URLs; the few operations builds need
//! (streamed put with multipart for large files, streamed and integrity-checked get, head,
//! delete, paged list, bucket creation). Tested against garage.
//!
//! Every buffered response body (listings, errors, small objects) is size-bounded; object
//! bodies stream to and from files. Small bodies carry a signed `Content-MD5`, so the store
//! refuses them altered; streamed ones are checked by the sha256 a download is given.

mod bench;
mod body;
mod client;
pub mod dev;
mod xml;

pub use bench::{bench, BenchResult};
pub use client::{ObjectInfo, ObjectStore, DEFAULT_PART_SIZE};

use serde::{Deserialize, Serialize};

/// Lower-case hex sha256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(<sha2::Sha256 as sha2::Digest>::digest(data))
}

/// Where the store is and how to sign for it.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectStoreConfig {
    /// `http(s)://host[:port]`: the S3 endpoint (path-style requests).
    pub endpoint: String,
    pub bucket: String,
    /// The signing region (garage: its `s3_region`).
    #[serde(default = "default_region")]
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    /// Put before every key (e.g. `vmon/`), so one bucket can hold several clusters.
    #[serde(default)]
    pub prefix: String,
}

fn default_region() -> String {
    "us-east-1".into()
}

impl std::fmt::Debug for ObjectStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStoreConfig")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl ObjectStoreConfig {
    /// From `VMON_S3_ENDPOINT`, `VMON_S3_BUCKET`, `VMON_S3_REGION`, `VMON_S3_ACCESS_KEY_ID`,
    /// `VMON_S3_SECRET_ACCESS_KEY`, `VMON_S3_PREFIX`: `None` when no endpoint is set, an error
    /// when one is set and another required variable is missing.
    pub fn from_env() -> anyhow::Result<Option<ObjectStoreConfig>> {
        Self::from_lookup(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// As [`Self::from_env`], reading variables through `get`.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<Option<ObjectStoreConfig>> {
        let Some(endpoint) = get("VMON_S3_ENDPOINT") else {
            return Ok(None);
        };
        let need = |k: &str| {
            get(k).ok_or_else(|| anyhow::anyhow!("VMON_S3_ENDPOINT is set but {k} is not"))
        };
        Ok(Some(ObjectStoreConfig {
            endpoint,
            bucket: need("VMON_S3_BUCKET")?,
            region: get("VMON_S3_REGION").unwrap_or_else(default_region),
            access_key_id: need("VMON_S3_ACCESS_KEY_ID")?,
            secret_access_key: need("VMON_S3_SECRET_ACCESS_KEY")?,
            prefix: get("VMON_S3_PREFIX").unwrap_or_default(),
        }))
    }
}

/// What an operation on the store failed with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("object {0} is not in the store")]
    NotFound(String),
    /// A download whose bytes do not hash to what the caller expected (nothing was kept).
    #[error("object {key} has sha256 {got}, expected {want}")]
    Integrity {
        key: String,
        want: String,
        got: String,
    },
    #[error("the store answered {status} to {what}: {code} {message}")]
    Status {
        what: String,
        status: u16,
        code: String,
        message: String,
    },
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::Other(e.into())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_from_the_environment_needs_every_credential_once_an_endpoint_is_set() {
        let none = ObjectStoreConfig::from_lookup(|_| None).expect("ok");
        assert!(none.is_none());
        let partial = ObjectStoreConfig::from_lookup(|k| {
            (k == "VMON_S3_ENDPOINT").then(|| "http://127.0.0.1:3900".to_string())
        });
        assert!(format!("{:#}", partial.expect_err("missing bucket")).contains("VMON_S3_BUCKET"));
        let full = ObjectStoreConfig::from_lookup(|k| {
            Some(match k {
                "VMON_S3_REGION" | "VMON_S3_PREFIX" => return None,
                _ => format!("v-{k}"),
            })
        })
        .expect("ok")
        .expect("some");
        assert_eq!(full.region, "us-east-1");
        assert_eq!(full.prefix, "");
        assert_eq!(full.bucket, "v-VMON_S3_BUCKET");
        let shown = format!("{full:?}");
        assert!(!shown.contains("SECRET"), "{shown}");
    }
}
