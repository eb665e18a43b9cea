//! Two implementations of `softmax(q k^T / sqrt(d) + mask) v` with GQA, chosen by
//! [`Numerics`](crate::model::Numerics):
//!
//! * [`batched`]: candle matrix products and a softmax over the whole score matrix:
//!   fast for prefill, and it yields the attention probabilities as a by-product;
//! * [`single_query`]: one decode step in plain loops over the KV cache, one parallel
//!   task per head, 16-lane dot products: a matrix product with one row spends most of
//!   its time packing operands;
//! * [`streaming`]: a one-pass online softmax (Milakov and Gimelshein 2018, as in
//!   FlashAttention) that visits key positions in order, one query row at a time, and
//!   for a single query splits the keys into tiles of 16 merged left to right. This is the
//!   arithmetic order of mistral.rs's CPU attention, so with the same quantized matmuls
//!   the two engines compute the same floats. With activations quantized to 8 bits before
//!   every matmul, any last-bit difference in attention would otherwise cascade through
//!   rounding flips into logit differences of ~0.1 (measured), which is why parity needs
//!   the same order and not merely the same function.
//!
//! Shapes: queries `(n_heads, q, d_head)` contiguous; keys and values
//! `(n_kv_heads, kv_len, d_head)` (views into the KV cache, last dim contiguous); mask
//! `(n_heads, q, kv_len)` or, when `None`, causal for queries at `start..start + q`.
//! Output `(n_heads, q, d_head)`.

use candle_core::{Device, Storage, Tensor};
use rayon::prelude::*;

use crate::{Error, Result};

/// Keys per tile in the single-query path.
const TILE: usize = 16;

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

/// Lanes of the vectorised dot product.
const LANES: usize = 16;

/// Dot product with `LANES` independent accumulators (the compiler maps them to SIMD).
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    // Pairwise halving: four vector adds instead of a chain of sixteen scalar ones.
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

/// Dot product of two rows: AVX-512 when the CPU has it and the width is a multiple of
/// 16, else [`dot_lanes`].
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if a.len().is_multiple_of(LANES) && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was detected; lengths are equal multiples of 16.
        return unsafe { dot_avx512(a, b) };
    }
    dot_lanes(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm512_setzero_ps();
    for i in (0..a.len().min(b.len())).step_by(LANES) {
        acc = _mm512_fmadd_ps(
            _mm512_loadu_ps(a.as_ptr().add(i)),
            _mm512_loadu_ps(b.as_ptr().add(i)),
            acc,
        );
    }
    _mm512_reduce_add_ps(acc)
}

/// Attention of one query position per head (a decode step); returns `(output,
/// probabilities)`: `(n_heads, 1, d_head)` and `(n_heads, 1, kv_len)`.
pub(crate) fn single_query(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let Shapes {
        nh,
        dh,
        kv_len,
        group,
        scale,
        ..
    } = Shapes::of(q, keys)?;
    let q = q.contiguous()?;
    let mask = mask_values(mask)?;
    let mut probs = vec![0f32; nh * kv_len];
    let mut out = vec![0f32; nh * dh];
    with_data(&q, |qd, _| {
        with_data(keys, |kd, ks| {
            with_data(values, |vd, vs| {
                // One task per query head (nine tasks balance two cores better than three).
                probs
                    .par_chunks_mut(kv_len)
                    .zip(out.par_chunks_mut(dh))
                    .enumerate()
                    .for_each(|(h, (row, out))| {
                        let kvh = h / group;
                        let q = &qd[h * dh..(h + 1) * dh];
                        for (j, p) in row.iter_mut().enumerate() {
                            *p = dot(q, &kd[kvh * ks[0] + j * ks[1]..][..dh]) * scale;
                        }
                        if let Some(m) = &mask {
                            let bias = &m[h * kv_len..(h + 1) * kv_len];
                            row.iter_mut().zip(bias).for_each(|(p, b)| *p += b);
                        }
                        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let mut sum = 0f32;
                        for p in row.iter_mut() {
                            *p = (*p - max).exp();
                            sum += *p;
                        }
                        let inv = 1.0 / sum;
                        for (j, p) in row.iter_mut().enumerate() {
                            *p *= inv;
                            if *p == 0.0 {
                                continue;
                            }
                            let v = &vd[kvh * vs[0] + j * vs[1]..][..dh];
                            for (o, x) in out.iter_mut().zip(v) {
                                *o += *p * x;
                            }
                        }
                    });
                Ok(())
            })
        })
    })?;
    Ok((
        Tensor::from_vec(out, (nh, 1, dh), &Device::Cpu)?,
        Tensor::from_vec(probs, (nh, 1, kv_len), &Device::Cpu)?,
    ))
}

/// Sizes shared by the loop kernels.
struct Shapes {
    nh: usize,
    q_len: usize,
    dh: usize,
    kv_len: usize,
    /// Query heads per KV head.
    group: usize,
    /// `1 / sqrt(d_head)`.
    scale: f32,
}

impl Shapes {
    fn of(q: &Tensor, keys: &Tensor) -> Result<Self> {
        let (nh, q_len, dh) = q.dims3()?;
        let (nkv, kv_len, _) = keys.dims3()?;
        Ok(Self {
            nh,
            q_len,
            dh,
            kv_len,
            group: nh / nkv,
            scale: 1.0 / (dh as f32).sqrt(),
        })
    }
}

/// The additive mask `(n_heads, q, kv_len)` as a flat vector, if any.
fn mask_values(mask: Option<&Tensor>) -> Result<Option<Vec<f32>>> {
    Ok(mask.map(|m| m.flatten_all()?.to_vec1()).transpose()?)
}

