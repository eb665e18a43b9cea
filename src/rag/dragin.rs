//! The DRAGIN loop on the instrumented model: generate an answer segment observing each
//! step inline (the output distribution's entropy, the last layer's attention averaged
//! over heads, the final hidden state for a probe); when the trigger fires, keep the
//! text before the triggering sentence, retrieve the top passages for the query (QFS or
//! the question), put them in the prompt in place of the previous ones, and generate
//! again from the kept text; at most `max_retrievals` times per answer.
//!
//! Prompt (raw completion, the eval harness's wording):
//!
//! ```text
//! [BOS?] "Answer the question using the paragraphs below. Reply with a short answer only.\n\n"
//!        "{title}: {text}\n\n" ...
//!        "Question: {question}\nAnswer:" "{kept text}"
//! ```
//!
//! and, with no paragraphs, `"Answer the question. Reply with a short answer only.\n\n
//! Question: {question}\nAnswer:"`. With `chat`, the same text without the kept answer
//! is the user message of the model's chat template, and the kept text follows the
//! assistant's turn start. An answer is the first line of the output.

use std::time::Instant;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::model::{KvCache, LoadedModel, Logits, NoObserver, Observer, Sampler, Sampling, Wants};
use crate::probe::Probe;
use crate::rag::corpus::Passage;
use crate::rag::qa::QaItem;
use crate::rag::retriever::Retriever;
use crate::rag::text::Stopwords;
use crate::rag::trigger::{entropy, fires, qfs_query, Segment, TriggerConfig};
use crate::{Error, Result};

/// What goes into the prompt besides retrieved passages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextMode {
    /// Only what is retrieved (closed book when nothing is).
    Retrieved,
    /// The question's own paragraphs, all of them (open book).
    AllParagraphs,
}

/// How a retrieval query is formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum QueryConfig {
    /// The `words` content words the triggering position attends to most, in order.
    Qfs { words: usize },
    /// The question's text.
    Question,
}

/// What to do when the retriever fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnRetrieverError {
    /// Go on without retrieval (the answer's record says so).
    Continue,
    /// Fail the answer.
    Fail,
}

/// One RAG variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RagConfig {
    pub trigger: TriggerConfig,
    #[serde(default = "default_query")]
    pub query: QueryConfig,
    #[serde(default = "default_context")]
    pub context: ContextMode,
    /// Passages per retrieval.
    #[serde(default = "default_passages")]
    pub passages: usize,
    /// Retrievals per answer at most.
    #[serde(default = "default_max_retrievals")]
    pub max_retrievals: usize,
    #[serde(default = "default_on_error")]
    pub on_retriever_error: OnRetrieverError,
}

fn default_query() -> QueryConfig {
    QueryConfig::Qfs { words: 25 }
}
fn default_context() -> ContextMode {
    ContextMode::Retrieved
}
fn default_passages() -> usize {
    3
}
fn default_max_retrievals() -> usize {
    3
}
fn default_on_error() -> OnRetrieverError {
    OnRetrieverError::Continue
}

impl RagConfig {
    /// Reject settings that cannot run.
    pub fn validate(&self) -> Result<()> {
        self.trigger.validate()?;
        if matches!(self.query, QueryConfig::Qfs { words: 0 }) {
            return Err(Error::invalid("query", "qfs needs words >= 1"));
        }
        if self.passages == 0 {
            return Err(Error::invalid("passages", "0 (must be at least 1)"));
        }
        Ok(())
    }
}

/// The probe behind a `retrieval_heads` trigger and the heads it watches.
#[derive(Debug, Clone, Copy)]
pub struct HeadSignal<'a> {
    pub probe: &'a Probe,
    /// `layer * n_heads + head` of the watched heads.
    pub heads: &'a [usize],
}

/// One retrieval of an answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Retrieval {
    /// Generated tokens (over all segments) before the trigger fired; 0 for `once`.
    pub at_token: usize,
    pub query: String,
    /// Ids of the passages retrieved.
    pub ids: Vec<String>,
}

/// A RAG answer and what it took.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RagAnswer {
    pub answer: String,
    pub retrievals: Vec<Retrieval>,
    /// Tokens generated, discarded ones included.
    pub generated_tokens: usize,
    pub secs: f64,
    /// Retriever failures the answer went on without.
    pub retriever_errors: Vec<String>,
}

