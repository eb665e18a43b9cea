//! Filler text for needle-in-a-haystack trials, split into sentences and tokenized on
//! demand.
//!
//! The standard filler is Paul Graham's essays (Kamradt's LLMTest_NeedleInAHaystack),
//! read from a folder of `*.txt` files ([`Haystack::from_dir`]); [`Haystack::synthetic`]
//! is a built-in stand-in for runs without the data folder.
//!
//! Text is cut into sentences once, with runs of whitespace (hard line wraps included)
//! collapsed to one space. A sentence ends at `.`, `!` or `?` (and any closing quotes or
//! brackets right after it) followed by a space and a capital, a digit or an opening
//! quote or bracket, or directly by a footnote mark (`dictators.[14] This`) or by a
//! capital when the character before the stop is not a capital (the essays' paragraph
//! breaks were lost, leaving `accelerating.We` and `in 1960.It's`; `U.S.A` stays one
//! piece). Abbreviations followed by a capital (`Mr. Smith`) are cut too; the needle only
//! ever goes between two pieces, so this costs nothing but a slightly odd boundary.
//!
//! [`HaystackTokens`] tokenizes sentences as they are needed, each on its own with a
//! leading space, and cuts [`Window`]s of an exact token count from them.

use std::path::Path;

use crate::lab::tasks::{Encoder, SplitMix64};
use crate::{Error, Result};

/// Salt of the stream that draws a seed's haystack start.
const START_SALT: u64 = 0x6861_7973_7461_636b; // "haystack"

/// Filler text as a list of sentences, in corpus order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Haystack {
    name: String,
    sentences: Vec<String>,
}

impl Haystack {
    /// Every `*.txt` file in `dir`, in file-name order, as one corpus (e.g.
    /// `../shared/data/haystack/paul_graham`).
    ///
    /// Errors: [`Error::Io`] naming the folder or file that cannot be read (a missing
    /// folder, a file that is not UTF-8); [`Error::InvalidArgument`] for a folder without
    /// `.txt` files or whose files hold no text.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
        let mut files = Vec::new();
        for entry in entries {
            let path = entry.map_err(|e| Error::io(dir, e))?.path();
            if path.is_file() && path.extension().is_some_and(|x| x == "txt") {
                files.push(path);
            }
        }
        if files.is_empty() {
            return Err(Error::invalid(
                "haystack",
                format!("{}: no .txt files", dir.display()),
            ));
        }
        files.sort();
        let texts = files
            .iter()
            .map(|f| std::fs::read_to_string(f).map_err(|e| Error::io(f, e)))
            .collect::<Result<Vec<_>>>()?;
        Self::from_texts(&dir.display().to_string(), texts)
    }

    /// A corpus of the given documents, in order; `name` says where it came from (errors
    /// and reports show it).
    ///
    /// Errors: [`Error::InvalidArgument`] when the documents hold no text.
    pub fn from_texts<S: AsRef<str>>(
        name: &str,
        texts: impl IntoIterator<Item = S>,
    ) -> Result<Self> {
        let mut sentences = Vec::new();
        for text in texts {
            split_sentences(text.as_ref(), &mut sentences);
        }
        if sentences.is_empty() {
            return Err(Error::invalid(
                "haystack",
                format!("{name}: the documents hold no text"),
            ));
        }
        Ok(Self {
            name: name.to_string(),
            sentences,
        })
    }

    /// A deterministic built-in filler of 4096 bland sentences ("The gardening club
    /// counted the rain gauges before the rain started."), drawn from a few word lists;
    /// it names no person, landmark or city and holds no number.
    pub fn synthetic() -> Self {
        const SUBJECTS: &[&str] = &[
            "the town council",
            "a group of volunteers",
            "the night shift",
            "the new librarian",
            "the bakery on the corner",
            "the school choir",
            "the ferry crew",
            "a retired teacher",
            "the gardening club",
            "the weather station",
            "the local newspaper",
            "the hiking group",
        ];
        const VERBS: &[&str] = &[
            "reviewed",
            "discussed",
            "repainted",
            "rearranged",
            "counted",
            "cleaned",
            "photographed",
            "catalogued",
            "measured",
            "inspected",
            "postponed",
            "planned",
        ];
        const OBJECTS: &[&str] = &[
            "the spring timetable",
            "the wooden benches",
            "the shelves of old maps",
            "the parking rules",
            "the garden fences",
            "the supply of candles",
            "the lost umbrellas",
            "the blue notebooks",
            "the village signposts",
            "the winter schedule",
            "the stack of letters",
            "the rain gauges",
        ];
        const WHEN: &[&str] = &[
            "on a quiet morning",
            "before the rain started",
            "after a long lunch",
            "during the afternoon break",
            "late in the evening",
            "without much fuss",
            "as they did every year",
            "while the kettle boiled",
            "in the usual careful way",
            "before anyone else arrived",
            "at the end of the week",
            "with a certain patience",
        ];
        let mut rng = SplitMix64::new(0, 0x7379_6e74_6865_7469); // "syntheti"
        let mut pick = |list: &[&'static str]| list[rng.below(list.len())];
        let sentences = (0..4096)
            .map(|i| {
                let (s, v, o, w) = (pick(SUBJECTS), pick(VERBS), pick(OBJECTS), pick(WHEN));
                if i % 3 == 2 {
                    capitalize(&format!("{w}, {s} {v} {o}."))
                } else {
                    capitalize(&format!("{s} {v} {o} {w}."))
                }
            })
            .collect();
        Self {
            name: "synthetic".into(),
            sentences,
        }
    }

    /// Where the text came from: the folder, or `synthetic`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The sentences, in corpus order, whitespace collapsed, without surrounding spaces.
    pub fn sentences(&self) -> &[String] {
        &self.sentences
    }

    /// `n` tokens of haystack starting at the beginning of a sentence chosen by `seed`
    /// (wrapping around the corpus; the last sentence cut at the `n`th token), as the
    /// generators place them: the first sentence without a leading space, the rest each
    /// with one.
    pub fn take_tokens(&self, enc: &Encoder, n: usize, seed: u64) -> Result<Vec<u32>> {
        let mut tokens = HaystackTokens::new(self, *enc, &[])?;
        let start = tokens.start_for_seed(seed);
        Ok(tokens.window(start, n, true)?.pieces.concat())
    }
}

