//! A one-pass online softmax in mistral.rs's arithmetic order (see the module docs).

use candle_core::Tensor;

use super::rows::{per_row, Kv, Shapes};
use crate::Result;

/// Keys per tile in the single-query path.
const TILE: usize = 16;

/// Dot product summed in groups of four, left to right.
fn dot4(a: &[f32], b: &[f32]) -> f32 {
    let mut sum = 0f32;
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        sum += x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
    }
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

/// Running state of an online softmax: max `m`, normaliser `s`, weighted values `acc`.
struct Online {
    m: f32,
    s: f32,
    acc: Vec<f32>,
}

impl Online {
    fn new(d: usize) -> Self {
        Self {
            m: f32::NEG_INFINITY,
            s: 0.0,
            acc: vec![0.0; d],
        }
    }

    /// Fold in one key with score `score` and value row `v`.
    fn push(&mut self, score: f32, v: &[f32]) {
        let (mut rescale, mut weight) = (1.0f32, 1.0f32);
        if score > self.m {
            rescale = (self.m - score).exp();
            self.m = score;
            for a in self.acc.iter_mut() {
                *a *= rescale;
            }
        } else {
            weight = (score - self.m).exp();
        }
        for (a, x) in self.acc.iter_mut().zip(v) {
            *a += x * weight;
        }
        self.s = self.s * rescale + weight;
    }

    /// Merge the state of the keys that follow (`other`) into this one.
    fn merge(&mut self, other: &Online) {
        if other.s == 0.0 {
            return; // every key of `other` was masked
        }
        if self.s == 0.0 {
            self.m = other.m;
            self.s = other.s;
            self.acc.copy_from_slice(&other.acc);
            return;
        }
        if self.m >= other.m {
            let f = (other.m - self.m).exp();
            for (a, b) in self.acc.iter_mut().zip(&other.acc) {
                *a += b * f;
            }
            self.s += other.s * f;
        } else {
            let f = (self.m - other.m).exp();
            for (a, b) in self.acc.iter_mut().zip(&other.acc) {
                *a = b + *a * f;
            }
            self.s = other.s + self.s * f;
            self.m = other.m;
        }
    }

    fn write(&self, out: &mut [f32]) {
        let inv = 1.0 / self.s;
        for (o, a) in out.iter_mut().zip(&self.acc) {
            *o = a * inv;
        }
    }
}

/// Attention by online softmax in mistral.rs's arithmetic order (see the module docs).
pub(crate) fn streaming(
    q: &Tensor,
    kv: &Kv,
    start: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    per_row(q, kv, start, mask, |rows, out| {
        let Shapes {
            q_len, dh, kv_len, ..
        } = *rows.shapes;
        for (i, slot) in out.chunks_mut(dh).enumerate() {
            let (kvh, qrow, scale) = (rows.kv_head(i), rows.query(i), rows.shapes.scale);
            let visit = |st: &mut Online, j: usize| {
                let b = rows.bias(i, j);
                if b == f32::NEG_INFINITY {
                    return;
                }
                let score = dot4(qrow, rows.key(kvh, j)) * scale + b;
                st.push(score, rows.value(kvh, j));
            };
            if q_len == 1 {
                let mut total: Option<Online> = None;
                for tile in (0..kv_len).step_by(TILE) {
                    let mut st = Online::new(dh);
                    for j in tile..(tile + TILE).min(kv_len) {
                        visit(&mut st, j);
                    }
                    match total.as_mut() {
                        None => total = Some(st),
                        Some(acc) => acc.merge(&st),
                    }
                }
                if let Some(st) = total {
                    st.write(slot);
                }
            } else {
                let mut st = Online::new(dh);
                for j in 0..kv_len {
                    visit(&mut st, j);
                }
                st.write(slot);
            }
        }
    })
}
