//! Task generators for retrieval-head scoring: needle-in-a-haystack trials, tokenized.
//!
//! Two families of trials, both "a needle sentence hidden in filler text, then a
//! question whose answer is in the needle":
//!
//! - [`TaskKind::Niah`], the literal needle-in-a-haystack test (Kamradt's
//!   LLMTest_NeedleInAHaystack) as used to find retrieval heads by their copy-paste score
//!   (Wu et al., 2024, "Retrieval Head Mechanistically Explains Long-Context
//!   Factuality"): the question repeats the needle's words and the answer is a number
//!   copied verbatim from it ([`niah`]);
//! - [`TaskKind::Nolima`], NoLiMa-style non-literal needles (Modarressi et al., 2025,
//!   "NoLiMa: Long-Context Evaluation Beyond Literal Matching"): the question shares no
//!   content word with the needle and needs one hop of world knowledge (landmark to
//!   place), and [`TaskKind::NolimaControl`], the literal control question on the same
//!   needle ([`nolima`]).
//!
//! ## Construction
//!
//! Every trial is assembled from separately tokenized pieces (no special tokens), so the
//! needle's token span is exact by construction:
//!
//! ```text
//! [BOS?] + "{instruction}\n\n" + haystack-before + needle + haystack-after
//!        + "\n\nQuestion: {question}\nAnswer:"
//! ```
//!
//! The haystack ([`haystack`]) is split into sentences; each sentence is tokenized on its
//! own with a leading space (`" Sentence."`), except the first piece after the
//! instruction, which is tokenized without one. The needle is one more such piece. The
//! haystack part holds exactly `context_tokens` tokens: whole sentences from a
//! seed-dependent start (wrapping around the corpus), the last one cut at the token where
//! the count is reached (mid-sentence, as in the original NIAH). The needle goes after
//! the sentence boundary nearest to `round(depth * context_tokens)` haystack tokens
//! (0 and the end count as boundaries; ties go to the earlier one); the trial records
//! where it went ([`Trial::haystack_before`]). The answer is expected to be generated
//! right after `Answer:` with a leading space (`" 4812907"`, `" Omar"`); its ids
//! ([`Trial::answer_tokens`]) are the tokenization of that text, which for both SmolLM2
//! and Gemma 3 is a contiguous run of the needle's ids (tested).
//!
//! Prompts are raw completions (no chat template); the BOS token is prepended when the
//! tokenizer adds one ([`Encoder::bos`]).
//!
//! ## Seeds
//!
//! A seed fixes the needle (number, or character and landmark) and the haystack start; a
//! [`TaskSpec`] crosses every length and depth with every seed, so cells that share a
//! seed differ only in length and depth, and [`TaskKind::Nolima`] and
//! [`TaskKind::NolimaControl`] trials with the same seed share their needle and haystack.
//! Generation is deterministic (a built-in SplitMix64, not tied to a `rand` version).

pub mod haystack;
pub mod niah;
pub mod nolima;

use std::collections::BTreeSet;
use std::ops::Range;

use tokenizers::Tokenizer;

pub use haystack::{Haystack, HaystackTokens, Window};

use crate::model::text::tokenizer::{decode_ids, encode_ids, SpecialTokens};
use crate::model::LoadedModel;
use crate::{Error, Result};

/// The generator of the trials, for the generators of this module.
pub(crate) use crate::rng::SplitMix64;

