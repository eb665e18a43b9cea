//! Admission and execution of generations: a bounded count of requests in flight in
//! front of the continuous-batching [`Scheduler`] (at most `max_concurrency` sequences
//! in its batch, admitted by their KV reservation under `kv_budget_mib`), each
//! generation's output sent to the request's handler as [`Event`]s. A generation stops
//! at the next step when its client goes away, its deadline passes or the server shuts
//! down; its KV cache is freed as it leaves the batch, and the metrics follow it step by
//! step. RAG requests run their own loop on a blocking thread, outside the batch.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use crate::model::LoadedModel;
use crate::policy::{
    GenerateOutput, GenerateRequest, Runtime, Scheduler, SchedulerConfig, Sink, Step, TokenExplain,
};
use crate::rag::dragin::{
    answer, AnswerOptions, ContextMode, Instrumented, OnRetrieverError, QueryConfig, RagConfig,
};
use crate::rag::qa::QaItem;
use crate::rag::text::Stopwords;
use crate::rag::trigger::TriggerConfig;
use crate::rag::Bm25Index;
use crate::serve::api::{
    ApiError, HeadwiseUsage, PromptTokensDetails, TokenLogprob, TopLogprob, Usage,
};
use crate::serve::config::ServeConfig;
use crate::serve::metrics::Metrics;
use crate::serve::stop::StopMatcher;

/// Most alternatives per token a request may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generation to run.
#[derive(Debug, Clone)]
pub struct Job {
    /// The preset's name (a key of the engine's runtimes).
    pub policy: String,
    /// The request, its prompt already as token ids.
    pub request: GenerateRequest,
    /// Stop strings.
    pub stops: Vec<String>,
    /// Return log-probabilities, with this many alternatives per token.
    pub top_logprobs: Option<usize>,
    /// Answer through the RAG loop instead: the trigger and the question.
    pub rag: Option<(TriggerConfig, String)>,
}

/// What the server retrieves with: a BM25 index, the stopwords of RIND and QFS, and
/// the triggers requests may name.
#[derive(Debug)]
pub struct RagService {
    pub index: Bm25Index,
    pub stopwords: Stopwords,
    pub triggers: BTreeMap<String, TriggerConfig>,
}

/// What a running generation reports.
#[derive(Debug, Clone)]
pub enum Event {
    /// Released text, and the log-probabilities and explanations of the tokens it came
    /// from (when asked).
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
        explain: Vec<TokenExplain>,
    },
    /// The end: `stop` or `length`, and what it cost; a RAG answer comes whole here.
    Done {
        finish: &'static str,
        usage: Usage,
        text: Option<String>,
    },
    /// The generation failed or was cut short (timeout, shutdown).
    Failed(ApiError),
}

/// The model under every allowed policy, and the queue in front of it.
#[derive(Debug)]
pub struct Engine {
    model_name: String,
    runtimes: BTreeMap<String, Runtime>,
    default_policy: String,
    /// Batch places plus queue places: a request that gets none is refused with 429.
    admission: Arc<Semaphore>,
    scheduler: Scheduler,
    timeout: Duration,
    /// Limits on `max_tokens`.
    pub max_tokens_limit: usize,
    pub default_max_tokens: usize,
    metrics: Arc<Metrics>,
    draining: AtomicBool,
    abort: Arc<AtomicBool>,
    next_id: AtomicU64,
    /// Batch places plus queue places.
    capacity: usize,
    rag: Option<RagService>,
    /// The heads explain reports on, best first (none: explain is off).
    explain_heads: Option<Vec<(usize, usize)>>,
}

