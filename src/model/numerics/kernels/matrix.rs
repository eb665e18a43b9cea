//! [`BlockMatrix`]: a `(rows, cols)` weight in Q4_1, Q5_0 or Q8_0 blocks and its
//! product with rows of activations, `y_i = W x_i`.
//!
//! The integer kernels: each activation row quantized to 8 bits once; the weights are
//! held interleaved sixteen rows to a group and multiplied by `interleaved`'s kernels,
//! one weight row per 32-bit lane, for any number of rows (decode, batches and prefill:
//! a group's blocks stay in L1 while every activation row passes over them). Every row's
//! result is the same as if it were computed alone, so no sequence's result depends on
//! the batch it ran in.
//!
//! [`BlockMatrix::tiled_product`] is the f32 alternative prefill used before: a few
//! weight rows at a time expanded to f32 in a per-thread buffer of about `TILE_BYTES`
//! and multiplied with all activation rows by `gemm` (the f32 weight never exists whole).
//! It stays as the baseline `headwise bench kernels` measures the integer kernels
//! against.

use std::cell::RefCell;

use rayon::prelude::*;

use super::blocks::{q4_k_to_q4_1, q5_0_to_q8_0, quantize_q8_0, Activations, Format, QK};
use super::interleaved::{self, GROUP};
use super::isa::{Isa, Supported};
use crate::model::numerics::PARTITION_THREADS;

/// Weight rows per parallel task of the integer path: large enough to amortise
/// scheduling, small enough to balance two cores on the narrowest projections.
const ROWS_PER_TASK: usize = 64;

/// Target size of one dequantized tile (f32), about a core's share of L2.
const TILE_BYTES: usize = 256 * 1024;

/// A `(rows, cols)` matrix of [`Format`] blocks; `cols` is a multiple of [`QK`].
#[derive(Debug, Clone)]
pub struct BlockMatrix {
    format: Format,
    rows: usize,
    cols: usize,
    /// The file's `rows * cols / QK` blocks interleaved in groups of sixteen rows
    /// (`interleaved`), the last group padded.
    blocks: Vec<u8>,
}

impl BlockMatrix {
    /// Take GGUF block data of `format` for a row-major `(rows, cols)` matrix; `None` if
    /// the sizes do not fit.
    pub fn from_blocks(format: Format, blocks: Vec<u8>, rows: usize, cols: usize) -> Option<Self> {
        let fits = cols.is_multiple_of(QK)
            && rows
                .checked_mul(cols / QK)
                .and_then(|n| n.checked_mul(format.block_bytes()))
                == Some(blocks.len());
        if !fits {
            return None;
        }
        let blocks = interleaved::interleave(format, blocks, rows, cols);
        Some(Self {
            format,
            rows,
            cols,
            blocks,
        })
    }

    /// The blocks row after row, as the file stores them.
    fn into_file_blocks(self) -> Vec<u8> {
        let (nb, bb) = (self.cols / QK, self.format.block_bytes());
        let mut out = vec![0u8; self.rows * nb * bb];
        for (i, blk) in out.chunks_exact_mut(bb).enumerate() {
            interleaved::file_block(self.format, &self.blocks, nb, i / nb, i % nb, blk);
        }
        out
    }

    /// Quantize a row-major f32 `(rows, cols)` matrix to Q8_0; `None` if `cols` is not a
    /// multiple of [`QK`] or `data` is not `rows * cols` long.
    pub fn quantize_q8_0(data: &[f32], rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(QK) || data.len() != rows * cols {
            return None;
        }
        Self::from_blocks(Format::Q8_0, quantize_q8_0(data), rows, cols)
    }

    /// A `(rows, cols)` matrix of GGUF Q4_K blocks as Q4_1 blocks of the same codes
    /// ([`q4_k_to_q4_1`]: each sub-block's scale and minimum rounded to f16); `None` if
    /// the sizes do not fit (`cols` must be whole Q4_K blocks of 256).
    pub fn from_q4_k(blocks: &[u8], rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(256) || !blocks.len().is_multiple_of(144) {
            return None;
        }
        Self::from_blocks(Format::Q4_1, q4_k_to_q4_1(blocks), rows, cols)
    }

