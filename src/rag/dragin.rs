//! The DRAGIN loop: generate an answer segment while the trigger is judged after every
//! token (by the instrumented model, inline or re-reading what mistral.rs streams: see
//! [`segment`](crate::rag::segment)); when it fires, keep the text before the
//! triggering sentence, retrieve the top passages for the query (QFS or the question),
//! put them in the prompt in place of the previous ones, and generate again from the
//! kept text; at most `max_retrievals` times per answer.
//!
//! In-context retrieval ([`InContext`]) replaces the search: the paragraphs are all in
//! the prompt, and from the trigger on the answer is generated with a few heads
//! restricted to their top-k keys, the heads being the static ranking's, the probe's
//! choice at each step, or random ones.
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

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::model::{LoadedModel, TopK};
use crate::rag::corpus::Passage;
use crate::rag::qa::QaItem;
use crate::rag::retriever::Retriever;
use crate::rag::segment::{masked, Judge, MaskHeads};
pub use crate::rag::segment::{HeadSignal, Instrumented, SegmentSource};
use crate::rag::text::Stopwords;
use crate::rag::trigger::{qfs_query, TriggerConfig};
use crate::rng::SplitMix64;
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
    /// In-context retrieval instead of search: when the trigger fires, the rest of the
    /// answer is generated with chosen heads restricted to their top-k positions.
    #[serde(default)]
    pub in_context: Option<InContext>,
}

/// In-context retrieval (the dynamic-heads paper's case study): the paragraphs are all
/// in the prompt; once the trigger fires (`once`: from the first token) the answer is
/// regenerated from the triggering sentence with `n` heads restricted, at every step,
/// to their `k` best-scoring keys plus `sink` + `window` (the `topk_mask` policy's
/// mask), `n` being the number of watched heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InContext {
    pub heads: InContextHeads,
    #[serde(default = "default_mask_k")]
    pub k: usize,
    #[serde(default = "default_mask_sink")]
    pub sink: usize,
    #[serde(default = "default_mask_window")]
    pub window: usize,
    /// `random`: the draw's seed (mixed with the question's id).
    #[serde(default)]
    pub seed: u64,
}

/// Which heads an in-context retrieval masks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InContextHeads {
    /// The static ranking's top heads (the watched heads), every step.
    Static,
    /// The heads the probe predicts most active, chosen again at every step (dynamic).
    Probe,
    /// As many heads drawn at random per question.
    Random,
}

fn default_mask_k() -> usize {
    32
}
fn default_mask_sink() -> usize {
    4
}
fn default_mask_window() -> usize {
    32
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
        if let Some(ic) = &self.in_context {
            if self.context != ContextMode::AllParagraphs {
                return Err(Error::invalid(
                    "in_context",
                    "needs context = \"all_paragraphs\" (the paragraphs to retrieve from)",
                ));
            }
            if ic.k == 0 {
                return Err(Error::invalid("in_context", "k = 0 (must be at least 1)"));
            }
        }
        Ok(())
    }
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
    /// Prompt tokens read, over every segment (each segment reads its whole prompt).
    pub prompt_tokens: usize,
    /// Tokens generated, discarded ones included.
    pub generated_tokens: usize,
    pub secs: f64,
    /// Retriever failures the answer went on without.
    pub retriever_errors: Vec<String>,
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

/// How answers are prompted, how long they may be and which engine writes them.
#[derive(Debug, Clone, Copy)]
pub struct AnswerOptions<'a> {
    /// Tokens per segment at most.
    pub max_new: usize,
    /// Put the prompt in the model's chat template (else raw completion).
    pub chat: bool,
    /// Generates the segments: [`Instrumented`], or mistral.rs streaming.
    pub engine: &'a dyn SegmentSource,
}

