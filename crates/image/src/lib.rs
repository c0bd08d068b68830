//! vmon-image: (placeholder, see docs/architecture.md)