impl Engine {
    /// An engine serving `runtimes` (preset name to runtime, all over the same model)
    /// under the queue and time limits of `cfg`.
    pub fn new(
        model_name: String,
        runtimes: BTreeMap<String, Runtime>,
        cfg: &ServeConfig,
    ) -> crate::Result<Self> {
        if !runtimes.contains_key(&cfg.default_policy) {
            return Err(crate::Error::invalid(
                "default_policy",
                format!(
                    "`{}` is not among the policies ({})",
                    cfg.default_policy,
                    runtimes.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
        let scheduler = Scheduler::new(
            runtimes.clone(),
            SchedulerConfig {
                max_batch: cfg.max_concurrency,
                kv_budget: cfg.kv_budget_bytes(),
                prefill_tokens: cfg.prefill_tokens,
                prefix_cache_bytes: (cfg.prefix_cache_mib * 1024.0 * 1024.0) as usize,
            },
        )?;
        if let Some(budget) = cfg.kv_budget_bytes() {
            // The smallest request of the default policy: a one-token prompt and the
            // default `max_tokens`.
            let need = scheduler.reservation(&cfg.default_policy, 1, cfg.default_max_tokens)?;
            if need > budget {
                return Err(crate::Error::invalid(
                    "kv_budget_mib",
                    format!(
                        "{budget} bytes is less than one request needs ({need} bytes under \
                         `{}` for a one-token prompt and {} new tokens)",
                        cfg.default_policy, cfg.default_max_tokens
                    ),
                ));
            }
        }
        let metrics = Arc::new(Metrics::default());
        metrics
            .kv_budget_bytes
            .set(cfg.kv_budget_bytes().unwrap_or(0) as i64);
        Ok(Self {
            model_name,
            runtimes,
            default_policy: cfg.default_policy.clone(),
            admission: Arc::new(Semaphore::new(cfg.max_concurrency + cfg.max_queue)),
            scheduler,
            timeout: Duration::from_secs_f64(cfg.request_timeout_secs),
            max_tokens_limit: cfg.max_tokens_limit,
            default_max_tokens: cfg.default_max_tokens.min(cfg.max_tokens_limit),
            metrics,
            draining: AtomicBool::new(false),
            abort: Arc::new(AtomicBool::new(false)),
            next_id: AtomicU64::new(1),
            capacity: cfg.max_concurrency + cfg.max_queue,
            rag: None,
            explain_heads: None,
        })
    }

    /// The same engine explaining tokens with `heads` (best first).
    pub fn with_explain_heads(mut self, heads: Vec<(usize, usize)>) -> Self {
        self.explain_heads = Some(heads);
        self
    }

    /// The heads explain reports on, best first; `None` when explain is off.
    pub fn explain_heads(&self) -> Option<&[(usize, usize)]> {
        self.explain_heads.as_deref()
    }

    /// The same engine answering `"rag"` requests with `rag`.
    pub fn with_rag(mut self, rag: RagService) -> Self {
        self.rag = Some(rag);
        self
    }

    /// The trigger a request names, or a 400 naming the allowed ones.
    pub fn trigger(&self, name: &str) -> Result<TriggerConfig, ApiError> {
        let allowed = self
            .rag
            .as_ref()
            .map(|r| r.triggers.keys().cloned().collect::<Vec<_>>().join(", "))
            .filter(|a| !a.is_empty())
            .unwrap_or_else(|| "none; the server has no rag_index".into());
        self.rag
            .as_ref()
            .and_then(|r| r.triggers.get(name).cloned())
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("headwise.rag"),
                    format!("unknown rag trigger `{name}` (allowed: {allowed})"),
                )
            })
    }

    /// The model's name in the API.
    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// The allowed presets.
    pub fn policies(&self) -> impl Iterator<Item = &str> {
        self.runtimes.keys().map(String::as_str)
    }

    /// The metrics, the scheduler's gauges brought up to date.
    pub fn metrics(&self) -> &Metrics {
        let load = self.scheduler.load();
        let get = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as i64;
        let m = &self.metrics;
        m.kv_reserved_bytes.set(get(&load.reserved_bytes));
        m.kv_used_bytes.set(get(&load.used_bytes));
        m.batch_size.set(get(&load.running));
        m.batch_steps.set(load.steps.load(Ordering::Relaxed) as i64);
        m.batch_rows.set(load.rows.load(Ordering::Relaxed) as i64);
        m.batch_prompt_rows
            .set(load.prompt_rows.load(Ordering::Relaxed) as i64);
        m.batch_mixed_steps
            .set(load.mixed_steps.load(Ordering::Relaxed) as i64);
        m.prefix_hits
            .set(load.prefix_hits.load(Ordering::Relaxed) as i64);
        m.prefix_tokens
            .set(load.prefix_tokens.load(Ordering::Relaxed) as i64);
        m.prefix_bytes.set(get(&load.prefix_bytes));
        m
    }

    /// A fresh response id with `prefix`.
    pub fn next_id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// The runtime of preset `name` (the default when `None`), or a 400 naming the
    /// allowed ones.
    pub fn runtime(&self, name: Option<&str>) -> Result<(&str, &Runtime), ApiError> {
        let name = name.unwrap_or(&self.default_policy);
        self.runtimes
            .get_key_value(name)
            .map(|(k, v)| (k.as_str(), v))
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("headwise.policy"),
                    format!(
                        "unknown policy `{name}` (allowed: {})",
                        self.policies().collect::<Vec<_>>().join(", ")
                    ),
                )
                .with_code("policy_not_allowed")
            })
    }

    /// Whether the server is shutting down.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Refuse new requests from now on.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Cut every running generation short at its next token.
    pub fn abort_all(&self) {
        self.abort.store(true, Ordering::SeqCst);
    }

    /// Requests admitted and not yet finished (queued or running).
    pub fn in_flight(&self) -> usize {
        self.capacity - self.admission.available_permits()
    }

    /// Admit `job` and queue it for the batch: 429 when the queue is full, 503 while
    /// shutting down, 504 when the deadline passes before it enters the batch, 400 for a
    /// request that alone needs more KV than the budget. Returns once it is in the batch;
    /// the receiver gets the generation's events, and dropping it cancels the generation.
    pub async fn submit(self: &Arc<Self>, job: Job) -> Result<UnboundedReceiver<Event>, ApiError> {
        let start = Instant::now();
        let deadline = start + self.timeout;
        if self.draining() {
            return Err(shutting_down());
        }
        let admitted = Arc::clone(&self.admission)
            .try_acquire_owned()
            .map_err(|_| {
                ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "the server is at capacity; retry later",
                )
                .with_code("queue_full")
            })?;
        let (tx, mut rx) = unbounded_channel();
        if let Some((trigger, question)) = job.rag.clone() {
            let engine = Arc::clone(self);
            tokio::task::spawn_blocking(move || {
                let event = match engine.runtime(Some(&job.policy)) {
                    Ok((_, rt)) => {
                        let _active = GaugeGuard::inc(&engine.metrics.active_sequences);
                        engine.run_rag(rt, &job, &trigger, &question, 0.0)
                    }
                    Err(e) => Event::Failed(e),
                };
                drop(admitted);
                let _ = tx.send(event);
            });
            return Ok(rx);
        }
        let (entered, in_batch) = oneshot::channel();
        self.metrics.queue_depth.inc();
        let sink = Generation {
            policy: job.policy.clone(),
            tx,
            entered: Some(entered),
            permit: Some(admitted),
            metrics: Arc::clone(&self.metrics),
            kv: KvTracker::new(self.metrics.kv(&job.policy)),
            matcher: StopMatcher::new(job.stops),
            top_logprobs: job.top_logprobs,
            logprobs: Vec::new(),
            explain: Vec::new(),
            lm: self.runtime(Some(&job.policy))?.1.shared_model(),
            abort: Arc::clone(&self.abort),
            deadline,
            start,
            queue_secs: None,
            cut: None,
        };
        if let Err(e) = self
            .scheduler
            .submit(&job.policy, &job.request, Box::new(sink))
        {
            // The sink was dropped unqueued: it counted itself out of the queue.
            return Err(e.into());
        }
        match tokio::time::timeout_at(deadline.into(), in_batch).await {
            Ok(Ok(())) => Ok(rx),
            // Failed before it entered the batch: its one event says why.
            Ok(Err(_)) => Err(match rx.try_recv() {
                Ok(Event::Failed(e)) => e,
                _ => shutting_down(),
            }),
            // Still queued: the scheduler drops it (its deadline has passed).
            Err(_) => Err(timed_out()),
        }
    }
}

