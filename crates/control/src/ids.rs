//! Identifiers and secrets: sandbox ids, execution ids, access tokens, API keys.

use rand::Rng;
use sha2::{Digest, Sha256};

const LOWER_ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

/// `n` characters of `[a-z0-9]` from the OS-seeded thread RNG.
pub fn random_lower(n: usize) -> String {
    let mut rng = rand::thread_rng();
    (0..n)
        .map(|_| LOWER_ALNUM[rng.gen_range(0..LOWER_ALNUM.len())] as char)
        .collect()
}

/// `i` followed by 20 characters of `[a-z0-9]`.
pub fn sandbox_id() -> String {
    format!("i{}", random_lower(20))
}

pub fn execution_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

pub fn template_id() -> String {
    random_lower(20)
}

pub fn build_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// 32 random bytes, hex.
pub fn token() -> String {
    let bytes: [u8; 32] = rand::thread_rng().gen();
    hex::encode(bytes)
}

/// A new API key: `e2b_` and 40 hex characters, like E2B's.
pub fn api_key() -> String {
    let bytes: [u8; 20] = rand::thread_rng().gen();
    format!("e2b_{}", hex::encode(bytes))
}

/// What the store keeps of a key: SHA-256, hex.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.trim().as_bytes()))
}

/// The part of a key shown in lists.
pub fn mask_key(key: &str) -> String {
    let head: String = key.chars().take(10).collect();
    format!("{head}…")
}

/// Whether `id` could be one of ours (cheap check before any lookup).
pub fn plausible_sandbox_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_have_the_upstream_shape() {
        for _ in 0..100 {
            let id = sandbox_id();
            assert_eq!(id.len(), 21);
            assert!(id.starts_with('i'));
            assert!(id[1..]
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()));
        }
    }

    #[test]
    fn keys_hash_stably() {
        let k = api_key();
        assert!(k.starts_with("e2b_") && k.len() == 44);
        assert_eq!(hash_key(&k), hash_key(&k));
        assert_ne!(hash_key(&k), hash_key(&api_key()));
    }
}
