//! Continuous batching: many generations over one model, each under its own policy,
//! advanced together one token per iteration by a batched decode step
//! ([`step_batch`]: the weights read once for all of them,
//! each sequence's logits the same bits as alone).
//!
//! A [`Scheduler`] owns one thread. Each iteration it
//!
//! 1. takes new requests into a FIFO queue, and drops waiting ones whose client left;
//! 2. admits from the front of the queue while fewer than `max_batch` sequences run and
//!    the front request's KV reservation fits beside the running ones' under
//!    `kv_budget` (the reservation is what the policy's stores allocate at prompt +
//!    `max_tokens` positions: full stores grow to it, rings are fixed, tiered heads'
//!    cold tiers count too; a press only gives rows back, so it is an upper bound);
//! 3. prefills at most `prefill_tokens` prompt positions (whole chunks of the model's
//!    prefill) of the admitted sequences still prefilling, oldest first, so that a long
//!    new prompt is spread over several iterations instead of stalling the running
//!    streams (a `full_then_evict` policy prefills and presses whole at admission). When
//!    the model's prefill chunk is one position, a prompt position is a decode step, so
//!    those positions run as rows of the iteration's batched step (below) instead of a
//!    pass of their own: prompts of several sequences and the running streams share
//!    one read of the weights. With `prefix_cache_bytes`, a streaming prefill's deepest
//!    shareable point ([`prefix_grain`](crate::policy::prefix::prefix_grain)) is kept in
//!    a [`PrefixCache`], and a later request of the same policy whose prompt starts with
//!    it continues from it instead of prefilling it again: it reads the prefix's rows in
//!    place (copy-on-write, [`HeadCache::share`]) and reserves only what it adds, so the
//!    resident KV stays within `kv_budget` plus `prefix_cache_bytes`;
//! 4. runs one batched decode step of every prefilled sequence (with the staged prompt
//!    positions) and hands each decoded sequence its token ([`Sink::token`]); finished
//!    and cancelled sequences leave at once, their caches freed and their reservation
//!    returned.
//!
//! Greedy tokens are the same as [`Runtime::generate`]'s for the same request, whatever
//! else runs (tested on the real model).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::model::{step_batch, BatchStep, GenerateOptions, HeadCache, StopReason};
use crate::policy::explain::ExplainConfig;
use crate::policy::generate::Decoding;
use crate::policy::prefix::PrefixCache;
use crate::policy::runtime::{GenerateOutput, GenerateRequest, Runtime, Step, TextOut};
use crate::policy::Prefill;
use crate::{Error, Result};

/// How a [`Scheduler`] batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences admitted at once (prefilling or decoding).
    pub max_batch: usize,
    /// KV bytes the admitted sequences may reserve together; `None`: no limit.
    pub kv_budget: Option<usize>,
    /// Most prompt positions prefilled per iteration (rounded up to whole chunks of the
    /// model's prefill).
    pub prefill_tokens: usize,
    /// Bytes of shared prompt prefixes kept for later requests ([`PrefixCache`]; 0:
    /// none).
    pub prefix_cache_bytes: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch: 16,
            kv_budget: None,
            prefill_tokens: 256,
            prefix_cache_bytes: 0,
        }
    }
}

/// Where a generation's output goes. Called on the scheduler's thread.
pub trait Sink: Send {
    /// The request left the queue and its prefill starts.
    fn admitted(&mut self) {}

    /// A generated token; `false` stops the generation (it leaves the batch at once).
    fn token(&mut self, step: &Step) -> bool;

    /// The end, called once: the output (its `finish` says `stop`, `length` or
    /// `cancelled`), or why it failed.
    fn done(self: Box<Self>, result: Result<GenerateOutput>);

    /// Whether the client has gone: polled while the request waits and before each of
    /// its steps.
    fn cancelled(&self) -> bool {
        false
    }
}

