//! Retrieval-head scoring: Wu et al.'s token-match score ([`wu`]), LOCOS logit
//! contribution ([`locos`]), the trial runner that feeds both from one observed greedy
//! generation per trial ([`run`]), and ranking files ([`ranking`]).

pub mod cca;
pub mod dynamic_ablation;
pub mod dynamics;
pub mod locos;
pub mod ranking;
pub mod run;
pub mod trace;
pub mod wu;

/// One score per (layer, query head), row-major `(n_layers, n_heads)`.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadMatrix {
    pub n_layers: usize,
    pub n_heads: usize,
    pub data: Vec<f64>,
}

impl HeadMatrix {
    /// All zeros.
    pub fn zeros(n_layers: usize, n_heads: usize) -> Self {
        Self {
            n_layers,
            n_heads,
            data: vec![0.0; n_layers * n_heads],
        }
    }

    /// Score of (layer, head).
    pub fn get(&self, layer: usize, head: usize) -> f64 {
        self.data[layer * self.n_heads + head]
    }

    /// Mutable score of (layer, head).
    pub fn at(&mut self, layer: usize, head: usize) -> &mut f64 {
        &mut self.data[layer * self.n_heads + head]
    }

    /// Add `other` element-wise.
    pub fn add(&mut self, other: &HeadMatrix) {
        self.data
            .iter_mut()
            .zip(&other.data)
            .for_each(|(a, b)| *a += b);
    }

    /// Multiply every score by `k`.
    pub fn scale(&mut self, k: f64) {
        self.data.iter_mut().for_each(|a| *a *= k);
    }
}
