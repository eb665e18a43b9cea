//! Per-step (dynamic) retrieval-head traces: for every generation step, one label per
//! query head and the hidden state of the same step, the data the dynamism statistics
//! and the probes are computed from.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor, D};
use ndarray::Array2;
use serde::{Deserialize, Serialize};

use crate::artifact::{read_versioned, Versioned};
use crate::lab::eval::Example;
use crate::model::{
    argmax, HeadCache, Interventions, LoadedModel, NoObserver, Observer, Session, Wants,
};
use crate::probe::LabelKind;
use crate::provenance::Made;
use crate::results::write_atomic;
use crate::{Error, Result};

/// Version of the trace file format (card and tensors).
pub const SCHEMA_VERSION: u32 = 1;

/// Steps of many prompts, in prompt order, then step order.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub label_kind: LabelKind,
    pub n_layers: usize,
    pub n_heads: usize,
    /// `(steps, d_model)`: the final hidden state (after the final norm) of the forward
    /// pass whose logits produced the step's token.
    pub features: Array2<f32>,
    /// `(steps, n_layers * n_heads)`, head `(l, h)` in column `l * n_heads + h`.
    pub labels: Array2<f32>,
    /// `(steps,)`: the prompt each step belongs to (`0..n_prompts`).
    pub prompt: Vec<usize>,
    /// `(steps,)`: the step's index within its prompt's generation.
    pub step: Vec<usize>,
}

/// Binary NIAH labels of one step: head `h` of this layer is active when its
/// most-attended position lies in a support span and holds `generated` (Wu's test, per
/// step). `probs`: `(n_heads, 1, kv_len)`, column `j` = position `j`; `sequence`: the
/// tokens at positions `0..kv_len`.
pub fn match_labels(
    probs: &Tensor,
    sequence: &[u32],
    support: &[Range<usize>],
    generated: u32,
) -> Result<Vec<f32>> {
    let argmax: Vec<u32> = probs.squeeze(1)?.argmax(D::Minus1)?.to_vec1()?;
    Ok(argmax
        .iter()
        .map(|&j| {
            let j = j as usize;
            let hit = support.iter().any(|s| s.contains(&j)) && sequence.get(j) == Some(&generated);
            f32::from(u8::from(hit))
        })
        .collect())
}

/// Where the effective context ends: the attention sink (the first `sink` positions) and
/// the `window` most recent positions are left out of the continuous score.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Effective {
    pub sink: usize,
    pub window: usize,
}

impl Default for Effective {
    /// 4 sink positions (BOS and the instruction's first tokens, which absorb attention
    /// in both models) and a 16-token local window (the answer's own tokens and the
    /// question's last words, which any head attends to for local syntax).
    fn default() -> Self {
        Self {
            sink: 4,
            window: 16,
        }
    }
}

/// Continuous HotpotQA labels of one step: per head, the attention mass on the support
/// spans over the mass on the effective context (positions `sink..kv_len - window`);
/// 0 when the effective context is empty or gets no mass. `probs`: `(n_heads, 1,
/// kv_len)`.
pub fn support_labels(
    probs: &Tensor,
    support: &[Range<usize>],
    effective: Effective,
) -> Result<Vec<f32>> {
    let rows: Vec<Vec<f32>> = probs.squeeze(1)?.to_vec2()?;
    Ok(rows
        .iter()
        .map(|row| {
            let end = row.len().saturating_sub(effective.window);
            if effective.sink >= end {
                return 0.0;
            }
            let ctx = &row[effective.sink..end];
            let total: f32 = ctx.iter().sum();
            let on: f32 = ctx
                .iter()
                .enumerate()
                .filter(|(i, _)| support.iter().any(|s| s.contains(&(i + effective.sink))))
                .map(|(_, p)| p)
                .sum();
            if total > 0.0 {
                on / total
            } else {
                0.0
            }
        })
        .collect())
}