/// One generated trial, already tokenized with the model's tokenizer.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Trial {
    /// Unique within one [`generate`] call: `{kind}-L{length}-D{depth %}-s{seed}`, e.g.
    /// `niah-L512-D25-s3`, `nolima_control-L0-D0-s1`.
    pub id: String,
    /// Which task generated it.
    pub task: TaskKind,
    /// Haystack length in tokens, as requested; the prompt holds exactly this many
    /// haystack tokens (0: no haystack, only the needle between instruction and question).
    pub context_tokens: usize,
    /// Requested needle depth in `[0, 1]` (0 for `context_tokens == 0`); where the needle
    /// actually went is [`Trial::haystack_before`].
    pub depth: f64,
    /// The seed that chose the needle and the haystack start.
    pub seed: u64,
    /// Full prompt ids: BOS first if the tokenizer adds it, ending right before the
    /// answer (after `Answer:`).
    pub prompt: Vec<u32>,
    /// Token span `[start, end)` of the needle sentence inside `prompt`.
    pub needle: Range<usize>,
    /// Where the question (`\n\nQuestion: ...\nAnswer:`) starts in `prompt`: the
    /// context before it is what a query-agnostic press compresses (`None` in trials
    /// recorded before it was).
    #[serde(default)]
    pub question_start: Option<usize>,
    /// Haystack tokens before the needle (the needle's depth in tokens, after snapping to
    /// a sentence boundary): `haystack_before / context_tokens` is the placed depth.
    pub haystack_before: usize,
    /// The needle sentence, e.g. `The special magic number for the archive is 4812907.`
    pub needle_text: String,
    /// The question asked after the haystack.
    pub question: String,
    /// Gold answer text, e.g. `4812907` or `Omar`.
    pub answer: String,
    /// Gold answer ids as generated right after the prompt: the tokenization of
    /// `" " + answer` (the prompt ends with `Answer:`).
    pub answer_tokens: Vec<u32>,
}

/// The task that generates a trial.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// Literal needle in a haystack: a magic number, asked for with the needle's words.
    Niah,
    /// NoLiMa-style: "Actually, {name} lives next to {landmark}.", asked as "Which
    /// character has been to {place}?" (no shared content word).
    Nolima,
    /// The literal control on the NoLiMa needle: "Which character lives next to
    /// {landmark}?".
    NolimaControl,
}

impl TaskKind {
    /// The name used in trial ids and serialized specs: `niah`, `nolima`,
    /// `nolima_control`.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Niah => "niah",
            TaskKind::Nolima => "nolima",
            TaskKind::NolimaControl => "nolima_control",
        }
    }
}

/// What to generate: every length crossed with every depth and every seed.
///
/// A length of 0 generates one trial per seed (depth 0), since depth means nothing
/// without a haystack.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TaskSpec {
    /// The task.
    pub kind: TaskKind,
    /// Haystack lengths in tokens (each at most the model's context length; 0 allowed).
    pub lengths: Vec<usize>,
    /// Needle depths as fractions of the haystack, each in `[0, 1]`.
    pub depths: Vec<f64>,
    /// One trial per seed in every (length, depth) cell.
    pub seeds: Vec<u64>,
}

impl TaskSpec {
    /// A spec with `n_seeds` seeds `0..n_seeds`.
    pub fn grid(kind: TaskKind, lengths: Vec<usize>, depths: Vec<f64>, n_seeds: u64) -> Self {
        Self {
            kind,
            lengths,
            depths,
            seeds: (0..n_seeds).collect(),
        }
    }

    /// Check the spec against a model context of `max_context` tokens: non-empty lists
    /// without duplicates, finite depths in `[0, 1]`, lengths at most `max_context`.
    pub fn validate(&self, max_context: usize) -> Result<()> {
        if self.lengths.is_empty() {
            return Err(Error::invalid("lengths", "no length given"));
        }
        if self.depths.is_empty() {
            return Err(Error::invalid("depths", "no depth given"));
        }
        if self.seeds.is_empty() {
            return Err(Error::invalid("seeds", "no seed given"));
        }
        for &d in &self.depths {
            if !(0.0..=1.0).contains(&d) {
                return Err(Error::invalid(
                    "depths",
                    format!("{d} is not a fraction in [0, 1]"),
                ));
            }
        }
        for &len in &self.lengths {
            if len > max_context {
                return Err(Error::invalid(
                    "lengths",
                    format!(
                        "a haystack of {len} tokens exceeds the model's context of {max_context} tokens"
                    ),
                ));
            }
        }
        let mut seen = BTreeSet::new();
        if let Some(d) = self.lengths.iter().find(|&&l| !seen.insert(l)) {
            return Err(Error::invalid("lengths", format!("{d} is given twice")));
        }
        let mut seen = BTreeSet::new();
        if let Some(d) = self.seeds.iter().find(|&&s| !seen.insert(s)) {
            return Err(Error::invalid("seeds", format!("{d} is given twice")));
        }
        let mut seen = BTreeSet::new();
        if let Some(d) = self.depths.iter().find(|&&d| !seen.insert(depth_label(d))) {
            return Err(Error::invalid(
                "depths",
                format!(
                    "{d} is given twice (depths are told apart by whole percent: D{})",
                    depth_label(*d)
                ),
            ));
        }
        Ok(())
    }
}

