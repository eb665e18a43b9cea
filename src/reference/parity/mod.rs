//! Parity between the instrumented model and mistral.rs on the same GGUF weights.
//!
//! For each fixed prompt: teacher-forced logits of every prompt position from both
//! engines (max and mean |Δlogit|, top-1 agreement), and 32 greedy tokens from both.
//! A greedy divergence is acceptable only at a near-tie: at the first differing step the
//! gap between the top two logits that made the choice (in either engine's own decode
//! step) is below [`NEAR_TIE`].

use candle_core::D;

use crate::model::{
    argmax, generate, GenerateOptions, Interventions, LoadedModel, Logits, Model, NoObserver,
    Session,
};
#[cfg(feature = "mistralrs")]
use crate::reference::mistralrs::MistralRsEngine;
use crate::reference::GreedyTrace;
use crate::synthetic::synthetic_notes;
use crate::Result;

pub mod llama_cpp;

/// Greedy tokens compared per prompt.
pub const GREEDY_TOKENS: usize = 32;
/// Top-2 logit gap under which a greedy divergence counts as a near-tie.
pub const NEAR_TIE: f32 = 1e-2;
/// Required share of positions whose top-1 token agrees.
pub const MIN_TOP1_AGREEMENT: f64 = 0.99;
/// Required prompts (of 8) with identical greedy continuations.
pub const MIN_IDENTICAL: usize = 7;

/// Where two greedy continuations first differ.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    /// Index of the first differing generated token.
    pub step: usize,
    /// Top-1 minus top-2 logit of the instrumented model at that decode step.
    pub gap_ours: f32,
    /// The same for mistral.rs (its own decode step).
    pub gap_reference: f32,
}

impl Divergence {
    /// Whether the divergence started at a near-tie in either engine.
    pub fn near_tie(&self) -> bool {
        self.gap_ours.min(self.gap_reference) < NEAR_TIE
    }
}

/// Parity numbers of one prompt.
#[derive(Debug, Clone)]
pub struct PromptParity {
    /// Short label.
    pub name: String,
    /// Prompt tokens (teacher-forced positions compared).
    pub tokens: usize,
    /// Largest |Δlogit| over all positions and vocabulary entries.
    pub max_abs_diff: f32,
    /// Mean |Δlogit|.
    pub mean_abs_diff: f32,
    /// Positions whose argmax agrees.
    pub top1_agree: usize,
    /// Greedy continuation of the instrumented model.
    pub greedy_ours: Vec<u32>,
    /// Greedy continuation of mistral.rs.
    pub greedy_reference: Vec<u32>,
    /// First difference of the continuations, if any.
    pub divergence: Option<Divergence>,
}

/// The verdict over all prompts.
#[derive(Debug, Clone)]
pub struct ParityReport {
    pub prompts: Vec<PromptParity>,
}

impl ParityReport {
    /// Share of all compared positions whose top-1 token agrees.
    pub fn top1_rate(&self) -> f64 {
        let agree: usize = self.prompts.iter().map(|p| p.top1_agree).sum();
        let total: usize = self.prompts.iter().map(|p| p.tokens).sum();
        agree as f64 / total.max(1) as f64
    }

    /// Prompts whose greedy continuations are identical.
    pub fn identical(&self) -> usize {
        self.prompts
            .iter()
            .filter(|p| p.divergence.is_none())
            .count()
    }

    /// The bar: top-1 agreement >= 99%, identical continuations on >= 7 of 8 prompts
    /// (scaled to the prompt count), and every divergence at a near-tie.
    pub fn passes(&self) -> bool {
        let n = self.prompts.len();
        let need = (MIN_IDENTICAL * n).div_ceil(8);
        self.top1_rate() >= MIN_TOP1_AGREEMENT
            && self.identical() >= need
            && self
                .prompts
                .iter()
                .filter_map(|p| p.divergence.as_ref())
                .all(Divergence::near_tie)
    }
}

/// The fixed parity prompts: `(name, text)`; the last one is over 1,500 tokens.
pub fn prompts() -> Vec<(&'static str, String)> {
    let mut v: Vec<(&'static str, String)> = vec![
        ("capital", "The capital of France is".into()),
        (
            "chat",
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n".into(),
        ),
        ("digits", "Year 2026 has 12345 items; 7 + 8 = 15 and 12 * 3 =".into()),
        (
            "code",
            "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n".into(),
        ),
        (
            "story",
            "Once upon a time, in a small village by the sea, there lived an old fisherman who".into(),
        ),
        (
            "unicode",
            "Café, naïve, Zürich, 東京 and Москва are words; the next one is".into(),
        ),
        (
            "list",
            "Shopping list:\n1. milk\n2. eggs\n3. bread\n4.".into(),
        ),
    ];
    v.push(("long-haystack", long_prompt()));
    v
}

