//! HotpotQA (Yang et al., 2018), distractor setting: a question with ten context
//! paragraphs (two gold, eight distractors), the supporting facts given as
//! `[title, sentence index]` pairs.
//!
//! Input: JSONL with HotpotQA's own fields (`_id`, `question`, `answer`,
//! `supporting_facts`, `context` as `[[title, [sentences]]]`; other fields are ignored).
//!
//! Prompt (raw completion):
//!
//! ```text
//! [BOS?] "Answer the question using the paragraphs below. Reply with a short answer only.\n\n"
//!        "{title 1}:" " {sentence 0}" "{sentence 1}" ...
//!        "\n\n" "{title 2}:" ...
//!        "\n\nQuestion: {question}\nAnswer:"
//! ```
//!
//! Each quoted piece is tokenized on its own, so every sentence has an exact token span.
//! HotpotQA sentences carry their own leading space (joined, they give the paragraph
//! text), except the first; the space after `{title}:` goes with that first sentence
//! (`" Jeffrey Thomas Porcaro ..."`), the way the joined text would tokenize, rather than
//! with the title. The text is the same as `"{title}: " + sentences`.
//!
//! The example: task `hotpotqa`, id `_id`, answers `[answer]`, support the spans of the
//! supporting sentences (sorted, without repeats; a fact naming a title or sentence that
//! is not in the context, or a sentence with no tokens, is ignored), context tokens the
//! prompt length. See [the module above](super) for skipped rows.

use std::ops::Range;
use std::path::Path;

use serde::Deserialize;

use super::ruler::QaItem;
use super::{empty_field, load_jsonl, question_suffix, reading_prompt, Loaded};
use crate::lab::eval::Example;
use crate::lab::tasks::Encoder;
use crate::Result;

/// The task name of the examples.
pub const TASK: &str = "hotpotqa";

/// One HotpotQA row, as much of it as the prompt needs.
#[derive(Deserialize)]
struct Row {
    #[serde(rename = "_id")]
    id: String,
    question: String,
    answer: String,
    supporting_facts: Vec<(String, usize)>,
    context: Vec<(String, Vec<String>)>,
}

/// Load up to `limit` examples (all when `None`) from the JSONL file at `path`, in file
/// order.
///
/// Errors: [`Error::Io`](crate::Error::Io) naming the path when it cannot be read;
/// tokenizer failures. Unusable rows are reported in [`Loaded::skipped`].
pub fn load(path: &Path, enc: &Encoder, limit: Option<usize>) -> Result<Loaded> {
    load_jsonl(path, limit, |row: Row| example(row, enc))
}

/// The questions of the JSONL file at `path` as RULER's QA task reads them: each row's
/// supporting paragraphs and its other paragraphs as `"{title}: {text}"`. Rows that
/// cannot be read, or have no supporting paragraph, are left out.
///
/// Errors: [`Error::Io`](crate::Error::Io) naming the path when it cannot be read.
pub fn qa_items(path: &Path) -> Result<Vec<QaItem>> {
    let text = std::fs::read_to_string(path).map_err(|e| crate::Error::io(path, e))?;
    let mut items = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(row) = serde_json::from_str::<Row>(line) else {
            continue;
        };
        let gold_titles: Vec<&str> = row.supporting_facts.iter().map(|f| f.0.as_str()).collect();
        let (mut gold, mut distractors) = (Vec::new(), Vec::new());
        for (title, sentences) in &row.context {
            let paragraph = format!("{}: {}", title.trim(), sentences.concat().trim());
            match gold_titles.contains(&title.as_str()) {
                true => gold.push(paragraph),
                false => distractors.push(paragraph),
            }
        }
        if !gold.is_empty() && !row.answer.trim().is_empty() {
            items.push(QaItem {
                question: row.question.trim().to_string(),
                answer: row.answer.trim().to_string(),
                gold,
                distractors,
            });
        }
    }
    Ok(items)
}

