//! What a probe's card records besides its weights: the label kind, the training
//! hyper-parameters and epoch log, the baselines' settings and choices, and the test-split
//! metrics. These are the types the runtime reads back with a probe; the training that
//! fills them is [`crate::lab::probe_train`].

use serde::{Deserialize, Serialize};

use super::mlp::Activation;
use crate::{Error, Result};

/// What a label means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LabelKind {
    /// 1 when the head retrieved at this step (NIAH: its most-attended position is in
    /// the needle and holds the generated token), else 0.
    Binary,
    /// A score in `[0, 1]` (HotpotQA: attention mass on supporting facts over the mass
    /// on the effective context).
    Continuous,
}

/// The loss for binary labels.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BinaryLoss {
    /// Asymmetric loss (Ridnik et al. 2021): negatives down-weighted by `p_m^gamma_neg`
    /// with `p_m = max(p - clip, 0)`, positives by `(1 - p)^gamma_pos`. The paper's
    /// recommended setting is the default: `gamma_neg` 4, `gamma_pos` 0, `clip` 0.05.
    Asymmetric {
        gamma_neg: f64,
        gamma_pos: f64,
        clip: f64,
    },
    /// Binary cross-entropy with each head's positives weighted by its train ratio of
    /// negatives to positives, capped at `max_pos_weight`.
    WeightedBce { max_pos_weight: f64 },
}

/// Hyper-parameters of the probe network and its training. Every field has a default
/// ([`ProbeConfig::default`]; see the field docs), so a partial TOML/JSON table
/// deserialises.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProbeConfig {
    /// Widths of the hidden layers. Default `[256, 256]`.
    pub hidden: Vec<usize>,
    /// Default GELU (tanh approximation).
    pub activation: Activation,
    /// Dropout after every hidden activation, in `[0, 1)`. Default 0.1.
    pub dropout: f32,
    /// AdamW learning rate. Default 1e-3.
    pub lr: f64,
    /// AdamW decoupled weight decay. Default 0.01 (candle's and PyTorch's AdamW).
    pub weight_decay: f64,
    /// Steps per mini-batch. Default 128.
    pub batch_size: usize,
    /// Default 100.
    pub max_epochs: usize,
    /// Stop after this many epochs without a better validation loss. Default 10.
    pub early_stopping_patience: usize,
    /// Multiply the learning rate by `plateau_factor` after more than this many epochs
    /// without a better validation loss. Default 3.
    pub plateau_patience: usize,
    /// In `(0, 1)`. Default 0.5.
    pub plateau_factor: f64,
    /// The plateau schedule's floor. Default 1e-6.
    pub min_lr: f64,
    /// Largest global L2 norm of the gradients; larger ones are scaled down. Default 1.0.
    pub grad_clip: f64,
    /// Default asymmetric loss (4, 0, 0.05). Continuous labels always use MSE.
    pub binary_loss: BinaryLoss,
    /// Seeds initialisation, batch order and dropout. Default 0.
    pub seed: u64,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            hidden: vec![256, 256],
            activation: Activation::Gelu,
            dropout: 0.1,
            lr: 1e-3,
            weight_decay: 0.01,
            batch_size: 128,
            max_epochs: 100,
            early_stopping_patience: 10,
            plateau_patience: 3,
            plateau_factor: 0.5,
            min_lr: 1e-6,
            grad_clip: 1.0,
            binary_loss: BinaryLoss::Asymmetric {
                gamma_neg: 4.0,
                gamma_pos: 0.0,
                clip: 0.05,
            },
            seed: 0,
        }
    }
}

