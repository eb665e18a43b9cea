//! Batch-1 matrix-vector products with 8-bit activations, the decode path of
//! [`Numerics::Fast`](crate::model::Numerics::Fast): [`Q8Matrix`] for 8-bit weights and
//! [`Q41Matrix`] for the file's own Q4_1 blocks (half the bytes to stream).
//!
//! Weights are stored as blocks of 32 signed bytes with one f32 scale (`w ≈ d_w * q_w`),
//! the activation vector is quantized the same way per call, and each block's integer dot
//! product is scaled by `d_w * d_x`: the Q8_0 scheme of llama.cpp. Decode at batch 1
//! streams every weight once per token, so one byte per weight instead of four is what
//! makes it fast; on x86-64 with AVX-512 VNNI the integer dot products run 32 at a time
//! (`vpdpbusd`), elsewhere a portable loop computes the same sums.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes, so each block is fed `|q_w|` and the
//! activation with `q_w`'s sign moved onto it (`sign(q_x, q_w)`): the products are the
//! same. Quantized values stay in `[-127, 127]`, so `|q_w|` fits a byte.

use rayon::prelude::*;

/// Output rows per parallel task: large enough to amortise scheduling, small enough to
/// balance two cores on the narrowest projections.
const ROWS_PER_TASK: usize = 64;

/// Elements per quantization block.
pub const BLOCK: usize = 32;

/// A row-major `(rows, cols)` matrix of Q8 blocks; `cols` is a multiple of [`BLOCK`].
#[derive(Debug, Clone)]
pub struct Q8Matrix {
    rows: usize,
    cols: usize,
    /// `rows * cols` quantized weights.
    quants: Vec<i8>,
    /// One scale per block, `rows * cols / BLOCK`.
    scales: Vec<f32>,
}

/// `row(r)` for every output row, in parallel chunks of [`ROWS_PER_TASK`].
fn par_rows(rows: usize, row: impl Fn(usize) -> f32 + Sync) -> Vec<f32> {
    let mut y = vec![0f32; rows];
    y.par_chunks_mut(ROWS_PER_TASK)
        .enumerate()
        .for_each(|(c, out)| {
            for (i, o) in out.iter_mut().enumerate() {
                *o = row(c * ROWS_PER_TASK + i);
            }
        });
    y
}

/// Quantize `x` (length a multiple of [`BLOCK`]) into `q` and per-block scales.
fn quantize_into(x: &[f32], q: &mut [i8], scales: &mut [f32]) {
    for ((xb, qb), d) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(scales)
    {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        *d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (o, v) in qb.iter_mut().zip(xb) {
            *o = (v * inv).round() as i8;
        }
    }
}

/// `x` (length a multiple of [`BLOCK`]) as 8-bit blocks and their scales.
fn quantized(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; x.len()];
    let mut d = vec![0f32; x.len() / BLOCK];
    quantize_into(x, &mut q, &mut d);
    (q, d)
}

impl Q8Matrix {
    /// Quantize a row-major f32 matrix; `None` if `cols` is not a multiple of [`BLOCK`].
    pub fn quantize(data: &[f32], rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(BLOCK) || data.len() != rows * cols {
            return None;
        }
        let mut quants = vec![0i8; rows * cols];
        let mut scales = vec![0f32; rows * cols / BLOCK];
        quantize_into(data, &mut quants, &mut scales);
        Some(Self {
            rows,
            cols,
            quants,
            scales,
        })
    }

    /// Output width.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// `y = W x` for `x` of length `cols`; returns `rows` values.
    pub fn gemv(&self, x: &[f32]) -> Vec<f32> {
        let (xq, xd) = quantized(x);
        let nb = xd.len();
        let kernel = Kernel::detect();
        par_rows(self.rows, |r| {
            let w = &self.quants[r * self.cols..(r + 1) * self.cols];
            kernel.row(&xq, &xd, w, &self.scales[r * nb..(r + 1) * nb])
        })
    }
}

