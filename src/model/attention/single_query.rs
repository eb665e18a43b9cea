//! One decode step in plain loops over the KV cache, parallel over KV heads and parts of
//! the keys, 16-lane dot products and a vectorised `exp` (a matrix product with one row
//! spends most of its time packing operands). The dot products and the weighted value
//! sums are written once per vector width (portable, AVX2, AVX-512: [`Lanes`]), each task
//! compiled for the widest one the CPU runs and chosen at run time ([`Isa`]), with the
//! same floats on each. Keys and values stored as f16 are widened in the registers they
//! are loaded into ([`Element`]), so their floats are those of the rows widened first.

use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;

use super::rows::{mask_values, with_data, Chunk, Kv, Shapes, StoredRows};
use crate::model::numerics::fast_exp;
use crate::model::numerics::kernels::Isa;
use crate::model::numerics::PARTITION_THREADS;
use crate::Result;

/// Lanes of the vectorised dot product.
const LANES: usize = 16;

/// A type KV rows are stored in that the decode task reads in place: f32, or f16 widened
/// as it is loaded (an exact conversion).
pub(super) trait Element: Copy {
    /// The value as f32.
    fn widen(self) -> f32;

    /// Eight values from `p` widened to f32.
    ///
    /// # Safety
    ///
    /// `p` points at eight readable values; the CPU runs AVX and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Sixteen values from `p` widened to f32.
    ///
    /// # Safety
    ///
    /// `p` points at sixteen readable values; the CPU runs AVX-512 F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Element for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

impl Element for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::{_mm256_cvtph_ps, _mm_loadu_si128};
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::{_mm256_loadu_si256, _mm512_cvtph_ps};
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
}

/// The decode task's vector arithmetic, one implementation per vector width, all with
/// the same floats. The dot product keeps [`LANES`] interleaved accumulators: lane `i`
/// sums `a[16c + i] * b[16c + i]` over the whole chunks `c` (a multiply, then an add: no
/// fused multiply-add), the lanes are halved pairwise (`acc[i] += acc[i + w]` for `w` =
/// 8, 4, 2, 1), and the remainder's plain sum is added last.
trait Lanes {
    /// `a . b` (equal lengths).
    ///
    /// # Safety
    ///
    /// The CPU runs the implementation's instruction set.
    unsafe fn dot<E: Element>(a: &[f32], b: &[E]) -> f32;

    /// For each query head `g` of a group, `accs[g] += w[g * stride + i] * values[i]`
    /// over the value rows in order, skipping zero weights, lane by lane (a multiply,
    /// then an add): `accs` `(group, d_head)`, `values` `(rows, d_head)`. Rows summed in
    /// several calls give the floats of one call over them all.
    ///
    /// # Safety
    ///
    /// The CPU runs the implementation's instruction set.
    unsafe fn weighted_sum<E: Element>(
        accs: &mut [f32],
        w: &[f32],
        stride: usize,
        values: &[E],
        dh: usize,
    );
}

/// The portable loop (the compiler vectorises it as it can).
struct Portable;

impl Lanes for Portable {
    #[inline(always)]
    unsafe fn dot<E: Element>(a: &[f32], b: &[E]) -> f32 {
        dot_lanes(a, b)
    }

    #[inline(always)]
    unsafe fn weighted_sum<E: Element>(
        accs: &mut [f32],
        w: &[f32],
        stride: usize,
        values: &[E],
        dh: usize,
    ) {
        for (i, v) in values.chunks_exact(dh).enumerate() {
            prefetch(v);
            for (g, acc) in accs.chunks_exact_mut(dh).enumerate() {
                let p = w[g * stride + i];
                if p != 0.0 {
                    acc.iter_mut().zip(v).for_each(|(a, x)| *a += p * x.widen());
                }
            }
        }
    }
}

/// The remainder of `a . b` past its whole chunks of [`LANES`], summed in order.
#[inline(always)]
fn tail<E: Element>(a: &[f32], b: &[E]) -> f32 {
    let whole = a.len() / LANES * LANES;
    a[whole..]
        .iter()
        .zip(&b[whole..])
        .map(|(x, y)| x * y.widen())
        .sum()
}