/// Everything one segment's steps showed.
struct SegmentRun {
    tokens: Vec<u32>,
    pieces: Vec<String>,
    entropy: Vec<f32>,
    /// `rows[j]`: last-layer attention (mean over heads) of generated token `j` as the
    /// query over positions `0..=prompt + j`.
    rows: Vec<Vec<f32>>,
    /// Mean predicted activity of the watched heads at the step that produced token `j`.
    signal: Vec<f32>,
}

/// Keeps the last layer's head-averaged attention row and the final hidden state of a
/// single-query step.
struct StepObserver {
    last_layer: usize,
    attention: bool,
    hidden: bool,
    row: Option<Vec<f32>>,
    final_hidden: Option<Vec<f32>>,
}

impl Observer for StepObserver {
    fn wants(&self) -> Wants {
        Wants {
            attention: self.attention,
            final_hidden: self.hidden,
            ..Wants::default()
        }
    }

    fn attention(&mut self, layer: usize, probs: &Tensor) {
        if layer == self.last_layer {
            self.row = probs
                .mean(0)
                .and_then(|m| m.flatten_all())
                .and_then(|m| m.to_dtype(DType::F32))
                .and_then(|m| m.to_vec1())
                .ok();
        }
    }

    fn final_hidden(&mut self, hidden: &Tensor) {
        self.final_hidden = hidden.flatten_all().and_then(|h| h.to_vec1()).ok();
    }
}

/// Greedy generation of at most `max_new` tokens after `prompt`, stopping at a stop
/// token or at a newline after some text, observing what the trigger needs.
fn run_segment(
    lm: &LoadedModel,
    prompt: &[u32],
    max_new: usize,
    observe: bool,
    signal: Option<HeadSignal>,
) -> Result<SegmentRun> {
    let model = &lm.model;
    let cfg = model.config();
    let mut kv = KvCache::new(cfg, prompt.len() + max_new + 1);
    let edits = Default::default();
    if prompt.len() > 1 {
        model.forward(
            &prompt[..prompt.len() - 1],
            &mut kv,
            Logits::Last,
            &mut NoObserver,
            &edits,
        )?;
    }
    let mut obs = StepObserver {
        last_layer: cfg.n_layers - 1,
        attention: observe,
        hidden: signal.is_some(),
        row: None,
        final_hidden: None,
    };
    let mut sampler = Sampler::new(Sampling::default())?;
    let mut run = SegmentRun {
        tokens: Vec::new(),
        pieces: Vec::new(),
        entropy: Vec::new(),
        rows: Vec::new(),
        signal: Vec::new(),
    };
    let mut ws = signal.map(|s| s.probe.workspace());
    let mut probe_out = Vec::new();
    let mut input = *prompt
        .last()
        .ok_or_else(|| Error::invalid("prompt", "empty"))?;
    let mut text = String::new();
    for step in 0..=max_new {
        let logits = model.forward(&[input], &mut kv, Logits::Last, &mut obs, &edits)?;
        if step > 0 && observe {
            // This step's query was the token generated before it.
            run.rows.push(obs.row.take().unwrap_or_default());
        }
        if step == max_new || (step > 0 && stops(lm, &text, input)) {
            break;
        }
        let next = sampler.sample(&logits)?;
        if observe {
            let values: Vec<f32> = logits.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
            run.entropy.push(entropy(&values));
        }
        if let (Some(s), Some(h)) = (signal, obs.final_hidden.take()) {
            let ws = ws.as_mut().expect("made with the signal");
            probe_out.resize(s.probe.output_dim(), 0.0);
            s.probe.predict_into(&h, ws, &mut probe_out)?;
            let mean =
                s.heads.iter().map(|&i| probe_out[i]).sum::<f32>() / s.heads.len().max(1) as f32;
            run.signal.push(mean);
        }
        let piece = if lm.special.stop.contains(&next) {
            String::new()
        } else {
            lm.decode(&[next])?
        };
        text.push_str(&piece);
        run.tokens.push(next);
        run.pieces.push(piece);
        input = next;
        if !observe && (stops(lm, &text, next) || run.tokens.len() == max_new) {
            break;
        }
    }
    Ok(run)
}