/// Consecutive haystack sentences as token ids; the last may be cut short.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// One entry per sentence, never empty.
    pub pieces: Vec<Vec<u32>>,
    /// Whether the last piece is a sentence cut short to reach the requested length.
    pub truncated: bool,
}

impl Window {
    /// Total tokens.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(Vec::len).sum()
    }

    /// Whether the window holds no token.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The number of pieces before the piece boundary nearest to `target` tokens (the
    /// start and the end count as boundaries; ties go to the earlier one).
    pub fn snap(&self, target: usize) -> usize {
        let mut best = (0, target);
        let mut at = 0;
        for (k, piece) in self.pieces.iter().enumerate() {
            at += piece.len();
            let dist = at.abs_diff(target);
            if dist < best.1 {
                best = (k + 1, dist);
            }
        }
        best.0
    }
}

/// A haystack tokenized on demand with one encoder, leaving out sentences that mention
/// any of a list of phrases.
pub struct HaystackTokens<'a> {
    haystack: &'a Haystack,
    enc: Encoder<'a>,
    /// Indices of the usable sentences, in corpus order.
    order: Vec<usize>,
    /// Ids of `" " + sentence`, per entry of `order`, once computed.
    cache: Vec<Option<Vec<u32>>>,
}

impl<'a> HaystackTokens<'a> {
    /// The usable sentences of `haystack`: those that do not mention any of `avoid` as a
    /// whole word or phrase (case-insensitive).
    ///
    /// Errors: [`Error::InvalidArgument`] when no sentence is left.
    pub fn new(haystack: &'a Haystack, enc: Encoder<'a>, avoid: &[String]) -> Result<Self> {
        let avoid: Vec<String> = avoid.iter().map(|p| p.to_lowercase()).collect();
        let order: Vec<usize> = haystack
            .sentences
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                let lower = s.to_lowercase();
                !avoid.iter().any(|p| mentions(&lower, p))
            })
            .map(|(i, _)| i)
            .collect();
        if order.is_empty() {
            return Err(Error::invalid(
                "haystack",
                format!(
                    "{}: every sentence mentions a word the task must avoid ({})",
                    haystack.name,
                    avoid.join(", ")
                ),
            ));
        }
        Ok(Self {
            haystack,
            enc,
            cache: vec![None; order.len()],
            order,
        })
    }

    /// How many sentences are usable.
    pub fn sentence_count(&self) -> usize {
        self.order.len()
    }

    /// The start (an index into the usable sentences) that `seed` draws.
    pub fn start_for_seed(&self, seed: u64) -> usize {
        SplitMix64::new(seed, START_SALT).below(self.order.len())
    }

    /// Exactly `n` tokens: usable sentences from number `start` on, wrapping around the
    /// corpus, the last one cut at the `n`th token. With `bare_first` the first sentence is
    /// tokenized without its leading space (it follows a newline).
    ///
    /// Errors: [`Error::Tokenizer`] from encoding; [`Error::InvalidArgument`] when no
    /// usable sentence yields a token.
    pub fn window(&mut self, start: usize, n: usize, bare_first: bool) -> Result<Window> {
        let mut pieces: Vec<Vec<u32>> = Vec::new();
        let mut total = 0;
        let mut pos = start;
        let mut empty_run = 0;
        let mut truncated = false;
        while total < n {
            let k = pos % self.order.len();
            pos += 1;
            let ids = if pieces.is_empty() && bare_first {
                self.enc.encode(&self.haystack.sentences[self.order[k]])?
            } else {
                self.spaced(k)?.to_vec()
            };
            if ids.is_empty() {
                empty_run += 1;
                if empty_run > self.order.len() {
                    return Err(Error::invalid(
                        "haystack",
                        format!("{}: no sentence has a token", self.haystack.name),
                    ));
                }
                continue;
            }
            empty_run = 0;
            let take = ids.len().min(n - total);
            truncated = take < ids.len();
            total += take;
            pieces.push(ids[..take].to_vec());
        }
        Ok(Window { pieces, truncated })
    }

    /// Ids of `" " + sentence` for usable sentence `k`.
    fn spaced(&mut self, k: usize) -> Result<&[u32]> {
        if self.cache[k].is_none() {
            let text = format!(" {}", self.haystack.sentences[self.order[k]]);
            self.cache[k] = Some(self.enc.encode(&text)?);
        }
        Ok(self.cache[k].as_deref().unwrap_or_default())
    }
}

