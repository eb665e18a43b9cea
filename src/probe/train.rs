//! `train`: from a recorded [`Trace`] to a tested probe. Validate the trace, split it by
//! prompt ([`split_by_prompt`]), standardise the hidden states with train statistics,
//! fit the MLP ([`ProbeConfig`]), choose the binary decision threshold on the validation
//! split (maximal micro F1), fit the baselines ([`BaselineConfig`]) and measure all three
//! on the test split ([`Evaluation`]).
//!
//! Setup after "Retrieval Heads are Dynamic" (2026, section on the MLP probe): input the
//! final hidden state, output one activity per query head, dropout 0.1, Adam(W),
//! reduce-LR-on-plateau, asymmetric loss for binary labels, gradient clipping 1.0, batch
//! 128, at most 100 epochs, split 70/20/10. The paper's hidden layers [8192, 4096, 4096]
//! serve Llama-8B (d_model 4096) and large traces; the default here is [256, 256] for
//! the 576-wide SmolLM2-135M and traces of a few thousand steps (about 0.3M weights,
//! a few hundred thousand multiply-adds per decode step). The learning rate is 1e-3
//! rather than the paper's 3e-4: the usual Adam rate for a network this small, with
//! the plateau schedule lowering it as needed.

use ndarray::{Array1, Array2, Axis};
use serde::{Deserialize, Serialize};

use super::baselines::{static_scores, BaselineConfig, BaselineSummary, LinearBaseline};
use super::file::{
    Architecture, ModelIdentity, ProbeCard, SplitSummary, TrainingRecord, INPUT_LAYER,
    PROBE_SCHEMA_VERSION,
};
use super::fit::{fit, FitData};
use super::metrics::{best_threshold, binary_metrics, continuous_metrics, Evaluation, Metrics};
use super::mlp::Activation;
use super::split::{split_by_prompt, SPLIT_FRACTIONS};
use super::Probe;
use crate::heads::trace::{LabelKind, Trace};
use crate::provenance::Made;
use crate::{Error, Result};

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

/// Everything `train` needs besides the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOptions {
    pub probe: ProbeConfig,
    pub baselines: BaselineConfig,
    /// Seeds the prompt split (separate from `probe.seed`, so training can be re-seeded
    /// on a fixed split).
    pub split_seed: u64,
    /// The model the trace was recorded from.
    pub model_name: String,
    pub model_sha256: String,
    /// Free-form description of the data, copied into the card (task, trace file,
    /// counts...).
    pub data: serde_json::Value,
    /// The card's provenance (its numerics: the trace's).
    pub made: Made,
}

impl TrainOptions {
    /// Default probe and baseline settings and split seed 0.
    pub fn new(
        model_name: impl Into<String>,
        model_sha256: impl Into<String>,
        data: serde_json::Value,
        made: Made,
    ) -> Self {
        TrainOptions {
            probe: ProbeConfig::default(),
            baselines: BaselineConfig::default(),
            split_seed: 0,
            model_name: model_name.into(),
            model_sha256: model_sha256.into(),
            data,
            made,
        }
    }
}

/// Check a trace's shapes and values: as many feature rows, label rows, prompt and step
/// entries; `n_layers * n_heads` label columns; finite features and labels; binary
/// labels 0 or 1. Errors name the first offending row.
pub fn validate_trace(trace: &Trace) -> Result<()> {
    let bad = |reason: String| Err(Error::invalid("trace", reason));
    let rows = trace.features.nrows();
    if trace.labels.nrows() != rows || trace.prompt.len() != rows || trace.step.len() != rows {
        return bad(format!(
            "{rows} feature rows but {} label rows, {} prompt ids and {} step indices",
            trace.labels.nrows(),
            trace.prompt.len(),
            trace.step.len()
        ));
    }
    let heads = trace.n_layers * trace.n_heads;
    if heads == 0 || trace.labels.ncols() != heads {
        return bad(format!(
            "labels have {} columns, expected n_layers * n_heads = {} * {} = {heads}",
            trace.labels.ncols(),
            trace.n_layers,
            trace.n_heads
        ));
    }
    if trace.features.ncols() == 0 {
        return bad("the features have width 0".into());
    }
    if let Some(((r, c), v)) = trace.features.indexed_iter().find(|(_, v)| !v.is_finite()) {
        return bad(format!(
            "feature row {r} (prompt {}, step {}) column {c} is {v}",
            trace.prompt[r], trace.step[r]
        ));
    }
    for ((r, c), &v) in trace.labels.indexed_iter() {
        let ok = match trace.label_kind {
            LabelKind::Binary => v == 0.0 || v == 1.0,
            LabelKind::Continuous => v.is_finite(),
        };
        if !ok {
            return bad(format!(
                "label row {r} (prompt {}, step {}) column {c} is {v}{}",
                trace.prompt[r],
                trace.step[r],
                if trace.label_kind == LabelKind::Binary {
                    " (binary labels must be 0 or 1)"
                } else {
                    ""
                }
            ));
        }
    }
    Ok(())
}

/// Per-feature mean and standard deviation of `x` `(rows, dim)`; a deviation below 1e-6
/// becomes 1 (a constant feature is only centred).
fn standardisation(x: &Array2<f32>) -> (Vec<f32>, Vec<f32>) {
    let x = x.mapv(f64::from);
    let mean = x
        .mean_axis(Axis(0))
        .unwrap_or_else(|| Array1::zeros(x.ncols()));
    let std = x.std_axis(Axis(0), 0.0);
    (
        mean.iter().map(|&m| m as f32).collect(),
        std.iter()
            .map(|&s| if s < 1e-6 { 1.0 } else { s as f32 })
            .collect(),
    )
}

