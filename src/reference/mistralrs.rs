//! mistral.rs as the reference engine.
//!
//! [`MistralRsEngine`] loads the same GGUF file as the instrumented model through
//! mistralrs-core 0.8.1 and exposes, as plain synchronous calls:
//!
//! - tokenization as mistral.rs does it ([`MistralRsEngine::tokenize`]);
//! - teacher-forced logits of every position, the parity oracle
//!   ([`MistralRsEngine::logits`], shape `(tokens, vocab)`);
//! - greedy continuation of token ids ([`MistralRsEngine::generate_greedy`]);
//! - streaming chat and raw-text generation with mistral.rs's own chat template and
//!   sampler ([`MistralRsEngine::chat_stream`], [`MistralRsEngine::complete_stream`]).
//!
//! How it is set up (`docs/parity.md` says why):
//!
//! - weights come from the local GGUF file only; the tokenizer and chat template are
//!   built from its metadata; nothing touches the network;
//! - activations are F32 on the CPU (`ModelDType::Auto` would pick BF16 there), eager
//!   attention (no paged attention), the prefix cache is disabled and one sequence runs
//!   at a time, so every request starts from an empty KV cache;
//! - the engine is built with `disable_eos_stop`: stopping on EOS is requested per call
//!   by passing the model's EOS ids as stop tokens, which mistral.rs treats exactly as
//!   an EOS stop. That is what lets [`MistralRsEngine::generate_greedy`] run past EOS;
//! - mistral.rs reports generated *text*, not token ids. Greedy generation therefore
//!   installs a logits processor that takes the argmax of mistral.rs's logits at every
//!   step, records it and masks every other token to `-inf`, so the token mistral.rs
//!   samples is, by construction, the recorded one.
//!
//! mistral.rs's `MistralRsBuilder::build` wants a multi-threaded tokio runtime, so the
//! engine owns one. Requests are sent with blocking channel operations: the methods must
//! be called from synchronous code, not from inside an async runtime.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use either::Either;
use indexmap::IndexMap;
use mistralrs_core::{
    AdapterPaths, Constraint, CustomLogitsProcessor, DefaultSchedulerMethod, DeviceMapSetting,
    GGUFLoaderBuilder, GGUFSpecificConfig, LocalModelPaths, MessageContent, MistralRs,
    MistralRsBuilder, ModelPaths, NormalRequest, Request, RequestMessage, Response, SamplingParams,
    SchedulerConfig, StopTokens, TokenizationRequest, Usage,
};
use tokio::sync::mpsc;

use crate::model::LoadedModel;
use crate::rag::segment::{Judge, SegmentRun, SegmentSource, Watch};
use crate::{Error, Result};

/// Capacity of the per-request response channels; streaming sends one message a token.
const RESPONSE_CHANNEL: usize = 64;

pub use super::GreedyTrace;

/// Throughput of one generation call.
///
/// For [`MistralRsEngine::chat_stream`] the numbers are the `usage` mistral.rs attaches to
/// its last streamed chunk (its timers have millisecond resolution, so a prompt that
/// runs in under a millisecond reports `prefill_tok_s == 0.0`). mistral.rs does not
/// attach `usage` to streamed *completion* chunks, so [`MistralRsEngine::complete_stream`]
/// (and `chat_stream` in the rare case where the last chunk is not delivered) measures
/// the same quantities itself, from the moments mistral.rs hands each step's logits to
/// the sampler: prefill is prompt tokens over the time from sending the request to the
/// first logits, decode is the number of steps after the first over the time from the
/// first to the last logits.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GenerationStats {
    /// Tokens in the prompt as mistral.rs counted them (after the chat template).
    pub prompt_tokens: usize,
    /// Tokens generated, including a final EOS token if generation stopped on one.
    pub generated_tokens: usize,
    /// Prompt tokens per second of the prefill step.
    pub prefill_tok_s: f64,
    /// Generated tokens per second of the decode steps.
    pub decode_tok_s: f64,
}

