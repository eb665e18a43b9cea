//! Rotary position embeddings (Su et al. 2021): pair `i` of a head's dimensions is rotated
//! by the angle `pos * base^(-2i / d_head)`. In the interleaved form llama.cpp applies to
//! `llama` GGUF models the pairs are `(2i, 2i+1)`; in the halves form of Gemma
//! ("neox" in llama.cpp) they are `(i, i + d_head / 2)`.

use std::sync::{Arc, RwLock};

use candle_core::{Device, Tensor};

use crate::model::config::RopeStyle;
use crate::{Error, Result};

/// Rows of the tables built at least at a time, so that a decode does not extend them
/// at every step.
const MIN_ROWS: usize = 256;

/// How a table row's angles are computed.
#[derive(Debug, Clone, Copy)]
enum Angles {
    /// `pos * base^(-2i / d_head)` with the inverse frequencies in f32 (candle's and
    /// mistral.rs's tables).
    Direct,
    /// `p`, `p s`, `(p s) s`, ... with `s = base^(-2 / d_head)` (ggml's).
    Repeated,
}

/// `cos`/`sin` rows for positions `0..rows`, `d_head / 2` values each.
#[derive(Debug, Default)]
struct Table {
    rows: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// Rotation tables for positions `0..context`, built on demand: a row exists once a
/// position at or past it has been rotated (the tables grow by doubling, at least
/// `MIN_ROWS` rows at a time), so memory follows the longest sequence run, not the
/// model's context (Gemma 3's 32,768 positions at two bases were 64 MiB of tables built
/// up front). Each row is computed on its own, so a row has the same bits whenever it is
/// built. Clones share the tables.
#[derive(Debug, Clone)]
pub struct Rope {
    base: f32,
    d_head: usize,
    context: usize,
    angles: Angles,
    style: RopeStyle,
    /// ggml's rotation (fused multiply-adds) instead of candle's kernels.
    fused: bool,
    table: Arc<RwLock<Table>>,
}

impl Rope {
    /// Tables for positions `0..context` of a head of width `d_head`.
    pub fn new(base: f32, d_head: usize, context: usize, style: RopeStyle) -> Self {
        Self::build(base, d_head, context, style, Angles::Direct, false)
    }

    /// Tables and rotation in ggml's arithmetic, for
    /// [`Numerics::Ggml`](crate::model::Numerics::Ggml): the angle of pair `i` at position
    /// `p` is `p s^i` with `s = base^(-2 / d_head)`, built by repeated f32 multiplication
    /// (`p`, `p s`, `(p s) s`, ...), `cos`/`sin` in f32, and a pair `(a, b)` becomes
    /// `(fma(a, cos, -(b sin)), fma(a, sin, b cos))`. Checked bit for bit against
    /// llama.cpp's RoPE; computing `base^(-2i / d_head)` directly instead moves rotated
    /// queries of Gemma-3-270M by up to 2.4e-4 within the first 347 positions.
    pub fn ggml(base: f32, d_head: usize, context: usize, style: RopeStyle) -> Self {
        Self::build(base, d_head, context, style, Angles::Repeated, true)
    }

    fn build(
        base: f32,
        d_head: usize,
        context: usize,
        style: RopeStyle,
        angles: Angles,
        fused: bool,
    ) -> Self {
        Self {
            base,
            d_head,
            context,
            angles,
            style,
            fused,
            table: Arc::default(),
        }
    }

    /// Positions the tables hold now.
    pub fn rows(&self) -> usize {
        self.table.read().map_or(0, |t| t.rows)
    }

    /// Append rows `t.rows..rows` to `t`.
    fn extend(&self, t: &mut Table, rows: usize) {
        let half = self.d_head / 2;
        t.cos.reserve_exact((rows - t.rows) * half);
        t.sin.reserve_exact((rows - t.rows) * half);
        match self.angles {
            Angles::Direct => {
                let inv_freq: Vec<f32> = (0..half)
                    .map(|i| 1.0 / self.base.powf((2 * i) as f32 / self.d_head as f32))
                    .collect();
                for p in t.rows..rows {
                    for f in &inv_freq {
                        let theta = p as f32 * f;
                        t.cos.push(theta.cos());
                        t.sin.push(theta.sin());
                    }
                }
            }
            Angles::Repeated => {
                let step = self.base.powf(-2.0 / self.d_head as f32);
                for p in t.rows..rows {
                    let mut theta = p as f32;
                    for _ in 0..half {
                        t.cos.push(theta.cos());
                        t.sin.push(theta.sin());
                        theta *= step;
                    }
                }
            }
        }
        t.rows = rows;
    }

