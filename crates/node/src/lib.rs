//! vmon-node: (placeholder, see docs/architecture.md)