/// Sees one decode step: every layer's attention and the final hidden state.
struct StepObserver {
    attention: Vec<Option<Tensor>>,
    hidden: Option<Tensor>,
}

impl Observer for StepObserver {
    fn wants(&self) -> Wants {
        Wants {
            attention: true,
            final_hidden: true,
            ..Wants::default()
        }
    }
    fn attention(&mut self, layer: usize, probs: &Tensor) {
        self.attention[layer] = Some(probs.clone());
    }
    fn final_hidden(&mut self, hidden: &Tensor) {
        self.hidden = Some(hidden.clone());
    }
}

/// The steps of one example: features `(steps, d_model)` and labels `(steps, n_layers *
/// n_heads)` as rows, with the generated tokens.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExampleSteps {
    pub features: Vec<Vec<f32>>,
    pub labels: Vec<Vec<f32>>,
    pub tokens: Vec<u32>,
}

/// How steps are labelled and how long generation runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TraceConfig {
    pub label_kind: LabelKind,
    /// Continuous labels only: what counts as effective context.
    pub effective: Effective,
    /// Tokens generated (or teacher-forced) at most per example.
    pub max_new: usize,
    /// Whether the gold answer was teacher-forced instead of generated.
    #[serde(default)]
    pub teacher: bool,
}

/// Generate greedily from `ex.prompt` under `edits_at(step)` (the edits of each observed
/// step; the prompt before its last token runs unedited),
/// labelling every step from its attention against `ex.support`; with `forced`, feed
/// those tokens instead (teacher forcing: each step is labelled against the forced
/// token, at most `max_new` of them).
///
/// The prompt's last token runs as the first observed step, so step `t`'s hidden state
/// is the one whose logits produced token `t`. Greedy generation stops after a stop
/// token or `max_new` tokens.
pub fn record(
    lm: &LoadedModel,
    ex: &Example,
    cfg: &TraceConfig,
    forced: Option<&[u32]>,
    edits_at: &mut dyn FnMut(usize) -> Interventions,
) -> Result<ExampleSteps> {
    let model = &lm.model;
    let prompt = &ex.prompt;
    if prompt.is_empty() {
        return Err(Error::invalid("prompt", format!("{}: empty", ex.id)));
    }
    let mut session = Session::new(model, prompt.len() + cfg.max_new);
    if prompt.len() > 1 {
        let head = &prompt[..prompt.len() - 1];
        session.prefill(head, &mut NoObserver, &Interventions::new())?;
    }
    record_steps(lm, ex, cfg, forced, edits_at, session.into_cache())
}

/// [`record`] from a cache that already holds every prompt position but the last
/// (a shared prefill).
pub fn record_steps(
    lm: &LoadedModel,
    ex: &Example,
    cfg: &TraceConfig,
    forced: Option<&[u32]>,
    edits_at: &mut dyn FnMut(usize) -> Interventions,
    cache: HeadCache,
) -> Result<ExampleSteps> {
    let model = &lm.model;
    let mc = model.config();
    let prompt = &ex.prompt;
    if prompt.is_empty() || cache.len() + 1 != prompt.len() {
        return Err(Error::invalid(
            "trace",
            format!(
                "{}: the cache holds {} positions, the prompt has {}",
                ex.id,
                cache.len(),
                prompt.len()
            ),
        ));
    }
    let mut session = Session::with_cache(model, cache);
    let mut out = ExampleSteps::default();
    let mut sequence = prompt.clone();
    let mut input = *prompt
        .last()
        .ok_or(Error::Internal("prompts are checked non-empty"))?;
    for step in 0..cfg.max_new {
        let edits = edits_at(step);
        let mut obs = StepObserver {
            attention: vec![None; mc.n_layers],
            hidden: None,
        };
        let logits = session.step(input, &mut obs, &edits)?;
        let y = match forced {
            Some(f) if step < f.len() => f[step],
            Some(_) => break,
            None => argmax(&logits)?,
        };
        let mut labels = Vec::with_capacity(mc.n_layers * mc.n_heads);
        for probs in &obs.attention {
            let probs = probs
                .as_ref()
                .ok_or_else(|| Error::invalid("trace", "a layer reported no attention"))?;
            labels.extend(match cfg.label_kind {
                LabelKind::Binary => match_labels(probs, &sequence, &ex.support, y)?,
                LabelKind::Continuous => support_labels(probs, &ex.support, cfg.effective)?,
            });
        }
        let hidden = obs
            .hidden
            .ok_or_else(|| Error::invalid("trace", "no final hidden state"))?;
        out.features.push(hidden.flatten_all()?.to_vec1()?);
        out.labels.push(labels);
        out.tokens.push(y);
        sequence.push(y);
        if forced.is_none() && lm.special.stop.contains(&y) {
            break;
        }
        input = y;
    }
    Ok(out)
}

