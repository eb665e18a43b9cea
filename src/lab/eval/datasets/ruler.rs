//! RULER-style synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size
//! of Your Long-Context Language Models?"), generated here from a seed at a given token
//! length and scored as RULER scores them: the share of the expected strings found in
//! the answer (`recall_all`, RULER's `string_match_all`), or for QA whether any accepted
//! answer is in it (`accuracy`, its `string_match_part`).
//!
//! | task | the context | the question asks for |
//! | --- | --- | --- |
//! | `ruler_niah_single` | one needle "The special magic number for {key} is: {7 digits}." in the essay haystack | that number |
//! | `ruler_niah_multikey` | four needles with different keys and UUID values | the value of one key |
//! | `ruler_niah_multivalue` | four needles with one key and four numbers | all four numbers |
//! | `ruler_niah_multiquery` | four needles with different keys | the numbers of all four keys |
//! | `ruler_vt` | a chain "VAR A = 12345." "VAR B = VAR A." ... (4 hops) in the haystack, in order | every variable holding the value (5 names) |
//! | `ruler_cwe` | a numbered list of words, 10 of them 6 times each, the rest twice | the 10 most common |
//! | `ruler_fwe` | a coded text whose word counts fall as `1 / rank^2` | the 3 most frequent |
//! | `ruler_qa` | a HotpotQA question's two gold paragraphs among distractors (its own, then other questions') | the answer |
//!
//! Keys are "{adjective}-{noun}" words, numbers have seven digits, UUIDs are 8-4-4-4-12
//! hexadecimal, variable names five capitals, coded words five lower-case letters. Needles
//! go at seed-drawn depths, snapped to haystack sentence boundaries, after the first
//! haystack sentence at least; the chain of `ruler_vt` keeps its order.
//!
//! Prompt (raw completion, like the other tasks):
//!
//! ```text
//! [BOS?] "{instruction}\n\n" {context} "\n\nQuestion: {question}\nAnswer:"
//! ```
//!
//! Lengths: needle and variable-tracking prompts hold exactly `length` tokens (the
//! haystack fills what the instruction, needles and question leave); word lists and QA
//! hold at most `length` (the longest list, the most whole paragraphs that fit; items
//! that run out more than 256 tokens short are an error). The
//! question starts where `Example::question_start` says, so a query-agnostic press
//! compresses the context alone.

use std::collections::BTreeSet;
use std::ops::Range;

use super::question_suffix;
use crate::lab::eval::Example;
use crate::lab::tasks::{Encoder, Haystack, HaystackTokens};
use crate::metrics::Metric;
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// One RULER-style task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RulerTask {
    NiahSingle,
    NiahMultikey,
    NiahMultivalue,
    NiahMultiquery,
    VariableTracking,
    CommonWords,
    FrequentWords,
    Qa,
}

impl RulerTask {
    /// Every task, in the table's order.
    pub const ALL: [RulerTask; 8] = [
        RulerTask::NiahSingle,
        RulerTask::NiahMultikey,
        RulerTask::NiahMultivalue,
        RulerTask::NiahMultiquery,
        RulerTask::VariableTracking,
        RulerTask::CommonWords,
        RulerTask::FrequentWords,
        RulerTask::Qa,
    ];

    /// The task's name in specs and records (`ruler_niah_single`, ...).
    pub fn name(self) -> &'static str {
        match self {
            RulerTask::NiahSingle => "ruler_niah_single",
            RulerTask::NiahMultikey => "ruler_niah_multikey",
            RulerTask::NiahMultivalue => "ruler_niah_multivalue",
            RulerTask::NiahMultiquery => "ruler_niah_multiquery",
            RulerTask::VariableTracking => "ruler_vt",
            RulerTask::CommonWords => "ruler_cwe",
            RulerTask::FrequentWords => "ruler_fwe",
            RulerTask::Qa => "ruler_qa",
        }
    }

    /// The task named `name`, if it is one.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Whether its answer is a list (several values, names or words), written over
    /// lines as often as not.
    pub fn lists(self) -> bool {
        !matches!(
            self,
            RulerTask::NiahSingle | RulerTask::NiahMultikey | RulerTask::Qa
        )
    }

    /// How its answers are scored.
    pub fn metric(self) -> Metric {
        match self {
            RulerTask::Qa => Metric::Accuracy,
            _ => Metric::RecallAll,
        }
    }

    /// The salt of the task's random stream.
    fn salt(self) -> u64 {
        0x7275_6c65_7200_0000 + self as u64
    }
}

