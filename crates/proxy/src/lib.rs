//! vmon-proxy: (placeholder, see docs/architecture.md)
