//! What the instrumented model is checked against: the reference engines, mistral.rs
//! (compiled in, same GGUF file; the only user of `mistralrs-core`) and llama.cpp (its
//! `llama-server` and `llama-perplexity` binaries, for architectures mistral.rs cannot
//! load from GGUF), and the parity checks between them and headwise ([`parity`],
//! [`perplexity`]).

pub mod llama_cpp;
#[cfg(feature = "mistralrs")]
pub mod mistralrs;
pub mod parity;
pub mod perplexity;

/// Greedy tokens with the margin each one won by.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GreedyTrace {
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Per step: largest minus second-largest logit.
    pub top2_gaps: Vec<f32>,
}
