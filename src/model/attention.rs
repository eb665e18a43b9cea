//! Five implementations of `softmax(q k^T / sqrt(d) + mask) v` with GQA, chosen by
//! [`Numerics`](crate::model::Numerics):
//!
//! * [`batched`]: candle matrix products and a softmax over the whole score matrix:
//!   fast for prefill, and it yields the attention probabilities as a by-product;
//! * [`blocked`]: the same products per block of queries over just the keys the block
//!   sees, for a prefill whose probabilities nobody reads;
//! * [`single_query`]: one decode step in plain loops over the KV cache, parallel over
//!   KV heads and parts of the keys, 16-lane dot products and a vectorised `exp`: a
//!   matrix product with one row spends most of its time packing operands. Its loops
//!   are compiled for AVX2 and AVX-512 besides the build's own target and chosen at run
//!   time ([`Isa`]), with the same floats on each; the prefill softmax of [`blocked`]
//!   is compiled for the build's target only;
//! * [`streaming`]: a one-pass online softmax (Milakov and Gimelshein 2018, as in
//!   FlashAttention) that visits key positions in order, one query row at a time, and
//!   for a single query splits the keys into tiles of 16 merged left to right. This is the
//!   arithmetic order of mistral.rs's CPU attention, so with the same quantized matmuls
//!   the two engines compute the same floats. With activations quantized to 8 bits before
//!   every matmul, any last-bit difference in attention would otherwise cascade through
//!   rounding flips into logit differences of ~0.1 (measured), which is why parity needs
//!   the same order and not merely the same function.
//! * [`ggml_plain`]: llama.cpp's plain attention over an f32 cache in ggml's arithmetic
//!   order (scores, softmax and value sums of [`crate::model::ggml`]), for parity with
//!   llama.cpp.
//!
//! Shapes: queries `(n_heads, q, d_head)` contiguous; keys and values
//! `(n_kv_heads, kv_len, d_head)` (views into the KV cache, last dim contiguous); mask
//! `(n_heads, q, kv_len)` or, when `None`, causal for queries at `start..start + q`.
//! Output `(n_heads, q, d_head)`.

use candle_core::{Device, Storage, Tensor};
use rayon::prelude::*;

use crate::model::kernels::Isa;
use crate::model::{fast_exp, ggml};
use crate::{Error, Result};

/// Run `f`, a closure over `#[inline(always)]` functions of plain loops, compiled for the
/// widest vectors `isa` allows (the portable build target if the CPU lacks it): the loops
/// are the same, so the floats are too (no reassociation, no fused multiply-add), only
/// the vector width differs.
#[inline(always)]
fn on_isa(isa: Isa, f: impl FnOnce()) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn wide(f: impl FnOnce()) {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn narrow(f: impl FnOnce()) {
            f()
        }
        match isa {
            // SAFETY (both): `supported` checked that the CPU runs the set.
            Isa::Avx512Vnni if isa.supported() => unsafe { wide(f) },
            Isa::Avx2 | Isa::AvxVnni if isa.supported() => unsafe { narrow(f) },
            _ => f(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        f()
    }
}

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

/// Lanes of the vectorised dot product.
const LANES: usize = 16;

/// Dot product with `LANES` independent accumulators (the compiler maps them to SIMD).
#[inline(always)]
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

/// Fewest keys in one part of the single-query path: below this, splitting the keys
/// costs more than it balances.
const MIN_PART: usize = 64;

/// One KV head's stored rows for a decode step: `len` key rows and `len` value rows of
/// `d_head` floats each, row-major.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvRows<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub len: usize,
}