/// A HotpotQA question as the QA task reads it: paragraphs as `"{title}: {text}"`.
#[derive(Debug, Clone, PartialEq)]
pub struct QaItem {
    pub question: String,
    pub answer: String,
    /// The paragraphs holding the supporting facts.
    pub gold: Vec<String>,
    /// The question's other paragraphs.
    pub distractors: Vec<String>,
}

/// Every example of `task` at every length for every seed (lengths outermost): ids
/// `{task}-L{length}-s{seed}`. `qa` holds the questions `ruler_qa` draws from (seed `s`
/// asks question `s % qa.len()`); the other tasks ignore it.
///
/// Errors: a length too short for the task's fixed parts; a prompt plus answer longer
/// than the context; an empty `qa` for `ruler_qa`; tokenizer failures.
pub fn generate(
    task: RulerTask,
    lengths: &[usize],
    seeds: &[u64],
    enc: &Encoder,
    haystack: &Haystack,
    qa: &[QaItem],
) -> Result<Vec<Example>> {
    let avoid = ["magic".to_string(), "var".to_string()];
    let mut tokens = HaystackTokens::new(haystack, *enc, &avoid)?;
    let words = list_words(haystack);
    let mut out = Vec::new();
    for &len in lengths {
        for &seed in seeds {
            let mut rng = SplitMix64::new(seed, task.salt());
            let id = format!("{}-L{len}-s{seed}", task.name());
            let draft = match task {
                RulerTask::NiahSingle
                | RulerTask::NiahMultikey
                | RulerTask::NiahMultivalue
                | RulerTask::NiahMultiquery => needles(task, &mut rng),
                RulerTask::VariableTracking => chain(&mut rng),
                RulerTask::CommonWords => common_words(&words, &mut rng)?,
                RulerTask::FrequentWords => frequent_words(&mut rng),
                RulerTask::Qa => {
                    if qa.is_empty() {
                        return Err(Error::invalid("ruler_qa", "no HotpotQA question to ask"));
                    }
                    qa_draft(qa, seed)
                }
            };
            let ex = match &draft.body {
                Body::Needles { .. } => {
                    fill_haystack(&id, task, len, seed, draft, enc, &mut tokens, &mut rng)?
                }
                Body::Items { .. } => fit_items(&id, task, len, draft, enc, &mut rng)?,
            };
            if ex.prompt.len() + ANSWER_ROOM > enc.max_context() {
                return Err(Error::ContextOverflow {
                    prompt: ex.prompt.len(),
                    max_new: ANSWER_ROOM,
                    context: enc.max_context(),
                });
            }
            out.push(ex);
        }
    }
    Ok(out)
}

/// Tokens left free for the answers (the longest, ten words, fits).
const ANSWER_ROOM: usize = 64;

/// How far short of its length a list or QA prompt may fall when its items run out.
const SHORT_BY: usize = 256;

/// An example before it is fitted to its length.
struct Draft {
    instruction: String,
    body: Body,
    question: String,
    answers: Vec<String>,
}

/// What the context is made of.
enum Body {
    /// Sentences hidden in the haystack, in this order; `support` are their indices
    /// that hold the answer.
    Needles {
        sentences: Vec<String>,
        support: Vec<usize>,
    },
    /// Items that make the whole context: `fixed` always, then as many `optional` groups
    /// as fit, in order (a group whole or not at all); shuffled together; `support`
    /// marks the fixed items that hold the answer.
    Items {
        fixed: Vec<String>,
        optional: Vec<Vec<String>>,
        support: Vec<usize>,
        layout: Layout,
    },
}

/// How list items are written.
#[derive(Clone, Copy)]
enum Layout {
    /// `"1. word"`, one a line.
    Numbered,
    /// Separated by spaces.
    Words,
    /// Separated by blank lines.
    Paragraphs,
}

const ADJECTIVES: [&str; 16] = [
    "amber", "brave", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly",
    "kind", "lucky", "misty", "noble", "proud", "quiet",
];
const NOUNS: [&str; 16] = [
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island",
    "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper",
];