/// Dot product with [`LANES`] independent accumulators, the reference loop of [`Lanes`].
#[inline(always)]
pub(super) fn dot_lanes<E: Element>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; LANES];
    for (x, y) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i].widen();
        }
    }
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0] + tail(a, b)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! [`Lanes`] in AVX2 (two 256-bit accumulators) and AVX-512 (one 512-bit one), and
    //! the decode task compiled for each. Written with intrinsics: the compiler split
    //! the portable loop's sixteen lanes into pairs of two-float vectors (measured in a
    //! profile of a batched decode step: a quarter of its time in those scores).

    use std::arch::x86_64::*;

    use super::{prefetch, run_task, tail, Element, Lanes, Portable, Step, Task, LANES};

    /// Lanes 0-7 of the accumulators halved down to lane 0, then the remainder added.
    #[inline(always)]
    unsafe fn finish<E: Element>(low8: __m256, a: &[f32], b: &[E]) -> f32 {
        let four = _mm_add_ps(
            _mm256_castps256_ps128(low8),
            _mm256_extractf128_ps::<1>(low8),
        );
        let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
        let one = _mm_add_ss(two, _mm_movehdup_ps(two));
        _mm_cvtss_f32(one) + tail(a, b)
    }

    /// [`Lanes::weighted_sum`] in vectors of `$w` floats, `$n` of them per run of the
    /// output: for each run, the query heads' sums held in registers while every key's
    /// value run is loaded once (widened by `Element::load8` or `load16`) and added,
    /// weighted, to each head's (the portable loop where `d_head` is not a multiple of the
    /// run, or a group has more than four heads).
    macro_rules! weighted_sum {
        (__m256) => {
            weighted_sum!(
                __m256,
                8,
                4,
                _mm256_setzero_ps,
                _mm256_set1_ps,
                _mm256_loadu_ps,
                load8,
                _mm256_storeu_ps,
                _mm256_add_ps,
                _mm256_mul_ps
            );
        };
        (__m512) => {
            weighted_sum!(
                __m512,
                16,
                4,
                _mm512_setzero_ps,
                _mm512_set1_ps,
                _mm512_loadu_ps,
                load16,
                _mm512_storeu_ps,
                _mm512_add_ps,
                _mm512_mul_ps
            );
        };
        ($t:ty, $w:literal, $n:literal, $zero:ident, $splat:ident, $load:ident,
         $loadv:ident, $store:ident, $add:ident, $mul:ident) => {
            #[inline(always)]
            unsafe fn weighted_sum<E: Element>(
                accs: &mut [f32],
                wts: &[f32],
                stride: usize,
                values: &[E],
                dh: usize,
            ) {
                #[inline(always)]
                unsafe fn heads<const G: usize, E: Element>(
                    accs: &mut [f32],
                    wts: &[f32],
                    stride: usize,
                    values: &[E],
                    dh: usize,
                ) {
                    // SAFETY (the pointer arithmetic): `accs` holds `G` rows of `dh`
                    // floats, each value row `dh`, and every run `c..c + $w * $n` lies
                    // within `dh` (checked below: `dh` is a multiple of the run).
                    for c in (0..dh).step_by($w * $n) {
                        let mut sums: [[$t; $n]; G] = [[$zero(); $n]; G];
                        for (g, sums) in sums.iter_mut().enumerate() {
                            let at = accs.as_ptr().add(g * dh + c);
                            for (k, sum) in sums.iter_mut().enumerate() {
                                *sum = $load(at.add(k * $w));
                            }
                        }
                        for (i, v) in values.chunks_exact(dh).enumerate() {
                            if c == 0 {
                                prefetch(v);
                            }
                            let v = v.as_ptr().add(c);
                            let vs: [$t; $n] = std::array::from_fn(|k| E::$loadv(v.add(k * $w)));
                            for (g, sums) in sums.iter_mut().enumerate() {
                                let p = wts[g * stride + i];
                                if p != 0.0 {
                                    let p = $splat(p);
                                    for (sum, v) in sums.iter_mut().zip(&vs) {
                                        *sum = $add(*sum, $mul(p, *v));
                                    }
                                }
                            }
                        }
                        for (g, sums) in sums.iter().enumerate() {
                            let at = accs.as_mut_ptr().add(g * dh + c);
                            for (k, sum) in sums.iter().enumerate() {
                                $store(at.add(k * $w), *sum);
                            }
                        }
                    }
                }
                if dh % ($w * $n) != 0 {
                    return Portable::weighted_sum(accs, wts, stride, values, dh);
                }
                match accs.len() / dh {
                    1 => heads::<1, E>(accs, wts, stride, values, dh),
                    2 => heads::<2, E>(accs, wts, stride, values, dh),
                    3 => heads::<3, E>(accs, wts, stride, values, dh),
                    4 => heads::<4, E>(accs, wts, stride, values, dh),
                    _ => Portable::weighted_sum(accs, wts, stride, values, dh),
                }
            }
        };
    }

    pub(super) struct Avx2;

    impl Lanes for Avx2 {
        #[inline(always)]
        unsafe fn dot<E: Element>(a: &[f32], b: &[E]) -> f32 {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let whole = a.len().min(b.len()) / LANES * LANES;
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            for c in (0..whole).step_by(LANES) {
                // SAFETY: `c + 16 <= whole` values of both slices.
                let (x0, y0) = (_mm256_loadu_ps(pa.add(c)), E::load8(pb.add(c)));
                let (x1, y1) = (_mm256_loadu_ps(pa.add(c + 8)), E::load8(pb.add(c + 8)));
                lo = _mm256_add_ps(lo, _mm256_mul_ps(x0, y0));
                hi = _mm256_add_ps(hi, _mm256_mul_ps(x1, y1));
            }
            finish(_mm256_add_ps(lo, hi), a, b)
        }

        weighted_sum!(__m256);
    }

    pub(super) struct Avx512;

    impl Lanes for Avx512 {
        #[inline(always)]
        unsafe fn dot<E: Element>(a: &[f32], b: &[E]) -> f32 {
            let mut acc = _mm512_setzero_ps();
            let whole = a.len().min(b.len()) / LANES * LANES;
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            for c in (0..whole).step_by(LANES) {
                // SAFETY: `c + 16 <= whole` values of both slices.
                let (x, y) = (_mm512_loadu_ps(pa.add(c)), E::load16(pb.add(c)));
                acc = _mm512_add_ps(acc, _mm512_mul_ps(x, y));
            }
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
            finish(_mm256_add_ps(_mm512_castps512_ps256(acc), high), a, b)
        }

        weighted_sum!(__m512);
    }

    /// [`run_task`] in AVX2.
    ///
    /// # Safety
    ///
    /// The CPU runs AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn task_avx2(task: &mut Task, step: &Step) {
        run_task::<Avx2>(task, step)
    }

    /// [`run_task`] in AVX-512.
    ///
    /// # Safety
    ///
    /// The CPU runs AVX-512 F, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn task_avx512(task: &mut Task, step: &Step) {
        run_task::<Avx512>(task, step)
    }
}

