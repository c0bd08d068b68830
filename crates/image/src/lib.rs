//! Guest images: a Debian rootfs made by debootstrap, Debian's own cloud kernel and initramfs
//! taken from inside it, users `root` and `user`, envd installed as `/usr/local/bin/envd`, and a
//! sparse raw ext4 made with `mkfs.ext4 -d` (no loop mount, no root-only mount tricks).
//!
//! Images are cached under `<data>/images/<hash>/` by a hash of their recipe, so a second build
//! of the same recipe is a lookup. The debootstrap tree is cached separately (by the package part
//! of the recipe) because it is the slow step and does not change when envd does.
//!
//! Templates built `from_image(...)` get their rootfs from an OCI registry instead ([`oci`]):
//! pulled, flattened, given envd (with its own libraries), the kernel's modules and the `user`
//! account, and made into the same kind of disk.
//!
//! The `desktop` builtin template boots a layer of its own ([`desktop`]): the base tree plus an
//! X desktop from Debian's packages, made on the host into another raw disk.
//!
//! This crate only makes files; it never starts a VM. It runs as root and a registry image's
//! tree is a tenant's: it never reads or writes in one but through [`tree::Tree`], so no link
//! in it ever leads vmon to a host file.

mod apt;
mod build;
pub mod desktop;
pub mod oci;
pub mod registry_net;
mod rootfs;
pub mod tree;

pub use apt::{host_apt_source, AptSource};
pub use build::{build, build_with, find, Image, Manifest, Recipe};
