//! Linear layers over GGUF weights, with a choice of numerics.
//!
//! * [`Numerics::Reference`] multiplies with the file's own quantized blocks through
//!   `QMatMul`, exactly the path mistral.rs takes (activations are quantized to the
//!   weight type's dot-product partner, e.g. Q8_1 for Q4_1): the parity mode.
//! * [`Numerics::Fast`] keeps a dequantized f32 copy for batched rows (prefill: a SIMD
//!   gemm is ~9x faster than quantized dot products at 64 rows) and a Q8_0 copy for
//!   single rows (decode is bandwidth-bound and candle has an AVX kernel for Q8_0 but
//!   none for Q4_1).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};

use crate::Result;

/// How linear layers compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Numerics {
    /// The file's quantized weights through `QMatMul`, as mistral.rs computes.
    Reference,
    /// Dequantized f32 for batched rows, Q8_0 for single rows.
    #[default]
    Fast,
}

impl std::str::FromStr for Numerics {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "reference" => Ok(Numerics::Reference),
            "fast" => Ok(Numerics::Fast),
            other => Err(crate::Error::invalid(
                "numerics",
                format!("`{other}` (expected reference or fast)"),
            )),
        }
    }
}

/// Rows above which the dense f32 weight is used in [`Numerics::Fast`].
const DENSE_MIN_ROWS: usize = 4;

/// `y = x W^T` for a weight `W` of shape `(out, in)`.
#[derive(Debug, Clone)]
pub struct Linear {
    quant: QMatMul,
    /// `(out, in)` f32, present in [`Numerics::Fast`].
    dense: Option<Tensor>,
}

impl Linear {
    /// Build from a GGUF tensor of shape `(out, in)`.
    pub fn new(weight: QTensor, numerics: Numerics) -> Result<Self> {
        match numerics {
            Numerics::Reference => Ok(Self {
                quant: QMatMul::from_qtensor(weight)?,
                dense: None,
            }),
            Numerics::Fast => {
                let dense = weight.dequantize(&candle_core::Device::Cpu)?;
                let quant = match weight.dtype() {
                    GgmlDType::Q8_0 | GgmlDType::F32 => QMatMul::from_qtensor(weight)?,
                    _ => QMatMul::from_qtensor(QTensor::quantize(&dense, GgmlDType::Q8_0)?)?,
                };
                Ok(Self {
                    quant,
                    dense: Some(dense),
                })
            }
        }
    }

    /// A [`Numerics::Fast`] layer from an f32 weight `(out, in)`; single rows use a Q8_0
    /// copy when `requantize`, else the f32 weight itself.
    fn from_dense(dense: Tensor, requantize: bool) -> Result<Self> {
        let quant = if requantize {
            QMatMul::from_qtensor(QTensor::quantize(&dense, GgmlDType::Q8_0)?)?
        } else {
            QMatMul::Tensor(dense.clone())
        };
        Ok(Self {
            quant,
            dense: Some(dense),
        })
    }

    /// Like [`Linear::new`], sharing an already dequantized copy of the weight
    /// (tied embeddings: the embedding table is the LM head).
    pub fn with_dense(weight: QTensor, dense: &Tensor, numerics: Numerics) -> Result<Self> {
        let quant = QMatMul::from_qtensor(weight)?;
        let dense = (numerics == Numerics::Fast).then(|| dense.clone());
        Ok(Self { quant, dense })
    }

    /// `x`: `(rows, in)` f32 -> `(rows, out)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dim(0)?;
        Ok(match &self.dense {
            Some(w) if rows >= DENSE_MIN_ROWS => x.matmul(&w.t()?)?,
            _ => self.quant.forward(x)?,
        })
    }

    /// The weight as f32 `(out, in)`.
    pub fn dequantized(&self) -> Result<Tensor> {
        Ok(match (&self.dense, &self.quant) {
            (Some(w), _) => w.clone(),
            (None, QMatMul::QTensor(t)) => t.dequantize(&candle_core::Device::Cpu)?,
            (None, QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.to_dtype(candle_core::DType::F32)?
            }
        })
    }

    /// Bytes held by this layer's weights (every copy).
    pub fn bytes(&self) -> usize {
        let q = match &self.quant {
            QMatMul::QTensor(t) => t.storage_size_in_bytes(),
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        };
        q + self.dense.as_ref().map_or(0, |d| d.elem_count() * 4)
    }
}

/// Several projections of the same input (Q, K and V; gate and up).
///
/// In [`Numerics::Fast`] they are stacked into one weight, so a decode step quantizes its
/// input once and runs one matmul instead of several; in [`Numerics::Reference`] they stay
/// separate, as mistral.rs keeps them (stacking would not change a single float, only
/// the layout).
#[derive(Debug, Clone)]
pub enum Projections {
    /// One stacked weight and the output width of each part.
    Stacked { weight: Linear, widths: Vec<usize> },
    /// One layer per part.
    Separate(Vec<Linear>),
}

impl Projections {
    /// Build from the parts' GGUF tensors, each `(out_i, in)`.
    pub fn new(parts: Vec<QTensor>, numerics: Numerics) -> Result<Self> {
        match numerics {
            Numerics::Reference => Ok(Projections::Separate(
                parts
                    .into_iter()
                    .map(|p| Linear::new(p, numerics))
                    .collect::<Result<_>>()?,
            )),
            Numerics::Fast => {
                let dense = parts
                    .iter()
                    .map(|p| p.dequantize(&candle_core::Device::Cpu))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                let widths = dense.iter().map(|d| d.dim(0)).collect::<candle_core::Result<_>>()?;
                let requantize = parts.iter().any(|p| p.dtype() != GgmlDType::F32);
                Ok(Projections::Stacked {
                    weight: Linear::from_dense(Tensor::cat(&dense, 0)?, requantize)?,
                    widths,
                })
            }
        }
    }

    /// `x`: `(rows, in)` -> one `(rows, out_i)` tensor per part.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Projections::Separate(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            Projections::Stacked { weight, widths } => {
                let y = weight.forward(x)?;
                let mut offset = 0;
                widths
                    .iter()
                    .map(|&w| {
                        let part = y.narrow(1, offset, w)?;
                        offset += w;
                        Ok(part)
                    })
                    .collect()
            }
        }
    }

    /// Bytes held by the weights.
    pub fn bytes(&self) -> usize {
        match self {
            Projections::Separate(parts) => parts.iter().map(Linear::bytes).sum(),
            Projections::Stacked { weight, .. } => weight.bytes(),
        }
    }
}
