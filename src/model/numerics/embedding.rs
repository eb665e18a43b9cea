//! The token embedding table: f32 rows, or in [`Numerics::Fast`] the file's Q4_1, Q5_0 or Q8_0
//! blocks dequantized one looked-up row at a time (and shared with a tied LM head), so
//! the table never exists in f32. A row's dequantized values are the ones the whole f32
//! table would hold.

use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::model::file::gguf::TensorSource;
use crate::model::numerics::kernels::{BlockMatrix, Format};
use crate::model::numerics::linear::fast_blocks;
use crate::model::numerics::Numerics;
use crate::{Error, Result};

/// A `(vocab, d_model)` embedding table.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// f32 rows.
    Dense(Tensor),
    /// Block rows, dequantized on lookup.
    Blocks(Arc<BlockMatrix>),
}

impl Embedding {
    /// Read the table `name` `(vocab, d_model)` from `src`: in [`Numerics::Fast`] the
    /// file's Q4_1, Q5_0 or Q8_0 bytes as they are (no `QTensor` is built, so the table is never
    /// held twice), Q4_K as Q4_1 blocks and other types requantized to Q8_0 where the width
    /// allows; f32 otherwise.
    /// Returns the tensor too when the table is f32 (a tied LM head is built from it).
    pub fn load(
        src: &mut dyn TensorSource,
        name: &str,
        (vocab, d): (usize, usize),
        numerics: Numerics,
    ) -> Result<(Self, Option<QTensor>)> {
        let raw = src.raw(name)?;
        if raw.dims != [vocab, d] {
            return Err(Error::Tensor {
                name: name.into(),
                reason: format!("shape {:?}, expected [{vocab}, {d}]", raw.dims),
            });
        }
        if numerics == Numerics::Fast {
            if let Some(format) = Format::of(raw.dtype) {
                if let Some(m) = BlockMatrix::from_blocks(format, raw.bytes, vocab, d) {
                    return Ok((Embedding::Blocks(Arc::new(m)), None));
                }
                return Err(Error::Tensor {
                    name: name.into(),
                    reason: "its bytes are not whole blocks of its type".into(),
                });
            }
        }
        let q = qtensor_from_ggml(raw.dtype, &raw.bytes, raw.dims, &Device::Cpu)?;
        if numerics == Numerics::Fast {
            if let Some(m) = fast_blocks(&q)? {
                return Ok((Embedding::Blocks(Arc::new(m)), None));
            }
        }
        Ok((Embedding::Dense(q.dequantize(&Device::Cpu)?), Some(q)))
    }

    /// The rows of `ids`, `(ids.len(), d_model)`; an error for an id outside the table.
    pub fn lookup(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Embedding::Dense(t) => {
                let vocab = t.dim(0)?;
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(out_of_range(id, vocab));
                }
                let ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
                Ok(t.index_select(&ids, 0)?)
            }
            Embedding::Blocks(m) => {
                let d = m.cols();
                let mut out = vec![0f32; ids.len() * d];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(d)) {
                    m.dequantize_row(id as usize, row)
                        .ok_or_else(|| out_of_range(id, m.rows()))?;
                }
                Ok(Tensor::from_vec(out, (ids.len(), d), &Device::Cpu)?)
            }
        }
    }

    /// The whole table as f32 `(vocab, d_model)`.
    pub fn table(&self) -> Result<Tensor> {
        match self {
            Embedding::Dense(t) => Ok(t.clone()),
            Embedding::Blocks(m) => Ok(Tensor::from_vec(
                m.dequantize(),
                (m.rows(), m.cols()),
                &Device::Cpu,
            )?),
        }
    }

    /// The blocks, when the table is kept in blocks.
    pub fn blocks(&self) -> Option<&Arc<BlockMatrix>> {
        match self {
            Embedding::Dense(_) => None,
            Embedding::Blocks(m) => Some(m),
        }
    }
}

fn out_of_range(id: u32, vocab: usize) -> Error {
    Error::invalid(
        "token id",
        format!("{id} is outside the vocabulary of {vocab}"),
    )
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::*;

    #[test]
    fn block_rows_are_the_rows_of_the_dequantized_table() {
        use crate::model::file::gguf::MemorySource;
        let data: Vec<f32> = (0..10 * 64)
            .map(|i| ((i * 7919) % 113) as f32 / 50.0 - 1.1)
            .collect();
        let t = Tensor::from_vec(data, (10, 64), &Device::Cpu).unwrap();
        let load = |dtype, numerics| {
            let mut src = MemorySource::default();
            src.insert("e", QTensor::quantize(&t, dtype).unwrap());
            Embedding::load(&mut src, "e", (10, 64), numerics).unwrap()
        };
        for dtype in [
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::F32,
        ] {
            let (fast, tensor) = load(dtype, Numerics::Fast);
            let (dense, dense_tensor) = load(dtype, Numerics::Reference);
            assert!(dense_tensor.is_some() && dense.blocks().is_none());
            assert_eq!(
                fast.blocks().is_some(),
                dtype != GgmlDType::F32,
                "{dtype:?}"
            );
            assert_eq!(tensor.is_some(), dtype == GgmlDType::F32, "{dtype:?}");
            let ids = [9, 0, 3, 3];
            let a: Vec<Vec<f32>> = fast.lookup(&ids).unwrap().to_vec2().unwrap();
            let b: Vec<Vec<f32>> = dense.lookup(&ids).unwrap().to_vec2().unwrap();
            if dtype == GgmlDType::Q5_1 {
                // requantized to Q8_0: within half an 8-bit step of each block's largest |w|
                for (ra, rb) in a.iter().zip(&b) {
                    assert!(
                        ra.iter().zip(rb).all(|(x, y)| (x - y).abs() < 0.01),
                        "{dtype:?}"
                    );
                }
            } else {
                assert_eq!(a, b, "{dtype:?}");
            }
            assert!(fast
                .lookup(&[10])
                .unwrap_err()
                .to_string()
                .contains("outside"));
            assert!(dense
                .lookup(&[10])
                .unwrap_err()
                .to_string()
                .contains("outside"));
        }
        let mut src = MemorySource::default();
        src.insert("e", QTensor::quantize(&t, GgmlDType::Q8_0).unwrap());
        let err = Embedding::load(&mut src, "e", (11, 64), Numerics::Fast).unwrap_err();
        assert!(err.to_string().contains("expected [11, 64]"), "{err}");
    }
}
