//! Causal prefill attention in blocks of queries over just the keys each block sees,
//! for a prefill whose probabilities nobody reads. Its softmax is compiled for the
//! build's target only.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::model::numerics::fast_exp;
use crate::Result;

/// Query rows per block of [`blocked`].
const BLOCK: usize = 256;

/// Causal attention for several queries without their probabilities: `(n_heads, q,
/// d_head)`. The queries go in blocks of [`BLOCK`] rows, each block against only the keys
/// one of its rows can see: up to its last query, and from its first query's window on
/// when `window` is given. Compared with [`batched`] this skips the masked upper triangle
/// (about half the products and exponentials of a long prefill) and the keys behind a
/// sliding window, and never holds the whole `(n_heads, q, kv_len)` score matrix.
///
/// `start` is the first query's position counted from the first stored key. `mask`,
/// when given, is the full additive mask `(n_heads, q, kv_len)` and must already hide
/// what causality and the window hide (as
/// [`Interventions::score_mask`](crate::model::Interventions) builds it); without it
/// the causal and window masks of each block are built here.
pub(crate) fn blocked(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start: usize,
    mask: Option<&Tensor>,
    window: Option<usize>,
) -> Result<Tensor> {
    let (nh, q_len, dh) = q.dims3()?;
    let (nkv, kv_len, _) = keys.dims3()?;
    let group = nh / nkv;
    let scale = 1.0 / (dh as f32).sqrt();
    let mut outs = Vec::with_capacity(q_len.div_ceil(BLOCK));
    for s in (0..q_len).step_by(BLOCK) {
        let n = BLOCK.min(q_len - s);
        // Keys lo..hi: the window of the block's first query to its last query.
        let hi = (start + s + n).min(kv_len);
        let lo = window
            .map_or(0, |w| (start + s + 1).saturating_sub(w))
            .min(hi);
        let width = hi - lo;
        let qb = q
            .narrow(1, s, n)?
            .contiguous()?
            .reshape((nkv, group * n, dh))?;
        let scores = qb.matmul(&keys.narrow(1, lo, width)?.t()?)?;
        let mut w: Vec<f32> = scores.flatten_all()?.to_vec1()?;
        let bias: Option<Vec<f32>> = mask
            .map(|m| {
                m.narrow(1, s, n)?
                    .narrow(2, lo, width)?
                    .flatten_all()?
                    .to_vec1()
            })
            .transpose()?;
        // Row r is query head r / n at query s + r % n; its visible keys are `seen`.
        w.par_chunks_mut(width.max(1))
            .enumerate()
            .for_each(|(r, row)| {
                let query = start + s + r % n;
                let first = window.map_or(0, |w| (query + 1).saturating_sub(w)).max(lo) - lo;
                let seen = first.min(width)..(query + 1 - lo).min(width);
                row[..seen.start].fill(0.0);
                row[seen.end..].fill(0.0);
                let at = seen.start;
                let row = &mut row[seen];
                let b = bias.as_ref().map(|b| &b[r * width + at..][..row.len()]);
                scaled_softmax(row, scale, b);
            });
        let probs = Tensor::from_vec(w, (nkv, group * n, width), &Device::Cpu)?;
        let out = probs
            .matmul(&values.narrow(1, lo, width)?)?
            .reshape((nh, n, dh))?;
        outs.push(out);
    }
    Ok(Tensor::cat(&outs, 1)?)
}

/// `softmax(row * scale + bias)` in place (all zeros when every entry is `-inf`).
#[inline(always)]
fn scaled_softmax(row: &mut [f32], scale: f32, bias: Option<&[f32]>) {
    row.iter_mut().for_each(|x| *x *= scale);
    if let Some(b) = bias {
        row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
    }
    let max = fast_exp::max(row);
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    let inv = 1.0 / fast_exp::exp_shifted(row, max);
    row.iter_mut().for_each(|x| *x *= inv);
}
