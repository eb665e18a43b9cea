//! NoLiMa-style non-literal needles (Modarressi et al., 2025, "NoLiMa: Long-Context
//! Evaluation Beyond Literal Matching"), generated in code because NoLiMa's own data is
//! not redistributable.
//!
//! The needle ties a character to a landmark; the question asks for the city or country
//! the landmark is in, so finding the needle needs one hop of world knowledge and no word
//! of the question (other than stopwords) appears in the needle:
//!
//! ```text
//! Read the text below, then answer the question at the end with one name only.
//!
//! {haystack ... Actually, Omar lives next to the Eiffel Tower. ... haystack}
//!
//! Question: Which character has been to Paris?
//! Answer:
//! ```
//!
//! The control task ([`crate::lab::tasks::TaskKind::NolimaControl`]) asks the literal question
//! on the same needle: `Which character lives next to the Eiffel Tower?`. The answer is the
//! name, generated as `" Omar"`. A seed draws one of [`pairs`] and one of [`names`].
//! Haystack sentences that mention any character, landmark or place are left out
//! ([`avoided_phrases`]), so the needle is the only sentence that can answer.

use std::collections::BTreeSet;

use crate::lab::tasks::{Needle, SplitMix64};

/// The instruction that opens every NoLiMa prompt.
pub const INSTRUCTION: &str =
    "Read the text below, then answer the question at the end with one name only.";

/// (landmark, place it is in): famous landmarks and the capital, famous city or country
/// a small model is likely to know them by. No place word occurs in its landmark.
const PAIRS: &[(&str, &str)] = &[
    ("the Eiffel Tower", "Paris"),
    ("the Louvre", "Paris"),
    ("the Arc de Triomphe", "Paris"),
    ("the Colosseum", "Rome"),
    ("the Trevi Fountain", "Rome"),
    ("the Statue of Liberty", "New York"),
    ("the Empire State Building", "New York"),
    ("Times Square", "New York"),
    ("Central Park", "New York"),
    ("Big Ben", "London"),
    ("Buckingham Palace", "London"),
    ("Westminster Abbey", "London"),
    ("the Brandenburg Gate", "Berlin"),
    ("the Reichstag", "Berlin"),
    ("the Kremlin", "Moscow"),
    ("Red Square", "Moscow"),
    ("the Golden Gate Bridge", "San Francisco"),
    ("the Acropolis", "Athens"),
    ("the Parthenon", "Athens"),
    ("the Sagrada Familia", "Barcelona"),
    ("the Forbidden City", "Beijing"),
    ("Tiananmen Square", "Beijing"),
    ("the Burj Khalifa", "Dubai"),
    ("the Space Needle", "Seattle"),
    ("the Hollywood sign", "Los Angeles"),
    ("Christ the Redeemer", "Rio de Janeiro"),
    ("the Little Mermaid statue", "Copenhagen"),
    ("the Atomium", "Brussels"),
    ("the Prado Museum", "Madrid"),
    ("the White House", "Washington"),
    ("the Lincoln Memorial", "Washington"),
    ("the CN Tower", "Toronto"),
    ("the Petronas Towers", "Kuala Lumpur"),
    ("Marina Bay Sands", "Singapore"),
    ("the Pyramids of Giza", "Egypt"),
    ("the Great Wall", "China"),
    ("the Taj Mahal", "India"),
    ("the Charles Bridge", "Prague"),
    ("the Hagia Sophia", "Istanbul"),
    ("the Blue Mosque", "Istanbul"),
    ("the Rijksmuseum", "Amsterdam"),
    ("the Gateway of India", "Mumbai"),
    ("the Rialto Bridge", "Venice"),
    ("the Doge's Palace", "Venice"),
    ("the Uffizi Gallery", "Florence"),
    ("the Hermitage Museum", "Saint Petersburg"),
    ("Schönbrunn Palace", "Vienna"),
    ("Table Mountain", "Cape Town"),
    ("the Liberty Bell", "Philadelphia"),
    ("Machu Picchu", "Peru"),
    ("Mount Fuji", "Japan"),
    ("Angkor Wat", "Cambodia"),
    ("Shibuya Crossing", "Tokyo"),
];

