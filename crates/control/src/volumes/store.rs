//! Volumes kept in the cluster's object store (`volume_store = "s3"`, `VMON_VOLUME_STORE`).
//!
//! The nodes do the work (`crates/node/src/node/volume_store.rs`): each keeps a cache of a
//! volume it mounts, filled from the store before the mount and written back at pause, kill
//! and periodically. The api only marks the shares it sends, with the team's byte quota, and
//! keeps no copy itself: the content plane (`/volumecontent`) is not served for such volumes
//! (501, saying why, rather than answering from a directory no node reads). Destroying one
//! asks the nodes to delete its objects and their caches.

use vmon_proto::node::VolumeShare;

use crate::config::{Config, VolumeStore};
use crate::Control;

/// The fields of a share that say where the volume lives (the rest is the mount's).
pub fn share_fields(cfg: &Config) -> VolumeShare {
    match cfg.volume_store {
        VolumeStore::Local => VolumeShare::default(),
        VolumeStore::S3 => VolumeShare {
            object_store: true,
            max_bytes: cfg.quotas.max_volume_bytes,
            ..VolumeShare::default()
        },
    }
}

/// Why the content plane does not serve this server's volumes, if it does not.
pub fn content_refused(cfg: &Config) -> Option<&'static str> {
    (cfg.volume_store == VolumeStore::S3).then_some(
        "this server keeps volumes in the object store (volume_store = \"s3\"): there a \
         volume is one archive of its whole tree, which only the nodes that mount it read and \
         write back (last writer wins), and the api holds no copy, so one file cannot be read \
         or written without fetching or replacing the whole tree under those write-backs; \
         read and write such volumes from a sandbox that mounts them",
    )
}

impl Control {
    /// A destroyed volume of an object-store server: the nodes delete its objects and their
    /// caches. A failure is logged (the row is gone already; what is left is unreachable).
    pub async fn delete_store_volume(&self, volume_id: &str) {
        if self.config().volume_store != VolumeStore::S3 {
            return;
        }
        match self.node.delete_volume(volume_id).await {
            Ok(()) => tracing::info!(volume_id, "destroyed volume's objects deleted"),
            Err(e) => {
                tracing::warn!(volume_id, error = %e, "deleting a destroyed volume's objects failed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_say_where_volumes_live() {
        let mut cfg = Config::default();
        let local = share_fields(&cfg);
        assert!(!local.object_store);
        assert_eq!(local.max_bytes, 0);
        assert!(content_refused(&cfg).is_none());
        cfg.volume_store = "s3".parse().expect("s3");
        cfg.quotas.max_volume_bytes = 1234;
        let s3 = share_fields(&cfg);
        assert!(s3.object_store);
        assert_eq!(s3.max_bytes, 1234);
        assert!(content_refused(&cfg).is_some());
        assert!("nfs".parse::<VolumeStore>().is_err());
    }
}
