//! A fingerprint of the model's arithmetic: a hash of the exact bits of the logits (and
//! attention probabilities) that a fixed, model-independent computation gives on this
//! build, CPU and numerics.
//!
//! A long run (an evaluation of hours) writes its records over several processes, and
//! its answers are comparable only if every process computed the same floats. The
//! machine's CPU and the `numerics` name do not pin that down: a new build may change a
//! kernel's summation order, or a cache's reading order, and leave both as they were.
//! [`arithmetic_fingerprint`] runs the paths answers go through and hashes every float
//! they give:
//! - plain generation: a chunked prefill longer than the largest sliding window (so
//!   rings wrap), single decode steps, a batched step over sequences of different
//!   lengths;
//! - what traces and head scoring run: a prefill and steps that return every head's
//!   attention probabilities;
//! - ablations: head outputs replaced, a query made uniform, a score bias;
//! - policies: a per-head cache whose stores alternate between full and a sink + window
//!   ring, with rows in 8-bit blocks, prefilled past the ring and decoded.
//!
//! The same fingerprint says the same arithmetic on those paths; a different one says
//! the records would not be reproduced, so a run refuses to continue them. The hash does
//! not depend on the thread count (every row's sums run in a fixed order, whatever thread
//! runs them).

use candle_core::Tensor;
use sha2::{Digest, Sha256};

use crate::model::{
    argmax, step_batch, BatchStep, HeadCache, Interventions, Model, NoObserver, Observer,
    OutputEdit, QueryEdit, Retention, RowFormat, Session, Wants,
};
use crate::Result;

/// Decode steps after each prompt.
const STEPS: usize = 3;
/// Prompt lengths of the sequences decoded beside the long one in one batched step.
const BATCHED: [usize; 2] = [5, 29];
/// Prompt length of the observed, edited and policy sequences.
const SHORT: usize = 40;
/// The ring of the policy sequence's streaming stores: shorter than [`SHORT`].
const RING: Retention = Retention::Stream {
    sink: 4,
    window: 16,
};