impl Trace {
    /// An empty trace for a model of `n_layers x n_heads` heads and width `d_model`.
    pub fn empty(label_kind: LabelKind, n_layers: usize, n_heads: usize, d_model: usize) -> Self {
        Self {
            label_kind,
            n_layers,
            n_heads,
            features: Array2::zeros((0, d_model)),
            labels: Array2::zeros((0, n_layers * n_heads)),
            prompt: Vec::new(),
            step: Vec::new(),
        }
    }

    /// Steps recorded.
    pub fn len(&self) -> usize {
        self.prompt.len()
    }

    /// Whether no step is recorded.
    pub fn is_empty(&self) -> bool {
        self.prompt.is_empty()
    }

    /// Append one example's steps as prompt number `prompt`.
    pub fn push(&mut self, prompt: usize, steps: &ExampleSteps) -> Result<()> {
        let (d, h) = (self.features.ncols(), self.labels.ncols());
        for (t, (f, l)) in steps.features.iter().zip(&steps.labels).enumerate() {
            if f.len() != d || l.len() != h {
                return Err(Error::invalid(
                    "trace",
                    format!("step {t} of prompt {prompt}: {} features and {} labels, expected {d} and {h}", f.len(), l.len()),
                ));
            }
            self.features
                .push_row(ndarray::ArrayView1::from(f))
                .map_err(|e| Error::invalid("trace", e.to_string()))?;
            self.labels
                .push_row(ndarray::ArrayView1::from(l))
                .map_err(|e| Error::invalid("trace", e.to_string()))?;
            self.prompt.push(prompt);
            self.step.push(t);
        }
        Ok(())
    }

