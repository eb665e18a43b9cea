//! A policy resolved against one model: what every KV head keeps, which query heads are
//! top-k restricted or ablated, and how dynamic heads are picked per step. Everything
//! that can fail (files, model identity, ranges) fails here, before generation.

use std::path::{Path, PathBuf};

use crate::model::{Config, Interventions, ModelId, Retention, TopK};
use crate::policy::ablation::{Calibration, HeadSet};
use crate::policy::config::{Gqa, HeadChoice, PolicyConfig, Prefill, Selection};
use crate::policy::ranking::Ranking;
use crate::probe::Probe;
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// Salt of the random head draws (so that seed 0 here differs from other draws).
const RANDOM_SALT: u64 = 0x706f_6c69_6379;

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
    /// The policy's name ([`PolicyConfig::name`]).
    pub name: String,
    /// Per `layer * n_kv_heads + kv_head`.
    pub retention: Vec<Retention>,
    /// `(layer, query head, restriction)` applied at decode steps.
    pub topk: Vec<(usize, usize, TopK)>,
    /// Ablations.
    pub edits: Interventions,
    pub prefill: Prefill,
    pub dynamic: Option<Dynamic>,
    n_heads: usize,
    n_kv_heads: usize,
    /// Per KV head: whether its layer has no sliding window of its own (the heads a
    /// policy can choose between).
    candidates: Vec<bool>,
}

impl Plan {
    /// Resolve `policy` for the model `cfg` with identity `id`; relative paths are read
    /// from `base`.
    pub fn resolve(policy: &PolicyConfig, cfg: &Config, id: &ModelId, base: &Path) -> Result<Self> {
        policy.validate()?;
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
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            candidates,
        };
        let parts = match policy {
            PolicyConfig::Compose { policies } => policies.clone(),
            p => vec![p.clone()],
        };
        for p in &parts {
            plan.apply(p, cfg, id, base)?;
        }
        Ok(plan)
    }

    fn apply(&mut self, p: &PolicyConfig, cfg: &Config, id: &ModelId, base: &Path) -> Result<()> {
        let ctx = Ctx { cfg, id, base };
        match p {
            PolicyConfig::Full {} => {}
            PolicyConfig::Window {
                sink,
                window,
                prefill,
            } => {
                self.retention.fill(Retention::Stream {
                    sink: *sink,
                    window: *window,
                });
                self.prefill = *prefill;
            }
            PolicyConfig::StaticHeads {
                heads,
                gqa,
                sink,
                window,
                prefill,
            } => {
                let chosen = ctx.choose(heads, true)?;
                let keep = self.kv_heads(&chosen, *gqa)?;
                for (r, keep) in self.retention.iter_mut().zip(keep) {
                    *r = if keep {
                        Retention::Full
                    } else {
                        Retention::Stream {
                            sink: *sink,
                            window: *window,
                        }
                    };
                }
                self.prefill = *prefill;
            }
            PolicyConfig::DynamicHeads {
                probe,
                oracle,
                threshold,
                gqa,
                sink,
                window,
                cold,
            } => {
                if *gqa == Gqa::Sum {
                    return Err(Error::invalid(
                        "gqa",
                        "sum ranks static scores; dynamic heads take any or majority",
                    ));
                }
                let source = if *oracle {
                    DynamicSource::Oracle
                } else {
                    let path = ctx.path(
                        probe
                            .as_ref()
                            .ok_or(Error::Internal("validated: a probe"))?,
                    );
                    let probe = crate::probe::Probe::load(&path)?;
                    probe.check_model(cfg.d_model, cfg.n_layers * cfg.n_heads, Some(&id.sha256))?;
                    let threshold = threshold.or(probe.threshold()).unwrap_or(0.5);
                    DynamicSource::Probe {
                        probe: Box::new(probe),
                        threshold,
                    }
                };
                self.retention.fill(Retention::Tiered {
                    sink: *sink,
                    window: *window,
                    cold: *cold,
                });
                self.dynamic = Some(Dynamic { source, gqa: *gqa });
                self.prefill = Prefill::FullThenEvict;
            }
            PolicyConfig::TopkMask {
                heads,
                k,
                sink,
                window,
            } => {
                for (layer, head) in ctx.choose(heads, false)?.heads.0 {
                    self.topk.push((
                        layer,
                        head,
                        TopK {
                            k: *k,
                            sink: *sink,
                            window: *window,
                        },
                    ));
                }
            }
            PolicyConfig::Ablate {
                heads,
                mode,
                calibration,
            } => {
                let chosen = ctx.choose(heads, false)?;
                let calibration = calibration
                    .as_ref()
                    .map(|c| Calibration::load(&ctx.path(c), id))
                    .transpose()?;
                let edits = chosen.heads.interventions(*mode, calibration.as_ref())?;
                self.edits.merge(&edits);
            }
            PolicyConfig::Compose { .. } => {
                return Err(Error::invalid("compose", "compositions do not nest"));
            }
        }
        Ok(())
    }

    /// Which KV heads to keep in full for the chosen query heads.
    fn kv_heads(&self, chosen: &Chosen, gqa: Gqa) -> Result<Vec<bool>> {
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

    /// KV heads that keep their whole history in the hot tier.
    pub fn full_kv_heads(&self) -> usize {
        self.retention
            .iter()
            .zip(&self.candidates)
            .filter(|(r, &c)| c && **r == Retention::Full)
            .count()
    }
}

