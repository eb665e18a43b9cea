//! Causal prefill attention in blocks of queries over just the keys each block sees,
//! for a prefill whose probabilities nobody reads. Its softmax is compiled for the
//! build's target only.

use std::cell::RefCell;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::model::numerics::fast_exp;
use crate::model::numerics::kernels::matrix::gemm_f32;
use crate::Result;

/// Query rows per task of [`blocked`]: one head's scores for a block, `(BLOCK, keys)`
/// f32, stay within a core's L2 cache (1 MiB at 4,096 keys) between the product that
/// writes them, the softmax and the product that reads them.
const BLOCK: usize = 64;

/// Causal attention for several queries without their probabilities: `(n_heads, q,
/// d_head)`. Each task takes one query head and a block of [`BLOCK`] queries against only
/// the keys one of its rows can see (up to its last query, and from its first query's
/// window on when `window` is given): scores by `gemm` into a per-thread buffer, the
/// softmax of each row over its visible keys in place, then the value sums by `gemm`.
/// Compared with [`batched`](super::batched) this skips the masked upper triangle (about
/// half the products and exponentials of a long prefill) and the keys behind a sliding
/// window, and never holds more than one block's scores per thread.
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
    let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1()?) };
    let (qs, ks, vs) = (flat(q)?, flat(keys)?, flat(values)?);
    let mut out = vec![0f32; nh * q_len * dh];
    out.par_chunks_mut(q_len * dh)
        .enumerate()
        .try_for_each(|(h, head)| {
            head.par_chunks_mut(BLOCK * dh)
                .enumerate()
                .try_for_each(|(b, ob)| {
                    let s = b * BLOCK;
                    let n = ob.len() / dh;
                    // Keys lo..hi: the window of the block's first query to its last query.
                    let hi = (start + s + n).min(kv_len);
                    let lo = window
                        .map_or(0, |w| (start + s + 1).saturating_sub(w))
                        .min(hi);
                    let width = hi - lo;
                    let bias = mask
                        .map(|m| flat(&m.narrow(0, h, 1)?.narrow(1, s, n)?.narrow(2, lo, width)?))
                        .transpose()?;
                    let kv = (h / group) * kv_len + lo;
                    let (kb, vb) = (
                        &ks[kv * dh..(kv + width) * dh],
                        &vs[kv * dh..(kv + width) * dh],
                    );
                    let qb = &qs[(h * q_len + s) * dh..(h * q_len + s + n) * dh];
                    SCORES.with_borrow_mut(|w| {
                        w.resize(n * width, 0.0);
                        // SAFETY: `w` is `(n, width)` row-major; `qb` is `(n, dh)` row-major;
                        // `kb` is `(width, dh)` row-major, read as the `(dh, width)` right
                        // operand (element (k, j) at `j * dh + k`). Every index stays inside
                        // its slice.
                        unsafe {
                            gemm_f32(
                                n,
                                width,
                                dh,
                                w.as_mut_ptr(),
                                width,
                                qb.as_ptr(),
                                dh,
                                kb.as_ptr(),
                                (dh, 1),
                            );
                        }
                        for (r, row) in w.chunks_exact_mut(width).enumerate() {
                            let query = start + s + r;
                            let first =
                                window.map_or(0, |w| (query + 1).saturating_sub(w)).max(lo) - lo;
                            let seen = first.min(width)..(query + 1 - lo).min(width);
                            row[..seen.start].fill(0.0);
                            row[seen.end..].fill(0.0);
                            let at = seen.start;
                            let row = &mut row[seen];
                            let b = bias.as_ref().map(|b| &b[r * width + at..][..row.len()]);
                            scaled_softmax(row, scale, b);
                        }
                        // SAFETY: `ob` is `(n, dh)` row-major, `w` `(n, width)` row-major, and
                        // `vb` `(width, dh)` row-major (element (j, d) at `j * dh + d`).
                        unsafe {
                            gemm_f32(
                                n,
                                dh,
                                width,
                                ob.as_mut_ptr(),
                                dh,
                                w.as_ptr(),
                                width,
                                vb.as_ptr(),
                                (1, dh),
                            );
                        }
                    });
                    Ok::<(), crate::Error>(())
                })
        })?;
    Ok(Tensor::from_vec(out, (nh, q_len, dh), &Device::Cpu)?)
}

thread_local! {
    /// One block's scores, reused across tasks on this thread.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
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