/// Character names: one token each (with a leading space) for SmolLM2 and Gemma 3,
/// none a place or a common English word, none occurring in the Paul Graham essays.
const NAMES: &[&str] = &[
    "Omar", "Lars", "Stuart", "Katie", "Calvin", "Diana", "Hugo", "Pablo", "Anna", "Laura",
    "Carlos", "Hans", "Boris", "Nina", "Vera", "Emma", "Julia", "Pedro", "Ahmed", "Hassan", "Raj",
    "Mei", "Felix", "Alice", "Otto", "Karl", "Ethan", "Wendy", "Anton", "Ibrahim", "Diego",
    "Bruno", "Rachel", "Sophie", "Hannah", "Marcus", "Fernando", "Teresa",
];

/// Words that carry no content, for [`content_words`]: pronouns, articles, auxiliaries,
/// prepositions and conjunctions.
const STOPWORDS: &[&str] = &[
    "a",
    "about",
    "above",
    "after",
    "again",
    "against",
    "all",
    "am",
    "an",
    "and",
    "any",
    "are",
    "as",
    "at",
    "be",
    "because",
    "been",
    "before",
    "being",
    "below",
    "between",
    "both",
    "but",
    "by",
    "can",
    "could",
    "did",
    "do",
    "does",
    "doing",
    "down",
    "during",
    "each",
    "few",
    "for",
    "from",
    "further",
    "had",
    "has",
    "have",
    "having",
    "he",
    "her",
    "here",
    "hers",
    "herself",
    "him",
    "himself",
    "his",
    "how",
    "i",
    "if",
    "in",
    "into",
    "is",
    "it",
    "its",
    "itself",
    "me",
    "more",
    "most",
    "my",
    "myself",
    "no",
    "nor",
    "not",
    "of",
    "off",
    "on",
    "once",
    "only",
    "or",
    "other",
    "our",
    "ours",
    "ourselves",
    "out",
    "over",
    "own",
    "same",
    "she",
    "should",
    "so",
    "some",
    "such",
    "than",
    "that",
    "the",
    "their",
    "theirs",
    "them",
    "themselves",
    "then",
    "there",
    "these",
    "they",
    "this",
    "those",
    "through",
    "to",
    "too",
    "under",
    "until",
    "up",
    "very",
    "was",
    "we",
    "were",
    "what",
    "when",
    "where",
    "which",
    "while",
    "who",
    "whom",
    "why",
    "will",
    "with",
    "would",
    "you",
    "your",
    "yours",
    "yourself",
    "yourselves",
];

/// Salt of the stream that draws a seed's needle.
const NEEDLE_SALT: u64 = 0x6e6f_6c69_6d61_6e65; // "nolimane"

/// The (landmark, place) pairs a needle is drawn from (53).
pub fn pairs() -> &'static [(&'static str, &'static str)] {
    PAIRS
}

/// The character names a needle is drawn from (38).
pub fn names() -> &'static [&'static str] {
    NAMES
}

/// The needle of `seed`: `Actually, {name} lives next to {landmark}.`, asked as `Which
/// character has been to {place}?`, or with `control` as `Which character lives next to
/// {landmark}?`. The same seed gives the same needle either way.
pub fn needle(seed: u64, control: bool) -> Needle {
    let mut rng = SplitMix64::new(seed, NEEDLE_SALT);
    let (landmark, place) = PAIRS[rng.below(PAIRS.len())];
    let name = NAMES[rng.below(NAMES.len())];
    let question = if control {
        format!("Which character lives next to {landmark}?")
    } else {
        format!("Which character has been to {place}?")
    };
    Needle {
        instruction: INSTRUCTION.to_string(),
        sentence: format!("Actually, {name} lives next to {landmark}."),
        question,
        answer: name.to_string(),
    }
}

/// Phrases whose sentences are left out of the haystack: every name, every place and
/// every landmark (without a leading "the"), so no sentence but the needle names a
/// character or answers the question.
pub fn avoided_phrases() -> Vec<String> {
    let mut out: BTreeSet<String> = NAMES.iter().map(|n| n.to_string()).collect();
    for (landmark, place) in PAIRS {
        out.insert(landmark.trim_start_matches("the ").to_string());
        out.insert(place.to_string());
    }
    out.into_iter().collect()
}

