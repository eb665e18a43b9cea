//! LOCOS logit-contribution scoring (Gema, Alex, Minervini 2026, "Logit-Contribution
//! Scoring Identifies Non-Literal Retrieval Heads"): what a head writes toward the
//! answer token, position by position, contrasted between the needle and the rest.
//!
//! For a step that produces answer token `y`, head `h` of layer `l` contributes
//! `phi_j = alpha_j * (v_j . w_h)` from position `j`, with `w_h = W_O[l, h]^T u_y`.
//! `u_y` is the unembedding row of `y` multiplied element-wise by the final RMSNorm
//! weight: the static part of direct logit attribution. The per-step `1 / rms` of the
//! final norm is not folded in: it scales every head of a step alike, and leaving it
//! out keeps steps comparable in the mean. The step score is
//! `sum_{j in needle} phi_j - (e - s) / (N - (e - s)) * sum_{j not in needle} phi_j`,
//! `N` being the positions the step attends over.

use std::ops::Range;

use candle_core::{Tensor, D};

use crate::{Error, Result};

/// `w_h = W_O[:, h]^T u` for every head of a layer: `w_o` `(d_model, n_heads * d_head)`,
/// `u` `(d_model,)` -> `(n_heads, d_head)`.
pub fn head_directions(w_o: &Tensor, u: &Tensor, n_heads: usize) -> Result<Tensor> {
    let (_, width) = w_o.dims2()?;
    let w = u.unsqueeze(0)?.matmul(w_o)?;
    Ok(w.reshape((n_heads, width / n_heads))?)
}

/// The step score of every head of one layer.
///
/// `probs`: `(n_heads, 1, kv_len)`; `values`: `(n_kv_heads, kv_len, d_head)`;
/// `directions`: `(n_heads, d_head)` from [`head_directions`]; query head `h` reads KV
/// head `h / (n_heads / n_kv_heads)`.
pub fn step_scores(
    probs: &Tensor,
    values: &Tensor,
    directions: &Tensor,
    needle: &Range<usize>,
) -> Result<Vec<f64>> {
    let (nh, _, kv_len) = probs.dims3()?;
    let (nkv, vlen, dh) = values.dims3()?;
    if vlen != kv_len || needle.end > kv_len || needle.is_empty() || needle.len() >= kv_len {
        return Err(Error::invalid(
            "locos",
            format!("needle {needle:?} over {kv_len} positions ({vlen} values)"),
        ));
    }
    let group = nh / nkv;
    // (n_kv, kv_len, d_head) x (n_kv, d_head, group) -> (n_kv, kv_len, group)
    let w = directions.reshape((nkv, group, dh))?.transpose(1, 2)?;
    let proj = values.contiguous()?.matmul(&w.contiguous()?)?;
    let proj = proj.transpose(1, 2)?.reshape((nh, kv_len))?;
    let phi = (probs.squeeze(1)? * proj)?;
    let inside = phi
        .narrow(D::Minus1, needle.start, needle.len())?
        .sum(D::Minus1)?;
    let total = phi.sum(D::Minus1)?;
    let inside: Vec<f32> = inside.to_vec1()?;
    let total: Vec<f32> = total.to_vec1()?;
    let k = needle.len() as f64 / (kv_len - needle.len()) as f64;
    Ok(inside
        .iter()
        .zip(&total)
        .map(|(&i, &t)| i as f64 - k * (t as f64 - i as f64))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn uniform_contributions_contrast_to_zero() {
        // 2 heads over 1 KV head, 10 positions, uniform attention, identical values:
        // every position contributes the same, so needle and rescaled rest cancel
        let probs = Tensor::full(0.1f32, (2, 1, 10), &Device::Cpu).unwrap();
        let values = Tensor::ones((1, 10, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let dirs = Tensor::new(
            &[[1f32, 2.0, 0.0, -1.0], [0.5, 0.5, 0.5, 0.5]],
            &Device::Cpu,
        )
        .unwrap();
        for needle in [0..1, 3..7, 9..10] {
            let s = step_scores(&probs, &values, &dirs, &needle).unwrap();
            assert!(s.iter().all(|x| x.abs() < 1e-6), "{needle:?}: {s:?}");
        }
    }

    #[test]
    fn a_needle_only_contribution_scores_its_full_value() {
        let mut p = vec![0f32; 5];
        p[2] = 1.0;
        let probs = Tensor::from_vec(p, (1, 1, 5), &Device::Cpu).unwrap();
        let values = Tensor::arange(0f32, 10.0, &Device::Cpu)
            .unwrap()
            .reshape((1, 5, 2))
            .unwrap();
        let dirs = Tensor::new(&[[1f32, 1.0]], &Device::Cpu).unwrap();
        // position 2 holds values (4, 5): phi = 9 inside the needle, nothing outside
        let s = step_scores(&probs, &values, &dirs, &(2..3)).unwrap();
        assert!((s[0] - 9.0).abs() < 1e-6);
        assert!(step_scores(&probs, &values, &dirs, &(0..5)).is_err());
    }
}
