//! `snapkv`: every KV head keeps the prompt positions its layer's last `window_size`
//! queries attend to most (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for
//! Before Generation"; kvpress's `SnapKVPress`). The observation window's attention to
//! each earlier position is averaged over its queries, smoothed by an average pool of
//! `kernel_size` positions and averaged over the KV head's query heads; the window
//! itself is always kept (inside the budget). The attention is the model's own, observed
//! while the window is prefilled, so Gemma's scaling and masks are those it ran with.
//!
//! Protocol as for [`crate::policy::presses::knorm`]: with a context length the window
//! is the context's last positions (query-agnostic); otherwise the prompt's, question
//! included.
//!
//! ```toml
//! type = "snapkv"
//! compression_ratio = 0.5
//! window_size = 64   # default
//! kernel_size = 5    # default; odd
//! ```


use serde::{Deserialize, Serialize};

use crate::policy::evict::{Eviction, Observe, Rows, TokenScorer};
use crate::policy::plan::Plan;
use crate::policy::presses::knorm::check_ratio;
use crate::policy::presses::{press_tokens, Press, Target};
use crate::{Error, Result};

/// The `snapkv` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapkv {
    /// Share of each KV head's prompt positions dropped, in `(0, 1)`.
    pub compression_ratio: f64,
    /// Queries whose attention scores the rest (the last positions pressed).
    #[serde(default = "default_window_size")]
    pub window_size: usize,
    /// Positions averaged around each score (odd).
    #[serde(default = "default_kernel_size")]
    pub kernel_size: usize,
}

pub(crate) fn default_window_size() -> usize {
    64
}

pub(crate) fn default_kernel_size() -> usize {
    5
}

impl Press for Snapkv {
    fn check(&self) -> Result<()> {
        check_ratio(self.compression_ratio)?;
        check_window(self.window_size, self.kernel_size)
    }

    fn apply(&self, plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        let scorer = WindowAttention {
            window: self.window_size,
            kernel: self.kernel_size,
        };
        press_tokens(plan, Eviction::new(self.compression_ratio, scorer));
        Ok(())
    }

    fn presses_tokens(&self) -> bool {
        true
    }
}

/// A window of at least one query and an odd pooling kernel.
pub(crate) fn check_window(window: usize, kernel: usize) -> Result<()> {
    if window == 0 {
        return Err(Error::invalid("window_size", "0 (must be at least 1)"));
    }
    if kernel.is_multiple_of(2) {
        return Err(Error::invalid(
            "kernel_size",
            format!("{kernel} (must be odd)"),
        ));
    }
    Ok(())
}

/// SnapKV's score: the window's mean attention to each earlier row, pooled over
/// `kernel` rows (zeros past either end, divided by `kernel`), averaged over the group;
/// the window's rows score infinity (kvpress gives them the maximum, which ties with the
/// best row before the window when the budget is exactly the window).
#[derive(Debug)]
pub(crate) struct WindowAttention {
    pub(crate) window: usize,
    pub(crate) kernel: usize,
}

impl TokenScorer for WindowAttention {
    fn observes(&self) -> Observe {
        Observe::Last(self.window)
    }

    fn check_rows(&self, n: usize) -> Result<()> {
        // None pressed (a one-token prompt): nothing to score.
        if n > 0 && n <= self.window {
            return Err(Error::invalid(
                "window_size",
                format!(
                    "{} is not shorter than the {n} positions pressed (the prompt is too \
                     short for this press)",
                    self.window
                ),
            ));
        }
        Ok(())
    }

    fn score(&self, rows: &Rows<'_>) -> Result<Vec<f32>> {
        let n = rows.len();
        self.check_rows(n)?;
        let before = n - self.window;
        let half = self.kernel / 2;
        let norm = (self.window * self.kernel * rows.group.len()) as f32;
        let mut scores = vec![0f32; n];
        for head in rows.group.clone() {
            let a = &rows.attention_of(head)?[..before];
            for (j, s) in scores[..before].iter_mut().enumerate() {
                let span = j.saturating_sub(half)..(j + half + 1).min(before);
                *s += a[span].iter().sum::<f32>() / norm;
            }
        }
        scores[before..].fill(f32::INFINITY);
        Ok(scores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_kept_and_the_rest_pooled() {
        // 6 rows, window 2, kernel 3, one query head: rows 0..4 pooled, 4 and 5 the window.
        let attention = [2.0, 0.0, 0.0, 4.0, 1.0, 1.0];
        let keys = [0.0; 6];
        let rows = Rows {
            values: &[],
            keys: &keys,
            d_head: 1,
            group: 0..1,
            attention: Some(&attention),
            queries: 4..6,
            moments: None,
        };
        let s = WindowAttention {
            window: 2,
            kernel: 3,
        }
        .score(&rows)
        .unwrap();
        // (2 + 0) / 6, (2 + 0 + 0) / 6, (0 + 0 + 4) / 6, (0 + 4) / 6, then the window
        let inf = f32::INFINITY;
        let want = [2.0 / 6.0, 2.0 / 6.0, 4.0 / 6.0, 4.0 / 6.0, inf, inf];
        for (a, b) in s.iter().zip(want) {
            assert!(a == &b || (a - b).abs() < 1e-6, "{s:?}");
        }
        let short = WindowAttention {
            window: 6,
            kernel: 3,
        };
        assert!(short.score(&rows).unwrap_err().to_string().contains("window_size"));
        assert!(check_window(0, 5).is_err());
        assert!(check_window(64, 4).is_err());
        assert!(check_window(64, 5).is_ok());
    }
}
