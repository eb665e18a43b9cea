//! Head ablation: which heads (top-k of a ranking, or a seeded random draw) and how
//! (the four modes of `docs/methods.md`, "Ablation modes"), with the calibration means two of the modes
//! need.

use std::path::Path;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::artifact::{read_versioned, Versioned};
use crate::model::{
    Interventions, Model, ModelId, Observer, OutputEdit, QueryEdit, Session, Wants,
};
use crate::policy::ranking::Ranking;
use crate::provenance::Made;
use crate::results::write_atomic;
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// Version of the calibration file format.
pub const CALIBRATION_SCHEMA_VERSION: u32 = 1;

/// How an ablated head is silenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AblationMode {
    /// The head's output (before `W_O`) is zero.
    ZeroOutput,
    /// The head's output is its mean over the calibration set.
    MeanOutput,
    /// The head's pre-RoPE query is its mean over the calibration set (RoPE still
    /// rotates it to each position).
    MeanQuery,
    /// The head attends uniformly over the keys it may see.
    UniformAttention,
}

impl AblationMode {
    /// Every mode, in the order the command line lists them.
    pub const ALL: [AblationMode; 4] = [
        AblationMode::ZeroOutput,
        AblationMode::MeanOutput,
        AblationMode::MeanQuery,
        AblationMode::UniformAttention,
    ];

    /// The name every result records: `zero-output`, `mean-output`, `mean-query`,
    /// `uniform-attention`.
    pub fn name(self) -> &'static str {
        match self {
            AblationMode::ZeroOutput => "zero-output",
            AblationMode::MeanOutput => "mean-output",
            AblationMode::MeanQuery => "mean-query",
            AblationMode::UniformAttention => "uniform-attention",
        }
    }

    /// Whether the mode needs calibration means.
    pub fn needs_calibration(self) -> bool {
        matches!(self, AblationMode::MeanOutput | AblationMode::MeanQuery)
    }
}

/// A set of (layer, query head) addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadSet(pub Vec<(usize, usize)>);

impl HeadSet {
    /// The `k` best-scored heads of `ranking` (ties broken by (layer, head) order).
    ///
    /// Errors when `k` exceeds the number of heads.
    pub fn top_k(ranking: &Ranking, k: usize) -> Result<Self> {
        let n = ranking.heads.len();
        if k > n {
            return Err(Error::invalid(
                "k",
                format!("{k} is more than the model's {n} heads"),
            ));
        }
        Ok(Self(
            ranking.top(k).iter().map(|h| (h.layer, h.head)).collect(),
        ))
    }

    /// `k` heads drawn uniformly without replacement from `n_layers x n_heads`, fixed by
    /// `seed` (a partial Fisher-Yates shuffle on SplitMix64, so a seed means the same set
    /// in every build); a larger `k` with the same seed extends the smaller set.
    pub fn random(n_layers: usize, n_heads: usize, k: usize, seed: u64) -> Result<Self> {
        let n = n_layers * n_heads;
        if k > n {
            return Err(Error::invalid(
                "k",
                format!("{k} is more than the model's {n} heads"),
            ));
        }
        let mut all: Vec<usize> = (0..n).collect();
        let mut rng = SplitMix64::new(seed, 0x4845_4144_5345_5421);
        for i in 0..k {
            let j = i + rng.below(n - i);
            all.swap(i, j);
        }
        Ok(Self(
            all[..k]
                .iter()
                .map(|&i| (i / n_heads, i % n_heads))
                .collect(),
        ))
    }

    /// The edits that ablate these heads in `mode`; `calibration` is required for the
    /// mean modes.
    pub fn interventions(
        &self,
        mode: AblationMode,
        calibration: Option<&Calibration>,
    ) -> Result<Interventions> {
        let mut edits = Interventions::new();
        if self.0.is_empty() {
            return Ok(edits);
        }
        let calibration = match (mode.needs_calibration(), calibration) {
            (true, None) => {
                return Err(Error::invalid(
                    "mode",
                    format!("{} needs a calibration set", mode.name()),
                ))
            }
            (_, c) => c,
        };
        for &(layer, head) in &self.0 {
            match mode {
                AblationMode::ZeroOutput => {
                    edits.set_output(layer, head, OutputEdit::Zero);
                }
                AblationMode::UniformAttention => {
                    edits.set_query(layer, head, QueryEdit::Uniform);
                }
                AblationMode::MeanOutput => {
                    let c = calibration.ok_or(Error::Internal("calibration is checked present"))?;
                    edits.set_output(layer, head, OutputEdit::Replace(c.output(layer, head)?));
                }
                AblationMode::MeanQuery => {
                    let c = calibration.ok_or(Error::Internal("calibration is checked present"))?;
                    edits.set_query(layer, head, QueryEdit::Replace(c.query(layer, head)?));
                }
            }
        }
        Ok(edits)
    }
}

