//! The forward pass's RMS normalisation and feed-forward gate in each [`Numerics`], chosen
//! once when a model is loaded ([`Ops::new`]), so that the forward pass runs its
//! numerics' arithmetic without asking which one it is:
//!
//! * [`Numerics::Fast`]: candle's normalisation and the fused one-pass gate of
//!   [`Gate::gated`];
//! * [`Numerics::Reference`]: candle's normalisation and candle's `silu`/`gelu`, as
//!   mistral.rs computes them;
//! * [`Numerics::Ggml`]: ggml's normalisation and GELU ([`super::ggml`]); SiLU as
//!   candle computes it.

use candle_core::Tensor;

use super::activation::Gate;
use super::{ggml, Numerics};
use crate::Result;

/// How rows are RMS-normalised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Norm {
    Candle,
    Ggml,
}

/// How `act(gate) * up` is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GateOp {
    /// One vectorised pass ([`Gate::gated`]).
    Fused(Gate),
    CandleSilu,
    CandleGelu,
    GgmlGelu,
}

/// One model's normalisation and gate: its numerics' arithmetic for its architecture's
/// activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ops {
    norm: Norm,
    gate: GateOp,
}

impl Ops {
    /// The operations of `numerics` for a feed-forward gate of `activation`.
    pub fn new(numerics: Numerics, activation: Gate) -> Self {
        let norm = match numerics {
            Numerics::Ggml => Norm::Ggml,
            Numerics::Reference | Numerics::Fast => Norm::Candle,
        };
        let gate = match (numerics, activation) {
            (Numerics::Fast, gate) => GateOp::Fused(gate),
            (_, Gate::Silu) => GateOp::CandleSilu,
            (Numerics::Ggml, Gate::GeluTanh) => GateOp::GgmlGelu,
            (Numerics::Reference, Gate::GeluTanh) => GateOp::CandleGelu,
        };
        Self { norm, gate }
    }

    /// `x` `(..., d)` RMS-normalised (`eps` inside the root) and scaled by `w` `(d,)`.
    pub fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
        Ok(match self.norm {
            Norm::Ggml => ggml::rms_norm(x, w, eps)?,
            Norm::Candle => candle_nn::ops::rms_norm(x, w, eps)?,
        })
    }

    /// `act(gate) * up` for `gate` and `up` of one shape (`(rows, d_ff)`).
    pub fn gated(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        Ok(match self.gate {
            GateOp::Fused(g) => g.gated(gate, up)?,
            GateOp::CandleSilu => (gate.silu()? * up)?,
            GateOp::CandleGelu => (gate.gelu()? * up)?,
            GateOp::GgmlGelu => (ggml::gelu_tensor(gate)? * up)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    /// Every numerics' gate and norm against their definitions, computed in f64 here.
    #[test]
    fn every_numerics_computes_the_definitions() {
        let (rows, d) = (3, 40);
        let g: Vec<f32> = (0..rows * d)
            .map(|i| (i as f32 * 0.37).sin() * 4.0)
            .collect();
        let u: Vec<f32> = (0..rows * d).map(|i| (i as f32 * 0.11).cos()).collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + (i as f32 * 0.3).sin().abs()).collect();
        let t = |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape, &Device::Cpu).unwrap();
        let (gt, ut, wt) = (t(&g, &[rows, d]), t(&u, &[rows, d]), t(&w, &[d]));
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let gelu = |x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        };
        let eps = 1e-5;
        for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
            for (gate, act) in [
                (Gate::Silu, &silu as &dyn Fn(f64) -> f64),
                (Gate::GeluTanh, &gelu),
            ] {
                let ops = Ops::new(numerics, gate);
                let got: Vec<f32> = ops
                    .gated(&gt, &ut)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                for (i, &x) in got.iter().enumerate() {
                    let want = act(g[i] as f64) * u[i] as f64;
                    // ggml's GELU goes through f16 (about 5e-4 relative).
                    assert!(
                        (x as f64 - want).abs() < 2e-3 * want.abs().max(1.0),
                        "{numerics:?} {gate:?} [{i}]: {x} vs {want}"
                    );
                }
                let got: Vec<f32> = ops
                    .rms_norm(&gt, &wt, eps)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                for r in 0..rows {
                    let row = &g[r * d..][..d];
                    let ms = row.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / d as f64;
                    let inv = 1.0 / (ms + eps as f64).sqrt();
                    for j in 0..d {
                        let want = row[j] as f64 * inv * w[j] as f64;
                        let x = got[r * d + j] as f64;
                        assert!(
                            (x - want).abs() < 1e-4 * want.abs().max(1.0),
                            "{numerics:?} norm [{r}, {j}]"
                        );
                    }
                }
            }
        }
    }
}
