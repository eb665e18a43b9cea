//! MuSiQue-Ans (Trivedi et al., 2022): 2-4 hop questions over twenty paragraphs, of which
//! the ones marked `is_supporting` hold the hops.
//!
//! Input: JSONL with MuSiQue's own fields (`id`, `paragraphs` as
//! `[{title, paragraph_text, is_supporting}]`, `question`, `answer`, `answer_aliases`,
//! `answerable`; other fields are ignored). A row marked `"answerable": false` is
//! skipped; `answer_aliases` may be absent.
//!
//! Prompt (raw completion), paragraphs in file order:
//!
//! ```text
//! [BOS?] "Answer the question using the paragraphs below. Reply with a short answer only.\n\n"
//!        "{title 1}: {paragraph_text 1}" "\n\n" "{title 2}: {paragraph_text 2}" ...
//!        "\n\nQuestion: {question}\nAnswer:"
//! ```
//!
//! Each quoted piece is tokenized on its own. The example: task `musique`, id `id`,
//! answers `[answer] + answer_aliases` (trimmed, without empties or repeats), support the
//! spans of the supporting paragraphs, title included, in prompt order; context tokens the
//! prompt length. See [the module above](super) for skipped rows.

use std::path::Path;

use serde::Deserialize;

use super::{empty_field, load_jsonl, question_suffix, reading_prompt, Loaded};
use crate::lab::eval::Example;
use crate::lab::tasks::Encoder;
use crate::Result;

/// The task name of the examples.
pub const TASK: &str = "musique";

/// One MuSiQue row, as much of it as the prompt needs.
#[derive(Deserialize)]
struct Row {
    id: String,
    paragraphs: Vec<Paragraph>,
    question: String,
    answer: String,
    #[serde(default)]
    answer_aliases: Vec<String>,
    answerable: Option<bool>,
}

/// One context paragraph.
#[derive(Deserialize)]
struct Paragraph {
    title: String,
    paragraph_text: String,
    is_supporting: bool,
}

/// Load up to `limit` examples (all when `None`) from the JSONL file at `path`, in file
/// order.
///
/// Errors: [`Error::Io`](crate::Error::Io) naming the path when it cannot be read;
/// tokenizer failures. Unusable rows are reported in [`Loaded::skipped`].
pub fn load(path: &Path, enc: &Encoder, limit: Option<usize>) -> Result<Loaded> {
    load_jsonl(path, limit, |row: Row| example(row, enc))
}

/// The example of one row, or the reason to skip it.
fn example(row: Row, enc: &Encoder) -> Result<std::result::Result<Example, String>> {
    let fields = [
        ("id", row.id.as_str()),
        ("question", &row.question),
        ("answer", &row.answer),
    ];
    if let Some(reason) = empty_field(&fields) {
        return Ok(Err(reason));
    }
    if row.answerable == Some(false) {
        return Ok(Err(format!("{}: marked unanswerable", row.id)));
    }
    if row.paragraphs.is_empty() {
        return Ok(Err(format!("{}: no paragraph", row.id)));
    }
    let mut support = Vec::new();
    let prompt = match reading_prompt(&row.id, &row.paragraphs, &row.question, enc, |b, p| {
        let span = b.push(&format!("{}: {}", p.title.trim(), p.paragraph_text.trim()))?;
        if p.is_supporting {
            support.push(span);
        }
        Ok(())
    })? {
        Ok(prompt) => prompt,
        Err(reason) => return Ok(Err(reason)),
    };
    let mut answers = vec![row.answer.trim().to_string()];
    for alias in &row.answer_aliases {
        let alias = alias.trim();
        if !alias.is_empty() && !answers.iter().any(|a| a == alias) {
            answers.push(alias.to_string());
        }
    }
    // The question suffix was tokenized on its own, last.
    let question_start = prompt.len() - enc.encode(&question_suffix(&row.question))?.len();
    Ok(Ok(Example {
        id: row.id,
        task: TASK.to_string(),
        context_tokens: prompt.len(),
        prompt,
        answers,
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

    #[test]
    fn the_real_file_loads_with_exact_supporting_spans() {
        let Some(path) = data("musique/musique_ans_dev_150.jsonl") else {
            return;
        };
        with_real_encoders(|enc| check_real_file(&path, enc));
    }

    fn check_real_file(path: &Path, enc: &Encoder) {
        let loaded = load(path, enc, None).unwrap();
        assert_clean(&loaded, 150);
        for (ex, row) in loaded.examples.iter().zip(&json_rows(path)) {
            check_reading_example(ex, enc, "musique", row["id"].as_str().unwrap());
            assert_eq!(ex.answers[0], row["answer"].as_str().unwrap());
            assert_eq!(
                ex.answers.len(),
                1 + row["answer_aliases"].as_array().unwrap().len()
            );

            let want: Vec<String> = row["paragraphs"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| p["is_supporting"].as_bool().unwrap())
                .map(|p| {
                    format!(
                        "{}: {}",
                        p["title"].as_str().unwrap(),
                        p["paragraph_text"].as_str().unwrap()
                    )
                })
                .collect();
            assert_eq!(support_texts(ex, enc), want, "{}", ex.id);
            assert!((2..=4).contains(&ex.support.len()), "{}", ex.id);
        }
    }

    #[test]
    fn broken_rows_are_reported_and_the_rest_load() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let dir = temp_dir("musique");
        let path = dir.join("rows.jsonl");
        let good = r#"{"id": "m1", "question": "Where?", "answer": "Oslo", "answer_aliases": ["Oslo", " Christiania ", ""], "answerable": true, "paragraphs": [{"idx": 0, "title": "A", "paragraph_text": "Nothing here.", "is_supporting": false}, {"idx": 1, "title": "B", "paragraph_text": "It is in Oslo.", "is_supporting": true}]}"#;
        let unanswerable = good
            .replace("\"m1\"", "\"m2\"")
            .replace("true, \"paragraphs", "false, \"paragraphs");
        let no_flag = good.replace(", \"is_supporting\": false", "");
        let text = format!("{unanswerable}\n[1, 2]\n{good}\n{no_flag}");
        std::fs::write(&path, text).unwrap();
        let loaded = load(&path, &enc, None).unwrap();
        assert_eq!(loaded.examples.len(), 1);
        let ex = &loaded.examples[0];
        assert_eq!(ex.answers, ["Oslo", "Christiania"]);
        assert_eq!(ex.support.len(), 1);
        assert_eq!(
            enc.decode(&ex.prompt[ex.support[0].clone()])
                .unwrap()
                .trim(),
            "B: It is in Oslo."
        );
        let lines: Vec<usize> = loaded.skipped.iter().map(|s| s.line).collect();
        assert_eq!(lines, [1, 2, 4]);
        assert!(loaded.skipped[0].reason.contains("unanswerable"));
        assert!(loaded.skipped[2].reason.contains("is_supporting"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
