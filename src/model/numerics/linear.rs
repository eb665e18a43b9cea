//! Linear layers over GGUF weights, with a choice of numerics.
//!
//! * [`Numerics::Reference`] multiplies with the file's own quantized blocks through
//!   `QMatMul`, exactly the path mistral.rs takes (activations are quantized to the
//!   weight type's dot-product partner, e.g. Q8_1 for Q4_1): the parity mode.
//! * [`Numerics::Fast`] keeps one copy of each weight, in blocks
//!   ([`BlockMatrix`]: Q4_1, Q5_0 and Q8_0 as the
//!   file stores them, Q4_K as Q4_1 blocks of its sub-blocks, other types requantized to
//!   Q8_0), multiplied by 8-bit integer kernels (activations quantized per row, as
//!   llama.cpp's CPU matmuls do) for any number of rows, prefill included; no f32 copy of
//!   a weight is kept.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use std::sync::Arc;

use crate::model::numerics::ggml::InputGrid;
use crate::model::numerics::ggml_quant::QuantMatrix;
use crate::model::numerics::kernels::{BlockMatrix, Format, Isa};

use crate::Result;

/// How linear layers compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Numerics {
    /// The file's quantized weights through `QMatMul`, as mistral.rs computes.
    Reference,
    /// llama.cpp's CPU arithmetic, bit for bit ([`crate::model::numerics::ggml`],
    /// [`crate::model::numerics::ggml_quant`]): quantized matmuls on the weights' own codes in
    /// ggml's order, its norms, RoPE, GELU table and plain f32 attention.
    Ggml,
    /// One copy of each weight in Q4_1, Q5_0 or Q8_0 blocks: 8-bit integer kernels.
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

/// How a [`Linear`] multiplies.
#[derive(Debug, Clone)]
enum RowPath {
    /// candle's `QMatMul`: the file's blocks ([`Numerics::Reference`]), or an f32 weight
    /// (`QMatMul::Tensor`: [`Numerics::Fast`] for weights that are f32 in the file or
    /// whose width is not whole blocks).
    Candle(QMatMul),
    /// [`Numerics::Fast`]: the weight in Q4_1, Q5_0 or Q8_0 blocks, for any number of rows
    /// (shared with the token embedding when the LM head is tied to it).
    Blocks(Arc<BlockMatrix>),
    /// [`Numerics::Ggml`], for any number of rows: ggml's own quantized product, and the
    /// f32 `weight` `(out, in)` for readers of the weight.
    GgmlExact { matrix: QuantMatrix, weight: Tensor },
    /// [`Numerics::Ggml`] for weight types without an exact kernel, any number of rows:
    /// the input rounded to the grid of the weight's type, times the f32 `weight`
    /// `(out, in)` (ggml's product up to summation order).
    Ggml { grid: InputGrid, weight: Tensor },
}

/// A 2-D weight `(out, in)` dequantized and requantized to Q8_0; `None` if the width is
/// not whole blocks.
fn requantized_q8_0(weight: &QTensor) -> Result<Option<BlockMatrix>> {
    let (out, inp) = weight.shape().dims2()?;
    let dense = weight.dequantize(&Device::Cpu)?.flatten_all()?;
    Ok(BlockMatrix::quantize_q8_0(
        &dense.to_vec1::<f32>()?,
        out,
        inp,
    ))
}

/// The [`Numerics::Fast`] blocks of a 2-D weight `(out, in)`: Q4_1, Q5_0 and Q8_0 as the
/// file stores them, Q4_K as Q4_1 blocks of its sub-blocks, any other type requantized to
/// Q8_0; `None` if the width is not whole blocks or the weight is f32 in the file (kept
/// exact).
pub(crate) fn fast_blocks(weight: &QTensor) -> Result<Option<BlockMatrix>> {
    let (out, inp) = weight.shape().dims2()?;
    let file = |format| -> Result<Option<BlockMatrix>> {
        Ok(BlockMatrix::from_blocks(
            format,
            weight.data()?.into_owned(),
            out,
            inp,
        ))
    };
    match (weight.dtype(), Format::of(weight.dtype())) {
        (GgmlDType::F32, _) => Ok(None),
        (_, Some(format)) => file(format),
        (GgmlDType::Q4K, None) => Ok(BlockMatrix::from_q4_k(&weight.data()?, out, inp)),
        (_, None) => requantized_q8_0(weight),
    }
}