/// Per-head means of the output (before `W_O`) and of the pre-RoPE query over every
/// position of a calibration set but the first of each prompt (position 0 is the
/// attention sink, whose head outputs are atypical).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub schema_version: u32,
    /// Model file stem and sha256: means are only valid for the model they came from.
    pub model: String,
    pub model_sha256: String,
    /// What the calibration prompts were (e.g. the example ids), for provenance.
    pub source: String,
    pub n_prompts: usize,
    /// Positions averaged over.
    pub n_positions: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub d_head: usize,
    /// `(n_layers, n_heads, d_head)`, row-major.
    pub output_means: Vec<f32>,
    /// `(n_layers, n_heads, d_head)`, row-major.
    pub query_means: Vec<f32>,
    /// Numerics, build, command line and date of the run that computed the means.
    #[serde(flatten)]
    pub made: Made,
}

/// Sums head outputs and queries over the positions of one forward call.
struct MeanObserver {
    skip_first: bool,
    start: usize,
    outputs: Vec<f64>,
    queries: Vec<f64>,
    positions: usize,
    per_layer: usize,
}

impl MeanObserver {
    fn add(sums: &mut [f64], layer: usize, per_layer: usize, t: &Tensor, skip: usize) {
        let Ok(data) = t.flatten_all().and_then(|t| t.to_vec1::<f32>()) else {
            return;
        };
        let sums = &mut sums[layer * per_layer..(layer + 1) * per_layer];
        for row in data.chunks(per_layer).skip(skip) {
            for (s, v) in sums.iter_mut().zip(row) {
                *s += *v as f64;
            }
        }
    }

    fn skip(&self) -> usize {
        usize::from(self.skip_first && self.start == 0)
    }
}

impl Observer for MeanObserver {
    fn wants(&self) -> Wants {
        Wants {
            head_outputs: true,
            queries: true,
            ..Wants::default()
        }
    }
    fn begin(&mut self, start: usize, q: usize) {
        self.start = start;
        self.positions += q - usize::from(self.skip_first && start == 0);
    }
    fn head_outputs(&mut self, layer: usize, outputs: &Tensor) {
        let skip = self.skip();
        Self::add(&mut self.outputs, layer, self.per_layer, outputs, skip);
    }
    fn queries(&mut self, layer: usize, queries: &Tensor) {
        let skip = self.skip();
        Self::add(&mut self.queries, layer, self.per_layer, queries, skip);
    }
}

impl Versioned for Calibration {
    const KIND: &'static str = "calibration";
    const SCHEMA_VERSION: u32 = CALIBRATION_SCHEMA_VERSION;
}

impl Calibration {
    /// Run `prompts` through `model` and average every head's output and query; `made`
    /// is the file's provenance (its numerics: `model`'s).
    ///
    /// Errors when the prompts hold no position past the first.
    pub fn compute(
        model: &Model,
        id: &ModelId,
        prompts: &[Vec<u32>],
        source: &str,
        made: &Made,
    ) -> Result<Self> {
        let cfg = model.config();
        let per_layer = cfg.n_heads * cfg.d_head;
        let mut obs = MeanObserver {
            skip_first: true,
            start: 0,
            outputs: vec![0.0; cfg.n_layers * per_layer],
            queries: vec![0.0; cfg.n_layers * per_layer],
            positions: 0,
            per_layer,
        };
        for p in prompts {
            Session::new(model, p.len()).prefill(p, &mut obs, &Interventions::new())?;
        }
        if obs.positions == 0 {
            return Err(Error::invalid(
                "calibration",
                "the calibration prompts hold no position past the first",
            ));
        }
        let n = obs.positions as f64;
        let mean = |v: Vec<f64>| v.into_iter().map(|s| (s / n) as f32).collect();
        Ok(Self {
            schema_version: CALIBRATION_SCHEMA_VERSION,
            model: id.name.clone(),
            model_sha256: id.sha256.clone(),
            source: source.to_string(),
            n_prompts: prompts.len(),
            n_positions: obs.positions,
            n_layers: cfg.n_layers,
            n_heads: cfg.n_heads,
            d_head: cfg.d_head,
            output_means: mean(obs.outputs),
            query_means: mean(obs.queries),
            made: made.clone(),
        })
    }