/// Whether `text` holds `phrase` as whole words (both already lower-case).
fn mentions(text: &str, phrase: &str) -> bool {
    text.match_indices(phrase).any(|(i, m)| {
        let before = text[..i].chars().next_back();
        let after = text[i + m.len()..].chars().next();
        !before.is_some_and(char::is_alphanumeric) && !after.is_some_and(char::is_alphanumeric)
    })
}

/// `s` with its first character upper-case.
fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Append the sentences of `text` to `out` (rules in the module docs).
fn split_sentences(text: &str, out: &mut Vec<String>) {
    let norm = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let chars: Vec<char> = norm.chars().collect();
    let opens = |c: char| {
        c.is_uppercase() || c.is_ascii_digit() || matches!(c, '"' | '\'' | '(' | '[' | '“' | '‘')
    };
    let mut push = |piece: &[char]| {
        let s: String = piece.iter().collect();
        let s = s.trim();
        if !s.is_empty() {
            out.push(s.to_string());
        }
    };
    let mut start = 0;
    let mut i = 0;
    while i < chars.len() {
        if matches!(chars[i], '.' | '!' | '?') {
            let mut j = i + 1;
            while j < chars.len() && matches!(chars[j], '"' | '\'' | ')' | ']' | '”' | '’') {
                j += 1;
            }
            let ends = match chars.get(j) {
                None => true,
                Some(' ') => chars.get(j + 1).is_some_and(|&c| opens(c)),
                Some('[') => chars.get(j + 1).is_some_and(char::is_ascii_digit),
                Some(&c) => c.is_uppercase() && i > 0 && !chars[i - 1].is_uppercase(),
            };
            if ends {
                push(&chars[start..j]);
                start = j;
                i = j;
                continue;
            }
        }
        i += 1;
    }
    push(&chars[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::smollm2;

    fn split(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        split_sentences(text, &mut out);
        out
    }

    #[test]
    fn sentences_are_split_where_prose_ends_them() {
        let rows: &[(&str, &[&str])] = &[
            ("One. Two.", &["One.", "Two."]),
            (
                "Wrapped\nline here.  Next one!",
                &["Wrapped line here.", "Next one!"],
            ),
            (
                "accelerating.We wouldn't",
                &["accelerating.", "We wouldn't"],
            ),
            ("in 1960.It's so.", &["in 1960.", "It's so."]),
            (
                "dictators.[14] This one.",
                &["dictators.", "[14] This one."],
            ),
            ("see [a] and x.[b] too.", &["see [a] and x.[b] too."]),
            (
                "Is it? \"Yes.\" 3 more.",
                &["Is it?", "\"Yes.\"", "3 more."],
            ),
            ("e.g. lower case goes on.", &["e.g. lower case goes on."]),
            ("version 1.5 of it.", &["version 1.5 of it."]),
            ("U.S.A was there.", &["U.S.A was there."]),
            ("no terminator", &["no terminator"]),
            ("  \n ", &[]),
        ];
        for (text, want) in rows {
            assert_eq!(split(text), *want, "{text:?}");
        }
    }

    #[test]
    fn phrases_match_whole_words_only() {
        assert!(mentions("she moved to paris.", "paris"));
        assert!(mentions("new york, again", "new york"));
        assert!(!mentions("parisian cafes", "paris"));
        assert!(!mentions("compare", "paris"));
        assert!(mentions("omar", "omar"));
    }

    #[test]
    fn snap_picks_the_nearest_boundary_earlier_on_ties() {
        let w = Window {
            pieces: vec![vec![0; 10], vec![0; 10], vec![0; 5]],
            truncated: true,
        };
        assert_eq!(w.len(), 25);
        let rows = [
            (0, 0),
            (4, 0),
            (5, 0),
            (6, 1),
            (12, 1),
            (15, 1),
            (18, 2),
            (24, 3),
            (25, 3),
            (99, 3),
        ];
        for (target, want) in rows {
            assert_eq!(w.snap(target), want, "target {target}");
        }
    }

    #[test]
    fn synthetic_is_deterministic_and_bland() {
        let a = Haystack::synthetic();
        assert_eq!(a, Haystack::synthetic());
        assert_eq!(a.sentences().len(), 4096);
        assert!(a.sentences().iter().all(|s| s.ends_with('.')));
        assert!(a
            .sentences()
            .iter()
            .all(|s| !s.chars().any(|c| c.is_ascii_digit())));
        let distinct: std::collections::BTreeSet<_> = a.sentences().iter().collect();
        assert!(distinct.len() > 3000, "{}", distinct.len());
        // Re-splitting the joined text gives the same sentences back.
        assert_eq!(split(&a.sentences().join(" ")), a.sentences());
    }

    #[test]
    fn from_dir_reads_txt_files_in_name_order_and_names_bad_folders() {
        let dir = std::env::temp_dir().join(format!("headwise-haystack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let missing = Haystack::from_dir(&dir).unwrap_err().to_string();
        assert!(missing.contains(&dir.display().to_string()), "{missing}");

        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("notes.md"), "Not a txt file.").unwrap();
        let none = Haystack::from_dir(&dir).unwrap_err().to_string();
        assert!(none.contains("no .txt files"), "{none}");

        std::fs::write(dir.join("b.txt"), "  \n").unwrap();
        let empty = Haystack::from_dir(&dir).unwrap_err().to_string();
        assert!(empty.contains("hold no text"), "{empty}");

        std::fs::write(dir.join("a.txt"), "First file. It has two.").unwrap();
        std::fs::write(dir.join("c.txt"), "Third file.").unwrap();
        let h = Haystack::from_dir(&dir).unwrap();
        assert_eq!(h.sentences(), ["First file.", "It has two.", "Third file."]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn windows_hold_exactly_n_tokens_from_a_seeded_start() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let hay = Haystack::synthetic();
        for n in [0, 1, 7, 100, 1234] {
            assert_eq!(hay.take_tokens(&enc, n, 5).unwrap().len(), n);
        }
        let a = hay.take_tokens(&enc, 200, 5).unwrap();
        assert_eq!(a, hay.take_tokens(&enc, 200, 5).unwrap());
        assert_ne!(a, hay.take_tokens(&enc, 200, 6).unwrap());
        // A window starts at a sentence, without a leading space.
        let text = enc.decode(&a).unwrap();
        assert!(hay.sentences().iter().any(|s| text.starts_with(s.as_str())));

        // Wrapping around a tiny corpus still reaches the length.
        let tiny = Haystack::from_texts("tiny", ["Only one sentence here."]).unwrap();
        assert_eq!(tiny.take_tokens(&enc, 500, 0).unwrap().len(), 500);

        let mut tokens = HaystackTokens::new(&hay, enc, &[]).unwrap();
        let w = tokens.window(0, 50, false).unwrap();
        assert_eq!(w.len(), 50);
        let first = enc.decode(&w.pieces[0]).unwrap();
        assert_eq!(first, format!(" {}", hay.sentences()[0]));
    }

    #[test]
    fn avoided_phrases_remove_sentences_and_an_empty_rest_is_an_error() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let hay = Haystack::from_texts("t", ["I went to Paris. It rained. Paris again."]).unwrap();
        let tokens = HaystackTokens::new(&hay, enc, &["PARIS".into()]).unwrap();
        assert_eq!(tokens.sentence_count(), 1);
        let all = ["paris".to_string(), "rained".to_string()];
        let err = HaystackTokens::new(&hay, enc, &all)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("every sentence mentions"), "{err}");
    }
}