/// One task of [`decode_rows_on`] on the widest vectors `isa` allows (the portable loop
/// if the CPU lacks it), with the same floats on each.
fn run_task_on(isa: Isa, task: &mut Task, step: &Step) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY (both): `supported` checked that the CPU runs the set (every `Isa` past
        // `Portable` includes AVX2, FMA and F16C, and AVX-512 VNNI includes AVX-512 F).
        Isa::Avx512Vnni if isa.supported() => return unsafe { x86::task_avx512(task, step) },
        Isa::Avx2 | Isa::AvxVnni if isa.supported() => {
            return unsafe { x86::task_avx2(task, step) }
        }
        _ => {}
    }
    // SAFETY: the portable loop runs everywhere.
    unsafe { run_task::<Portable>(task, step) }
}

/// Values of key or value rows a task reads per chunk (16 KiB as f32: in the first-level
/// cache with the rows decoded from 8 bits).
const CHUNK_FLOATS: usize = 4096;

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
        let q = &qd[..nh * dh];
        if let Kv::Stored(heads) = kv {
            return Ok(decode_rows(q, dh, heads, &masks, want_probs));
        }
        kv.with_rows(dh, |heads| {
            let heads: Vec<StoredRows> = heads.iter().map(StoredRows::from).collect();
            Ok(decode_rows(q, dh, &heads, &masks, want_probs))
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
    heads: &[StoredRows],
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
    heads: &[StoredRows],
    masks: &[Option<&[f32]>],
    want_probs: bool,
) -> (Vec<f32>, Option<Vec<Vec<f32>>>) {
    let nkv = heads.len();
    let nh = q.len() / dh;
    let group = nh / nkv;
    let scale = 1.0 / (dh as f32).sqrt();
    // Two tasks per thread of PARTITION_THREADS (not the pool's size: the parts change
    // the floats), in parts of at least MIN_PART keys.
    let mut tasks = Vec::new();
    for (kv_head, rows) in heads.iter().enumerate() {
        let parts = (2 * PARTITION_THREADS)
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
        .for_each(|task| run_task_on(isa, task, &step));
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
    heads: &'a [StoredRows<'a>],
    masks: &'a [Option<&'a [f32]>],
}

