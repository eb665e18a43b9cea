//! Passage corpora: JSONL rows `{"id", "title", "text"}` (only `text` required), and the
//! paragraph pools of the HotpotQA and MuSiQue files, deduplicated.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One retrievable passage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Passage {
    pub id: String,
    #[serde(default)]
    pub title: String,
    pub text: String,
}

/// A corpus row as a file may give it.
#[derive(Deserialize)]
struct Row {
    id: Option<serde_json::Value>,
    #[serde(default)]
    title: Option<String>,
    text: Option<String>,
}

/// Read a JSONL corpus. Errors name the file and line: unreadable JSON, a row without
/// `text` (or with an empty one), and a file with no passage at all.
pub fn read_jsonl(path: &Path) -> Result<Vec<Passage>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let bad = |line: usize, why: String| {
        Error::invalid("corpus", format!("{}:{line}: {why}", path.display()))
    };
    let mut out = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| Error::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let row: Row = serde_json::from_str(&line).map_err(|e| bad(i + 1, e.to_string()))?;
        let text = row
            .text
            .filter(|t| !t.trim().is_empty())
            .ok_or_else(|| bad(i + 1, "a row without `text`".into()))?;
        let id = match row.id {
            None => out.len().to_string(),
            Some(serde_json::Value::String(s)) => s,
            Some(v) => v.to_string(),
        };
        out.push(Passage {
            id,
            title: row.title.unwrap_or_default(),
            text,
        });
    }
    if out.is_empty() {
        return Err(Error::invalid(
            "corpus",
            format!("{}: no passages (empty corpus)", path.display()),
        ));
    }
    Ok(out)
}

/// The distinct passages of `paragraphs` (same title and text once), ids `p0`, `p1`, ...
pub fn pool<'a>(paragraphs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<Passage> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (title, text) in paragraphs {
        if text.trim().is_empty() || !seen.insert((title.to_string(), text.to_string())) {
            continue;
        }
        out.push(Passage {
            id: format!("p{}", out.len()),
            title: title.to_string(),
            text: text.to_string(),
        });
    }
    out
}

/// Which kind of file a corpus is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CorpusFormat {
    /// Rows `{"id", "title", "text"}`.
    Jsonl,
    /// The paragraph pool of a HotpotQA file (`context` of every row).
    Hotpotqa,
    /// The paragraph pool of a MuSiQue file (`paragraphs` of every row).
    Musique,
}

impl CorpusFormat {
    /// Every format.
    pub const ALL: [CorpusFormat; 3] = [
        CorpusFormat::Jsonl,
        CorpusFormat::Hotpotqa,
        CorpusFormat::Musique,
    ];

    /// The format's name, as its serde form: `jsonl`, `hotpotqa`, `musique`.
    pub fn name(self) -> &'static str {
        match self {
            CorpusFormat::Jsonl => "jsonl",
            CorpusFormat::Hotpotqa => "hotpotqa",
            CorpusFormat::Musique => "musique",
        }
    }
}

/// Read the passages of `path` in `format`.
pub fn read(path: &Path, format: CorpusFormat) -> Result<Vec<Passage>> {
    #[derive(Deserialize)]
    struct Hotpot {
        context: Vec<(String, Vec<String>)>,
    }
    #[derive(Deserialize)]
    struct Musique {
        paragraphs: Vec<MusiquePara>,
    }
    #[derive(Deserialize)]
    struct MusiquePara {
        title: String,
        paragraph_text: String,
    }
    let rows = |path: &Path| -> Result<Vec<String>> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Ok(text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect())
    };
    let bad = |i: usize, e: serde_json::Error| {
        Error::invalid("corpus", format!("{}:{}: {e}", path.display(), i + 1))
    };
    let paragraphs: Vec<(String, String)> = match format {
        CorpusFormat::Jsonl => return read_jsonl(path),
        CorpusFormat::Hotpotqa => {
            let mut out = Vec::new();
            for (i, line) in rows(path)?.iter().enumerate() {
                let row: Hotpot = serde_json::from_str(line).map_err(|e| bad(i, e))?;
                out.extend(row.context.into_iter().map(|(t, s)| (t, s.concat())));
            }
            out
        }
        CorpusFormat::Musique => {
            let mut out = Vec::new();
            for (i, line) in rows(path)?.iter().enumerate() {
                let row: Musique = serde_json::from_str(line).map_err(|e| bad(i, e))?;
                out.extend(
                    row.paragraphs
                        .into_iter()
                        .map(|p| (p.title, p.paragraph_text)),
                );
            }
            out
        }
    };
    let passages = pool(paragraphs.iter().map(|(t, x)| (t.as_str(), x.as_str())));
    if passages.is_empty() {
        return Err(Error::invalid(
            "corpus",
            format!("{}: no passages (empty corpus)", path.display()),
        ));
    }
    Ok(passages)
}

/// Write `passages` as JSONL (atomically).
pub fn write_jsonl(path: &Path, passages: &[Passage]) -> Result<()> {
    let mut text = String::new();
    for p in passages {
        text.push_str(
            &serde_json::to_string(p).map_err(|e| Error::invalid("corpus", e.to_string()))?,
        );
        text.push('\n');
    }
    crate::results::write_atomic(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` as file `name` in a temporary folder removed with the returned value.
    fn file(name: &str, text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix("headwise-corpus-")
            .tempdir()
            .unwrap();
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        (dir, p)
    }

    #[test]
    fn rows_read_with_defaults_and_bad_rows_name_their_line() {
        let (_dir, p) = file(
            "ok.jsonl",
            "{\"id\": 7, \"title\": \"A\", \"text\": \"alpha\"}\n\n{\"text\": \"beta\"}\n",
        );
        let c = read_jsonl(&p).unwrap();
        assert_eq!(c[0].id, "7");
        assert_eq!(
            (c[1].id.as_str(), c[1].title.as_str(), c[1].text.as_str()),
            ("1", "", "beta")
        );
        let (_bad, p) = file("bad.jsonl", "{\"text\": \"a\"}\n{\"title\": \"no text\"}\n");
        let err = read_jsonl(&p).unwrap_err().to_string();
        assert!(
            err.contains("bad.jsonl:2") && err.contains("without `text`"),
            "{err}"
        );
        let (_empty, p) = file("empty.jsonl", "\n");
        let err = read_jsonl(&p).unwrap_err().to_string();
        assert!(err.contains("empty corpus"), "{err}");
    }

    #[test]
    fn pool_keeps_each_paragraph_once() {
        let p = pool([("A", "x"), ("B", "y"), ("A", "x"), ("C", " ")]);
        assert_eq!(p.len(), 2);
        assert_eq!(p[1].id, "p1");
    }
}
