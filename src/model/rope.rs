//! Rotary position embeddings (Su et al. 2021): pair `i` of a head's dimensions is rotated
//! by the angle `pos * base^(-2i / d_head)`. In the interleaved form llama.cpp applies to
//! `llama` GGUF models the pairs are `(2i, 2i+1)`; in the halves form of Gemma
//! ("neox" in llama.cpp) they are `(i, i + d_head / 2)`.

use candle_core::{DType, Device, Tensor};

use crate::model::config::RopeStyle;
use crate::Result;

/// Precomputed `cos`/`sin` tables, `(context, d_head / 2)` each.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
}

impl Rope {
    /// Tables for positions `0..context` of a head of width `d_head`.
    pub fn new(base: f32, d_head: usize, context: usize, style: RopeStyle) -> Result<Self> {
        let half = d_head / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d_head as f32))
            .collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), &Device::Cpu)?;
        let pos = Tensor::arange(0u32, context as u32, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .reshape((context, 1))?;
        let angles = pos.broadcast_mul(&inv_freq)?;
        Ok(Self {
            cos: angles.cos()?,
            sin: angles.sin()?,
            style,
        })
    }

    /// Rotate `x`: `(1, heads, seq, d_head)` whose first token sits at position `start`.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let seq = x.dim(2)?;
        let cos = self.cos.narrow(0, start, seq)?;
        let sin = self.sin.narrow(0, start, seq)?;
        let x = x.contiguous()?;
        Ok(match self.style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?,
            RopeStyle::Halves => candle_nn::rotary_emb::rope(&x, &cos, &sin)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute-force rotation of one head vector, written independently of candle's kernel.
    fn rotate(v: &[f32], pos: usize, base: f32, style: RopeStyle) -> Vec<f32> {
        let d = v.len();
        let mut out = vec![0.0; d];
        for i in 0..d / 2 {
            let theta = pos as f64 * (base as f64).powf(-2.0 * i as f64 / d as f64);
            let (s, c) = theta.sin_cos();
            let (x, y) = match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Halves => (i, i + d / 2),
            };
            let (a, b) = (v[x] as f64, v[y] as f64);
            out[x] = (a * c - b * s) as f32;
            out[y] = (a * s + b * c) as f32;
        }
        out
    }

    fn vec_at(t: &Tensor, head: usize, pos: usize) -> Vec<f32> {
        t.get(0)
            .unwrap()
            .get(head)
            .unwrap()
            .get(pos)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn matches_brute_force_rotation_and_preserves_norms() {
        let (d, seq, start) = (16, 5, 7);
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            let rope = Rope::new(10_000.0, d, 64, style).unwrap();
            let x = Tensor::randn(0f32, 1.0, (1, 2, seq, d), &Device::Cpu).unwrap();
            let y = rope.apply(&x, start).unwrap();
            for h in 0..2 {
                for t in 0..seq {
                    let xv = vec_at(&x, h, t);
                    let yv = vec_at(&y, h, t);
                    let want = rotate(&xv, start + t, 10_000.0, style);
                    for (a, b) in yv.iter().zip(&want) {
                        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
                    }
                    let n0: f32 = xv.iter().map(|v| v * v).sum();
                    let n1: f32 = yv.iter().map(|v| v * v).sum();
                    assert!((n0 - n1).abs() < 1e-3 * n0.max(1.0));
                }
            }
        }
    }

    #[test]
    fn dot_products_depend_only_on_relative_position() {
        let d = 32;
        let rope = Rope::new(100_000.0, d, 128, RopeStyle::Halves).unwrap();
        let q = Tensor::randn(0f32, 1.0, (1, 1, 1, d), &Device::Cpu).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, 1, 1, d), &Device::Cpu).unwrap();
        let dot = |qp: usize, kp: usize| -> f32 {
            let a = vec_at(&rope.apply(&q, qp).unwrap(), 0, 0);
            let b = vec_at(&rope.apply(&k, kp).unwrap(), 0, 0);
            a.iter().zip(&b).map(|(x, y)| x * y).sum()
        };
        let base = dot(10, 3);
        for shift in [1, 20, 90] {
            let shifted = dot(10 + shift, 3 + shift);
            assert!((base - shifted).abs() < 1e-3, "{base} vs {shifted}");
        }
        assert!((dot(10, 3) - dot(10, 4)).abs() > 1e-6);
    }
}
