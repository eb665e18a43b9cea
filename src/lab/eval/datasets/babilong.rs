//! BABILong-style tasks (Kuratov et al., 2024, "BABILong: Testing the Limits of LLMs
//! with Long Context Reasoning-in-a-Haystack") from bAbI tasks qa1-qa5 (Weston et al.,
//! 2015): the facts of a bAbI story scattered through filler text, the question at the
//! end.
//!
//! ## Files
//!
//! `babi_dir` is the folder that holds `babilong_test_100_idxs.json` (`{"qa1": [..],
//! ...}`) and `en-10k/qa{n}_*_test.txt`. A bAbI file has numbered lines; the numbers
//! restart at 1 where a new story starts; a question line is
//! `N question\tanswer\tsupporting line numbers`.
//!
//! ## Samples
//!
//! As BABILong builds them (`get_dataset_df` in booydar/babilong): every question of the
//! file is one sample, numbered from 0 in file order, whose facts are all the non-question
//! lines of its story before it (the supporting facts and the distractors; earlier
//! questions are left out). The index file lists the 100 sample numbers per task that
//! BABILong evaluates (values 0..=998 for 1,000 questions a file); they are taken in the
//! order listed, and `limit` keeps the first `limit` usable ones.
//!
//! ## Construction
//!
//! ```text
//! [BOS?] "Read the text and answer the question with one word.\n\n"
//!        context
//!        "\n\nQuestion: {question}\nAnswer:"
//! ```
//!
//! The context holds exactly `length` filler tokens (0: the facts alone): whole haystack
//! sentences from a start drawn by the sample's seed, the last one cut at the token where
//! the count is reached ([`HaystackTokens::window`]). Each fact goes, as BABILong does it,
//! into one of the gaps between filler sentences (before the first, between two, after the
//! last), drawn uniformly and independently per fact, then sorted so the facts keep their
//! story order; facts in the same gap stay together. Every fact and filler sentence is
//! tokenized on its own with a leading space, except the piece that opens the context,
//! which has none. Filler sentences that mention a name, object or place of the task
//! (capitalized words of the facts other than `The`, words after `the`, the answers) are
//! not used, so the filler never competes with the facts.
//!
//! Unlike BABILong, whose `1k`, `2k`, ... name the whole sample, facts included,
//! `length` here counts the filler only: the facts add their own tokens (with SmolLM2's
//! tokenizer from a few dozen for short qa1 stories up to about 900 for the longest qa3
//! ones), so the same length means the same distance of filler for every task.
//!
//! The seed of sample `i` of task `n` is `n << 32 | i`: the filler start depends on the
//! sample only (every length starts at the same sentence), the fact gaps on the sample and
//! the length. Loading is deterministic.
//!
//! The example: task `babilong_qa{n}`, id `babilong_qa{n}-L{length}-i{index}`, answers
//! `[answer]`, support the spans of the supporting facts (in prompt order), context
//! tokens the filler length asked for. Examples come lengths outermost, then samples.
//!
//! ## Rows that cannot be used
//!
//! Malformed lines (no line number, an empty fact, a question without three tab-separated
//! fields or with supporting line numbers that are no facts of its story, not UTF-8) are
//! reported as [`Skipped`] with file and line, and a malformed question is no sample; a
//! line with a tab still counts as a question, so later sample numbers keep their
//! meaning. Also reported: sample numbers past the file's questions or listed twice (with
//! the index file and line 0), and a sample too long for the context at some length
//! (with its question's line).

