//! The node's own layers a template may boot instead of the base image
//! ([`vmon_proto::node::TemplateSpec::layer`]): `desktop`, the base tree plus an X desktop
//! (`vmon_image::desktop`): its tree made once per debootstrap tree, its disk once per base
//! image, both kept in the image cache.

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
        let path = dir.join("rootfs.img");
        vmon_image::desktop::desktop_disk(
            &self.cfg.data_dir,
            &self.recipe,
            image,
            self.cfg.progress.as_ref(),
            &path,
        )
        .await
        .map_err(|e| err(e.context("making the desktop layer")))?;
        tracing::info!(layer, secs = t0.elapsed().as_secs_f64(), "layer disk ready");
        Ok((path, vmon_image::desktop::DESKTOP_DISK_MB))
    }
}
