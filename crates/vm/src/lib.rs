//! vmon-vm: (placeholder, see docs/architecture.md)