/// The text of `tokens`, stop tokens left out.
fn decode_answer(lm: &LoadedModel, tokens: &[u32]) -> Result<String> {
    let ids: Vec<u32> = tokens
        .iter()
        .copied()
        .filter(|t| !lm.special.stop.contains(t))
        .collect();
    lm.decode(&ids)
}

/// Whether generation ends after `last`: a stop token, or a newline after some text.
fn stops(lm: &LoadedModel, text: &str, last: u32) -> bool {
    lm.special.stop.contains(&last) || text.trim_start().contains('\n')
}

/// The prompt text for `item` with `passages` and the kept answer text.
pub fn prompt_text(item: &QaItem, passages: &[Passage], kept: &str) -> String {
    let mut s = String::new();
    if passages.is_empty() {
        s.push_str("Answer the question. Reply with a short answer only.\n\n");
    } else {
        s.push_str(
            "Answer the question using the paragraphs below. Reply with a short answer only.\n\n",
        );
        for p in passages {
            s.push_str(&format!("{}: {}\n\n", p.title.trim(), p.text.trim()));
        }
    }
    s.push_str(&format!(
        "Question: {}\nAnswer:{kept}",
        item.question.trim()
    ));
    s
}

/// The token span of the question line in a prompt's token texts: from the last
/// `Question` token to the first special token (`<|...|>`, `<...>`) or `Answer` token
/// after it; the whole prompt when there is no `Question` token.
fn question_span(pieces: &[String]) -> std::ops::Range<usize> {
    let Some(start) = pieces.iter().rposition(|p| p.trim() == "Question") else {
        return 0..pieces.len();
    };
    let end = (start + 1..pieces.len())
        .find(|&i| {
            let p = pieces[i].trim();
            (p.starts_with('<') && p.ends_with('>') && p.len() > 2) || p == "Answer"
        })
        .unwrap_or(pieces.len());
    start + 1..end
}

/// The byte offset where the sentence holding byte `at` of `text` starts.
fn sentence_start(text: &str, at: usize) -> usize {
    text[..at].rfind(['.', '!', '?', '\n']).map_or(0, |i| i + 1)
}

/// How answers are prompted and how long they may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnswerOptions {
    /// Tokens per segment at most.
    pub max_new: usize,
    /// Put the prompt in the model's chat template (else raw completion).
    pub chat: bool,
}

/// The prompt ids for `item` with `passages` and the kept answer text.
fn prompt_ids(
    lm: &LoadedModel,
    item: &QaItem,
    passages: &[Passage],
    kept: &str,
    chat: bool,
) -> Result<Vec<u32>> {
    if !chat {
        return lm.encode(&prompt_text(item, passages, kept), true);
    }
    let user = prompt_text(item, passages, "");
    let user = user.strip_suffix("\nAnswer:").unwrap_or(&user);
    let mut ids = lm.chat_prompt(&[crate::model::chat::ChatMessage {
        role: "user".into(),
        content: user.to_string(),
    }])?;
    if !kept.is_empty() {
        ids.extend(lm.encode(kept, false)?);
    }
    Ok(ids)
}

