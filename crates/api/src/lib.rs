//! vmon-api: (placeholder, see docs/architecture.md)