/// The tokenizer side of a model, as the generators need it.
#[derive(Clone, Copy)]
pub struct Encoder<'a> {
    tokenizer: &'a Tokenizer,
    bos: Option<u32>,
    max_context: usize,
}

impl<'a> Encoder<'a> {
    /// Encode with `tokenizer`; prepend `special.bos` when `special.add_bos` is set;
    /// reject prompts longer than `max_context` tokens (the model's context length).
    pub fn new(tokenizer: &'a Tokenizer, special: &SpecialTokens, max_context: usize) -> Self {
        Self {
            tokenizer,
            bos: if special.add_bos { special.bos } else { None },
            max_context,
        }
    }

    /// The encoder of a loaded model, limited to its `context_length`.
    pub fn from_model(model: &'a LoadedModel) -> Self {
        Self::new(
            &model.tokenizer,
            &model.special,
            model.model.config().context_length,
        )
    }

    /// Ids of `text`, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        encode_ids(self.tokenizer, text, false)
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        decode_ids(self.tokenizer, ids)
    }

    /// The BOS id every prompt starts with, if the tokenizer adds one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The longest prompt plus answer, in tokens.
    pub fn max_context(&self) -> usize {
        self.max_context
    }
}

/// A needle with its question, as one task draws it for one seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Needle {
    /// The instruction that opens the prompt.
    pub instruction: String,
    /// The needle sentence hidden in the haystack.
    pub sentence: String,
    /// The question asked after the haystack.
    pub question: String,
    /// The gold answer text.
    pub answer: String,
}

/// Generate every trial of `spec`: lengths outermost, then depths, then seeds.
///
/// Errors ([`Error::InvalidArgument`] unless noted): a spec that fails
/// [`TaskSpec::validate`] against [`Encoder::max_context`]; a length above 0 but shorter
/// than the needle plus question; a haystack with no usable sentence (for NoLiMa,
/// sentences that mention a character, landmark or place are left out); a prompt plus
/// answer longer than the context ([`Error::ContextOverflow`]); tokenizer failures
/// ([`Error::Tokenizer`]).
pub fn generate(spec: &TaskSpec, enc: &Encoder, haystack: &Haystack) -> Result<Vec<Trial>> {
    spec.validate(enc.max_context())?;
    let avoid = match spec.kind {
        TaskKind::Niah => niah::avoided_phrases(),
        TaskKind::Nolima | TaskKind::NolimaControl => nolima::avoided_phrases(),
    };
    let mut tokens = HaystackTokens::new(haystack, *enc, &avoid)?;
    let mut trials = Vec::new();
    let mut ids = BTreeSet::new();
    for &len in &spec.lengths {
        let depths: &[f64] = if len == 0 { &[0.0] } else { &spec.depths };
        for &depth in depths {
            for &seed in &spec.seeds {
                let needle = match spec.kind {
                    TaskKind::Niah => niah::needle(seed),
                    TaskKind::Nolima => nolima::needle(seed, false),
                    TaskKind::NolimaControl => nolima::needle(seed, true),
                };
                let trial = assemble(spec.kind, &needle, len, depth, seed, enc, &mut tokens)?;
                if !ids.insert(trial.id.clone()) {
                    return Err(Error::invalid(
                        "spec",
                        format!("two trials share the id {}", trial.id),
                    ));
                }
                trials.push(trial);
            }
        }
    }
    Ok(trials)
}

/// Whole percent of a depth, as trial ids show it.
fn depth_label(depth: f64) -> u32 {
    (depth * 100.0).round() as u32
}