/// The hex SHA-256 (first 16 digits) of every logit `(vocab,)` and attention
/// probability the computations of the module's list give.
pub fn arithmetic_fingerprint(model: &Model) -> Result<String> {
    let mut hash = Fingerprint(Sha256::new());
    hash.plain(model)?;
    hash.observed(model)?;
    hash.edited(model)?;
    hash.policy(model)?;
    Ok(hash.0.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The running hash.
struct Fingerprint(Sha256);

impl Fingerprint {
    /// Hash every float of `t`.
    fn absorb(&mut self, t: &Tensor) -> Result<()> {
        for v in t.flatten_all()?.to_vec1::<f32>()? {
            self.0.update(v.to_bits().to_le_bytes());
        }
        Ok(())
    }

    /// Hash the logits `(1, vocab)`; the greedy next token.
    fn logits(&mut self, logits: &Tensor) -> Result<u32> {
        self.absorb(logits)?;
        argmax(logits)
    }

    /// `prompt` then [`STEPS`] greedy steps of `session`, each hashed.
    fn run(
        &mut self,
        session: &mut Session,
        prompt: &[u32],
        observer: &mut dyn Observer,
        edits: &Interventions,
    ) -> Result<u32> {
        let mut next = self.logits(&session.prefill(prompt, observer, edits)?)?;
        for _ in 0..STEPS {
            next = self.logits(&session.step(next, observer, edits)?)?;
        }
        Ok(next)
    }

    /// The long prompt and its steps, then one batched step beside two short prompts.
    fn plain(&mut self, model: &Model) -> Result<()> {
        let cfg = model.config();
        let window = (0..cfg.n_layers)
            .filter_map(|l| cfg.layer(l).window)
            .max()
            .unwrap_or(0);
        let long =
            (model.chunk().max(window) + 40).min(cfg.context_length.saturating_sub(STEPS + 2));
        let none = Interventions::new();
        let mut main = Session::new(model, long + STEPS + 1);
        let next = self.run(&mut main, &ids(model, long, 0), &mut NoObserver, &none)?;
        let mut others: Vec<(Session, u32)> = Vec::new();
        for (salt, &n) in BATCHED.iter().enumerate() {
            let mut s = Session::new(model, n + 1);
            let prompt = ids(model, n, salt as u64 + 1);
            let first = self.logits(&s.prefill(&prompt, &mut NoObserver, &none)?)?;
            others.push((s, first));
        }
        let tokens: Vec<[u32; 1]> = std::iter::once([next])
            .chain(others.iter().map(|(_, t)| [*t]))
            .collect();
        let mut observers: Vec<NoObserver> = tokens.iter().map(|_| NoObserver).collect();
        let mut batch: Vec<BatchStep> = std::iter::once(&mut main)
            .chain(others.iter_mut().map(|(s, _)| s))
            .zip(&tokens)
            .zip(observers.iter_mut())
            .map(|((session, t), observer)| BatchStep {
                session,
                tokens: t,
                logits: true,
                observer,
                edits: &none,
            })
            .collect();
        for logits in step_batch(&mut batch)?.into_iter().flatten() {
            self.absorb(&logits)?;
        }
        Ok(())
    }

    /// A prompt and its steps with every head's attention probabilities asked for (the
    /// kernels that return them), the probabilities hashed too.
    fn observed(&mut self, model: &Model) -> Result<()> {
        let mut probs = Probabilities(Sha256::new());
        let mut s = Session::new(model, SHORT + STEPS + 1);
        let prompt = ids(model, SHORT, 3);
        self.run(&mut s, &prompt, &mut probs, &Interventions::new())?;
        self.0.update(probs.0.finalize());
        Ok(())
    }

    /// A prompt and its steps with three ablations at once: head 0's output replaced in
    /// the first layer, the last head's query made uniform and a bias on head 0's scores
    /// in the last layer.
    fn edited(&mut self, model: &Model) -> Result<()> {
        let cfg = model.config();
        let last = cfg.n_layers - 1;
        let mut edits = Interventions::new();
        edits.set_output(0, 0, OutputEdit::Replace(vec![0.25; cfg.d_head]));
        edits.set_query(last, cfg.n_heads - 1, QueryEdit::Uniform);
        let bias = (0..SHORT + STEPS).map(|j| -((j % 3) as f32)).collect();
        edits.set_bias(last, 0, bias);
        let mut s = Session::new(model, SHORT + STEPS + 1);
        self.run(&mut s, &ids(model, SHORT, 4), &mut NoObserver, &edits)?;
        Ok(())
    }

    /// A prompt and its steps over a policy's cache: every second store a [`RING`], the
    /// others full, every row in 8-bit blocks.
    fn policy(&mut self, model: &Model) -> Result<()> {
        let cfg = model.config();
        let retention: Vec<Retention> = (0..cfg.n_layers * cfg.n_kv_heads)
            .map(|i| if i % 2 == 1 { RING } else { Retention::Full })
            .collect();
        let cache = HeadCache::new(cfg, &retention, RowFormat::Q8_0, SHORT + STEPS + 1)?;
        let mut s = Session::with_cache(model, cache);
        let prompt = ids(model, SHORT, 5);
        self.run(&mut s, &prompt, &mut NoObserver, &Interventions::new())?;
        Ok(())
    }
}

/// `n` token ids below the vocabulary, fixed by `salt`.
fn ids(model: &Model, n: usize, salt: u64) -> Vec<u32> {
    let vocab = model.config().vocab_size as u64;
    (0..n as u64)
        .map(|i| ((i * 7919 + salt * 104_729 + 13) % vocab) as u32)
        .collect()
}

/// Hashes the attention probabilities of every pass it observes.
struct Probabilities(Sha256);

impl Observer for Probabilities {
    fn wants(&self) -> Wants {
        Wants {
            attention: true,
            ..Wants::default()
        }
    }

    fn attention(&mut self, _layer: usize, probs: &Tensor) {
        // a tensor that cannot be read leaves its mark instead of its floats
        match probs.flatten_all().and_then(|t| t.to_vec1::<f32>()) {
            Ok(values) => values
                .iter()
                .for_each(|v| self.0.update(v.to_bits().to_le_bytes())),
            Err(_) => self.0.update(b"unreadable"),
        }
    }
}
