//! The library entry point for serving stacks: a model with a resolved policy, and
//! `generate` with a streaming callback and per-request statistics.
//!
//! ```no_run
//! use headwise::policy::{GenerateRequest, Policy, Prompt, Runtime};
//!
//! let runtime = Runtime::builder()
//!     .model("models/SmolLM2-135M-Instruct.Q4_1.gguf")
//!     .policy(Policy::load("policies/static-locos.toml".as_ref(), &[])?)
//!     .build()?;
//! let request = GenerateRequest::new(Prompt::Text("The capital of France is".into()), 16);
//! let out = runtime.generate(&request, &mut |step| {
//!     print!("{}", step.text);
//!     true
//! })?;
//! eprintln!("{}", out.stats);
//! # Ok::<(), headwise::Error>(())
//! ```

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Tensor;

use serde::{Deserialize, Serialize};

use crate::model::text::chat::ChatMessage;
use crate::model::{
    GenerateOptions, KvBytes, LoadedModel, ModelId, Numerics, Sampling, StopReason, TextStream,
};
use crate::policy::config::Policy;
use crate::policy::explain::{fill_text, ExplainConfig, TokenExplain};
use crate::policy::generate::{Decoding, KvStats, PolicyGeneration};
use crate::policy::plan::Plan;
use crate::{Error, Result};

/// A loaded model and a resolved policy. Runtimes made with [`Runtime::with_policy`]
/// share one copy of the weights.
#[derive(Clone)]
pub struct Runtime {
    lm: Arc<LoadedModel>,
    id: Arc<ModelId>,
    plan: Plan,
}

/// Builds a [`Runtime`]; every check happens in [`RuntimeBuilder::build`].
#[derive(Debug, Clone, Default)]
pub struct RuntimeBuilder {
    model: Option<PathBuf>,
    policy: Option<Policy>,
    probe: Option<PathBuf>,
    base: Option<PathBuf>,
    chunk: Option<usize>,
}

impl RuntimeBuilder {
    /// The GGUF model file.
    pub fn model(mut self, path: impl Into<PathBuf>) -> Self {
        self.model = Some(path.into());
        self
    }

    /// The policy [default: `full`].
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = Some(policy);
        self
    }

    /// The probe card of the policy's `dynamic_heads` part (overrides the file's).
    pub fn probe(mut self, path: impl Into<PathBuf>) -> Self {
        self.probe = Some(path.into());
        self
    }

    /// The folder relative paths in the policy are read from [default: the current one].
    pub fn base_dir(mut self, path: impl Into<PathBuf>) -> Self {
        self.base = Some(path.into());
        self
    }

    /// Positions per forward pass of a prompt's prefill, at least 1 [default:
    /// [`crate::model::DEFAULT_CHUNK`]]. Every generation of the runtime (alone or in a
    /// [`crate::policy::Scheduler`]'s batch) prefills in chunks of this size, so a
    /// scheduler can run decode steps between any two of them; each size is its own
    /// summation order (logits differ from another size's in the last bits). At 1 every
    /// prompt position is a decode step, and a scheduler runs them as rows of its
    /// batched step.
    pub fn prefill_chunk(mut self, chunk: usize) -> Self {
        self.chunk = Some(chunk);
        self
    }

    /// Load the model and resolve the policy against it.
    pub fn build(self) -> Result<Runtime> {
        let path = self
            .model
            .ok_or_else(|| Error::invalid("model", "no model file given"))?;
        let mut policy = self.policy.unwrap_or_else(Policy::full);
        if let Some(probe) = self.probe {
            policy = policy.with_probe(probe)?;
        }
        let id = ModelId::of_file(&path)?;
        let mut lm = LoadedModel::load(&path, Numerics::Fast)?;
        match self.chunk {
            Some(0) => return Err(Error::invalid("prefill_chunk", "0 (must be at least 1)")),
            Some(chunk) => lm.model.set_chunk(chunk),
            None => {}
        }
        let base = self.base.unwrap_or_else(|| PathBuf::from("."));
        let plan = Plan::resolve(&policy, lm.model.config(), &id, &base)?.with_text(&lm)?;
        Ok(Runtime {
            lm: Arc::new(lm),
            id: Arc::new(id),
            plan,
        })
    }
}