/// `y = x W^T` for a weight `W` of shape `(out, in)`.
#[derive(Debug, Clone)]
pub struct Linear {
    rows: RowPath,
}

impl Linear {
    /// Build from a GGUF tensor of shape `(out, in)`.
    pub fn new(weight: QTensor, numerics: Numerics) -> Result<Self> {
        let rows = match numerics {
            Numerics::Reference => RowPath::Candle(QMatMul::from_qtensor(weight)?),
            Numerics::Fast => match fast_blocks(&weight)? {
                Some(m) => RowPath::Blocks(Arc::new(m)),
                None => RowPath::Candle(QMatMul::Tensor(weight.dequantize(&Device::Cpu)?)),
            },
            Numerics::Ggml => {
                let dense = weight.dequantize(&Device::Cpu)?;
                return Self::ggml(&weight, dense);
            }
        };
        Ok(Self { rows })
    }

    /// A [`Numerics::Fast`] layer on blocks that another reader may share (the tied
    /// token embedding).
    pub fn shared(matrix: Arc<BlockMatrix>) -> Self {
        Self {
            rows: RowPath::Blocks(matrix),
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
        Ok(Self { rows })
    }

    /// Like [`Linear::new`], sharing an already dequantized copy of the weight in
    /// [`Numerics::Ggml`] (tied embeddings).
    pub fn with_dense(weight: QTensor, dense: &Tensor, numerics: Numerics) -> Result<Self> {
        match numerics {
            Numerics::Ggml => Self::ggml(&weight, dense.clone()),
            Numerics::Reference | Numerics::Fast => Self::new(weight, numerics),
        }
    }

    /// `x`: `(rows, in)` f32 -> `(rows, out)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.rows {
            RowPath::Candle(q) => Ok(q.forward(x)?),
            RowPath::Blocks(m) => {
                let (n, inp) = x.dims2()?;
                if inp != m.cols() {
                    return Err(crate::Error::invalid(
                        "linear input",
                        format!("width {inp}, the weight takes {}", m.cols()),
                    ));
                }
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                Ok(Tensor::from_vec(
                    m.matmul(&xs, n),
                    (n, m.rows()),
                    &Device::Cpu,
                )?)
            }
            RowPath::GgmlExact { matrix, .. } => matrix.forward(x),
            RowPath::Ggml { grid, weight } => Ok(grid.round_trip(x)?.matmul(&weight.t()?)?),
        }
    }

    /// `x`: `(rows, in)` f32 -> `(rows, out)`, each row computed exactly as it would be
    /// alone (rows from different sequences of a batched decode step). Block weights run
    /// every row through the integer kernels in one pass over the weight; the other
    /// paths, whose arithmetic may depend on the number of rows, multiply row by row.
    pub fn forward_each(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        match &self.rows {
            _ if n == 1 => self.forward(x),
            RowPath::Blocks(m) => {
                let inp = x.dim(1)?;
                if inp != m.cols() {
                    return Err(crate::Error::invalid(
                        "linear input",
                        format!("width {inp}, the weight takes {}", m.cols()),
                    ));
                }
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                let y = m.quantized_product(&xs, n, Isa::active());
                Ok(Tensor::from_vec(y, (n, m.rows()), &Device::Cpu)?)
            }
            _ => {
                let rows = (0..n)
                    .map(|i| self.forward(&x.narrow(0, i, 1)?))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&rows, 0)?)
            }
        }
    }

    /// The weight as f32 `(out, in)`: in [`Numerics::Fast`] the values it multiplies with
    /// (for a weight requantized to Q8_0, those of its Q8_0 blocks).
    pub fn dequantized(&self) -> Result<Tensor> {
        match &self.rows {
            RowPath::Candle(QMatMul::QTensor(t)) => Ok(t.dequantize(&Device::Cpu)?),
            RowPath::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                Ok(t.to_dtype(candle_core::DType::F32)?)
            }
            RowPath::Blocks(m) => Ok(Tensor::from_vec(
                m.dequantize(),
                (m.rows(), m.cols()),
                &Device::Cpu,
            )?),
            RowPath::Ggml { weight, .. } | RowPath::GgmlExact { weight, .. } => Ok(weight.clone()),
        }
    }

    /// The weight's blocks, in [`Numerics::Fast`] when it is kept in blocks.
    pub fn blocks(&self) -> Option<&BlockMatrix> {
        match &self.rows {
            RowPath::Blocks(m) => Some(m),
            _ => None,
        }
    }

    /// Bytes of weight data that one row of input streams (what decode is bound by).
    pub fn weight_bytes(&self) -> usize {
        match &self.rows {
            RowPath::Blocks(m) => m.bytes(),
            RowPath::Candle(QMatMul::QTensor(t)) => t.storage_size_in_bytes(),
            RowPath::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t))
            | RowPath::Ggml { weight: t, .. }
            | RowPath::GgmlExact { weight: t, .. } => t.elem_count() * t.dtype().size_in_bytes(),
        }
    }
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
                let widths: Vec<usize> = parts
                    .iter()
                    .map(|p| p.shape().dims2().map(|(out, _)| out))
                    .collect::<candle_core::Result<_>>()?;
                let blocks = parts
                    .iter()
                    .map(fast_blocks)
                    .collect::<Result<Option<Vec<BlockMatrix>>>>()?;
                // One format for all parts: their own if they share it, else Q8_0 (Q5_0
                // parts converted exactly, or, beside Q4_1, every part requantized; a Q8_0
                // part requantized to Q8_0 keeps its codes).
                let blocks = match blocks {
                    Some(b) => match BlockMatrix::stack(b) {
                        Some(m) => Some(m),
                        None => BlockMatrix::stack(
                            parts
                                .iter()
                                .map(requantized_q8_0)
                                .collect::<Result<Option<Vec<_>>>>()?
                                .unwrap_or_default(),
                        ),
                    },
                    None => None,
                };
                let weight = match blocks {
                    Some(m) => Linear::shared(Arc::new(m)),
                    None => {
                        let dense = parts
                            .iter()
                            .map(|p| p.dequantize(&Device::Cpu))
                            .collect::<candle_core::Result<Vec<_>>>()?;
                        Linear {
                            rows: RowPath::Candle(QMatMul::Tensor(Tensor::cat(&dense, 0)?)),
                        }
                    }
                };
                Ok(Projections::Stacked { weight, widths })
            }
        }
    }

    /// The layers (one when stacked).
    pub fn layers(&self) -> Vec<&Linear> {
        match self {
            Projections::Separate(parts) => parts.iter().collect(),
            Projections::Stacked { weight, .. } => vec![weight],
        }
    }

    /// `x`: `(rows, in)` -> one `(rows, out_i)` tensor per part.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.parts(x, Linear::forward)
    }

    /// [`Projections::forward`] with each row computed as it would be alone
    /// ([`Linear::forward_each`]).
    pub fn forward_each(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.parts(x, Linear::forward_each)
    }

    fn parts(
        &self,
        x: &Tensor,
        mul: fn(&Linear, &Tensor) -> Result<Tensor>,
    ) -> Result<Vec<Tensor>> {
        match self {
            Projections::Separate(parts) => parts.iter().map(|p| mul(p, x)).collect(),
            Projections::Stacked { weight, widths } => {
                let y = mul(weight, x)?;
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
