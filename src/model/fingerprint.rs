//! A fingerprint of the model's arithmetic: a hash of the exact bits of the logits that
//! a fixed, model-independent computation gives on this build, CPU and numerics.
//!
//! A long run (an evaluation of hours) writes its records over several processes, and
//! its answers are comparable only if every process computed the same floats. The
//! machine's CPU and the `numerics` name do not pin that down: a new build may change a
//! kernel's summation order, or a cache's reading order, and leave both as they were.
//! [`arithmetic_fingerprint`] runs the paths a run's answers go through (a chunked
//! prefill longer than the largest sliding window, so rings wrap; single decode steps;
//! a batched decode step over sequences of different lengths) and hashes every logit's
//! bits. The same fingerprint says the same arithmetic on those paths; a different one
//! says the records would not be reproduced, so a run refuses to continue them.
//!
//! The hash does not depend on the thread count (every row's sums run in a fixed order,
//! whatever thread runs them).

use sha2::{Digest, Sha256};

use crate::model::{argmax, step_batch, BatchStep, Interventions, Model, NoObserver, Session};
use crate::Result;

/// Decode steps after the long prompt.
const STEPS: usize = 3;
/// Prompt lengths of the sequences decoded beside it in one batched step.
const BATCHED: [usize; 2] = [5, 29];

/// The hex SHA-256 (first 16 digits) of the logits `(vocab,)` of: a prompt of
/// `max(chunk, largest window) + 40` deterministic token ids (fewer if the context is
/// shorter), its next three greedy tokens one at a time, two short prompts, then one
/// batched step of all three sequences.
pub fn arithmetic_fingerprint(model: &Model) -> Result<String> {
    let cfg = model.config();
    let window = (0..cfg.n_layers)
        .filter_map(|l| cfg.layer(l).window)
        .max()
        .unwrap_or(0);
    let long = (model.chunk().max(window) + 40).min(cfg.context_length.saturating_sub(STEPS + 2));
    let ids = |n: usize, salt: u64| -> Vec<u32> {
        (0..n as u64)
            .map(|i| ((i * 7919 + salt * 104_729 + 13) % cfg.vocab_size as u64) as u32)
            .collect()
    };
    let none = Interventions::new();
    let mut hash = Sha256::new();
    let mut absorb = |logits: &candle_core::Tensor| -> Result<u32> {
        let row: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        for v in &row {
            hash.update(v.to_bits().to_le_bytes());
        }
        argmax(logits)
    };

    let mut main = Session::new(model, long + STEPS + 1);
    let mut next = absorb(&main.prefill(&ids(long, 0), &mut NoObserver, &none)?)?;
    for _ in 0..STEPS {
        next = absorb(&main.step(next, &mut NoObserver, &none)?)?;
    }
    let mut others: Vec<(Session, u32)> = Vec::new();
    for (salt, &n) in BATCHED.iter().enumerate() {
        let mut s = Session::new(model, n + 1);
        let first = absorb(&s.prefill(&ids(n, salt as u64 + 1), &mut NoObserver, &none)?)?;
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
        absorb(&logits)?;
    }
    let digest = hash.finalize();
    Ok(digest[..8].iter().map(|b| format!("{b:02x}")).collect())
}