/// A deterministic ~1,700-token prompt: numbered notes with a needle in the middle and a
/// question at the end.
fn long_prompt() -> String {
    format!(
        "Read the notes below and answer the question.\n\n{}\nQuestion: What is the secret number of the archive?\nAnswer: The secret number is",
        synthetic_notes(64, Some(32))
    )
}

/// Top-1 minus top-2 of a `(vocab,)` logits row.
fn top2_gap(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in row {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// `n` greedy tokens after `prompt` (no stop token: the reference runs ignore EOS too),
/// with the top-2 logit gap of every step.
pub fn greedy_trace(model: &Model, prompt: &[u32], n: usize) -> Result<GreedyTrace> {
    let mut session = Session::new(model, prompt.len() + n);
    let (none, mut trace) = (Interventions::new(), GreedyTrace::default());
    let mut logits = session.prefill(prompt, &mut NoObserver, &none)?;
    for step in 0..n {
        let next = argmax(&logits)?;
        trace.tokens.push(next);
        trace
            .top2_gaps
            .push(top2_gap(&logits.flatten_all()?.to_vec1()?));
        if step + 1 < n {
            logits = session.step(next, &mut NoObserver, &none)?;
        }
    }
    Ok(trace)
}

/// Where two greedy continuations first differ, with both engines' top-2 gaps there.
pub fn divergence(ours: &GreedyTrace, reference: &GreedyTrace) -> Option<Divergence> {
    ours.tokens
        .iter()
        .zip(&reference.tokens)
        .position(|(x, y)| x != y)
        .map(|step| Divergence {
            step,
            gap_ours: ours.top2_gaps[step],
            gap_reference: reference.top2_gaps[step],
        })
}

/// Compare one prompt.
#[cfg(feature = "mistralrs")]
pub fn compare_prompt(
    ours: &LoadedModel,
    reference: &MistralRsEngine,
    name: &str,
    text: &str,
) -> Result<PromptParity> {
    let tokens = ours.encode(text, true)?;
    let a = Session::new(&ours.model, tokens.len()).feed(
        &tokens,
        Logits::All,
        &mut NoObserver,
        &Interventions::new(),
    )?;
    let b = reference.logits(&tokens)?;
    let diff = (&a - &b)?.abs()?;
    let max_abs_diff = diff.max_all()?.to_scalar::<f32>()?;
    let mean_abs_diff = diff.mean_all()?.to_scalar::<f32>()?;
    let top_a: Vec<u32> = a.argmax(D::Minus1)?.to_vec1()?;
    let top_b: Vec<u32> = b.argmax(D::Minus1)?.to_vec1()?;
    let top1_agree = top_a.iter().zip(&top_b).filter(|(x, y)| x == y).count();

    let opts = GenerateOptions {
        max_new: GREEDY_TOKENS,
        ..GenerateOptions::default()
    };
    let mut gaps_ours = Vec::with_capacity(GREEDY_TOKENS);
    let mut gap_error = None;
    let greedy_ours = generate(
        &ours.model,
        &tokens,
        &opts,
        &mut NoObserver,
        &Interventions::new(),
        &mut |_, logits| match logits.flatten_all().and_then(|l| l.to_vec1::<f32>()) {
            Ok(row) => {
                gaps_ours.push(top2_gap(&row));
                true
            }
            Err(e) => {
                gap_error = Some(e);
                false
            }
        },
    )?
    .tokens;
    if let Some(e) = gap_error {
        return Err(e.into());
    }
    let reference_trace = reference.greedy_trace(&tokens, GREEDY_TOKENS)?;
    let divergence = greedy_ours
        .iter()
        .zip(&reference_trace.tokens)
        .position(|(x, y)| x != y)
        .map(|step| Divergence {
            step,
            gap_ours: gaps_ours[step],
            gap_reference: reference_trace.top2_gaps[step],
        });
    let greedy_reference = reference_trace.tokens;
    Ok(PromptParity {
        name: name.to_string(),
        tokens: tokens.len(),
        max_abs_diff,
        mean_abs_diff,
        top1_agree,
        greedy_ours,
        greedy_reference,
        divergence,
    })
}

/// Compare all [`prompts`], calling `progress` after each.
#[cfg(feature = "mistralrs")]
pub fn run(
    ours: &LoadedModel,
    reference: &MistralRsEngine,
    progress: &mut dyn FnMut(&PromptParity),
) -> Result<ParityReport> {
    let mut prompts = Vec::new();
    for (name, text) in self::prompts() {
        let p = compare_prompt(ours, reference, name, &text)?;
        progress(&p);
        prompts.push(p);
    }
    Ok(ParityReport { prompts })
}
