//! Choosing heads, split the way kvpress splits its presses: a **scorer** gives every
//! query head a score (a ranking file, a seeded random draw, or an explicit list), a
//! **selector** keeps the best ones ([`Selection`]), and [`Gqa`] turns the chosen query
//! heads into KV heads under grouped-query attention. Every head-level policy
//! (`static_heads`, `topk_mask`, `ablate`) chooses through [`HeadChoice::choose`]; the
//! per-step probe of `dynamic_heads` is a scorer of its own whose outputs go through the
//! same [`Gqa`] rule ([`crate::policy::Plan::active_kv_heads`]).

use serde::{Deserialize, Serialize};

use crate::policy::ablation::HeadSet;
use crate::policy::presses::Target;
use crate::policy::ranking::Ranking;
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// Salt of the random head draws (so that seed 0 here differs from other draws).
const RANDOM_SALT: u64 = 0x706f_6c69_6379;

/// Which query heads a policy applies to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct HeadChoice {
    /// A ranking file (needed by `top_k`, `fraction` and `threshold`).
    #[serde(default)]
    pub ranking: Option<std::path::PathBuf>,
    /// How heads are picked from the ranking (or at random).
    #[serde(default)]
    pub select: Option<Selection>,
    /// Explicit `[layer, head]` pairs instead of a selection.
    #[serde(default)]
    pub list: Option<Vec<[usize; 2]>>,
}

/// How query heads are picked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Selection {
    /// The `k` best-ranked heads.
    TopK(usize),
    /// This share of the candidate heads, in `(0, 1]`, best-ranked first.
    Fraction(f64),
    /// Every head scoring at least this.
    Threshold(f64),
    /// `count` heads drawn at random (seeded): the control.
    Random { count: usize, seed: u64 },
}

/// How query-head choices become KV-head choices under grouped-query attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gqa {
    /// A KV head is kept when any of its query heads is chosen (RazorAttention).
    #[default]
    Any,
    /// When more than half of its query heads are chosen.
    Majority,
    /// KV heads ranked by the summed scores of their query heads; as many kept as the
    /// selection covers whole groups (`ceil(chosen / group)`).
    Sum,
}

/// Chosen query heads, with the ranking's scores (`layer * n_heads + head`) when a
/// ranking chose them.
#[derive(Debug, Clone)]
pub struct Chosen {
    pub heads: HeadSet,
    pub scores: Option<Vec<f64>>,
}

impl HeadChoice {
    /// Check what can be checked without the model; `policy` names the policy in errors.
    pub(crate) fn check(&self, policy: &str) -> Result<()> {
        match (&self.list, &self.select) {
            (Some(_), Some(_)) => Err(Error::invalid(
                policy,
                "give either `heads.list` or `heads.select`, not both",
            )),
            (None, None) => Err(Error::invalid(
                policy,
                "needs `heads = { ranking = \"<file>.json\", select = { top_k = N } }` or `heads = { list = [[layer, head], ...] }`",
            )),
            (Some(_), None) => Ok(()),
            (None, Some(sel)) => {
                match sel {
                    Selection::Fraction(f) if !(*f > 0.0 && *f <= 1.0) => {
                        return Err(Error::invalid(
                            "select.fraction",
                            format!("{f} (must be in (0, 1])"),
                        ))
                    }
                    Selection::Threshold(t) if !t.is_finite() => {
                        return Err(Error::invalid(
                            "select.threshold",
                            format!("{t} (must be finite)"),
                        ))
                    }
                    _ => {}
                }
                if self.ranking.is_none() && !matches!(sel, Selection::Random { .. }) {
                    return Err(Error::invalid(
                        policy,
                        "this selection needs `heads.ranking = \"policies/rankings/<model>/<file>.json\"`",
                    ));
                }
                Ok(())
            }
        }
    }

    /// The query heads this choice names for the model of `target`; with `global_only`,
    /// only heads of layers without a sliding window of their own are candidates.
    pub fn choose(&self, target: &Target<'_>, global_only: bool) -> Result<Chosen> {
        let cfg = target.cfg;
        let candidate = |layer: usize| !global_only || cfg.layer(layer).window.is_none();
        let n_candidates = (0..cfg.n_layers).filter(|&l| candidate(l)).count() * cfg.n_heads;
        if let Some(list) = &self.list {
            for &[layer, head] in list {
                Error::check_head(layer, head, cfg.n_layers, cfg.n_heads)?;
            }
            return Ok(Chosen {
                heads: HeadSet(list.iter().map(|&[l, h]| (l, h)).collect()),
                scores: None,
            });
        }
        let select = self
            .select
            .as_ref()
            .ok_or(Error::Internal("checked: a selection"))?;
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
        let path = target.path(
            self.ranking
                .as_ref()
                .ok_or(Error::Internal("checked: a ranking"))?,
        );
        let ranking = Ranking::load(&path)?;
        ranking.check_for(&path, target.id, cfg.n_layers, cfg.n_heads)?;
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
