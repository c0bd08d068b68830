//! envd: the in-guest agent.