/// One generation in the batch: its events to the request's handler, its metrics.
struct Generation {
    policy: String,
    tx: UnboundedSender<Event>,
    /// Told when the request enters the batch.
    entered: Option<oneshot::Sender<()>>,
    /// Its place among the requests in flight, released before the end is sent.
    permit: Option<OwnedSemaphorePermit>,
    metrics: Arc<Metrics>,
    kv: KvTracker,
    matcher: StopMatcher,
    top_logprobs: Option<usize>,
    logprobs: Vec<TokenLogprob>,
    /// Explained tokens not yet sent.
    explain: Vec<TokenExplain>,
    /// The model's tokenizer, for log-probabilities.
    lm: Arc<LoadedModel>,
    abort: Arc<AtomicBool>,
    deadline: Instant,
    start: Instant,
    /// Seconds from arrival to the batch, once there.
    queue_secs: Option<f64>,
    /// Why it was cut short.
    cut: Option<&'static str>,
}

impl Generation {
    /// Why the generation must stop now, if it must.
    fn reason(&self) -> Option<&'static str> {
        if self.tx.is_closed() {
            Some("disconnect")
        } else if self.abort.load(Ordering::SeqCst) {
            Some("shutdown")
        } else if Instant::now() >= self.deadline {
            Some("timeout")
        } else {
            None
        }
    }

    /// The final event for `result`; none when the client has gone.
    fn last_event(&mut self, result: crate::Result<GenerateOutput>) -> Option<Event> {
        let out = match result {
            Ok(out) => out,
            Err(e) => return Some(Event::Failed(e.into())),
        };
        self.metrics
            .prompt_tokens
            .inc_by(out.stats.prompt_tokens as u64);
        self.metrics
            .completion_tokens
            .inc_by(out.stats.generated_tokens as u64);
        // Cut short by the client, the deadline or the shutdown; a stop string also ends
        // the generation early, but is a normal end.
        let cut = match out.stats.finish == "cancelled" {
            true => self.cut.or_else(|| {
                (!self.matcher.stopped()).then(|| self.reason().unwrap_or("disconnect"))
            }),
            false => None,
        };
        if let Some(reason) = cut {
            self.metrics.cancel(reason);
            return match reason {
                "timeout" => Some(Event::Failed(timed_out())),
                "shutdown" => Some(Event::Failed(shutting_down())),
                _ => None,
            };
        }
        let rest = self.matcher.finish();
        let logprobs = std::mem::take(&mut self.logprobs);
        let explain = std::mem::take(&mut self.explain);
        if !rest.is_empty() || !logprobs.is_empty() || !explain.is_empty() {
            let _ = self.tx.send(Event::Text {
                text: rest,
                logprobs,
                explain,
            });
        }
        let s = &out.stats;
        let usage = Usage {
            prompt_tokens: s.prompt_tokens,
            completion_tokens: s.generated_tokens,
            total_tokens: s.prompt_tokens + s.generated_tokens,
            prompt_tokens_details: Some(PromptTokensDetails {
                cached_tokens: s.cached_prompt_tokens,
            }),
            headwise: HeadwiseUsage {
                policy: self.policy.clone(),
                kv_bytes: s.kv.end.hot,
                kv_cold_bytes: s.kv.end.cold,
                kv_peak_bytes: s.kv.peak.total(),
                kv_prefill_peak_bytes: s.kv.prefill_peak,
                prefill_tok_s: s.prefill_tok_s,
                decode_tok_s: s.decode_tok_s,
                queue_secs: self.queue_secs.unwrap_or(0.0),
                cached_prompt_tokens: s.cached_prompt_tokens,
                kv_shared_bytes: s.kv.shared.total(),
                retrievals: None,
            },
        };
        let finish = if self.matcher.stopped() || s.finish == "stop" {
            "stop"
        } else {
            "length"
        };
        Some(Event::Done {
            finish,
            usage,
            text: None,
        })
    }
}