fn standardise(x: &Array2<f32>, mean: &[f32], std: &[f32]) -> Array2<f32> {
    let mut out = x.clone();
    for (mut col, (m, s)) in out.axis_iter_mut(Axis(1)).zip(mean.iter().zip(std)) {
        col.mapv_inplace(|v| (v - m) / s);
    }
    out
}

/// Train a probe on `trace`, fit the baselines and measure all three on the held-out
/// test prompts. `on_epoch` sees each epoch as it ends (for progress output). The card
/// of the returned probe holds the split, the training record and the metrics; save it
/// with [`Probe::save`].
pub fn train(
    trace: &Trace,
    opts: &TrainOptions,
    on_epoch: &mut dyn FnMut(&EpochLog),
) -> Result<Probe> {
    validate_trace(trace)?;
    opts.probe.validate()?;
    opts.baselines.validate(trace.n_layers, trace.n_heads)?;
    let split = split_by_prompt(&trace.prompt, opts.split_seed)?;
    let rows = |idx: &[usize]| {
        (
            trace.features.select(Axis(0), idx),
            trace.labels.select(Axis(0), idx),
        )
    };
    let (x_train, y_train) = rows(&split.train);
    let (x_val, y_val) = rows(&split.val);
    let (x_test, y_test) = rows(&split.test);
    let (mean, std) = standardisation(&x_train);
    let (xs_train, xs_val, xs_test) = (
        standardise(&x_train, &mean, &std),
        standardise(&x_val, &mean, &std),
        standardise(&x_test, &mean, &std),
    );
    let kind = trace.label_kind;
    let n_heads = trace.n_heads;
    let fitted = fit(
        &FitData {
            x_train: &xs_train,
            y_train: &y_train,
            x_val: &xs_val,
            y_val: &y_val,
        },
        kind,
        &opts.probe,
        on_epoch,
    )?;
    let mut mlp = fitted.mlp;
    (mlp.mean, mlp.std) = (mean, std);
    let train_mean: Vec<f64> = y_train
        .mapv(f64::from)
        .mean_axis(Axis(0))
        .map(|m| m.to_vec())
        .unwrap_or_default();

    let linear = LinearBaseline::fit(
        kind,
        &opts.baselines,
        &xs_train,
        &y_train,
        &xs_val,
        &y_val,
        n_heads,
    )?;
    let (static_test, static_heads) =
        static_scores(kind, &opts.baselines, &train_mean, y_test.nrows(), n_heads);
    let probe_test = mlp.forward_batch(x_test.view())?;
    let linear_test = linear.predict(&xs_test);
    let (threshold, metrics) = match kind {
        LabelKind::Binary => {
            let probe_threshold =
                best_threshold(mlp.forward_batch(x_val.view())?.view(), y_val.view());
            let linear_threshold = best_threshold(linear.predict(&xs_val).view(), y_val.view());
            let m = |scores: &Array2<f32>, t: f32| {
                Metrics::Binary(binary_metrics(
                    scores.view(),
                    y_test.view(),
                    t,
                    &train_mean,
                    n_heads,
                ))
            };
            (
                Some(probe_threshold),
                Evaluation {
                    probe: m(&probe_test, probe_threshold),
                    linear: m(&linear_test, linear_threshold),
                    static_topk: m(&static_test, 0.5),
                },
            )
        }
        LabelKind::Continuous => {
            let m = |pred: &Array2<f32>| {
                Metrics::Continuous(continuous_metrics(
                    pred.view(),
                    y_test.view(),
                    &train_mean,
                    n_heads,
                ))
            };
            (
                None,
                Evaluation {
                    probe: m(&probe_test),
                    linear: m(&linear_test),
                    static_topk: m(&static_test),
                },
            )
        }
    };
    let card = ProbeCard {
        schema_version: PROBE_SCHEMA_VERSION,
        architecture: Architecture {
            input_dim: mlp.input_dim(),
            hidden: opts.probe.hidden.clone(),
            output_dim: mlp.output_dim(),
            activation: opts.probe.activation,
            dropout: opts.probe.dropout,
        },
        input_layer: INPUT_LAYER.to_string(),
        label_kind: kind,
        n_layers: trace.n_layers,
        n_heads,
        threshold,
        data: opts.data.clone(),
        model: ModelIdentity {
            name: opts.model_name.clone(),
            sha256: opts.model_sha256.clone(),
        },
        split: SplitSummary {
            seed: split.seed,
            fractions: SPLIT_FRACTIONS,
            train_steps: split.train.len(),
            val_steps: split.val.len(),
            test_steps: split.test.len(),
            train_prompts: split.train_prompts,
            val_prompts: split.val_prompts,
            test_prompts: split.test_prompts,
        },
        training: TrainingRecord {
            config: opts.probe.clone(),
            epochs_run: fitted.history.len(),
            best_epoch: fitted.best_epoch,
            best_val_loss: fitted.best_val_loss,
            history: fitted.history,
        },
        baselines: opts.baselines.clone(),
        baseline_fit: BaselineSummary {
            static_heads,
            ridge_lambda: linear.ridge_lambda,
            linear_constant_heads: linear.constant_heads(),
        },
        weights: None,
        metrics,
        made: opts.made.clone(),
    };
    Ok(Probe { mlp, card })
}
