//! `expected_attention`: every KV head keeps the prompt positions that the queries still
//! to come are expected to attend to most (Devoto et al. 2025, "Expected Attention: KV
//! Cache Compression by Estimating Attention from Future Queries Distribution"; kvpress's
//! `ExpectedAttentionPress`). The queries before RoPE are taken as Gaussian with the
//! mean `mu` and covariance `S` of the pressed positions' queries (the first `n_sink`
//! left out), rotated by the average RoPE rotation `R` of the next `n_future_positions`
//! positions; a key `k` then gets `E[exp(q.k / sqrt(d))] ∝ exp((R mu).k / sqrt(d) +
//! k.(R S R^T) k / (2 d))`, normalised over the head's keys (a softmax), averaged over
//! the KV head's query heads and, with `use_vnorm`, times `|v|` (after adding
//! `epsilon`). The first `n_sink` positions are always kept.
//!
//! The moments are of the model's own queries before RoPE (after Gemma's query norm),
//! observed during the prefill; kvpress projects the mean hidden state through `W_q`,
//! which is the same for llama's bias-free projection. Protocol as for
//! [`crate::policy::presses::knorm`].
//!
//! ```toml
//! type = "expected_attention"
//! compression_ratio = 0.5
//! n_future_positions = 512   # defaults
//! n_sink = 4
//! use_covariance = true
//! use_vnorm = true
//! epsilon = 0.0
//! ```

use serde::{Deserialize, Serialize};

use crate::model::RopeStyle;
use crate::policy::evict::{Eviction, Observe, QueryMoments, Rows, TokenScorer};
use crate::policy::plan::Plan;
use crate::policy::presses::knorm::check_ratio;
use crate::policy::presses::{press_tokens, Press, Target};
use crate::{Error, Result};

/// The `expected_attention` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectedAttention {
    /// Share of each KV head's prompt positions dropped, in `(0, 1)`.
    pub compression_ratio: f64,
    /// Future positions whose RoPE rotations are averaged.
    #[serde(default = "default_future")]
    pub n_future_positions: usize,
    /// First positions kept and left out of the statistics.
    #[serde(default = "default_sink")]
    pub n_sink: usize,
    /// Include the covariance term.
    #[serde(default = "yes")]
    pub use_covariance: bool,
    /// Multiply by the value's norm.
    #[serde(default = "yes")]
    pub use_vnorm: bool,
    /// Added to the scores before the value norm.
    #[serde(default)]
    pub epsilon: f64,
}

fn default_future() -> usize {
    512
}

fn default_sink() -> usize {
    4
}

fn yes() -> bool {
    true
}

impl Press for ExpectedAttention {
    fn check(&self) -> Result<()> {
        check_ratio(self.compression_ratio)?;
        if self.n_future_positions == 0 {
            return Err(Error::invalid("n_future_positions", "0 (must be at least 1)"));
        }
        if !self.epsilon.is_finite() || self.epsilon < 0.0 {
            return Err(Error::invalid(
                "epsilon",
                format!("{} (must be finite and not negative)", self.epsilon),
            ));
        }
        Ok(())
    }

    fn apply(&self, plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        let scorer = Expected {
            future: self.n_future_positions,
            sink: self.n_sink,
            covariance: self.use_covariance,
            vnorm: self.use_vnorm,
            epsilon: self.epsilon,
        };
        press_tokens(plan, Eviction::new(self.compression_ratio, scorer));
        Ok(())
    }

    fn presses_tokens(&self) -> bool {
        true
    }
}

/// The expected attention of the next positions' queries.
#[derive(Debug)]
struct Expected {
    future: usize,
    sink: usize,
    covariance: bool,
    vnorm: bool,
    epsilon: f64,
}

/// The average over positions `from..from + count` of the RoPE rotations of a head of
/// width `d`: block-diagonal, pair `(x, y)` of frequency `theta` getting
/// `[[c, -s], [s, c]]` with `c`, `s` the mean cosine and sine of `p theta`.
/// Row-major `(d, d)`.
fn mean_rotation(m: &QueryMoments, from: usize, count: usize) -> Vec<f64> {
    let d = m.d_head;
    let mut r = vec![0.0; d * d];
    for i in 0..d / 2 {
        let theta = (m.layer.rope_base as f64).powf(-2.0 * i as f64 / d as f64);
        let (mut c, mut s) = (0.0, 0.0);
        for p in from..from + count {
            let (sin, cos) = (p as f64 * theta).sin_cos();
            c += cos;
            s += sin;
        }
        let (c, s) = (c / count as f64, s / count as f64);
        let (x, y) = match m.layer.rope_style {
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            RopeStyle::Halves => (i, i + d / 2),
        };
        r[x * d + x] = c;
        r[x * d + y] = -s;
        r[y * d + x] = s;
        r[y * d + y] = c;
    }
    r
}

/// `a b` for row-major `(d, d)` matrices.
fn matmul(a: &[f64], b: &[f64], d: usize) -> Vec<f64> {
    let mut out = vec![0.0; d * d];
    for i in 0..d {
        for k in 0..d {
            let aik = a[i * d + k];
            if aik != 0.0 {
                for j in 0..d {
                    out[i * d + j] += aik * b[k * d + j];
                }
            }
        }
    }
    out
}

impl TokenScorer for Expected {
    fn observes(&self) -> Observe {
        Observe::QueryMoments { skip: self.sink }
    }

    fn score(&self, rows: &Rows<'_>) -> Result<Vec<f32>> {
        let m = rows
            .moments
            .ok_or(Error::Internal("expected attention reads query moments"))?;
        let (n, d) = (rows.len(), rows.d_head);
        let sink = self.sink.min(n);
        let r = mean_rotation(m, n, self.future);
        let rt: Vec<f64> = (0..d * d).map(|ij| r[(ij % d) * d + ij / d]).collect();
        let mut mean_of_group = vec![0.0f64; n - sink];
        for head in rows.group.clone() {
            let mu = m.mean(head);
            let mu: Vec<f64> = (0..d)
                .map(|i| (0..d).map(|j| r[i * d + j] * mu[j]).sum())
                .collect();
            let cov = self
                .covariance
                .then(|| matmul(&r, &matmul(&m.covariance(head), &rt, d), d));
            let logits: Vec<f64> = rows.keys[sink * d..]
                .chunks_exact(d)
                .map(|k| {
                    let linear = mu.iter().zip(k).map(|(a, &b)| a * b as f64).sum::<f64>();
                    let quadratic = cov.as_ref().map_or(0.0, |c| {
                        (0..d)
                            .map(|i| {
                                let row = &c[i * d..(i + 1) * d];
                                k[i] as f64 * row.iter().zip(k).map(|(a, &b)| a * b as f64).sum::<f64>()
                            })
                            .sum()
                    });
                    linear / (d as f64).sqrt() + quadratic / (2.0 * d as f64)
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            for (acc, l) in mean_of_group.iter_mut().zip(&logits) {
                *acc += (l - max).exp() / z / rows.group.len() as f64;
            }
        }
        let mut scores: Vec<f32> = mean_of_group
            .iter()
            .enumerate()
            .map(|(j, &s)| {
                let row = sink + j;
                if !self.vnorm {
                    return s as f32;
                }
                let norm = rows.values[row * d..(row + 1) * d]
                    .iter()
                    .map(|&v| v as f64 * v as f64)
                    .sum::<f64>()
                    .sqrt();
                ((s + self.epsilon) * norm) as f32
            })
            .collect();
        let best = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut all = vec![best.max(f32::MIN); sink];
        all.append(&mut scores);
        Ok(all)
    }
}