/// Borrow the f32 data of a CPU tensor with its strides and start offset.
fn with_data<R>(t: &Tensor, f: impl FnOnce(&[f32], &[usize]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(Error::invalid(
            "device",
            "streaming attention runs on the CPU",
        ));
    };
    let data = cpu.as_slice::<f32>()?;
    f(&data[layout.start_offset()..], layout.stride())
}

/// Dot product summed in groups of four, left to right.
fn dot4(a: &[f32], b: &[f32]) -> f32 {
    let mut sum = 0f32;
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        sum += x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
    }
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

/// Running state of an online softmax: max `m`, normaliser `s`, weighted values `acc`.
struct Online {
    m: f32,
    s: f32,
    acc: Vec<f32>,
}

impl Online {
    fn new(d: usize) -> Self {
        Self {
            m: f32::NEG_INFINITY,
            s: 0.0,
            acc: vec![0.0; d],
        }
    }

    /// Fold in one key with score `score` and value row `v`.
    fn push(&mut self, score: f32, v: &[f32]) {
        let (mut rescale, mut weight) = (1.0f32, 1.0f32);
        if score > self.m {
            rescale = (self.m - score).exp();
            self.m = score;
            for a in self.acc.iter_mut() {
                *a *= rescale;
            }
        } else {
            weight = (score - self.m).exp();
        }
        for (a, x) in self.acc.iter_mut().zip(v) {
            *a += x * weight;
        }
        self.s = self.s * rescale + weight;
    }

    /// Merge the state of the keys that follow (`other`) into this one.
    fn merge(&mut self, other: &Online) {
        if other.s == 0.0 {
            return; // every key of `other` was masked
        }
        if self.s == 0.0 {
            self.m = other.m;
            self.s = other.s;
            self.acc.copy_from_slice(&other.acc);
            return;
        }
        if self.m >= other.m {
            let f = (other.m - self.m).exp();
            for (a, b) in self.acc.iter_mut().zip(&other.acc) {
                *a += b * f;
            }
            self.s += other.s * f;
        } else {
            let f = (self.m - other.m).exp();
            for (a, b) in self.acc.iter_mut().zip(&other.acc) {
                *a = b + *a * f;
            }
            self.s = other.s + self.s * f;
            self.m = other.m;
        }
    }

    fn write(&self, out: &mut [f32]) {
        let inv = 1.0 / self.s;
        for (o, a) in out.iter_mut().zip(&self.acc) {
            *o = a * inv;
        }
    }
}

/// Attention by online softmax in mistral.rs's arithmetic order (see the module docs).
pub(crate) fn streaming(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let Shapes {
        nh,
        q_len,
        dh,
        kv_len,
        group,
        scale,
    } = Shapes::of(q, keys)?;
    let q = q.contiguous()?;
    let mask = mask_values(mask)?;
    let mut out = vec![0f32; nh * q_len * dh];
    with_data(&q, |qd, _| {
        with_data(keys, |kd, ks| {
            with_data(values, |vd, vs| {
                let row = |st: &[usize], kvh: usize, pos: usize| {
                    let b = kvh * st[0] + pos * st[1];
                    b..b + dh
                };
                for h in 0..nh {
                    let kvh = h / group;
                    for t in 0..q_len {
                        let qrow = &qd[(h * q_len + t) * dh..(h * q_len + t + 1) * dh];
                        let bias = |j: usize| -> f32 {
                            match &mask {
                                Some(m) => m[(h * q_len + t) * kv_len + j],
                                None if j > start + t => f32::NEG_INFINITY,
                                None => 0.0,
                            }
                        };
                        let visit = |st: &mut Online, j: usize| {
                            let b = bias(j);
                            if b == f32::NEG_INFINITY {
                                return;
                            }
                            let score = dot4(qrow, &kd[row(ks, kvh, j)]) * scale + b;
                            st.push(score, &vd[row(vs, kvh, j)]);
                        };
                        let slot = &mut out[(h * q_len + t) * dh..(h * q_len + t + 1) * dh];
                        if q_len == 1 {
                            let mut total: Option<Online> = None;
                            for tile in (0..kv_len).step_by(TILE) {
                                let mut st = Online::new(dh);
                                for j in tile..(tile + TILE).min(kv_len) {
                                    visit(&mut st, j);
                                }
                                match total.as_mut() {
                                    None => total = Some(st),
                                    Some(acc) => acc.merge(&st),
                                }
                            }
                            if let Some(st) = total {
                                st.write(slot);
                            }
                        } else {
                            let mut st = Online::new(dh);
                            for j in 0..kv_len {
                                visit(&mut st, j);
                            }
                            st.write(slot);
                        }
                    }
                }
                Ok(())
            })
        })
    })?;
    Ok(Tensor::from_vec(out, (nh, q_len, dh), &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_kernels_agree_with_a_plain_sum() {
        for n in [8, 16, 64, 80] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-4, "n {n}");
            assert!((dot_lanes(&a, &b) as f64 - want).abs() < 1e-4, "n {n}");
        }
    }

    #[test]
    fn single_query_matches_batched_attention() {
        let q = Tensor::randn(0f32, 1.0, (6, 1, 64), &Device::Cpu).unwrap();
        let k = Tensor::randn(0f32, 1.0, (2, 37, 64), &Device::Cpu).unwrap();
        let v = Tensor::randn(0f32, 1.0, (2, 37, 64), &Device::Cpu).unwrap();
        let (o1, p1) = single_query(&q, &k, &v, None).unwrap();
        let (o2, p2) = batched(&q, &k, &v, None, None).unwrap();
        let d = |a: &Tensor, b: &Tensor| {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert!(d(&o1, &o2) < 1e-5 && d(&p1, &p2) < 1e-6);
    }
}