use std::collections::{BTreeSet, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{check_fits, question_suffix, read_lines, Loaded, Skipped, ANSWER_RESERVE};
use crate::lab::eval::{Example, PromptBuilder};
use crate::lab::tasks::{Encoder, Haystack, HaystackTokens};
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// The index file inside `babi_dir`.
pub const INDEX_FILE: &str = "babilong_test_100_idxs.json";

/// The folder of bAbI files inside `babi_dir`.
pub const BABI_SUBDIR: &str = "en-10k";

/// The instruction that opens every prompt.
const INSTRUCTION: &str = "Read the text and answer the question with one word.\n\n";

/// Salt of the fact placement stream.
const PLACE_SALT: u64 = 0xBAB1_1096_FAC7_5EED;

/// The name of task `n`: `babilong_qa{n}`.
pub fn task_name(task: u8) -> String {
    format!("babilong_qa{task}")
}

/// Load the BABILong samples of bAbI task `task` (1 to 5), each at every filler length of
/// `lengths` (tokens; 0 for the facts alone), with filler from `haystack`.
///
/// Errors ([`Error::InvalidArgument`] unless noted): a task outside 1..=5; no length, a
/// length given twice, a length that leaves no room for facts and answer in the context;
/// a missing folder or file ([`Error::Io`] naming it), no or several bAbI test files for
/// the task, an index file that is not the expected JSON or has no list for the task; a
/// haystack whose every sentence mentions an entity of the task; tokenizer failures.
pub fn load(
    babi_dir: &Path,
    task: u8,
    lengths: &[usize],
    haystack: &Haystack,
    enc: &Encoder,
    limit: Option<usize>,
) -> Result<Loaded> {
    if !(1..=5).contains(&task) {
        return Err(Error::invalid(
            "babilong task",
            format!("qa{task} is not one of qa1 to qa5"),
        ));
    }
    check_lengths(lengths, enc)?;
    let file = task_file(babi_dir, task)?;
    let index_path = babi_dir.join(INDEX_FILE);
    let indices = sample_indices(&index_path, task)?;
    let mut parsed = parse(&file)?;
    let mut loaded = Loaded {
        examples: Vec::new(),
        skipped: std::mem::take(&mut parsed.skipped),
    };

    let mut samples: Vec<(usize, &Question)> = Vec::new();
    let mut seen = HashSet::new();
    for &i in &indices {
        if limit.is_some_and(|n| samples.len() >= n) {
            break;
        }
        if !seen.insert(i) {
            loaded.skipped.push(Skipped {
                file: index_path.clone(),
                line: 0,
                reason: format!("qa{task}: sample {i} is listed twice"),
            });
            continue;
        }
        match parsed.questions.get(i) {
            Some(Some(q)) => samples.push((i, q)),
            // Malformed: reported while parsing.
            Some(None) => {}
            None => loaded.skipped.push(Skipped {
                file: index_path.clone(),
                line: 0,
                reason: format!(
                    "qa{task}: sample {i} is past the {} questions of {}",
                    parsed.questions.len(),
                    file.display()
                ),
            }),
        }
    }

    let mut filler = HaystackTokens::new(haystack, *enc, &parsed.entity_words())?;
    // Each sample's facts, tokenized with their leading space, once for all lengths.
    let spaced: Vec<Vec<Vec<u32>>> = samples
        .iter()
        .map(|(_, q)| {
            parsed
                .facts(q)
                .iter()
                .map(|f| enc.encode(&format!(" {}", f.text)))
                .collect::<Result<_>>()
        })
        .collect::<Result<_>>()?;
    let name = task_name(task);
    for &len in lengths {
        for ((i, q), spaced) in samples.iter().zip(&spaced) {
            let seed = (u64::from(task) << 32) | *i as u64;
            let id = format!("{name}-L{len}-i{i}");
            let placed = place(&parsed, q, spaced, len, seed, enc, &mut filler)?;
            match check_fits(&id, placed.prompt.len(), enc) {
                Ok(()) => loaded.examples.push(Example {
                    id,
                    task: name.clone(),
                    context_tokens: len,
                    prompt: placed.prompt,
                    answers: vec![q.answer.clone()],
                    support: placed.support,
                    question_start: None,
                }),
                Err(reason) => loaded.skipped.push(Skipped {
                    file: file.clone(),
                    line: q.line,
                    reason,
                }),
            }
        }
    }
    Ok(loaded)
}

/// At least one length, none twice, each leaving room for some facts and the answer.
fn check_lengths(lengths: &[usize], enc: &Encoder) -> Result<()> {
    if lengths.is_empty() {
        return Err(Error::invalid("lengths", "no length given"));
    }
    let mut seen = BTreeSet::new();
    for &len in lengths {
        if !seen.insert(len) {
            return Err(Error::invalid("lengths", format!("{len} is given twice")));
        }
        if len + ANSWER_RESERVE >= enc.max_context() {
            return Err(Error::invalid(
                "lengths",
                format!(
                    "{len} filler tokens plus {ANSWER_RESERVE} for the answer leave no room for \
                     the facts in the context of {} tokens",
                    enc.max_context()
                ),
            ));
        }
    }
    Ok(())
}

/// The one `qa{task}_*_test.txt` file in `babi_dir/en-10k`.
fn task_file(babi_dir: &Path, task: u8) -> Result<PathBuf> {
    let dir = babi_dir.join(BABI_SUBDIR);
    let prefix = format!("qa{task}_");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
        let path = entry.map_err(|e| Error::io(&dir, e))?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with(&prefix) && name.ends_with("_test.txt") {
            found.push(path);
        }
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(Error::invalid(
            "babi data",
            format!("{}: no {prefix}*_test.txt file", dir.display()),
        )),
        n => Err(Error::invalid(
            "babi data",
            format!("{}: {n} files match {prefix}*_test.txt", dir.display()),
        )),
    }
}

