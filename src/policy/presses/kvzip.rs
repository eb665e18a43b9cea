//! `kvzip`: every KV head keeps the prompt positions the model reads most while it
//! re-reads the context (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression
//! with Context Reconstruction"; kvpress's `KVzipPress`). After the context is
//! prefilled, the model is fed, on a copy of its cache, a repeat instruction, the chat
//! template's turn change and the context again, teacher-forced; a cached position's
//! score is the most attention any of those queries of its KV head's group gives it.
//! Positions a model needs to reproduce the context are the ones it needs to answer
//! anything about it, so the scores do not depend on the question.
//!
//! Long contexts are reconstructed `chunk_size` positions at a time, each pass on a fresh
//! copy of the context's cache, the later ones told to start after the previous piece's
//! last eight tokens (as the paper does). The first `n_sink` positions are always kept.
//! By default one threshold runs across every pressed layer and head (kvpress's
//! default, `layerwise = false`), so layers and heads keep different amounts; with
//! `layerwise = true` each layer keeps the same share, chosen across its heads.
//!
//! One difference from kvpress: the scores are the model's own attention, whose softmax
//! runs over every cached position (kvpress recomputes it over the sinks, the chunk and
//! the repeat only). As in kvpress, the chat template's opening is not re-read, so its
//! positions beyond the sinks score 0. The copy of the cache costs
//! one more context's KV during the prefill, counted in the prefill's peak bytes, and
//! the reconstruction costs about one more prefill.
//!
//! ```toml
//! type = "kvzip"
//! compression_ratio = 0.5
//! n_sink = 4          # default
//! layerwise = false   # default
//! chunk_size = 2048   # default
//! ```

use serde::{Deserialize, Serialize};

use crate::model::text::chat::ChatMessage;
use crate::model::{HeadCache, Interventions, LoadedModel, Model, Session};
use crate::policy::evict::{Budget, Eviction, Observe, Observed, Rows, TokenScorer};
use crate::policy::plan::Plan;
use crate::policy::presses::knorm::check_ratio;
use crate::policy::presses::{press_tokens, Press, Target};
use crate::{Error, Result};

/// The instruction before the first piece of the context (the paper's).
const REPEAT_FIRST: &str = "\n\nRepeat the previous context exactly.";
/// The instruction before a later piece, followed by the previous piece's last tokens.
const REPEAT_LATER: &str = "\n\nRepeat the part of the previous context exactly, starting with";
/// Tokens of the previous piece a later piece's instruction ends with.
const OVERLAP: usize = 8;

/// The `kvzip` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kvzip {
    /// Share of the pressed positions dropped, in `(0, 1)`.
    pub compression_ratio: f64,
    /// First positions always kept (attention sinks).
    #[serde(default = "default_sink")]
    pub n_sink: usize,
    /// Each layer keeps the same share (chosen across its heads); otherwise one threshold
    /// runs across all pressed layers and heads.
    #[serde(default)]
    pub layerwise: bool,
    /// Context positions reconstructed per pass.
    #[serde(default = "default_chunk")]
    pub chunk_size: usize,
}

fn default_sink() -> usize {
    4
}

fn default_chunk() -> usize {
    2048
}

impl Press for Kvzip {
    fn check(&self) -> Result<()> {
        check_ratio(self.compression_ratio)?;
        if self.chunk_size == 0 {
            return Err(Error::invalid("chunk_size", "0 (must be at least 1)"));
        }
        Ok(())
    }

    fn apply(&self, plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        let scorer = Reconstruction {
            sink: self.n_sink,
            chunk: self.chunk_size,
        };
        let mut eviction = Eviction::new(self.compression_ratio, scorer);
        eviction.budget = match self.layerwise {
            true => Budget::Shared { alpha: 0.0 },
            false => Budget::Global,
        };
        press_tokens(plan, eviction);
        Ok(())
    }

    fn presses_tokens(&self) -> bool {
        true
    }
}

/// KVzip's score: the most attention any reconstruction query of the KV head's group
/// gave the row; the first `sink` rows score infinity.
#[derive(Debug)]
struct Reconstruction {
    sink: usize,
    chunk: usize,
}

impl TokenScorer for Reconstruction {
    fn observes(&self) -> Observe {
        Observe::Reconstruct { chunk: self.chunk }
    }

    fn score(&self, rows: &Rows<'_>) -> Result<Vec<f32>> {
        let n = rows.len();
        let mut scores = vec![f32::NEG_INFINITY; n];
        for head in rows.group.clone() {
            for (s, &a) in scores.iter_mut().zip(rows.attention_of(head)?) {
                *s = s.max(a);
            }
        }
        scores[..self.sink.min(n)].fill(f32::INFINITY);
        Ok(scores)
    }
}

/// What the model is fed to re-read its context: the instructions and the chat
/// template's parts around a user turn, as token ids of one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepeatPrompt {
    /// The template's opening of a user turn (BOS included where it renders one): a
    /// pressed prompt that starts with it has its context after it.
    opening: Vec<u32>,
    /// From the end of a user turn to the start of the assistant's reply.
    turn: Vec<u32>,
    /// [`REPEAT_FIRST`] and [`REPEAT_LATER`].
    first: Vec<u32>,
    later: Vec<u32>,
}

impl RepeatPrompt {
    /// A repeat prompt from its parts' token ids: the chat template's opening of a user
    /// turn, its change from the user's turn to the reply, and the two instructions
    /// (before the first piece of the context, and before a later one).
    pub fn new(opening: Vec<u32>, turn: Vec<u32>, first: Vec<u32>, later: Vec<u32>) -> Self {
        Self {
            opening,
            turn,
            first,
            later,
        }
    }