/// What to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Raw text (BOS added where the model expects it).
    Text(String),
    /// Messages rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
    /// Token ids as they are.
    Tokens(Vec<u32>),
}

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Keep generating through end-of-turn tokens (always `max_tokens` tokens).
    pub ignore_eos: bool,
    /// Explain every token ([`Step::explain`]).
    pub explain: Option<ExplainConfig>,
}

impl GenerateRequest {
    /// Greedy generation of at most `max_tokens` tokens.
    pub fn new(prompt: Prompt, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling: Sampling::default(),
            ignore_eos: false,
            explain: None,
        }
    }
}

/// One generated token, as the callback of [`Runtime::generate`] sees it.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    /// The token id.
    pub token: u32,
    /// The text this token completes: empty for an end-of-turn token and while a
    /// multi-byte character is still incomplete.
    pub text: &'a str,
    /// Logits `(1, vocab)` the token was drawn from.
    pub logits: &'a Tensor,
    /// Resident KV bytes after the step.
    pub kv: KvBytes,
    /// The token explained, when the request asked.
    pub explain: Option<&'a TokenExplain>,
}

/// What one generation did and cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationStats {
    /// The policy's name.
    pub policy: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt tokens per second (up to the first generated token).
    pub prefill_tok_s: f64,
    /// Tokens per second after the first.
    pub decode_tok_s: f64,
    /// Resident KV bytes, per tier: now, at peak, during the prefill.
    pub kv: KvStats,
    /// Why generation ended: `stop`, `length` or `cancelled`.
    pub finish: String,
    /// Prompt tokens taken from a shared prefix ([`crate::policy::prefix`]) instead
    /// of prefilled.
    #[serde(default)]
    pub cached_prompt_tokens: usize,
}

impl fmt::Display for GenerationStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        write!(
            f,
            "policy {}: prompt {} tokens, prefill {:.1} tok/s; generated {} tokens, decode {:.1} tok/s; \
             KV hot {:.2} MiB (peak {:.2}), cold {:.2} MiB, prefill peak {:.2} MiB",
            self.policy,
            self.prompt_tokens,
            self.prefill_tok_s,
            self.generated_tokens,
            self.decode_tok_s,
            mib(self.kv.end.hot),
            mib(self.kv.peak.hot),
            mib(self.kv.end.cold),
            mib(self.kv.prefill_peak),
        )?;
        if let Some(a) = self.kv.mean_active_kv_heads {
            write!(f, ", {a:.1} KV heads read the cold tier per step")?;
        }
        Ok(())
    }
}

/// A finished generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOutput {
    /// The generated text (stop tokens left out).
    pub text: String,
    /// Generated ids, a final stop token included.
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
}

impl Runtime {
    /// Start building a runtime.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// The model with its tokenizer.
    pub fn model(&self) -> &LoadedModel {
        &self.lm
    }

    /// The model with its tokenizer, shared (no copy).
    pub fn shared_model(&self) -> Arc<LoadedModel> {
        Arc::clone(&self.lm)
    }

    /// The model file's identity.
    pub fn model_id(&self) -> &ModelId {
        &self.id
    }

    /// The resolved policy.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The same model (shared, not reloaded) under another policy; relative paths in
    /// it are read from `base`.
    pub fn with_policy(&self, policy: &Policy, base: &Path) -> Result<Runtime> {
        let plan =
            Plan::resolve(policy, self.lm.model.config(), &self.id, base)?.with_text(&self.lm)?;
        Ok(Runtime {
            lm: Arc::clone(&self.lm),
            id: Arc::clone(&self.id),
            plan,
        })
    }