    /// The same values in Q8_0 blocks, if they fit them exactly (Q8_0 and Q5_0 do,
    /// Q4_1's offsets do not).
    pub fn into_q8_0(self) -> Option<Self> {
        match self.format {
            Format::Q8_0 => Some(self),
            Format::Q5_0 => {
                let (rows, cols) = (self.rows, self.cols);
                Self::from_blocks(
                    Format::Q8_0,
                    q5_0_to_q8_0(&self.into_file_blocks()),
                    rows,
                    cols,
                )
            }
            Format::Q4_1 => None,
        }
    }

    /// Stack matrices of the same width row-wise, in their common format, or in Q8_0 if
    /// their formats differ and each converts to it exactly; `None` otherwise.
    pub fn stack(parts: Vec<BlockMatrix>) -> Option<Self> {
        let first = parts.first()?;
        let (format, cols) = (first.format, first.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        if parts.iter().any(|p| p.format != format) {
            let parts = parts
                .into_iter()
                .map(BlockMatrix::into_q8_0)
                .collect::<Option<Vec<_>>>()?;
            return Self::stack(parts);
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let blocks = parts
            .into_iter()
            .flat_map(BlockMatrix::into_file_blocks)
            .collect();
        Self::from_blocks(format, blocks, rows, cols)
    }

    /// The block layout.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Output width.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input width.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of weight data (what one matrix-vector product streams; the padding rows of
    /// an interleaved format included).
    pub fn bytes(&self) -> usize {
        self.blocks.len()
    }

    /// Rows `r0..r1` dequantized into `out` (`(r1 - r0) * cols` floats, row-major).
    fn dequantize_rows(&self, r0: usize, r1: usize, out: &mut [f32]) {
        let nb = self.cols / QK;
        for (r, row) in (r0..r1).zip(out.chunks_exact_mut(self.cols)) {
            for (b, o) in row.chunks_exact_mut(QK).enumerate() {
                interleaved::dequantize_block(self.format, &self.blocks, nb, r, b, o);
            }
        }
    }

    /// Row `r` dequantized into `out` (`cols` floats); `None` if `r` is out of range.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Option<()> {
        if r >= self.rows {
            return None;
        }
        self.dequantize_rows(r, r + 1, out.get_mut(..self.cols)?);
        Some(())
    }

    /// The whole matrix as row-major f32 `(rows, cols)`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        self.dequantize_rows(0, self.rows, &mut out);
        out
    }

