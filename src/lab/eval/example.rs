//! One evaluation example, tokenized, and the builder that assembles its prompt from
//! separately tokenized pieces so that every piece's token span is exact.

use std::ops::Range;

use crate::lab::tasks::{Encoder, Trial};
use crate::Result;

/// One question with its context, ready for the model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Example {
    /// Unique within its task, stable across runs (e.g. the dataset's own id, or a
    /// generated `{task}-L{len}-...-s{seed}`).
    pub id: String,
    /// The task that made it: `niah`, `nolima`, `nolima_control`, `hotpotqa`,
    /// `musique`, `babilong_qa1` ... `babilong_qa5`, `control_capital`,
    /// `control_arithmetic`.
    pub task: String,
    /// Context length class in tokens (the haystack or filler length asked for; for
    /// datasets whose context is fixed, the context's actual token count).
    pub context_tokens: usize,
    /// Prompt ids (BOS first when the tokenizer adds one), ending where the answer
    /// starts (after `Answer:`).
    pub prompt: Vec<u32>,
    /// Gold answer first, then accepted aliases (never empty).
    pub answers: Vec<String>,
    /// Token spans inside `prompt` that hold the supporting facts (the needle, the
    /// supporting sentences or paragraphs); empty for closed-book items.
    pub support: Vec<Range<usize>>,
    /// Where the question starts in `prompt` (the context before it is what a
    /// query-agnostic press compresses); `None` where the task does not say.
    #[serde(default)]
    pub question_start: Option<usize>,
}

impl Example {
    /// A NIAH / NoLiMa trial as an example: the needle is the support.
    pub fn from_trial(t: &Trial) -> Self {
        Self {
            id: t.id.clone(),
            task: t.task.name().to_string(),
            context_tokens: t.context_tokens,
            prompt: t.prompt.clone(),
            answers: vec![t.answer.clone()],
            support: vec![t.needle.clone()],
            question_start: t.question_start,
        }
    }
}

/// Assembles a prompt piece by piece, remembering where each piece went.
pub struct PromptBuilder<'a> {
    enc: Encoder<'a>,
    ids: Vec<u32>,
}

impl<'a> PromptBuilder<'a> {
    /// An empty prompt: just BOS when the tokenizer adds one.
    pub fn new(enc: Encoder<'a>) -> Self {
        Self {
            ids: enc.bos().into_iter().collect(),
            enc,
        }
    }

    /// Append `text` (tokenized on its own, no special tokens); returns its token span.
    pub fn push(&mut self, text: &str) -> Result<Range<usize>> {
        let start = self.ids.len();
        self.ids.extend(self.enc.encode(text)?);
        Ok(start..self.ids.len())
    }

    /// Append already tokenized ids; returns their span.
    pub fn push_ids(&mut self, ids: &[u32]) -> Range<usize> {
        let start = self.ids.len();
        self.ids.extend_from_slice(ids);
        start..self.ids.len()
    }

    /// The finished prompt ids.
    pub fn finish(self) -> Vec<u32> {
        self.ids
    }
}
