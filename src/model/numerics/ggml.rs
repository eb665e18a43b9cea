//! llama.cpp's CPU arithmetic (ggml on x86, its AVX-512 and its AVX2 paths: [`Simd`]), so
//! that [`Numerics::Ggml`](crate::model::Numerics::Ggml) can follow llama.cpp token for
//! token. Each piece was checked against tensors dumped from llama.cpp's graph (0.3.36,
//! an AVX-512 build, run as the parity runner runs it: `-fa off -ctk f32 -ctv f32
//! --no-repack`, `GGML_CPU_TILED_MM=0`) on Gemma-3-270M: bit-identical. The AVX2 path
//! differs only in register width, lane-sum orders and `exp`; its pieces are checked
//! against the AVX2 instructions themselves (tests) and end to end by the parity test.
//!
//! - **quantized matmuls**: [`crate::model::numerics::ggml_quant`] for `Q5_0`, `Q8_0`, `Q4_K` and
//!   `Q6_K` weights. For other types the input is only rounded to the 8-bit grid ggml
//!   quantizes it to ([`InputGrid`]) and multiplied by the dequantized weight in f32,
//!   which is ggml's integer dot product up to summation order (~1e-7 relative). (candle,
//!   and so mistral.rs, scales its `Q8_K` codes by `max / 128` where ggml now uses
//!   `max / 127`: a different grid, so different rounding in every K-quant matmul.)
//! - **GELU** ([`gelu`]): ggml rounds the input to f16 and looks the f16-rounded GELU up
//!   in a 65,536-entry table.
//! - **RMSNorm** ([`rms_norm`]): the sum of squares in f64, then `x * (1 / sqrt(mean +
//!   eps)) * w` in f32 (candle sums in f32 and divides).
//! - **attention scores and values** ([`Simd::dot`], [`Simd::weighted_rows`],
//!   [`Simd::softmax_in_place`]): ggml's summation orders (four register-wide
//!   accumulators for `q . k`, one for `p . v`), its vectorised `exp` ([`Simd::expf`]) and
//!   its softmax sums per register of keys in f64.
//!
//! The 8-bit codes and the f16 table are relative errors of ~2^-8 and 2^-11 per element;
//! the rest are last-bit differences, which matter because each can flip an 8-bit
//! rounding downstream, and on Gemma-3-270M one flip grows to hidden states ~3% apart
//! within three layers.

use std::sync::OnceLock;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use half::f16;

use crate::model::numerics::ggml_quant::Q8Blocks;
use crate::{Error, Result};

/// The grid ggml rounds a matmul's input `(rows, in)` to before its dot products with a
/// weight of a given type (the type's `vec_dot_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputGrid {
    /// f32 weights: the input stays f32.
    F32,
    /// f16 weights: the input is rounded to f16.
    F16,
    /// `Q8_0`: blocks of 32 values, codes `round(x * 127 / amax)` (ties to even), scale
    /// `amax / 127` stored as f16. `Q8_1` (for `Q4_1`/`Q5_1` weights) has the same codes
    /// and scale, plus a block sum that ggml stores as f16 and that is kept exact here.
    Q8_0,
    /// `Q8_K`: blocks of 256 values, codes `min(127, round(-127 x / max))` (ties to even)
    /// where `max` is the signed value of largest magnitude, scale `-max / 127` in f32.
    Q8K,
}

impl InputGrid {
    /// The grid for a weight of type `dtype`.
    pub fn for_weight(dtype: GgmlDType) -> Result<Self> {
        use GgmlDType as T;
        Ok(match dtype {
            T::F32 => Self::F32,
            T::F16 => Self::F16,
            T::Q4_0 | T::Q4_1 | T::Q5_0 | T::Q5_1 | T::Q8_0 => Self::Q8_0,
            T::Q2K | T::Q3K | T::Q4K | T::Q5K | T::Q6K => Self::Q8K,
            T::BF16 | T::Q8_1 | T::Q8K => {
                return Err(Error::invalid(
                    "weight type",
                    format!("{dtype:?} weights have no ggml-numerics emulation"),
                ))
            }
        })
    }

    /// `x` `(rows, in)` f32 rounded to this grid and back to f32 (same shape).
    pub fn round_trip(self, x: &Tensor) -> Result<Tensor> {
        let (block, quantize): (usize, fn(&[f32]) -> Q8Blocks) = match self {
            Self::F32 => return Ok(x.clone()),
            Self::F16 => return Ok(x.to_dtype(DType::F16)?.to_dtype(DType::F32)?),
            Self::Q8_0 => (32, Q8Blocks::q8_0),
            Self::Q8K => (256, Q8Blocks::q8_k),
        };
        let width = x.dim(x.rank() - 1)?;
        if width % block != 0 {
            return Err(Error::invalid(
                "matmul input",
                format!("width {width} is not a multiple of {self:?}'s block of {block}"),
            ));
        }
        let values: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let rounded: Vec<f32> = values
            .chunks(width)
            .flat_map(|row| quantize(row).dequantize())
            .collect();
        Ok(Tensor::from_vec(rounded, x.shape(), x.device())?)
    }
}