impl ProbeConfig {
    /// Check every value's range once, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, reason: String| Err(Error::invalid(name, reason));
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if self.hidden.contains(&0) {
            return bad(
                "hidden",
                format!("{:?}: widths must be at least 1", self.hidden),
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad("dropout", format!("{} is not in [0, 1)", self.dropout));
        }
        if !positive(self.lr) {
            return bad("lr", format!("{} is not a positive number", self.lr));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(
                "weight_decay",
                format!("{} is negative or not finite", self.weight_decay),
            );
        }
        if self.batch_size == 0 || self.max_epochs == 0 || self.early_stopping_patience == 0 {
            return bad(
                "batch_size / max_epochs / early_stopping_patience",
                "must be at least 1".into(),
            );
        }
        if !(self.plateau_factor > 0.0 && self.plateau_factor < 1.0) {
            return bad(
                "plateau_factor",
                format!("{} is not in (0, 1)", self.plateau_factor),
            );
        }
        if !positive(self.min_lr) {
            return bad(
                "min_lr",
                format!("{} is not a positive number", self.min_lr),
            );
        }
        if !positive(self.grad_clip) {
            return bad(
                "grad_clip",
                format!("{} is not a positive number", self.grad_clip),
            );
        }
        match self.binary_loss {
            BinaryLoss::Asymmetric {
                gamma_neg,
                gamma_pos,
                clip,
            } => {
                if !(gamma_neg.is_finite()
                    && gamma_neg >= 0.0
                    && gamma_pos.is_finite()
                    && gamma_pos >= 0.0)
                {
                    return bad(
                        "binary_loss",
                        format!("gammas ({gamma_neg}, {gamma_pos}) must be finite and >= 0"),
                    );
                }
                if !(0.0..1.0).contains(&clip) {
                    return bad("binary_loss.clip", format!("{clip} is not in [0, 1)"));
                }
            }
            BinaryLoss::WeightedBce { max_pos_weight } => {
                if !(max_pos_weight.is_finite() && max_pos_weight >= 1.0) {
                    return bad(
                        "binary_loss.max_pos_weight",
                        format!("{max_pos_weight} is not a number >= 1"),
                    );
                }
            }
        }
        Ok(())
    }
}

/// One epoch of training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochLog {
    /// From 1.
    pub epoch: usize,
    /// Mean loss over the epoch's mini-batches (with dropout).
    pub train_loss: f64,
    /// Loss on the whole validation split after the epoch (no dropout).
    pub val_loss: f64,
    /// The learning rate the epoch ran with.
    pub lr: f64,
}

/// Which heads the static binary baseline predicts active on every step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StaticHeads {
    /// The `k` heads most often active in the train split (ties: lower layer, then
    /// lower head).
    TopK { k: usize },
    /// These `(layer, head)` pairs.
    List { heads: Vec<(usize, usize)> },
}

/// Hyper-parameters of the baselines; a missing field takes its default
/// ([`BaselineConfig::default`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BaselineConfig {
    /// Default: top 20, the size of the papers' static set.
    pub static_heads: StaticHeads,
    /// L2 penalty of the logistic regression (linfa's `alpha`). Default 1.0 (linfa's).
    pub logistic_alpha: f64,
    /// L-BFGS iterations per head. Default 100 (linfa's).
    pub logistic_max_iterations: u64,
    /// Ridge penalties to choose from by validation MSE. Default `1e-2 ..= 1e4`, one per
    /// decade.
    pub ridge_lambdas: Vec<f64>,
}

impl Default for BaselineConfig {
    fn default() -> Self {
        BaselineConfig {
            static_heads: StaticHeads::TopK { k: 20 },
            logistic_alpha: 1.0,
            logistic_max_iterations: 100,
            ridge_lambdas: vec![1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4],
        }
    }
}

impl BaselineConfig {
    /// Check the values against a model of `n_layers x n_heads` heads.
    pub fn validate(&self, n_layers: usize, n_heads: usize) -> Result<()> {
        let bad = |name: &str, reason: String| Err(Error::invalid(name, reason));
        match &self.static_heads {
            StaticHeads::TopK { k } if *k == 0 || *k > n_layers * n_heads => {
                return bad(
                    "static_heads.k",
                    format!("{k} is not in 1..={}", n_layers * n_heads),
                )
            }
            StaticHeads::List { heads } => {
                if heads.is_empty() {
                    return bad("static_heads.heads", "the list is empty".into());
                }
                if let Some(&(layer, head)) =
                    heads.iter().find(|(l, h)| *l >= n_layers || *h >= n_heads)
                {
                    return Err(Error::BadHead {
                        layer,
                        head,
                        n_layers,
                        n_heads,
                    });
                }
            }
            StaticHeads::TopK { .. } => {}
        }
        if !(self.logistic_alpha.is_finite() && self.logistic_alpha > 0.0) {
            return bad(
                "logistic_alpha",
                format!("{} is not a positive number", self.logistic_alpha),
            );
        }
        if self.logistic_max_iterations == 0 {
            return bad("logistic_max_iterations", "must be at least 1".into());
        }
        if self.ridge_lambdas.is_empty()
            || self
                .ridge_lambdas
                .iter()
                .any(|l| !(l.is_finite() && *l > 0.0))
        {
            return bad(
                "ridge_lambdas",
                format!(
                    "{:?} must be non-empty positive numbers",
                    self.ridge_lambdas
                ),
            );
        }
        Ok(())
    }
}

