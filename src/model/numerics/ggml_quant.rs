//! ggml's quantized matrix products bit for bit, for
//! [`Numerics::Ggml`](crate::model::Numerics::Ggml): the weight's own integer codes times
//! the input quantized as ggml quantizes it, with ggml's float accumulation order.
//!
//! Which kernel llama.cpp's CPU backend (x86, AVX2 and up) runs depends on the weight type:
//!
//! - `Q5_0` and `Q8_0` weights (tinyBLAS, any number of rows): the input row in `Q8_0`
//!   blocks of 32; per block, eight float lanes, lane `l` taking the integer dot product
//!   of codes `4l..4l + 3`, each lane accumulated as `fma(d_w d_x, lane, acc)`; then the
//!   lanes summed pairwise (`hsum8`).
//! - `Q4_K` and `Q6_K` weights (`ggml_vec_dot_q4_K_q8_K` / `_q6_K_q8_K`, AVX2): the input
//!   in `Q8_K` blocks of 256; per block, eight integer lanes, lane `l` taking codes
//!   `32c + 4l..32c + 4l + 3` of every 32-code chunk `c` times their sub-block scale
//!   (`Q6_K` subtracting its offset of 32 through the block sums, two sub-blocks per
//!   lane), then `fma(d_w d_x, lane, acc)` and `hsum8`; `Q4_K`'s minimums go through
//!   four more lanes.
//!
//! llama.cpp uses these kernels for K-quant weights only when it neither repacks them
//! (`--no-repack`) nor takes its tiled K-quant path for batches of 8 rows and more
//! (`GGML_CPU_TILED_MM=0`); the parity runner starts it so. Each kernel was checked
//! against tensors dumped from llama.cpp's graph on Gemma-3-270M: identical on every
//! sampled output.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::model::numerics::kernels::blocks::q4_k_scale_min;
use crate::Result;

/// Codes per `Q8_0` / `Q5_0` block.
const QK0: usize = 32;
/// Codes per K-quant block.
const QK: usize = 256;