/// `0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))` in f32, term by term as ggml
/// fills its table.
fn gelu_tanh(x: f32) -> f32 {
    const COEF_A: f32 = 0.044715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    // ggml's build contracts `1 + a x x` into one fused multiply-add.
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// The f16-rounded GELU of every f16 value, indexed by its bit pattern.
fn gelu_table() -> &'static [f16] {
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_tanh(f16::from_bits(bits).to_f32())))
            .collect()
    })
}

/// GELU (tanh approximation) of one value as ggml computes it: 0 at or below -10, the
/// input at or above 10, else the table entry of the input rounded to f16.
pub fn gelu(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        gelu_table()[usize::from(f16::from_f32(x).to_bits())].to_f32()
    }
}

/// [`gelu`] elementwise over an f32 tensor of any shape.
pub fn gelu_tensor(x: &Tensor) -> Result<Tensor> {
    let values: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let out: Vec<f32> = values.into_iter().map(gelu).collect();
    Ok(Tensor::from_vec(out, x.shape(), x.device())?)
}

/// `x` `(..., d)` RMS-normalised over its last axis and scaled by `w` `(d,)`, as ggml's
/// `rms_norm` followed by `mul`: `sum(x^2)` accumulated in f64, `mean` rounded to f32,
/// then `x * (1 / sqrt(mean + eps)) * w` in f32. Same shape as `x`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let d = x.dim(x.rank() - 1)?;
    let w: Vec<f32> = w.to_vec1()?;
    if w.len() != d {
        return Err(Error::invalid(
            "rms_norm",
            format!("weight of {} for rows of {d}", w.len()),
        ));
    }
    let mut values: Vec<f32> = x.flatten_all()?.to_vec1()?;
    for row in values.chunks_mut(d) {
        let sum: f64 = row.iter().map(|v| f64::from(v * v)).sum();
        let mean = (sum / d as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, w) in row.iter_mut().zip(&w) {
            *v = *v * scale * w;
        }
    }
    Ok(Tensor::from_vec(values, x.shape(), x.device())?)
}

/// Which of ggml's x86 code paths the attention arithmetic follows. ggml picks its f32
/// kernels when it is compiled (a native build: by the CPU it is built on), and the two
/// paths sum in different orders and compute `exp` differently, so bit-exact parity needs
/// the same path on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    /// AVX2 + FMA: 8-lane registers (`__m256`), `exp` by integer exponent arithmetic.
    Avx2,
    /// AVX-512 F + DQ: 16-lane registers (`__m512`), `exp` through `_mm512_scalef_ps`.
    Avx512,
}

/// Lanes of the widest register emulated (AVX-512's 16 f32).
const MAX_LANES: usize = 16;

/// Four registers' worth of accumulator lanes (only the path's [`Simd::lanes`] used).
type Accumulators = [[f32; MAX_LANES]; 4];

/// Environment variable that overrides [`Simd::detect`]: `avx2` or `avx512`.
pub const SIMD_ENV: &str = "HEADWISE_GGML_SIMD";

