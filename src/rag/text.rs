//! Words over tokens, and the stopword list that tells content words from the rest
//! (RIND's `s_i`, QFS's content words).

use std::collections::HashSet;
use std::ops::Range;
use std::path::Path;

use crate::{Error, Result};

/// Lowercase stopwords.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stopwords(HashSet<String>);

impl Stopwords {
    /// Read a list of one word per line; `|` starts a comment (the Snowball format).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let words: HashSet<String> = text
            .lines()
            .filter_map(|l| l.split('|').next())
            .map(|w| w.trim().to_lowercase())
            .filter(|w| !w.is_empty())
            .collect();
        if words.is_empty() {
            return Err(Error::invalid(
                "stopwords",
                format!("{}: no words", path.display()),
            ));
        }
        Ok(Self(words))
    }

    /// NLTK's English list (179 words, from the `stop-words` crate): the built-in list of
    /// the server's RIND and QFS.
    pub fn english() -> Self {
        Self::from_words(
            stop_words::get(stop_words::LANGUAGE::English)
                .iter()
                .copied(),
        )
    }

    /// A list from words.
    pub fn from_words<'a>(words: impl IntoIterator<Item = &'a str>) -> Self {
        Self(words.into_iter().map(str::to_lowercase).collect())
    }

    /// Whether `word` carries content: it has a letter or digit and, with its
    /// punctuation stripped and lowercased, is not a stopword.
    pub fn is_content(&self, word: &str) -> bool {
        let w = word
            .trim_matches(|c: char| !c.is_alphanumeric())
            .to_lowercase();
        !w.is_empty() && !self.0.contains(&w)
    }
}

/// Group token texts into words: a word starts at a token that begins with whitespace,
/// and punctuation stands alone. Returns token ranges; tokens of whitespace only end up
/// in the word before them (or in none, at the start).
pub fn words(pieces: &[&str]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let kind = |c: char| c.is_alphanumeric() || c == '\'' || c == '-';
    for (i, p) in pieces.iter().enumerate() {
        let trimmed = p.trim_start();
        let Some(first) = trimmed.chars().next() else {
            if let Some(last) = out.last_mut() {
                last.end = i + 1;
            }
            continue;
        };
        let joins = !p.starts_with(char::is_whitespace)
            && kind(first)
            && out
                .last()
                .and_then(|r| pieces[r.end - 1].chars().last())
                .is_some_and(kind);
        match out.last_mut() {
            Some(last) if joins && last.end == i => last.end = i + 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// The text of the tokens in `range`, trimmed.
pub fn word_text(pieces: &[&str], range: &Range<usize>) -> String {
    pieces[range.clone()].concat().trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_group_into_words_and_punctuation_stands_alone() {
        let pieces = [
            "The", " Eiff", "el", " Tower", ",", " built", " in", " 18", "89", ".",
        ];
        let w = words(&pieces);
        let texts: Vec<String> = w.iter().map(|r| word_text(&pieces, r)).collect();
        assert_eq!(
            texts,
            ["The", "Eiffel", "Tower", ",", "built", "in", "1889", "."]
        );
    }

    #[test]
    fn content_words_skip_stopwords_and_punctuation() {
        let s = Stopwords::from_words(["the", "in", "was"]);
        assert!(s.is_content("Tower"));
        assert!(s.is_content("1889"));
        assert!(!s.is_content("The"));
        assert!(!s.is_content(","));
        assert!(!s.is_content("in."));
    }

    #[test]
    fn the_built_in_english_list_holds_function_words_only() {
        let s = Stopwords::english();
        for w in ["the", "of", "which", "was", "is", "and"] {
            assert!(!s.is_content(w), "{w}");
        }
        for w in ["archive", "Paris", "tower", "1889"] {
            assert!(s.is_content(w), "{w}");
        }
        assert!((150..=200).contains(&s.0.len()), "{} words", s.0.len());
    }
}
