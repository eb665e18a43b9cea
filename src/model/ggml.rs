//! The two places where llama.cpp's CPU backend (ggml) rounds more coarsely than f32, so
//! that [`Numerics::Ggml`](crate::model::Numerics::Ggml) can follow llama.cpp token for
//! token:
//!
//! - **matmul inputs**: before a dot product with a quantized weight, ggml quantizes the
//!   input row to the weight type's 8-bit companion format ([`InputGrid`]); the dot product
//!   is then exact integer arithmetic on the codes. Rounding the input to the same codes
//!   and multiplying by the dequantized weight in f32 gives the same value up to f32
//!   summation order. (candle, and so mistral.rs, scales its `Q8_K` codes by `max / 128`
//!   where ggml now uses `max / 127`: a different grid, so different rounding in every
//!   K-quant matmul.)
//! - **GELU**: ggml rounds the input to f16 and looks the f16-rounded GELU up in a
//!   65,536-entry table ([`gelu`]).
//!
//! Each is a relative error of up to ~2^-8 (the 8-bit codes) or 2^-11 (f16) per element,
//! orders above the f32 differences of the other operations.

use std::sync::OnceLock;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use half::f16;

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
        let (block, round): (usize, fn(&mut [f32])) = match self {
            Self::F32 => return Ok(x.clone()),
            Self::F16 => return Ok(x.to_dtype(DType::F16)?.to_dtype(DType::F32)?),
            Self::Q8_0 => (32, q8_0),
            Self::Q8K => (256, q8_k),
        };
        let width = x.dim(x.rank() - 1)?;
        if width % block != 0 {
            return Err(Error::invalid(
                "matmul input",
                format!("width {width} is not a multiple of {self:?}'s block of {block}"),
            ));
        }
        let mut values: Vec<f32> = x.flatten_all()?.to_vec1()?;
        values.chunks_mut(block).for_each(round);
        Ok(Tensor::from_vec(values, x.shape(), x.device())?)
    }
}

/// One `Q8_0` block rounded in place, as ggml's x86 `quantize_row_q8_0` does.
fn q8_0(block: &mut [f32]) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = f16::from_f32(amax / 127.0).to_f32();
    let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for v in block {
        *v = scale * (*v * inv).round_ties_even();
    }
}

/// One `Q8_K` block rounded in place, as ggml's `quantize_row_q8_K` does.
fn q8_k(block: &mut [f32]) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in block.iter() {
        if v.abs() > amax {
            (amax, max) = (v.abs(), v);
        }
    }
    if amax == 0.0 {
        block.fill(0.0);
        return;
    }
    let inv = -127.0 / max;
    let scale = 1.0 / inv;
    for v in block {
        *v = scale * (*v * inv).round_ties_even().min(127.0);
    }
}

/// `0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))` in f32, term by term.
fn gelu_tanh(x: f32) -> f32 {
    const COEF_A: f32 = 0.044715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::Device;

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
