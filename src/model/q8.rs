//! Batch-1 matrix-vector products over 8-bit weights, the decode path of
//! [`Numerics::Fast`](crate::model::Numerics::Fast).
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

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.quants.len() + 4 * self.scales.len()
    }

    /// `y = W x` for `x` of length `cols`; returns `rows` values.
    pub fn gemv(&self, x: &[f32]) -> Vec<f32> {
        let nb = self.cols / BLOCK;
        let mut xq = vec![0i8; self.cols];
        let mut xd = vec![0f32; nb];
        quantize_into(x, &mut xq, &mut xd);
        let mut y = vec![0f32; self.rows];
        let kernel = Kernel::detect();
        y.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(c, out)| {
                for (i, o) in out.iter_mut().enumerate() {
                    let r = c * ROWS_PER_TASK + i;
                    let w = &self.quants[r * self.cols..(r + 1) * self.cols];
                    let ws = &self.scales[r * nb..(r + 1) * nb];
                    *o = kernel.row(&xq, &xd, w, ws);
                }
            });
        y
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
    // Two accumulators so consecutive blocks do not wait on each other's sums.
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let nb = xd.len();
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
    let acc = _mm256_add_ps(acc0, acc1);
    let s4 = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
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
        let mut xq = vec![0i8; cols];
        let mut xd = vec![0f32; nb];
        quantize_into(&x, &mut xq, &mut xd);
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

    #[test]
    fn widths_that_are_not_whole_blocks_are_refused() {
        assert!(Q8Matrix::quantize(&[0.0; 48], 1, 48).is_none());
    }
}