/// What the scheduler holds now, for metrics.
#[derive(Debug, Default)]
pub struct Load {
    /// Sequences admitted (prefilling or decoding).
    pub running: AtomicUsize,
    /// Requests waiting for admission.
    pub waiting: AtomicUsize,
    /// KV bytes the admitted sequences reserved.
    pub reserved_bytes: AtomicUsize,
    /// KV bytes their caches hold now, less the rows they share with the prefix cache
    /// (counted once, in `prefix_bytes`).
    pub used_bytes: AtomicUsize,
    /// Batched steps run that decoded, and the sequences they decoded (mean batch size =
    /// rows / steps; prompt positions run in a step are not counted).
    pub steps: AtomicU64,
    pub rows: AtomicU64,
    /// Prompt positions run as rows of batched steps (prefill chunks of one position),
    /// and the steps that ran some beside decoding sequences.
    pub prompt_rows: AtomicU64,
    pub mixed_steps: AtomicU64,
    /// Requests that continued a shared prefix, and the prompt tokens they did not
    /// prefill.
    pub prefix_hits: AtomicU64,
    pub prefix_tokens: AtomicU64,
    /// Bytes the prefix cache holds.
    pub prefix_bytes: AtomicUsize,
}

struct Job {
    policy: String,
    ids: Vec<u32>,
    opts: GenerateOptions,
    explain: Option<ExplainConfig>,
    need: usize,
    sink: Box<dyn Sink>,
}

/// Runs generations of several policies over one model with continuous batching.
pub struct Scheduler {
    runtimes: Arc<BTreeMap<String, Runtime>>,
    cfg: SchedulerConfig,
    tx: Option<Sender<Job>>,
    load: Arc<Load>,
    closing: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Scheduler {
    /// Start a scheduler over `runtimes` (policy name to runtime; all over the same
    /// loaded model, as [`Runtime::with_policy`] makes them).
    pub fn new(runtimes: BTreeMap<String, Runtime>, cfg: SchedulerConfig) -> Result<Self> {
        if cfg.max_batch == 0 {
            return Err(Error::invalid("max_batch", "0 (must be at least 1)"));
        }
        if cfg.prefill_tokens == 0 {
            return Err(Error::invalid("prefill_tokens", "0 (must be at least 1)"));
        }
        let mut models = runtimes.values().map(|r| &r.model().model);
        let first = models
            .next()
            .ok_or_else(|| Error::invalid("policies", "none given"))?;
        if models.any(|m| !std::ptr::eq(m, first)) {
            return Err(Error::invalid(
                "policies",
                "runtimes over different models (make them with Runtime::with_policy)",
            ));
        }
        let runtimes = Arc::new(runtimes);
        let (tx, rx) = channel();
        let load = Arc::new(Load::default());
        let closing = Arc::new(AtomicBool::new(false));
        let thread = {
            let (runtimes, load, closing) = (runtimes.clone(), load.clone(), closing.clone());
            std::thread::Builder::new()
                .name("headwise-scheduler".into())
                .spawn(move || run(&runtimes, cfg, rx, &load, &closing))
                .map_err(|e| Error::io("scheduler thread", e))?
        };
        Ok(Self {
            runtimes,
            cfg,
            tx: Some(tx),
            load,
            closing,
            thread: Some(thread),
        })
    }

    /// The settings.
    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }

    /// What it holds now.
    pub fn load(&self) -> &Load {
        &self.load
    }

    /// KV bytes a request of `prompt_len` tokens and `max_tokens` new ones reserves
    /// under `policy`.
    pub fn reservation(&self, policy: &str, prompt_len: usize, max_tokens: usize) -> Result<usize> {
        let rt = self.runtime(policy)?;
        reservation(rt, prompt_len + max_tokens)
    }