/// Q4_1 weights kept as GGUF stores them: per block of 32, `w = d * q + m` with `q` in
/// `0..16`, 20 bytes: f16 `d`, f16 `m`, then 16 bytes whose low nibbles hold elements
/// `0..16` and high nibbles elements `16..32`.
///
/// Against an 8-bit activation block (`x ≈ d_x * q_x`) the block's contribution is
/// `d * d_x * dot(q, q_x) + m * d_x * sum(q_x)`; `q` is already unsigned, so `vpdpbusd`
/// takes it as is. Keeping the file's layout (rather than widening the scales to f32)
/// streams 20 bytes per block instead of 24 from one place, which is what decode at
/// batch 1 is bound by.
#[derive(Debug, Clone)]
pub struct Q41Matrix {
    rows: usize,
    /// `rows * cols / 32` blocks of [`Q4_1_BLOCK_BYTES`], row after row.
    blocks: Vec<u8>,
}

/// Bytes of one GGUF Q4_1 block: f16 `d`, f16 `m`, 16 bytes of nibbles.
const Q4_1_BLOCK_BYTES: usize = 20;

impl Q41Matrix {
    /// Take raw GGUF Q4_1 data of a row-major `(rows, cols)` matrix; `None` if the sizes
    /// do not fit.
    pub fn from_gguf(raw: Vec<u8>, rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(BLOCK) || raw.len() != rows * cols / BLOCK * Q4_1_BLOCK_BYTES {
            return None;
        }
        Some(Self { rows, blocks: raw })
    }

    /// Output width.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// `y = W x` for `x` of length `cols`; returns `rows` values.
    pub fn gemv(&self, x: &[f32]) -> Vec<f32> {
        let (xq, xd) = quantized(x);
        // Per block `(d_x, d_x * sum(q_x))`: the scale of the dot product and of `m`.
        let xs: Vec<[f32; 2]> = xq
            .chunks_exact(BLOCK)
            .zip(&xd)
            .map(|(q, &d)| [d, d * q.iter().map(|&v| v as i32).sum::<i32>() as f32])
            .collect();
        let kernel = Kernel::detect();
        let row_bytes = xd.len() * Q4_1_BLOCK_BYTES;
        par_rows(self.rows, |r| {
            kernel.row_q4_1(&xq, &xs, &self.blocks[r * row_bytes..(r + 1) * row_bytes])
        })
    }
}

/// Which instruction set computes the block dot products.
#[derive(Clone, Copy)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kernel {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return Kernel::Vnni;
        }
        Kernel::Portable
    }

    /// One Q4_1 row of GGUF blocks: `sum_b d_b * xs[b][0] * dot(q_b, x_b) + m_b * xs[b][1]`.
    fn row_q4_1(self, x: &[i8], xs: &[[f32; 2]], blocks: &[u8]) -> f32 {
        match self {
            Kernel::Portable => row_q4_1_portable(x, xs, blocks),
            // SAFETY: `detect` checked that the CPU has the features the function enables.
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => unsafe { row_q4_1_vnni(x, xs, blocks) },
        }
    }

    /// `sum_b d_x[b] * d_w[b] * dot(x_b, w_b)` over the blocks of one row.
    fn row(self, x: &[i8], xd: &[f32], w: &[i8], ws: &[f32]) -> f32 {
        match self {
            Kernel::Portable => row_portable(x, xd, w, ws),
            // SAFETY: `detect` checked that the CPU has the features the function enables.
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => unsafe { row_vnni(x, xd, w, ws) },
        }
    }
}

