//! `observed_attention`: every KV head keeps the prompt positions that received the most
//! attention over the whole prefill, each position's sum divided by the number of
//! queries that could see it (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for
//! Efficient Generative Inference of Large Language Models"; kvpress's
//! `ObservedAttentionPress`), averaged over the KV head's query heads. The prefill runs
//! with its attention probabilities observed, which costs time (the fast blocked
//! prefill is not used) and memory: one chunk's probabilities at a time, and the sums,
//! `n_heads x n` floats per pressed layer (not counted in the reported KV bytes).
//!
//! ```toml
//! type = "observed_attention"
//! compression_ratio = 0.5
//! ```


use serde::{Deserialize, Serialize};

use crate::policy::evict::{Eviction, Observe, Rows, TokenScorer};
use crate::policy::plan::Plan;
use crate::policy::presses::knorm::check_ratio;
use crate::policy::presses::{press_tokens, Press, Target};
use crate::Result;

/// The `observed_attention` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObservedAttention {
    /// Share of each KV head's prompt positions dropped, in `(0, 1)`.
    pub compression_ratio: f64,
}

impl Press for ObservedAttention {
    fn check(&self) -> Result<()> {
        check_ratio(self.compression_ratio)
    }

    fn apply(&self, plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        press_tokens(plan, Eviction::new(self.compression_ratio, MeanAttention));
        Ok(())
    }

    fn presses_tokens(&self) -> bool {
        true
    }
}

/// Attention summed over every observed query, divided by how many of them see the row
/// (causal: those at or after it), averaged over the group.
#[derive(Debug)]
struct MeanAttention;

impl TokenScorer for MeanAttention {
    fn observes(&self) -> Observe {
        Observe::All
    }

    fn score(&self, rows: &Rows<'_>) -> Result<Vec<f32>> {
        let n = rows.len();
        let from = rows.queries.start;
        let mut scores = vec![0f32; n];
        for head in rows.group.clone() {
            for (j, (s, &a)) in scores.iter_mut().zip(rows.attention_of(head)?).enumerate() {
                let seen_by = (n - j.max(from)) as f32;
                *s += a / seen_by / rows.group.len() as f32;
            }
        }
        Ok(scores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_sum_is_divided_by_the_queries_that_see_it() {
        // 4 rows observed by all 4 queries: row j is seen by 4 - j of them.
        let attention = [2.0, 1.5, 1.0, 1.0];
        let keys = [0.0; 4];
        let rows = Rows {
            values: &[],
            keys: &keys,
            d_head: 1,
            group: 0..1,
            attention: Some(&attention),
            queries: 0..4,
            moments: None,
        };
        assert_eq!(MeanAttention.score(&rows).unwrap(), vec![0.5, 0.5, 0.5, 1.0]);
    }
}