    fn slot(&self, v: &[f32], layer: usize, head: usize) -> Result<Vec<f32>> {
        Error::check_head(layer, head, self.n_layers, self.n_heads)?;
        let at = (layer * self.n_heads + head) * self.d_head;
        Ok(v[at..at + self.d_head].to_vec())
    }

    /// Mean output of (layer, head): `d_head` values.
    pub fn output(&self, layer: usize, head: usize) -> Result<Vec<f32>> {
        self.slot(&self.output_means, layer, head)
    }

    /// Mean pre-RoPE query of (layer, head): `d_head` values.
    pub fn query(&self, layer: usize, head: usize) -> Result<Vec<f32>> {
        self.slot(&self.query_means, layer, head)
    }

    /// Read a calibration file, checking its schema and that it belongs to `model`.
    pub fn load(path: &Path, model: &ModelId) -> Result<Self> {
        let c: Calibration = read_versioned(path)?;
        if c.model_sha256 != model.sha256 {
            return Err(Error::invalid(
                "calibration",
                format!(
                    "{} was computed on {} ({}), not {} ({})",
                    path.display(),
                    c.model,
                    c.model_sha256,
                    model.name,
                    model.sha256
                ),
            ));
        }
        Ok(c)
    }

    /// Write atomically as JSON.
    pub fn write(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_string(self)
            .map_err(|e| Error::invalid("calibration", e.to_string()))?;
        write_atomic(path, json.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_sets_are_fixed_by_seed_distinct_and_nested() {
        let a = HeadSet::random(30, 9, 50, 1).unwrap();
        assert_eq!(a, HeadSet::random(30, 9, 50, 1).unwrap());
        let distinct: std::collections::BTreeSet<_> = a.0.iter().collect();
        assert_eq!(distinct.len(), 50);
        assert!(a.0.iter().all(|&(l, h)| l < 30 && h < 9));
        let small = HeadSet::random(30, 9, 10, 1).unwrap();
        assert_eq!(small.0[..], a.0[..10]);
        assert_ne!(a, HeadSet::random(30, 9, 50, 2).unwrap());
        assert_eq!(HeadSet::random(2, 2, 4, 0).unwrap().0.len(), 4);
        let err = HeadSet::random(2, 2, 5, 0).unwrap_err().to_string();
        assert!(err.contains("more than the model's 4 heads"), "{err}");
    }

    #[test]
    fn mean_modes_need_a_calibration_and_others_do_not() {
        let set = HeadSet(vec![(0, 1)]);
        for mode in [AblationMode::MeanOutput, AblationMode::MeanQuery] {
            let err = set.interventions(mode, None).unwrap_err().to_string();
            assert!(err.contains("needs a calibration set"), "{err}");
        }
        for mode in [AblationMode::ZeroOutput, AblationMode::UniformAttention] {
            assert!(!set.interventions(mode, None).unwrap().is_empty());
        }
        // k = 0 is no edit at all, whatever the mode
        let none = HeadSet(vec![]);
        assert!(none
            .interventions(AblationMode::MeanOutput, None)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn mode_names_round_trip_through_serde() {
        for mode in [
            AblationMode::ZeroOutput,
            AblationMode::MeanOutput,
            AblationMode::MeanQuery,
            AblationMode::UniformAttention,
        ] {
            let json = serde_json::to_string(&mode).unwrap();
            assert_eq!(json, format!("\"{}\"", mode.name()));
            assert_eq!(serde_json::from_str::<AblationMode>(&json).unwrap(), mode);
        }
    }
}
