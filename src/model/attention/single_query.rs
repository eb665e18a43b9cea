//! One decode step in plain loops over the KV cache, parallel over KV heads and parts of
//! the keys, 16-lane dot products and a vectorised `exp` (a matrix product with one row
//! spends most of its time packing operands). The loops are compiled for AVX2 and
//! AVX-512 besides the build's own target and chosen at run time ([`Isa`]), with the same
//! floats on each.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::rows::{mask_values, with_data, Kv, KvRows, Shapes};
use crate::model::numerics::fast_exp;
use crate::model::numerics::kernels::Isa;
use crate::Result;

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

/// Lanes of the vectorised dot product.
const LANES: usize = 16;

/// Dot product with `LANES` independent accumulators (the compiler maps them to SIMD).
#[inline(always)]
pub(super) fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
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

/// Fewest keys in one part of the single-query path: below this, splitting the keys
/// costs more than it balances.
const MIN_PART: usize = 64;

/// Attention of one query position per head (a decode step): `(n_heads, 1, d_head)` and,
/// when `want_probs`, the probabilities `(n_heads, 1, kv_len)`. A tensor front end to
/// [`decode_rows`].
pub(crate) fn single_query(
    q: &Tensor,
    kv: &Kv,
    mask: Option<&Tensor>,
    want_probs: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let Shapes { nh, dh, kv_len, .. } = Shapes::of(q, kv)?;
    let q = q.contiguous()?;
    let mask = mask_values(mask)?;
    let masks: Vec<Option<&[f32]>> = (0..nh)
        .map(|h| mask.as_ref().map(|m| &m[h * kv_len..(h + 1) * kv_len]))
        .collect();
    let (out, probs) = with_data(&q, |qd, _| {
        kv.with_rows(dh, |heads| {
            Ok(decode_rows(&qd[..nh * dh], dh, heads, &masks, want_probs))
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
pub(super) fn decode_rows_on(
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
            .min(rows.len().div_ceil(MIN_PART))
            .max(1);
        let span = rows.len().div_ceil(parts);
        for part in 0..parts {
            let keys = (part * span).min(rows.len())..((part + 1) * span).min(rows.len());
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
            .map(|h| vec![0f32; heads[h / group].len()])
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
        let k = rows.key(j, dh);
        prefetch(k);
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
        let v = rows.value(j, dh);
        prefetch(v);
        for (g, acc) in task.accs.chunks_exact_mut(dh).enumerate() {
            let p = w[g * n + i];
            if p != 0.0 {
                acc.iter_mut().zip(v).for_each(|(a, x)| *a += p * x);
            }
        }
    }
}

/// Ask for the cache lines
/// [`PREFETCH_BYTES`](crate::model::numerics::kernels::PREFETCH_BYTES) past each line of `row`, a row of a KV
/// head's contiguous keys or values (a hint only: results do not change).
#[inline(always)]
fn prefetch(row: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..row.len()).step_by(16) {
        use crate::model::numerics::kernels::PREFETCH_BYTES;
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let at = row.as_ptr().wrapping_add(line + PREFETCH_BYTES / 4);
        // SAFETY: a prefetch does not fault or read memory architecturally, whatever the
        // address; SSE is part of every x86-64 CPU.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at as *const i8) };
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
