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
    last_row, BatchStep, GenerateOptions, Generation, HeadCache, Interventions, KvBytes, Model,
    Observer, Session, StopReason, Tee, Wants,
};
use crate::policy::evict::{Observe, Observed};
use crate::policy::explain::{ExplainConfig, HeadReads, TokenExplain};
use crate::policy::plan::{DynamicSource, Plan, Prefill};
use crate::policy::prefix::{prefix_grain, Prefix};
use crate::policy::presses::kvzip::{reconstruct, RepeatPrompt};
use crate::{Error, Result};

/// A prompt prefilled with the plain (full) cache, all but its last token: shared by
/// every `full_then_evict` policy run on the same prompt with the same edits.
#[derive(Debug, Clone)]
pub struct Prefilled {
    kv: HeadCache,
    /// The edits the prompt ran with.
    edits: Interventions,
    /// Final hidden state `(d_model,)` of the last prefilled position.
    hidden: Option<Vec<f32>>,
    /// The prompt.
    prompt: Vec<u32>,
    /// Attention sums of the observed positions, for presses that read attention.
    attention: Option<Observed>,
    /// Bytes of the copy of the cache a reconstruction ran on (KVzip), at most.
    fork: usize,
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
        Self::observed(model, edits, prompt, capacity, &[], None)
    }

    /// [`Prefilled::run`], with the attention each of `observes` names summed over its
    /// queries, for the presses that read it: the positions before the first observed
    /// query run as one pass, the rest as another. An [`Observe::Reconstruct`] then
    /// re-reads the prefilled positions with `repeat` (KVzip; an error without it).
    pub fn observed(
        model: &Model,
        edits: &Interventions,
        prompt: &[u32],
        capacity: usize,
        observes: &[Observe],
        repeat: Option<&RepeatPrompt>,
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
        let kv = session.into_cache();
        let mut fork = 0;
        // A prompt of one token has nothing before it to re-read.
        let reconstruct_in = observes
            .iter()
            .find_map(|o| match o {
                Observe::Reconstruct { chunk } => Some(*chunk),
                _ => None,
            })
            .filter(|_| !head.is_empty());
        if let Some(chunk) = reconstruct_in {
            let repeat = repeat.ok_or_else(|| {
                Error::invalid(
                    "policy",
                    "kvzip re-reads the context after a repeat instruction, which needs the \
                     model's tokenizer: resolve the plan with `Plan::with_text`",
                )
            })?;
            fork = reconstruct(model, edits, &kv, head, chunk, repeat, &mut sums)?;
        }
        let observed = from < head.len() || reconstruct_in.is_some();
        Ok(Self {
            kv,
            edits: edits.clone(),
            hidden: obs.hidden,
            prompt: prompt.to_vec(),
            attention: observed.then_some(sums),
            fork,
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
    pub fn cache(&self) -> &HeadCache {
        &self.kv
    }

    /// Bytes the plain cache allocated for the prefill.
    pub fn bytes(&self) -> usize {
        self.kv.bytes().total()
    }

    /// Bytes the prefill held at most: the plain cache, with the copy KVzip's
    /// reconstruction ran on.
    pub fn peak_bytes(&self) -> usize {
        self.bytes() + self.fork
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

/// What a decode step observes: the final hidden state (for a probe) and, when the
/// generation is explained, the chosen heads' reading.
struct StepObserver {
    hidden: LastHidden,
    reads: Option<HeadReads>,
}

impl Observer for StepObserver {
    fn wants(&self) -> Wants {
        Wants {
            attention: self.reads.is_some(),
            ..self.hidden.wants()
        }
    }

    fn begin(&mut self, start: usize, q: usize) {
        if let Some(r) = &mut self.reads {
            r.begin(start, q);
        }
    }

    fn attention(&mut self, layer: usize, probs: &Tensor) {
        if let Some(r) = &mut self.reads {
            r.attention(layer, probs);
        }
    }

    fn final_hidden(&mut self, hidden: &Tensor) {
        self.hidden.final_hidden(hidden);
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
    /// Of `end`, the rows shared with another holder at the end (a prompt prefix read
    /// in place, [`HeadCache::shared_bytes`]).
    #[serde(default)]
    pub shared: KvBytes,
}

/// A generation and what it cost.
#[derive(Debug, Clone)]
pub struct PolicyGeneration {
    pub generation: Generation,
    pub kv: KvStats,
    /// Prompt positions taken from a shared prefix instead of prefilled.
    pub cached_tokens: usize,
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
    let mut decoding = Decoding::start(model, plan, prompt, opts, prefilled, oracle_labels)?;
    let stop = loop {
        decoding.prepare()?;
        let logits = decoding.step()?;
        let next = decoding.advance(&logits)?;
        if !on_token(next, &logits, decoding.kv_bytes()) {
            break StopReason::Cancelled;
        }
        if let Some(stop) = decoding.stopped() {
            break stop;
        }
    };
    Ok(decoding.finish(stop))
}

/// One generation under a [`Plan`] between its steps: prefilled by
/// [`Decoding::start`], then per token [`Decoding::prepare`] (the dynamic head
/// choice), a step ([`Decoding::step`] alone, or [`Decoding::batch_step`] in a
/// [`step_batch`](crate::model::step_batch) with other generations), and
/// [`Decoding::advance`] with the step's logits. [`generate`] is this loop for one
/// generation; a scheduler runs it for many at once.
pub struct Decoding<'a> {
    plan: &'a Plan,
    session: Session<'a>,
    /// A streaming prefill's positions (all of the prompt but its last token), of
    /// which `done` have run.
    pending: Vec<u32>,
    /// Prompt positions staged for the next batched step ([`Decoding::stage_prefill`]).
    staged: usize,
    /// The prefill's observer: the last prompt position's final hidden state.
    prefill_hidden: LastHidden,
    done: usize,
    /// Positions taken from a shared prefix.
    cached_tokens: usize,
    /// Whether this prefill's prefix was offered for sharing.
    offered: bool,
    /// The prefill is done.
    ready: bool,
    stop: Vec<u32>,
    max_new: usize,
    oracle: Option<&'a [Vec<f32>]>,
    /// What the next step observes (the final hidden state, for a probe; the chosen
    /// heads' reading, when explained).
    observer: StepObserver,
    /// The last token, explained ([`Decoding::explain`]).
    explained: Option<TokenExplain>,
    /// The final hidden state of the last position run, when a probe reads it.
    hidden: Option<Vec<f32>>,
    probe_ws: Option<crate::probe::Workspace>,
    probe_out: Vec<f32>,
    no_labels: Vec<f32>,
    /// `n_layers * n_kv_heads`.
    kv_heads: usize,
    active_sum: usize,
    steps: usize,
    tokens: Vec<u32>,
    input: u32,
    prompt_tokens: usize,
    prefill_peak: usize,
    t0: Instant,
    t1: Instant,
    /// With a shared prefill, its time counts as this run's prefill.
    shared_secs: f64,
    prefill_secs: f64,
}

impl<'a> Decoding<'a> {
    /// Check the request and run the prompt but its last token (which the first step
    /// runs); see [`generate`] for `prefilled` and `oracle_labels`.
    pub fn start(
        model: &'a Model,
        plan: &'a Plan,
        prompt: &[u32],
        opts: &GenerateOptions,
        prefilled: Option<&Prefilled>,
        oracle_labels: Option<&'a [Vec<f32>]>,
    ) -> Result<Self> {
        let mut decoding = Self::begin(model, plan, prompt, opts, prefilled, oracle_labels)?;
        while !decoding.ready() {
            decoding.prefill_some(usize::MAX)?;
        }
        Ok(decoding)
    }

    /// [`Decoding::start`] with the prefill left to [`Decoding::prefill_some`] where
    /// the plan streams its prefill (a `full_then_evict` plan prefills and presses here,
    /// whole).
    pub fn begin(
        model: &'a Model,
        plan: &'a Plan,
        prompt: &[u32],
        opts: &GenerateOptions,
        prefilled: Option<&Prefilled>,
        oracle_labels: Option<&'a [Vec<f32>]>,
    ) -> Result<Self> {
        Self::begin_with(model, plan, prompt, opts, prefilled, oracle_labels, None)
    }

    /// [`Decoding::begin`] continuing from `prefix`, a shared prefix of the prompt
    /// prefilled under the same plan ([`Decoding::take_prefix`] of an earlier request):
    /// only the rest of the prompt is prefilled. A plan that presses after a full
    /// prefill cannot continue one.
    pub fn begin_with(
        model: &'a Model,
        plan: &'a Plan,
        prompt: &[u32],
        opts: &GenerateOptions,
        prefilled: Option<&Prefilled>,
        oracle_labels: Option<&'a [Vec<f32>]>,
        prefix: Option<Prefix>,
    ) -> Result<Self> {
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
        // Checked before the prefill's work; the session takes it once it exists.
        opts.sampling.validate()?;
        let capacity = prompt.len() + opts.max_new;
        let t0 = Instant::now();
        let mut shared_secs = 0.0;
        let mut pending = Vec::new();
        let mut done = 0;
        let prefix_given = prefix.is_some();
        let (session, hidden, prefill_peak) = match plan.prefill {
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
                        let repeat = plan.repeat.as_deref();
                        own = Prefilled::observed(
                            model,
                            &plan.edits,
                            pressed,
                            capacity,
                            &observes,
                            repeat,
                        )?;
                        &own
                    }
                };
                let mut cache = pre.kv.retained(cfg, &plan.retention, plan.rows, capacity)?;
                let mut peak = pre.peak_bytes().max(pre.bytes() + cache.bytes().total());
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
                pending = prompt[..prompt.len() - 1].to_vec();
                match prefix {
                    Some(p) => {
                        if !pending.starts_with(&p.tokens) || p.tokens.len() % model.chunk() != 0 {
                            return Err(Error::invalid(
                                "prefix",
                                "not a whole number of prefill chunks at the start of this prompt",
                            ));
                        }
                        done = p.tokens.len();
                        let cache = p.cache.with_capacity(capacity)?;
                        (Session::with_cache(model, cache), p.hidden, 0)
                    }
                    None => {
                        let cache = HeadCache::new(cfg, &plan.retention, plan.rows, capacity)?;
                        (Session::with_cache(model, cache), None, 0)
                    }
                }
            }
        };
        if prefix_given && plan.prefill != Prefill::Stream {
            return Err(Error::invalid(
                "prefix",
                "a policy that presses after a full prefill does not continue a shared prefix",
            ));
        }
        let want_hidden = matches!(
            plan.dynamic.as_ref().map(|d| &d.source),
            Some(DynamicSource::Probe { .. })
        );
        Ok(Self {
            plan,
            session: session.with_sampling(opts.sampling)?,
            pending,
            staged: 0,
            prefill_hidden: LastHidden::new(true),
            done,
            cached_tokens: done,
            offered: false,
            ready: false,
            stop: opts.stop.clone(),
            max_new: opts.max_new,
            oracle,
            observer: StepObserver {
                hidden: LastHidden::new(want_hidden),
                reads: None,
            },
            explained: None,
            hidden,
            probe_ws: None,
            probe_out: Vec::new(),
            no_labels: vec![0.0; cfg.n_layers * cfg.n_heads],
            kv_heads: cfg.n_layers * cfg.n_kv_heads,
            active_sum: 0,
            steps: 0,
            tokens: Vec::with_capacity(opts.max_new),
            input: *prompt
                .last()
                .ok_or(Error::Internal("prompts are checked non-empty"))?,
            prompt_tokens: prompt.len(),
            prefill_peak,
            t0,
            t1: Instant::now(),
            shared_secs,
            prefill_secs: 0.0,
        })
    }

    /// Explain every token from the next step on ([`crate::policy::explain`]): after
    /// each [`Decoding::advance`], [`Decoding::take_explained`] gives it (its texts left
    /// empty).
    pub fn explain(&mut self, cfg: ExplainConfig) -> Result<()> {
        cfg.check(self.session.model().config())?;
        self.observer.reads = Some(HeadReads::new(cfg, self.prompt_tokens));
        Ok(())
    }

    /// Prompt tokens either side of a read position in an explanation's text.
    pub fn explain_context(&self) -> usize {
        self.observer.reads.as_ref().map_or(0, |r| r.context())
    }

    /// The last token, explained (once).
    pub fn take_explained(&mut self) -> Option<TokenExplain> {
        self.explained.take()
    }

    /// Prompt positions still to prefill.
    pub fn prefill_left(&self) -> usize {
        self.pending.len() - self.done
    }

    /// Prefill up to `max_tokens` more prompt positions (rounded up to whole chunks of
    /// the model's prefill, so that a prefill run in several calls computes what one
    /// call would); returns how many ran. Top-k restrictions start once it is done.
    pub fn prefill_some(&mut self, max_tokens: usize) -> Result<usize> {
        if self.ready {
            return Ok(0);
        }
        let n = self.prefill_part(max_tokens);
        if n > 0 {
            let part = &self.pending[self.done..self.done + n];
            self.session
                .prefill(part, &mut self.prefill_hidden, &self.plan.edits)?;
        }
        self.prefilled(n)?;
        Ok(n)
    }

    /// Stage up to `max_tokens` more prompt positions to run as one row of the next
    /// batched step ([`Decoding::prefill_step`]), each position a decode step of its
    /// own: for a model whose prefill chunk is one position, what
    /// [`Decoding::prefill_some`] computes. Returns how many were staged (0 ends a
    /// prefill with nothing left to run).
    pub fn stage_prefill(&mut self, max_tokens: usize) -> Result<usize> {
        if self.session.model().chunk() != 1 {
            return Err(Error::Internal(
                "prompt rows in a batch need one-position chunks",
            ));
        }
        if self.ready {
            return Ok(0);
        }
        let n = self.prefill_part(max_tokens);
        self.staged = n;
        if n == 0 {
            self.prefilled(0)?;
        }
        Ok(n)
    }

    /// Prompt positions staged for the next batched step.
    pub fn staged(&self) -> usize {
        self.staged
    }

    /// The staged prompt positions as one row of a batched step, no logits asked.
    pub fn prefill_step(&mut self) -> BatchStep<'_, 'a> {
        BatchStep {
            session: &mut self.session,
            tokens: &self.pending[self.done..self.done + self.staged],
            logits: false,
            observer: &mut self.prefill_hidden,
            edits: &self.plan.edits,
        }
    }

    /// After the batched step that ran the staged positions.
    pub fn prefill_stepped(&mut self) -> Result<()> {
        let n = std::mem::take(&mut self.staged);
        self.prefilled(n)
    }

    /// Prompt positions the next prefill call runs for `max_tokens`: whole chunks,
    /// stopping once at the deepest point where the prefix can be shared.
    fn prefill_part(&self, max_tokens: usize) -> usize {
        let chunk = self.session.model().chunk();
        let mut n = max_tokens
            .max(1)
            .checked_next_multiple_of(chunk)
            .unwrap_or(usize::MAX)
            .min(self.prefill_left());
        let boundary = self.boundary();
        if self.done < boundary {
            n = n.min(boundary - self.done);
        }
        n
    }

    /// Account for `n` prompt positions that ran; once none is left, the top-k
    /// restrictions start and the next call is a step.
    fn prefilled(&mut self, n: usize) -> Result<()> {
        if n > 0 {
            self.hidden = self.prefill_hidden.hidden.take();
            self.done += n;
            let peak = self.session.cache().peak_bytes().total();
            self.prefill_peak = self.prefill_peak.max(peak);
        }
        if self.prefill_left() == 0 && !self.ready {
            for &(layer, head, tk) in &self.plan.topk {
                self.session.cache_mut().set_topk(layer, head, Some(tk))?;
            }
            self.ready = true;
        }
        Ok(())
    }

    /// The deepest point of the streamed prefill where its prefix can be shared: a
    /// whole number of [`PREFIX_GRAIN`]-sized steps of whole prefill chunks.
    fn boundary(&self) -> usize {
        let grain = prefix_grain(self.session.model().chunk());
        self.pending.len() / grain * grain
    }

    /// The prompt prefix this prefill has just reached, for later requests to continue
    /// ([`Decoding::begin_with`]): offered once, when a streaming prefill stands at its
    /// deepest shareable point (and that is more than it started from).
    pub fn take_prefix(&mut self) -> Option<Prefix> {
        let at = self.boundary();
        let share = !self.offered
            && self.plan.prefill == Prefill::Stream
            && at > self.cached_tokens
            && self.done == at;
        if !share {
            return None;
        }
        self.offered = true;
        // Shared copy-on-write: the prefix and this sequence read the same rows.
        self.session.cache_mut().share();
        let mut cache = self.session.cache().clone();
        for &(layer, head, _) in &self.plan.topk {
            cache.set_topk(layer, head, None).ok()?;
        }
        Some(Prefix {
            tokens: self.pending[..at].to_vec(),
            cache,
            hidden: self.hidden.clone(),
        })
    }

    /// Whether the prefill is done (the next call is a step).
    pub fn ready(&self) -> bool {
        self.ready
    }

    /// Before a step: a dynamic plan chooses the KV heads that read their cold tier
    /// (from the probe on the last hidden state, or the oracle's labels).
    pub fn prepare(&mut self) -> Result<()> {
        let Some(d) = &self.plan.dynamic else {
            return Ok(());
        };
        let flags = match &d.source {
            DynamicSource::Oracle => {
                let labels = self
                    .oracle
                    .ok_or(Error::Internal("oracle labels are checked present"))?;
                let step = labels.get(self.steps).unwrap_or(&self.no_labels);
                self.plan.active_kv_heads(step, 0.5, d.gqa)
            }
            DynamicSource::Probe { probe, threshold } => match &self.hidden {
                Some(h) => {
                    let ws = self.probe_ws.get_or_insert_with(|| probe.workspace());
                    self.probe_out.resize(probe.output_dim(), 0.0);
                    probe.predict_into(h, ws, &mut self.probe_out)?;
                    self.plan
                        .active_kv_heads(&self.probe_out, *threshold, d.gqa)
                }
                None => vec![false; self.kv_heads],
            },
        };
        self.active_sum += flags.iter().filter(|&&a| a).count();
        self.session.cache_mut().set_active(&flags)
    }

    /// Run the next token alone; its logits `(1, vocab)`.
    pub fn step(&mut self) -> Result<Tensor> {
        if !self.ready {
            return Err(Error::Internal("a step before the prefill is done"));
        }
        self.session
            .step(self.input, &mut self.observer, &self.plan.edits)
    }

    /// The next token as one row of a batched step (once [`Decoding::ready`]).
    pub fn batch_step(&mut self) -> BatchStep<'_, 'a> {
        BatchStep {
            session: &mut self.session,
            tokens: std::slice::from_ref(&self.input),
            logits: true,
            observer: &mut self.observer,
            edits: &self.plan.edits,
        }
    }

    /// After a step with its `logits` `(1, vocab)`: sample the next token, which the
    /// next step runs.
    pub fn advance(&mut self, logits: &Tensor) -> Result<u32> {
        self.hidden = self.observer.hidden.hidden.take();
        if let Some(reads) = &mut self.observer.reads {
            // Under a probe, the prediction that chose this step's heads.
            let probe = match self.plan.dynamic.as_ref().map(|d| &d.source) {
                Some(DynamicSource::Probe { .. }) if !self.probe_out.is_empty() => {
                    Some(self.probe_out.as_slice())
                }
                _ => None,
            };
            let n_heads = self.session.model().config().n_heads;
            self.explained = Some(reads.explain(logits, probe, n_heads)?);
        }
        self.steps += 1;
        let next = self.session.sample(logits)?;
        if self.tokens.is_empty() {
            self.prefill_secs = self.t0.elapsed().as_secs_f64() + self.shared_secs;
            self.t1 = Instant::now();
        }
        self.tokens.push(next);
        self.input = next;
        Ok(next)
    }

    /// Why the generation is over after the last token: a stop token, or `max_new`
    /// tokens; `None` while it goes on.
    pub fn stopped(&self) -> Option<StopReason> {
        if self.tokens.last().is_some_and(|t| self.stop.contains(t)) {
            Some(StopReason::Stop)
        } else if self.tokens.len() >= self.max_new {
            Some(StopReason::Length)
        } else {
            None
        }
    }

    /// Resident KV bytes now (rows of a shared prefix it reads in place included).
    pub fn kv_bytes(&self) -> KvBytes {
        self.session.cache().bytes()
    }

    /// Of [`Decoding::kv_bytes`], the rows it shares with another holder (a prefix it
    /// continued or offered, [`HeadCache::shared_bytes`]).
    pub fn shared_kv_bytes(&self) -> KvBytes {
        self.session.cache().shared_bytes()
    }

    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The generation, ended for `stop`, and what it cost.
    pub fn finish(self, stop: StopReason) -> PolicyGeneration {
        let cache = self.session.cache();
        let kv = KvStats {
            end: cache.bytes(),
            shared: cache.shared_bytes(),
            peak: cache.peak_bytes(),
            prefill_peak: self.prefill_peak,
            mean_active_kv_heads: self
                .plan
                .dynamic
                .as_ref()
                .map(|_| self.active_sum as f64 / self.steps.max(1) as f64),
        };
        PolicyGeneration {
            generation: Generation {
                tokens: self.tokens,
                stop,
                prompt_tokens: self.prompt_tokens,
                prefill_secs: self.prefill_secs,
                decode_secs: self.t1.elapsed().as_secs_f64(),
            },
            kv,
            cached_tokens: self.cached_tokens,
        }
    }
}