    /// The table rows of positions `start..start + seq`, `(seq, d_head / 2)` each, built
    /// first if the tables do not reach them yet.
    fn rows_at(&self, start: usize, seq: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let end = start + seq;
        if end > self.context {
            return Err(Error::invalid(
                "position",
                format!("{end} past the model's context of {}", self.context),
            ));
        }
        fn poisoned<T>(_: std::sync::PoisonError<T>) -> Error {
            Error::invalid("rope", "a thread panicked while extending the tables")
        }
        if self.table.read().map_err(poisoned)?.rows < end {
            let mut t = self.table.write().map_err(poisoned)?;
            if t.rows < end {
                let rows = end.max(2 * t.rows).max(MIN_ROWS).min(self.context);
                self.extend(&mut t, rows);
            }
        }
        let t = self.table.read().map_err(poisoned)?;
        let half = self.d_head / 2;
        let (a, b) = (start * half, end * half);
        Ok((
            Tensor::from_slice(&t.cos[a..b], (seq, half), dev)?,
            Tensor::from_slice(&t.sin[a..b], (seq, half), dev)?,
        ))
    }

    /// Rotate `x`: `(1, heads, seq, d_head)` whose first token sits at position `start`.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let (cos, sin) = self.rows_at(start, x.dim(2)?, x.device())?;
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
            let rope = build(10_000.0, d, 64, style);
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
        let rope = Rope::new(100_000.0, d, 128, RopeStyle::Halves);
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

    /// The tables as they were built before they grew on demand: candle's `arange` times
    /// the inverse frequencies, then `cos`/`sin`, all positions at once.
    fn whole_table(base: f32, d: usize, context: usize) -> (Vec<f32>, Vec<f32>) {
        let half = d / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        let inv = Tensor::from_vec(inv, (1, half), &Device::Cpu).unwrap();
        let pos = Tensor::arange(0u32, context as u32, &Device::Cpu)
            .unwrap()
            .to_dtype(candle_core::DType::F32)
            .unwrap()
            .reshape((context, 1))
            .unwrap();
        let angles = pos.broadcast_mul(&inv).unwrap();
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (flat(angles.cos().unwrap()), flat(angles.sin().unwrap()))
    }

    #[test]
    fn tables_grown_in_pieces_hold_the_bits_of_whole_tables() {
        let (d, context, base) = (16, 2000, 10_000.0);
        let (cos, sin) = whole_table(base, d, context);
        let rope = Rope::new(base, d, context, RopeStyle::Halves);
        assert_eq!(rope.rows(), 0);
        // A first call builds MIN_ROWS rows, a later one past them doubles, the last one
        // stops at the context.
        for (start, seq, rows) in [
            (0, 3, MIN_ROWS),
            (300, 1, 2 * MIN_ROWS),
            (1990, 10, context),
        ] {
            let (c, s) = rope.rows_at(start, seq, &Device::Cpu).unwrap();
            assert_eq!(rope.rows(), rows);
            let (c, s) = (c.flatten_all().unwrap(), s.flatten_all().unwrap());
            let range = start * d / 2..(start + seq) * d / 2;
            assert_eq!(c.to_vec1::<f32>().unwrap(), cos[range.clone()]);
            assert_eq!(s.to_vec1::<f32>().unwrap(), sin[range]);
        }
        let err = rope.rows_at(1995, 6, &Device::Cpu).unwrap_err().to_string();
        assert!(
            err.contains("2001 past the model's context of 2000"),
            "{err}"
        );
        // Clones share the tables.
        assert_eq!(rope.clone().rows(), context);
    }

    #[test]
    fn ggml_tables_follow_repeated_multiplication_at_any_position() {
        let (d, base) = (8, 1_000_000.0f32);
        let rope = Rope::ggml(base, d, 4096, RopeStyle::Interleaved);
        let step = base.powf(-2.0 / d as f32);
        let (c, s) = rope.rows_at(3000, 2, &Device::Cpu).unwrap();
        let (c, s) = (c.to_vec2::<f32>().unwrap(), s.to_vec2::<f32>().unwrap());
        for (r, p) in [3000usize, 3001].into_iter().enumerate() {
            let mut theta = p as f32;
            for i in 0..d / 2 {
                assert_eq!(
                    (c[r][i], s[r][i]),
                    (theta.cos(), theta.sin()),
                    "pos {p} pair {i}"
                );
                theta *= step;
            }
        }
        assert_eq!(rope.rows(), 3002);
    }
}
