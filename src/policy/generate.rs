//! Generation under a [`Plan`]: prefill (streaming, or full then evict), then one decode
//! step per token over the per-head cache, with the dynamic head choice made before
//! every step, and the memory it took.
//!
//! The prompt's last token runs as the first decode step, so every step (including the
//! one that yields the first token) is a single-query pass: the probe of a dynamic
//! policy sees the final hidden state of the step before (for the first step, the
//! prompt's second-to-last position).

use std::time::Instant;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::model::{
    last_row, GenerateOptions, Generation, HeadCache, Interventions, KvBytes, KvCache, Model,
    Observer, Sampler, Session, StopReason, Tee, Wants,
};
use crate::policy::evict::{Observe, Observed};
use crate::policy::plan::{DynamicSource, Plan, Prefill};
use crate::{Error, Result};

/// A prompt prefilled with the plain (full) cache, all but its last token: shared by
/// every `full_then_evict` policy run on the same prompt with the same edits.
#[derive(Debug, Clone)]
pub struct Prefilled {
    kv: KvCache,
    /// The edits the prompt ran with.
    edits: Interventions,
    /// Final hidden state `(d_model,)` of the last prefilled position.
    hidden: Option<Vec<f32>>,
    /// The prompt.
    prompt: Vec<u32>,
    /// Attention sums of the observed positions, for presses that read attention.
    attention: Option<Observed>,
    secs: f64,
}

impl Prefilled {
    /// Run `prompt[..len - 1]` through the model with full attention and `edits`;
    /// `capacity` sizes the cache (prompt plus new tokens).
    pub fn run(
        model: &Model,
        edits: &Interventions,
        prompt: &[u32],
        capacity: usize,
    ) -> Result<Self> {
        Self::observed(model, edits, prompt, capacity, &[])
    }

    /// [`Prefilled::run`], with the attention each of `observes` names summed over its
    /// queries, for the presses that read it: the positions before the first observed
    /// query run as one pass, the rest as another.
    pub fn observed(
        model: &Model,
        edits: &Interventions,
        prompt: &[u32],
        capacity: usize,
        observes: &[Observe],
    ) -> Result<Self> {
        if prompt.is_empty() {
            return Err(Error::invalid("prompt", "empty (no tokens)"));
        }
        let t0 = Instant::now();
        let mut session = Session::new(model, capacity);
        let mut obs = LastHidden::new(true);
        let head = &prompt[..prompt.len() - 1];
        let mut sums = Observed::new(model.config(), head.len(), observes);
        let from = sums.first();
        if from > 0 {
            session.prefill(&head[..from], &mut obs, edits)?;
        }
        if from < head.len() {
            session.prefill(&head[from..], &mut Tee(&mut obs, &mut sums), edits)?;
        }
        Ok(Self {
            kv: session.into_cache(),
            edits: edits.clone(),
            hidden: obs.hidden,
            prompt: prompt.to_vec(),
            attention: (from < head.len()).then_some(sums),
            secs: t0.elapsed().as_secs_f64(),
        })
    }

    /// Whether this prefill can stand in for `need`'s under `edits`.
    fn serves(&self, prompt: &[u32], need: PrefillNeed, edits: &Interventions) -> bool {
        let n = need.len - 1;
        self.prompt == prompt[..need.len]
            && self.edits == *edits
            && (need.observe == Observe::Keys
                || self
                    .attention
                    .as_ref()
                    .is_some_and(|a| a.covers(need.observe, n)))
    }

    /// The plain cache holding every prompt position but the last.
    pub fn cache(&self) -> &KvCache {
        &self.kv
    }

    /// Bytes the plain cache allocated for the prefill.
    pub fn bytes(&self) -> usize {
        self.kv.allocated_bytes()
    }
}

/// What a `full_then_evict` plan prefills before it presses, so that plans can share
/// one prefill ([`Prefilled::observed`] with every `observe` they need).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillNeed {
    /// The prefill is of `prompt[..len]` (all of it but its last token runs): the whole
    /// prompt, or, for a press told where the question starts, the context and the
    /// question's first token.
    pub len: usize,
    /// The attention the plan's press reads.
    pub observe: Observe,
}