    /// `x` `(n, cols)` row-major -> `(n, rows)` through the integer kernels, on the
    /// instruction set that runs ([`Isa::active`]).
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        self.quantized_product(x, n, Isa::active())
    }

    /// `x` `(n, cols)` -> `(n, rows)` with 8-bit activations on `isa` (the portable loop
    /// if the CPU lacks it). Each row's result is the same for any `n` and any `isa`.
    ///
    /// Panics if `x` is not `n * cols` long.
    pub fn quantized_product(&self, x: &[f32], n: usize, isa: Isa) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "activations do not fit the matrix");
        let acts: Vec<Activations> = x
            .par_chunks_exact(self.cols)
            .with_min_len(8)
            .map(Activations::quantize)
            .collect();
        let refs: Vec<&Activations> = acts.iter().collect();
        let mut y = vec![0f32; n * self.rows];
        if n > 0 {
            self.interleaved_product(Supported::new(isa), &refs, &mut y);
        }
        y
    }

    /// The product of the weights with `xs` into `y` `(xs.len(), rows)`: each task
    /// takes whole groups of sixteen weight rows.
    fn interleaved_product(&self, isa: Supported, xs: &[&Activations], y: &mut [f32]) {
        let (n, nb) = (xs.len(), self.cols / QK);
        let groups_per_task = ROWS_PER_TASK / GROUP;
        let groups = self.rows.div_ceil(GROUP);
        let out = Columns(y.as_mut_ptr());
        (0..groups.div_ceil(groups_per_task))
            .into_par_iter()
            .for_each(|t| {
                let mut o = vec![[0f32; GROUP]; n];
                for g in t * groups_per_task..((t + 1) * groups_per_task).min(groups) {
                    interleaved::group_product(isa, self.format, &self.blocks, nb, g, xs, &mut o);
                    let real = GROUP.min(self.rows - g * GROUP);
                    for (i, lanes) in o.iter().enumerate() {
                        for (l, v) in lanes[..real].iter().enumerate() {
                            // SAFETY: `i < n` and `g * GROUP + l < rows`, so the element
                            // lies inside `y` (`n * rows` long, alive until every task is
                            // done), and the group's columns are written by this task alone.
                            unsafe { out.at(i * self.rows + g * GROUP + l).write(*v) };
                        }
                    }
                }
            });
    }

    /// Weight rows per dequantized tile: at most [`TILE_BYTES`] of f32, and a count of
    /// tiles that is a multiple of [`PARTITION_THREADS`] (at least two each), so that
    /// both cores of a two-thread machine finish together; a multiple of 8 rows. Not the
    /// pool's size: the tile's width changes how `gemm` blocks its sums.
    fn tile_rows(&self) -> usize {
        let threads = PARTITION_THREADS;
        let cap = (TILE_BYTES / 4 / self.cols).max(8);
        let tiles = self
            .rows
            .div_ceil(cap)
            .max(2 * threads)
            .next_multiple_of(threads);
        self.rows
            .div_ceil(tiles)
            .next_multiple_of(8)
            .clamp(8, cap.next_multiple_of(8))
    }

    /// `x` `(n, cols)` -> `(n, rows)` through f32 tiles of the weight and `gemm`.
    ///
    /// Panics if `x` is not `n * cols` long.
    pub fn tiled_product(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "activations do not fit the matrix");
        thread_local! {
            static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        let (cols, tr) = (self.cols, self.tile_rows());
        let tiles: Vec<(usize, Vec<f32>)> = (0..self.rows.div_ceil(tr))
            .into_par_iter()
            .map(|t| {
                let (r0, r1) = (t * tr, ((t + 1) * tr).min(self.rows));
                let m = r1 - r0;
                let mut dst = vec![0f32; n * m];
                TILE.with_borrow_mut(|buf| {
                    buf.resize(m * cols, 0.0);
                    self.dequantize_rows(r0, r1, &mut buf[..m * cols]);
                    // SAFETY: `dst` is `(n, m)` with row stride `m`, `x` is `(n, cols)` with
                    // row stride `cols` (checked above), and the tile `(m, cols)` row-major
                    // is read as the `(cols, m)` right operand: element (k, j) at
                    // `j * cols + k`. Every index stays inside its buffer.
                    unsafe {
                        gemm_f32(
                            n,
                            m,
                            cols,
                            dst.as_mut_ptr(),
                            m,
                            x.as_ptr(),
                            cols,
                            buf.as_ptr(),
                            (cols, 1),
                        );
                    }
                });
                (r0, dst)
            })
            .collect();
        let mut y = vec![0f32; n * self.rows];
        for (r0, dst) in tiles {
            let m = dst.len() / n.max(1);
            for (i, row) in dst.chunks_exact(m.max(1)).enumerate() {
                y[i * self.rows + r0..][..row.len()].copy_from_slice(row);
            }
        }
        y
    }
}

/// `dst (m, n) = lhs (m, k) * rhs (k, n)` on this thread, `dst` and `lhs` row-major with
/// row strides `dst_rs` and `lhs_rs`, `rhs` element (i, j) at `i * rhs_rs + j * rhs_cs`
/// for `(rhs_cs, rhs_rs)`.
///
/// # Safety
/// Every element so addressed must lie inside its buffer.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    lhs: *const f32,
    lhs_rs: usize,
    rhs: *const f32,
    (rhs_cs, rhs_rs): (usize, usize),
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        false,
        lhs,
        1,
        lhs_rs as isize,
        rhs,
        rhs_cs as isize,
        rhs_rs as isize,
        0.0,
        1.0,
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

/// The output `(n, rows)` of one product, whose tasks each write the columns of their
/// own weight rows.
#[derive(Clone, Copy)]
struct Columns(*mut f32);

// SAFETY: the tasks of one product write disjoint elements through it (their own
// columns), and the buffer outlives them (the parallel loop returns before it is read).
unsafe impl Send for Columns {}
unsafe impl Sync for Columns {}

impl Columns {
    /// Element `i` (a method, so that closures capture the whole wrapper).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::*;

