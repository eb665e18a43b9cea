//! `knorm`: every KV head keeps the prompt positions whose keys have the smallest L2
//! norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV
//! Cache Compression"; kvpress's `KnormPress`, the weak baseline of its leaderboard).
//! The prompt is prefilled in full; then each KV head of a layer without a window of its
//! own drops `compression_ratio` of the positions it holds, and decoding continues over
//! what is left. The score needs neither queries nor attention, so it is the same
//! whichever query follows.
//!
//! Protocol: when the request says where its question starts
//! ([`crate::model::GenerateOptions::context_len`]; the eval harness does for NIAH,
//! HotpotQA and MuSiQue), the context alone is prefilled and pressed and the question
//! runs over what was kept: kvpress's query-agnostic protocol. Otherwise (`Runtime`,
//! `serve`, `generate`) the whole prompt but its last token is pressed, the question
//! and the chat template's tail included.
//!
//! ```toml
//! type = "knorm"
//! compression_ratio = 0.5
//! ```


use serde::{Deserialize, Serialize};

use crate::policy::evict::{Eviction, Rows, TokenScorer};
use crate::policy::plan::Plan;
use crate::policy::presses::{press_tokens, Press, Target};
use crate::{Error, Result};

/// The `knorm` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Knorm {
    /// Share of each KV head's prompt positions dropped, in `(0, 1)`.
    pub compression_ratio: f64,
}

impl Press for Knorm {
    fn check(&self) -> Result<()> {
        check_ratio(self.compression_ratio)
    }

    fn apply(&self, plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        press_tokens(plan, Eviction::new(self.compression_ratio, KeyNorm));
        Ok(())
    }

    fn presses_tokens(&self) -> bool {
        true
    }
}

/// A compression ratio is the share dropped: strictly between 0 and 1.
pub(crate) fn check_ratio(ratio: f64) -> Result<()> {
    if !(ratio > 0.0 && ratio < 1.0) {
        return Err(Error::invalid(
            "compression_ratio",
            format!("{ratio} (must be in (0, 1))"),
        ));
    }
    Ok(())
}

/// Minus the key's L2 norm: the smallest norms score highest.
#[derive(Debug)]
struct KeyNorm;

impl TokenScorer for KeyNorm {
    fn score(&self, rows: &Rows<'_>) -> Result<Vec<f32>> {
        Ok(rows
            .keys
            .chunks_exact(rows.d_head)
            .map(|k| -(k.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt() as f32))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_keys_score_highest_and_ratios_stay_inside_zero_and_one() {
        let keys = [3.0, 4.0, 0.0, 1.0, 1.0, 1.0];
        let rows = Rows {
            values: &[],
            keys: &keys,
            d_head: 2,
            group: 0..1,
            attention: None,
            queries: 3..3,
            moments: None,
        };
        let want = vec![-5.0, -1.0, -(2f32.sqrt())];
        assert_eq!(KeyNorm.score(&rows).unwrap(), want);
        for bad in [0.0, 1.0, -0.5, f64::NAN] {
            assert!(check_ratio(bad).is_err(), "{bad}");
        }
        assert!(check_ratio(0.75).is_ok());
    }
}