/// The prefill `plan` needs for a prompt of `prompt_len` tokens under `opts`; `None` for
/// a plan that streams its prefill. A `context_len` of 0 or past the prompt, or fewer
/// positions to press than the press's scorer needs, is an error.
pub fn prefill_need(
    plan: &Plan,
    prompt_len: usize,
    opts: &GenerateOptions,
) -> Result<Option<PrefillNeed>> {
    if plan.prefill != Prefill::FullThenEvict {
        return Ok(None);
    }
    let len = match (&plan.evict, opts.context_len) {
        (Some(_), Some(c)) if c == 0 || c >= prompt_len => {
            return Err(Error::invalid(
                "context_len",
                format!("{c} (must be in 1..{prompt_len} for this prompt)"),
            ))
        }
        // A question of one token: the whole prompt but its last token is pressed.
        (Some(_), Some(c)) => c + 1,
        _ => prompt_len,
    };
    if let Some(e) = &plan.evict {
        e.scorer.check_rows(len - 1)?;
    }
    let observe = plan
        .evict
        .as_ref()
        .map_or(Observe::Keys, |e| e.scorer.observes());
    Ok(Some(PrefillNeed { len, observe }))
}

/// Keeps the final hidden state of the last position of each pass, when enabled.
struct LastHidden {
    enabled: bool,
    hidden: Option<Vec<f32>>,
}

impl LastHidden {
    fn new(enabled: bool) -> Self {
        Self {
            enabled,
            hidden: None,
        }
    }
}

impl Observer for LastHidden {
    fn wants(&self) -> Wants {
        Wants {
            final_hidden: self.enabled,
            ..Wants::default()
        }
    }

    fn final_hidden(&mut self, hidden: &Tensor) {
        self.hidden = last_row(hidden);
    }
}

/// Memory and head activity of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct KvStats {
    /// Resident KV bytes at the end.
    pub end: KvBytes,
    /// The most resident at any point of decode (and of a streaming prefill).
    pub peak: KvBytes,
    /// The most resident during the prefill (`full_then_evict`: the full cache).
    pub prefill_peak: usize,
    /// Dynamic policies: mean KV heads reading their cold tier per step.
    pub mean_active_kv_heads: Option<f64>,
}

/// A generation and what it cost.
#[derive(Debug, Clone)]
pub struct PolicyGeneration {
    pub generation: Generation,
    pub kv: KvStats,
}