/// What the baselines chose, for the probe card.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaselineSummary {
    /// The static heads as `(layer, head)` (binary labels; empty for continuous).
    pub static_heads: Vec<(usize, usize)>,
    /// The ridge penalty chosen on the validation split (continuous labels).
    pub ridge_lambda: Option<f64>,
    /// Heads whose train labels are constant, so the linear baseline predicts the
    /// constant.
    pub linear_constant_heads: usize,
}

/// The number of heads in the per-head breakdown (the most frequent in train).
pub const PER_HEAD_TOP: usize = 20;

/// Binary metrics of one predictor on the test split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BinaryMetrics {
    /// A head is predicted active when its score is `>= threshold`.
    pub threshold: f32,
    pub micro_f1: f64,
    /// 95% interval of the micro F1 over test prompts (resampled whole); absent in cards
    /// made before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_f1_ci95: Option<[f64; 2]>,
    /// Mean F1 over the heads with at least one positive in the test split.
    pub macro_f1: f64,
    /// How many heads the macro F1 averages.
    pub macro_f1_heads: usize,
    /// Micro average precision over all (step, head) entries; `None` without positives.
    pub auprc: Option<f64>,
    pub precision: f64,
    pub recall: f64,
    /// Test steps.
    pub rows: usize,
    /// Positive (step, head) entries in the test split.
    pub positives: usize,
    /// The [`PER_HEAD_TOP`] heads most often active in train.
    pub per_head: Vec<BinaryHeadMetrics>,
}

/// One head's binary metrics on the test split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BinaryHeadMetrics {
    pub layer: usize,
    pub head: usize,
    /// Share of train steps on which the head is active.
    pub train_frequency: f64,
    /// Test steps on which the head is active.
    pub support: usize,
    /// `None` when the head is neither active nor predicted active on any test step.
    pub f1: Option<f64>,
    /// `None` when the head is never active in the test split.
    pub ap: Option<f64>,
}

/// Continuous metrics of one predictor on the test split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContinuousMetrics {
    /// Pooled over heads; `None` when no head's test labels vary.
    pub r2_micro: Option<f64>,
    /// 95% interval of the micro R^2 over test prompts (resampled whole); absent in cards
    /// made before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub r2_micro_ci95: Option<[f64; 2]>,
    /// Mean per-head R^2 over the heads whose test labels vary; `None` when none do.
    pub r2_mean_per_head: Option<f64>,
    /// How many heads the per-head mean averages.
    pub r2_heads: usize,
    /// Mean squared error over all (step, head) entries.
    pub mse: f64,
    /// Test steps.
    pub rows: usize,
    /// The [`PER_HEAD_TOP`] heads with the highest train mean.
    pub per_head: Vec<ContinuousHeadMetrics>,
}

/// One head's continuous metrics on the test split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContinuousHeadMetrics {
    pub layer: usize,
    pub head: usize,
    /// Mean label over the train steps.
    pub train_mean: f64,
    /// Mean label over the test steps.
    pub test_mean: f64,
    /// `None` when the head's test labels do not vary.
    pub r2: Option<f64>,
}

/// The metrics of one predictor, binary or continuous.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Metrics {
    Binary(BinaryMetrics),
    Continuous(ContinuousMetrics),
}

/// Test-split metrics of the probe and its two baselines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    pub probe: Metrics,
    /// Logistic regression (binary) or ridge regression (continuous) per head.
    pub linear: Metrics,
    /// The static top-k heads (binary) or each head's train mean (continuous).
    pub static_topk: Metrics,
}
