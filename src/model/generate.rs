//! Token generation with the instrumented model: sampling (greedy, temperature, top-p)
//! and a decode loop that observes exactly one forward step per generated token.
//!
//! When an observer wants something, the prompt is prefilled in chunks without
//! observation except for its last token, which runs as its own step: so step `t` of the
//! observer is the forward pass whose logits produced generated token `t` (what the
//! retrieval-head scorers need).
//!
//! [`generate_batch`] runs several unobserved generations at once, one batched decode
//! step for all of them per token, each with the tokens [`generate`] gives it alone.

use std::time::Instant;

use candle_core::Tensor;
use rand::{Rng, SeedableRng};

use crate::model::{
    argmax, step_batch, BatchStep, Interventions, Model, NoObserver, Observer, Session,
};
use crate::{Error, Result};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; `None` or `0` means greedy.
    pub temperature: Option<f64>,
    /// Nucleus sampling mass in `(0, 1]`; `None` keeps the whole distribution.
    pub top_p: Option<f64>,
    /// Seed of the sampling RNG.
    pub seed: u64,
}

impl Default for Sampling {
    /// Greedy.
    fn default() -> Self {
        Self {
            temperature: None,
            top_p: None,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Reject NaN and out-of-range values.
    pub fn validate(&self) -> Result<()> {
        if let Some(t) = self.temperature {
            if !(t.is_finite() && t >= 0.0) {
                return Err(Error::invalid("temperature", format!("{t} (must be >= 0)")));
            }
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(Error::invalid("top-p", format!("{p} (must be in (0, 1])")));
            }
        }
        Ok(())
    }
}

/// Draws tokens from logits.
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    rng: rand::rngs::StdRng,
}

impl Sampler {
    /// The argmax of every step.
    pub fn greedy() -> Self {
        Self {
            sampling: Sampling::default(),
            rng: rand::rngs::StdRng::seed_from_u64(0),
        }
    }

    /// A sampler seeded from `sampling.seed`.
    pub fn new(sampling: Sampling) -> Result<Self> {
        sampling.validate()?;
        Ok(Self {
            sampling,
            rng: rand::rngs::StdRng::seed_from_u64(sampling.seed),
        })
    }

    /// Next token from logits `(vocab,)` or `(1, vocab)`.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let temp = match self.sampling.temperature {
            Some(t) if t > 0.0 => t,
            _ => return argmax(logits),
        };
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, (((l - max) as f64) / temp).exp()))
            .collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total: f64 = probs.iter().map(|p| p.1).sum();
        let keep = match self.sampling.top_p {
            Some(p) => {
                let mut acc = 0.0;
                probs
                    .iter()
                    .position(|x| {
                        acc += x.1 / total;
                        acc >= p
                    })
                    .map_or(probs.len(), |i| i + 1)
            }
            None => probs.len(),
        };
        probs.truncate(keep);
        let mass: f64 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.random::<f64>() * mass;
        for &(id, p) in &probs {
            if r < p {
                return Ok(id);
            }
            r -= p;
        }
        Ok(probs.last().map_or(0, |p| p.0))
    }
}

/// Options of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenerateOptions {
    /// Tokens to generate at most (at least 1).
    pub max_new: usize,
    /// Token choice.
    pub sampling: Sampling,
    /// Token ids that end the generation (EOS, end of turn); the stop token is kept in
    /// the output.
    pub stop: Vec<u32>,
    /// The prompt's first `n` tokens are its context, the rest its question. A
    /// token-eviction policy then presses the context alone and runs the question over
    /// what it kept (kvpress's query-agnostic protocol); `None`: it presses the whole
    /// prompt but its last token. Other policies and plain generation ignore it.
    pub context_len: Option<usize>,
}

