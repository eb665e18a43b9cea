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
    /// ggml's rotation (fused multiply-adds) instead of candle's kernels.
    fused: bool,
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
            fused: false,
        })
    }

    /// Tables and rotation in ggml's arithmetic, for
    /// [`Numerics::Ggml`](crate::model::Numerics::Ggml): the angle of pair `i` at position
    /// `p` is `p s^i` with `s = base^(-2 / d_head)`, built by repeated f32 multiplication
    /// (`p`, `p s`, `(p s) s`, ...), `cos`/`sin` in f32, and a pair `(a, b)` becomes
    /// `(fma(a, cos, -(b sin)), fma(a, sin, b cos))`. Checked bit for bit against
    /// llama.cpp's RoPE; computing `base^(-2i / d_head)` directly instead moves rotated
    /// queries of Gemma-3-270M by up to 2.4e-4 within the first 347 positions.
    pub fn ggml(base: f32, d_head: usize, context: usize, style: RopeStyle) -> Result<Self> {
        let half = d_head / 2;
        let step = base.powf(-2.0 / d_head as f32);
        let mut cos = Vec::with_capacity(context * half);
        let mut sin = Vec::with_capacity(context * half);
        for p in 0..context {
            let mut theta = p as f32;
            for _ in 0..half {
                cos.push(theta.cos());
                sin.push(theta.sin());
                theta *= step;
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (context, half), &Device::Cpu)?,
            sin: Tensor::from_vec(sin, (context, half), &Device::Cpu)?,
            style,
            fused: true,
        })
    }

    /// Rotate `x`: `(1, heads, seq, d_head)` whose first token sits at position `start`.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let seq = x.dim(2)?;
        let cos = self.cos.narrow(0, start, seq)?;
        let sin = self.sin.narrow(0, start, seq)?;
        let x = x.contiguous()?;
        if self.fused {
            return self.apply_fused(&x, &cos, &sin);
        }
        Ok(match self.style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?,
            RopeStyle::Halves => candle_nn::rotary_emb::rope(&x, &cos, &sin)?,
        })
    }

    /// ggml's rotation of contiguous `x` `(b, n_heads, seq, d_head)` by the tables' rows
    /// `cos`/`sin` `(seq, d_head / 2)`.
    fn apply_fused(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let d = x.dim(3)?;
        let (seq, half) = (x.dim(2)?, d / 2);
        let (cos, sin): (Vec<f32>, Vec<f32>) =
            (cos.flatten_all()?.to_vec1()?, sin.flatten_all()?.to_vec1()?);
        let mut v: Vec<f32> = x.flatten_all()?.to_vec1()?;
        for (r, row) in v.chunks_mut(d).enumerate() {
            let t = r % seq;
            for i in 0..half {
                let (a, b) = match self.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + half),
                };
                let (c, s) = (cos[t * half + i], sin[t * half + i]);
                let (x0, x1) = (row[a], row[b]);
                row[a] = x0.mul_add(c, -(x1 * s));
                row[b] = x0.mul_add(s, x1 * c);
            }
        }
        Ok(Tensor::from_vec(v, x.shape(), x.device())?)
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
        for (style, ggml) in [RopeStyle::Interleaved, RopeStyle::Halves]
            .into_iter()
            .flat_map(|s| [(s, false), (s, true)])
        {
            let build = if ggml { Rope::ggml } else { Rope::new };
            let rope = build(10_000.0, d, 64, style).unwrap();
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
