//! The node's own layers a template may boot instead of the base image
//! ([`vmon_proto::node::TemplateSpec::layer`]): `desktop`, the base tree plus an X desktop
//! (`vmon_image::desktop`), made once per base image and kept in the image cache.

use std::path::{Path, PathBuf};

use vmon_proto::node::{NodeError, LAYER_DESKTOP};

use super::{err, Node};

impl Node {
    /// A raw disk of `layer` in `dir` (`dir/rootfs.img`, for [`super::boot::BootDisk::NewRaw`],
    /// which moves it into the artifacts) and its size in MiB.
    pub(super) async fn layer_disk(
        &self,
        layer: &str,
        image: &vmon_image::Image,
        dir: &Path,
    ) -> Result<(PathBuf, u32), NodeError> {
        if layer != LAYER_DESKTOP {
            return Err(NodeError::InvalidArgument(format!(
                "{layer:?} is not a layer this node makes"
            )));
        }
        let t0 = std::time::Instant::now();
        let cached = vmon_image::desktop::desktop_disk(
            &self.cfg.data_dir,
            &self.recipe,
            image,
            self.cfg.progress.as_ref(),
        )
        .await
        .map_err(|e| err(e.context("making the desktop layer")))?;
        let path = dir.join("rootfs.img");
        let _ = std::fs::remove_file(&path);
        // The cached disk is read-only and never written (the template's overlay is above it):
        // a second name for it costs nothing; a copy only where a link cannot be made.
        if std::fs::hard_link(&cached, &path).is_err() {
            let out = tokio::process::Command::new("cp")
                .args(["--reflink=auto", "--sparse=always"])
                .arg(&cached)
                .arg(&path)
                .output()
                .await
                .map_err(|e| err(e.into()))?;
            if !out.status.success() {
                return Err(NodeError::Failed(format!(
                    "copying the desktop layer: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
        }
        tracing::info!(layer, secs = t0.elapsed().as_secs_f64(), "layer disk ready");
        Ok((path, vmon_image::desktop::DESKTOP_DISK_MB))
    }
}