impl Simd {
    /// The name [`SIMD_ENV`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Simd::Avx2 => "avx2",
            Simd::Avx512 => "avx512",
        }
    }

    /// Lanes of one f32 register.
    pub fn lanes(self) -> usize {
        match self {
            Simd::Avx2 => 8,
            Simd::Avx512 => 16,
        }
    }

    /// The path a native ggml build takes on this CPU: AVX-512 when it has AVX-512 F and
    /// DQ (ggml's softmax needs both), AVX2 otherwise.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
        {
            return Simd::Avx512;
        }
        Simd::Avx2
    }

    /// The path a model loaded in `ggml` numerics follows unless told otherwise
    /// ([`crate::model::Model::set_ggml_simd`]): `$HEADWISE_GGML_SIMD`, else
    /// [`Simd::detect`].
    pub fn from_env() -> Result<Self> {
        match std::env::var(SIMD_ENV) {
            Ok(v) => v.parse(),
            Err(_) => Ok(Self::detect()),
        }
    }

    /// The sum of one register's lanes as ggml's softmax and tinyBLAS take it: halves
    /// added lane by lane until one is left (`_mm512_reduce_add_ps`, or AVX2's
    /// `extractf128` + `movehl` + `movehdup`): lane `i` plus lane `i + n/2`, then `+ n/4`...
    fn reduce_halves(lanes: &mut [f32]) -> f32 {
        let mut width = lanes.len() / 2;
        while width > 0 {
            for i in 0..width {
                lanes[i] += lanes[i + width];
            }
            width /= 2;
        }
        lanes[0]
    }

    /// The sum of one register's lanes at the end of `ggml_vec_dot_f32`: for AVX-512 as
    /// [`Simd::reduce_halves`]; for AVX2 the halves added, then two horizontal adds
    /// (`hadd`), which pair neighbours: `((l0 + l1) + (l2 + l3))` of the four.
    fn reduce_dot(self, lanes: &mut [f32]) -> f32 {
        match self {
            Simd::Avx512 => Self::reduce_halves(lanes),
            Simd::Avx2 => {
                let l: [f32; 4] = std::array::from_fn(|i| lanes[i] + lanes[i + 4]);
                (l[0] + l[1]) + (l[2] + l[3])
            }
        }
    }

    /// Fold four accumulators `0 + 2`, `1 + 3`, then `0 + 1` (`GGML_F32_VEC_REDUCE`) and
    /// sum the lanes of what is left by [`Simd::reduce_dot`].
    fn fold4(self, acc: &mut Accumulators) -> f32 {
        let lanes = self.lanes();
        let [a0, a1, a2, a3] = acc;
        for l in 0..lanes {
            a0[l] += a2[l];
            a1[l] += a3[l];
        }
        for l in 0..lanes {
            a0[l] += a1[l];
        }
        self.reduce_dot(&mut a0[..lanes])
    }

    /// `x . y` in the order of ggml's `ggml_vec_dot_f32` (the attention scores `q . k`):
    /// four fused multiply-add accumulators of [`Simd::lanes`] lanes over steps of four
    /// registers, folded by `Simd::fold4`. A tail past the last whole step (never there
    /// for the head sizes of the models here, 64 and 256) is added in f64, which is not
    /// ggml's order (it adds it in f32).
    pub fn dot(self, x: &[f32], y: &[f32]) -> f32 {
        debug_assert_eq!(x.len(), y.len());
        let lanes = self.lanes();
        let step = 4 * lanes;
        let whole = x.len() / step * step;
        let mut acc: Accumulators = [[0f32; MAX_LANES]; 4];
        for base in (0..whole).step_by(step) {
            for (a, acc) in acc.iter_mut().enumerate() {
                let at = base + a * lanes;
                for (l, s) in acc[..lanes].iter_mut().enumerate() {
                    *s = x[at + l].mul_add(y[at + l], *s);
                }
            }
        }
        let tail: f64 = (whole..x.len()).map(|i| f64::from(x[i] * y[i])).sum();
        (f64::from(self.fold4(&mut acc)) + tail) as f32
    }

    /// `out[d] = sum_j p[j] row(j)[d]` (the attention output `p . v`) as ggml sums it for
    /// a batch of `queries` rows. From two queries on it is tinyBLAS's f32 kernel: per `d`,
    /// one fused multiply-add accumulator, term `j` in lane `(first + j) % lanes`, then
    /// `Simd::reduce_halves`. For a single query (a decode step) tinyBLAS stands aside
    /// and it is [`Simd::dot`]'s order: four accumulators, term `j` in accumulator
    /// `((first + j) % (4 lanes)) / lanes`. `first` is the position of term 0, so that lanes
    /// line up with a sum that starts at position 0 (the terms before `first` being zero,
    /// as masked keys are, and llama.cpp's cache being a multiple of 64 cells, so that no
    /// tail is left).
    pub fn weighted_rows<'a>(
        self,
        p: &[f32],
        first: usize,
        queries: usize,
        row: impl Fn(usize) -> &'a [f32],
        out: &mut [f32],
    ) {
        let lanes = self.lanes();
        let accumulators = if queries == 1 { 4 } else { 1 };
        let mut acc: Vec<Accumulators> = vec![[[0f32; MAX_LANES]; 4]; out.len()];
        for (j, &pj) in p.iter().enumerate() {
            let at = first + j;
            let (a, l) = ((at % (accumulators * lanes)) / lanes, at % lanes);
            for (acc, v) in acc.iter_mut().zip(row(j)) {
                acc[a][l] = v.mul_add(pj, acc[a][l]);
            }
        }
        for (o, acc) in out.iter_mut().zip(&mut acc) {
            *o = if queries == 1 {
                self.fold4(acc)
            } else {
                Self::reduce_halves(&mut acc[0][..lanes])
            };
        }
    }

    /// ggml's vectorised `exp` (`ggml_v_expf`) of one lane: `x = n ln2 + b` with `n`
    /// rounded to an integer and a degree-5 polynomial in `b`, scaled by `2^n`. The
    /// AVX-512 form scales `1 + p(b)` by `_mm512_scalef_ps` and gives `0` or `inf` once
    /// `|n| > 192`; the AVX2 form builds `2^n` from `n`'s bits and rounds `2^n + p(b) 2^n`
    /// once, with a two-step scaling for `126 < |n| <= 192`. Both within 2 ulp of `exp`
    /// (tested).
    pub fn expf(self, x: f32) -> f32 {
        // Round-to-integer shift 1.5 * 2^23, log2(e), ln 2 split in two, polynomial terms.
        let shift = f32::from_bits(0x4b40_0000);
        let log2e = f32::from_bits(0x3fb8_aa3b);
        let ln2_hi = f32::from_bits(0x3f31_7200);
        let ln2_lo = f32::from_bits(0x35bf_be8e);
        let c = [
            0x3f7f_fff6,
            0x3eff_fedb,
            0x3e2a_af33,
            0x3d2b_9f17,
            0x3c07_2010,
        ]
        .map(f32::from_bits);
        let z = x.mul_add(log2e, shift);
        let n = z - shift;
        let b = (-n).mul_add(ln2_lo, (-n).mul_add(ln2_hi, x));
        let u = b * b;
        let high = c[4].mul_add(b, c[3]).mul_add(u, c[2].mul_add(b, c[1]));
        match self {
            Simd::Avx512 => {
                if n.abs() > 192.0 {
                    return if n <= 0.0 { 0.0 } else { f32::INFINITY };
                }
                let j = high.mul_add(u, c[0].mul_add(b, 1.0));
                // `j * 2^n` rounded once, as `_mm512_scalef_ps` does (exact in f64 first).
                (f64::from(j) * 2f64.powi(n as i32)) as f32
            }
            Simd::Avx2 => {
                let j = high.mul_add(u, c[0] * b);
                // `2^n` from the integer in `z`'s low mantissa bits, shifted into the
                // exponent (wrapping, as the integer lanes do).
                let e = z.to_bits() << 23;
                let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
                if n.abs() <= 126.0 || n.is_nan() {
                    return j.mul_add(k, k);
                }
                let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
                let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
                if n.abs() > 192.0 {
                    return s1 * s1;
                }
                let s2 = f32::from_bits(e.wrapping_sub(g));
                s2.mul_add(j, s2) * s1
            }
        }
    }

    /// Scores `(kv,)` of one query row (masked entries `-inf`) turned into probabilities
    /// in place as ggml's `soft_max` does: `exp(s - max)` by [`Simd::expf`], summed per
    /// register of keys (`Simd::reduce_halves`, keys aligned to position 0 through
    /// `first`, the position of entry 0) into an f64 total, then each multiplied by
    /// `1 / total` rounded to f32. A row with every entry masked becomes all zeros. A
    /// last partial register takes the vectorised `exp` too, where ggml calls libm's; with
    /// llama.cpp's cache padded to whole registers that case does not arise.
    pub fn softmax_in_place(self, scores: &mut [f32], first: usize) {
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        if max == f32::NEG_INFINITY {
            scores.fill(0.0);
            return;
        }
        let width = self.lanes();
        let mut total = 0f64;
        let (n, mut register) = (scores.len(), [0f32; MAX_LANES]);
        let lanes = &mut register[..width];
        for (j, s) in scores.iter_mut().enumerate() {
            *s = self.expf(*s - max);
            let lane = (first + j) % width;
            lanes[lane] = *s;
            if lane == width - 1 || j + 1 == n {
                total += f64::from(Self::reduce_halves(lanes));
                lanes.fill(0.0);
            }
        }
        let inv = (1.0 / total) as f32;
        for s in scores.iter_mut() {
            *s *= inv;
        }
    }
}

