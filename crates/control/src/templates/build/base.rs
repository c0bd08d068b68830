//! The build's first layer: the base build (`fromTemplate`'s, `base`, or an OCI image pulled
//! and booted), then, for a machine other than the base's, the base image booted fresh on it.

use std::collections::BTreeMap;

use vmon_proto::node::{BuildInfo, NodeError, OciImage, TemplateSpec};

use super::cache::Keys;
use super::log::Log;
use super::{fail, Failed};
use crate::ids;
use crate::records::{Team, TemplateBuild};
use crate::templates::image;
use crate::templates::steps::{BuildStart, BASE_IMAGE};
use crate::Control;

impl Control {
    /// The base build: `fromTemplate`'s, `base` for `e2bdev/base`, or any other `fromImage`
    /// pulled from its registry and booted (a layer keyed on the reference and its digest).
    pub(super) async fn base_of(
        &self,
        team: &Team,
        build: &TemplateBuild,
        start: &BuildStart,
        log: &Log,
    ) -> Result<BuildInfo, Failed> {
        if let Some(t) = &start.from_template {
            let (_, _, b) = self
                .resolve_template(team, t)
                .await
                .map_err(|e| fail("base", format!("template {t:?}: {e}")))?;
            return Ok(b);
        }
        match start.from_image.as_deref() {
            None | Some(BASE_IMAGE) | Some("e2bdev/base:latest") => {
                let (_, _, b) = self
                    .resolve_template(team, "base")
                    .await
                    .map_err(|e| fail("base", format!("the base template: {e}")))?;
                Ok(b)
            }
            Some(reference) => self.image_base(team, build, start, reference, log).await,
        }
    }

    /// The first layer of a build from an OCI image: the cached one for the digest the
    /// reference names now, or the image pulled and booted by the node.
    async fn image_base(
        &self,
        team: &Team,
        build: &TemplateBuild,
        start: &BuildStart,
        reference: &str,
        log: &Log,
    ) -> Result<BuildInfo, Failed> {
        let (mut oci, registry) = image::image(
            reference,
            start.from_image_registry.as_ref().map(|l| &l.0),
            &self.config.insecure_registries,
        )
        .map_err(|e| fail("base", e))?;
        oci.registry_allow = self.config.registry_allow.clone();
        log.info(
            Some("base"),
            format!("Resolving {reference} in the registry {registry}"),
        )
        .await;
        let digest = self
            .node
            .resolve_image(oci.clone())
            .await
            .map_err(|e| fail("base", e.to_string()))?;
        let key = image::base_key(reference, &digest, build.vcpus, build.memory_mb);
        if !start.force {
            if let Some(b) = self.cached(team, &key).await {
                log.info(Some("base"), format!("CACHED {reference} ({digest})"))
                    .await;
                return Ok(b);
            }
        }
        log.info(
            Some("base"),
            format!("Pulling {reference} ({digest}) and booting it"),
        )
        .await;
        oci.digest = Some(digest);
        let b = self
            .boot_base(build, build.disk_mb, Some(oci))
            .await
            .map_err(|e| fail("base", e.to_string()))?;
        self.remember(team, &key, &b).await;
        Ok(b)
    }

    /// Where a build with no step cached starts: the base itself, or, on a machine other than
    /// the base's, the base image booted fresh with it (a memory restore keeps its machine),
    /// a layer like any other.
    pub(super) async fn machine_base(
        &self,
        team: &Team,
        build: &TemplateBuild,
        start: &BuildStart,
        base: BuildInfo,
        keys: &Keys,
        log: &Log,
    ) -> Result<BuildInfo, Failed> {
        let shape_differs = start.from_template.is_none()
            && (base.vcpus != build.vcpus || base.memory_mb != build.memory_mb);
        if !shape_differs {
            return Ok(base);
        }
        if let Some(b) = self
            .cached(team, &keys.machine)
            .await
            .filter(|_| !start.force)
        {
            return Ok(b);
        }
        log.info(
            Some("base"),
            format!(
                "Booting the base image with {} vCPUs and {} MiB",
                build.vcpus, build.memory_mb
            ),
        )
        .await;
        let b = self
            .boot_base(build, build.disk_mb.max(base.disk_mb), None)
            .await
            .map_err(|e| fail("base", format!("booting the base image: {e}")))?;
        self.remember(team, &keys.machine, &b).await;
        Ok(b)
    }

    /// A cold boot on the build's machine of the node's base image, or of `image`'s disk,
    /// captured with nothing started in it.
    async fn boot_base(
        &self,
        build: &TemplateBuild,
        disk_mb: u32,
        image: Option<OciImage>,
    ) -> Result<BuildInfo, NodeError> {
        self.node
            .build_template(TemplateSpec {
                build_id: ids::build_id(),
                vcpus: build.vcpus,
                memory_mb: build.memory_mb,
                disk_mb,
                start_cmd: None,
                ready_cmd: None,
                warm_request: None,
                env_vars: BTreeMap::new(),
                image,
                layer: None,
            })
            .await
    }
}
