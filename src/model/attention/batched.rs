//! Attention through candle matrix products and a softmax over the whole score matrix:
//! fast for prefill, and it yields the attention probabilities as a by-product.

use candle_core::Tensor;

use crate::Result;

/// Attention through candle matmuls; returns `(output, probabilities)`, the latter
/// `(n_heads, q, kv_len)`.
pub(crate) fn batched(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: Option<&Tensor>,
    causal: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (nh, q_len, dh) = q.dims3()?;
    let (nkv, kv_len, _) = keys.dims3()?;
    let group = nh / nkv;
    // (n_kv, group * q, d_head): the query heads of one KV head are consecutive.
    let qg = q.reshape((nkv, group * q_len, dh))?;
    let scale = 1.0 / (dh as f64).sqrt();
    let scores = (qg.matmul(&keys.t()?)? * scale)?.reshape((nh, q_len, kv_len))?;
    let scores = match (mask, causal) {
        (Some(m), _) => (scores + m)?,
        (None, Some(c)) => scores.broadcast_add(c)?,
        (None, None) => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    let out = probs
        .reshape((nkv, group * q_len, kv_len))?
        .matmul(values)?
        .reshape((nh, q_len, dh))?;
    Ok((out, probs))
}