/// One task of [`decode_rows`]: scores, softmax statistics and weighted value sums of
/// its part of the keys for every query head of its KV head, its dot products in `L`.
///
/// # Safety
///
/// The CPU runs `L`'s instruction set.
#[inline(always)]
unsafe fn run_task<L: Lanes>(task: &mut Task, step: &Step) {
    let Step {
        dh,
        group,
        heads,
        masks,
        ..
    } = *step;
    let rows = &heads[task.kv_head];
    let n = task.keys.len();
    let w = &mut task.weights;
    // The keys, then the values, a chunk of rows at a time: borrowed where stored as f32
    // or f16, else decoded into `scratch` while it stays in cache.
    let chunk = (CHUNK_FLOATS / dh).max(1);
    let chunks = || (0..n).step_by(chunk).map(move |c| c..(c + chunk).min(n));
    let at = |r: &std::ops::Range<usize>| task.keys.start + r.start..task.keys.start + r.end;
    let mut scratch = Vec::new();
    let first = task.kv_head * group;
    for c in chunks() {
        match rows.keys(at(&c), dh, &mut scratch) {
            Chunk::F32(k) => scores::<L, f32>(w, c, k, first, step),
            Chunk::F16(k) => scores::<L, f16>(w, c, k, first, step),
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
    for c in chunks() {
        let (accs, w) = (&mut task.accs, &w[c.start..]);
        match rows.values(at(&c), dh, &mut scratch) {
            Chunk::F32(v) => L::weighted_sum(accs, w, n, v, dh),
            Chunk::F16(v) => L::weighted_sum(accs, w, n, v, dh),
        }
    }
}

/// The scores of keys `c` (their rows `keys`) for the query heads `first..first + group`
/// into `w` (`group` rows of the task's keys), in `L`.
///
/// # Safety
///
/// The CPU runs `L`'s instruction set.
#[inline(always)]
unsafe fn scores<L: Lanes, E: Element>(
    w: &mut [f32],
    c: std::ops::Range<usize>,
    keys: &[E],
    first: usize,
    step: &Step,
) {
    let (n, dh) = (w.len() / step.group, step.dh);
    for (i, k) in c.zip(keys.chunks_exact(dh)) {
        prefetch(k);
        for g in 0..step.group {
            let h = first + g;
            w[g * n + i] = L::dot(&step.q[h * dh..(h + 1) * dh], k) * step.scale;
        }
    }
}

/// Ask for the cache lines
/// [`PREFETCH_BYTES`](crate::model::numerics::kernels::PREFETCH_BYTES) past each line of `row`, a row of a KV
/// head's contiguous keys or values (a hint only: results do not change).
#[inline(always)]
fn prefetch<E>(row: &[E]) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..row.len()).step_by(64 / std::mem::size_of::<E>()) {
        use crate::model::numerics::kernels::PREFETCH_BYTES;
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let at = row
            .as_ptr()
            .wrapping_add(line + PREFETCH_BYTES / std::mem::size_of::<E>());
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
