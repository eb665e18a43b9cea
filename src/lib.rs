//! headwise: find, predict and use the attention heads that retrieve.
//!
//! The crate is layered; a module imports only from the layers below it (checked by
//! `tests/layering.rs`):
//!
//! 1. the foundations: [`error`], [`artifact`], [`provenance`], [`lock`], [`wait`],
//!    [`http`], [`metrics`], [`synthetic`];
//! 2. [`model`]: an instrumented forward pass over a real GGUF model in which every
//!    attention head can be observed ([`model::Observer`]) and changed
//!    ([`model::Interventions`]), with its kernels, caches and tokenizer;
//! 3. [`policy`] (which heads keep their KV memory, from [`policy::ranking`] files or a
//!    [`probe`]) and [`probe`] inference;
//! 4. [`rag`] (DRAGIN-style retrieval) and [`serve`] (the OpenAI-compatible server);
//! 5. [`reference`](mod@reference): mistral.rs and llama.cpp, and the parity checks against them;
//! 6. [`lab`]: the experiments (head scoring, traces, tasks and datasets, probe training,
//!    evaluations, benchmarks), above everything and imported by nothing but the CLI.

// Bad input is an `Err`, never a panic: no `unwrap` or `expect` outside tests (an
// invariant headwise itself keeps is `Error::Internal`).
#![deny(clippy::unwrap_used, clippy::expect_used)]

pub mod artifact;
pub mod error;
pub mod http;
pub mod lock;
pub mod metrics;
pub mod provenance;
pub mod results;
mod rng;
pub mod synthetic;
pub mod wait;

pub mod model;

pub mod policy;
pub mod probe;

pub mod rag;
pub mod serve;

pub mod reference;

pub mod lab;

#[cfg(test)]
mod test_support;

pub use error::{Error, Result};
