//! Probes that predict, from the model's final hidden state at a decode step, which
//! attention heads retrieve at that step ("Retrieval Heads are Dynamic", 2026: the MLP
//! probe, section on the probe).
//!
//! This is the runtime side: [`Probe::load`] (`<name>.safetensors` + `<name>.json`, the
//! card in `card`) and [`Probe::predict`], [`Probe::predict_into`],
//! [`Probe::predict_batch`]: per-head probabilities (binary labels) or values (continuous
//! labels). Training a probe from a recorded trace is [`crate::lab::probe_train`].

mod card;
mod file;
pub(crate) mod mlp;

use ndarray::{Array2, ArrayView2};

pub use card::{
    BaselineConfig, BaselineSummary, BinaryHeadMetrics, BinaryLoss, BinaryMetrics,
    ContinuousHeadMetrics, ContinuousMetrics, EpochLog, Evaluation, LabelKind, Metrics,
    ProbeConfig, StaticHeads, PER_HEAD_TOP,
};
pub use file::{
    Architecture, ModelIdentity, ProbeCard, SplitSummary, TrainingRecord, WeightsFile, INPUT_LAYER,
    PROBE_SCHEMA_VERSION,
};
pub use mlp::{Activation, Workspace};

use crate::{Error, Result};

/// A trained probe: the network (with its input standardisation) and its card.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    mlp: mlp::Mlp,
    card: ProbeCard,
}

impl Probe {
    /// A probe from a trained network and its card (the training in
    /// [`crate::lab::probe_train`] makes them).
    pub(crate) fn from_parts(mlp: mlp::Mlp, card: ProbeCard) -> Self {
        Probe { mlp, card }
    }

    /// The card: architecture, threshold, data, model, training record, metrics.
    pub fn card(&self) -> &ProbeCard {
        &self.card
    }

    /// The binary decision threshold (`None` for continuous labels).
    pub fn threshold(&self) -> Option<f32> {
        self.card.threshold
    }

    /// Width of the hidden state the probe reads (`d_model`).
    pub fn input_dim(&self) -> usize {
        self.mlp.input_dim()
    }

    /// Number of outputs: `n_layers * n_heads`, head `(l, h)` at `l * n_heads + h`.
    pub fn output_dim(&self) -> usize {
        self.mlp.output_dim()
    }

    /// Check that the probe fits a model with hidden width `d_model` and `n_heads_total`
    /// query heads (all layers), and, when given, that it was trained on the model file
    /// with SHA-256 `model_sha256`.
    pub fn check_model(
        &self,
        d_model: usize,
        n_heads_total: usize,
        model_sha256: Option<&str>,
    ) -> Result<()> {
        let trained_on = &self.card.model;
        if self.input_dim() != d_model {
            return Err(Error::invalid(
                "probe",
                format!(
                    "the probe reads hidden states of width {} (trained on {}), the model's \
                     d_model is {d_model}",
                    self.input_dim(),
                    trained_on.name
                ),
            ));
        }
        if self.output_dim() != n_heads_total {
            return Err(Error::invalid(
                "probe",
                format!(
                    "the probe predicts {} heads (trained on {}), the model has {n_heads_total}",
                    self.output_dim(),
                    trained_on.name
                ),
            ));
        }
        if let Some(sha) = model_sha256 {
            if !sha.eq_ignore_ascii_case(&trained_on.sha256) {
                return Err(Error::invalid(
                    "probe",
                    format!(
                        "the probe was trained on {} (sha256 {}), not on this model (sha256 {sha})",
                        trained_on.name, trained_on.sha256
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Scratch buffers for [`Probe::predict_into`], sized for this probe.
    pub fn workspace(&self) -> Workspace {
        Workspace::with_capacity(
            self.mlp
                .layers
                .iter()
                .map(|l| l.inputs.max(l.outputs))
                .max()
                .unwrap_or(0),
        )
    }

    /// Per-head outputs `(output_dim,)` for one hidden state `(input_dim,)`:
    /// probabilities (binary labels) or values (continuous labels).
    pub fn predict(&self, hidden: &[f32]) -> Result<Vec<f32>> {
        let mut out = vec![0.0; self.output_dim()];
        self.predict_into(hidden, &mut self.workspace(), &mut out)?;
        Ok(out)
    }

    /// [`Probe::predict`] into `out` `(output_dim,)`, with scratch space `ws` reused
    /// across calls: no allocation once `ws` has been used.
    pub fn predict_into(&self, hidden: &[f32], ws: &mut Workspace, out: &mut [f32]) -> Result<()> {
        self.mlp.forward_into(hidden, ws, out)
    }

    /// Outputs `(rows, output_dim)` for hidden states `(rows, input_dim)`.
    pub fn predict_batch(&self, hidden: ArrayView2<f32>) -> Result<Array2<f32>> {
        self.mlp.forward_batch(hidden)
    }
}
