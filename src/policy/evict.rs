//! Token eviction, the split of kvpress's `ScorerPress`: a press's scorer gives every
//! position a KV head stores a score ([`TokenScorer`]), and one selector keeps the
//! highest-scoring `floor(n * (1 - compression_ratio))` of its `n` rows
//! ([`Eviction::press`]). Each KV head keeps its own positions, in its own store, so the
//! memory given back is real. It runs after a full prefill of what is pressed: the
//! context, when the request says where its question starts (then the question runs
//! over what was kept), else the whole prompt but its last token.

use std::fmt;
use std::sync::Arc;

use crate::model::{Config, HeadCache};
use crate::Result;

/// Scores the rows of one KV head; the highest are kept.
pub trait TokenScorer: fmt::Debug + Send + Sync {
    /// One score per row of `keys` `(rows, d_head)` (row-major, after RoPE).
    fn score(&self, keys: &[f32], d_head: usize) -> Vec<f32>;
}

/// A token-eviction step of a plan.
#[derive(Debug, Clone)]
pub struct Eviction {
    /// Share of each KV head's stored positions dropped, in `(0, 1)`.
    pub compression_ratio: f64,
    pub scorer: Arc<dyn TokenScorer>,
}

impl Eviction {
    /// Evict from every store of `cache` that keeps every position (the KV heads of
    /// layers without a window of their own): each keeps its best-scoring
    /// `floor(n * (1 - compression_ratio))` rows.
    pub fn press(&self, cache: &mut HeadCache, cfg: &Config) -> Result<()> {
        for layer in 0..cfg.n_layers {
            for kv_head in 0..cfg.n_kv_heads {
                let Some(keys) = cache.full_store_keys(layer, kv_head) else {
                    continue;
                };
                let scores = self.scorer.score(keys, cfg.d_head);
                let keep = (scores.len() as f64 * (1.0 - self.compression_ratio)).floor();
                let rows = best_rows(&scores, keep as usize);
                cache.keep(layer, kv_head, &rows)?;
            }
        }
        Ok(())
    }
}

/// Indices of the `keep` highest scores, ascending; of equal scores the earlier row.
pub(crate) fn best_rows(scores: &[f32], keep: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut rows = order[..keep.min(order.len())].to_vec();
    rows.sort_unstable();
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_rows_come_back_in_order() {
        let scores = [0.5, 3.0, -1.0, 3.0, 2.0];
        assert_eq!(best_rows(&scores, 3), vec![1, 3, 4]);
        assert_eq!(best_rows(&scores, 2), vec![1, 3]);
        assert_eq!(best_rows(&scores, 0), Vec::<usize>::new());
        assert_eq!(best_rows(&scores, 9), vec![0, 1, 2, 3, 4]);
    }
}