impl GenerateOptions {
    /// Check a request of `prompt` tokens against these options and a context of
    /// `context` tokens: a non-empty prompt, at least one new token, and room for both.
    pub fn check(&self, prompt: usize, context: usize) -> Result<()> {
        if prompt == 0 {
            return Err(Error::invalid("prompt", "empty (no tokens)"));
        }
        if self.max_new == 0 {
            return Err(Error::invalid("max-tokens", "0 (must be at least 1)"));
        }
        if prompt.saturating_add(self.max_new) > context {
            return Err(Error::ContextOverflow {
                prompt,
                max_new: self.max_new,
                context,
            });
        }
        Ok(())
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was generated.
    Stop,
    /// `max_new` tokens were generated.
    Length,
    /// The caller's callback asked to stop.
    Cancelled,
}

/// The result of [`generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub stop: StopReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Seconds spent on the prompt (up to the first generated token).
    pub prefill_secs: f64,
    /// Seconds spent on the remaining decode steps.
    pub decode_secs: f64,
}

impl Generation {
    /// Prompt tokens per second.
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    /// Decode steps (after the first token) per second.
    pub fn decode_tok_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// Generate from `prompt` into a fresh cache. `observer` sees one forward call per
/// generated token; `edits` apply to the prompt and every step. `on_token` is called
/// with each new token and the logits `(1, vocab)` it was drawn from, and may return
/// `false` to stop.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    opts: &GenerateOptions,
    observer: &mut dyn Observer,
    edits: &Interventions,
    on_token: &mut dyn FnMut(u32, &Tensor) -> bool,
) -> Result<Generation> {
    let cfg = model.config();
    opts.check(prompt.len(), cfg.context_length)?;
    let mut session =
        Session::new(model, prompt.len() + opts.max_new).with_sampling(opts.sampling)?;
    let t0 = Instant::now();
    // With an observer the prompt's last token runs as its own step, so that every
    // observed step produces exactly one generated token. Without one the prompt is
    // prefilled whole, as mistral.rs does (in reference numerics the floats then match).
    let split = if observer.wants().none() { 0 } else { 1 };
    let (head, last) = prompt.split_at(prompt.len() - split);
    let mut logits = if last.is_empty() {
        session.prefill(head, observer, edits)?
    } else {
        if !head.is_empty() {
            session.prefill(head, &mut NoObserver, edits)?;
        }
        session.prefill(last, observer, edits)?
    };
    let mut tokens = Vec::with_capacity(opts.max_new);
    let mut prefill_secs = 0.0;
    let mut t1 = Instant::now();
    let stop = loop {
        let next = session.sample(&logits)?;
        if tokens.is_empty() {
            prefill_secs = t0.elapsed().as_secs_f64();
            t1 = Instant::now();
        }
        tokens.push(next);
        if !on_token(next, &logits) {
            break StopReason::Cancelled;
        }
        if opts.stop.contains(&next) {
            break StopReason::Stop;
        }
        if tokens.len() == opts.max_new {
            break StopReason::Length;
        }
        logits = session.step(next, observer, edits)?;
    };
    Ok(Generation {
        tokens,
        stop,
        prompt_tokens: prompt.len(),
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
    })
}

/// One sequence of a [`generate_batch`] while it runs.
struct Running<'m, 'e> {
    session: Session<'m>,
    observer: NoObserver,
    edits: &'e Interventions,
    /// The logits the next token is drawn from.
    logits: Tensor,
    tokens: Vec<u32>,
    stop: Option<StopReason>,
    prompt_tokens: usize,
    prefill_secs: f64,
    decode_secs: f64,
}

