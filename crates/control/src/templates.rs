//! Template builds: a build's steps checked and turned into guest commands (`steps`), registry
//! image references (`image`), the build run as node calls (`build`, `impl Control`), and the
//! collection of uploaded files no build names (`collect_files`). The routes are the api's.

pub mod build;
pub mod collect_files;
pub mod image;
pub mod steps;