/// Attention of one query position per head (a decode step): `(n_heads, 1, d_head)` and,
/// when `want_probs`, the probabilities `(n_heads, 1, kv_len)`. A tensor front end to
/// [`decode_rows`].
pub(crate) fn single_query(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: Option<&Tensor>,
    want_probs: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let Shapes {
        nh,
        dh,
        kv_len,
        group,
        ..
    } = Shapes::of(q, keys)?;
    let nkv = nh / group;
    let q = q.contiguous()?;
    let mask = mask_values(mask)?;
    let masks: Vec<Option<&[f32]>> = (0..nh)
        .map(|h| mask.as_ref().map(|m| &m[h * kv_len..(h + 1) * kv_len]))
        .collect();
    let (out, probs) = with_data(&q, |qd, _| {
        with_data(keys, |kd, ks| {
            with_data(values, |vd, vs| {
                if ks[1..] != [dh, 1] || vs[1..] != [dh, 1] {
                    return Err(Error::invalid("attention", "key rows must be contiguous"));
                }
                let heads: Vec<KvRows> = (0..nkv)
                    .map(|h| KvRows {
                        keys: &kd[h * ks[0]..][..kv_len * dh],
                        values: &vd[h * vs[0]..][..kv_len * dh],
                        len: kv_len,
                    })
                    .collect();
                Ok(decode_rows(&qd[..nh * dh], dh, &heads, &masks, want_probs))
            })
        })
    })?;
    let out = Tensor::from_vec(out, (nh, 1, dh), &Device::Cpu)?;
    let probs = probs
        .map(|p| Tensor::from_vec(p.concat(), (nh, 1, kv_len), &Device::Cpu))
        .transpose()?;
    Ok((out, probs))
}

/// The work of one parallel task of [`decode_rows`]: a KV head and a part of its keys.
struct Task {
    kv_head: usize,
    keys: std::ops::Range<usize>,
    /// `group` rows of `keys.len()` weights.
    weights: Vec<f32>,
    /// Per query head of the group.
    stats: Vec<Part>,
    /// `group` rows of `d_head` weighted value sums.
    accs: Vec<f32>,
}

/// [`decode_rows_on`] with the instruction set in force.
pub(crate) fn decode_rows(
    q: &[f32],
    dh: usize,
    heads: &[KvRows],
    masks: &[Option<&[f32]>],
    want_probs: bool,
) -> (Vec<f32>, Option<Vec<Vec<f32>>>) {
    decode_rows_on(Isa::active(), q, dh, heads, masks, want_probs)
}

/// Attention of one query position per head over per-KV-head rows that may differ in
/// length: queries `q` `(n_heads * d_head)`, query head `h` reading `heads[h / group]`;
/// `masks[h]`, when given, is an additive bias over that KV head's rows. Returns the
/// output `(n_heads * d_head)` and, when `want_probs`, each head's probabilities over its
/// rows.
///
/// Each parallel task takes one KV head and a contiguous part of its keys, and serves all
/// query heads of the group from it, so every key and value row is read from memory once
/// per step, not once per query head. A task leaves, per query head, the unnormalised
/// weights `exp(s - m_part)`, their maximum `m_part` and sum, and `sum_j w_j v_j`; the
/// parts are then merged with the usual rescaling by `exp(m_part - m)`.
fn decode_rows_on(
    isa: Isa,
    q: &[f32],
    dh: usize,
    heads: &[KvRows],
    masks: &[Option<&[f32]>],
    want_probs: bool,
) -> (Vec<f32>, Option<Vec<Vec<f32>>>) {
    let nkv = heads.len();
    let nh = q.len() / dh;
    let group = nh / nkv;
    let scale = 1.0 / (dh as f32).sqrt();
    // Enough tasks for two per thread, in parts of at least MIN_PART keys.
    let mut tasks = Vec::new();
    for (kv_head, rows) in heads.iter().enumerate() {
        let parts = (2 * rayon::current_num_threads())
            .div_ceil(nkv)
            .min(rows.len.div_ceil(MIN_PART))
            .max(1);
        let span = rows.len.div_ceil(parts);
        for part in 0..parts {
            let keys = (part * span).min(rows.len)..((part + 1) * span).min(rows.len);
            tasks.push(Task {
                kv_head,
                weights: vec![0f32; group * keys.len()],
                keys,
                stats: vec![Part::default(); group],
                accs: vec![0f32; group * dh],
            });
        }
    }
    let step = Step {
        q,
        dh,
        group,
        scale,
        heads,
        masks,
    };
    tasks
        .par_iter_mut()
        .for_each(|task| on_isa(isa, || run_task(task, &step)));
    // Merge the parts of each query head (tasks of one KV head are consecutive).
    let mut out = vec![0f32; nh * dh];
    let mut probs = want_probs.then(|| {
        (0..nh)
            .map(|h| vec![0f32; heads[h / group].len])
            .collect::<Vec<_>>()
    });
    let mut first = 0;
    for kv_head in 0..nkv {
        let end = first
            + tasks[first..]
                .iter()
                .take_while(|t| t.kv_head == kv_head)
                .count();
        let parts = &tasks[first..end];
        for g in 0..group {
            let h = kv_head * group + g;
            let max = parts
                .iter()
                .map(|t| t.stats[g].max)
                .fold(f32::NEG_INFINITY, f32::max);
            let factors: Vec<f32> = parts
                .iter()
                .map(|t| {
                    if t.stats[g].sum > 0.0 {
                        (t.stats[g].max - max).exp()
                    } else {
                        0.0
                    }
                })
                .collect();
            let total: f32 = parts
                .iter()
                .zip(&factors)
                .fold(0f32, |acc, (t, f)| acc + t.stats[g].sum * f);
            let o = &mut out[h * dh..(h + 1) * dh];
            for (t, f) in parts.iter().zip(&factors) {
                let acc = &t.accs[g * dh..(g + 1) * dh];
                o.iter_mut().zip(acc).for_each(|(o, a)| *o += a * f / total);
            }
            if let Some(probs) = &mut probs {
                for (t, f) in parts.iter().zip(&factors) {
                    let n = t.keys.len();
                    let w = &t.weights[g * n..(g + 1) * n];
                    let dst = &mut probs[h][t.keys.clone()];
                    dst.iter_mut().zip(w).for_each(|(d, w)| *d = w * f / total);
                }
            }
        }
        first = end;
    }
    (out, probs)
}