/// `n` of the model's `total` heads drawn for the question `id` with `seed`, sorted.
fn random_heads(total: usize, n: usize, seed: u64, id: &str) -> Vec<usize> {
    let digest = Sha256::digest(id.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let salt = u64::from_le_bytes(first);
    let mut rng = SplitMix64::new(seed, salt);
    let mut order: Vec<usize> = (0..total).collect();
    rng.shuffle(&mut order);
    order.truncate(n.min(total));
    order.sort_unstable();
    order
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
    let mut ids = lm.chat_prompt(&[crate::model::text::chat::ChatMessage {
        role: "user".into(),
        content: user.to_string(),
    }])?;
    if !kept.is_empty() {
        ids.extend(lm.encode(kept, false)?);
    }
    Ok(ids)
}

/// Answer `item` under `cfg`, with `retriever` (none: no search happens). `signal`
/// carries the watched heads (and the probe) for `retrieval_heads` and in-context
/// retrieval.
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
    let heads_trigger = matches!(cfg.trigger, TriggerConfig::RetrievalHeads { .. });
    let probe_chosen = cfg.in_context.map(|ic| ic.heads) == Some(InContextHeads::Probe);
    if (heads_trigger || probe_chosen) && signal.and_then(|s| s.probe).is_none() {
        return Err(Error::invalid(
            "rag",
            "retrieval_heads triggers and probe-chosen masks need a probe",
        ));
    }
    // In-context retrieval: the mask, and the masked heads (fixed ones, or none when the
    // probe picks them per step).
    let watched = signal.map(|s| s.heads).unwrap_or_default();
    if cfg.in_context.is_some() && watched.is_empty() {
        return Err(Error::invalid(
            "in_context",
            "needs the watched heads (a ranking) to know how many heads to mask",
        ));
    }
    let mask = cfg.in_context.map(|ic| TopK {
        k: ic.k,
        sink: ic.sink,
        window: ic.window,
    });
    let model = lm.model.config();
    let fixed_heads = match cfg.in_context.map(|ic| (ic.heads, ic.seed)) {
        Some((InContextHeads::Static, _)) => watched.to_vec(),
        Some((InContextHeads::Random, seed)) => random_heads(
            model.n_layers * model.n_heads,
            watched.len(),
            seed,
            &item.id,
        ),
        Some((InContextHeads::Probe, _)) | None => Vec::new(),
    };
    let mask_heads = match (probe_chosen, signal.and_then(|s| s.probe)) {
        (true, Some(probe)) => MaskHeads::Probe {
            probe,
            n: watched.len(),
        },
        _ => MaskHeads::Fixed(&fixed_heads),
    };
    let t0 = Instant::now();
    let mut out = RagAnswer {
        answer: String::new(),
        retrievals: Vec::new(),
        prompt_tokens: 0,
        generated_tokens: 0,
        secs: 0.0,
        retriever_errors: Vec::new(),
    };
    let mut retrieved: Vec<Passage> = Vec::new();
    // In-context retrieval needs no retriever; search never runs with it.
    let mut retriever = if mask.is_some() { None } else { retriever };
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
    // An in-context retrieval: recorded with no query and no passages.
    let in_context_at = |at: usize, out: &mut RagAnswer| {
        out.retrievals.push(Retrieval {
            at_token: at,
            query: String::new(),
            ids: Vec::new(),
        })
    };
    let mut masking = false;
    if cfg.trigger == TriggerConfig::Once && cfg.max_retrievals > 0 {
        if mask.is_some() {
            in_context_at(0, &mut out);
            masking = true;
        } else if let Some(p) = search(&item.question, 0, &mut out, &mut retriever)? {
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
        out.prompt_tokens += ids.len();
        if let (true, Some(tk)) = (masking, mask) {
            let seg = masked(lm, &ids, max_new, mask_heads, tk)?;
            out.generated_tokens += seg.tokens.len();
            kept.push_str(&decode_answer(lm, &seg.tokens)?);
            break;
        }
        let may_fire = (retriever.is_some() || mask.is_some())
            && out.retrievals.len() < cfg.max_retrievals
            && !matches!(cfg.trigger, TriggerConfig::Never | TriggerConfig::Once);
        let judge = may_fire.then_some(Judge {
            trigger: &cfg.trigger,
            stop,
            offset: kept_tokens,
            signal: signal.filter(|_| heads_trigger),
        });
        let seg = opts.engine.segment(lm, &ids, max_new, judge)?;
        out.generated_tokens += seg.tokens.len();
        let Some(f) = seg.fired else {
            kept.push_str(&decode_answer(lm, &seg.tokens)?);
            break;
        };
        let before = decode_answer(lm, &seg.tokens[..f])?;
        let cut = sentence_start(&before, before.len());
        let at = kept_tokens + f;
        if mask.is_some() {
            in_context_at(at, &mut out);
            masking = true;
        } else {
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
                    let mut att: Vec<f32> =
                        span.map(|i| row.get(i).copied().unwrap_or(0.0)).collect();
                    for (i, piece) in seg.pieces[..f].iter().enumerate() {
                        context.push(piece);
                        att.push(row.get(ids.len() + i).copied().unwrap_or(0.0));
                    }
                    qfs_query(&context, &att, words, stop)
                }
            };
            match search(&query, at, &mut out, &mut retriever)? {
                Some(p) => retrieved = p,
                None => {
                    // The retriever is gone: keep the segment and go on without it.
                    kept.push_str(&decode_answer(lm, &seg.tokens)?);
                    kept_tokens += seg.tokens.len();
                    continue;
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_heads_are_fixed_by_seed_and_question() {
        let a = random_heads(270, 9, 1, "q1");
        assert_eq!(a, random_heads(270, 9, 1, "q1"));
        assert_ne!(a, random_heads(270, 9, 1, "q2"));
        assert_ne!(a, random_heads(270, 9, 2, "q1"));
        assert_eq!(a.len(), 9);
        assert!(a.windows(2).all(|w| w[0] < w[1]) && a[8] < 270);
    }
}
