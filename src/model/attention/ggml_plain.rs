//! llama.cpp's plain attention over an f32 cache in ggml's arithmetic order.

use candle_core::Tensor;
use rayon::prelude::*;

use super::rows::{per_row, Kv, Shapes};
use crate::model::numerics::ggml;
use crate::Result;

/// Attention as llama.cpp computes it without flash attention over an f32 KV cache
/// (`-fa off -ctk f32 -ctv f32`; rows stored in another format are read decoded) on
/// ggml's `simd` path: per query row, scores
/// [`ggml::Simd::dot`]`(q, k)` scaled by `1 / sqrt(d_head)` plus the mask,
/// [`ggml::Simd::softmax_in_place`], and each output dimension `sum_j p_j v_j` by
/// [`ggml::Simd::weighted_rows`]. (ggml scales `q` before the
/// product; for a power-of-two scale, as in both models here, that is the same float.)
/// Keys line up with ggml's lanes by absolute position (`key_start` is key 0's), as
/// llama.cpp's cache cells do until it evicts. `start` is the first query's offset from
/// key 0. Parallel over (head, query) rows.
pub(crate) fn ggml_plain(
    q: &Tensor,
    kv: &Kv,
    start: usize,
    key_start: usize,
    mask: Option<&Tensor>,
    simd: ggml::Simd,
) -> Result<Tensor> {
    per_row(q, kv, start, mask, |rows, out| {
        let Shapes {
            q_len, dh, kv_len, ..
        } = *rows.shapes;
        out.par_chunks_mut(dh).enumerate().for_each(|(i, slot)| {
            let (kvh, qrow, scale) = (rows.kv_head(i), rows.query(i), rows.shapes.scale);
            let mut p: Vec<f32> = (0..kv_len)
                .map(|j| match rows.bias(i, j) {
                    f32::NEG_INFINITY => f32::NEG_INFINITY,
                    b => simd.dot(qrow, rows.key(kvh, j)) * scale + b,
                })
                .collect();
            simd.softmax_in_place(&mut p, key_start);
            simd.weighted_rows(&p, key_start, q_len, |j| rows.value(kvh, j), slot);
        });
    })
}