    /// Write `<stem>.safetensors` (features, labels, prompt, step) and `<stem>.json`
    /// (the card), each atomically.
    pub fn save(&self, stem: &Path, card: &TraceCard) -> Result<()> {
        let dev = &Device::Cpu;
        let n = self.len();
        let to_u32 = |v: &[usize]| v.iter().map(|&x| x as u32).collect::<Vec<u32>>();
        let tensors: HashMap<String, Tensor> = [
            (
                "features",
                Tensor::from_iter(self.features.iter().copied(), dev)?
                    .reshape(self.features.dim())?,
            ),
            (
                "labels",
                Tensor::from_iter(self.labels.iter().copied(), dev)?.reshape(self.labels.dim())?,
            ),
            ("prompt", Tensor::from_vec(to_u32(&self.prompt), n, dev)?),
            ("step", Tensor::from_vec(to_u32(&self.step), n, dev)?),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let data = with_ext(stem, "safetensors");
        let tmp = with_ext(stem, "safetensors.tmp");
        if let Some(dir) = data.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        candle_core::safetensors::save(&tensors, &tmp)?;
        std::fs::rename(&tmp, &data).map_err(|e| Error::io(&data, e))?;
        let json = serde_json::to_vec_pretty(card)
            .map_err(|e| Error::invalid("trace card", e.to_string()))?;
        write_atomic(&with_ext(stem, "json"), &json)
    }

    /// Read a trace saved by [`Trace::save`] (`path` is the `.json` card or the
    /// `.safetensors` file), checking the schema and the tensors' shapes against the card.
    pub fn load(path: &Path) -> Result<(Self, TraceCard)> {
        let stem = path.with_extension("");
        let card_path = with_ext(&stem, "json");
        let card: TraceCard = read_versioned(&card_path)?;
        let data = with_ext(&stem, "safetensors");
        if !data.exists() {
            return Err(Error::invalid(
                "trace",
                format!(
                    "{} is missing (the card is there; rerun `headwise heads trace`)",
                    data.display()
                ),
            ));
        }
        let mut t = candle_core::safetensors::load(&data, &Device::Cpu)?;
        let mut take = |name: &str| {
            t.remove(name).ok_or_else(|| {
                Error::invalid("trace", format!("{}: no `{name}` tensor", data.display()))
            })
        };
        let (features, labels, prompt, step) = (
            take("features")?,
            take("labels")?,
            take("prompt")?,
            take("step")?,
        );
        let (n, d) = features.dims2()?;
        let (n2, h) = labels.dims2()?;
        if n != n2 || n != card.steps || d != card.d_model || h != card.n_layers * card.n_heads {
            return Err(Error::invalid(
                "trace",
                format!(
                    "{}: shapes ({n}, {d}) and ({n2}, {h}) do not match the card",
                    data.display()
                ),
            ));
        }
        let arr = |t: Tensor, cols: usize| -> Result<Array2<f32>> {
            Array2::from_shape_vec((n, cols), t.flatten_all()?.to_vec1()?)
                .map_err(|e| Error::invalid("trace", e.to_string()))
        };
        let idx = |t: Tensor| -> Result<Vec<usize>> {
            Ok(t.to_vec1::<u32>()?
                .into_iter()
                .map(|x| x as usize)
                .collect())
        };
        let trace = Self {
            label_kind: card.label_kind,
            n_layers: card.n_layers,
            n_heads: card.n_heads,
            features: arr(features, d)?,
            labels: arr(labels, h)?,
            prompt: idx(prompt)?,
            step: idx(step)?,
        };
        Ok((trace, card))
    }
}

/// `stem` with `.ext` appended (the stem may itself contain dots).
fn with_ext(stem: &Path, ext: &str) -> PathBuf {
    let mut s = stem.as_os_str().to_owned();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

impl Versioned for TraceCard {
    const KIND: &'static str = "trace card";
    const SCHEMA_VERSION: u32 = SCHEMA_VERSION;
}

/// The JSON card of a trace file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceCard {
    pub schema_version: u32,
    pub model: String,
    pub model_sha256: String,
    /// The task and its generation settings (lengths, seeds, rows), as given.
    pub task: serde_json::Value,
    pub config: TraceConfig,
    pub label_kind: LabelKind,
    pub n_layers: usize,
    pub n_heads: usize,
    pub d_model: usize,
    pub prompts: usize,
    pub steps: usize,
    /// Binary: the share of (step, head) labels that are 1; continuous: the mean label.
    pub label_mean: f64,
    /// Steps with at least one active head (binary) or any label above 0.5
    /// (continuous).
    pub steps_with_active_head: usize,
    /// Example ids, in prompt order.
    pub examples: Vec<String>,
    /// Numerics, build, command line and date of the recording.
    #[serde(flatten)]
    pub made: Made,
}

impl TraceCard {
    /// Refuse a trace recorded on another model.
    pub fn check_model(&self, sha256: &str, name: &str) -> Result<()> {
        if self.model_sha256 != sha256 {
            return Err(Error::invalid(
                "trace",
                format!(
                    "recorded on {} ({}), not {name} ({sha256})",
                    self.model, self.model_sha256
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention rows `(n_heads, 1, kv_len)` from plain vectors.
    fn rows(r: &[&[f32]]) -> Tensor {
        let kv = r[0].len();
        let flat: Vec<f32> = r.iter().flat_map(|x| x.iter().copied()).collect();
        Tensor::from_vec(flat, (r.len(), 1, kv), &Device::Cpu).unwrap()
    }

    #[test]
    fn match_labels_need_the_argmax_in_the_support_on_the_generated_token() {
        // positions 0..6; support [2, 4) holds tokens 70, 71
        let seq = [1, 9, 70, 71, 9, 70];
        let probs = rows(&[
            &[0.1, 0.0, 0.8, 0.1, 0.0, 0.0], // argmax 2: in support, token 70 -> active
            &[0.1, 0.0, 0.1, 0.8, 0.0, 0.0], // argmax 3: in support, token 71 != 70
            &[0.1, 0.0, 0.1, 0.0, 0.0, 0.8], // argmax 5: token 70 but outside support
        ]);
        let l = match_labels(&probs, &seq, std::slice::from_ref(&(2..4)), 70).unwrap();
        assert_eq!(l, vec![1.0, 0.0, 0.0]);
    }

    #[test]
    fn support_labels_leave_out_sink_and_window() {
        // 10 positions, sink 2, window 3: effective context 2..7; support 3..5
        let eff = Effective { sink: 2, window: 3 };
        let probs = rows(&[
            &[0.5, 0.0, 0.1, 0.2, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0], // 0.4 / 0.5
            &[0.9, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], // nothing effective
            &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0], // all in the window
        ]);
        let l = support_labels(&probs, std::slice::from_ref(&(3..5)), eff).unwrap();
        assert!((l[0] - 0.8).abs() < 1e-6, "{l:?}");
        assert_eq!(&l[1..], &[0.0, 0.0]);
        // a context shorter than sink + window has no effective part
        let short = rows(&[&[0.5, 0.5, 0.0]]);
        assert_eq!(
            support_labels(&short, std::slice::from_ref(&(1..2)), eff).unwrap(),
            vec![0.0]
        );
    }

    #[test]
    fn a_trace_round_trips_through_its_files() {
        let mut t = Trace::empty(LabelKind::Binary, 2, 3, 4);
        let steps = ExampleSteps {
            features: vec![vec![1.0, 2.0, 3.0, 4.0], vec![0.5; 4]],
            labels: vec![vec![0.0, 1.0, 0.0, 0.0, 0.0, 1.0], vec![0.0; 6]],
            tokens: vec![5, 6],
        };
        t.push(0, &steps).unwrap();
        t.push(1, &steps).unwrap();
        assert_eq!((t.len(), t.prompt.clone()), (4, vec![0, 0, 1, 1]));
        assert_eq!(t.step, vec![0, 1, 0, 1]);
        let bad = ExampleSteps {
            features: vec![vec![1.0; 3]],
            labels: vec![vec![0.0; 6]],
            tokens: vec![1],
        };
        assert!(t.push(2, &bad).is_err());
        let dir = std::env::temp_dir().join(format!("headwise-trace-{}", std::process::id()));
        let stem = dir.join("niah.test");
        let card = TraceCard {
            schema_version: SCHEMA_VERSION,
            model: "m".into(),
            model_sha256: "ab".into(),
            task: serde_json::json!({"task": "niah"}),
            config: TraceConfig {
                label_kind: LabelKind::Binary,
                effective: Effective::default(),
                max_new: 2,
                teacher: false,
            },
            label_kind: LabelKind::Binary,
            n_layers: 2,
            n_heads: 3,
            d_model: 4,
            prompts: 2,
            steps: 4,
            label_mean: 0.25,
            steps_with_active_head: 2,
            examples: vec!["a".into(), "b".into()],
            made: Made::now("fast"),
        };
        t.save(&stem, &card).unwrap();
        let (back, back_card) = Trace::load(&dir.join("niah.test.json")).unwrap();
        assert_eq!(back, t);
        assert_eq!(back_card, card);
        assert!(card.check_model("ab", "m").is_ok());
        let err = card.check_model("cd", "other").unwrap_err().to_string();
        assert!(err.contains("recorded on m"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