impl Sink for Generation {
    fn admitted(&mut self) {
        self.metrics.queue_depth.dec();
        self.metrics.active_sequences.inc();
        self.queue_secs = Some(self.start.elapsed().as_secs_f64());
        if let Some(entered) = self.entered.take() {
            let _ = entered.send(());
        }
    }

    fn token(&mut self, step: &Step) -> bool {
        self.kv.set(step.kv.total());
        if let Some(n) = self.top_logprobs {
            match token_logprob(&self.lm, step, n) {
                Ok(lp) => self.logprobs.push(lp),
                Err(_) => return false,
            }
        }
        if let Some(e) = step.explain {
            self.explain.push(e.clone());
        }
        let text = self.matcher.push(step.text);
        if !text.is_empty() {
            let event = Event::Text {
                text,
                logprobs: std::mem::take(&mut self.logprobs),
                explain: std::mem::take(&mut self.explain),
            };
            if self.tx.send(event).is_err() {
                self.cut = Some("disconnect");
                return false;
            }
        }
        self.cut = self.reason();
        self.cut.is_none() && !self.matcher.stopped()
    }

    fn done(mut self: Box<Self>, result: crate::Result<GenerateOutput>) {
        // The generation's cache is gone once it has left the batch.
        self.kv.set(0);
        let event = match self.entered.is_some() {
            // Never entered the batch: the submitter hears of it through `entered`.
            true => {
                if let Some(reason) = self.reason() {
                    self.metrics.cancel(reason);
                }
                match result {
                    Err(e) => Some(Event::Failed(e.into())),
                    Ok(_) => None,
                }
            }
            false => {
                self.metrics.active_sequences.dec();
                self.last_event(result)
            }
        };
        // Free the place before the client hears of the end, so that it can send its
        // next request at once.
        self.permit.take();
        if let Some(event) = event {
            let _ = self.tx.send(event);
        }
    }

    fn cancelled(&self) -> bool {
        self.reason().is_some()
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if self.entered.is_some() {
            // Left the queue without entering the batch.
            self.metrics.queue_depth.dec();
        }
    }
}