    fn runtime(&self, policy: &str) -> Result<&Runtime> {
        self.runtimes.get(policy).ok_or_else(|| {
            Error::invalid(
                "policy",
                format!(
                    "unknown policy `{policy}` (allowed: {})",
                    self.runtimes.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            )
        })
    }

    /// Queue `request` under `policy`; its tokens and end go to `sink`. Refused at once
    /// (nothing queued, `sink` dropped) for an unknown policy, a prompt that does not
    /// encode, or a reservation larger than the whole `kv_budget`.
    pub fn submit(
        &self,
        policy: &str,
        request: &GenerateRequest,
        sink: Box<dyn Sink>,
    ) -> Result<()> {
        let rt = self.runtime(policy)?;
        let ids = rt.encode(&request.prompt)?;
        let opts = rt.options(request);
        opts.check(ids.len(), rt.model().model.config().context_length)?;
        if let Some(e) = &request.explain {
            e.check(rt.model().model.config())?;
        }
        let need = reservation(rt, ids.len() + request.max_tokens)?;
        if let Some(budget) = self.cfg.kv_budget {
            if need > budget {
                return Err(Error::invalid(
                    "kv_budget",
                    format!(
                        "this request needs {need} bytes of KV under policy `{policy}` \
                         ({} prompt + {} new tokens), more than the whole budget of {budget}",
                        ids.len(),
                        request.max_tokens
                    ),
                ));
            }
        }
        let job = Job {
            policy: policy.to_string(),
            ids,
            opts,
            explain: request.explain.clone(),
            need,
            sink,
        };
        self.tx
            .as_ref()
            .and_then(|tx| tx.send(job).ok())
            .ok_or(Error::Internal("the scheduler has stopped"))
    }
}

impl Drop for Scheduler {
    /// Fail what still waits or runs, and wait for the thread.
    fn drop(&mut self) {
        self.closing.store(true, Ordering::SeqCst);
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("policies", &self.runtimes.keys().collect::<Vec<_>>())
            .field("cfg", &self.cfg)
            .finish()
    }
}

/// KV bytes `rt`'s policy allocates for a sequence of `capacity` positions: its stores
/// ([`HeadCache::projected_bytes`]), plus, for a policy that prefills with the plain
/// cache before it presses, that cache (it is held while the press runs).
pub fn reservation(rt: &Runtime, capacity: usize) -> Result<usize> {
    let cfg = rt.model().model.config();
    let plan = rt.plan();
    let stores = HeadCache::projected_bytes(cfg, &plan.retention, plan.rows, capacity)?;
    let plain = match plan.prefill {
        Prefill::Stream => 0,
        Prefill::FullThenEvict => {
            let full = vec![crate::model::Retention::Full; cfg.n_layers * cfg.n_kv_heads];
            HeadCache::projected_bytes(cfg, &full, crate::model::RowFormat::F32, capacity)?.total()
        }
    };
    Ok(stores.total() + plain)
}

/// One admitted sequence.
struct Running<'a> {
    policy: &'a str,
    rt: &'a Runtime,
    decoding: Decoding<'a>,
    /// The prompt, for the text of what an explained token's heads read.
    ids: Vec<u32>,
    sink: Box<dyn Sink>,
    text: TextOut,
    need: usize,
    /// Set when it must leave: how it ended, or why it failed.
    end: Option<Result<StopReason>>,
}