    /// The prompt's token ids.
    pub fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Text(t) => self.lm.encode(t, true),
            Prompt::Chat(m) => self.lm.chat_prompt(m),
            Prompt::Tokens(ids) => Ok(ids.clone()),
        }
    }

    /// Generate, handing every token with its text to `on_step`, which may return
    /// `false` to stop.
    pub fn generate(
        &self,
        request: &GenerateRequest,
        on_step: &mut dyn FnMut(&Step) -> bool,
    ) -> Result<GenerateOutput> {
        let ids = self.encode(&request.prompt)?;
        let opts = self.options(request);
        let mut decoding = Decoding::start(&self.lm.model, &self.plan, &ids, &opts, None, None)?;
        if let Some(cfg) = &request.explain {
            decoding.explain(cfg.clone())?;
        }
        let mut text = TextOut::default();
        let stop = loop {
            decoding.prepare()?;
            let logits = decoding.step()?;
            let token = decoding.advance(&logits)?;
            let explain = self.explained(&mut decoding, &ids);
            let step = Step {
                token,
                text: text.push(self, token)?,
                logits: &logits,
                kv: decoding.kv_bytes(),
                explain: explain.as_ref(),
            };
            if !on_step(&step) {
                break StopReason::Cancelled;
            }
            if let Some(stop) = decoding.stopped() {
                break stop;
            }
        };
        Ok(self.output(decoding.finish(stop), text.text))
    }

    /// The token `decoding` has just advanced by, explained, with the text of `prompt`
    /// around each position its heads read; `None` unless it explains.
    pub(crate) fn explained(
        &self,
        decoding: &mut Decoding,
        prompt: &[u32],
    ) -> Option<TokenExplain> {
        let mut e = decoding.take_explained()?;
        let context = decoding.explain_context();
        fill_text(&mut e, prompt, context, &|ids| {
            self.lm.decode(ids).unwrap_or_default()
        });
        Some(e)
    }

    /// The options a request generates with.
    pub(crate) fn options(&self, request: &GenerateRequest) -> GenerateOptions {
        GenerateOptions {
            max_new: request.max_tokens,
            sampling: request.sampling,
            context_len: None,
            stop: if request.ignore_eos {
                Vec::new()
            } else {
                self.lm.special.stop.clone()
            },
        }
    }

    /// The finished generation `out` with its `text`.
    pub(crate) fn output(&self, out: PolicyGeneration, text: String) -> GenerateOutput {
        let g = &out.generation;
        let stats = GenerationStats {
            policy: self.plan.name.clone(),
            prompt_tokens: g.prompt_tokens,
            generated_tokens: g.tokens.len(),
            prefill_tok_s: g.prefill_tok_s(),
            decode_tok_s: g.decode_tok_s(),
            kv: out.kv,
            finish: match g.stop {
                StopReason::Stop => "stop",
                StopReason::Length => "length",
                StopReason::Cancelled => "cancelled",
            }
            .into(),
            cached_prompt_tokens: out.cached_tokens,
        };
        GenerateOutput {
            text,
            tokens: out.generation.tokens,
            stats,
        }
    }
}

/// A generation's text as its tokens arrive: stop tokens left out, multi-byte
/// characters released once whole.
#[derive(Debug, Default)]
pub(crate) struct TextOut {
    stream: TextStream,
    piece: String,
    /// Everything released so far.
    pub(crate) text: String,
}

impl TextOut {
    /// Add `token`; the text it releases (empty for a stop token or an incomplete
    /// character).
    pub(crate) fn push(&mut self, rt: &Runtime, token: u32) -> Result<&str> {
        self.piece.clear();
        if !rt.lm.special.stop.contains(&token) {
            if let Some(p) = self.stream.push(&rt.lm.tokenizer, token)? {
                self.piece = p;
            }
        }
        self.text.push_str(&self.piece);
        Ok(&self.piece)
    }
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime")
            .field("model", &self.id.name)
            .field("policy", &self.plan.name)
            .finish()
    }
}