/// Chosen query heads with the ranking's scores (`layer * n_heads + head`) when a
/// ranking chose them.
struct Chosen {
    heads: HeadSet,
    scores: Option<Vec<f64>>,
}

/// What choosing heads needs.
struct Ctx<'a> {
    cfg: &'a Config,
    id: &'a ModelId,
    base: &'a Path,
}

impl Ctx<'_> {
    /// A path of the policy, relative to the base folder, with `{model}` replaced by the
    /// model's name (so one preset serves every model).
    fn path(&self, p: &Path) -> PathBuf {
        let text = p.to_string_lossy().replace("{model}", &self.id.name);
        self.base.join(text)
    }

    /// The query heads `choice` names; with `global_only`, only heads of layers without
    /// a sliding window of their own are candidates.
    fn choose(&self, choice: &HeadChoice, global_only: bool) -> Result<Chosen> {
        let cfg = self.cfg;
        let candidate = |layer: usize| !global_only || cfg.layer(layer).window.is_none();
        let n_candidates = (0..cfg.n_layers).filter(|&l| candidate(l)).count() * cfg.n_heads;
        if let Some(list) = &choice.list {
            for &[layer, head] in list {
                Error::check_head(layer, head, cfg.n_layers, cfg.n_heads)?;
            }
            return Ok(Chosen {
                heads: HeadSet(list.iter().map(|&[l, h]| (l, h)).collect()),
                scores: None,
            });
        }
        let select = choice
            .select
            .as_ref()
            .ok_or(Error::Internal("validated: a selection"))?;
        let count_in_range = |k: usize| -> Result<usize> {
            if k > n_candidates {
                return Err(Error::invalid(
                    "select",
                    format!("{k} heads, the model has {n_candidates} to choose from"),
                ));
            }
            Ok(k)
        };
        if let Selection::Random { count, seed } = select {
            let count = count_in_range(*count)?;
            let pool: Vec<(usize, usize)> = (0..cfg.n_layers)
                .filter(|&l| candidate(l))
                .flat_map(|l| (0..cfg.n_heads).map(move |h| (l, h)))
                .collect();
            let mut rng = SplitMix64::new(*seed, RANDOM_SALT);
            let mut order: Vec<usize> = (0..pool.len()).collect();
            rng.shuffle(&mut order);
            let mut heads: Vec<(usize, usize)> = order[..count].iter().map(|&i| pool[i]).collect();
            heads.sort_unstable();
            return Ok(Chosen {
                heads: HeadSet(heads),
                scores: None,
            });
        }
        let path = self.path(
            choice
                .ranking
                .as_ref()
                .ok_or(Error::Internal("validated: a ranking"))?,
        );
        let ranking = Ranking::load(&path)?;
        let p = &ranking.provenance;
        if !p.model_sha256.eq_ignore_ascii_case(&self.id.sha256)
            || (ranking.n_layers, ranking.n_heads) != (cfg.n_layers, cfg.n_heads)
        {
            return Err(Error::invalid(
                "ranking",
                format!(
                    "{} ranks {} (sha256 {}), not this model ({}, sha256 {})",
                    path.display(),
                    p.model,
                    p.model_sha256,
                    self.id.name,
                    self.id.sha256
                ),
            ));
        }
        let mut ranked: Vec<(f64, usize, usize)> = ranking
            .heads
            .iter()
            .filter(|h| candidate(h.layer))
            .map(|h| (h.score, h.layer, h.head))
            .collect();
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        let take = match select {
            Selection::TopK(k) => count_in_range(*k)?,
            Selection::Fraction(f) => ((f * n_candidates as f64).round() as usize).max(1),
            Selection::Threshold(t) => ranked.iter().filter(|h| h.0 >= *t).count(),
            Selection::Random { .. } => unreachable!("handled above"),
        };
        let mut scores = vec![0.0; cfg.n_layers * cfg.n_heads];
        for h in &ranking.heads {
            scores[h.layer * cfg.n_heads + h.head] = h.score;
        }
        Ok(Chosen {
            heads: HeadSet(ranked[..take].iter().map(|&(_, l, h)| (l, h)).collect()),
            scores: Some(scores),
        })
    }
}
