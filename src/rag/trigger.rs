//! When to retrieve. A trigger looks at a generated segment and names the first token
//! that needs retrieval, or none. It is asked after every generated token, over the
//! segment so far ([`Segment::complete`] false): a word still being written (the last
//! one) is not judged until a later token starts a new word or the segment ends, so
//! generation stops as soon as the trigger can decide, on either engine:
//!
//! - `rind` (DRAGIN): for each generated word `i`, `S_i = H_i * a_max(i) * s_i`, with
//!   `H_i` the entropy (nats) of the output distribution that produced the word (its
//!   tokens' mean), `a_max(i)` the most attention any later generated token pays to the
//!   word (last layer, mean over heads, summed over the word's tokens), `s_i` 0 for a
//!   stopword or punctuation and 1 otherwise. It fires at the first word whose score is
//!   above the threshold. The paper multiplies by `s_i` before the threshold; DRAGIN's
//!   code thresholds `H * a` and then drops stopwords. With a positive threshold both
//!   fire on the same words, so this follows the paper's equation.
//! - `retrieval_heads`: the probe's predicted activity of the model's top retrieval
//!   heads at the step (mean over those heads) below a threshold on a content word: the
//!   model writes a content word with no retrieval signal, the papers' hallucination
//!   signal.
//! - `never`; `once` (one retrieval with the question before generating); `every_n`
//!   (at generated tokens n, 2n, ...).

use serde::{Deserialize, Serialize};

pub use crate::model::entropy;
use crate::rag::text::{word_text, words, Stopwords};
use crate::{Error, Result};

/// Which trigger, with its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum TriggerConfig {
    Never,
    Once,
    EveryN { n: usize },
    Rind { threshold: f32 },
    RetrievalHeads { threshold: f32 },
}

impl TriggerConfig {
    /// Reject thresholds that are not finite and `n = 0`.
    pub fn validate(&self) -> Result<()> {
        match *self {
            TriggerConfig::EveryN { n: 0 } => {
                Err(Error::invalid("trigger", "every_n needs n >= 1"))
            }
            TriggerConfig::Rind { threshold } | TriggerConfig::RetrievalHeads { threshold }
                if !threshold.is_finite() =>
            {
                Err(Error::invalid(
                    "trigger",
                    format!("threshold {threshold} is not a finite number"),
                ))
            }
            _ => Ok(()),
        }
    }

    /// The trigger's name.
    pub fn name(&self) -> &'static str {
        match self {
            TriggerConfig::Never => "never",
            TriggerConfig::Once => "once",
            TriggerConfig::EveryN { .. } => "every_n",
            TriggerConfig::Rind { .. } => "rind",
            TriggerConfig::RetrievalHeads { .. } => "retrieval_heads",
        }
    }
}

/// What a trigger sees of a generated segment of `t` tokens.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    /// Each token's text.
    pub pieces: &'a [&'a str],
    /// Entropy (nats) of the distribution each token was drawn from, `(t,)`.
    pub entropy: &'a [f32],
    /// Last-layer attention among the segment's tokens, mean over heads: `attention[j][i]`
    /// is what token `j` pays to token `i` (`i < j`), `(t, t)` row-major by query.
    pub attention: &'a [Vec<f32>],
    /// `retrieval_heads`: the probe's mean predicted activity of the top heads at each
    /// token's step, `(t,)`.
    pub head_signal: Option<&'a [f32]>,
    /// Tokens generated before this segment (for `every_n`).
    pub offset: usize,
    /// Whether the segment has ended; if not, its last word may still grow and is not
    /// judged by `rind` or `retrieval_heads`.
    pub complete: bool,
}

impl Segment<'_> {
    /// The token ranges of the words a trigger may judge now.
    fn judged_words(&self) -> Vec<std::ops::Range<usize>> {
        let mut all = words(self.pieces);
        if !self.complete && all.last().is_some_and(|r| r.end == self.pieces.len()) {
            all.pop();
        }
        all
    }
}

/// RIND's parts for one word.
#[derive(Debug, Clone, PartialEq)]
pub struct WordScore {
    pub tokens: std::ops::Range<usize>,
    pub word: String,
    pub entropy: f32,
    pub attention: f32,
    pub content: bool,
    pub score: f32,
}