/// Answer `item` under `cfg`, with `retriever` (none: no retrieval happens).
pub fn answer(
    lm: &LoadedModel,
    item: &QaItem,
    cfg: &RagConfig,
    retriever: Option<&dyn Retriever>,
    stop: &Stopwords,
    signal: Option<HeadSignal>,
    opts: AnswerOptions,
) -> Result<RagAnswer> {
    let max_new = opts.max_new;
    cfg.validate()?;
    if matches!(cfg.trigger, TriggerConfig::RetrievalHeads { .. }) && signal.is_none() {
        return Err(Error::invalid("trigger", "retrieval_heads needs a probe"));
    }
    let t0 = Instant::now();
    let mut out = RagAnswer {
        answer: String::new(),
        retrievals: Vec::new(),
        generated_tokens: 0,
        secs: 0.0,
        retriever_errors: Vec::new(),
    };
    let mut retrieved: Vec<Passage> = Vec::new();
    let mut retriever = retriever;
    let search = |query: &str,
                  at: usize,
                  out: &mut RagAnswer,
                  retriever: &mut Option<&dyn Retriever>|
     -> Result<Option<Vec<Passage>>> {
        let Some(r) = *retriever else { return Ok(None) };
        match r.search(query, cfg.passages) {
            Ok(hits) => {
                out.retrievals.push(Retrieval {
                    at_token: at,
                    query: query.to_string(),
                    ids: hits.iter().map(|h| h.id.clone()).collect(),
                });
                Ok(Some(
                    hits.into_iter()
                        .map(|h| Passage {
                            id: h.id,
                            title: h.title,
                            text: h.text,
                        })
                        .collect(),
                ))
            }
            Err(e) if cfg.on_retriever_error == OnRetrieverError::Continue => {
                out.retriever_errors.push(e.to_string());
                *retriever = None;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    };
    if cfg.trigger == TriggerConfig::Once && cfg.max_retrievals > 0 {
        if let Some(p) = search(&item.question, 0, &mut out, &mut retriever)? {
            retrieved = p;
        }
    }
    let mut kept = String::new();
    let mut kept_tokens = 0;
    loop {
        let mut passages = match cfg.context {
            ContextMode::AllParagraphs => item.paragraphs.clone(),
            ContextMode::Retrieved => Vec::new(),
        };
        passages.extend(retrieved.iter().cloned());
        let ids = prompt_ids(lm, item, &passages, &kept, opts.chat)?;
        let may_fire = retriever.is_some()
            && out.retrievals.len() < cfg.max_retrievals
            && !matches!(cfg.trigger, TriggerConfig::Never | TriggerConfig::Once);
        let seg = run_segment(lm, &ids, max_new, may_fire, signal.filter(|_| may_fire))?;
        out.generated_tokens += seg.tokens.len();
        let text = decode_answer(lm, &seg.tokens)?;
        let fired = if may_fire {
            let pieces: Vec<&str> = seg.pieces.iter().map(String::as_str).collect();
            let p = ids.len();
            let attention: Vec<Vec<f32>> = seg
                .rows
                .iter()
                .map(|row| {
                    (0..pieces.len())
                        .map(|i| row.get(p + i).copied().unwrap_or(0.0))
                        .collect()
                })
                .collect();
            let segment = Segment {
                pieces: &pieces,
                entropy: &seg.entropy,
                attention: &attention,
                head_signal: (!seg.signal.is_empty()).then_some(seg.signal.as_slice()),
                offset: kept_tokens,
            };
            fires(&cfg.trigger, &segment, stop)?
        } else {
            None
        };
        let Some(f) = fired else {
            kept.push_str(&text);
            break;
        };
        let before = decode_answer(lm, &seg.tokens[..f])?;
        let cut = sentence_start(&before, before.len());
        let query = match cfg.query {
            QueryConfig::Question => item.question.clone(),
            QueryConfig::Qfs { words } => {
                // The question line of the prompt and the answer so far: not the
                // instruction, the passages or the chat template's words.
                let prompt: Vec<String> = ids
                    .iter()
                    .map(|&t| lm.decode(&[t]))
                    .collect::<Result<_>>()?;
                let span = question_span(&prompt);
                let row = seg.rows.get(f).cloned().unwrap_or_default();
                let mut context: Vec<&str> =
                    prompt[span.clone()].iter().map(String::as_str).collect();
                let mut att: Vec<f32> = span.map(|i| row.get(i).copied().unwrap_or(0.0)).collect();
                for (i, piece) in seg.pieces[..f].iter().enumerate() {
                    context.push(piece);
                    att.push(row.get(ids.len() + i).copied().unwrap_or(0.0));
                }
                qfs_query(&context, &att, words, stop)
            }
        };
        let at = kept_tokens + f;
        match search(&query, at, &mut out, &mut retriever)? {
            Some(p) => retrieved = p,
            None => {
                // The retriever is gone: finish this segment as it is.
                kept.push_str(&text);
                break;
            }
        }
        kept.push_str(&before[..cut]);
        // The tokens whose text lies wholly before the cut.
        let mut whole = 0;
        while whole < f && decode_answer(lm, &seg.tokens[..whole + 1])?.len() <= cut {
            whole += 1;
        }
        kept_tokens += whole;
    }
    out.answer = kept
        .trim_start()
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_string();
    out.secs = t0.elapsed().as_secs_f64();
    Ok(out)
}