    /// A deterministic stream of `u32`s.
    fn lcg(seed: u32) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            s >> 8
        }
    }

    fn floats(n: usize, seed: u32, amp: f32) -> Vec<f32> {
        let mut next = lcg(seed);
        (0..n)
            .map(|_| (next() as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * amp)
            .collect()
    }

    /// Random blocks of `format`, every byte pattern allowed (Q8_0 codes include -128,
    /// Q4_1 codes all of 0..16), scales of both signs.
    fn random_blocks(format: Format, rows: usize, cols: usize, seed: u32) -> BlockMatrix {
        let mut next = lcg(seed);
        let mut blocks = Vec::new();
        let scales = if format == Format::Q4_1 { 2 } else { 1 };
        for _ in 0..rows * cols / QK {
            let scale = |v: u32| half::f16::from_f32((v % 2001) as f32 / 1000.0 - 1.0);
            blocks.extend(scale(next()).to_le_bytes());
            if format == Format::Q4_1 {
                blocks.extend(scale(next()).to_le_bytes());
            }
            blocks.extend((0..format.block_bytes() - 2 * scales).map(|_| next() as u8));
        }
        BlockMatrix::from_blocks(format, blocks, rows, cols).unwrap()
    }

    /// `W x` in f64 over the independently dequantized weight, and `sum |w| |x|` of each
    /// output (the scale of f32 rounding error).
    fn exact(w: &[f32], x: &[f32], rows: usize, cols: usize) -> (Vec<f64>, Vec<f64>) {
        let mut y = Vec::new();
        let mut scale = Vec::new();
        for xi in x.chunks_exact(cols) {
            for r in 0..rows {
                let terms = (0..cols).map(|c| w[r * cols + c] as f64 * xi[c] as f64);
                y.push(terms.clone().sum());
                scale.push(terms.map(f64::abs).sum());
            }
        }
        (y, scale)
    }

    #[test]
    fn every_instruction_set_computes_the_portable_floats() {
        for format in Format::ALL {
            // 70 rows: five groups, the last one padded; 3 and 18 blocks per row
            for (rows, cols) in [(70, 96), (9, 576)] {
                let m = random_blocks(format, rows, cols, 11 + cols as u32);
                // 5 rows: one pass on every set; 17: passes of 8, 8 and 1 on AVX-512, of
                // 4 and a remainder of 1 on the 256-bit sets
                for n in [5, 17] {
                    let mut x = floats(n * cols, 5, 40.0);
                    x[3] = 1e4; // one block whose other codes round to zero
                    let reference = m.quantized_product(&x, n, Isa::Portable);
                    for isa in Isa::available() {
                        let got = m.quantized_product(&x, n, isa);
                        assert!(
                            got.iter()
                                .zip(&reference)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{format:?} {rows}x{cols}, {n} rows: {isa} differs from the portable loop"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn sums_at_their_extremes_are_exact_on_every_instruction_set() {
        // Every code at its largest (Q4_1 15, Q5_0 31: the value 15) against activations
        // that all quantize to 127 or all to -127: the largest integer sums a Q4_1 block
        // or a Q5_0 half block can have (AVX2 holds them in i16 lanes).
        let (rows, cols) = (16, 64);
        for format in [Format::Q4_1, Format::Q5_0] {
            let mut blocks = Vec::new();
            for _ in 0..rows * cols / QK {
                blocks.extend(half::f16::from_f32(1.0).to_le_bytes());
                if format == Format::Q4_1 {
                    blocks.extend(half::f16::from_f32(0.0).to_le_bytes());
                } else {
                    blocks.extend([0xFFu8; 4]); // every fifth bit set
                }
                blocks.extend([0xFFu8; QK / 2]);
            }
            let m = BlockMatrix::from_blocks(format, blocks, rows, cols).unwrap();
            let x: Vec<f32> = [1.0f32, -1.0].iter().flat_map(|&v| vec![v; cols]).collect();
            for isa in Isa::available() {
                let y = m.quantized_product(&x, 2, isa);
                // Each output is sum(15 * 127) * d_x over the row, d_x = 1 / 127.
                let want = 15.0 * cols as f32;
                for (i, v) in y.iter().enumerate() {
                    let sign = if i < rows { 1.0 } else { -1.0 };
                    assert!((v - sign * want).abs() < 1e-3, "{format:?} {isa}: {i}: {v}");
                }
            }
        }
    }

    #[test]
    fn tiled_products_are_the_same_on_every_pool_size() {
        // 1,536 columns: past 512, where gemm's blocking of the sums depends on the
        // tile's width; 576 rows: tiles that would shrink with more threads
        let (rows, cols, n) = (576, 1536, 29);
        let m = random_blocks(Format::Q8_0, rows, cols, 7);
        let x = floats(n * cols, 13, 2.0);
        let on = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| (m.tile_rows(), m.tiled_product(&x, n)))
        };
        let (tile, one) = on(1);
        for threads in [2, 3, 16, 64] {
            let (t, y) = on(threads);
            assert_eq!(t, tile, "{threads} threads");
            assert!(
                y.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{threads} threads"
            );
        }
    }

    #[test]
    fn a_row_gives_the_same_bits_in_any_batch() {
        // up to 33 rows: passes of 8 or 4 with remainders
        let (rows, cols, n) = (33, 64, 33);
        for format in Format::ALL {
            let m = random_blocks(format, rows, cols, 3);
            let x = floats(n * cols, 9, 3.0);
            for isa in Isa::available() {
                let all = m.quantized_product(&x, n, isa);
                for k in [1, 2, 3, 5, 8, 15, 16, 17, 32] {
                    let some = m.quantized_product(&x[..k * cols], k, isa);
                    assert_eq!(some, all[..k * rows], "{format:?} {isa}: {k} rows");
                }
                for i in 0..n {
                    let one = m.quantized_product(&x[i * cols..(i + 1) * cols], 1, isa);
                    assert_eq!(
                        one,
                        all[i * rows..(i + 1) * rows],
                        "{format:?} {isa}: row {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn quantized_products_are_close_to_the_exact_product() {
        for format in Format::ALL {
            let (rows, cols) = (40, 128);
            let m = random_blocks(format, rows, cols, 21);
            let w = m.dequantize();
            let x = floats(3 * cols, 22, 1.0);
            let (want, _) = exact(&w, &x, rows, cols);
            let got = m.quantized_product(&x, 3, Isa::active());
            // Only the activations are rounded: at most half a step (max|x| / 254) per
            // element, times |w| (below 16 here for Q4_1 and Q5_0, 128 for Q8_0).
            let bound = cols as f64 / 254.0 * if format == Format::Q8_0 { 128.0 } else { 16.0 };
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - e).abs() < bound * 0.2,
                    "{format:?} {i}: {g} vs {e}"
                );
            }
        }
    }

    #[test]
    fn tiled_products_match_the_exact_product() {
        for format in Format::ALL {
            // 100 rows: tiles that do not divide them; 8 and 37 activation rows.
            let (rows, cols) = (100, 192);
            let m = random_blocks(format, rows, cols, 31);
            let w = m.dequantize();
            for n in [8, 37] {
                let x = floats(n * cols, 32 + n as u32, 2.0);
                let got = m.tiled_product(&x, n);
                let (want, scale) = exact(&w, &x, rows, cols);
                // f32 sums of `cols` products: within `cols * 2^-24` of `sum |w| |x|`
                // (the classic bound), doubled.
                let bound = 2.0 * cols as f64 * f32::EPSILON as f64 / 2.0;
                for (i, ((g, e), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
                    assert!(
                        (*g as f64 - e).abs() <= bound * s,
                        "{format:?} n={n} {i}: {g} vs {e}"
                    );
                }
                // Prefill's product is the integer kernels'.
                assert_eq!(m.matmul(&x, n), m.quantized_product(&x, n, Isa::active()));
            }
        }
    }

    /// `q` dequantized by candle, flat.
    fn candle_values(q: &QTensor) -> Vec<f32> {
        let t = q.dequantize(&Device::Cpu).unwrap();
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn blocks_dequantize_and_quantize_as_candle_does() {
        let (rows, cols) = (6, 96);
        let data = floats(rows * cols, 41, 3.0);
        let t = Tensor::from_vec(data.clone(), (rows, cols), &Device::Cpu).unwrap();
        for (dtype, format) in [
            (GgmlDType::Q4_1, Format::Q4_1),
            (GgmlDType::Q5_0, Format::Q5_0),
            (GgmlDType::Q8_0, Format::Q8_0),
        ] {
            let q = QTensor::quantize(&t, dtype).unwrap();
            let raw = q.data().unwrap().into_owned();
            if format == Format::Q8_0 {
                assert_eq!(quantize_q8_0(&data), raw, "Q8_0 codes differ from candle's");
            }
            let m = BlockMatrix::from_blocks(format, raw, rows, cols).unwrap();
            let candle = candle_values(&q);
            let ours = m.dequantize();
            assert!(ours
                .iter()
                .zip(&candle)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let mut row = vec![0f32; cols];
            m.dequantize_row(4, &mut row).unwrap();
            assert_eq!(row, candle[4 * cols..5 * cols]);
            assert!(m.dequantize_row(rows, &mut row).is_none());
        }
    }

    #[test]
    fn q4_k_blocks_become_q4_1_blocks_of_the_same_values() {
        // candle quantizes to Q4_K and dequantizes with ggml's formula; the Q4_1 blocks
        // must give each value up to the f16 rounding of its sub-block's scale and
        // minimum: at most 2^-11 of |d| * 15 + |m|, itself at most 3 max |w| of the
        // sub-block.
        let (rows, cols) = (5, 512);
        let mut data = floats(rows * cols, 51, 2.0);
        data.iter_mut().step_by(7).for_each(|v| *v += 1.5); // sub-blocks with offsets
        let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q4K).unwrap();
        let want = candle_values(&q);
        let raw = q.data().unwrap().into_owned();
        let m = BlockMatrix::from_q4_k(&raw, rows, cols).unwrap();
        // Held in one group of sixteen rows, the last eleven padding.
        assert_eq!((m.format(), m.bytes()), (Format::Q4_1, 16 * cols / QK * 20));
        let got = m.dequantize();
        for (b, (g, w)) in got.chunks(QK).zip(want.chunks(QK)).enumerate() {
            let amax = w.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (x, y) in g.iter().zip(w) {
                assert!(
                    (x - y).abs() <= 3.0 * amax / 2048.0 + 1e-7,
                    "sub-block {b}: {x} vs {y}"
                );
            }
        }
        assert!(BlockMatrix::from_q4_k(&raw, rows, cols - 256).is_none());
        assert!(BlockMatrix::from_q4_k(&raw[1..], rows, cols).is_none());
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused() {
        assert!(BlockMatrix::quantize_q8_0(&[0.0; 48], 1, 48).is_none());
        assert!(BlockMatrix::from_blocks(Format::Q4_1, vec![0; 19], 1, 32).is_none());
        assert!(BlockMatrix::from_blocks(Format::Q8_0, vec![0; 34], usize::MAX, 32).is_none());
        let a = random_blocks(Format::Q4_1, 2, 32, 1);
        let b = random_blocks(Format::Q8_0, 2, 32, 1);
        assert!(BlockMatrix::stack(vec![a.clone(), b.clone()]).is_none());
        let e = random_blocks(Format::Q4_1, 3, 32, 4);
        let s = BlockMatrix::stack(vec![a.clone(), e.clone()]).unwrap();
        // Q4_1 is held in groups of sixteen rows: 5 rows take one group.
        assert_eq!((s.rows(), s.cols(), s.bytes()), (5, 32, 16 * 20));
        let mut want = a.dequantize();
        want.extend(e.dequantize());
        assert_eq!(s.dequantize(), want);
        // Q5_0 beside Q8_0 stacks as Q8_0, with every value kept.
        let c = random_blocks(Format::Q5_0, 3, 64, 2);
        let d = random_blocks(Format::Q8_0, 2, 64, 5);
        let s = BlockMatrix::stack(vec![c.clone(), d.clone()]).unwrap();
        // Q8_0 is held in groups of sixteen rows too.
        assert_eq!(
            (s.format(), s.rows(), s.bytes()),
            (Format::Q8_0, 5, 16 * 68)
        );
        let mut want = c.dequantize();
        want.extend(d.dequantize());
        assert_eq!(s.dequantize(), want);
        assert!(BlockMatrix::stack(vec![b, c]).is_none(), "widths 32 and 64");
    }
}