/// RIND's score of every judged word of the segment. For a word followed by another,
/// the score can only grow as the segment does (`a_max` is a maximum over more tokens).
pub fn rind_scores(seg: &Segment, stop: &Stopwords) -> Vec<WordScore> {
    seg.judged_words()
        .into_iter()
        .map(|r| {
            let word = word_text(seg.pieces, &r);
            let entropy = seg.entropy[r.clone()].iter().sum::<f32>() / r.len() as f32;
            let attention = (r.end..seg.pieces.len())
                .map(|j| r.clone().map(|i| seg.attention[j][i]).sum::<f32>())
                .fold(0.0, f32::max);
            let content = stop.is_content(&word);
            let score = entropy * attention * if content { 1.0 } else { 0.0 };
            WordScore {
                tokens: r,
                word,
                entropy,
                attention,
                content,
                score,
            }
        })
        .collect()
}

/// The first token of the segment at which `cfg` fires, if any. (`once` and `never`
/// never fire inside a segment.)
pub fn fires(cfg: &TriggerConfig, seg: &Segment, stop: &Stopwords) -> Result<Option<usize>> {
    Ok(match *cfg {
        TriggerConfig::Never | TriggerConfig::Once => None,
        TriggerConfig::EveryN { n } => {
            // The first generated index `g >= offset`, g > 0, with g % n == 0.
            let first = seg.offset.div_ceil(n).max(1) * n;
            (first < seg.offset + seg.pieces.len()).then(|| first - seg.offset)
        }
        TriggerConfig::Rind { threshold } => rind_scores(seg, stop)
            .into_iter()
            .find(|w| w.score > threshold)
            .map(|w| w.tokens.start),
        TriggerConfig::RetrievalHeads { threshold } => {
            let signal = seg.head_signal.ok_or_else(|| {
                Error::invalid("trigger", "retrieval_heads needs a probe's head signal")
            })?;
            seg.judged_words()
                .into_iter()
                .find(|r| {
                    stop.is_content(&word_text(seg.pieces, r))
                        && r.clone().map(|i| signal[i]).fold(f32::INFINITY, f32::min) < threshold
                })
                .map(|r| r.start)
        }
    })
}