/// Build one trial (see the module docs for the layout).
fn assemble(
    kind: TaskKind,
    needle: &Needle,
    len: usize,
    depth: f64,
    seed: u64,
    enc: &Encoder,
    tokens: &mut HaystackTokens,
) -> Result<Trial> {
    let id = format!("{}-L{len}-D{}-s{seed}", kind.name(), depth_label(depth));
    let suffix = enc.encode(&format!("\n\nQuestion: {}\nAnswer:", needle.question))?;
    let bare_needle = enc.encode(&needle.sentence)?;
    if len > 0 && len < bare_needle.len() + suffix.len() {
        return Err(Error::invalid(
            "lengths",
            format!(
                "{id}: a haystack of {len} tokens is shorter than the needle and question \
                 ({} tokens); use 0 for no haystack or at least {}",
                bare_needle.len() + suffix.len(),
                bare_needle.len() + suffix.len()
            ),
        ));
    }
    let start = tokens.start_for_seed(seed);
    let mut window = tokens.window(start, len, true)?;
    let target = (depth * len as f64).round() as usize;
    let mut at = window.snap(target);
    if at == 0 && !window.pieces.is_empty() {
        // The needle opens the body, so the first sentence gets its leading space back.
        window = tokens.window(start, len, false)?;
        at = 0;
    }
    let needle_ids = if at == 0 {
        bare_needle
    } else {
        enc.encode(&format!(" {}", needle.sentence))?
    };

    let mut prompt = Vec::with_capacity(len + needle_ids.len() + suffix.len() + 64);
    prompt.extend(enc.bos());
    prompt.extend(enc.encode(&format!("{}\n\n", needle.instruction))?);
    let mut before = 0;
    for piece in &window.pieces[..at] {
        prompt.extend_from_slice(piece);
        before += piece.len();
    }
    let start_needle = prompt.len();
    prompt.extend_from_slice(&needle_ids);
    let needle_span = start_needle..prompt.len();
    for piece in &window.pieces[at..] {
        prompt.extend_from_slice(piece);
    }
    let question_start = prompt.len();
    prompt.extend_from_slice(&suffix);
    let answer_tokens = enc.encode(&format!(" {}", needle.answer))?;
    if prompt.len() + answer_tokens.len() > enc.max_context() {
        return Err(Error::ContextOverflow {
            prompt: prompt.len(),
            max_new: answer_tokens.len(),
            context: enc.max_context(),
        });
    }
    Ok(Trial {
        id,
        task: kind,
        context_tokens: len,
        depth,
        seed,
        prompt,
        needle: needle_span,
        question_start: Some(question_start),
        haystack_before: before,
        needle_text: needle.sentence.clone(),
        question: needle.question.clone(),
        answer: needle.answer.clone(),
        answer_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{data, gemma3, smollm2};

    fn paul_graham() -> Option<Haystack> {
        let dir = data("haystack/paul_graham")?;
        Some(Haystack::from_dir(&dir).expect("essays"))
    }

    fn spec(kind: TaskKind) -> TaskSpec {
        TaskSpec {
            kind,
            lengths: vec![0, 64, 300, 1000],
            depths: vec![0.0, 0.25, 0.5, 0.75, 1.0],
            seeds: vec![0, 1, 7],
        }
    }

    fn is_run_of(needle: &[u32], run: &[u32]) -> bool {
        !run.is_empty() && needle.windows(run.len()).any(|w| w == run)
    }

    /// Every structural promise of a trial, checked against an independent decode.
    fn check_trial(t: &Trial, enc: &Encoder) {
        let needle = enc.decode(&t.prompt[t.needle.clone()]).unwrap();
        assert_eq!(needle.trim(), t.needle_text.trim(), "{}", t.id);
        assert!(
            is_run_of(&t.prompt[t.needle.clone()], &t.answer_tokens),
            "{}: answer ids {:?} not inside the needle ids {:?}",
            t.id,
            t.answer_tokens,
            &t.prompt[t.needle.clone()]
        );
        assert_eq!(
            enc.decode(&t.answer_tokens).unwrap().trim(),
            t.answer,
            "{}",
            t.id
        );
        if let Some(bos) = enc.bos() {
            assert_eq!(t.prompt[0], bos);
        }
        let text = enc.decode(&t.prompt).unwrap();
        assert!(text.ends_with("\nAnswer:"), "{}", t.id);
        assert!(
            text.contains(&format!("Question: {}", t.question)),
            "{}",
            t.id
        );
        // Exact haystack length: everything but BOS, instruction, needle and suffix.
        let prefix = enc.encode(&format!("{}\n\n", instruction_of(t))).unwrap();
        let suffix = enc
            .encode(&format!("\n\nQuestion: {}\nAnswer:", t.question))
            .unwrap();
        let bos = usize::from(enc.bos().is_some());
        let hay = t.prompt.len() - bos - prefix.len() - t.needle.len() - suffix.len();
        assert_eq!(hay, t.context_tokens, "{}", t.id);
        assert_eq!(t.needle.start, bos + prefix.len() + t.haystack_before);
        assert!(t.prompt.len() + t.answer_tokens.len() <= enc.max_context());
    }

    fn instruction_of(t: &Trial) -> String {
        match t.task {
            TaskKind::Niah => niah::needle(t.seed).instruction,
            TaskKind::Nolima => nolima::needle(t.seed, false).instruction,
            TaskKind::NolimaControl => nolima::needle(t.seed, true).instruction,
        }
    }

    fn check_all(tok: &Tokenizer, special: &SpecialTokens, ctx: usize, hay: &Haystack) {
        let enc = Encoder::new(tok, special, ctx);
        for kind in [TaskKind::Niah, TaskKind::Nolima, TaskKind::NolimaControl] {
            let trials = generate(&spec(kind), &enc, hay).unwrap();
            // Length 0 is one trial per seed; the rest cross every depth.
            assert_eq!(trials.len(), 3 + 3 * 5 * 3);
            for t in &trials {
                check_trial(t, &enc);
                // The placed depth is near the requested one: within one sentence.
                if t.context_tokens > 0 {
                    let placed = t.haystack_before as f64 / t.context_tokens as f64;
                    assert!((0.0..=1.0).contains(&placed));
                }
            }
        }
    }

    #[test]
    fn needle_span_answer_and_length_are_exact_for_smollm2() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        check_all(&tok, &special, ctx, &Haystack::synthetic());
        if let Some(pg) = paul_graham() {
            check_all(&tok, &special, ctx, &pg);
        }
    }

    #[test]
    fn needle_span_answer_and_length_are_exact_for_gemma3() {
        let Some((tok, special, ctx)) = gemma3() else {
            return;
        };
        assert!(special.add_bos, "Gemma 3 prompts start with BOS");
        check_all(&tok, &special, ctx, &Haystack::synthetic());
        if let Some(pg) = paul_graham() {
            check_all(&tok, &special, ctx, &pg);
        }
    }

    #[test]
    fn depth_places_the_needle_near_the_requested_fraction() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let spec = TaskSpec {
            kind: TaskKind::Niah,
            lengths: vec![2000],
            depths: vec![0.0, 0.1, 0.5, 0.9, 1.0],
            seeds: vec![3],
        };
        let trials = generate(&spec, &enc, &Haystack::synthetic()).unwrap();
        let before: Vec<usize> = trials.iter().map(|t| t.haystack_before).collect();
        assert_eq!(before[0], 0);
        assert_eq!(before[4], 2000);
        // Synthetic sentences are under 30 tokens, so snapping moves the needle by less.
        for (t, b) in trials.iter().zip(&before) {
            let target = (t.depth * 2000.0).round() as i64;
            assert!((*b as i64 - target).abs() < 30, "{}: {b} vs {target}", t.id);
        }
        assert!(before.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn same_spec_and_seed_give_identical_trials() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let hay = Haystack::synthetic();
        for kind in [TaskKind::Niah, TaskKind::Nolima] {
            let a = generate(&spec(kind), &enc, &hay).unwrap();
            let b = generate(&spec(kind), &enc, &hay).unwrap();
            assert_eq!(a, b);
            // Different seeds: different needles and different haystack text.
            let s0: Vec<&Trial> = a.iter().filter(|t| t.seed == 0).collect();
            let s1: Vec<&Trial> = a.iter().filter(|t| t.seed == 1).collect();
            for (x, y) in s0.iter().zip(&s1) {
                assert_eq!((x.context_tokens, x.depth), (y.context_tokens, y.depth));
                assert_ne!(x.needle_text, y.needle_text);
                if x.context_tokens > 0 {
                    assert_ne!(x.prompt, y.prompt);
                }
            }
        }
    }

    #[test]
    fn nolima_and_its_control_share_needle_and_haystack() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let hay = Haystack::synthetic();
        let a = generate(&spec(TaskKind::Nolima), &enc, &hay).unwrap();
        let b = generate(&spec(TaskKind::NolimaControl), &enc, &hay).unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.needle_text, y.needle_text);
            assert_eq!(x.answer_tokens, y.answer_tokens);
            assert_eq!(x.prompt[x.needle.clone()], y.prompt[y.needle.clone()]);
            assert_eq!(x.haystack_before, y.haystack_before);
            assert_ne!(x.question, y.question);
        }
    }

    #[test]
    fn bad_specs_are_errors_not_panics() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let hay = Haystack::synthetic();
        let bad = |lengths: Vec<usize>, depths: Vec<f64>, seeds: Vec<u64>| {
            let spec = TaskSpec {
                kind: TaskKind::Niah,
                lengths,
                depths,
                seeds,
            };
            generate(&spec, &enc, &hay).unwrap_err().to_string()
        };
        let too_long = bad(vec![ctx + 1], vec![0.5], vec![0]);
        assert!(
            too_long.contains("exceeds the model's context"),
            "{too_long}"
        );
        let shorter = bad(vec![10], vec![0.5], vec![0]);
        assert!(shorter.contains("shorter than the needle"), "{shorter}");
        // Fits as a haystack, but not with instruction, needle and question around it.
        let overflow = bad(vec![ctx], vec![0.5], vec![0]);
        assert!(overflow.contains("exceeds the context"), "{overflow}");
        assert!(bad(vec![], vec![0.5], vec![0]).contains("no length"));
        assert!(bad(vec![64], vec![], vec![0]).contains("no depth"));
        assert!(bad(vec![64], vec![0.5], vec![]).contains("no seed"));
        assert!(bad(vec![64], vec![1.5], vec![0]).contains("[0, 1]"));
        assert!(bad(vec![64], vec![f64::NAN], vec![0]).contains("[0, 1]"));
        assert!(bad(vec![64, 64], vec![0.5], vec![0]).contains("twice"));
        assert!(bad(vec![64], vec![0.5, 0.501], vec![0]).contains("twice"));
        assert!(bad(vec![64], vec![0.5], vec![2, 2]).contains("twice"));
        // A haystack whose every sentence names a place leaves nothing for NoLiMa.
        let places = Haystack::from_texts("places", ["Paris is nice. So is Rome."]).unwrap();
        let spec = TaskSpec::grid(TaskKind::Nolima, vec![64], vec![0.5], 1);
        let empty = generate(&spec, &enc, &places).unwrap_err().to_string();
        assert!(empty.contains("every sentence mentions"), "{empty}");
    }

    #[test]
    fn spec_and_trial_round_trip_through_serde() {
        let spec = TaskSpec::grid(TaskKind::NolimaControl, vec![0, 512], vec![0.5], 3);
        let json = serde_json::to_string(&spec).unwrap();
        assert!(json.contains("\"nolima_control\""), "{json}");
        let back: TaskSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, spec);
        let trial = Trial {
            id: "niah-L0-D0-s0".into(),
            task: TaskKind::Niah,
            context_tokens: 0,
            depth: 0.0,
            seed: 0,
            prompt: vec![1, 2, 3],
            needle: 1..2,
            question_start: Some(2),
            haystack_before: 0,
            needle_text: "x".into(),
            question: "y".into(),
            answer: "z".into(),
            answer_tokens: vec![4],
        };
        let back: Trial = serde_json::from_str(&serde_json::to_string(&trial).unwrap()).unwrap();
        assert_eq!(back, trial);
    }

    #[test]
    fn splitmix_is_fixed_and_below_stays_in_range() {
        // First output of SplitMix64 seeded with 0 (reference value of the algorithm).
        assert_eq!(SplitMix64(0).next_u64(), 0xE220_A839_7B1D_CDAF);
        let mut g = SplitMix64::new(5, 9);
        for n in [1, 2, 3, 10, 1000] {
            for _ in 0..100 {
                assert!(g.below(n) < n);
            }
        }
        assert_ne!(
            SplitMix64::new(1, 0).next_u64(),
            SplitMix64::new(2, 0).next_u64()
        );
        assert_ne!(
            SplitMix64::new(1, 0).next_u64(),
            SplitMix64::new(1, 1).next_u64()
        );
    }
}