/// What every task of one [`decode_rows`] call reads.
struct Step<'a> {
    q: &'a [f32],
    dh: usize,
    group: usize,
    scale: f32,
    heads: &'a [KvRows<'a>],
    masks: &'a [Option<&'a [f32]>],
}

/// One task of [`decode_rows`]: scores, softmax statistics and weighted value sums of
/// its part of the keys for every query head of its KV head.
#[inline(always)]
fn run_task(task: &mut Task, step: &Step) {
    let Step {
        q,
        dh,
        group,
        scale,
        heads,
        masks,
    } = *step;
    let rows = &heads[task.kv_head];
    let n = task.keys.len();
    let w = &mut task.weights;
    for (i, j) in task.keys.clone().enumerate() {
        let k = &rows.keys[j * dh..][..dh];
        for g in 0..group {
            let h = task.kv_head * group + g;
            w[g * n + i] = dot_lanes(&q[h * dh..(h + 1) * dh], k) * scale;
        }
    }
    for (g, st) in task.stats.iter_mut().enumerate() {
        let row = &mut w[g * n..(g + 1) * n];
        if let Some(m) = masks[task.kv_head * group + g] {
            let bias = &m[task.keys.clone()];
            row.iter_mut().zip(bias).for_each(|(p, b)| *p += b);
        }
        st.max = fast_exp::max(row);
        st.sum = if st.max == f32::NEG_INFINITY {
            row.fill(0.0);
            0.0
        } else {
            fast_exp::exp_shifted(row, st.max)
        };
    }
    for (i, j) in task.keys.clone().enumerate() {
        let v = &rows.values[j * dh..][..dh];
        for (g, acc) in task.accs.chunks_exact_mut(dh).enumerate() {
            let p = w[g * n + i];
            if p != 0.0 {
                acc.iter_mut().zip(v).for_each(|(a, x)| *a += p * x);
            }
        }
    }
}

/// One query head's softmax statistics over one part of the keys.
#[derive(Debug, Clone, Copy)]
struct Part {
    /// Largest score (`-inf` when every key of the part is masked).
    max: f32,
    /// `sum_j exp(s_j - max)`.
    sum: f32,
}

impl Default for Part {
    fn default() -> Self {
        Self {
            max: f32::NEG_INFINITY,
            sum: 0.0,
        }
    }
}