/// `n` distinct strings from `draw` (which must be able to give that many).
fn distinct(
    rng: &mut SplitMix64,
    n: usize,
    draw: impl Fn(&mut SplitMix64) -> String,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(n);
    while out.len() < n {
        let s = draw(rng);
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// `len` random letters from `first` on (`b'A'` or `b'a'`).
fn letters(rng: &mut SplitMix64, first: u8, len: usize) -> String {
    (0..len)
        .map(|_| char::from(first + rng.below(26) as u8))
        .collect()
}

/// `n` distinct "{adjective}-{noun}" keys.
fn keys(rng: &mut SplitMix64, n: usize) -> Vec<String> {
    distinct(rng, n, |rng| {
        let adjective = ADJECTIVES[rng.below(ADJECTIVES.len())];
        format!("{adjective}-{}", NOUNS[rng.below(NOUNS.len())])
    })
}

fn number(rng: &mut SplitMix64) -> String {
    (1_000_000 + rng.below(9_000_000)).to_string()
}

fn uuid(rng: &mut SplitMix64) -> String {
    let hex = |rng: &mut SplitMix64, n: usize| -> String {
        (0..n)
            .map(|_| char::from_digit(rng.below(16) as u32, 16).unwrap_or('0'))
            .collect()
    };
    [8, 4, 4, 4, 12]
        .iter()
        .map(|&n| hex(rng, n))
        .collect::<Vec<_>>()
        .join("-")
}

/// The four needle tasks.
fn needles(task: RulerTask, rng: &mut SplitMix64) -> Draft {
    let sentence = |kind: &str, key: &str, value: &str| {
        format!("The special magic {kind} for {key} is: {value}.")
    };
    let instruction = |kind: &str| {
        format!(
            "Special magic {kind}s are hidden in the text below. Memorize them: a question \
             about them follows the text."
        )
    };
    match task {
        RulerTask::NiahSingle => {
            let (key, value) = (keys(rng, 1).remove(0), number(rng));
            Draft {
                instruction: instruction("number"),
                body: Body::Needles {
                    sentences: vec![sentence("number", &key, &value)],
                    support: vec![0],
                },
                question: format!("What is the special magic number for {key}?"),
                answers: vec![value],
            }
        }
        RulerTask::NiahMultikey => {
            let ks = keys(rng, 4);
            let values: Vec<String> = (0..4).map(|_| uuid(rng)).collect();
            let asked = rng.below(4);
            Draft {
                instruction: instruction("uuid"),
                body: Body::Needles {
                    sentences: (0..4)
                        .map(|i| sentence("uuid", &ks[i], &values[i]))
                        .collect(),
                    support: vec![asked],
                },
                question: format!("What is the special magic uuid for {}?", ks[asked]),
                answers: vec![values[asked].clone()],
            }
        }
        RulerTask::NiahMultivalue => {
            let key = keys(rng, 1).remove(0);
            let values: Vec<String> = (0..4).map(|_| number(rng)).collect();
            Draft {
                instruction: instruction("number"),
                body: Body::Needles {
                    sentences: values.iter().map(|v| sentence("number", &key, v)).collect(),
                    support: (0..4).collect(),
                },
                question: format!("What are all the special magic numbers for {key}?"),
                answers: values,
            }
        }
        _ => {
            let ks = keys(rng, 4);
            let values: Vec<String> = (0..4).map(|_| number(rng)).collect();
            Draft {
                instruction: instruction("number"),
                body: Body::Needles {
                    sentences: (0..4)
                        .map(|i| sentence("number", &ks[i], &values[i]))
                        .collect(),
                    support: (0..4).collect(),
                },
                question: format!(
                    "What are the special magic numbers for {}, {}, {} and {}?",
                    ks[0], ks[1], ks[2], ks[3]
                ),
                answers: values,
            }
        }
    }
}

/// Variable tracking: one chain of five names through four hops.
fn chain(rng: &mut SplitMix64) -> Draft {
    let names = distinct(rng, 5, |rng| letters(rng, b'A', 5));
    let value = (10_000 + rng.below(90_000)).to_string();
    let mut sentences = vec![format!("VAR {} = {value}.", names[0])];
    sentences.extend((1..5).map(|i| format!("VAR {} = VAR {}.", names[i], names[i - 1])));
    Draft {
        instruction: "Memorize the variable assignments hidden in the text below: a question \
                      about them follows the text."
            .into(),
        body: Body::Needles {
            sentences,
            support: (0..5).collect(),
        },
        question: format!(
            "Which variables are assigned the value {value}, directly or through other \
             variables? List their names."
        ),
        answers: names,
    }
}

/// The lower-case words of 4 to 10 letters in the haystack, sorted, without repeats.
fn list_words(haystack: &Haystack) -> Vec<String> {
    let mut words = BTreeSet::new();
    for s in haystack.sentences() {
        for w in s.split(|c: char| !c.is_ascii_alphabetic()) {
            if (4..=10).contains(&w.len()) && w.chars().all(|c| c.is_ascii_lowercase()) {
                words.insert(w.to_string());
            }
        }
    }
    words.into_iter().collect()
}

/// Common words: 10 words six times each, then uncommon words twice each.
fn common_words(words: &[String], rng: &mut SplitMix64) -> Result<Draft> {
    if words.len() < 20 {
        return Err(Error::invalid(
            "haystack",
            "too few distinct words for the common-words task",
        ));
    }
    let mut pool = words.to_vec();
    rng.shuffle(&mut pool);
    let common = pool[..10].to_vec();
    let fixed = common.iter().flat_map(|w| vec![w.clone(); 6]).collect();
    let optional = pool[10..].iter().map(|w| vec![w.clone(); 2]).collect();
    Ok(Draft {
        instruction: "Below is a numbered list of words. Some words appear many times, the \
                      others only twice."
            .into(),
        body: Body::Items {
            fixed,
            optional,
            support: Vec::new(),
            layout: Layout::Numbered,
        },
        question: "What are the 10 most common words in the list above?".into(),
        answers: common,
    })
}

/// Frequent words: coded words of rank `r` appear `floor(c / r^2)` times, `c` as large
/// as fits (each optional group holds the copies that going from `c - 1` to `c` adds).
fn frequent_words(rng: &mut SplitMix64) -> Draft {
    let vocab = distinct(rng, 100, |rng| letters(rng, b'a', 5));
    let count = |c: usize, r: usize| c / (r * r);
    let copies = |c: usize| -> Vec<String> {
        (1..=vocab.len())
            .flat_map(|r| vec![vocab[r - 1].clone(); count(c, r)])
            .collect()
    };
    // At c = 36 the top four counts are 36, 9, 4, 2: the top three stand apart. Each
    // further c adds the copies that raise every count to its floor at c.
    let fixed = copies(36);
    let optional = (37..=12_000)
        .map(|c| {
            (1..=vocab.len())
                .filter(|&r| count(c, r) > count(c - 1, r))
                .map(|r| vocab[r - 1].clone())
                .collect()
        })
        .collect();
    Draft {
        instruction: "Below is a coded text. Keep track of how often each coded word appears."
            .into(),
        body: Body::Items {
            fixed,
            optional,
            support: Vec::new(),
            layout: Layout::Words,
        },
        question: "What are the three most frequent coded words in the text above?".into(),
        answers: vocab[..3].to_vec(),
    }
}

/// QA: the gold paragraphs, then the question's distractors, then the next questions'
/// paragraphs.
fn qa_draft(qa: &[QaItem], seed: u64) -> Draft {
    let at = (seed % qa.len() as u64) as usize;
    let item = &qa[at];
    let mut optional: Vec<Vec<String>> = item.distractors.iter().map(|p| vec![p.clone()]).collect();
    for k in 1..qa.len() {
        let other = &qa[(at + k) % qa.len()];
        optional.extend(
            other
                .gold
                .iter()
                .chain(&other.distractors)
                .map(|p| vec![p.clone()]),
        );
    }
    Draft {
        instruction: "Answer the question using the paragraphs below. Reply with a short \
                      answer only."
            .into(),
        body: Body::Items {
            fixed: item.gold.clone(),
            optional,
            support: (0..item.gold.len()).collect(),
            layout: Layout::Paragraphs,
        },
        question: item.question.clone(),
        answers: vec![item.answer.clone()],
    }
}

/// The prompt's opening and closing ids, and what is left of `len` between them.
fn frame(
    id: &str,
    len: usize,
    draft: &Draft,
    enc: &Encoder,
) -> Result<(Vec<u32>, Vec<u32>, usize)> {
    let mut head: Vec<u32> = enc.bos().into_iter().collect();
    head.extend(enc.encode(&format!("{}\n\n", draft.instruction))?);
    let suffix = enc.encode(&question_suffix(&draft.question))?;
    let room = len.checked_sub(head.len() + suffix.len()).ok_or_else(|| {
        Error::invalid(
            "lengths",
            format!(
                "{id}: {len} tokens do not hold the instruction and question ({})",
                head.len() + suffix.len()
            ),
        )
    })?;
    Ok((head, suffix, room))
}

/// Needles in exactly enough haystack to make `len` tokens.
#[allow(clippy::too_many_arguments)]
fn fill_haystack(
    id: &str,
    task: RulerTask,
    len: usize,
    seed: u64,
    draft: Draft,
    enc: &Encoder,
    tokens: &mut HaystackTokens,
    rng: &mut SplitMix64,
) -> Result<Example> {
    let Body::Needles { sentences, support } = &draft.body else {
        return Err(Error::Internal("a needle draft"));
    };
    let (head, suffix, room) = frame(id, len, &draft, enc)?;
    let ids: Vec<Vec<u32>> = sentences
        .iter()
        .map(|s| enc.encode(&format!(" {s}")))
        .collect::<Result<_>>()?;
    let needle_tokens: usize = ids.iter().map(Vec::len).sum();
    let fill = room
        .checked_sub(needle_tokens)
        .filter(|&f| f > 0)
        .ok_or_else(|| {
            Error::invalid(
                "lengths",
                format!("{id}: {len} tokens leave no haystack around the needles"),
            )
        })?;
    let window = tokens.window(tokens.start_for_seed(seed), fill, true)?;
    // Seed-drawn depths, ascending, snapped to sentence boundaries after the first.
    let mut depths: Vec<f32> = (0..ids.len()).map(|_| rng.next_f32()).collect();
    depths.sort_by(f32::total_cmp);
    let at: Vec<usize> = depths
        .iter()
        .map(|d| window.snap((d * fill as f32) as usize).max(1))
        .collect();
    // Which sentence goes in which slot: the chain keeps its order, needles are shuffled.
    let mut order: Vec<usize> = (0..ids.len()).collect();
    if task != RulerTask::VariableTracking {
        rng.shuffle(&mut order);
    }
    let mut prompt = head;
    let mut spans: Vec<Range<usize>> = vec![0..0; ids.len()];
    let mut next = 0;
    for (k, piece) in window.pieces.iter().enumerate() {
        prompt.extend_from_slice(piece);
        while next < at.len() && at[next] == k + 1 {
            let s = order[next];
            let start = prompt.len();
            prompt.extend_from_slice(&ids[s]);
            spans[s] = start..prompt.len();
            next += 1;
        }
    }
    let question_start = prompt.len();
    prompt.extend_from_slice(&suffix);
    if prompt.len() != len {
        return Err(Error::Internal("a needle prompt holds exactly its length"));
    }
    Ok(Example {
        id: id.to_string(),
        task: task.name().to_string(),
        context_tokens: len,
        prompt,
        answers: draft.answers,
        support: support.iter().map(|&i| spans[i].clone()).collect(),
        question_start: Some(question_start),
    })
}

/// The longest list (all fixed items, the most optional ones in order) that fits `len`.
fn fit_items(
    id: &str,
    task: RulerTask,
    len: usize,
    draft: Draft,
    enc: &Encoder,
    rng: &mut SplitMix64,
) -> Result<Example> {
    let Body::Items {
        fixed,
        optional,
        support,
        layout,
    } = &draft.body
    else {
        return Err(Error::Internal("an item draft"));
    };
    let (head, suffix, room) = frame(id, len, &draft, enc)?;
    // Items and their support flags, shuffled by a stream of their own per size.
    let arrange = |n: usize| -> (Vec<String>, Vec<bool>) {
        let mut items: Vec<(String, bool)> = fixed
            .iter()
            .enumerate()
            .map(|(i, s)| (s.clone(), support.contains(&i)))
            .chain(optional[..n].iter().flatten().map(|s| (s.clone(), false)))
            .collect();
        let mut r = rng.clone();
        r.shuffle(&mut items);
        items.into_iter().unzip()
    };
    let pieces = |items: &[String]| -> Result<Vec<Vec<u32>>> {
        items
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let text = match (layout, i) {
                    (Layout::Numbered, 0) => format!("1. {s}"),
                    (Layout::Numbered, _) => format!("\n{}. {s}", i + 1),
                    (Layout::Words, 0) | (Layout::Paragraphs, 0) => s.clone(),
                    (Layout::Words, _) => format!(" {s}"),
                    (Layout::Paragraphs, _) => format!("\n\n{s}"),
                };
                enc.encode(&text)
            })
            .collect()
    };
    let size =
        |n: usize| -> Result<usize> { Ok(pieces(&arrange(n).0)?.iter().map(Vec::len).sum()) };
    if size(0)? > room {
        return Err(Error::invalid(
            "lengths",
            format!("{id}: {len} tokens do not hold the task's fixed items"),
        ));
    }
    // The items must reach the length, within a group or two.
    let most = size(optional.len())?;
    if most + SHORT_BY < room {
        return Err(Error::invalid(
            "lengths",
            format!("{id}: the task's items fill {most} of the {room} tokens {len} leaves"),
        ));
    }
    // The most optional items that fit: sizes grow with the count (nearly: each count is
    // shuffled anew, so the fit may fall a group short of the largest).
    let (mut lo, mut hi) = (0, optional.len());
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if size(mid)? <= room {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let (items, flags) = arrange(lo);
    let mut prompt = head;
    let mut spans = Vec::new();
    for (piece, flag) in pieces(&items)?.iter().zip(flags) {
        let start = prompt.len();
        prompt.extend_from_slice(piece);
        if flag {
            spans.push(start..prompt.len());
        }
    }
    let question_start = prompt.len();
    prompt.extend_from_slice(&suffix);
    Ok(Example {
        id: id.to_string(),
        task: task.name().to_string(),
        context_tokens: len,
        prompt,
        answers: draft.answers,
        support: spans,
        question_start: Some(question_start),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::tasks::Encoder;
    use crate::test_support::smollm2;

    fn qa_items() -> Vec<QaItem> {
        (0..10)
            .map(|i| QaItem {
                question: format!("Which town holds the mill number {i}?"),
                answer: format!("Town{i}"),
                gold: vec![
                    format!("Mill {i}: The mill number {i} stands in Town{i}."),
                    format!("Town{i}: Town{i} is a small town by a river."),
                ],
                distractors: (0..6)
                    .map(|d| {
                        format!(
                            "Other {i}{d}: A paragraph about something else entirely, written \
                             to fill the context with words that do not answer the question."
                        )
                    })
                    .collect(),
            })
            .collect()
    }

    #[test]
    fn every_task_fits_its_length_and_its_gold_answer_scores_one() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let hay = Haystack::synthetic();
        for task in RulerTask::ALL {
            let exs = generate(task, &[400, 900], &[0, 1, 2], &enc, &hay, &qa_items()).unwrap();
            assert_eq!(exs.len(), 6, "{task:?}");
            let again = generate(task, &[400, 900], &[0, 1, 2], &enc, &hay, &qa_items()).unwrap();
            assert_eq!(exs, again, "{task:?}: seeds fix the examples");
            assert_ne!(exs[0].prompt, exs[1].prompt, "{task:?}: seeds differ");
            for ex in &exs {
                let what = ex.id.clone();
                match task {
                    RulerTask::CommonWords | RulerTask::FrequentWords | RulerTask::Qa => {
                        assert!(ex.prompt.len() <= ex.context_tokens, "{what}");
                        assert!(ex.prompt.len() + 60 > ex.context_tokens, "{what}: fills");
                    }
                    _ => assert_eq!(ex.prompt.len(), ex.context_tokens, "{what}"),
                }
                let text = enc.decode(&ex.prompt).unwrap();
                let q = ex.question_start.unwrap();
                let context = enc.decode(&ex.prompt[..q]).unwrap();
                let question = enc.decode(&ex.prompt[q..]).unwrap();
                assert!(question.starts_with("\n\nQuestion: "), "{what}");
                assert!(text.ends_with("\nAnswer:"), "{what}");
                // Every expected string is in the context, and its support spans say
                // where the needles are.
                for a in &ex.answers {
                    assert!(context.contains(a.as_str()), "{what}: {a}");
                }
                for span in &ex.support {
                    let s = enc.decode(&ex.prompt[span.clone()]).unwrap();
                    let holds = ex.answers.iter().any(|a| s.contains(a.as_str()));
                    assert!(holds || task == RulerTask::Qa, "{what}: {s}");
                }
                let all = ex.answers.join(", ");
                assert_eq!(task.metric().score(&ex.answers, &all), 1.0, "{what}");
                assert_eq!(task.metric().score(&ex.answers, "I do not know"), 0.0);
            }
        }
    }

    #[test]
    fn the_tasks_hold_what_their_questions_ask_for() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let hay = Haystack::synthetic();
        let one = |task| {
            generate(task, &[900], &[5], &enc, &hay, &qa_items())
                .unwrap()
                .remove(0)
        };
        let text = |ex: &Example| enc.decode(&ex.prompt).unwrap();
        // Multi-value: four needles of one key; multi-key: four keys, one asked.
        let mv = one(RulerTask::NiahMultivalue);
        assert_eq!((mv.answers.len(), mv.support.len()), (4, 4));
        let mk = one(RulerTask::NiahMultikey);
        assert_eq!((mk.answers.len(), mk.support.len()), (1, 1));
        assert_eq!(text(&mk).matches("special magic uuid for").count(), 5);
        assert_eq!(mk.answers[0].len(), 36);
        // The chain runs in order through the text.
        let vt = one(RulerTask::VariableTracking);
        let starts: Vec<usize> = vt.support.iter().map(|s| s.start).collect();
        assert!(starts.windows(2).all(|w| w[0] < w[1]), "{starts:?}");
        // Common words: the ten answers appear six times each, every other word twice.
        let cwe = one(RulerTask::CommonWords);
        let body = text(&cwe);
        let items: Vec<&str> = body
            .lines()
            .filter_map(|l| l.split_once(". "))
            .filter(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
            .map(|(_, w)| w)
            .collect();
        for w in &cwe.answers {
            assert_eq!(items.iter().filter(|i| *i == w).count(), 6, "{w}");
        }
        let rest: BTreeSet<&str> = items
            .iter()
            .copied()
            .filter(|i| !cwe.answers.iter().any(|a| a == i))
            .collect();
        for w in rest {
            assert_eq!(items.iter().filter(|i| **i == w).count(), 2, "{w}");
        }
        // Frequent words: the three answers are the three most frequent, apart.
        let fwe = one(RulerTask::FrequentWords);
        let q = fwe.question_start.unwrap();
        let coded = enc.decode(&fwe.prompt[..q]).unwrap();
        let words: Vec<&str> = coded.rsplit("\n\n").next().unwrap().split(' ').collect();
        let count = |w: &str| words.iter().filter(|x| **x == w).count();
        let counts: Vec<usize> = fwe.answers.iter().map(|a| count(a)).collect();
        assert!(counts[0] > counts[1] && counts[1] > counts[2], "{counts:?}");
        let fourth = words
            .iter()
            .filter(|w| !fwe.answers.iter().any(|a| a == **w))
            .map(|w| count(w))
            .max()
            .unwrap();
        assert!(counts[2] > fourth, "{counts:?} vs {fourth}");
        // QA: the gold paragraphs are the support, among distractors.
        let qa = one(RulerTask::Qa);
        assert_eq!(qa.support.len(), 2);
        assert!(text(&qa).contains("Other"));
        // Too short a length is refused with the key named.
        let err = generate(RulerTask::NiahSingle, &[30], &[0], &enc, &hay, &[]).unwrap_err();
        assert!(err.to_string().contains("lengths"), "{err}");
        let err = generate(RulerTask::Qa, &[900], &[0], &enc, &hay, &[]).unwrap_err();
        assert!(err.to_string().contains("ruler_qa"), "{err}");
    }
}
