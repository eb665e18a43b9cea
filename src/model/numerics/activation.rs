//! The feed-forward gate of [`Numerics::Fast`](super::Numerics::Fast) in one pass:
//! `act(g) * u` for SiLU or GELU's tanh form, both written as `g / (1 + exp(-z))` (SiLU:
//! `z = g`; GELU: `1 + tanh(y) = 2 / (1 + exp(-2y))`, so `z = 2 sqrt(2/pi) (g + 0.044715
//! g^3)`) over the vectorised `exp` of `fast_exp`, with long inputs split across
//! threads. candle's `silu`/`gelu` call libm per element on one thread: 14% of a
//! 2,048-token Gemma prefill went to them (perf, AMD EPYC, AVX2).
//!
//! Each element is computed alone, so a row's result does not depend on the rows beside
//! it (batching stays bit-identical).

use candle_core::Tensor;
use rayon::prelude::*;

use super::fast_exp::exp;
use crate::Result;

/// Elements below which the gate runs on the calling thread (a decode step's rows).
const PARALLEL_MIN: usize = 1 << 15;

/// Elements per parallel task.
const CHUNK: usize = 1 << 13;

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// `x * sigmoid(x)` (Llama).
    Silu,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (Gemma 3).
    GeluTanh,
}

impl Gate {
    /// The activation of one value.
    #[inline(always)]
    fn apply(self, x: f32) -> f32 {
        let z = match self {
            Gate::Silu => x,
            Gate::GeluTanh => {
                // The f32 nearest 2 sqrt(2 / pi) = 1.5957691216...
                const TWO_SQRT_2_OVER_PI: f32 = 1.595_769_2;
                TWO_SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)
            }
        };
        x / (1.0 + exp(-z))
    }

    /// `act(gate) * up` for `gate` and `up` of one shape (`(rows, ffn)`).
    pub fn gated(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let g: Vec<f32> = gate.flatten_all()?.to_vec1()?;
        let u: Vec<f32> = up.flatten_all()?.to_vec1()?;
        if g.len() != u.len() {
            return Err(crate::Error::invalid(
                "gate",
                format!("gate {:?} and up {:?} differ", gate.shape(), up.shape()),
            ));
        }
        let mut out = vec![0f32; g.len()];
        let run = |o: &mut [f32], g: &[f32], u: &[f32]| {
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                *o = self.apply(*g) * u;
            }
        };
        if g.len() < PARALLEL_MIN {
            run(&mut out, &g, &u);
        } else {
            out.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
                .for_each(|(o, (g, u))| run(o, g, u));
        }
        Ok(Tensor::from_vec(out, gate.shape(), gate.device())?)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// The activations in f64: SiLU as defined; GELU in the textbook tanh form where
    /// `1 + tanh` keeps its digits, else (`y < -2`, where f64's tanh rounds towards `-1`)
    /// as `x exp(2y) / (1 + exp(2y))`, the same value.
    fn want(gate: Gate, x: f64) -> f64 {
        match gate {
            Gate::Silu => x / (1.0 + (-x).exp()),
            Gate::GeluTanh => {
                let y = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3));
                if y >= -2.0 {
                    0.5 * x * (1.0 + y.tanh())
                } else {
                    x * (2.0 * y).exp() / (1.0 + (2.0 * y).exp())
                }
            }
        }
    }

    #[test]
    fn gates_match_f64_within_a_few_ulp_on_both_paths() {
        // Both sides of zero, the tails where exp saturates (far left, `exp(-z)` stops at
        // `exp(88)`, so the gate is `x / 1.7e38` where it should be 0: below 1e-35 here),
        // and enough elements for the parallel path (the same values again). In the left
        // tail the gate is about `x exp(z)`, so an f32 rounding of `z` moves it by `|z|`
        // ulps: the bound grows with `|z|`.
        let xs: Vec<f32> = (0..PARALLEL_MIN + 7)
            .map(|i| ((i % 4001) as f32 - 2000.0) * 0.025 * if i % 3 == 0 { 0.01 } else { 1.0 })
            .collect();
        let ups: Vec<f32> = (0..xs.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        for gate in [Gate::Silu, Gate::GeluTanh] {
            for n in [19, xs.len()] {
                let g = Tensor::from_slice(&xs[..n], n, &Device::Cpu).unwrap();
                let u = Tensor::from_slice(&ups[..n], n, &Device::Cpu).unwrap();
                let got: Vec<f32> = gate.gated(&g, &u).unwrap().to_vec1().unwrap();
                for i in 0..n {
                    let x = xs[i] as f64;
                    let w = want(gate, x) * ups[i] as f64;
                    let z = match gate {
                        Gate::Silu => x,
                        Gate::GeluTanh => 1.6 * (x + 0.044715 * x.powi(3)),
                    };
                    let err = (got[i] as f64 - w).abs();
                    assert!(
                        err <= 4.0 * f32::EPSILON as f64 * (1.0 + z.abs()) * w.abs() + 1e-35,
                        "{gate:?} x = {}: {} vs {w}",
                        xs[i],
                        got[i]
                    );
                }
            }
        }
    }

    #[test]
    fn a_shape_mismatch_is_an_error() {
        let g = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let u = Tensor::zeros((3, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(Gate::Silu.gated(&g, &u).is_err());
    }
}
