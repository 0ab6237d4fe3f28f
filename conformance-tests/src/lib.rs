//! Conformance suite for outbox stores and publishers.

pub mod env;