/// Sizes shared by the loop kernels.
#[derive(Debug, Clone, Copy)]
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

/// One attention call's operands borrowed as rows, for the per-row kernels.
struct Rows<'a> {
    shapes: &'a Shapes,
    q: &'a [f32],
    k: (&'a [f32], &'a [usize]),
    v: (&'a [f32], &'a [usize]),
    mask: Option<&'a [f32]>,
    /// The first query's offset from key 0 (for the causal rule without a mask).
    start: usize,
}

impl Rows<'_> {
    /// Query row `i = head * q_len + t`.
    fn query(&self, i: usize) -> &[f32] {
        let dh = self.shapes.dh;
        &self.q[i * dh..(i + 1) * dh]
    }

    fn at<'b>(&self, (data, st): (&'b [f32], &[usize]), kvh: usize, j: usize) -> &'b [f32] {
        let b = kvh * st[0] + j * st[1];
        &data[b..b + self.shapes.dh]
    }

    /// The KV head that query row `i = head * q_len + t` reads.
    fn kv_head(&self, i: usize) -> usize {
        i / self.shapes.q_len / self.shapes.group
    }

    /// Key `j` of KV head `kvh`.
    fn key(&self, kvh: usize, j: usize) -> &[f32] {
        self.at(self.k, kvh, j)
    }

    /// Value `j` of KV head `kvh`.
    fn value(&self, kvh: usize, j: usize) -> &[f32] {
        self.at(self.v, kvh, j)
    }

    /// Additive bias of key `j` for query row `i`: the mask's, or causal.
    fn bias(&self, i: usize, j: usize) -> f32 {
        match self.mask {
            Some(m) => m[i * self.shapes.kv_len + j],
            None if j > self.start + i % self.shapes.q_len => f32::NEG_INFINITY,
            None => 0.0,
        }
    }
}

/// Run `kernel(rows, out)` over `q`, `keys`, `values` and `mask` borrowed as [`Rows`],
/// with `out` `(n_heads * q * d_head)` zeroed; returns `out` as `(n_heads, q, d_head)`.
fn per_row(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start: usize,
    mask: Option<&Tensor>,
    kernel: impl FnOnce(&Rows, &mut [f32]),
) -> Result<Tensor> {
    let shapes = Shapes::of(q, keys)?;
    let (nh, q_len, dh) = (shapes.nh, shapes.q_len, shapes.dh);
    let q = q.contiguous()?;
    let mask = mask_values(mask)?;
    let mut out = vec![0f32; nh * q_len * dh];
    with_data(&q, |qd, _| {
        with_data(keys, |kd, ks| {
            with_data(values, |vd, vs| {
                let rows = Rows {
                    shapes: &shapes,
                    q: qd,
                    k: (kd, ks),
                    v: (vd, vs),
                    mask: mask.as_deref(),
                    start,
                };
                kernel(&rows, &mut out);
                Ok(())
            })
        })
    })?;
    Ok(Tensor::from_vec(out, (nh, q_len, dh), &Device::Cpu)?)
}

