//! headwise: find, predict and use the attention heads that retrieve.
//!
//! The foundation is [`model`], an instrumented forward pass over a real GGUF model in
//! which every attention head can be observed ([`model::Observer`]) and changed
//! ([`model::Interventions`]), and [`engine`], the reference engines it is checked
//! against ([`parity`]): mistral.rs for llama models, llama.cpp for Gemma 3.

pub mod bench;
pub mod engine;
pub mod error;
pub mod eval;
pub mod heads;
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

pub use error::{Error, Result};