/// The example of one row, or the reason to skip it.
fn example(row: Row, enc: &Encoder) -> Result<std::result::Result<Example, String>> {
    let fields = [
        ("_id", row.id.as_str()),
        ("question", &row.question),
        ("answer", &row.answer),
    ];
    if let Some(reason) = empty_field(&fields) {
        return Ok(Err(reason));
    }
    if row.context.is_empty() {
        return Ok(Err(format!("{}: no context paragraph", row.id)));
    }
    let mut sentence_spans: Vec<Vec<Range<usize>>> = Vec::with_capacity(row.context.len());
    let prompt = match reading_prompt(
        &row.id,
        &row.context,
        &row.question,
        enc,
        |b, (title, sentences)| {
            b.push(&format!("{}:", title.trim()))?;
            let mut spans = Vec::with_capacity(sentences.len());
            // The space after the colon still has to be written (by the first sentence
            // with any text, unless it brings its own).
            let mut owes_space = true;
            for sentence in sentences {
                let span = if owes_space && !sentence.trim().is_empty() {
                    owes_space = false;
                    if sentence.starts_with(char::is_whitespace) {
                        b.push(sentence)?
                    } else {
                        b.push(&format!(" {sentence}"))?
                    }
                } else {
                    b.push(sentence)?
                };
                spans.push(span);
            }
            sentence_spans.push(spans);
            Ok(())
        },
    )? {
        Ok(prompt) => prompt,
        Err(reason) => return Ok(Err(reason)),
    };

    let mut support: Vec<Range<usize>> = Vec::new();
    for (title, sentence) in &row.supporting_facts {
        let span = row
            .context
            .iter()
            .position(|(t, _)| t == title)
            .and_then(|p| sentence_spans[p].get(*sentence));
        if let Some(span) = span {
            if !span.is_empty() && !support.contains(span) {
                support.push(span.clone());
            }
        }
    }
    support.sort_by_key(|s| s.start);
    // The question suffix was tokenized on its own, last.
    let question_start = prompt.len() - enc.encode(&question_suffix(&row.question))?.len();
    Ok(Ok(Example {
        id: row.id,
        task: TASK.to_string(),
        context_tokens: prompt.len(),
        prompt,
        answers: vec![row.answer.trim().to_string()],
        support,
        question_start: Some(question_start),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::eval::datasets::test_support::{
        assert_clean, check_reading_example, json_rows, support_texts, temp_dir, with_real_encoders,
    };
    use crate::test_support::{data, smollm2};

    /// The supporting sentences of a row, read independently of the loader.
    fn supporting_sentences(row: &serde_json::Value) -> Vec<String> {
        let mut out = Vec::new();
        for fact in row["supporting_facts"].as_array().unwrap() {
            let title = fact[0].as_str().unwrap();
            let k = fact[1].as_u64().unwrap() as usize;
            let para = row["context"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p[0].as_str() == Some(title));
            if let Some(s) = para.and_then(|p| p[1].as_array().unwrap().get(k)) {
                let s = s.as_str().unwrap().trim().to_string();
                if !s.is_empty() && !out.contains(&s) {
                    out.push(s);
                }
            }
        }
        out
    }

    #[test]
    fn the_real_file_loads_with_exact_supporting_spans() {
        let Some(path) = data("hotpotqa/hotpot_dev_distractor_200.jsonl") else {
            return;
        };
        with_real_encoders(|enc| check_real_file(&path, enc));
    }

    fn check_real_file(path: &Path, enc: &Encoder) {
        let loaded = load(path, enc, None).unwrap();
        assert_clean(&loaded, 200);
        for (ex, row) in loaded.examples.iter().zip(&json_rows(path)) {
            let text = check_reading_example(ex, enc, "hotpotqa", row["_id"].as_str().unwrap());
            assert_eq!(ex.answers, [row["answer"].as_str().unwrap()]);
            let q = row["question"].as_str().unwrap().trim();
            assert!(text.contains(&format!("\n\nQuestion: {q}\nAnswer:")));
            let title = row["context"][0][0].as_str().unwrap();
            let first = row["context"][0][1][0].as_str().unwrap();
            assert!(text.contains(&format!("{title}: {first}")), "{}", ex.id);

            let mut got = support_texts(ex, enc);
            got.sort();
            let mut want = supporting_sentences(row);
            want.sort();
            assert_eq!(got, want, "{}", ex.id);
            assert!(!ex.support.is_empty(), "{}", ex.id);
            assert!(ex.support.windows(2).all(|w| w[0].end <= w[1].start));
        }

        let five = load(path, enc, Some(5)).unwrap();
        assert_eq!(five.examples[..], loaded.examples[..5]);
    }

    #[test]
    fn broken_rows_are_reported_and_the_rest_load() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let dir = temp_dir("hotpotqa");
        let path = dir.join("rows.jsonl");
        let good = r#"{"_id": "a1", "question": "Who wrote it?", "answer": "Ann", "supporting_facts": [["Book", 1], ["Book", 9], ["Nope", 0]], "context": [["Book", ["The book is old.", " Ann wrote it."]], ["Other", ["Unrelated text."]]]}"#;
        let no_answer = r#"{"_id": "a2", "question": "Who?", "supporting_facts": [], "context": [["T", ["S."]]]}"#;
        let empty_answer = r#"{"_id": "a3", "question": "Who?", "answer": " ", "supporting_facts": [], "context": [["T", ["S."]]]}"#;
        let repeat = good.replace("Ann wrote", "Bob wrote");
        let huge = format!(
            r#"{{"_id": "a4", "question": "Q?", "answer": "x", "supporting_facts": [], "context": [["T", ["{}"]]]}}"#,
            "word ".repeat(ctx)
        );
        let text = format!(
            "{{\"_id\": \"broken\n{good}\n\n{no_answer}\n{empty_answer}\n{repeat}\n{huge}\n"
        );
        std::fs::write(&path, text).unwrap();
        let loaded = load(&path, &enc, None).unwrap();
        assert_eq!(loaded.examples.len(), 1);
        let ex = &loaded.examples[0];
        assert_eq!(ex.id, "a1");
        assert_eq!(ex.support.len(), 1);
        assert_eq!(
            enc.decode(&ex.prompt[ex.support[0].clone()])
                .unwrap()
                .trim(),
            "Ann wrote it."
        );
        let lines: Vec<usize> = loaded.skipped.iter().map(|s| s.line).collect();
        assert_eq!(lines, [1, 4, 5, 6, 7]);
        let reasons: Vec<String> = loaded.skipped.iter().map(|s| s.to_string()).collect();
        assert!(
            reasons[0].contains("rows.jsonl:1: not a valid row"),
            "{reasons:?}"
        );
        assert!(reasons[1].contains("missing field `answer`"), "{reasons:?}");
        assert!(reasons[2].contains("`answer` is empty"), "{reasons:?}");
        assert!(reasons[3].contains("a1: the id is repeated"), "{reasons:?}");
        assert!(reasons[4].contains("exceeds the context"), "{reasons:?}");

        let missing = load(&dir.join("absent.jsonl"), &enc, None)
            .err()
            .unwrap()
            .to_string();
        assert!(missing.contains("absent.jsonl"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
