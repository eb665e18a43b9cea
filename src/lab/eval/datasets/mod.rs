//! Loaders for the real evaluation datasets, each turning its rows into tokenized
//! [`Example`]s: HotpotQA ([`hotpotqa`]), MuSiQue ([`musique`]) and BABILong-style bAbI
//! tasks ([`babilong`]); and the RULER-style tasks generated from a seed ([`ruler`]).
//!
//! ## Prompts
//!
//! Raw completions (no chat template), BOS first when the tokenizer adds one, assembled
//! piece by piece with [`crate::lab::eval::PromptBuilder`] so that the spans of
//! the supporting facts are exact. Every prompt ends with
//! `"\n\nQuestion: {question}\nAnswer:"` and leaves [`ANSWER_RESERVE`] tokens of the
//! model's context free for the answer.
//!
//! ## Rows that cannot be used
//!
//! A missing or unreadable file is an error that names the path. A row that cannot be
//! used (not UTF-8, not valid JSON, a missing field, an empty id, question or answer, a
//! duplicate id, a prompt that does not fit the context) is left out and reported as a
//! [`Skipped`] naming its file and line, so that a run can say what it left out; it never
//! stops the load. Blank lines are not rows and are passed over.

pub mod babilong;
pub mod hotpotqa;
pub mod musique;
pub mod ruler;

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

use crate::lab::eval::{Example, PromptBuilder};
use crate::lab::tasks::Encoder;
use crate::{Error, Result};

/// Tokens of the context kept free for the answer: a prompt longer than the context
/// minus this is skipped.
pub const ANSWER_RESERVE: usize = 32;

/// The instruction that opens the HotpotQA and MuSiQue prompts.
const READING_INSTRUCTION: &str =
    "Answer the question using the paragraphs below. Reply with a short answer only.\n\n";

/// A row left out of a load, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Skipped {
    /// The file the row is in.
    pub file: PathBuf,
    /// Its line number, counted from 1; 0 when the reason concerns no single line.
    pub line: usize,
    /// Why it was left out.
    pub reason: String,
}

impl fmt::Display for Skipped {
    /// `file:line: reason`, or `file: reason` for line 0.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file.display(), self.reason)
        } else {
            write!(f, "{}:{}: {}", self.file.display(), self.line, self.reason)
        }
    }
}

/// What a loader made of a dataset: the examples, in file order, and the rows it left
/// out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Loaded {
    /// The usable rows as examples.
    pub examples: Vec<Example>,
    /// The rows left out, with file, line and reason.
    pub skipped: Vec<Skipped>,
}

/// One line of a data file.
struct Line {
    /// Counted from 1.
    number: usize,
    /// The line without its end (`\n` or `\r\n`); invalid UTF-8 replaced.
    text: String,
    /// Whether the line was valid UTF-8.
    utf8: bool,
}

/// The lines of `path`. Errors: [`Error::Io`] naming the path when it cannot be read.
fn read_lines(path: &Path) -> Result<Vec<Line>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    Ok(bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .map(|(i, raw)| {
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            Line {
                number: i + 1,
                text: String::from_utf8_lossy(raw).into_owned(),
                utf8: std::str::from_utf8(raw).is_ok(),
            }
        })
        .collect())
}

/// Load a JSONL file: every non-blank line is parsed as a `T` and handed to `build`,
/// which returns the example or the reason to skip the row; rows that fail to parse or
/// repeat an earlier example's id are skipped too. Stops once `limit` examples are
/// loaded.
fn load_jsonl<T: DeserializeOwned>(
    path: &Path,
    limit: Option<usize>,
    mut build: impl FnMut(T) -> Result<std::result::Result<Example, String>>,
) -> Result<Loaded> {
    let mut loaded = Loaded::default();
    let mut ids = HashSet::new();
    for line in read_lines(path)? {
        if limit.is_some_and(|n| loaded.examples.len() >= n) {
            break;
        }
        if line.text.trim().is_empty() {
            continue;
        }
        let outcome = if line.utf8 {
            match serde_json::from_str::<T>(&line.text) {
                Ok(row) => build(row)?,
                Err(e) => Err(format!("not a valid row: {e}")),
            }
        } else {
            Err("not UTF-8 text".to_string())
        };
        match outcome {
            Ok(ex) if !ids.contains(&ex.id) => {
                ids.insert(ex.id.clone());
                loaded.examples.push(ex);
            }
            Ok(ex) => loaded.skipped.push(Skipped {
                file: path.to_path_buf(),
                line: line.number,
                reason: format!("{}: the id is repeated from an earlier row", ex.id),
            }),
            Err(reason) => loaded.skipped.push(Skipped {
                file: path.to_path_buf(),
                line: line.number,
                reason,
            }),
        }
    }
    Ok(loaded)
}

/// The reason to skip a row when one of its required text fields (name, value) is
/// empty.
fn empty_field(fields: &[(&str, &str)]) -> Option<String> {
    fields
        .iter()
        .find(|(_, value)| value.trim().is_empty())
        .map(|(name, _)| format!("the field `{name}` is empty"))
}

/// The prompt's closing piece.
fn question_suffix(question: &str) -> String {
    format!("\n\nQuestion: {}\nAnswer:", question.trim())
}