impl std::str::FromStr for Simd {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "avx2" => Ok(Simd::Avx2),
            "avx512" => Ok(Simd::Avx512),
            other => Err(Error::invalid(
                SIMD_ENV,
                format!("unknown ggml SIMD path {other:?} (avx2 or avx512)"),
            )),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::Device;

    /// Units in the last place between two f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    /// A deterministic wavy vector for tests.
    pub(crate) fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + 1.0) * (seed as f32 + 0.37) * 12.9898).sin() * 3.0)
            .collect()
    }

    const BOTH: [Simd; 2] = [Simd::Avx2, Simd::Avx512];

    #[test]
    fn expf_is_within_two_ulp_of_exp_and_saturates() {
        for simd in BOTH {
            for i in 0..20_000 {
                let x = -87.0 + i as f32 * 0.0049;
                let want = (x as f64).exp() as f32;
                let got = simd.expf(x);
                assert!(ulps(got, want) <= 2, "{simd:?} {x}: {got} vs {want}");
            }
            assert_eq!(simd.expf(0.0), 1.0);
            assert_eq!(simd.expf(f32::NEG_INFINITY), 0.0);
            assert_eq!(simd.expf(-200.0), 0.0);
            assert_eq!(simd.expf(200.0), f32::INFINITY);
        }
        // The AVX2 form's scaled range (126 < |n| <= 192): subnormal results.
        for x in [-88.0f32, -95.5, -100.0, -103.0] {
            let want = (x as f64).exp() as f32;
            let got = Simd::Avx2.expf(x);
            assert!(ulps(got, want) <= 2, "{x}: {got} vs {want}");
        }
    }

    #[test]
    fn reductions_pair_lanes_as_the_registers_do() {
        // Left to right, each 1 is lost against 2^24; paired (1 + 1 first) it is kept.
        let mut lanes = [0f32; 16];
        (lanes[0], lanes[1], lanes[9]) = (16_777_216.0, 1.0, 1.0);
        assert_eq!(lanes.iter().fold(0f32, |s, v| s + v), 16_777_216.0);
        assert_eq!(Simd::reduce_halves(&mut lanes.clone()), 16_777_218.0);
        // AVX2's dot product reduction pairs neighbours after the halves: lane 1 meets
        // lane 0 (and is lost) before it could meet lane 3.
        let mut eight = [0f32; 8];
        (eight[0], eight[1], eight[3]) = (16_777_216.0, 1.0, 1.0);
        assert_eq!(Simd::Avx2.reduce_dot(&mut eight.clone()), 16_777_216.0);
        assert_eq!(Simd::reduce_halves(&mut eight.clone()), 16_777_218.0);
    }

    #[test]
    fn dot_and_weighted_rows_match_f64_sums() {
        for simd in BOTH {
            for n in [64, 256, 70, 5] {
                let (x, y) = (pseudo(n, 1), pseudo(n, 2));
                let want: f64 = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
                let got = simd.dot(&x, &y) as f64;
                assert!((got - want).abs() < 1e-5 * n as f64, "{simd:?} n {n}");
            }
            let (p, rows) = (pseudo(137, 3), pseudo(137 * 8, 4));
            for queries in [1, 2] {
                let mut out = [0f32; 8];
                simd.weighted_rows(&p, 5, queries, |j| &rows[j * 8..(j + 1) * 8], &mut out);
                for (d, o) in out.iter().enumerate() {
                    let want: f64 = (0..137).map(|j| p[j] as f64 * rows[j * 8 + d] as f64).sum();
                    assert!((*o as f64 - want).abs() < 1e-4, "{d}: {o} vs {want}");
                }
            }
        }
    }

    #[test]
    fn softmax_matches_f64_and_zeroes_masked_entries() {
        for simd in BOTH {
            let mut s = pseudo(40, 5);
            s[3] = f32::NEG_INFINITY;
            let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let e: Vec<f64> = s.iter().map(|&v| (v as f64 - max).exp()).collect();
            let total: f64 = e.iter().sum();
            simd.softmax_in_place(&mut s, 11);
            assert_eq!(s[3], 0.0);
            for (got, want) in s.iter().zip(&e) {
                assert!((*got as f64 - want / total).abs() < 1e-7);
            }
            let mut masked = vec![f32::NEG_INFINITY; 5];
            simd.softmax_in_place(&mut masked, 0);
            assert_eq!(masked, vec![0.0; 5]);
        }
    }

    #[test]
    fn simd_names_parse_and_unknown_ones_are_errors() {
        for simd in BOTH {
            assert_eq!(simd.name().parse::<Simd>().unwrap(), simd);
        }
        let err = "sse".parse::<Simd>().unwrap_err().to_string();
        assert!(err.contains(SIMD_ENV) && err.contains("avx2"), "{err}");
    }

    /// The emulated AVX2 path against the AVX2 instructions ggml's AVX2 build runs
    /// (`ggml_v_expf`, `GGML_F32x8_REDUCE`, tinyBLAS's and the softmax's `hsum`), on
    /// this CPU. Fails, rather than skipping, on an x86 CPU without AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_path_is_bit_identical_to_the_avx2_instructions() {
        assert!(
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma"),
            "this test needs a CPU with AVX2 and FMA"
        );
        let xs: Vec<f32> = (0..40_000)
            .map(|i| -130.0 + i as f32 * 0.0037)
            .chain(pseudo(4096, 9))
            .chain([0.0, -0.0, f32::NEG_INFINITY, -87.4, -126.5, -190.0, 88.5])
            .collect();
        for chunk in xs.chunks_exact(8) {
            let want = unsafe { avx2::expf8(chunk.try_into().unwrap()) };
            for (x, w) in chunk.iter().zip(want) {
                let got = Simd::Avx2.expf(*x);
                assert_eq!(got.to_bits(), w.to_bits(), "exp({x}): {got} vs {w}");
            }
        }
        for seed in 0..200 {
            let lanes: [f32; 8] = pseudo(8, seed).try_into().unwrap();
            let (hsum, hadd) = unsafe { avx2::sums8(lanes) };
            assert_eq!(
                Simd::reduce_halves(&mut lanes.clone()).to_bits(),
                hsum.to_bits()
            );
            assert_eq!(
                Simd::Avx2.reduce_dot(&mut lanes.clone()).to_bits(),
                hadd.to_bits()
            );
        }
    }

    /// The emulated AVX-512 path against the AVX-512 instructions of ggml's AVX-512
    /// build (`ggml_v_expf`, `_mm512_reduce_add_ps` as GCC expands it), where this CPU
    /// has them (AVX-512 F and DQ: the path [`Simd::detect`] picks). Without them the
    /// AVX-512 path is checked only end to end, by the parity with an AVX-512 build, and
    /// the test says so.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_path_is_bit_identical_to_the_avx512_instructions_where_present() {
        if Simd::detect() != Simd::Avx512 {
            eprintln!("this CPU has no AVX-512 F + DQ: only the AVX2 path runs here");
            return;
        }
        let xs: Vec<f32> = (0..40_000)
            .map(|i| -200.0 + i as f32 * 0.0071)
            .chain(pseudo(4096, 11))
            .chain([
                0.0,
                -0.0,
                f32::NEG_INFINITY,
                88.7,
                -87.4,
                -190.0,
                -193.0,
                200.0,
            ])
            .collect();
        for chunk in xs.chunks(16).filter(|c| c.len() == 16) {
            let want = unsafe { avx512::expf16(chunk.try_into().unwrap()) };
            for (x, w) in chunk.iter().zip(want) {
                let got = Simd::Avx512.expf(*x);
                assert_eq!(got.to_bits(), w.to_bits(), "exp({x}): {got} vs {w}");
            }
        }
        for seed in 0..200 {
            let lanes: [f32; 16] = pseudo(16, seed).try_into().unwrap();
            let want = unsafe { avx512::reduce_add16(lanes) };
            assert_eq!(
                Simd::reduce_halves(&mut lanes.clone()).to_bits(),
                want.to_bits()
            );
        }
    }

    /// The AVX-512 intrinsics of ggml's code, for the test above.
    #[cfg(target_arch = "x86_64")]
    mod avx512 {
        use std::arch::x86_64::*;

        /// `ggml_v_expf` (AVX-512 form) of 16 lanes.
        #[target_feature(enable = "avx512f,avx512dq")]
        pub(super) unsafe fn expf16(x: [f32; 16]) -> [f32; 16] {
            let x = _mm512_loadu_ps(x.as_ptr());
            let k = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
            let r = k(0x4b40_0000);
            let z = _mm512_fmadd_ps(x, k(0x3fb8_aa3b), r);
            let n = _mm512_sub_ps(z, r);
            let b = _mm512_fnmadd_ps(n, k(0x35bf_be8e), _mm512_fnmadd_ps(n, k(0x3f31_7200), x));
            let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
            let u = _mm512_mul_ps(b, b);
            let j = _mm512_fmadd_ps(
                _mm512_fmadd_ps(
                    _mm512_fmadd_ps(k(0x3c07_2010), b, k(0x3d2b_9f17)),
                    u,
                    _mm512_fmadd_ps(k(0x3e2a_af33), b, k(0x3eff_fedb)),
                ),
                u,
                _mm512_fmadd_ps(k(0x3f7f_fff6), b, _mm512_set1_ps(1.0)),
            );
            let mut res = _mm512_scalef_ps(j, n);
            if d != 0 {
                let zero = _mm512_setzero_ps();
                let alt = _mm512_mask_blend_ps(
                    _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero),
                    _mm512_set1_ps(f32::INFINITY),
                    zero,
                );
                res = _mm512_mask_blend_ps(d, res, alt);
            }
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), res);
            out
        }

        /// GCC's `_mm512_reduce_add_ps`: 256-bit halves, 128-bit halves, then two
        /// shuffled adds (lanes two apart, then neighbours).
        #[target_feature(enable = "avx512f,avx512dq")]
        pub(super) unsafe fn reduce_add16(lanes: [f32; 16]) -> f32 {
            let a = _mm512_loadu_ps(lanes.as_ptr());
            let t3 = _mm256_add_ps(_mm512_extractf32x8_ps::<1>(a), _mm512_castps512_ps256(a));
            let t6 = _mm_add_ps(_mm256_extractf128_ps::<1>(t3), _mm256_castps256_ps128(t3));
            let t8 = _mm_add_ps(t6, _mm_shuffle_ps::<0b0100_1110>(t6, t6));
            let t10 = _mm_add_ps(t8, _mm_shuffle_ps::<0b1011_0001>(t8, t8));
            _mm_cvtss_f32(t10)
        }
    }

    /// The AVX2 intrinsics of ggml's code, for the test above.
    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use std::arch::x86_64::*;

        /// `ggml_v_expf` (AVX2 + FMA form) of 8 lanes.
        #[target_feature(enable = "avx2,fma")]
        pub(super) unsafe fn expf8(x: [f32; 8]) -> [f32; 8] {
            let x = _mm256_loadu_ps(x.as_ptr());
            let r = _mm256_set1_ps(f32::from_bits(0x4b40_0000));
            let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32::from_bits(0x3fb8_aa3b)), r);
            let n = _mm256_sub_ps(z, r);
            let b = _mm256_fnmadd_ps(
                n,
                _mm256_set1_ps(f32::from_bits(0x35bf_be8e)),
                _mm256_fnmadd_ps(n, _mm256_set1_ps(f32::from_bits(0x3f31_7200)), x),
            );
            let e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
            let k = _mm256_castsi256_ps(_mm256_add_epi32(
                e,
                _mm256_castps_si256(_mm256_set1_ps(1.0)),
            ));
            let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
            let c = _mm256_castps_si256(_mm256_cmp_ps(abs_n, _mm256_set1_ps(126.0), _CMP_GT_OQ));
            let u = _mm256_mul_ps(b, b);
            let coef = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
            let j = _mm256_fmadd_ps(
                _mm256_fmadd_ps(
                    _mm256_fmadd_ps(coef(0x3c07_2010), b, coef(0x3d2b_9f17)),
                    u,
                    _mm256_fmadd_ps(coef(0x3e2a_af33), b, coef(0x3eff_fedb)),
                ),
                u,
                _mm256_mul_ps(coef(0x3f7f_fff6), b),
            );
            let mut out = [0f32; 8];
            if _mm256_movemask_ps(_mm256_castsi256_ps(c)) == 0 {
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_fmadd_ps(j, k, k));
                return out;
            }
            let g = _mm256_and_si256(
                _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                _mm256_set1_epi32(0x8200_0000u32 as i32),
            );
            let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
            let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
            let d = _mm256_castps_si256(_mm256_cmp_ps(abs_n, _mm256_set1_ps(192.0), _CMP_GT_OQ));
            let scaled = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
            let res = _mm256_or_ps(
                _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
                _mm256_andnot_ps(
                    _mm256_castsi256_ps(d),
                    _mm256_or_ps(
                        _mm256_and_ps(_mm256_castsi256_ps(c), scaled),
                        _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)),
                    ),
                ),
            );
            _mm256_storeu_ps(out.as_mut_ptr(), res);
            out
        }

        /// tinyBLAS's / the softmax's `hsum` and `GGML_F32x8_REDUCE`'s final sum of one
        /// register.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn sums8(lanes: [f32; 8]) -> (f32, f32) {
            let x = _mm256_loadu_ps(lanes.as_ptr());
            let h = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let hsum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
            let t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
            let t1 = _mm_hadd_ps(t0, t0);
            (hsum, _mm_cvtss_f32(_mm_hadd_ps(t1, t1)))
        }
    }

    #[test]
    fn rms_norm_matches_f64_within_two_ulp() -> Result<()> {
        let (x, w) = (pseudo(3 * 64, 6), pseudo(64, 7));
        let got: Vec<f32> = rms_norm(
            &Tensor::from_vec(x.clone(), (3, 64), &Device::Cpu)?,
            &Tensor::from_vec(w.clone(), 64, &Device::Cpu)?,
            1e-6,
        )?
        .flatten_all()?
        .to_vec1()?;
        for (r, row) in x.chunks(64).enumerate() {
            let ms: f64 = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 64.0;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for (i, v) in row.iter().enumerate() {
                let want = (*v as f64 * inv * w[i] as f64) as f32;
                assert!(ulps(got[r * 64 + i], want) <= 2, "{r}/{i}");
            }
        }
        Ok(())
    }
    /// GELU with the exact error function in f64 (Simpson's rule): an independent
    /// definition.
    fn gelu_erf(x: f64) -> f64 {
        let z = x / std::f64::consts::SQRT_2;
        let n = 2000;
        let h = z / n as f64;
        let f = |t: f64| (-t * t).exp();
        let mut s = f(0.0) + f(z);
        for i in 1..n {
            s += f(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
        }
        let erf = s * h / 3.0 * 2.0 / std::f64::consts::PI.sqrt();
        0.5 * x * (1.0 + erf)
    }

    #[test]
    fn gelu_is_close_to_exact_gelu_within_the_tanh_and_f16_errors() {
        for i in -400..=400 {
            let x = i as f32 * 0.03;
            let want = gelu_erf(x as f64);
            let got = gelu(x) as f64;
            // tanh approximation (< 5e-4 absolute) plus two f16 roundings.
            let tol = 5e-4 + 2.0 * 2f64.powi(-11) * (want.abs() + x.abs() as f64);
            assert!((got - want).abs() <= tol, "x {x}: {got} vs {want}");
        }
    }

    #[test]
    fn gelu_steps_with_the_f16_input() {
        // 1 and 1 + 2^-12 round to the same f16; 1 + 2^-9 does not.
        assert_eq!(gelu(1.0), gelu(1.0 + 2f32.powi(-12)));
        assert_ne!(gelu(1.0), gelu(1.0 + 2f32.powi(-9)));
        for x in [-3.7f32, -0.2, 0.013, 0.5, 2.25, 7.9] {
            let y = gelu(x);
            assert_eq!(f16::from_f32(y).to_f32(), y, "{x}: not an f16 value");
        }
        assert_eq!(gelu(-10.0), 0.0);
        assert_eq!(gelu(-250.0), 0.0);
        assert_eq!(gelu(10.0), 10.0);
        assert_eq!(gelu(123.5), 123.5);
        assert!(gelu(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_tensor_keeps_the_shape() -> Result<()> {
        let xs = [-1.0f32, 0.0, 1.0, 2.0, 3.0, 11.0];
        let y = gelu_tensor(&Tensor::from_vec(xs.to_vec(), (2, 3), &Device::Cpu)?)?;
        assert_eq!(y.dims(), &[2, 3]);
        let got: Vec<f32> = y.flatten_all()?.to_vec1()?;
        assert_eq!(got, xs.into_iter().map(gelu).collect::<Vec<_>>());
        Ok(())
    }

    /// A reproducible row of `n` values in about [-3, 3].
    fn row(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32).wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503);
                (h % 6001) as f32 / 1000.0 - 3.0
            })
            .collect()
    }

    #[test]
    fn q8_k_codes_use_127_steps_of_the_signed_maximum() -> Result<()> {
        let mut x = row(256, 1);
        x[17] = -4.5; // the largest magnitude, negative
        let y: Vec<f32> = InputGrid::Q8K
            .round_trip(&Tensor::from_vec(x.clone(), (1, 256), &Device::Cpu)?)?
            .flatten_all()?
            .to_vec1()?;
        let step = 4.5f64 / 127.0;
        for (a, b) in x.iter().zip(&y) {
            // Every value is an integer number of steps, at most half a step away.
            let k = *b as f64 / step;
            assert!((k - k.round()).abs() < 1e-3, "{b} is not on the grid");
            assert!(
                (*a as f64 - *b as f64).abs() <= step / 2.0 + 1e-6,
                "{a} -> {b}"
            );
        }
        assert_eq!(y[17], -4.5);
        Ok(())
    }

    #[test]
    fn q8_0_round_trip_matches_candle_dequantization_of_its_own_q8_0() -> Result<()> {
        // candle's Q8_0 uses the same scale (amax / 127, stored as f16) as ggml.
        let x = row(64 * 3, 7);
        let t = Tensor::from_vec(x, (3, 64), &Device::Cpu)?;
        let candle = QTensor::quantize(&t, GgmlDType::Q8_0)?.dequantize(&Device::Cpu)?;
        let ours = InputGrid::Q8_0.round_trip(&t)?;
        let diff = (candle - ours)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        Ok(())
    }

    #[test]
    fn grids_follow_the_weight_types() -> Result<()> {
        assert_eq!(InputGrid::for_weight(GgmlDType::Q4K)?, InputGrid::Q8K);
        assert_eq!(InputGrid::for_weight(GgmlDType::Q6K)?, InputGrid::Q8K);
        assert_eq!(InputGrid::for_weight(GgmlDType::Q5_0)?, InputGrid::Q8_0);
        assert_eq!(InputGrid::for_weight(GgmlDType::F32)?, InputGrid::F32);
        assert!(InputGrid::for_weight(GgmlDType::Q8K).is_err());
        let x = Tensor::zeros((1, 100), DType::F32, &Device::Cpu)?;
        assert!(InputGrid::Q8K.round_trip(&x).is_err());
        let zeros =
            InputGrid::Q8K.round_trip(&Tensor::zeros((1, 256), DType::F32, &Device::Cpu)?)?;
        assert_eq!(zeros.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
        Ok(())
    }
}
