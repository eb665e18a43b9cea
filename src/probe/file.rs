//! Probe files: `<name>.safetensors` (weights and input standardisation, written with
//! candle's safetensors support) and `<name>.json` (the card: architecture, label kind,
//! threshold, data, model identity, split, training record, baselines, test metrics
//! and provenance), both written atomically. The card records the weights file's SHA-256, so
//! a card never silently pairs with another run's weights.
//!
//! Tensors: `norm.mean`, `norm.std` `(input_dim,)`; `layers.{i}.weight`
//! `(outputs, inputs)` and `layers.{i}.bias` `(outputs,)` for the hidden layers then
//! the output layer, all `f32`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::Digest;

use super::card::{BaselineConfig, BaselineSummary, EpochLog, Evaluation, LabelKind, ProbeConfig};
use super::mlp::{Activation, Dense, Mlp};
use super::Probe;
use crate::artifact::{read_versioned, Versioned};
use crate::provenance::Made;
use crate::results::write_atomic;
use crate::{Error, Result};

/// Version of the card layout and tensor names; [`Probe::load`] refuses others.
pub const PROBE_SCHEMA_VERSION: u32 = 1;
/// The hidden state probes read: the final hidden state (after the final norm) of the
/// forward pass that produced the step's token.
pub const INPUT_LAYER: &str = "final_hidden";

/// The network's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Architecture {
    /// `d_model` of the model the probe reads.
    pub input_dim: usize,
    pub hidden: Vec<usize>,
    /// `n_layers * n_heads`.
    pub output_dim: usize,
    pub activation: Activation,
    /// Dropout used in training (inference applies none).
    pub dropout: f32,
}

/// The model a probe was trained on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelIdentity {
    pub name: String,
    pub sha256: String,
}

/// The prompt split the probe was trained and tested on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SplitSummary {
    pub seed: u64,
    /// Train, validation, test shares of the prompts.
    pub fractions: [f64; 3],
    pub train_steps: usize,
    pub val_steps: usize,
    pub test_steps: usize,
    pub train_prompts: Vec<usize>,
    pub val_prompts: Vec<usize>,
    pub test_prompts: Vec<usize>,
}

/// How the probe was trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingRecord {
    pub config: ProbeConfig,
    pub epochs_run: usize,
    /// The epoch whose weights were kept (lowest validation loss).
    pub best_epoch: usize,
    pub best_val_loss: f64,
    pub history: Vec<EpochLog>,
}

/// The weights file next to the card.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsFile {
    /// File name, in the card's folder.
    pub file: String,
    pub sha256: String,
}

impl Versioned for ProbeCard {
    const KIND: &'static str = "probe card";
    const SCHEMA_VERSION: u32 = PROBE_SCHEMA_VERSION;
}

/// The JSON card of a probe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeCard {
    pub schema_version: u32,
    pub architecture: Architecture,
    /// Always [`INPUT_LAYER`].
    pub input_layer: String,
    pub label_kind: LabelKind,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Binary labels: a head is predicted active when its probability is `>=` this
    /// (chosen on the validation split for maximal micro F1). `None` for continuous.
    pub threshold: Option<f32>,
    /// The caller's description of the data (task, trace file, counts...).
    pub data: serde_json::Value,
    pub model: ModelIdentity,
    pub split: SplitSummary,
    pub training: TrainingRecord,
    pub baselines: BaselineConfig,
    pub baseline_fit: BaselineSummary,
    /// Set when the probe is saved; `None` for a probe only held in memory.
    pub weights: Option<WeightsFile>,
    /// Test-split metrics of the probe and the baselines.
    pub metrics: Evaluation,
    /// Numerics (of the trace it learned from), build, command line and date.
    #[serde(flatten)]
    pub made: Made,
}

fn card_error(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::invalid("probe card", format!("{}: {reason}", path.display()))
}

fn weights_error(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::invalid("probe weights", format!("{}: {reason}", path.display()))
}

fn hex_sha256(bytes: &[u8]) -> String {
    format!("{:x}", sha2::Sha256::digest(bytes))
}

