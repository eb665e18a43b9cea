//! `tova`: every KV head keeps the prompt positions the last prompt position attends to
//! most, averaged over all query heads of its layer (Oren et al. 2024, "Transformers
//! are Multi-State RNNs", TOVA; kvpress's `TOVAPress`, applied once after the prefill
//! as kvpress does). The last position itself is always kept.
//!
//! ```toml
//! type = "tova"
//! compression_ratio = 0.5
//! ```


use serde::{Deserialize, Serialize};

use crate::policy::evict::{Eviction, Observe, Rows, TokenScorer};
use crate::policy::plan::Plan;
use crate::policy::presses::knorm::check_ratio;
use crate::policy::presses::{press_tokens, Press, Target};
use crate::{Error, Result};

/// The `tova` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tova {
    /// Share of each KV head's prompt positions dropped, in `(0, 1)`.
    pub compression_ratio: f64,
}

impl Press for Tova {
    fn check(&self) -> Result<()> {
        check_ratio(self.compression_ratio)
    }

    fn apply(&self, plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        press_tokens(plan, Eviction::new(self.compression_ratio, LastQuery));
        Ok(())
    }

    fn presses_tokens(&self) -> bool {
        true
    }
}

/// The last query's attention, averaged over every query head of the layer; the last
/// row scores infinity.
#[derive(Debug)]
struct LastQuery;

impl TokenScorer for LastQuery {
    fn observes(&self) -> Observe {
        Observe::Last(1)
    }

    fn score(&self, rows: &Rows<'_>) -> Result<Vec<f32>> {
        let n = rows.len();
        let attention = rows
            .attention
            .ok_or(Error::Internal("tova observes attention"))?;
        let heads = attention.len() / n.max(1);
        if n < 2 || heads == 0 {
            return Err(Error::invalid(
                "prompt",
                format!("{n} positions pressed (tova needs at least 2)"),
            ));
        }
        let mut scores = vec![0f32; n];
        for head in 0..heads {
            for (s, &a) in scores.iter_mut().zip(rows.attention_of(head)?) {
                *s += a / heads as f32;
            }
        }
        scores[n - 1] = f32::INFINITY;
        Ok(scores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_head_of_the_layer_counts_and_the_last_row_is_kept() {
        // Two query heads over 3 rows; the KV head's group is head 1 alone, yet both
        // heads count.
        let attention = [0.6, 0.4, 0.0, 0.0, 0.2, 0.8];
        let keys = [0.0; 3];
        let rows = Rows {
            values: &[],
            keys: &keys,
            d_head: 1,
            group: 1..2,
            attention: Some(&attention),
            queries: 2..3,
            moments: None,
        };
        let s = LastQuery.score(&rows).unwrap();
        assert_eq!(s, vec![0.3, 0.3, f32::INFINITY]);
    }
}
