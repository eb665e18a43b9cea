//! The probe network at inference time: input standardisation, then dense layers with
//! an activation between them, then a sigmoid (binary labels) or nothing (continuous).
//! Plain `f32` loops for one hidden state per decode step (no tensor-library dispatch,
//! no allocation with a [`Workspace`]); `ndarray` matrix products for batches.

use ndarray::{Array2, ArrayView2, Axis};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The non-linearity between dense layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// GELU, tanh approximation (`candle`'s `gelu`):
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    Gelu,
    /// `max(x, 0)`.
    Relu,
}

impl Activation {
    pub(crate) fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Relu => x.max(0.0),
            Activation::Gelu => {
                const SQRT_2_OVER_PI: f32 = 0.797_884_6;
                0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
            }
        }
    }
}

/// `y = W x + b` with `W` `(outputs, inputs)` row-major and `b` `(outputs,)`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Dense {
    pub(crate) weight: Vec<f32>,
    pub(crate) bias: Vec<f32>,
    pub(crate) inputs: usize,
    pub(crate) outputs: usize,
}

impl Dense {
    /// `out = W x + b`; `x` `(inputs,)`, `out` `(outputs,)`.
    fn apply(&self, x: &[f32], out: &mut [f32]) {
        for ((o, row), b) in out
            .iter_mut()
            .zip(self.weight.chunks_exact(self.inputs))
            .zip(&self.bias)
        {
            *o = dot(row, x) + b;
        }
    }
}

/// Dot product with eight independent accumulators (vectorises without `-ffast-math`).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Scratch buffers for [`crate::probe::Probe::predict_into`]: reuse one per thread to
/// predict without allocating.
#[derive(Debug, Clone, Default)]
pub struct Workspace {
    a: Vec<f32>,
    b: Vec<f32>,
}

impl Workspace {
    /// Buffers that hold `width` values each without growing.
    pub(crate) fn with_capacity(width: usize) -> Self {
        Workspace {
            a: Vec::with_capacity(width),
            b: Vec::with_capacity(width),
        }
    }
}

/// Standardisation plus the dense stack.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Mlp {
    /// `(input_dim,)`: train-split mean of each input feature.
    pub(crate) mean: Vec<f32>,
    /// `(input_dim,)`: train-split standard deviation (1 where it was below 1e-6).
    pub(crate) std: Vec<f32>,
    /// Hidden layers then the output layer.
    pub(crate) layers: Vec<Dense>,
    pub(crate) activation: Activation,
    /// Apply a sigmoid to the outputs (binary labels).
    pub(crate) sigmoid: bool,
}

impl Mlp {
    pub(crate) fn input_dim(&self) -> usize {
        self.mean.len()
    }

    pub(crate) fn output_dim(&self) -> usize {
        self.layers.last().map_or(0, |l| l.outputs)
    }