/// The eight float lanes of an AVX register summed as ggml's `hsum_float_8`: lane `i`
/// plus lane `i + 4`, then `(0 + 2) + (1 + 3)`.
fn hsum8(l: &[f32; 8]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|i| l[i] + l[i + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// A weight `(out, in)` as its integer codes and block scales.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    blocks: Blocks,
}

/// Per-row blocks, row-major.
#[derive(Debug, Clone)]
enum Blocks {
    /// `Q5_0` or `Q8_0`: a scale and 32 signed codes per block (`Q5_0`'s offset of 16
    /// already subtracted).
    Q0 { d: Vec<f32>, q: Vec<i8> },
    /// `Q4_K`: scale, minimum scale, 8 six-bit sub-block scales and minimums, 256 codes
    /// `0..16` per block.
    Q4K {
        d: Vec<f32>,
        dmin: Vec<f32>,
        scales: Vec<i32>,
        mins: Vec<i32>,
        q: Vec<i32>,
    },
    /// `Q6_K`: scale, 16 signed sub-block scales, 256 codes `0..64` per block.
    Q6K {
        d: Vec<f32>,
        scales: Vec<i32>,
        q: Vec<i32>,
    },
}

fn half(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

impl QuantMatrix {
    /// The codes of a 2-D GGUF tensor `(out, in)`, or `None` for a type without an exact
    /// kernel here.
    pub fn from_qtensor(t: &QTensor) -> Result<Option<Self>> {
        let (rows, cols) = t.shape().dims2()?;
        let raw = t.data()?;
        let blocks = match t.dtype() {
            GgmlDType::Q8_0 => {
                let (mut d, mut q) = (Vec::new(), Vec::with_capacity(rows * cols));
                for b in raw.chunks_exact(2 + QK0) {
                    d.push(half(b));
                    q.extend(b[2..].iter().map(|&c| c as i8));
                }
                Blocks::Q0 { d, q }
            }
            GgmlDType::Q5_0 => {
                let (mut d, mut q) = (Vec::new(), Vec::with_capacity(rows * cols));
                for b in raw.chunks_exact(6 + QK0 / 2) {
                    d.push(half(b));
                    let high = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                    let (qs, mut codes) = (&b[6..], [0i8; QK0]);
                    for j in 0..QK0 / 2 {
                        let lo = (qs[j] & 0x0f) as u32 | (((high >> j) << 4) & 0x10);
                        let hi = (qs[j] >> 4) as u32 | ((high >> (j + 12)) & 0x10);
                        codes[j] = lo as i8 - 16;
                        codes[j + QK0 / 2] = hi as i8 - 16;
                    }
                    q.extend_from_slice(&codes);
                }
                Blocks::Q0 { d, q }
            }
            GgmlDType::Q4K => {
                let n = raw.len() / 144;
                let (mut d, mut dmin) = (Vec::with_capacity(n), Vec::with_capacity(n));
                let (mut scales, mut mins) = (Vec::with_capacity(8 * n), Vec::with_capacity(8 * n));
                let mut q = Vec::with_capacity(QK * n);
                for b in raw.chunks_exact(144) {
                    d.push(half(&b[0..2]));
                    dmin.push(half(&b[2..4]));
                    for j in 0..8 {
                        let (sc, m) = q4_k_scale_min(&b[4..16], j);
                        scales.push(sc as i32);
                        mins.push(m as i32);
                    }
                    for chunk in b[16..].chunks_exact(32) {
                        q.extend(chunk.iter().map(|&c| (c & 0x0f) as i32));
                        q.extend(chunk.iter().map(|&c| (c >> 4) as i32));
                    }
                }
                Blocks::Q4K {
                    d,
                    dmin,
                    scales,
                    mins,
                    q,
                }
            }
            GgmlDType::Q6K => {
                let n = raw.len() / 210;
                let (mut d, mut scales) = (Vec::with_capacity(n), Vec::with_capacity(16 * n));
                let mut q = Vec::with_capacity(QK * n);
                for b in raw.chunks_exact(210) {
                    let (ql, qh) = (&b[0..128], &b[128..192]);
                    scales.extend(b[192..208].iter().map(|&s| s as i8 as i32));
                    d.push(half(&b[208..210]));
                    let mut codes = [0i32; QK];
                    for half in 0..2 {
                        let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
                        let out = &mut codes[128 * half..];
                        for l in 0..32 {
                            let h = qh[l] as i32;
                            out[l] = (ql[l] & 0x0f) as i32 | ((h & 3) << 4);
                            out[l + 32] = (ql[l + 32] & 0x0f) as i32 | (((h >> 2) & 3) << 4);
                            out[l + 64] = (ql[l] >> 4) as i32 | (((h >> 4) & 3) << 4);
                            out[l + 96] = (ql[l + 32] >> 4) as i32 | (((h >> 6) & 3) << 4);
                        }
                    }
                    q.extend_from_slice(&codes);
                }
                Blocks::Q6K { d, scales, q }
            }
            _ => return Ok(None),
        };
        Ok(Some(Self { rows, cols, blocks }))
    }

    /// `x` `(n, in)` f32 -> `(n, out)`, each output as ggml computes it.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let input: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let mut y = vec![0f32; n * self.rows];
        for (row, out) in input.chunks(self.cols).zip(y.chunks_mut(self.rows)) {
            let act = match self.blocks {
                Blocks::Q0 { .. } => Q8Blocks::q8_0(row),
                Blocks::Q4K { .. } | Blocks::Q6K { .. } => Q8Blocks::q8_k(row),
            };
            out.par_iter_mut()
                .enumerate()
                .for_each(|(o, y)| *y = self.dot_row(o, &act));
        }
        Ok(Tensor::from_vec(y, (n, self.rows), &Device::Cpu)?)
    }

    /// Output `o`: weight row `o` times the quantized input row `act`.
    fn dot_row(&self, o: usize, act: &Q8Blocks) -> f32 {
        match &self.blocks {
            Blocks::Q0 { d, q } => {
                let (b0, b1) = (o * self.cols / QK0, (o + 1) * self.cols / QK0);
                dot_q0(&d[b0..b1], &q[QK0 * b0..QK0 * b1], act)
            }
            Blocks::Q4K {
                d,
                dmin,
                scales,
                mins,
                q,
            } => {
                let (b0, b1) = (o * self.cols / QK, (o + 1) * self.cols / QK);
                let w = Q4KRow {
                    d: &d[b0..b1],
                    dmin: &dmin[b0..b1],
                    scales: &scales[8 * b0..8 * b1],
                    mins: &mins[8 * b0..8 * b1],
                    q: &q[QK * b0..QK * b1],
                };
                dot_q4_k(&w, act)
            }
            Blocks::Q6K { d, scales, q } => {
                let (b0, b1) = (o * self.cols / QK, (o + 1) * self.cols / QK);
                dot_q6_k(
                    &d[b0..b1],
                    &scales[16 * b0..16 * b1],
                    &q[QK * b0..QK * b1],
                    act,
                )
            }
        }
    }
}

/// An input row quantized for a dot product: per block a scale, the codes, and (`Q8_K`)
/// the sums of each 16 codes.
pub(crate) struct Q8Blocks {
    d: Vec<f32>,
    q: Vec<i32>,
    sums: Vec<i32>,
}

impl Q8Blocks {
    /// ggml's x86 `quantize_row_q8_0`: scale `amax / 127` rounded to f16, codes
    /// `round(x * (127 / amax))`, ties to even.
    pub(crate) fn q8_0(x: &[f32]) -> Self {
        let (mut d, mut q) = (Vec::new(), Vec::with_capacity(x.len()));
        for block in x.chunks(QK0) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            d.push(f16::from_f32(amax / 127.0).to_f32());
            let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            q.extend(block.iter().map(|v| (v * inv).round_ties_even() as i32));
        }
        Self {
            d,
            q,
            sums: Vec::new(),
        }
    }

    /// ggml's `quantize_row_q8_K`: `iscale = -127 / max` (`max` the signed value of
    /// largest magnitude), codes `min(127, round(iscale x))`, scale `1 / iscale`.
    pub(crate) fn q8_k(x: &[f32]) -> Self {
        let (mut d, mut q, mut sums) = (Vec::new(), Vec::with_capacity(x.len()), Vec::new());
        for block in x.chunks(QK) {
            let (mut amax, mut max) = (0f32, 0f32);
            for &v in block {
                if v.abs() > amax {
                    (amax, max) = (v.abs(), v);
                }
            }
            let start = q.len();
            if amax == 0.0 {
                d.push(0.0);
                q.extend(std::iter::repeat_n(0, block.len()));
            } else {
                let iscale = -127.0 / max;
                d.push(1.0 / iscale);
                q.extend(
                    block
                        .iter()
                        .map(|v| ((iscale * v).round_ties_even() as i32).min(127)),
                );
            }
            sums.extend(q[start..].chunks(16).map(|c| c.iter().sum::<i32>()));
        }
        Self { d, q, sums }
    }

    /// The values the codes stand for, `d * code`.
    pub(crate) fn dequantize(&self) -> Vec<f32> {
        let block = self.q.len() / self.d.len().max(1);
        self.q
            .iter()
            .enumerate()
            .map(|(i, &c)| self.d[i / block] * c as f32)
            .collect()
    }
}