/// `Err(reason)` when a prompt of `len` tokens leaves less than [`ANSWER_RESERVE`]
/// tokens of the context.
fn check_fits(id: &str, len: usize, enc: &Encoder) -> std::result::Result<(), String> {
    if len + ANSWER_RESERVE > enc.max_context() {
        Err(format!(
            "{id}: a prompt of {len} tokens plus {ANSWER_RESERVE} for the answer exceeds the \
             context of {} tokens",
            enc.max_context()
        ))
    } else {
        Ok(())
    }
}

/// The prompt of a reading row (HotpotQA, MuSiQue): [`READING_INSTRUCTION`], the
/// `paragraphs` separated by blank lines, each written by `write`, and the question; or
/// the reason to skip the row when the prompt does not fit the context ([`check_fits`]).
fn reading_prompt<P>(
    id: &str,
    paragraphs: &[P],
    question: &str,
    enc: &Encoder,
    mut write: impl FnMut(&mut PromptBuilder, &P) -> Result<()>,
) -> Result<std::result::Result<Vec<u32>, String>> {
    let mut b = PromptBuilder::new(*enc);
    b.push(READING_INSTRUCTION)?;
    for (k, paragraph) in paragraphs.iter().enumerate() {
        if k > 0 {
            b.push("\n\n")?;
        }
        write(&mut b, paragraph)?;
    }
    b.push(&question_suffix(question))?;
    let prompt = b.finish();
    Ok(check_fits(id, prompt.len(), enc).map(|()| prompt))
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Shared helpers for the loader tests.

    use std::collections::BTreeSet;
    use std::path::{Path, PathBuf};

    use super::{Loaded, ANSWER_RESERVE};
    use crate::lab::eval::Example;
    use crate::lab::tasks::Encoder;
    use crate::test_support::{gemma3, smollm2};

    /// Run `check` with the encoder of each real tokenizer (SmolLM2, Gemma 3) that could be
    /// fetched.
    pub(crate) fn with_real_encoders(check: impl Fn(&Encoder)) {
        for (tok, special, ctx) in [smollm2(), gemma3()].into_iter().flatten() {
            check(&Encoder::new(&tok, &special, ctx));
        }
    }

    /// Assert that a load of a real dataset is clean: `n` examples with distinct ids and
    /// no row skipped (the skipped rows are printed first).
    pub(crate) fn assert_clean(loaded: &Loaded, n: usize) {
        for s in &loaded.skipped {
            eprintln!("skipped {s}");
        }
        assert!(loaded.skipped.is_empty(), "{:?}", loaded.skipped);
        assert_eq!(loaded.examples.len(), n);
        let ids: BTreeSet<&str> = loaded.examples.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids.len(), loaded.examples.len());
    }

    /// The rows of a JSONL file, read independently of the loader.
    pub(crate) fn json_rows(path: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Assert what every example of a reading dataset shares: its id and task, context
    /// tokens the prompt length, room left for the answer, the prompt ending in
    /// `Answer:`. Returns the decoded prompt.
    pub(crate) fn check_reading_example(
        ex: &Example,
        enc: &Encoder,
        task: &str,
        id: &str,
    ) -> String {
        assert_eq!(ex.id, id);
        assert_eq!(ex.task, task);
        assert_eq!(ex.context_tokens, ex.prompt.len());
        assert!(ex.prompt.len() + ANSWER_RESERVE <= enc.max_context());
        let text = enc.decode(&ex.prompt).unwrap();
        assert!(text.ends_with("\nAnswer:"), "{}", ex.id);
        text
    }

    /// The decoded text of each support span of `ex`, trimmed, in span order.
    pub(crate) fn support_texts(ex: &Example, enc: &Encoder) -> Vec<String> {
        ex.support
            .iter()
            .map(|s| {
                enc.decode(&ex.prompt[s.clone()])
                    .unwrap()
                    .trim()
                    .to_string()
            })
            .collect()
    }

    /// A fresh, empty temporary folder unique to this process and `name`.
    pub(crate) fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("headwise-datasets-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipped_names_file_and_line() {
        let s = Skipped {
            file: PathBuf::from("data/x.jsonl"),
            line: 7,
            reason: "broken".into(),
        };
        assert_eq!(s.to_string(), "data/x.jsonl:7: broken");
        let whole = Skipped { line: 0, ..s };
        assert_eq!(whole.to_string(), "data/x.jsonl: broken");
    }

    #[test]
    fn lines_are_numbered_from_one_and_keep_bad_bytes_visible() {
        let dir = test_support::temp_dir("lines");
        let path = dir.join("l.txt");
        std::fs::write(&path, b"a\r\n\nb\xff\n").unwrap();
        let lines = read_lines(&path).unwrap();
        let got: Vec<(usize, &str, bool)> = lines
            .iter()
            .map(|l| (l.number, l.text.as_str(), l.utf8))
            .collect();
        assert_eq!(
            got,
            [
                (1, "a", true),
                (2, "", true),
                (3, "b\u{fffd}", false),
                (4, "", true)
            ]
        );
        let missing = read_lines(&dir.join("absent.txt"))
            .err()
            .unwrap()
            .to_string();
        assert!(missing.contains("absent.txt"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