impl Engine {
    /// Answer `question` through the RAG loop (full cache, greedy; not cancellable
    /// mid-answer: it is bounded by `max_tokens` per segment and the retrieval cap).
    fn run_rag(
        &self,
        rt: &Runtime,
        job: &Job,
        trigger: &TriggerConfig,
        question: &str,
        queue_secs: f64,
    ) -> Event {
        let Some(rag) = &self.rag else {
            return Event::Failed(ApiError::invalid(
                Some("headwise.rag"),
                "the server has no rag_index",
            ));
        };
        let item = QaItem {
            id: String::new(),
            question: question.to_string(),
            answers: Vec::new(),
            paragraphs: Vec::new(),
        };
        let cfg = RagConfig {
            trigger: trigger.clone(),
            query: QueryConfig::Qfs { words: 25 },
            context: ContextMode::Retrieved,
            passages: 3,
            max_retrievals: 3,
            on_retriever_error: OnRetrieverError::Continue,
            in_context: None,
        };
        let opts = AnswerOptions {
            max_new: job.request.max_tokens,
            chat: rt.model().chat_template.is_some(),
            engine: &Instrumented,
        };
        let t0 = Instant::now();
        match answer(
            rt.model(),
            &item,
            &cfg,
            Some(&rag.index),
            &rag.stopwords,
            None,
            opts,
        ) {
            Ok(a) => {
                self.metrics.retrievals.inc_by(a.retrievals.len() as u64);
                self.metrics
                    .completion_tokens
                    .inc_by(a.generated_tokens as u64);
                let secs = t0.elapsed().as_secs_f64().max(1e-9);
                Event::Done {
                    finish: "stop",
                    usage: Usage {
                        prompt_tokens: a.prompt_tokens,
                        completion_tokens: a.generated_tokens,
                        total_tokens: a.prompt_tokens + a.generated_tokens,
                        prompt_tokens_details: None,
                        headwise: HeadwiseUsage {
                            policy: job.policy.clone(),
                            kv_bytes: 0,
                            kv_cold_bytes: 0,
                            kv_peak_bytes: 0,
                            kv_prefill_peak_bytes: 0,
                            prefill_tok_s: 0.0,
                            decode_tok_s: a.generated_tokens as f64 / secs,
                            queue_secs,
                            cached_prompt_tokens: 0,
                            kv_shared_bytes: 0,
                            retrievals: Some(a.retrievals.len()),
                        },
                    },
                    text: Some(a.answer),
                }
            }
            Err(e) => Event::Failed(e.into()),
        }
    }
}

fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "the server is shutting down",
    )
    .with_code("shutting_down")
}

fn timed_out() -> ApiError {
    ApiError::new(
        StatusCode::GATEWAY_TIMEOUT,
        "timeout_error",
        "the request took longer than the server's request timeout",
    )
    .with_code("timeout")
}

/// Increments a gauge now and decrements it when dropped (also when a waiting
/// request's future is dropped).
struct GaugeGuard<'a>(&'a Gauge);

impl<'a> GaugeGuard<'a> {
    fn inc(g: &'a Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One generation's share of a KV gauge.
struct KvTracker {
    gauge: Gauge,
    held: i64,
}

impl KvTracker {
    fn new(gauge: Gauge) -> Self {
        Self { gauge, held: 0 }
    }

    fn set(&mut self, bytes: usize) {
        let bytes = bytes as i64;
        self.gauge.inc_by(bytes - self.held);
        self.held = bytes;
    }
}

impl Drop for KvTracker {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// The log-probability of the step's token and of the `n` likeliest tokens, from the
/// log-softmax of the model's logits (before temperature and top-p).
fn token_logprob(lm: &LoadedModel, step: &Step, n: usize) -> crate::Result<TokenLogprob> {
    let logits: Vec<f32> = step
        .logits
        .flatten_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1()?;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(order.len());
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
    if n > 0 && n < order.len() {
        order.select_nth_unstable_by(n - 1, by_logit);
    }
    order.truncate(n);
    order.sort_by(by_logit);
    let entry = |id: u32| -> crate::Result<TopLogprob> {
        let token = lm.decode(&[id])?;
        Ok(TopLogprob {
            bytes: token.as_bytes().to_vec(),
            token,
            logprob: logits[id as usize] - log_z,
        })
    };
    let own = entry(step.token)?;
    Ok(TokenLogprob {
        token: own.token,
        logprob: own.logprob,
        bytes: own.bytes,
        top_logprobs: order.into_iter().map(entry).collect::<crate::Result<_>>()?,
    })
}