    /// One hidden state `(input_dim,)` into `out` `(output_dim,)`.
    pub(crate) fn forward_into(
        &self,
        x: &[f32],
        ws: &mut Workspace,
        out: &mut [f32],
    ) -> Result<()> {
        if x.len() != self.input_dim() || out.len() != self.output_dim() {
            return Err(Error::invalid(
                "probe input",
                format!(
                    "got a hidden state of width {} and an output buffer of {} for a probe of \
                     input width {} and {} outputs",
                    x.len(),
                    out.len(),
                    self.input_dim(),
                    self.output_dim()
                ),
            ));
        }
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(
                "probe input",
                format!("hidden state element {i} is {}", x[i]),
            ));
        }
        ws.a.clear();
        ws.a.extend(
            x.iter()
                .zip(self.mean.iter().zip(&self.std))
                .map(|(v, (m, s))| (v - m) / s),
        );
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            if i == last {
                layer.apply(&ws.a, out);
            } else {
                ws.b.resize(layer.outputs, 0.0);
                layer.apply(&ws.a, &mut ws.b);
                for v in &mut ws.b {
                    *v = self.activation.apply(*v);
                }
                std::mem::swap(&mut ws.a, &mut ws.b);
            }
        }
        if self.sigmoid {
            for v in out.iter_mut() {
                *v = sigmoid(*v);
            }
        }
        Ok(())
    }

    /// Hidden states `(rows, input_dim)` to outputs `(rows, output_dim)`.
    pub(crate) fn forward_batch(&self, x: ArrayView2<f32>) -> Result<Array2<f32>> {
        if x.ncols() != self.input_dim() {
            return Err(Error::invalid(
                "probe input",
                format!(
                    "hidden states of width {} for a probe of input width {}",
                    x.ncols(),
                    self.input_dim()
                ),
            ));
        }
        if let Some((i, v)) = x.indexed_iter().find(|(_, v)| !v.is_finite()) {
            return Err(Error::invalid(
                "probe input",
                format!("row {} element {} of the hidden states is {v}", i.0, i.1),
            ));
        }
        let mut h = x.to_owned();
        for (mut col, (m, s)) in h
            .axis_iter_mut(Axis(1))
            .zip(self.mean.iter().zip(&self.std))
        {
            col.mapv_inplace(|v| (v - m) / s);
        }
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            let w = ArrayView2::from_shape((layer.outputs, layer.inputs), &layer.weight)
                .map_err(|e| Error::invalid("probe weights", e.to_string()))?;
            let b = ArrayView2::from_shape((1, layer.outputs), &layer.bias)
                .map_err(|e| Error::invalid("probe weights", e.to_string()))?;
            h = h.dot(&w.t()) + b;
            if i != last {
                h.mapv_inplace(|v| self.activation.apply(v));
            }
        }
        if self.sigmoid {
            h.mapv_inplace(sigmoid);
        }
        Ok(h)
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_and_batched_forward_agree_with_a_hand_computed_network() {
        // 2 -> 2 (relu) -> 1 (sigmoid), standardised by mean (1, 0) and std (2, 1).
        let mlp = Mlp {
            mean: vec![1.0, 0.0],
            std: vec![2.0, 1.0],
            layers: vec![
                Dense {
                    weight: vec![1.0, -1.0, 0.5, 2.0],
                    bias: vec![0.0, -1.0],
                    inputs: 2,
                    outputs: 2,
                },
                Dense {
                    weight: vec![1.0, 3.0],
                    bias: vec![0.25],
                    inputs: 2,
                    outputs: 1,
                },
            ],
            activation: Activation::Relu,
            sigmoid: true,
        };
        // x = (5, 1) -> standardised (2, 1) -> units (2 - 1, 0.5 * 2 + 2 * 1 - 1) = (1, 2)
        // -> relu (1, 2) -> 1 + 6 + 0.25 = 7.25 -> sigmoid.
        let expect = 1.0 / (1.0 + (-7.25f32).exp());
        let mut out = [0.0f32];
        mlp.forward_into(&[5.0, 1.0], &mut Workspace::default(), &mut out)
            .unwrap();
        assert!((out[0] - expect).abs() < 1e-6);
        let batch = ndarray::array![[5.0f32, 1.0], [1.0, 0.0]];
        let got = mlp.forward_batch(batch.view()).unwrap();
        assert!((got[[0, 0]] - expect).abs() < 1e-6);
        // x = (1, 0) -> z = 0 -> relu(0, -1) = 0 -> 0.25.
        assert!((got[[1, 0]] - 1.0 / (1.0 + (-0.25f32).exp())).abs() < 1e-6);
        let err = mlp.forward_into(&[f32::NAN, 0.0], &mut Workspace::default(), &mut out);
        assert!(err.unwrap_err().to_string().contains("element 0 is NaN"));
        assert!(mlp.forward_batch(ndarray::array![[1.0f32]].view()).is_err());
    }

    #[test]
    fn gelu_matches_reference_values() {
        // The tanh formula evaluated by hand at -1, 0, 1, 2.
        let want = [-0.158_808, 0.0, 0.841_192, 1.954_598];
        for (x, w) in [-1.0f32, 0.0, 1.0, 2.0].into_iter().zip(want) {
            assert!((Activation::Gelu.apply(x) - w).abs() < 1e-5, "{x}");
        }
    }
}