/// Generate from `prompt` under `plan`. A `full_then_evict` plan reuses `prefilled`
/// when given (it must be what [`prefill_need`] says: of the same prompt or context,
/// with the same edits and the attention the press reads), else prefills itself.
/// `oracle_labels` (per step, `layer * n_heads + head`, 1 = retrieval head) drive an
/// oracle plan (and only an oracle plan: other plans ignore them).
/// `on_token` sees each token with its logits `(1, vocab)` and the resident KV bytes
/// after the step, and may return `false` to stop.
pub fn generate(
    model: &Model,
    plan: &Plan,
    prompt: &[u32],
    opts: &GenerateOptions,
    prefilled: Option<&Prefilled>,
    oracle_labels: Option<&[Vec<f32>]>,
    on_token: &mut dyn FnMut(u32, &Tensor, KvBytes) -> bool,
) -> Result<PolicyGeneration> {
    let cfg = model.config();
    opts.check(prompt.len(), cfg.context_length)?;
    // Labels drive an oracle plan only; any other plan ignores them.
    let oracle = match (&plan.dynamic, oracle_labels) {
        (Some(d), labels) if matches!(d.source, DynamicSource::Oracle) => {
            Some(labels.ok_or_else(|| {
                Error::invalid(
                    "dynamic_heads",
                    "the oracle needs per-step labels (run it from the eval harness)",
                )
            })?)
        }
        _ => None,
    };
    let mut sampler = Sampler::new(opts.sampling)?;
    let capacity = prompt.len() + opts.max_new;
    let t0 = Instant::now();
    // With a shared prefill, its time counts as this run's prefill.
    let mut shared_secs = 0.0;
    let (mut session, mut hidden, prefill_peak) = match plan.prefill {
        Prefill::FullThenEvict => {
            let need = prefill_need(plan, prompt.len(), opts)?
                .ok_or(Error::Internal("a full_then_evict plan prefills"))?;
            // Pressing the context alone: the question then runs over what was kept.
            let context = (need.len < prompt.len()).then_some(need.len - 1);
            let own;
            let pre = match prefilled {
                Some(p) if p.serves(prompt, need, &plan.edits) => {
                    shared_secs = p.secs;
                    p
                }
                Some(_) => return Err(Error::invalid(
                    "prefill",
                    "shared for another prompt or edits, or without the attention the press reads",
                )),
                None => {
                    let pressed = &prompt[..need.len];
                    let observes = [need.observe];
                    own = Prefilled::observed(model, &plan.edits, pressed, capacity, &observes)?;
                    &own
                }
            };
            let mut cache = HeadCache::from_kv(cfg, &pre.kv, &plan.retention, plan.rows, capacity)?;
            let mut peak = pre.bytes() + cache.bytes().total();
            if let Some(eviction) = &plan.evict {
                eviction.press(&mut cache, cfg, pre.attention.as_ref())?;
            }
            let mut session = Session::with_cache(model, cache);
            let hidden = match context {
                Some(c) => {
                    let mut obs = LastHidden::new(true);
                    session.prefill(&prompt[c..prompt.len() - 1], &mut obs, &plan.edits)?;
                    peak = peak.max(session.cache().peak_bytes().total());
                    obs.hidden
                }
                None => pre.hidden.clone(),
            };
            (session, hidden, peak)
        }
        Prefill::Stream => {
            let cache = HeadCache::new(cfg, &plan.retention, plan.rows, capacity)?;
            let mut session = Session::with_cache(model, cache);
            let mut obs = LastHidden::new(true);
            if prompt.len() > 1 {
                let head = &prompt[..prompt.len() - 1];
                session.prefill(head, &mut obs, &plan.edits)?;
            }
            let peak = session.cache().peak_bytes().total();
            (session, obs.hidden, peak)
        }
    };
    for &(layer, head, tk) in &plan.topk {
        session.cache_mut().set_topk(layer, head, Some(tk))?;
    }
    let want_hidden = matches!(
        plan.dynamic.as_ref().map(|d| &d.source),
        Some(DynamicSource::Probe { .. })
    );
    let mut probe_ws = None;
    let mut probe_out = Vec::new();
    let mut active_sum = 0usize;
    let mut steps = 0usize;
    let mut tokens = Vec::with_capacity(opts.max_new);
    let mut input = *prompt
        .last()
        .ok_or(Error::Internal("prompts are checked non-empty"))?;
    let mut prefill_secs = 0.0;
    let no_labels = vec![0.0; cfg.n_layers * cfg.n_heads];
    let mut t1 = Instant::now();
    let stop = loop {
        if let Some(d) = &plan.dynamic {
            let flags = match &d.source {
                DynamicSource::Oracle => {
                    let labels =
                        oracle.ok_or(Error::Internal("oracle labels are checked present"))?;
                    let step = labels.get(steps).unwrap_or(&no_labels);
                    plan.active_kv_heads(step, 0.5, d.gqa)
                }
                DynamicSource::Probe { probe, threshold } => match &hidden {
                    Some(h) => {
                        let ws = probe_ws.get_or_insert_with(|| probe.workspace());
                        probe_out.resize(probe.output_dim(), 0.0);
                        probe.predict_into(h, ws, &mut probe_out)?;
                        plan.active_kv_heads(&probe_out, *threshold, d.gqa)
                    }
                    None => vec![false; cfg.n_layers * cfg.n_kv_heads],
                },
            };
            active_sum += flags.iter().filter(|&&a| a).count();
            session.cache_mut().set_active(&flags)?;
        }
        let mut obs = LastHidden::new(want_hidden);
        let logits = session.step(input, &mut obs, &plan.edits)?;
        hidden = obs.hidden;
        steps += 1;
        let next = sampler.sample(&logits)?;
        if tokens.is_empty() {
            prefill_secs = t0.elapsed().as_secs_f64() + shared_secs;
            t1 = Instant::now();
        }
        tokens.push(next);
        if !on_token(next, &logits, session.cache().bytes()) {
            break StopReason::Cancelled;
        }
        if opts.stop.contains(&next) {
            break StopReason::Stop;
        }
        if tokens.len() == opts.max_new {
            break StopReason::Length;
        }
        input = next;
    };
    let kv = KvStats {
        end: session.cache().bytes(),
        peak: session.cache().peak_bytes(),
        prefill_peak,
        mean_active_kv_heads: plan
            .dynamic
            .as_ref()
            .map(|_| active_sum as f64 / steps.max(1) as f64),
    };
    Ok(PolicyGeneration {
        generation: Generation {
            tokens,
            stop,
            prompt_tokens: prompt.len(),
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
        },
        kv,
    })
}