/// The sample indices the index file lists for `task`.
fn sample_indices(path: &Path, task: u8) -> Result<Vec<usize>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut all: std::collections::HashMap<String, Vec<usize>> = serde_json::from_str(&text)
        .map_err(|e| {
            Error::invalid(
                "babilong indices",
                format!("{}: not a JSON object of index lists: {e}", path.display()),
            )
        })?;
    all.remove(&format!("qa{task}")).ok_or_else(|| {
        Error::invalid(
            "babilong indices",
            format!("{}: no list for qa{task}", path.display()),
        )
    })
}

/// A story line that is not a question.
#[derive(Debug)]
struct Fact {
    /// Its number in the story.
    number: usize,
    /// The sentence, trimmed.
    text: String,
}

/// A well-formed question.
#[derive(Debug)]
struct Question {
    /// Its line in the file (from 1).
    line: usize,
    /// Its story, an index into [`Parsed::stories`].
    story: usize,
    /// How many facts of the story come before it.
    facts: usize,
    /// The question, trimmed.
    text: String,
    /// The answer, trimmed.
    answer: String,
    /// Its supporting facts, as indices into the story's facts.
    support: Vec<usize>,
}

/// A bAbI file, parsed.
#[derive(Debug)]
struct Parsed {
    /// Every story's facts, in order.
    stories: Vec<Vec<Fact>>,
    /// Every question line in file order (the sample numbers); `None` where malformed.
    questions: Vec<Option<Question>>,
    /// The malformed lines.
    skipped: Vec<Skipped>,
    /// The answers of the well-formed questions.
    answers: BTreeSet<String>,
}

impl Parsed {
    /// The facts before question `q`.
    fn facts(&self, q: &Question) -> &[Fact] {
        &self.stories[q.story][..q.facts]
    }

    /// The task's names, objects and places, lower-case: capitalized words of the facts
    /// other than `the`, words right after `the`, and the answers.
    fn entity_words(&self) -> Vec<String> {
        let mut words: BTreeSet<String> = self.answers.iter().map(|a| a.to_lowercase()).collect();
        for fact in self.stories.iter().flatten() {
            let mut after_the = false;
            for w in fact
                .text
                .split(|c: char| !c.is_alphanumeric())
                .filter(|w| !w.is_empty())
            {
                let lower = w.to_lowercase();
                if after_the || (w.starts_with(char::is_uppercase) && lower != "the") {
                    words.insert(lower.clone());
                }
                after_the = lower == "the";
            }
        }
        words.into_iter().collect()
    }
}

/// Parse the bAbI file at `path` (rules in the module docs).
fn parse(path: &Path) -> Result<Parsed> {
    let mut parsed = Parsed {
        stories: Vec::new(),
        questions: Vec::new(),
        skipped: Vec::new(),
        answers: BTreeSet::new(),
    };
    for line in read_lines(path)? {
        if line.text.trim().is_empty() {
            continue;
        }
        let is_question = line.text.contains('\t');
        let outcome = if line.utf8 {
            parse_line(&line.text, line.number, &mut parsed)
        } else {
            Err("not UTF-8 text".to_string())
        };
        match outcome {
            Ok(Some(q)) => {
                parsed.answers.insert(q.answer.clone());
                parsed.questions.push(Some(q));
            }
            Ok(None) => {}
            Err(reason) => {
                let reason = if is_question {
                    parsed.questions.push(None);
                    format!("question {}: {reason}", parsed.questions.len() - 1)
                } else {
                    reason
                };
                parsed.skipped.push(Skipped {
                    file: path.to_path_buf(),
                    line: line.number,
                    reason,
                });
            }
        }
    }
    Ok(parsed)
}

