//! A policy resolved against one model: what every KV head keeps, which query heads are
//! top-k restricted or ablated, and how dynamic heads are picked per step. Each policy
//! writes its part ([`crate::policy::presses::Press::apply`]); everything that can fail
//! (files, model identity, ranges) fails here, before generation.

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::model::{Config, Interventions, LoadedModel, ModelId, Retention, RowFormat, TopK};
use crate::policy::config::Policy;
use crate::policy::evict::{Eviction, Observe};
use crate::policy::presses::kvzip::RepeatPrompt;
use crate::policy::presses::Target;
use crate::policy::select::{Chosen, Gqa};
use crate::probe::Probe;
use crate::{Error, Result};

/// How the prompt is processed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prefill {
    /// Streaming heads stream already during the chunked prefill (DuoAttention): less
    /// work and a lower peak.
    #[default]
    Stream,
    /// The prompt runs with full attention, then streaming heads drop what they do not
    /// keep: the prompt's representations are exact, the peak is the full cache.
    FullThenEvict,
}

/// Where a dynamic policy's per-step head choice comes from.
#[derive(Debug, Clone)]
pub enum DynamicSource {
    /// A probe fed the previous step's final hidden state; a head is chosen when its
    /// output reaches `threshold`.
    Probe { probe: Box<Probe>, threshold: f32 },
    /// The true labels of each step (from a full-cache run of the same request).
    Oracle,
}

/// Per-step head choice of a `dynamic_heads` policy.
#[derive(Debug, Clone)]
pub struct Dynamic {
    pub source: DynamicSource,
    pub gqa: Gqa,
}

/// A resolved policy.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The policy's name ([`Policy::name`]).
    pub name: String,
    /// Per `layer * n_kv_heads + kv_head`.
    pub retention: Vec<Retention>,
    /// `(layer, query head, restriction)` applied at decode steps.
    pub topk: Vec<(usize, usize, TopK)>,
    /// Ablations.
    pub edits: Interventions,
    pub prefill: Prefill,
    pub dynamic: Option<Dynamic>,
    /// Token eviction after the prompt's prefill.
    pub evict: Option<Eviction>,
    /// How every store holds its rows (f32 unless a `quantize` part says otherwise).
    pub rows: RowFormat,
    /// What a press that re-reads the context feeds the model (KVzip), once
    /// [`Plan::with_text`] gave it.
    pub repeat: Option<Arc<RepeatPrompt>>,
    n_heads: usize,
    n_kv_heads: usize,
    /// Per KV head: whether its layer has no sliding window of its own (the heads a
    /// policy can choose between).
    candidates: Vec<bool>,
}

impl Plan {
    /// Resolve `policy` for the model `cfg` with identity `id`; relative paths are read
    /// from `base`.
    pub fn resolve(policy: &Policy, cfg: &Config, id: &ModelId, base: &Path) -> Result<Self> {
        let candidates: Vec<bool> = (0..cfg.n_layers * cfg.n_kv_heads)
            .map(|i| cfg.layer(i / cfg.n_kv_heads).window.is_none())
            .collect();
        let mut plan = Plan {
            name: policy.name(),
            retention: vec![Retention::Full; candidates.len()],
            topk: Vec::new(),
            edits: Interventions::new(),
            prefill: Prefill::Stream,
            dynamic: None,
            evict: None,
            rows: RowFormat::F32,
            repeat: None,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            candidates,
        };
        let target = Target { cfg, id, base };
        policy.config().press().apply(&mut plan, &target)?;
        Ok(plan)
    }

    /// This plan with what it needs of `lm`'s tokenizer and chat template: the repeat
    /// prompt of a press that re-reads the context (KVzip); the rest need nothing.
    pub fn with_text(mut self, lm: &LoadedModel) -> Result<Self> {
        let reconstructs = self
            .evict
            .as_ref()
            .is_some_and(|e| matches!(e.scorer.observes(), Observe::Reconstruct { .. }));
        if reconstructs {
            self.repeat = Some(Arc::new(RepeatPrompt::of(lm)?));
        }
        Ok(self)
    }

    /// Which KV heads to keep in full for the chosen query heads.
    pub(crate) fn kv_heads(&self, chosen: &Chosen, gqa: Gqa) -> Result<Vec<bool>> {
        let group = self.n_heads / self.n_kv_heads;
        let mut counts = vec![0usize; self.candidates.len()];
        for &(layer, head) in &chosen.heads.0 {
            counts[layer * self.n_kv_heads + head / group] += 1;
        }
        Ok(match gqa {
            Gqa::Any => counts.iter().map(|&c| c > 0).collect(),
            Gqa::Majority => counts.iter().map(|&c| 2 * c > group).collect(),
            Gqa::Sum => {
                let scores = chosen.scores.as_ref().ok_or_else(|| {
                    Error::invalid("gqa", "sum needs ranking scores (not a list or random)")
                })?;
                let keep = chosen.heads.0.len().div_ceil(group);
                let mut kv: Vec<(f64, usize)> = (0..self.candidates.len())
                    .filter(|&i| self.candidates[i])
                    .map(|i| {
                        let s = (0..group).map(|g| scores[i * group + g]).sum();
                        (s, i)
                    })
                    .collect();
                kv.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut out = vec![false; self.candidates.len()];
                for &(_, i) in kv.iter().take(keep) {
                    out[i] = true;
                }
                out
            }
        })
    }

    /// KV-head flags for one step from per-query-head values (probe outputs or labels,
    /// `layer * n_heads + head`) and a threshold.
    pub fn active_kv_heads(&self, values: &[f32], threshold: f32, gqa: Gqa) -> Vec<bool> {
        let group = self.n_heads / self.n_kv_heads;
        (0..self.candidates.len())
            .map(|i| {
                let chosen = values[i * group..(i + 1) * group]
                    .iter()
                    .filter(|&&v| v >= threshold)
                    .count();
                self.candidates[i]
                    && match gqa {
                        Gqa::Majority => 2 * chosen > group,
                        _ => chosen > 0,
                    }
            })
            .collect()
    }

    /// KV heads a policy can choose between (those of layers without their own window).
    pub fn candidate_kv_heads(&self) -> usize {
        self.candidates.iter().filter(|&&c| c).count()
    }

    /// KV heads that keep their whole history in the hot tier (under a press, those it
    /// leaves whole).
    pub fn full_kv_heads(&self) -> usize {
        if let Some(evict) = &self.evict {
            return evict.exempt.iter().filter(|&&e| e).count();
        }
        self.retention
            .iter()
            .zip(&self.candidates)
            .filter(|(r, &c)| c && **r == Retention::Full)
            .count()
    }
}