/// QFS: the `n` content words of the context that the triggering position attends to
/// most (attention summed over a word's tokens), in their original order, joined by
/// spaces. `pieces` are the context's token texts, `attention` the triggering
/// position's attention over them (last layer, mean over heads), `(pieces.len(),)`.
pub fn qfs_query(pieces: &[&str], attention: &[f32], n: usize, stop: &Stopwords) -> String {
    let mut scored: Vec<(usize, f32, String)> = words(pieces)
        .into_iter()
        .map(|r| {
            (
                r.start,
                r.clone().map(|i| attention[i]).sum::<f32>(),
                word_text(pieces, &r),
            )
        })
        .filter(|(_, _, w)| stop.is_content(w))
        .collect();
    scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    scored.truncate(n);
    scored.sort_by_key(|s| s.0);
    scored
        .into_iter()
        .map(|s| s.2)
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stop() -> Stopwords {
        Stopwords::from_words(["the", "was", "in", "of", "a"])
    }

    /// A hand-built segment: "The tower was built in 1889 ." with chosen entropies
    /// and attention.
    #[test]
    fn rind_multiplies_entropy_attention_and_content() {
        let pieces = ["The", " tower", " was", " built", " in", " 18", "89", " ."];
        let entropy = [2.0, 0.5, 3.0, 0.2, 1.0, 1.5, 0.5, 0.1];
        let t = pieces.len();
        let mut attention = vec![vec![0.0f32; t]; t];
        attention[3][1] = 0.6; // "built" looks at "tower"
        attention[7][1] = 0.3;
        attention[7][2] = 0.9; // "." looks at "was" (a stopword)
        attention[7][5] = 0.4; // and at "1889": 0.4 + 0.3 over its two tokens
        attention[7][6] = 0.3;
        let seg = Segment {
            pieces: &pieces,
            entropy: &entropy,
            attention: &attention,
            head_signal: None,
            offset: 0,
            complete: true,
        };
        let s = rind_scores(&seg, &stop());
        let by = |w: &str| s.iter().find(|x| x.word == w).unwrap().clone();
        assert!((by("tower").score - 0.5 * 0.6).abs() < 1e-6);
        assert_eq!(by("was").score, 0.0); // high H * a, but a stopword
        assert!((by("was").entropy * by("was").attention - 2.7).abs() < 1e-6);
        let year = by("1889");
        assert!((year.entropy - 1.0).abs() < 1e-6 && (year.attention - 0.7).abs() < 1e-6);
        assert_eq!(by(".").attention, 0.0); // nothing comes after it
        let rind = |th| fires(&TriggerConfig::Rind { threshold: th }, &seg, &stop()).unwrap();
        assert_eq!(rind(0.25), Some(1)); // "tower" at 0.3
        assert_eq!(rind(0.5), Some(5)); // "1889" at 0.7
        assert_eq!(rind(0.8), None);
    }

    #[test]
    fn every_n_counts_across_segments_and_head_signal_needs_content() {
        let pieces = ["a", " b", " c", " d"];
        let zeros = [0.0; 4];
        let att = vec![vec![0.0; 4]; 4];
        let seg = |offset| Segment {
            pieces: &pieces,
            entropy: &zeros,
            attention: &att,
            head_signal: Some(&[0.9, 0.1, 0.2, 0.9]),
            offset,
            complete: true,
        };
        let every = TriggerConfig::EveryN { n: 3 };
        assert_eq!(fires(&every, &seg(0), &stop()).unwrap(), Some(3));
        assert_eq!(fires(&every, &seg(4), &stop()).unwrap(), Some(2));
        let heads = TriggerConfig::RetrievalHeads { threshold: 0.5 };
        // " b" has a low signal and is a content word; "a" is a stopword.
        assert_eq!(fires(&heads, &seg(0), &stop()).unwrap(), Some(1));
        assert!(TriggerConfig::Rind {
            threshold: f32::NAN
        }
        .validate()
        .is_err());
        assert!(TriggerConfig::EveryN { n: 0 }.validate().is_err());
    }

    #[test]
    fn an_unfinished_segment_leaves_its_last_word_unjudged() {
        let stop = stop();
        let heads = TriggerConfig::RetrievalHeads { threshold: 0.5 };
        let signal = [0.9, 0.9, 0.1, 0.1];
        let zeros = [0.0; 4];
        let att = vec![vec![0.0; 4]; 4];
        let seg = |pieces: &'static [&'static str], complete| Segment {
            pieces,
            entropy: &zeros[..pieces.len()],
            attention: &att[..pieces.len()],
            head_signal: Some(&signal[..pieces.len()]),
            offset: 0,
            complete,
        };
        // " Eiff" may become " Eiffel": not judged until the segment ends or a word follows.
        assert_eq!(
            fires(&heads, &seg(&["a", " b", " Eiff"], false), &stop).unwrap(),
            None
        );
        assert_eq!(
            fires(&heads, &seg(&["a", " b", " Eiff"], true), &stop).unwrap(),
            Some(2)
        );
        assert_eq!(
            fires(&heads, &seg(&["a", " b", " Eiff", "el"], false), &stop).unwrap(),
            None
        );
        // RIND: the last word has no later token to be attended by, so it scores 0 anyway,
        // and an earlier word's score grows with the tokens after it.
        let pieces = ["The", " tower", " was", " tall"];
        let entropy = [1.0; 4];
        let mut attention = vec![vec![0.0f32; 4]; 4];
        attention[2][1] = 0.3;
        attention[3][1] = 0.8;
        let rind = TriggerConfig::Rind { threshold: 0.5 };
        let prefix = |n: usize| Segment {
            pieces: &pieces[..n],
            entropy: &entropy[..n],
            attention: &attention[..n],
            head_signal: None,
            offset: 0,
            complete: false,
        };
        assert_eq!(fires(&rind, &prefix(3), &stop).unwrap(), None);
        assert_eq!(fires(&rind, &prefix(4), &stop).unwrap(), Some(1));
    }

    #[test]
    fn qfs_keeps_the_most_attended_content_words_in_order() {
        let pieces = [
            "Where", " was", " the", " Eiff", "el", " Tower", " built", "?",
        ];
        let attention = [0.05, 0.3, 0.2, 0.1, 0.15, 0.1, 0.05, 0.05];
        // Eiffel 0.25, Tower 0.1, Where 0.05 / built 0.05; "was" and "the" are stopwords.
        assert_eq!(qfs_query(&pieces, &attention, 2, &stop()), "Eiffel Tower");
        assert_eq!(
            qfs_query(&pieces, &attention, 3, &stop()),
            "Where Eiffel Tower"
        );
    }

    #[test]
    fn entropy_of_uniform_and_peaked_distributions() {
        assert!((entropy(&[0.0; 4]) - 4f32.ln()).abs() < 1e-6);
        assert!(entropy(&[100.0, 0.0, 0.0]) < 1e-6);
    }
}
