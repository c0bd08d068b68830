//! vmon-store: (placeholder, see docs/architecture.md)
