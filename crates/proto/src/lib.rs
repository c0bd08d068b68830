//! vmon-proto: (placeholder, see docs/architecture.md)