/// Generate from several prompts, each under its own `edits` into its own fresh cache,
/// decoding them together: each prompt is prefilled alone (whole, as [`generate`] does
/// without an observer), then every unfinished sequence advances by one token per
/// batched step ([`step_batch`]: the weights read once per step for all of them). Each
/// sequence's tokens, and the logits `(1, vocab)` they were drawn from, are the same
/// bits as [`generate`]'s with [`NoObserver`] and the same options, whatever else is in
/// the batch. `on_token(i, token, logits)` is called with sequence `i`'s tokens and may
/// return `false` to stop that sequence alone. One [`Generation`] per job, in order;
/// its `decode_secs` is the batch's wall time until that sequence ended.
pub fn generate_batch(
    model: &Model,
    jobs: &[(&[u32], &Interventions)],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(usize, u32, &Tensor) -> bool,
) -> Result<Vec<Generation>> {
    let cfg = model.config();
    for (prompt, _) in jobs {
        opts.check(prompt.len(), cfg.context_length)?;
    }
    let mut seqs = Vec::with_capacity(jobs.len());
    for &(prompt, edits) in jobs {
        let t0 = Instant::now();
        let mut session =
            Session::new(model, prompt.len() + opts.max_new).with_sampling(opts.sampling)?;
        let logits = session.prefill(prompt, &mut NoObserver, edits)?;
        seqs.push(Running {
            session,
            observer: NoObserver,
            edits,
            logits,
            tokens: Vec::with_capacity(opts.max_new),
            stop: None,
            prompt_tokens: prompt.len(),
            prefill_secs: t0.elapsed().as_secs_f64(),
            decode_secs: 0.0,
        });
    }
    let t1 = Instant::now();
    loop {
        for (i, s) in seqs.iter_mut().enumerate() {
            if s.stop.is_some() {
                continue;
            }
            let next = s.session.sample(&s.logits)?;
            s.tokens.push(next);
            s.stop = if !on_token(i, next, &s.logits) {
                Some(StopReason::Cancelled)
            } else if opts.stop.contains(&next) {
                Some(StopReason::Stop)
            } else if s.tokens.len() == opts.max_new {
                Some(StopReason::Length)
            } else {
                None
            };
            if s.stop.is_some() {
                s.decode_secs = t1.elapsed().as_secs_f64();
            }
        }
        let mut batch: Vec<BatchStep<'_, '_>> = seqs
            .iter_mut()
            .filter(|s| s.stop.is_none())
            .map(|s| BatchStep {
                session: &mut s.session,
                tokens: &s.tokens[s.tokens.len() - 1..],
                logits: true,
                observer: &mut s.observer,
                edits: s.edits,
            })
            .collect();
        if batch.is_empty() {
            break;
        }
        let logits = step_batch(&mut batch)?;
        drop(batch);
        let live = seqs.iter_mut().filter(|s| s.stop.is_none());
        for (s, l) in live.zip(logits) {
            s.logits = l.ok_or(Error::Internal("a step's logits"))?;
        }
    }
    Ok(seqs
        .into_iter()
        .map(|s| Generation {
            tokens: s.tokens,
            stop: s.stop.unwrap_or(StopReason::Length),
            prompt_tokens: s.prompt_tokens,
            prefill_secs: s.prefill_secs,
            decode_secs: s.decode_secs,
        })
        .collect())
}

/// Entropy (nats) of the softmax of `logits`.
pub fn entropy(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let log_z = z.ln();
    -logits
        .iter()
        .map(|&l| {
            let lp = l - max - log_z;
            lp.exp() * lp
        })
        .sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn greedy_takes_the_argmax_and_top_p_keeps_the_nucleus() {
        let logits = Tensor::new(&[0.0f32, 3.0, 1.0, 2.9], &Device::Cpu).unwrap();
        let mut greedy = Sampler::new(Sampling::default()).unwrap();
        assert_eq!(greedy.sample(&logits).unwrap(), 1);
        // With top-p tiny only the most likely token survives, whatever the RNG draws.
        let mut nucleus = Sampler::new(Sampling {
            temperature: Some(1.0),
            top_p: Some(1e-6),
            seed: 7,
        })
        .unwrap();
        for _ in 0..20 {
            assert_eq!(nucleus.sample(&logits).unwrap(), 1);
        }
    }

    #[test]
    fn temperature_sampling_follows_the_distribution() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]
        let logits = Tensor::new(&[0.0f32, 3f32.ln()], &Device::Cpu).unwrap();
        let mut s = Sampler::new(Sampling {
            temperature: Some(1.0),
            top_p: None,
            seed: 1,
        })
        .unwrap();
        let ones = (0..4000)
            .filter(|_| s.sample(&logits).unwrap() == 1)
            .count();
        let frac = ones as f64 / 4000.0;
        assert!((frac - 0.75).abs() < 0.03, "{frac}");
    }

    #[test]
    fn invalid_sampling_is_rejected() {
        let bad = Sampling {
            temperature: Some(f64::NAN),
            ..Sampling::default()
        };
        assert!(Sampler::new(bad).is_err());
        let bad = Sampling {
            top_p: Some(1.5),
            ..Sampling::default()
        };
        assert!(Sampler::new(bad).is_err());
    }
}