fn row_portable(x: &[i8], xd: &[f32], w: &[i8], ws: &[f32]) -> f32 {
    let mut sum = 0f32;
    for b in 0..xd.len() {
        let dot: i32 = x[b * BLOCK..(b + 1) * BLOCK]
            .iter()
            .zip(&w[b * BLOCK..(b + 1) * BLOCK])
            .map(|(&u, &q)| u as i32 * q as i32)
            .sum();
        sum += xd[b] * ws[b] * dot as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512vnni,avx512vl,avx512f,avx2,fma")]
unsafe fn row_vnni(x: &[i8], xd: &[f32], w: &[i8], ws: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let block = |b: usize| {
        let xv = _mm256_loadu_si256(x.as_ptr().add(b * BLOCK) as *const __m256i);
        let wv = _mm256_loadu_si256(w.as_ptr().add(b * BLOCK) as *const __m256i);
        let dot = _mm256_dpbusd_epi32(
            _mm256_setzero_si256(),
            _mm256_abs_epi8(wv),
            _mm256_sign_epi8(xv, wv),
        );
        (_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xd[b] * ws[b]))
    };
    hsum(scaled_block_sum(xd.len(), block))
}

/// `sum_b dots(b) * scales(b)` over `nb` blocks, `block(b)` giving both as 8 lanes; two
/// accumulators so consecutive blocks do not wait on each other's sums.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn scaled_block_sum(
    nb: usize,
    mut block: impl FnMut(usize) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256),
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut b = 0;
    while b + 1 < nb {
        let (d0, s0) = block(b);
        let (d1, s1) = block(b + 1);
        acc0 = _mm256_fmadd_ps(d0, s0, acc0);
        acc1 = _mm256_fmadd_ps(d1, s1, acc1);
        b += 2;
    }
    if b < nb {
        let (d0, s0) = block(b);
        acc0 = _mm256_fmadd_ps(d0, s0, acc0);
    }
    _mm256_add_ps(acc0, acc1)
}

/// Sum of the eight lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s4 = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)))
}