/// Parse one non-blank line into `parsed`: a fact joins the current story (a new one at
/// number 1), a question is returned.
fn parse_line(
    text: &str,
    line: usize,
    parsed: &mut Parsed,
) -> std::result::Result<Option<Question>, String> {
    let (number, rest) = text
        .trim_start()
        .split_once(' ')
        .ok_or_else(|| "no line number and text".to_string())?;
    let number: usize = number
        .parse()
        .map_err(|_| format!("`{number}` is not a line number"))?;
    if number == 1 || parsed.stories.is_empty() {
        parsed.stories.push(Vec::new());
    }
    let story_index = parsed.stories.len() - 1;
    let story = &mut parsed.stories[story_index];
    if !rest.contains('\t') {
        let fact = rest.trim();
        if fact.is_empty() {
            return Err("empty fact".to_string());
        }
        story.push(Fact {
            number,
            text: fact.to_string(),
        });
        return Ok(None);
    }
    let fields: Vec<&str> = rest.split('\t').map(str::trim).collect();
    let [question, answer, support] = fields[..] else {
        return Err(format!(
            "a question line has {} tab-separated fields, not 3 (question, answer, supporting \
             lines)",
            fields.len()
        ));
    };
    if question.is_empty() || answer.is_empty() {
        return Err("empty question or answer".to_string());
    }
    let mut facts = Vec::new();
    for n in support.split_whitespace() {
        let n: usize = n
            .parse()
            .map_err(|_| format!("`{n}` is not a supporting line number"))?;
        let k = story
            .iter()
            .rposition(|f| f.number == n)
            .ok_or_else(|| format!("supporting line {n} is not a fact of its story"))?;
        if !facts.contains(&k) {
            facts.push(k);
        }
    }
    if facts.is_empty() {
        return Err("no supporting line".to_string());
    }
    Ok(Some(Question {
        line,
        story: story_index,
        facts: story.len(),
        text: question.to_string(),
        answer: answer.to_string(),
        support: facts,
    }))
}

/// A prompt with the spans of its supporting facts.
struct Placed {
    prompt: Vec<u32>,
    support: Vec<Range<usize>>,
}

