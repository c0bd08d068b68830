//! vmon-kv: (placeholder, see docs/architecture.md)