/// The mistral.rs reference engine over one local GGUF model.
///
/// Cheap to share by reference: every method takes `&self`; requests are serialized
/// internally (one sequence at a time), so calls from several threads queue up.
pub struct MistralRsEngine {
    /// The mistral.rs instance; its engine runs on its own thread.
    mistralrs: Arc<MistralRs>,
    /// Runtime `MistralRsBuilder::build` ran on; kept alive for the engine's lifetime.
    _runtime: tokio::runtime::Runtime,
    /// Model id mistral.rs registered the pipeline under (the GGUF file name).
    model_id: String,
    /// Token ids mistral.rs treats as end of sequence.
    eos_token_ids: Vec<u32>,
    /// Longest sequence (prompt + generated) the model accepts.
    max_seq_len: usize,
    /// Vocabulary size of the tokenizer (special tokens included).
    vocab_size: usize,
    /// Serializes requests: raw logits only work with a batch of one.
    request_lock: Mutex<()>,
}

impl fmt::Debug for MistralRsEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MistralRsEngine")
            .field("model_id", &self.model_id)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("max_seq_len", &self.max_seq_len)
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl MistralRsEngine {
    /// Load a local GGUF file offline: F32 activations, CPU, tokenizer and chat template
    /// from the GGUF metadata, prefix cache disabled, no network.
    ///
    /// Loading includes mistral.rs's own one-token warm-up run.
    ///
    /// Errors: [`Error::Io`] if the file cannot be opened, [`Error::BadGguf`] if its header
    /// is corrupt, [`Error::Engine`] if mistral.rs cannot load it.
    pub fn load(gguf_path: &Path) -> Result<Self> {
        // headwise's own checked reader first: mistral.rs's would allocate from a corrupt
        // header's counts before noticing.
        crate::model::file::gguf::GgufFile::open(gguf_path)?;
        let model_id = gguf_path
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_else(|| gguf_path.display().to_string());

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Error::Engine(format!("cannot start a tokio runtime: {e}")))?;

        let loader = GGUFLoaderBuilder::new(
            None,
            None,
            model_id.clone(),
            vec![model_id.clone()],
            GGUFSpecificConfig { topology: None },
            false,
            None,
        )
        .build();
        // An empty tokenizer path makes mistral.rs build the tokenizer from the GGUF
        // metadata; no template file makes it take the chat template from there too.
        let paths: Box<dyn ModelPaths> = Box::new(LocalModelPaths {
            tokenizer_filename: PathBuf::new(),
            config_filename: PathBuf::new(),
            template_filename: None,
            filenames: vec![gguf_path.to_path_buf()],
            adapter_paths: AdapterPaths::None,
            gen_conf: None,
            preprocessor_config: None,
            processor_config: None,
            chat_template_json_filename: None,
        });

        let (mistralrs, eos_token_ids, max_seq_len, vocab_size) = runtime.block_on(async {
            let pipeline = loader
                .load_model_from_path(
                    &paths,
                    &DType::F32,
                    &Device::Cpu,
                    true,
                    DeviceMapSetting::dummy(),
                    None,
                    None,
                )
                .map_err(|e| Error::Engine(format!("loading {}: {e:#}", gguf_path.display())))?;
            let (eos_token_ids, max_seq_len, vocab_size) = {
                let guard = pipeline.lock().await;
                let metadata = guard.get_metadata();
                let vocab_size = guard
                    .tokenizer()
                    .map(|t| t.get_vocab_size(true))
                    .ok_or_else(|| Error::Engine("the pipeline has no tokenizer".into()))?;
                (metadata.eos_tok.clone(), metadata.max_seq_len, vocab_size)
            };
            let one = std::num::NonZeroUsize::MIN;
            let mistralrs = MistralRsBuilder::new(
                pipeline,
                SchedulerConfig::DefaultScheduler {
                    method: DefaultSchedulerMethod::Fixed(one),
                },
                false,
                None,
            )
            .with_model_id(model_id.clone())
            .with_no_prefix_cache(true)
            .with_disable_eos_stop(true)
            .build()
            .await;
            Ok::<_, Error>((mistralrs, eos_token_ids, max_seq_len, vocab_size))
        })?;

        Ok(Self {
            mistralrs,
            _runtime: runtime,
            model_id,
            eos_token_ids,
            max_seq_len,
            vocab_size,
            request_lock: Mutex::new(()),
        })
    }

    /// The id mistral.rs knows the model by (the GGUF file name).
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// Token ids mistral.rs treats as end of sequence (GGUF `eos_token_id`, plus
    /// alternates such as `<|im_end|>` that the chat template uses).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Longest sequence (prompt plus generated tokens) the model accepts.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Token ids of `text` as mistral.rs tokenizes it (`Request::Tokenize`).
    /// `add_special_tokens` as in HF tokenizers.
    ///
    /// Note: the tokenizer mistral.rs builds from GGUF metadata has no template post
    /// processor, so `add_special_tokens` adds nothing (no BOS) for BPE (`gpt2`)
    /// tokenizers such as SmolLM2's; special-token *text* in `text` (e.g.
    /// `<|im_start|>`) is always mapped to its special id.
    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let (tx, mut rx) = mpsc::channel(1);
        let request = Request::Tokenize(TokenizationRequest {
            text: Either::Right(text.to_string()),
            tools: None,
            add_generation_prompt: false,
            add_special_tokens,
            enable_thinking: None,
            reasoning_effort: None,
            response: tx,
        });
        let _turn = self.turn();
        self.send(request)?;
        match rx.blocking_recv() {
            Some(Ok(ids)) => Ok(ids),
            Some(Err(e)) => Err(Error::Engine(format!("tokenize: {e:#}"))),
            None => Err(Error::Engine(
                "tokenize: the engine dropped the request".into(),
            )),
        }
    }

    /// Teacher-forced logits for every position of `tokens`: `CompletionTokens` +
    /// `return_raw_logits`. Returns a candle Tensor of shape `(tokens.len(), vocab)`,
    /// dtype F32, on CPU; row `i` scores the token that follows `tokens[..=i]`.
    ///
    /// The ids are used as given: nothing (no BOS) is prepended.
    pub fn logits(&self, tokens: &[u32]) -> Result<Tensor> {
        self.check_prompt(tokens, 0)?;
        let (tx, mut rx) = mpsc::channel(RESPONSE_CHANNEL);
        let mut request = self.request(
            RequestMessage::CompletionTokens(tokens.to_vec()),
            SamplingParams {
                max_len: Some(1),
                ..SamplingParams::deterministic()
            },
            tx,
        );
        request.return_raw_logits = true;
        let _turn = self.turn();
        self.send(Request::Normal(Box::new(request)))?;
        let chunks = loop {
            match rx.blocking_recv() {
                Some(Response::Raw { logits_chunks, .. }) => break logits_chunks,
                Some(other) => check_response(other, "logits")?,
                None => {
                    return Err(Error::Engine(
                        "logits: the engine closed the request without logits".into(),
                    ))
                }
            }
        };
        if chunks.is_empty() {
            return Err(Error::Engine("logits: no logits returned".into()));
        }
        let logits = Tensor::cat(&chunks, 0)?;
        let logits = if logits.rank() == 3 && logits.dim(0)? == 1 {
            logits.squeeze(0)?
        } else {
            logits
        };
        let logits = logits.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        match logits.dims() {
            &[n, _] if n == tokens.len() => Ok(logits),
            dims => Err(Error::Engine(format!(
                "logits: expected ({}, vocab), mistral.rs returned {dims:?}",
                tokens.len()
            ))),
        }
    }

    /// Greedy generation of up to `max_new` tokens continuing the given token ids (no
    /// chat template applied); stops early on EOS only if `stop_on_eos`. Returns the
    /// generated token ids.
    ///
    /// When generation stops on EOS, the EOS id is the last element. With
    /// `stop_on_eos == false` exactly `max_new` ids come back: EOS is generated like any
    /// other token and decoding continues after it. Ties between equal logits go to the
    /// lowest token id.
    ///
    /// Errors: [`Error::ContextOverflow`] if `tokens.len() + max_new` exceeds
    /// [`Self::max_seq_len`].
    pub fn generate_greedy(
        &self,
        tokens: &[u32],
        max_new: usize,
        stop_on_eos: bool,
    ) -> Result<Vec<u32>> {
        Ok(self.greedy(tokens, max_new, stop_on_eos)?.0.tokens)
    }

    /// Greedy generation of exactly `max_new` tokens after `tokens` (EOS does not stop
    /// it), timed: returns the generated ids and their [`GenerationStats`].
    ///
    /// The stats are measured here from the moments mistral.rs hands each step's logits
    /// to the sampler (see [`GenerationStats`]), not taken from mistral.rs's `usage`,
    /// whose timers have millisecond resolution. Meant for benchmarks.
    pub fn generate_timed(
        &self,
        tokens: &[u32],
        max_new: usize,
    ) -> Result<(Vec<u32>, GenerationStats)> {
        let (trace, stats) = self.greedy(tokens, max_new, false)?;
        Ok((trace.tokens, stats))
    }

    /// Greedy generation of up to `max_new` tokens after `tokens`, streamed: `on_token`
    /// gets each generated id as soon as mistral.rs has produced it and returns whether
    /// to go on. Returning `false` drops the stream, which cancels the request inside
    /// mistral.rs (it stops a sequence whose receiver is gone). Stops on EOS (the EOS id
    /// is delivered) or after `max_new` tokens. Returns the ids delivered.
    ///
    /// The ids are the argmax tokens a forcing logits processor recorded (mistral.rs
    /// streams text, not ids); they are handed out as the text chunks arrive.
    pub fn stream_greedy(
        &self,
        tokens: &[u32],
        max_new: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<Vec<u32>> {
        self.check_prompt(tokens, max_new)?;
        if max_new == 0 {
            return Ok(Vec::new());
        }
        let (tx, mut rx) = mpsc::channel(RESPONSE_CHANNEL);
        let (mut request, recorder) = self.forced_greedy(tokens, max_new, true, tx);
        request.is_streaming = true;
        let _turn = self.turn();
        self.send(Request::Normal(Box::new(request)))?;
        let mut delivered: Vec<u32> = Vec::new();
        // Hands out what the recorder holds beyond what was delivered; false: stop.
        let mut deliver = |delivered: &mut Vec<u32>| -> Result<bool> {
            let new: Vec<u32> = recorder.finish()?.tokens[delivered.len()..].to_vec();
            for t in new {
                delivered.push(t);
                if !on_token(t)? {
                    return Ok(false);
                }
            }
            Ok(true)
        };
        while let Some(response) = rx.blocking_recv() {
            let finished = match response {
                Response::CompletionChunk(chunk) => {
                    chunk.choices.iter().any(|c| c.finish_reason.is_some())
                }
                other => {
                    check_response(other, "stream")?;
                    false
                }
            };
            if !deliver(&mut delivered)? {
                return Ok(delivered);
            }
            if finished {
                break;
            }
        }
        deliver(&mut delivered)?;
        Ok(delivered)
    }

    /// Greedy generation with a forcing [`StepRecorder`]; the stats are measured.
    fn greedy(
        &self,
        tokens: &[u32],
        max_new: usize,
        stop_on_eos: bool,
    ) -> Result<(GreedyTrace, GenerationStats)> {
        self.check_prompt(tokens, max_new)?;
        if max_new == 0 {
            return Ok((
                GreedyTrace::default(),
                GenerationStats {
                    prompt_tokens: tokens.len(),
                    ..GenerationStats::default()
                },
            ));
        }
        let (tx, mut rx) = mpsc::channel(RESPONSE_CHANNEL);
        let (request, recorder) = self.forced_greedy(tokens, max_new, stop_on_eos, tx);
        let _turn = self.turn();
        let started = Instant::now();
        self.send(Request::Normal(Box::new(request)))?;
        let usage = loop {
            match rx.blocking_recv() {
                Some(Response::CompletionDone(done)) => break done.usage,
                Some(other) => check_response(other, "generate")?,
                None => {
                    return Err(Error::Engine(
                        "generate: the engine closed the request before it finished".into(),
                    ))
                }
            }
        };
        let log = recorder.finish()?;
        if log.tokens.len() != usage.completion_tokens {
            return Err(Error::Engine(format!(
                "generate: recorded {} greedy steps but mistral.rs reports {} generated tokens",
                log.tokens.len(),
                usage.completion_tokens
            )));
        }
        let stats = log.stats(started);
        Ok((
            GreedyTrace {
                tokens: log.tokens,
                top2_gaps: log.gaps,
            },
            stats,
        ))
    }

    /// Greedy generation of exactly `max_new` tokens (EOS does not stop it), with the gap
    /// between the two largest logits at every step: the margin by which each token won.
    pub fn greedy_trace(&self, tokens: &[u32], max_new: usize) -> Result<GreedyTrace> {
        Ok(self.greedy(tokens, max_new, false)?.0)
    }

    /// Streaming chat generation: messages are `(role, content)` pairs rendered by
    /// mistral.rs's own chat template (with the generation prompt); greedy when
    /// `temperature` is `None` (or 0). Calls `on_text` with each new text piece as it
    /// arrives; returns stats (prompt tokens, generated tokens, prefill and decode
    /// tokens per second) as mistral.rs reports them in its usage.
    ///
    /// Generation stops on EOS or after `max_new` tokens. Special tokens are not
    /// rendered into the text, and mistral.rs trims leading whitespace off the first
    /// piece. `top_p` must lie in `(0, 1]`; `max_new` must be at least 1.
    pub fn chat_stream(
        &self,
        messages: &[(String, String)],
        max_new: usize,
        temperature: Option<f64>,
        top_p: Option<f64>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerationStats> {
        if messages.is_empty() {
            return Err(Error::invalid("messages", "at least one message is needed"));
        }
        // The messages' own tokens: a lower bound on the rendered prompt (the template
        // adds a few), enough to refuse what cannot fit before mistral.rs runs.
        let mut content_tokens = 0usize;
        for (_, content) in messages {
            content_tokens += self.tokenize(content, false)?.len();
        }
        self.check_room(content_tokens, max_new)?;
        let messages = messages
            .iter()
            .map(|(role, content)| {
                let mut message: IndexMap<String, MessageContent> = IndexMap::new();
                message.insert("role".to_string(), Either::Left(role.clone()));
                message.insert("content".to_string(), Either::Left(content.clone()));
                message
            })
            .collect();
        let message = RequestMessage::Chat {
            messages,
            enable_thinking: None,
            reasoning_effort: None,
        };
        self.stream(message, max_new, temperature, top_p, on_text)
    }

    /// Same as [`Self::chat_stream`] but for a raw text prompt (completion, no template).
    ///
    /// mistral.rs tokenizes `prompt` with special tokens added (a no-op for SmolLM2's
    /// GGUF tokenizer) and does not report usage for streamed completions, so the stats
    /// are measured here (see [`GenerationStats`]). As in chat, the first piece has its
    /// leading whitespace trimmed: "The capital of France is" streams "Paris", not
    /// " Paris".
    pub fn complete_stream(
        &self,
        prompt: &str,
        max_new: usize,
        temperature: Option<f64>,
        top_p: Option<f64>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerationStats> {
        if prompt.is_empty() {
            return Err(Error::invalid("prompt", "must not be empty"));
        }
        self.check_room(self.tokenize(prompt, true)?.len(), max_new)?;
        let message = RequestMessage::Completion {
            text: prompt.to_string(),
            echo_prompt: false,
            best_of: None,
        };
        self.stream(message, max_new, temperature, top_p, on_text)
    }

    /// Runs one streaming chat or completion request to its end.
    fn stream(
        &self,
        message: RequestMessage,
        max_new: usize,
        temperature: Option<f64>,
        top_p: Option<f64>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerationStats> {
        if max_new == 0 {
            return Err(Error::invalid("max_new", "must be at least 1"));
        }
        let sampling = sampling_params(temperature, top_p)?;
        let recorder = Arc::new(StepRecorder::new(false));
        let (tx, mut rx) = mpsc::channel(RESPONSE_CHANNEL);
        let mut request = self.request(
            message,
            SamplingParams {
                max_len: Some(max_new),
                stop_toks: self.stop_tokens(true),
                ..sampling
            },
            tx,
        );
        request.is_streaming = true;
        let processor: Arc<dyn CustomLogitsProcessor> = recorder.clone();
        request.logits_processors = Some(vec![processor]);

        let _turn = self.turn();
        let started = Instant::now();
        self.send(Request::Normal(Box::new(request)))?;
        let mut usage: Option<Usage> = None;
        // Ends on the chunk that carries a finish reason, or when mistral.rs drops the
        // sequence (it skips the last chunk when the final token is an incomplete
        // UTF-8 sequence).
        while let Some(response) = rx.blocking_recv() {
            let finished = match response {
                Response::Chunk(chunk) => {
                    usage = chunk.usage.or(usage);
                    let mut finished = false;
                    for choice in &chunk.choices {
                        if let Some(text) = choice.delta.content.as_deref() {
                            if !text.is_empty() {
                                on_text(text);
                            }
                        }
                        finished |= choice.finish_reason.is_some();
                    }
                    finished
                }
                Response::CompletionChunk(chunk) => {
                    let mut finished = false;
                    for choice in &chunk.choices {
                        if !choice.text.is_empty() {
                            on_text(&choice.text);
                        }
                        finished |= choice.finish_reason.is_some();
                    }
                    finished
                }
                other => {
                    check_response(other, "generate")?;
                    false
                }
            };
            if finished {
                break;
            }
        }
        let log = recorder.finish()?;
        Ok(match usage {
            Some(usage) => GenerationStats {
                prompt_tokens: usage.prompt_tokens,
                generated_tokens: usage.completion_tokens,
                prefill_tok_s: f64::from(usage.avg_prompt_tok_per_sec),
                decode_tok_s: f64::from(usage.avg_compl_tok_per_sec),
            },
            None => log.stats(started),
        })
    }

    /// A request continuing `tokens` by up to `max_new` greedy tokens, forced through a
    /// [`StepRecorder`] that records them (returned with the request).
    fn forced_greedy(
        &self,
        tokens: &[u32],
        max_new: usize,
        stop_on_eos: bool,
        response: mpsc::Sender<Response>,
    ) -> (NormalRequest, Arc<StepRecorder>) {
        let recorder = Arc::new(StepRecorder::new(true));
        let mut request = self.request(
            RequestMessage::CompletionTokens(tokens.to_vec()),
            SamplingParams {
                max_len: Some(max_new),
                stop_toks: self.stop_tokens(stop_on_eos),
                ..SamplingParams::deterministic()
            },
            response,
        );
        let processor: Arc<dyn CustomLogitsProcessor> = recorder.clone();
        request.logits_processors = Some(vec![processor]);
        (request, recorder)
    }

    /// A `NormalRequest` with everything this engine does not use switched off.
    fn request(
        &self,
        messages: RequestMessage,
        sampling_params: SamplingParams,
        response: mpsc::Sender<Response>,
    ) -> NormalRequest {
        NormalRequest {
            messages,
            sampling_params,
            response,
            return_logprobs: false,
            is_streaming: false,
            id: self.mistralrs.next_request_id(),
            constraint: Constraint::None,
            suffix: None,
            tools: None,
            tool_choice: None,
            logits_processors: None,
            return_raw_logits: false,
            web_search_options: None,
            model_id: None,
            truncate_sequence: false,
        }
    }

    /// The model's EOS ids as stop tokens, or none.
    fn stop_tokens(&self, stop_on_eos: bool) -> Option<StopTokens> {
        (stop_on_eos && !self.eos_token_ids.is_empty())
            .then(|| StopTokens::Ids(self.eos_token_ids.clone()))
    }

    /// Rejects prompts mistral.rs would refuse or fail on.
    fn check_prompt(&self, tokens: &[u32], max_new: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::invalid("tokens", "at least one token is needed"));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(Error::invalid(
                "tokens",
                format!("id {bad} is outside the vocabulary of {}", self.vocab_size),
            ));
        }
        self.check_room(tokens.len(), max_new)
    }

    /// Errors with [`Error::ContextOverflow`] unless `prompt` tokens plus `max_new` fit
    /// the context.
    fn check_room(&self, prompt: usize, max_new: usize) -> Result<()> {
        if prompt.saturating_add(max_new) > self.max_seq_len {
            return Err(Error::ContextOverflow {
                prompt,
                max_new,
                context: self.max_seq_len,
            });
        }
        Ok(())
    }

    /// Waits for this engine's turn: one request at a time.
    fn turn(&self) -> MutexGuard<'_, ()> {
        // The guarded value is `()`: a panic elsewhere leaves nothing inconsistent.
        self.request_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Hands `request` to the mistral.rs engine.
    fn send(&self, request: Request) -> Result<()> {
        let sender = self
            .mistralrs
            .get_sender(None)
            .map_err(|e| Error::Engine(format!("no engine to send to: {e}")))?;
        sender
            .blocking_send(request)
            .map_err(|_| Error::Engine("the engine has shut down".into()))
    }
}

/// Sampling parameters for a generation call: greedy (`top_k = 1`) unless a positive
/// temperature is given.
///
/// mistral.rs replaces a missing temperature by 1.0, so greedy decoding has to be
/// requested through `top_k = 1` (`SamplingParams::deterministic`).
fn sampling_params(temperature: Option<f64>, top_p: Option<f64>) -> Result<SamplingParams> {
    if let Some(p) = top_p {
        if p.is_nan() || p <= 0.0 || p > 1.0 {
            return Err(Error::invalid("top_p", format!("{p} is not in (0, 1]")));
        }
    }
    match temperature {
        None => Ok(SamplingParams::deterministic()),
        Some(t) if !t.is_finite() || t < 0.0 => Err(Error::invalid(
            "temperature",
            format!("{t} is not a finite number >= 0"),
        )),
        Some(0.0) => Ok(SamplingParams::deterministic()),
        Some(t) => Ok(SamplingParams {
            temperature: Some(t),
            top_p,
            ..SamplingParams::neutral()
        }),
    }
}

/// Turns a response that is not the one a call waits for into an error (or ignores it).
fn check_response(response: Response, what: &str) -> Result<()> {
    match response {
        Response::InternalError(e) => Err(Error::Engine(format!("{what}: internal error: {e}"))),
        Response::ValidationError(e) => Err(Error::Engine(format!("{what}: rejected: {e}"))),
        Response::ModelError(e, _) | Response::CompletionModelError(e, _) => {
            Err(Error::Engine(format!("{what}: model error: {e}")))
        }
        // Streaming chunks and partial answers are handled by the callers; anything
        // else is not a reply to this engine's requests.
        Response::Chunk(_) | Response::CompletionChunk(_) => Ok(()),
        Response::Done(_) | Response::CompletionDone(_) | Response::Raw { .. } => Ok(()),
        _ => Err(Error::Engine(format!("{what}: unexpected response kind"))),
    }
}

/// What a [`StepRecorder`] saw over one request.
#[derive(Debug, Default, Clone)]
struct StepLog {
    /// Context length at the first step: the prompt length.
    prompt_len: Option<usize>,
    /// Steps (sampled tokens) seen.
    steps: usize,
    /// Forced greedy tokens, in order (only when forcing).
    tokens: Vec<u32>,
    /// Top-1 minus top-2 logit at each forced step.
    gaps: Vec<f32>,
    /// When the first and the last step's logits arrived.
    first: Option<Instant>,
    last: Option<Instant>,
    /// A failure inside the processor, reported after the request.
    error: Option<String>,
}

impl StepLog {
    /// Throughput from the step timestamps; `started` is when the request was sent.
    fn stats(&self, started: Instant) -> GenerationStats {
        let prompt_tokens = self.prompt_len.unwrap_or(0);
        let per_second = |count: usize, time: Duration| {
            let secs = time.as_secs_f64();
            if count > 0 && secs > 0.0 {
                count as f64 / secs
            } else {
                0.0
            }
        };
        let (prefill_tok_s, decode_tok_s) = match (self.first, self.last) {
            (Some(first), Some(last)) => (
                per_second(prompt_tokens, first.duration_since(started)),
                per_second(self.steps.saturating_sub(1), last.duration_since(first)),
            ),
            _ => (0.0, 0.0),
        };
        GenerationStats {
            prompt_tokens,
            generated_tokens: self.steps,
            prefill_tok_s,
            decode_tok_s,
        }
    }
}

/// A logits processor that watches every sampling step of one request and, when
/// `force_argmax`, records the argmax token and masks all others to `-inf`, so that the
/// sampler can only pick the recorded token.
struct StepRecorder {
    force_argmax: bool,
    log: Mutex<StepLog>,
}

impl StepRecorder {
    fn new(force_argmax: bool) -> Self {
        Self {
            force_argmax,
            log: Mutex::new(StepLog::default()),
        }
    }

    /// The log, or the error the processor hit.
    fn finish(&self) -> Result<StepLog> {
        let log = self
            .log
            .lock()
            .map_err(|_| Error::Engine("logits processor panicked".into()))?
            .clone();
        match log.error {
            Some(e) => Err(Error::Engine(format!("logits processor: {e}"))),
            None => Ok(log),
        }
    }

    fn step(&self, logits: &Tensor, context: &[u32]) -> candle_core::Result<Tensor> {
        let now = Instant::now();
        let mut log = self
            .log
            .lock()
            .map_err(|_| candle_core::Error::Msg("step log poisoned".into()))?;
        if log.prompt_len.is_none() {
            log.prompt_len = Some(context.len());
            log.first = Some(now);
        }
        log.last = Some(now);
        log.steps += 1;
        if !self.force_argmax {
            return Ok(logits.clone());
        }
        let values: Vec<f32> = logits.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        let Some(best) = argmax(&values) else {
            let msg = "all logits are NaN".to_string();
            log.error = Some(msg.clone());
            return Err(candle_core::Error::Msg(msg));
        };
        let Ok(best_id) = u32::try_from(best) else {
            let msg = format!("token index {best} does not fit in u32");
            log.error = Some(msg.clone());
            return Err(candle_core::Error::Msg(msg));
        };
        log.tokens.push(best_id);
        let runner_up = values
            .iter()
            .enumerate()
            .filter(|&(i, v)| i != best && !v.is_nan())
            .map(|(_, &v)| v)
            .fold(f32::NEG_INFINITY, f32::max);
        log.gaps.push(values[best] - runner_up);
        let mut forced = vec![f32::NEG_INFINITY; values.len()];
        forced[best] = 0.0;
        Tensor::from_vec(forced, logits.shape().clone(), logits.device())
    }
}

impl CustomLogitsProcessor for StepRecorder {
    fn apply(&self, logits: &Tensor, context: &[u32]) -> candle_core::Result<Tensor> {
        self.step(logits, context)
    }
}

/// Index of the largest value, ties to the lowest index; NaNs are skipped.
fn argmax(values: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best.map(|(i, _)| i)
}

impl SegmentSource for MistralRsEngine {
    fn segment(
        &self,
        lm: &LoadedModel,
        prompt: &[u32],
        max_new: usize,
        judge: Option<Judge>,
    ) -> Result<SegmentRun> {
        streamed(self, lm, prompt, max_new, judge)
    }
}

/// A segment generated (greedily) by mistral.rs and streamed; the instrumented model
/// re-reads each token to judge the trigger, and the stream is dropped when it fires or
/// the segment ends.
pub fn streamed(
    engine: &MistralRsEngine,
    lm: &LoadedModel,
    prompt: &[u32],
    max_new: usize,
    judge: Option<Judge>,
) -> Result<SegmentRun> {
    let mut watch = Watch::start(lm, prompt, max_new, judge, false)?;
    engine.stream_greedy(prompt, max_new, &mut |token| watch.accept(token))?;
    Ok(watch.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_first_of_ties_and_skips_nan() {
        let rows: [(&[f32], Option<usize>); 5] = [
            (&[], None),
            (&[f32::NAN], None),
            (&[1.0, 3.0, 3.0], Some(1)),
            (&[f32::NAN, -1.0, -2.0], Some(1)),
            (&[f32::NEG_INFINITY, f32::NEG_INFINITY], Some(0)),
        ];
        for (values, expected) in rows {
            assert_eq!(argmax(values), expected, "{values:?}");
        }
    }

    #[test]
    fn sampling_params_greedy_and_validation() {
        let greedy = sampling_params(None, None).unwrap();
        assert_eq!(greedy.top_k, Some(1));
        assert_eq!(greedy.temperature, None);
        assert_eq!(sampling_params(Some(0.0), None).unwrap().top_k, Some(1));
        let sampled = sampling_params(Some(0.7), Some(0.9)).unwrap();
        assert_eq!(sampled.temperature, Some(0.7));
        assert_eq!(sampled.top_k, None);
        assert_eq!(sampled.top_p, Some(0.9));
        assert!(sampling_params(Some(-1.0), None).is_err());
        assert!(sampling_params(Some(f64::NAN), None).is_err());
        assert!(sampling_params(None, Some(0.0)).is_err());
        assert!(sampling_params(None, Some(1.5)).is_err());
    }

    #[test]
    fn forced_step_masks_everything_but_the_argmax() {
        let recorder = StepRecorder::new(true);
        let logits = Tensor::new(&[0.5f32, 2.0, -1.0, 2.0], &Device::Cpu).unwrap();
        let forced: Vec<f32> = recorder
            .step(&logits, &[7, 8, 9])
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(forced[1], 0.0);
        assert!(forced
            .iter()
            .enumerate()
            .all(|(i, &v)| i == 1 || v == f32::NEG_INFINITY));
        let log = recorder.finish().unwrap();
        assert_eq!(log.tokens, vec![1]);
        assert_eq!(log.prompt_len, Some(3));
        assert_eq!(log.steps, 1);
    }
}