/// Scatter the facts of `q` (`spaced`: their ids with a leading space) into `len` filler
/// tokens and build the prompt (rules in the module docs).
fn place(
    parsed: &Parsed,
    q: &Question,
    spaced: &[Vec<u32>],
    len: usize,
    seed: u64,
    enc: &Encoder,
    filler: &mut HaystackTokens,
) -> Result<Placed> {
    let facts = parsed.facts(q);
    let start = filler.start_for_seed(seed);
    let mut window = filler.window(start, len, true)?;
    let mut rng = SplitMix64::new(seed, PLACE_SALT.wrapping_add(len as u64));
    let mut gaps: Vec<usize> = (0..facts.len())
        .map(|_| rng.below(window.pieces.len() + 1))
        .collect();
    gaps.sort_unstable();
    if len > 0 && gaps.first() == Some(&0) {
        // A fact opens the context, so the first filler sentence gets its space back
        // (which may change how many sentences fit; later gaps stay in range).
        window = filler.window(start, len, false)?;
        let last = window.pieces.len();
        for g in &mut gaps {
            *g = (*g).min(last);
        }
    }

    let mut b = PromptBuilder::new(*enc);
    b.push(INSTRUCTION)?;
    let mut spans = Vec::with_capacity(facts.len());
    let mut next = 0;
    for gap in 0..=window.pieces.len() {
        while next < facts.len() && gaps[next] == gap {
            let span = if gap == 0 && next == 0 {
                b.push(&facts[0].text)?
            } else {
                b.push_ids(&spaced[next])
            };
            spans.push(span);
            next += 1;
        }
        if let Some(piece) = window.pieces.get(gap) {
            b.push_ids(piece);
        }
    }
    b.push(&question_suffix(&q.text))?;
    let mut support: Vec<Range<usize>> = q.support.iter().map(|&k| spans[k].clone()).collect();
    support.sort_by_key(|s| s.start);
    Ok(Placed {
        prompt: b.finish(),
        support,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::eval::datasets::test_support::{
        assert_clean, support_texts, temp_dir, with_real_encoders,
    };
    use crate::test_support::{data, smollm2};

    const LENGTHS: [usize; 4] = [0, 1000, 2000, 4000];

    /// The facts, question, answer and supporting facts of every question of a bAbI file,
    /// parsed independently of the loader.
    fn reference(path: &Path) -> Vec<(Vec<String>, String, String, Vec<String>)> {
        let mut story: Vec<(usize, String)> = Vec::new();
        let mut out = Vec::new();
        for line in std::fs::read_to_string(path).unwrap().lines() {
            let (n, rest) = line.split_once(' ').unwrap();
            let n: usize = n.parse().unwrap();
            if n == 1 {
                story.clear();
            }
            match rest.split('\t').collect::<Vec<_>>()[..] {
                [q, a, s] => {
                    let support = s
                        .split(' ')
                        .map(|k| {
                            let k: usize = k.parse().unwrap();
                            story.iter().find(|(m, _)| *m == k).unwrap().1.clone()
                        })
                        .collect();
                    let facts = story.iter().map(|(_, f)| f.clone()).collect();
                    out.push((facts, q.trim().to_string(), a.to_string(), support));
                }
                _ => story.push((n, rest.to_string())),
            }
        }
        out
    }

    #[test]
    fn the_real_tasks_scatter_facts_in_order_into_exact_filler() {
        let (Some(babi), Some(essays)) = (data("babi"), data("haystack/paul_graham")) else {
            return;
        };
        let hay = Haystack::from_dir(&essays).unwrap();
        with_real_encoders(|enc| check_real_tasks(&babi, &hay, enc));
    }

    fn check_real_tasks(babi: &Path, hay: &Haystack, enc: &Encoder) {
        let bos = usize::from(enc.bos().is_some());
        let instruction = enc.encode(INSTRUCTION).unwrap().len();
        let all: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(babi.join(INDEX_FILE)).unwrap()).unwrap();
        for task in 1..=5u8 {
            let file = task_file(babi, task).unwrap();
            let refs = reference(&file);
            assert_eq!(refs.len(), 1000);
            let loaded = load(babi, task, &LENGTHS, hay, enc, None).unwrap();
            assert_clean(&loaded, 100 * LENGTHS.len());
            let indices: Vec<usize> = all[format!("qa{task}")]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();

            for (k, ex) in loaded.examples.iter().enumerate() {
                let (len, i) = (LENGTHS[k / 100], indices[k % 100]);
                assert_eq!(ex.id, format!("babilong_qa{task}-L{len}-i{i}"));
                assert_eq!(ex.task, format!("babilong_qa{task}"));
                assert_eq!(ex.context_tokens, len);
                let (facts, question, answer, support) = &refs[i];
                assert_eq!(ex.answers, [answer.as_str()]);
                assert!(!answer.contains(char::is_whitespace), "{answer}");

                // The facts, in story order.
                let text = enc.decode(&ex.prompt).unwrap();
                assert!(text.ends_with(&format!("\n\nQuestion: {question}\nAnswer:")));
                let mut at = 0;
                for f in facts {
                    let found = text[at..].find(f.as_str());
                    let found = found.unwrap_or_else(|| panic!("{}: {f} out of order", ex.id));
                    at += found + f.len();
                }
                // The supporting facts decode back from their spans.
                let mut got = support_texts(ex, enc);
                let mut want = support.clone();
                got.sort();
                want.sort();
                want.dedup();
                assert_eq!(got, want, "{}", ex.id);

                // The filler is exactly `len` tokens: everything but BOS, instruction, facts
                // and question.
                let context = text
                    .strip_prefix(
                        enc.decode(&ex.prompt[..bos + instruction])
                            .unwrap()
                            .as_str(),
                    )
                    .unwrap();
                let mut fact_tokens = 0;
                for (j, f) in facts.iter().enumerate() {
                    let piece = if j == 0 && context.starts_with(f.as_str()) {
                        f.clone()
                    } else {
                        format!(" {f}")
                    };
                    fact_tokens += enc.encode(&piece).unwrap().len();
                }
                let suffix = enc.encode(&question_suffix(question)).unwrap().len();
                let filler = ex.prompt.len() - bos - instruction - fact_tokens - suffix;
                assert_eq!(filler, len, "{}", ex.id);
                if len == 0 {
                    assert!(context.starts_with(facts[0].as_str()));
                }
            }
        }
    }

    #[test]
    fn loading_is_deterministic_and_placement_depends_on_sample_and_length() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let Some(babi) = data("babi") else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let hay = Haystack::synthetic();
        let a = load(&babi, 2, &[500, 800], &hay, &enc, Some(3)).unwrap();
        let b = load(&babi, 2, &[500, 800], &hay, &enc, Some(3)).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.examples.len(), 6);
        let gaps = |ex: &Example| -> Vec<usize> { ex.support.iter().map(|s| s.start).collect() };
        assert_ne!(gaps(&a.examples[0]), gaps(&a.examples[3]));
        assert_ne!(a.examples[0].prompt, a.examples[1].prompt);
        // Only the filler length changed: the second load's first length is the first's.
        let c = load(&babi, 2, &[800], &hay, &enc, Some(3)).unwrap();
        assert_eq!(c.examples[..], a.examples[3..]);
    }

    #[test]
    fn malformed_lines_and_bad_indices_are_reported() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let dir = temp_dir("babilong");
        std::fs::create_dir_all(dir.join(BABI_SUBDIR)).unwrap();
        let lines = [
            "1 Mary went to the kitchen.",
            "2 John went to the garden.",
            "3 Where is Mary? \tkitchen\t1",
            "x Nonsense without a number.",
            "4 Where is John? \tgarden",
            "5 Where is John? \tgarden\t9",
            "1 Sandra went to the office.",
            "2 ",
            "3 Where is Sandra? \toffice\t1",
            "4 Sandra moved to the hallway.",
            "5 Where is Sandra? \thallway\t4",
        ];
        std::fs::write(
            dir.join(BABI_SUBDIR).join("qa1_toy_test.txt"),
            lines.join("\n"),
        )
        .unwrap();
        std::fs::write(dir.join(INDEX_FILE), r#"{"qa1": [4, 1, 0, 2, 3, 0, 7]}"#).unwrap();
        let hay = Haystack::synthetic();
        let loaded = load(&dir, 1, &[0, 50], &hay, &enc, None).unwrap();
        let ids: Vec<&str> = loaded.examples.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "babilong_qa1-L0-i4",
                "babilong_qa1-L0-i0",
                "babilong_qa1-L0-i3",
                "babilong_qa1-L50-i4",
                "babilong_qa1-L50-i0",
                "babilong_qa1-L50-i3",
            ]
        );
        let text = enc.decode(&loaded.examples[0].prompt).unwrap();
        assert!(text.contains("Sandra went to the office. Sandra moved to the hallway."));
        assert!(!text.contains("Mary"));
        let report: Vec<String> = loaded.skipped.iter().map(|s| s.to_string()).collect();
        let want = [
            "qa1_toy_test.txt:4: `x` is not a line number",
            "qa1_toy_test.txt:5: question 1: a question line has 2 tab-separated fields",
            "qa1_toy_test.txt:6: question 2: supporting line 9 is not a fact of its story",
            "qa1_toy_test.txt:8: empty fact",
            "babilong_test_100_idxs.json: qa1: sample 0 is listed twice",
            "babilong_test_100_idxs.json: qa1: sample 7 is past the 5 questions",
        ];
        assert_eq!(report.len(), want.len(), "{report:#?}");
        for (r, w) in report.iter().zip(want) {
            assert!(r.contains(w), "{r} lacks {w}");
        }
        // `limit` counts usable samples.
        let two = load(&dir, 1, &[0], &hay, &enc, Some(2)).unwrap();
        assert_eq!(two.examples.len(), 2);

        let bad = |task: u8, lengths: &[usize]| {
            load(&dir, task, lengths, &hay, &enc, None)
                .err()
                .unwrap()
                .to_string()
        };
        assert!(bad(6, &[0]).contains("qa6"));
        assert!(bad(2, &[0]).contains("no qa2_*_test.txt"));
        assert!(bad(1, &[]).contains("no length"));
        assert!(bad(1, &[0, 0]).contains("twice"));
        assert!(bad(1, &[ctx]).contains("no room"));
        std::fs::write(dir.join(INDEX_FILE), "[1, 2]").unwrap();
        assert!(bad(1, &[0]).contains("not a JSON object"));
        std::fs::remove_dir_all(&dir).unwrap();
        let missing = bad(1, &[0]);
        assert!(missing.contains(&dir.display().to_string()), "{missing}");
    }
}