impl Probe {
    /// Write `<dir>/<name>.safetensors` and `<dir>/<name>.json`, each atomically (the
    /// weights first, so a card never names weights that are not there). Returns the
    /// card's path.
    pub fn save(&self, dir: &Path, name: &str) -> Result<PathBuf> {
        if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
            return Err(Error::invalid(
                "probe name",
                format!("`{name}` must be a plain file name"),
            ));
        }
        let mut tensors = HashMap::new();
        let dev = Device::Cpu;
        tensors.insert(
            "norm.mean".to_string(),
            Tensor::new(self.mlp.mean.as_slice(), &dev)?,
        );
        tensors.insert(
            "norm.std".to_string(),
            Tensor::new(self.mlp.std.as_slice(), &dev)?,
        );
        for (i, layer) in self.mlp.layers.iter().enumerate() {
            tensors.insert(
                format!("layers.{i}.weight"),
                Tensor::from_slice(&layer.weight, (layer.outputs, layer.inputs), &dev)?,
            );
            tensors.insert(
                format!("layers.{i}.bias"),
                Tensor::new(layer.bias.as_slice(), &dev)?,
            );
        }
        // candle writes safetensors to a path: write next to the target, then move the
        // bytes into place through `write_atomic`.
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let file = format!("{name}.safetensors");
        let staging = dir.join(format!(".{file}.{}.staging", std::process::id()));
        let staged = candle_core::safetensors::save(&tensors, &staging)
            .map_err(Error::from)
            .and_then(|()| std::fs::read(&staging).map_err(|e| Error::io(&staging, e)));
        let _ = std::fs::remove_file(&staging);
        let bytes = staged?;
        write_atomic(&dir.join(&file), &bytes)?;
        let mut card = self.card.clone();
        card.weights = Some(WeightsFile {
            sha256: hex_sha256(&bytes),
            file,
        });
        let json = serde_json::to_string_pretty(&card)
            .map_err(|e| Error::invalid("probe card", e.to_string()))?;
        let path = dir.join(format!("{name}.json"));
        write_atomic(&path, json.as_bytes())?;
        Ok(path)
    }

    /// [`Probe::load`] of `<dir>/<name>.json`.
    pub fn load_named(dir: &Path, name: &str) -> Result<Probe> {
        Probe::load(&dir.join(format!("{name}.json")))
    }

    /// Read a probe from its card (`<name>.json`) and the weights file the card names.
    /// Errors on another schema version, a weights file whose SHA-256 differs from the
    /// card's, or tensors whose shapes disagree with the card's architecture.
    pub fn load(card_path: &Path) -> Result<Probe> {
        let card: ProbeCard = read_versioned(card_path)?;
        let weights = card
            .weights
            .as_ref()
            .ok_or_else(|| card_error(card_path, "names no weights file"))?;
        if weights.file.contains(['/', '\\']) || weights.file.starts_with('.') {
            return Err(card_error(
                card_path,
                format!("weights file `{}` is not a plain file name", weights.file),
            ));
        }
        let weights_path = card_path
            .parent()
            .unwrap_or(Path::new("."))
            .join(&weights.file);
        let bytes = std::fs::read(&weights_path).map_err(|e| Error::io(&weights_path, e))?;
        let sha = hex_sha256(&bytes);
        if sha != weights.sha256 {
            return Err(card_error(
                card_path,
                format!(
                    "{} has SHA-256 {sha}, the card expects {}",
                    weights_path.display(),
                    weights.sha256
                ),
            ));
        }
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
            .map_err(|e| weights_error(&weights_path, e))?;
        let mlp = mlp_from_tensors(&card, &tensors, &weights_path)?;
        Ok(Probe { mlp, card })
    }
}

/// The network described by `card.architecture`, from the tensors of its weights file
/// `path`; errors name the missing or misshapen tensor.
fn mlp_from_tensors(
    card: &ProbeCard,
    tensors: &HashMap<String, Tensor>,
    path: &Path,
) -> Result<Mlp> {
    let arch = &card.architecture;
    let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        let t = tensors
            .get(name)
            .ok_or_else(|| weights_error(path, format!("tensor `{name}` is missing")))?;
        if t.dims() != shape {
            return Err(weights_error(
                path,
                format!(
                    "tensor `{name}` has shape {:?}, the card's architecture implies {shape:?}",
                    t.dims()
                ),
            ));
        }
        let v = t
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if v.iter().any(|x| !x.is_finite()) {
            return Err(weights_error(
                path,
                format!("tensor `{name}` is not finite"),
            ));
        }
        Ok(v)
    };
    let dims: Vec<usize> = std::iter::once(arch.input_dim)
        .chain(arch.hidden.iter().copied())
        .chain(std::iter::once(arch.output_dim))
        .collect();
    if dims.contains(&0) || arch.output_dim != card.n_layers * card.n_heads {
        return Err(Error::invalid(
            "probe card",
            format!(
                "architecture {dims:?} does not fit {} layers x {} heads",
                card.n_layers, card.n_heads
            ),
        ));
    }
    let std = get("norm.std", &[arch.input_dim])?;
    if std.iter().any(|&s| s <= 0.0) {
        return Err(Error::invalid(
            "probe weights",
            "`norm.std` has a value <= 0",
        ));
    }
    let layers = dims
        .windows(2)
        .enumerate()
        .map(|(i, pair)| {
            Ok(Dense {
                weight: get(&format!("layers.{i}.weight"), &[pair[1], pair[0]])?,
                bias: get(&format!("layers.{i}.bias"), &[pair[1]])?,
                inputs: pair[0],
                outputs: pair[1],
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Mlp {
        mean: get("norm.mean", &[arch.input_dim])?,
        std,
        layers,
        activation: arch.activation,
        sigmoid: card.label_kind == LabelKind::Binary,
    })
}