/// One `Q5_0`/`Q8_0` weight row (`d` per block, 32 codes per block) times `x`.
fn dot_q0(d: &[f32], q: &[i8], x: &Q8Blocks) -> f32 {
    let mut acc = [0f32; 8];
    for (b, (wd, wq)) in d.iter().zip(q.chunks_exact(QK0)).enumerate() {
        let scale = wd * x.d[b];
        let xq = &x.q[b * QK0..(b + 1) * QK0];
        for (l, lane) in acc.iter_mut().enumerate() {
            let s: i32 = (4 * l..4 * l + 4).map(|i| wq[i] as i32 * xq[i]).sum();
            *lane = scale.mul_add(s as f32, *lane);
        }
    }
    hsum8(&acc)
}

/// One `Q4_K` weight row's blocks.
struct Q4KRow<'a> {
    d: &'a [f32],
    dmin: &'a [f32],
    scales: &'a [i32],
    mins: &'a [i32],
    q: &'a [i32],
}

/// Integer lanes of one K-quant block: lane `l` sums `scale(v) q_w[v] q_x[v]` over the
/// codes `v` with `(v % 32) / 4 == l`; `scale_of` maps a code index to its sub-block's.
fn k_lanes(wq: &[i32], xq: &[i32], scale_of: impl Fn(usize) -> i32) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for (chunk, (w, x)) in wq.chunks_exact(32).zip(xq.chunks_exact(32)).enumerate() {
        for (l, lane) in lanes.iter_mut().enumerate() {
            // Four consecutive codes never straddle a 16-code sub-block.
            let v = 32 * chunk + 4 * l;
            let s: i32 = (4 * l..4 * l + 4).map(|i| w[i] * x[i]).sum();
            *lane += scale_of(v) * s;
        }
    }
    lanes
}