/// Attention by online softmax in mistral.rs's arithmetic order (see the module docs).
pub(crate) fn streaming(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    per_row(q, keys, values, start, mask, |rows, out| {
        let Shapes {
            q_len, dh, kv_len, ..
        } = *rows.shapes;
        for (i, slot) in out.chunks_mut(dh).enumerate() {
            let (kvh, qrow, scale) = (rows.kv_head(i), rows.query(i), rows.shapes.scale);
            let visit = |st: &mut Online, j: usize| {
                let b = rows.bias(i, j);
                if b == f32::NEG_INFINITY {
                    return;
                }
                let score = dot4(qrow, rows.key(kvh, j)) * scale + b;
                st.push(score, rows.value(kvh, j));
            };
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
    })
}

/// Attention as llama.cpp computes it without flash attention over an f32 KV cache
/// (`-fa off -ctk f32 -ctv f32`) on ggml's `simd` path: per query row, scores
/// [`ggml::Simd::dot`]`(q, k)` scaled by `1 / sqrt(d_head)` plus the mask,
/// [`ggml::Simd::softmax_in_place`], and each output dimension `sum_j p_j v_j` by
/// [`ggml::Simd::weighted_rows`]. (ggml scales `q` before the
/// product; for a power-of-two scale, as in both models here, that is the same float.)
/// Keys line up with ggml's lanes by absolute position (`key_start` is key 0's), as
/// llama.cpp's cache cells do until it evicts. `start` is the first query's offset from
/// key 0. Parallel over (head, query) rows.
pub(crate) fn ggml_plain(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start: usize,
    key_start: usize,
    mask: Option<&Tensor>,
    simd: ggml::Simd,
) -> Result<Tensor> {
    per_row(q, keys, values, start, mask, |rows, out| {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_kernels_agree_with_a_plain_sum() {
        for n in [8, 16, 64, 80] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot_lanes(&a, &b) as f64 - want).abs() < 1e-4, "n {n}");
        }
    }

    #[test]
    fn decode_attention_is_the_same_on_every_instruction_set() {
        let (nh, nkv, len, dh) = (6, 2, 300, 64);
        let q = Tensor::randn(0f32, 1.0, (nh * dh,), &Device::Cpu).unwrap();
        let q: Vec<f32> = q.to_vec1().unwrap();
        let kv = Tensor::randn(0f32, 1.0, (2 * nkv * len * dh,), &Device::Cpu).unwrap();
        let kv: Vec<f32> = kv.to_vec1().unwrap();
        let heads: Vec<KvRows> = (0..nkv)
            .map(|h| KvRows {
                keys: &kv[h * len * dh..][..len * dh],
                values: &kv[(nkv + h) * len * dh..][..len * dh],
                len,
            })
            .collect();
        let bias: Vec<f32> = (0..len)
            .map(|j| if j % 7 == 0 { f32::NEG_INFINITY } else { 0.1 })
            .collect();
        let masks: Vec<Option<&[f32]>> =
            (0..nh).map(|h| (h % 2 == 0).then_some(&bias[..])).collect();
        let (out, probs) = decode_rows_on(Isa::Portable, &q, dh, &heads, &masks, true);
        for isa in Isa::available() {
            let (o, p) = decode_rows_on(isa, &q, dh, &heads, &masks, true);
            assert!(
                o.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa}"
            );
            assert_eq!(p, probs, "{isa}");
        }
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn single_query_matches_batched_attention() {
        // 37 keys: one part; 300 keys: several parts per KV head; MQA (4 heads, 1 KV head).
        for (nh, nkv, kv_len) in [(6, 2, 37), (9, 3, 300), (4, 1, 1000)] {
            let q = Tensor::randn(0f32, 1.0, (nh, 1, 64), &Device::Cpu).unwrap();
            let k = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let v = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let (o1, p1) = single_query(&q, &k, &v, None, true).unwrap();
            let (o2, p2) = batched(&q, &k, &v, None, None).unwrap();
            assert!(max_diff(&o1, &o2) < 1e-5, "{nh}/{nkv}/{kv_len}");
            assert!(max_diff(&p1.unwrap(), &p2) < 1e-6, "{nh}/{nkv}/{kv_len}");
            let (o3, none) = single_query(&q, &k, &v, None, false).unwrap();
            assert!(none.is_none() && max_diff(&o1, &o3) == 0.0);
        }
    }

    /// `(nh, q, kv_len)` mask: causal for queries at `start..`, within `window`, plus
    /// `bias * (j % 7)` on visible key `j`.
    fn full_mask(
        (nh, q, kv_len): (usize, usize, usize),
        start: usize,
        w: Option<usize>,
        bias: f32,
    ) -> Tensor {
        let m: Vec<f32> = (0..nh * q * kv_len)
            .map(|i| {
                let (t, j) = ((i / kv_len) % q, i % kv_len);
                let query = start + t;
                if j <= query && w.is_none_or(|w| j + w > query) {
                    bias * (j % 7) as f32
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        Tensor::from_vec(m, (nh, q, kv_len), &Device::Cpu).unwrap()
    }

    #[test]
    fn blocked_prefill_matches_loops_over_the_whole_mask() {
        // Several blocks, a partial last block, earlier keys before the queries, MQA and a
        // sliding window shorter than a block; with and without a given mask.
        for (nh, nkv, q_len, start, window) in [
            (9, 3, 600, 0, None),
            (6, 2, 300, 45, None),
            (4, 1, 700, 20, Some(100)),
        ] {
            let kv_len = start + q_len;
            let q = Tensor::randn(0f32, 1.0, (nh, q_len, 64), &Device::Cpu).unwrap();
            let k = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let v = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let shape = (nh, q_len, kv_len);
            let mask = full_mask(shape, start, window, 0.0);
            let want = streaming(&q, &k, &v, start, Some(&mask)).unwrap();
            let got = blocked(&q, &k, &v, start, None, window).unwrap();
            let case = format!("{nh}/{nkv}/{q_len}/{start}/{window:?}");
            assert!(max_diff(&got, &want) < 1e-5, "{case}");
            let biased = full_mask(shape, start, window, 0.3);
            let want = streaming(&q, &k, &v, start, Some(&biased)).unwrap();
            let given = blocked(&q, &k, &v, start, Some(&biased), window).unwrap();
            assert!(max_diff(&given, &want) < 1e-5, "{case}");
            assert!(max_diff(&given, &got) > 1e-3, "{case}: the bias is used");
        }
    }

    #[test]
    fn ggml_plain_matches_batched_attention() {
        // Prefill with a window and a bias, a causal prefill after earlier keys, and one
        // decode step; lanes aligned to absolute positions other than 0 change only the
        // last bits.
        for (nh, nkv, q_len, start, window, bias) in [
            (4, 1, 70, 0, Some(20), 0.3),
            (6, 2, 33, 40, None, 0.0),
            (9, 3, 1, 99, None, 0.0),
        ] {
            let kv_len = start + q_len;
            let q = Tensor::randn(0f32, 1.0, (nh, q_len, 64), &Device::Cpu).unwrap();
            let k = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let v = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let mask = full_mask((nh, q_len, kv_len), start, window, bias);
            let (want, _) = batched(&q, &k, &v, Some(&mask), None).unwrap();
            for simd in [ggml::Simd::Avx2, ggml::Simd::Avx512] {
                let case = format!("{simd:?} {nh}/{nkv}/{q_len}/{start}/{window:?}");
                let got = ggml_plain(&q, &k, &v, start, 0, Some(&mask), simd).unwrap();
                assert!(max_diff(&got, &want) < 1e-5, "{case}");
                if window.is_none() && bias == 0.0 {
                    let causal = ggml_plain(&q, &k, &v, start, 0, None, simd).unwrap();
                    assert_eq!(max_diff(&causal, &got), 0.0, "{case}: None is causal");
                }
                let shifted = ggml_plain(&q, &k, &v, start, 7, Some(&mask), simd).unwrap();
                assert!(max_diff(&shifted, &got) < 1e-6, "{case}");
            }
        }
    }

    #[test]
    fn single_query_honours_masks_that_blank_whole_parts() {
        let (nh, nkv, kv_len) = (9, 3, 400);
        let q = Tensor::randn(0f32, 1.0, (nh, 1, 64), &Device::Cpu).unwrap();
        let k = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
        let v = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
        // keep 4 sink keys and the last 8: everything between is masked
        let mask: Vec<f32> = (0..nh * kv_len)
            .map(|i| {
                let j = i % kv_len;
                if j < 4 || j >= kv_len - 8 {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (nh, 1, kv_len), &Device::Cpu).unwrap();
        let (o1, p1) = single_query(&q, &k, &v, Some(&mask), true).unwrap();
        let (o2, p2) = batched(&q, &k, &v, Some(&mask), None).unwrap();
        let p1 = p1.unwrap();
        assert!(max_diff(&o1, &o2) < 1e-5 && max_diff(&p1, &p2) < 1e-6);
        let kept: f32 = p1.sum_all().unwrap().to_scalar().unwrap();
        assert!((kept - nh as f32).abs() < 1e-4);
        let masked = p1.narrow(2, 4, kv_len - 12).unwrap();
        assert_eq!(
            masked
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
    }
}
