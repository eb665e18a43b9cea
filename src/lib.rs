//! headwise: find, predict and use the attention heads that retrieve.
//!
//! The foundation is [`model`], an instrumented forward pass over a real GGUF model in
//! which every attention head can be observed ([`model::Observer`]) and changed
//! ([`model::Interventions`]), and [`engine`], the mistral.rs reference engine it is
//! checked against ([`parity`]).

pub mod bench;
#[cfg(feature = "mistralrs")]
pub mod engine;
pub mod error;
pub mod model;
#[cfg(feature = "mistralrs")]
pub mod parity;
pub mod results;

pub use error::{Error, Result};