fn run(
    runtimes: &BTreeMap<String, Runtime>,
    cfg: SchedulerConfig,
    rx: Receiver<Job>,
    load: &Load,
    closing: &AtomicBool,
) {
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut prefixes = PrefixCache::new(cfg.prefix_cache_bytes);
    let mut reserved = 0usize;
    let mut open = true;
    loop {
        // 1. Intake: block only when there is nothing to do.
        if running.is_empty() && waiting.is_empty() {
            match rx.recv() {
                Ok(job) => waiting.push_back(job),
                Err(_) => return,
            }
        }
        while open {
            match rx.try_recv() {
                Ok(job) => waiting.push_back(job),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        if closing.load(Ordering::SeqCst) {
            let stopped = || Err(Error::Internal("the scheduler stopped"));
            for job in waiting.drain(..) {
                job.sink.done(stopped());
            }
            for r in running.drain(..) {
                r.sink.done(stopped());
            }
            load.running.store(0, Ordering::Relaxed);
            return;
        }
        let (gone, kept): (Vec<Job>, Vec<Job>) =
            waiting.drain(..).partition(|j| j.sink.cancelled());
        waiting = kept.into();
        for job in gone {
            job.sink
                .done(Err(Error::invalid("request", "cancelled while waiting")));
        }
        // 2. Admission, first come first served.
        while running.len() < cfg.max_batch {
            let Some(front) = waiting.front() else { break };
            // A request that continues a shared prefix reads its rows in place (the
            // prefix cache holds them): it reserves only what it adds. Peeked, so that
            // a request the budget keeps waiting copies nothing.
            let streams = |policy: &str| {
                runtimes
                    .get(policy)
                    .is_some_and(|rt| rt.plan().prefill == Prefill::Stream)
            };
            let shared = match streams(&front.policy) {
                true => prefixes
                    .peek(&front.policy, &front.ids[..front.ids.len() - 1])
                    .map_or(0, |p| p.cache.bytes_behind_shares().total()),
                false => 0,
            };
            let need = front.need.saturating_sub(shared);
            if cfg.kv_budget.is_some_and(|b| reserved + need > b) {
                break;
            }
            let Some(mut job) = waiting.pop_front() else {
                break;
            };
            job.need = need;
            let Some((policy, rt)) = runtimes.get_key_value(&job.policy) else {
                job.sink
                    .done(Err(Error::Internal("a job of an unknown policy")));
                continue;
            };
            job.sink.admitted();
            let prefix = match streams(policy) {
                true => prefixes.lookup(policy, &job.ids[..job.ids.len() - 1]),
                false => None,
            };
            if let Some(p) = &prefix {
                load.prefix_hits.fetch_add(1, Ordering::Relaxed);
                load.prefix_tokens
                    .fetch_add(p.tokens.len() as u64, Ordering::Relaxed);
            }
            let (model, plan) = (&rt.model().model, rt.plan());
            let begun = Decoding::begin_with(model, plan, &job.ids, &job.opts, None, None, prefix)
                .and_then(|mut d| {
                    if let Some(cfg) = job.explain.take() {
                        d.explain(cfg)?;
                    }
                    Ok(d)
                });
            match begun {
                Ok(decoding) => {
                    reserved += job.need;
                    running.push(Running {
                        policy,
                        rt,
                        decoding,
                        ids: job.ids,
                        sink: job.sink,
                        text: TextOut::default(),
                        need: job.need,
                        end: None,
                    });
                }
                Err(e) => job.sink.done(Err(e)),
            }
        }
        // 3. Prefill under the per-iteration token budget, oldest first. With prefill
        // chunks of one position, prompt positions are decode steps: they are staged
        // to run as rows of this iteration's batched step.
        let mut budget = cfg.prefill_tokens;
        for r in running
            .iter_mut()
            .filter(|r| r.end.is_none() && !r.decoding.ready())
        {
            if budget == 0 {
                break;
            }
            let ran = match r.rt.model().model.chunk() {
                1 => r.decoding.stage_prefill(budget),
                _ => r.decoding.prefill_some(budget),
            };
            match ran {
                Ok(n) => budget = budget.saturating_sub(n),
                Err(e) => r.end = Some(Err(e)),
            }
            if cfg.prefix_cache_bytes > 0 {
                if let Some(p) = r.decoding.take_prefix() {
                    prefixes.insert(r.policy, p);
                }
            }
        }
        // 4. One batched step: a decode step of every prefilled sequence, and the staged
        // prompt positions of the others.
        for r in running.iter_mut().filter(|r| r.end.is_none()) {
            if r.sink.cancelled() {
                r.end = Some(Ok(StopReason::Cancelled));
            } else if r.decoding.ready() {
                if let Err(e) = r.decoding.prepare() {
                    r.end = Some(Err(e));
                }
            }
        }
        let live = |r: &Running| r.end.is_none() && (r.decoding.ready() || r.decoding.staged() > 0);
        let stepping: Vec<usize> = (0..running.len()).filter(|&i| live(&running[i])).collect();
        if !stepping.is_empty() {
            let mut batch: Vec<BatchStep<'_, '_>> = running
                .iter_mut()
                .filter(|r| live(r))
                .map(|r| match r.decoding.ready() {
                    true => r.decoding.batch_step(),
                    false => r.decoding.prefill_step(),
                })
                .collect();
            let result = step_batch(&mut batch);
            drop(batch);
            let decoded = stepping
                .iter()
                .filter(|&&i| running[i].decoding.ready())
                .count();
            let prompt: usize = stepping.iter().map(|&i| running[i].decoding.staged()).sum();
            if decoded > 0 {
                load.steps.fetch_add(1, Ordering::Relaxed);
                load.rows.fetch_add(decoded as u64, Ordering::Relaxed);
            }
            load.prompt_rows.fetch_add(prompt as u64, Ordering::Relaxed);
            if decoded > 0 && prompt > 0 {
                load.mixed_steps.fetch_add(1, Ordering::Relaxed);
            }
            match result {
                Ok(logits) => {
                    for (&i, l) in stepping.iter().zip(&logits) {
                        let r = &mut running[i];
                        r.end = match l {
                            Some(l) => deliver(r, l).transpose(),
                            None => r.decoding.prefill_stepped().err().map(Err),
                        };
                        if cfg.prefix_cache_bytes > 0 && r.end.is_none() {
                            if let Some(p) = r.decoding.take_prefix() {
                                prefixes.insert(r.policy, p);
                            }
                        }
                    }
                }
                Err(e) => {
                    for &i in &stepping {
                        running[i].end = Some(Err(Error::invalid("batch step", e.to_string())));
                    }
                }
            }
        }
        // 5. Finished and cancelled sequences leave; their caches are freed here.
        let mut i = 0;
        while i < running.len() {
            if running[i].end.is_none() {
                i += 1;
                continue;
            }
            let r = running.swap_remove(i);
            reserved -= r.need;
            let result = match r.end {
                Some(Ok(stop)) => Ok(r.rt.output(r.decoding.finish(stop), r.text.text)),
                Some(Err(e)) => Err(e),
                None => Err(Error::Internal("a sequence left without an end")),
            };
            r.sink.done(result);
        }
        load.running.store(running.len(), Ordering::Relaxed);
        load.waiting.store(waiting.len(), Ordering::Relaxed);
        load.reserved_bytes.store(reserved, Ordering::Relaxed);
        // Rows shared with the prefix cache are counted once, there.
        let used: usize = running
            .iter()
            .map(|r| r.decoding.kv_bytes().total() - r.decoding.shared_kv_bytes().total())
            .sum();
        load.used_bytes.store(used, Ordering::Relaxed);
        load.prefix_bytes.store(prefixes.bytes(), Ordering::Relaxed);
    }
}

/// Sample `r`'s token from its `logits` and hand it to its sink; how it ends, if it does.
fn deliver(r: &mut Running, logits: &candle_core::Tensor) -> Result<Option<StopReason>> {
    let token = r.decoding.advance(logits)?;
    let explain = r.rt.explained(&mut r.decoding, &r.ids);
    let text = r.text.push(r.rt, token)?;
    let step = Step {
        token,
        text,
        logits,
        kv: r.decoding.kv_bytes(),
        explain: explain.as_ref(),
    };
    if !r.sink.token(&step) {
        return Ok(Some(StopReason::Cancelled));
    }
    Ok(r.decoding.stopped())
}
