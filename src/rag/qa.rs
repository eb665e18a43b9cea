//! Question-answering items for RAG runs: the question, its gold answers and its own
//! paragraphs, from HotpotQA and MuSiQue files.

use std::path::Path;

use serde::Deserialize;

use crate::rag::corpus::{CorpusFormat, Passage};
use crate::{Error, Result};

/// One question.
#[derive(Debug, Clone, PartialEq)]
pub struct QaItem {
    pub id: String,
    pub question: String,
    /// The answer and its aliases.
    pub answers: Vec<String>,
    /// The paragraphs the dataset gives with the question (gold and distractors).
    pub paragraphs: Vec<Passage>,
}

#[derive(Deserialize)]
struct HotpotRow {
    #[serde(rename = "_id")]
    id: String,
    question: String,
    answer: String,
    context: Vec<(String, Vec<String>)>,
}

#[derive(Deserialize)]
struct MusiqueRow {
    id: String,
    question: String,
    answer: String,
    #[serde(default)]
    answer_aliases: Vec<String>,
    paragraphs: Vec<MusiquePara>,
}

#[derive(Deserialize)]
struct MusiquePara {
    title: String,
    paragraph_text: String,
}

/// Up to `limit` items of a HotpotQA or MuSiQue file, in file order.
pub fn load(path: &Path, format: CorpusFormat, limit: Option<usize>) -> Result<Vec<QaItem>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let bad = |i: usize, e: String| {
        Error::invalid("dataset", format!("{}:{}: {e}", path.display(), i + 1))
    };
    let passage = |i: usize, title: String, text: String| Passage {
        id: format!("q{i}"),
        title,
        text,
    };
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        if limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        let item = match format {
            CorpusFormat::Hotpotqa => {
                let r: HotpotRow = serde_json::from_str(line).map_err(|e| bad(i, e.to_string()))?;
                QaItem {
                    id: r.id,
                    question: r.question,
                    answers: vec![r.answer],
                    paragraphs: r
                        .context
                        .into_iter()
                        .enumerate()
                        .map(|(k, (t, s))| passage(k, t, s.concat()))
                        .collect(),
                }
            }
            CorpusFormat::Musique => {
                let r: MusiqueRow =
                    serde_json::from_str(line).map_err(|e| bad(i, e.to_string()))?;
                let mut answers = vec![r.answer];
                answers.extend(r.answer_aliases);
                QaItem {
                    id: r.id,
                    question: r.question,
                    answers,
                    paragraphs: r
                        .paragraphs
                        .into_iter()
                        .enumerate()
                        .map(|(k, p)| passage(k, p.title, p.paragraph_text))
                        .collect(),
                }
            }
            CorpusFormat::Jsonl => {
                return Err(Error::invalid(
                    "dataset",
                    "questions come from a hotpotqa or musique file",
                ))
            }
        };
        if item.question.trim().is_empty() || item.answers.iter().all(|a| a.trim().is_empty()) {
            return Err(bad(i, "a row without question or answer".into()));
        }
        out.push(item);
    }
    Ok(out)
}
