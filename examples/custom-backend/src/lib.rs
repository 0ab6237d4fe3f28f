#![doc = include_str!("../README.md")]

mod harness;
mod store;

pub use harness::VecHarness;
pub use store::{VecStore, VecTx};