/// One `Q4_K` weight row times `x` (`Q8_K`).
fn dot_q4_k(w: &Q4KRow, x: &Q8Blocks) -> f32 {
    let (mut acc, mut acc_min) = ([0f32; 8], [0f32; 4]);
    for b in 0..w.d.len() {
        let (scales, mins) = (&w.scales[8 * b..8 * b + 8], &w.mins[8 * b..8 * b + 8]);
        let sums = &x.sums[16 * b..16 * b + 16];
        let d = x.d[b] * w.d[b];
        let dmin = -x.d[b] * w.dmin[b];
        for (k, lane) in acc_min.iter_mut().enumerate() {
            let pair = |i: usize| mins[i] * (sums[2 * i] + sums[2 * i + 1]);
            *lane = dmin.mul_add((pair(2 * k) + pair(2 * k + 1)) as f32, *lane);
        }
        let lanes = k_lanes(
            &w.q[QK * b..QK * (b + 1)],
            &x.q[QK * b..QK * (b + 1)],
            |v| scales[v / 32],
        );
        for (a, l) in acc.iter_mut().zip(lanes) {
            *a = d.mul_add(l as f32, *a);
        }
    }
    hsum8(&acc) + ((acc_min[0] + acc_min[2]) + (acc_min[1] + acc_min[3]))
}

/// One `Q6_K` weight row (`d` per block, 16 scales and 256 codes per block) times `x`.
fn dot_q6_k(d: &[f32], scales: &[i32], q: &[i32], x: &Q8Blocks) -> f32 {
    let mut acc = [0f32; 8];
    for (b, wd) in d.iter().enumerate() {
        let sc = &scales[16 * b..16 * b + 16];
        let sums = &x.sums[16 * b..16 * b + 16];
        let mut lanes = k_lanes(&q[QK * b..QK * (b + 1)], &x.q[QK * b..QK * (b + 1)], |v| {
            sc[v / 16]
        });
        for (k, lane) in lanes.iter_mut().enumerate() {
            *lane -= 32 * (sums[2 * k] * sc[2 * k] + sums[2 * k + 1] * sc[2 * k + 1]);
        }
        let scale = x.d[b] * wd;
        for (a, l) in acc.iter_mut().zip(lanes) {
            *a = scale.mul_add(l as f32, *a);
        }
    }
    hsum8(&acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::numerics::ggml::tests::pseudo;

    #[test]
    fn hsum8_pairs_lanes_four_apart() {
        // Left to right each 1 is lost against 2^24; paired (1 + 1 first) it is kept.
        let lanes = [16_777_216.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        assert_eq!(lanes.iter().fold(0f32, |s, v| s + v), 16_777_216.0);
        assert_eq!(hsum8(&lanes), 16_777_218.0);
    }

    /// Every supported type against an independent product: candle's dequantized weight
    /// times the input rounded to the same 8-bit grid, summed in f64.
    #[test]
    fn exact_kernels_match_dequantized_products() -> Result<()> {
        let (out, inp) = (8, 512);
        let w = Tensor::from_vec(pseudo(out * inp, 1), (out, inp), &Device::Cpu)?;
        let x = pseudo(3 * inp, 2);
        for dtype in [
            GgmlDType::Q8_0,
            GgmlDType::Q5_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ] {
            let qt = QTensor::quantize(&w, dtype)?;
            let m = QuantMatrix::from_qtensor(&qt)?.expect("supported");
            let got: Vec<Vec<f32>> = m
                .forward(&Tensor::from_vec(x.clone(), (3, inp), &Device::Cpu)?)?
                .to_vec2()?;
            let dense: Vec<Vec<f32>> = qt.dequantize(&Device::Cpu)?.to_vec2()?;
            for (r, row) in x.chunks(inp).enumerate() {
                let act = match dtype {
                    GgmlDType::Q8_0 | GgmlDType::Q5_0 => Q8Blocks::q8_0(row),
                    _ => Q8Blocks::q8_k(row),
                };
                let xr: Vec<f64> = act.dequantize().iter().map(|&v| v as f64).collect();
                for (o, wrow) in dense.iter().enumerate() {
                    let want: f64 = wrow.iter().zip(&xr).map(|(a, b)| *a as f64 * b).sum();
                    let diff = (got[r][o] as f64 - want).abs();
                    assert!(
                        diff < 1e-4 * want.abs().max(1.0),
                        "{dtype:?} {r}/{o}: {diff}"
                    );
                }
            }
        }
        assert!(QuantMatrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q4_1)?)?.is_none());
        Ok(())
    }
}