/// The lower-case words of `text` that are not stopwords: words are runs of letters and
/// digits, so `Doge's` gives `doge` and `s`, and one-letter words are dropped.
pub fn content_words(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .map(str::to_lowercase)
        .filter(|w| w.chars().count() > 1 && !STOPWORDS.contains(&w.as_str()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::tasks::Encoder;
    use crate::test_support::{data, gemma3, smollm2};

    /// The Snowball list from the evaluation data folder.
    fn snowball() -> Option<BTreeSet<String>> {
        let text = std::fs::read_to_string(data("stopwords/snowball_en.txt")?).expect("read");
        Some(
            text.lines()
                .filter_map(|l| l.split('|').next())
                .map(|w| w.trim().to_lowercase())
                .filter(|w| !w.is_empty())
                .collect(),
        )
    }

    #[test]
    fn lists_are_big_enough_and_distinct() {
        assert!(pairs().len() >= 40);
        assert!(names().len() >= 20);
        let landmarks: BTreeSet<_> = pairs().iter().map(|p| p.0).collect();
        assert_eq!(landmarks.len(), pairs().len());
        let names_set: BTreeSet<_> = names().iter().collect();
        assert_eq!(names_set.len(), names().len());
        let places: BTreeSet<String> = pairs().iter().flat_map(|p| content_words(p.1)).collect();
        for name in names() {
            assert!(!places.contains(&name.to_lowercase()), "{name} is a place");
            for (landmark, _) in pairs() {
                assert!(
                    !content_words(landmark).contains(&name.to_lowercase()),
                    "{name} in {landmark}"
                );
            }
        }
    }

    #[test]
    fn question_shares_no_content_word_with_the_needle_for_every_pair_and_name() {
        let snow = snowball();
        let words = |text: &str, list: &Option<BTreeSet<String>>| -> BTreeSet<String> {
            match list {
                None => content_words(text),
                Some(stop) => text
                    .split(|c: char| !c.is_alphanumeric())
                    .map(str::to_lowercase)
                    .filter(|w| w.chars().count() > 1 && !stop.contains(w))
                    .collect(),
            }
        };
        for &(landmark, place) in pairs() {
            for &name in names() {
                let needle = format!("Actually, {name} lives next to {landmark}.");
                let question = format!("Which character has been to {place}?");
                let control = format!("Which character lives next to {landmark}?");
                for list in [&None, &snow] {
                    let n = words(&needle, list);
                    let shared: Vec<_> = words(&question, list).intersection(&n).cloned().collect();
                    assert!(shared.is_empty(), "{needle} / {question}: {shared:?}");
                    assert!(
                        words(&control, list).intersection(&n).count() >= 2,
                        "{needle} / {control}"
                    );
                }
            }
        }
        // And the generator builds exactly these sentences.
        for seed in 0..100 {
            let n = needle(seed, false);
            let shared: Vec<_> = content_words(&n.question)
                .intersection(&content_words(&n.sentence))
                .cloned()
                .collect();
            assert!(shared.is_empty(), "{n:?}");
            assert!(
                n.sentence.contains(&format!(" {},", n.answer))
                    || n.sentence.contains(&format!(" {} ", n.answer))
            );
        }
    }

    #[test]
    fn seeds_spread_over_pairs_and_names_and_control_keeps_the_needle() {
        let mut seen_pairs = BTreeSet::new();
        let mut seen_names = BTreeSet::new();
        for seed in 0..500 {
            let (a, b) = (needle(seed, false), needle(seed, true));
            assert_eq!(a.sentence, b.sentence);
            assert_eq!(a.answer, b.answer);
            assert_ne!(a.question, b.question);
            seen_pairs.insert(a.sentence.split(" next to ").nth(1).unwrap().to_string());
            seen_names.insert(a.answer);
        }
        assert_eq!(seen_pairs.len(), pairs().len());
        assert_eq!(seen_names.len(), names().len());
    }

    #[test]
    fn avoided_phrases_cover_names_places_and_landmarks() {
        let avoid = avoided_phrases();
        for p in [
            "Omar",
            "Paris",
            "New York",
            "Eiffel Tower",
            "Taj Mahal",
            "Big Ben",
        ] {
            assert!(avoid.iter().any(|a| a == p), "{p}");
        }
    }

    #[test]
    fn names_are_single_tokens_for_smollm2_and_gemma3() {
        for (tok, special, ctx) in [smollm2(), gemma3()].into_iter().flatten() {
            let enc = Encoder::new(&tok, &special, ctx);
            let mut ids = BTreeSet::new();
            for name in names() {
                let name_ids = enc.encode(&format!(" {name}")).unwrap();
                assert_eq!(name_ids.len(), 1, "{name}: {name_ids:?}");
                assert!(ids.insert(name_ids[0]));
            }
        }
    }
}
