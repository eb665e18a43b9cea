//! One sequence being decoded: the model, the sequence's cache and, through the cache,
//! its position, and the state of its token choice. Every generation path of the crate
//! (plain and policy generation, scoring, traces, RAG segments, parity, benchmarks) runs
//! the model through a [`Session`]: [`Session::prefill`] for the prompt,
//! [`Session::step`] for each new token, [`Session::feed`] when a caller needs the logits
//! of every position, and [`Session::sample`] to draw the next token from a step's logits
//! (greedy unless the session was made [`Session::with_sampling`]).
//!
//! The cache is a [`HeadCache`]: plain ([`Session::new`], every head keeps every
//! position) or the per-head cache of a policy ([`Session::with_cache`]). [`step_batch`]
//! advances several sessions in one pass (continuous batching), by one token each or,
//! for a session prefilling its prompt, by several run as steps of their own; each
//! session's logits are the same as its own [`Session::step`]s would give.

use candle_core::Tensor;

use crate::model::transformer::DecodeRow;
use crate::model::{HeadCache, Interventions, Logits, Model, Observer, Sampler, Sampling};
use crate::{Error, Result};

/// A sequence over `model` with its cache and its sampler.
pub struct Session<'m> {
    model: &'m Model,
    cache: HeadCache,
    sampler: Sampler,
}

impl<'m> Session<'m> {
    /// An empty sequence with a plain cache for `capacity` positions.
    pub fn new(model: &'m Model, capacity: usize) -> Self {
        Self::with_cache(model, HeadCache::plain(model.config(), capacity))
    }

    /// A sequence that continues from what `cache` holds, choosing tokens greedily.
    pub fn with_cache(model: &'m Model, cache: HeadCache) -> Self {
        Self {
            model,
            cache,
            sampler: Sampler::greedy(),
        }
    }

    /// The same session choosing tokens by `sampling` (its RNG seeded from
    /// `sampling.seed`); an invalid temperature or top-p is an error.
    pub fn with_sampling(mut self, sampling: Sampling) -> Result<Self> {
        self.sampler = Sampler::new(sampling)?;
        Ok(self)
    }

    /// The next token, drawn from `logits` `(1, vocab)` or `(vocab,)` (a step's output),
    /// advancing the session's sampling RNG.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        self.sampler.sample(logits)
    }

    /// The model.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// The cache.
    pub fn cache(&self) -> &HeadCache {
        &self.cache
    }

    /// The cache, to change what it keeps (a policy's top-k or active heads).
    pub fn cache_mut(&mut self) -> &mut HeadCache {
        &mut self.cache
    }

    /// The cache, ending the session.
    pub fn into_cache(self) -> HeadCache {
        self.cache
    }

    /// Positions processed so far.
    pub fn position(&self) -> usize {
        self.cache.len()
    }

    /// Run `tokens` and return the logits of the rows `logits` asks for.
    pub fn feed(
        &mut self,
        tokens: &[u32],
        logits: Logits,
        observer: &mut dyn Observer,
        edits: &Interventions,
    ) -> Result<Tensor> {
        self.model
            .forward(tokens, &mut self.cache, logits, observer, edits)
    }

    /// Run a prompt (or part of one) in chunks; logits `(1, vocab)` of its last position.
    pub fn prefill(
        &mut self,
        tokens: &[u32],
        observer: &mut dyn Observer,
        edits: &Interventions,
    ) -> Result<Tensor> {
        self.feed(tokens, Logits::Last, observer, edits)
    }

    /// Run one token; its logits `(1, vocab)`.
    pub fn step(
        &mut self,
        token: u32,
        observer: &mut dyn Observer,
        edits: &Interventions,
    ) -> Result<Tensor> {
        self.feed(&[token], Logits::Last, observer, edits)
    }
}

/// One session's part of a [`step_batch`]: the tokens it runs (one for a decode step;
/// several for a part of its prompt, each run as a step of its own), whether it wants
/// the last one's logits, and its own observer and edits.
pub struct BatchStep<'s, 'm> {
    pub session: &'s mut Session<'m>,
    pub tokens: &'s [u32],
    pub logits: bool,
    pub observer: &'s mut dyn Observer,
    pub edits: &'s Interventions,
}

/// Run the tokens of every session in `batch` in one forward pass (the weights read
/// once for all of them); per session, in order, the logits `(1, vocab)` of its last
/// token where it asked for them, bit-identical to what its own [`Session::step`] of
/// each token in turn gives, whatever else is in the batch. The sessions must run the
/// same model.
pub fn step_batch(batch: &mut [BatchStep<'_, '_>]) -> Result<Vec<Option<Tensor>>> {
    let Some(model) = batch.first().map(|b| b.session.model) else {
        return Ok(Vec::new());
    };
    if batch.iter().any(|b| !std::ptr::eq(b.session.model, model)) {
        return Err(Error::invalid("batch", "sessions of different models"));
    }
    let mut rows: Vec<DecodeRow<'_>> = batch
        .iter_mut()
        .map(|b| DecodeRow {
            cache: &mut b.session.cache,
            tokens: b.tokens,
            logits: b.logits,
            observer: &mut *b.observer,
            edits: b.edits,
        })
        .collect();
    model.decode_batch(&mut rows)
}
