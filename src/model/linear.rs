//! Linear layers over GGUF weights, with a choice of numerics.
//!
//! * [`Numerics::Reference`] multiplies with the file's own quantized blocks through
//!   `QMatMul`, exactly the path mistral.rs takes (activations are quantized to the
//!   weight type's dot-product partner, e.g. Q8_1 for Q4_1): the parity mode.
//! * [`Numerics::Fast`] keeps a dequantized f32 copy for batched rows (prefill: a SIMD
//!   gemm is ~9x faster than quantized dot products at 64 rows) and an 8-bit copy for
//!   single rows ([`Q8Matrix`]: decode streams every weight once per token, and candle
//!   has no SIMD kernel for Q4_1).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use crate::model::ggml::InputGrid;
use crate::model::ggml_quant::QuantMatrix;
use crate::model::q8::{Q41Matrix, Q8Matrix};

use crate::Result;

/// How linear layers compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Numerics {
    /// The file's quantized weights through `QMatMul`, as mistral.rs computes.
    Reference,
    /// llama.cpp's CPU arithmetic, bit for bit ([`crate::model::ggml`],
    /// [`crate::model::ggml_quant`]): quantized matmuls on the weights' own codes in
    /// ggml's order, its norms, RoPE, GELU table and plain f32 attention.
    Ggml,
    /// Dequantized f32 for batched rows, Q8_0 for single rows.
    #[default]
    Fast,
}

impl Numerics {
    /// The name `--numerics` takes.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Reference => "reference",
            Numerics::Ggml => "ggml",
            Numerics::Fast => "fast",
        }
    }
}

impl std::str::FromStr for Numerics {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "reference" => Ok(Numerics::Reference),
            "ggml" => Ok(Numerics::Ggml),
            "fast" => Ok(Numerics::Fast),
            other => Err(crate::Error::invalid(
                "numerics",
                format!("`{other}` (expected reference, ggml or fast)"),
            )),
        }
    }
}

/// Rows from which the dense f32 weight is used in [`Numerics::Fast`].
const DENSE_MIN_ROWS: usize = 4;

/// How rows below [`DENSE_MIN_ROWS`] (decode steps) are multiplied.
#[derive(Debug, Clone)]
enum RowPath {
    /// candle's `QMatMul` (the file's blocks, or an f32 weight).
    Candle(QMatMul),
    /// headwise's 8-bit matrix-vector kernel.
    Q8(Q8Matrix),
    /// headwise's kernel over the file's own Q4_1 blocks.
    Q41(Q41Matrix),
    /// [`Numerics::Ggml`], for any number of rows: ggml's own quantized product, and the
    /// f32 `weight` `(out, in)` for readers of the weight.
    GgmlExact { matrix: QuantMatrix, weight: Tensor },
    /// [`Numerics::Ggml`] for weight types without an exact kernel, any number of rows:
    /// the input rounded to the grid of the weight's type, times the f32 `weight`
    /// `(out, in)` (ggml's product up to summation order).
    Ggml { grid: InputGrid, weight: Tensor },
}

/// The parts' Q4_1 blocks stacked row-wise, if every part is a 2-D Q4_1 tensor.
fn stacked_q4_1(parts: &[&QTensor]) -> Result<Option<Q41Matrix>> {
    if parts.iter().any(|p| p.dtype() != GgmlDType::Q4_1) {
        return Ok(None);
    }
    let mut raw = Vec::new();
    let (mut rows, mut cols) = (0, None);
    for p in parts {
        let (out, inp) = p.shape().dims2()?;
        if cols.is_some_and(|c| c != inp) {
            return Ok(None);
        }
        cols = Some(inp);
        rows += out;
        raw.extend_from_slice(&p.data()?);
    }
    Ok(cols.and_then(|c| Q41Matrix::from_gguf(raw, rows, c)))
}

/// `y = x W^T` for a weight `W` of shape `(out, in)`.
#[derive(Debug, Clone)]
pub struct Linear {
    rows: RowPath,
    /// `(out, in)` f32, present in [`Numerics::Fast`].
    dense: Option<Tensor>,
}

impl Linear {
    /// Build from a GGUF tensor of shape `(out, in)`.
    pub fn new(weight: QTensor, numerics: Numerics) -> Result<Self> {
        match numerics {
            Numerics::Reference => Ok(Self {
                rows: RowPath::Candle(QMatMul::from_qtensor(weight)?),
                dense: None,
            }),
            Numerics::Fast => {
                let dense = weight.dequantize(&Device::Cpu)?;
                if let Some(m) = stacked_q4_1(&[&weight])? {
                    return Ok(Self {
                        rows: RowPath::Q41(m),
                        dense: Some(dense),
                    });
                }
                let exact = weight.dtype() == GgmlDType::F32;
                Self::fast(dense, !exact, || QMatMul::from_qtensor(weight))
            }
            Numerics::Ggml => {
                let dense = weight.dequantize(&Device::Cpu)?;
                Self::ggml(&weight, dense)
            }
        }
    }

    /// A [`Numerics::Ggml`] layer: ggml's exact product where [`QuantMatrix`] has the
    /// weight's type, else its input grid times the f32 weight `dense` `(out, in)`.
    fn ggml(weight: &QTensor, dense: Tensor) -> Result<Self> {
        let rows = match QuantMatrix::from_qtensor(weight)? {
            Some(matrix) => RowPath::GgmlExact {
                matrix,
                weight: dense,
            },
            None => RowPath::Ggml {
                grid: InputGrid::for_weight(weight.dtype())?,
                weight: dense,
            },
        };
        Ok(Self { rows, dense: None })
    }

