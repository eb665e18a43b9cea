//! The literal needle-in-a-haystack task (Kamradt's LLMTest_NeedleInAHaystack), in the
//! form used to find retrieval heads by their copy-paste score (Wu et al., 2024,
//! "Retrieval Head Mechanistically Explains Long-Context Factuality", section 2): the
//! answer is copied token by token from the needle, so a head that attends to the needle
//! token being generated can be scored.
//!
//! Prompt (SmolLM2 adds no BOS; Gemma 3 starts with `<bos>`):
//!
//! ```text
//! A special magic number is hidden somewhere in the text below. Find it, then answer
//! the question at the end with the number only.
//!
//! {haystack ... The special magic number for the lighthouse is 4812907. ... haystack}
//!
//! Question: What is the special magic number for the lighthouse?
//! Answer:
//! ```
//!
//! (the instruction is one line). The answer, `4812907`, is generated as `" 4812907"`. The
//! number has seven digits (1000000..=9999999), as in RULER's NIAH; the subject ("the
//! lighthouse") is drawn from [`SUBJECTS`]. SmolLM2 and Gemma 3 both split numbers into
//! single digits, so the answer is seven copied digit tokens after one space token.

use crate::lab::tasks::{Needle, SplitMix64};

/// The instruction that opens every NIAH prompt.
pub const INSTRUCTION: &str = "A special magic number is hidden somewhere in the text below. \
Find it, then answer the question at the end with the number only.";

/// What the magic number belongs to; a seed draws one.
pub const SUBJECTS: &[&str] = &[
    "the archive",
    "the lighthouse",
    "the observatory",
    "the greenhouse",
    "the old library",
    "the harbor office",
    "the railway depot",
    "the mountain cabin",
    "the river mill",
    "the music hall",
    "the clock tower",
    "the orchard",
    "the boathouse",
    "the weaving workshop",
    "the print shop",
    "the chess club",
];

/// Salt of the stream that draws a seed's needle.
const NEEDLE_SALT: u64 = 0x6e69_6168_6e65_6564; // "niahneed"

/// The needle, question and answer of `seed`.
pub fn needle(seed: u64) -> Needle {
    let mut rng = SplitMix64::new(seed, NEEDLE_SALT);
    let subject = SUBJECTS[rng.below(SUBJECTS.len())];
    let number = 1_000_000 + rng.below(9_000_000);
    Needle {
        instruction: INSTRUCTION.to_string(),
        sentence: format!("The special magic number for {subject} is {number}."),
        question: format!("What is the special magic number for {subject}?"),
        answer: number.to_string(),
    }
}

/// Phrases whose sentences are left out of the haystack: anything that could pass for
/// the needle.
pub fn avoided_phrases() -> Vec<String> {
    vec!["magic number".into()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::tasks::Encoder;
    use crate::test_support::smollm2;

    #[test]
    fn needles_are_literal_and_vary_with_the_seed() {
        let mut numbers = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let n = needle(seed);
            assert_eq!(n, needle(seed));
            assert_eq!(n.answer.len(), 7);
            assert!(n.answer.chars().all(|c| c.is_ascii_digit()));
            assert!(n.sentence.contains(&format!(" {}.", n.answer)));
            // The question repeats the needle's words (minus the number).
            let asked = n
                .question
                .trim_start_matches("What is ")
                .trim_end_matches('?');
            assert!(n
                .sentence
                .to_lowercase()
                .starts_with(&format!("{asked} is ")));
            numbers.insert(n.answer);
        }
        assert!(numbers.len() > 195);
    }

    #[test]
    fn answer_is_a_space_then_single_digits_for_smollm2() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let n = needle(11);
        let ids = enc.encode(&format!(" {}", n.answer)).unwrap();
        assert_eq!(ids.len(), 8, "{ids:?}");
        assert_eq!(enc.decode(&ids[..1]).unwrap(), " ");
        for (id, digit) in ids[1..].iter().zip(n.answer.chars()) {
            assert_eq!(enc.decode(&[*id]).unwrap(), digit.to_string());
        }
    }
}
