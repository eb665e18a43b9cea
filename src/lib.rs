//! headwise: find, predict and use the attention heads that retrieve.
//!
//! The foundation is [`model`], an instrumented forward pass over a real GGUF model in
//! which every attention head can be observed ([`model::Observer`]) and changed
//! ([`model::Interventions`]), and [`engine`], the reference engines it is checked
//! against ([`parity`]): mistral.rs for llama models, llama.cpp for Gemma 3.

// Bad input is an `Err`, never a panic: no `unwrap` or `expect` outside tests (an
// invariant headwise itself keeps is `Error::Internal`).
#![deny(clippy::unwrap_used, clippy::expect_used)]

pub mod bench;
pub mod engine;
pub mod error;
pub mod eval;
pub mod heads;
pub mod http;
pub mod lock;
pub mod metrics;
pub mod model;
pub mod parity;
pub mod perplexity;
mod plot;
pub mod policy;
pub mod probe;
pub mod provenance;
pub mod rag;
pub mod results;
mod rng;
pub mod serve;
pub mod tasks;
#[cfg(test)]
mod test_support;
pub mod wait;

pub use error::{Error, Result};