    /// A [`Numerics::Fast`] layer from an f32 weight `(out, in)`. Single rows go through
    /// [`Q8Matrix`] when `requantize` and the width allows, else through `fallback`.
    fn fast(
        dense: Tensor,
        requantize: bool,
        fallback: impl FnOnce() -> candle_core::Result<QMatMul>,
    ) -> Result<Self> {
        let q8 = if requantize {
            let (out, inp) = dense.dims2()?;
            Q8Matrix::quantize(&dense.flatten_all()?.to_vec1::<f32>()?, out, inp)
        } else {
            None
        };
        let rows = match q8 {
            Some(m) => RowPath::Q8(m),
            None if requantize => RowPath::Candle(fallback()?),
            None => RowPath::Candle(QMatMul::Tensor(dense.clone())),
        };
        Ok(Self {
            rows,
            dense: Some(dense),
        })
    }

    /// Like [`Linear::new`], sharing an already dequantized copy of the weight
    /// (tied embeddings: the embedding table is the LM head).
    pub fn with_dense(weight: QTensor, dense: &Tensor, numerics: Numerics) -> Result<Self> {
        match numerics {
            Numerics::Reference => Self::new(weight, numerics),
            Numerics::Fast => {
                let exact = weight.dtype() == GgmlDType::F32;
                Self::fast(dense.clone(), !exact, || QMatMul::from_qtensor(weight))
            }
            Numerics::Ggml => Self::ggml(&weight, dense.clone()),
        }
    }

    /// `x`: `(rows, in)` f32 -> `(rows, out)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dim(0)?;
        match (&self.dense, &self.rows) {
            (Some(w), _) if rows >= DENSE_MIN_ROWS => Ok(x.matmul(&w.t()?)?),
            (_, RowPath::Candle(q)) => Ok(q.forward(x)?),
            (_, RowPath::Q8(m)) => per_row(x, m.rows(), |v| m.gemv(v)),
            (_, RowPath::Q41(m)) => per_row(x, m.rows(), |v| m.gemv(v)),
            (_, RowPath::GgmlExact { matrix, .. }) => matrix.forward(x),
            (_, RowPath::Ggml { grid, weight }) => Ok(grid.round_trip(x)?.matmul(&weight.t()?)?),
        }
    }

    /// The weight as f32 `(out, in)`.
    pub fn dequantized(&self) -> Result<Tensor> {
        match (&self.dense, &self.rows) {
            (Some(w), _) => Ok(w.clone()),
            (None, RowPath::Candle(QMatMul::QTensor(t))) => Ok(t.dequantize(&Device::Cpu)?),
            (None, RowPath::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t))) => {
                Ok(t.to_dtype(candle_core::DType::F32)?)
            }
            (None, RowPath::Ggml { weight, .. } | RowPath::GgmlExact { weight, .. }) => {
                Ok(weight.clone())
            }
            (None, RowPath::Q8(_) | RowPath::Q41(_)) => Err(crate::Error::invalid(
                "weight",
                "an 8-bit decode weight without its f32 copy",
            )),
        }
    }
}

/// `x` `(rows, in)` through a matrix-vector product one row at a time -> `(rows, out)`.
fn per_row(x: &Tensor, out: usize, gemv: impl Fn(&[f32]) -> Vec<f32>) -> Result<Tensor> {
    let rows = x.dim(0)?;
    let mut y = Vec::with_capacity(rows * out);
    for r in 0..rows {
        y.extend(gemv(&x.get(r)?.to_vec1::<f32>()?));
    }
    Ok(Tensor::from_vec(y, (rows, out), &Device::Cpu)?)
}

/// Several projections of the same input (Q, K and V; gate and up).
///
/// In [`Numerics::Fast`] they are stacked into one weight, so a decode step quantizes its
/// input once and runs one matmul instead of several; in [`Numerics::Reference`] they stay
/// separate, as mistral.rs keeps them (stacking would not change a single float, only
/// the layout), and in [`Numerics::Ggml`] too, each rounding its input to its own grid.
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
            Numerics::Reference | Numerics::Ggml => Ok(Projections::Separate(
                parts
                    .into_iter()
                    .map(|p| Linear::new(p, numerics))
                    .collect::<Result<_>>()?,
            )),
            Numerics::Fast => {
                let dense = parts
                    .iter()
                    .map(|p| p.dequantize(&Device::Cpu))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                let widths: Vec<usize> = dense
                    .iter()
                    .map(|d| d.dim(0))
                    .collect::<candle_core::Result<_>>()?;
                let stacked = Tensor::cat(&dense, 0)?;
                if let Some(m) = stacked_q4_1(&parts.iter().collect::<Vec<_>>())? {
                    let weight = Linear {
                        rows: RowPath::Q41(m),
                        dense: Some(stacked),
                    };
                    return Ok(Projections::Stacked { weight, widths });
                }
                let requantize = parts.iter().any(|p| p.dtype() != GgmlDType::F32);
                let fallback = || Ok(QMatMul::Tensor(stacked.clone()));
                Ok(Projections::Stacked {
                    weight: Linear::fast(stacked.clone(), requantize, fallback)?,
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
}