    /// The repeat prompt of `lm`, from its chat template (without one: BOS, if the
    /// model adds it, opens and a newline changes turn).
    pub fn of(lm: &LoadedModel) -> Result<Self> {
        const MARK: &str = "\u{1}headwise-context\u{1}";
        let (opening, turn) = match &lm.chat_template {
            Some(t) => {
                let text = t.render(&[ChatMessage::user(MARK)], true)?;
                let (open, turn) = text.split_once(MARK).ok_or_else(|| {
                    Error::ChatTemplate("the template does not show a user message whole".into())
                })?;
                (lm.encode(open, false)?, lm.encode(turn, false)?)
            }
            None => (lm.encode("", true)?, lm.encode("\n", false)?),
        };
        Ok(Self {
            opening,
            turn,
            first: lm.encode(REPEAT_FIRST, false)?,
            later: lm.encode(REPEAT_LATER, false)?,
        })
    }

    /// Where the context starts in `pressed`: after the template's opening when it
    /// starts with it, else at 0.
    fn context_start(&self, pressed: &[u32]) -> usize {
        match pressed.starts_with(&self.opening) && self.opening.len() < pressed.len() {
            true => self.opening.len(),
            false => 0,
        }
    }

    /// The reconstruction passes over `pressed`: per piece of at most `chunk` context
    /// positions, the positions it covers and the ids fed after the context.
    pub fn passes(&self, pressed: &[u32], chunk: usize) -> Vec<(std::ops::Range<usize>, Vec<u32>)> {
        let start = self.context_start(pressed);
        let mut out = Vec::new();
        let mut at = start;
        while at < pressed.len() {
            let end = (at + chunk).min(pressed.len());
            let mut ids = match at == start {
                true => self.first.clone(),
                false => {
                    let mut ids = self.later.clone();
                    ids.extend_from_slice(&pressed[at.saturating_sub(OVERLAP).max(start)..at]);
                    ids
                }
            };
            ids.extend_from_slice(&self.turn);
            ids.extend_from_slice(&pressed[at..end]);
            out.push((at..end, ids));
            at = end;
        }
        out
    }
}

/// Run KVzip's reconstruction of `pressed` (cached in `cache`, all of it) in pieces of
/// `chunk` positions, each on its own copy of `cache` with `edits`, recording in
/// `observed` the most attention each cached position received. Returns the most bytes
/// a copy allocated.
pub(crate) fn reconstruct(
    model: &Model,
    edits: &Interventions,
    cache: &HeadCache,
    pressed: &[u32],
    chunk: usize,
    repeat: &RepeatPrompt,
    observed: &mut Observed,
) -> Result<usize> {
    let mut peak = 0;
    for (keys, ids) in repeat.passes(pressed, chunk) {
        // A copy with room for the repeat, as a new cache would reserve it.
        let copy = cache.clone().with_capacity(cache.len() + ids.len())?;
        let mut session = Session::with_cache(model, copy);
        observed.reconstructing(keys);
        session.prefill(&ids, observed, edits)?;
        peak = peak.max(session.cache().bytes().total());
    }
    observed.reconstructed(chunk);
    Ok(peak)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_query_of_the_group_scores_and_sinks_are_kept() {
        // 5 rows, two query heads in the group (heads 1 and 2 of 3).
        let attention = [
            9.0, 9.0, 9.0, 9.0, 9.0, // head 0: another group
            0.1, 0.5, 0.2, 0.0, 0.3, // head 1
            0.2, 0.1, 0.1, 0.4, 0.0, // head 2
        ];
        let keys = [0.0; 5];
        let rows = Rows {
            values: &[],
            keys: &keys,
            d_head: 1,
            group: 1..3,
            attention: Some(&attention),
            queries: 5..5,
            moments: None,
        };
        let s = Reconstruction { sink: 1, chunk: 8 }.score(&rows).unwrap();
        assert_eq!(s, vec![f32::INFINITY, 0.5, 0.2, 0.4, 0.3]);
    }

    fn repeat() -> RepeatPrompt {
        RepeatPrompt::new(vec![1, 2], vec![3], vec![10], vec![20])
    }

    #[test]
    fn passes_cover_the_context_once_in_pieces() {
        let pressed: Vec<u32> = vec![1, 2, 100, 101, 102, 103, 104];
        let passes = repeat().passes(&pressed, 3);
        assert_eq!(passes.len(), 2);
        assert_eq!(passes[0], (2..5, vec![10, 3, 100, 101, 102]));
        // The later piece's instruction ends with the previous piece's tokens (all three,
        // fewer than the overlap), then the turn change and the piece.
        assert_eq!(passes[1], (5..7, vec![20, 100, 101, 102, 3, 103, 104]));
        // A prompt without the template's opening is all context.
        let raw = [7, 8, 9];
        assert_eq!(repeat().passes(&raw, 8), vec![(0..3, vec![10, 3, 7, 8, 9])]);
    }

    #[test]
    fn bad_values_are_named() {
        let press = |ratio, chunk| Kvzip {
            compression_ratio: ratio,
            n_sink: 4,
            layerwise: false,
            chunk_size: chunk,
        };
        assert!(press(0.5, 2048).check().is_ok());
        let e = press(1.0, 2048).check().unwrap_err().to_string();
        assert!(e.contains("compression_ratio"), "{e}");
        let e = press(0.5, 0).check().unwrap_err().to_string();
        assert!(e.contains("chunk_size"), "{e}");
    }
}