fn row_q4_1_portable(x: &[i8], xs: &[[f32; 2]], blocks: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (b, (blk, [xd, xsum])) in blocks.chunks_exact(Q4_1_BLOCK_BYTES).zip(xs).enumerate() {
        let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let m = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
        let (xb, q) = (&x[b * BLOCK..(b + 1) * BLOCK], &blk[4..]);
        let dot: i32 = (0..BLOCK / 2)
            .map(|j| (q[j] & 0x0F) as i32 * xb[j] as i32 + (q[j] >> 4) as i32 * xb[j + 16] as i32)
            .sum();
        sum += d * xd * dot as f32 + m * xsum;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512vnni,avx512vl,avx512f,avx2,fma,f16c")]
unsafe fn row_q4_1_vnni(x: &[i8], xs: &[[f32; 2]], blocks: &[u8]) -> f32 {
    use std::arch::x86_64::*;
    let low = _mm_set1_epi8(0x0F);
    let base = blocks.as_ptr();
    // Lane 1 of this accumulates `m * d_x * sum(q_x)`; lane 0 is scratch.
    let mut offsets = _mm_setzero_ps();
    let mut block = |b: usize| {
        let blk = base.add(b * Q4_1_BLOCK_BYTES);
        // (d, m) as f32 lanes 0 and 1, times (d_x, d_x * sum(q_x)).
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
        let scales = _mm_mul_ps(
            dm,
            _mm_castpd_ps(_mm_load_sd(xs.as_ptr().add(b) as *const f64)),
        );
        offsets = _mm_add_ps(offsets, scales);
        let packed = _mm_loadu_si128(blk.add(4) as *const __m128i);
        let lo = _mm_and_si128(packed, low);
        let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
        let xv = _mm256_loadu_si256(x.as_ptr().add(b * BLOCK) as *const __m256i);
        let dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set_m128i(hi, lo), xv);
        (_mm256_cvtepi32_ps(dot), _mm256_broadcastss_ps(scales))
    };
    let dots = scaled_block_sum(xs.len(), &mut block);
    hsum(dots) + _mm_cvtss_f32(_mm_shuffle_ps(offsets, offsets, 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn gemv_is_close_to_the_f32_product() {
        let (rows, cols) = (130, 96);
        let w = data(rows * cols, 1);
        let x = data(cols, 2);
        let m = Q8Matrix::quantize(&w, rows, cols).unwrap();
        let y = m.gemv(&x);
        for r in 0..rows {
            let exact: f32 = (0..cols).map(|c| w[r * cols + c] * x[c]).sum();
            // two 8-bit roundings of values in [-1, 1]: error well below 0.05 here
            assert!((y[r] - exact).abs() < 0.05, "row {r}: {} vs {exact}", y[r]);
        }
    }

    #[test]
    fn simd_and_portable_kernels_agree() {
        let (rows, cols) = (8, 576);
        let w = data(rows * cols, 3);
        let x: Vec<f32> = data(cols, 4).iter().map(|v| v * 30.0).collect();
        let m = Q8Matrix::quantize(&w, rows, cols).unwrap();
        let nb = cols / BLOCK;
        let (xq, xd) = quantized(&x);
        let kernel = Kernel::detect();
        for r in 0..rows {
            let args = (
                &m.quants[r * cols..(r + 1) * cols],
                &m.scales[r * nb..(r + 1) * nb],
            );
            let a = row_portable(&xq, &xd, args.0, args.1);
            let b = kernel.row(&xq, &xd, args.0, args.1);
            assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{a} vs {b}");
        }
    }

    /// GGUF Q4_1 bytes for `w` (rows of `cols`), quantized the way ggml does it.
    fn q4_1_bytes(w: &[f32], cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for blk in w.chunks_exact(BLOCK) {
            let (lo, hi) = blk
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            let d = (hi - lo) / 15.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            out.extend(half::f16::from_f32(d).to_le_bytes());
            out.extend(half::f16::from_f32(lo).to_le_bytes());
            for j in 0..BLOCK / 2 {
                let q = |v: f32| (((v - lo) * inv + 0.5) as u8).min(15);
                out.push(q(blk[j]) | (q(blk[j + 16]) << 4));
            }
        }
        assert_eq!(out.len(), w.len() / BLOCK * Q4_1_BLOCK_BYTES);
        let _ = cols;
        out
    }

    #[test]
    fn q4_1_gemv_matches_the_dequantized_product() {
        let (rows, cols) = (70, 96);
        let w = data(rows * cols, 7);
        let x = data(cols, 8);
        let raw = q4_1_bytes(&w, cols);
        let m = Q41Matrix::from_gguf(raw.clone(), rows, cols).unwrap();
        let y = m.gemv(&x);
        // dequantize the bytes independently and multiply in f64
        let nb = cols / BLOCK;
        for r in 0..rows {
            let mut exact = 0f64;
            for (c, xc) in x.iter().enumerate() {
                let blk = &raw[(r * nb + c / BLOCK) * Q4_1_BLOCK_BYTES..];
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f64();
                let min = half::f16::from_le_bytes([blk[2], blk[3]]).to_f64();
                let j = c % BLOCK;
                let byte = blk[4 + j % 16];
                let q = if j < 16 { byte & 0x0F } else { byte >> 4 };
                exact += (d * q as f64 + min) * *xc as f64;
            }
            // only the activation is rounded (8 bits, step 1/127 of each block's maximum)
            assert!(
                (y[r] as f64 - exact).abs() < 0.08,
                "row {r}: {} vs {exact}",
                y[r]
            );
            let f32_product: f64 = (0..cols)
                .map(|c| w[r * cols + c] as f64 * x[c] as f64)
                .sum();
            assert!(
                (y[r] as f64 - f32_product).abs() < 0.6,
                "row {r}: far from the f32 product"
            );
        }
        assert_eq!(y.len(), m.rows());
        // The SIMD kernel computes the same sums as the portable loop.
        let (xq, xd) = quantized(&x);
        let xs: Vec<[f32; 2]> = (0..nb)
            .map(|b| {
                let sum: i32 = xq[b * BLOCK..(b + 1) * BLOCK]
                    .iter()
                    .map(|&v| v as i32)
                    .sum();
                [xd[b], xd[b] * sum as f32]
            })
            .collect();
        let row_bytes = nb * Q4_1_BLOCK_BYTES;
        for r in 0..rows {
            let blocks = &raw[r * row_bytes..(r + 1) * row_bytes];
            let a = row_q4_1_portable(&xq, &xs, blocks);
            let b = Kernel::detect().row_q4_1(&xq, &xs, blocks);
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                "row {r}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn widths_that_are_not_whole_blocks_are_refused() {
        assert!(Q8Matrix::quantize(&[0.0; 48], 1, 48).is_none());
    }
}
