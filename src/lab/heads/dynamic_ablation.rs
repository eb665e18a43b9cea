//! Dynamic ablation ("Retrieval Heads are Dynamic", 2026): at every generation step, silence the heads
//! that are active at that step (oracle labels from the unablated run), against as many
//! static top heads or random heads at the same step; and the compensation analysis:
//! which heads become active once the dynamic ones are silenced.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::lab::eval::Example;
use crate::lab::heads::trace::{record, ExampleSteps, TraceConfig};
use crate::model::{Interventions, LoadedModel};
use crate::policy::ablation::{AblationMode, HeadSet};
use crate::Result;

/// Which heads a run silences at step `t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// Nothing (the unablated run that provides the oracle labels).
    None,
    /// The heads active at step `t` of the unablated run.
    Dynamic,
    /// As many heads as `Dynamic` silences at `t`, taken from the static ranking's top.
    Static,
    /// As many heads as `Dynamic` silences at `t`, drawn at random (seeded per step).
    Random,
}

/// One example under every variant.
#[derive(Debug, Clone)]
pub struct ExampleAblation {
    /// `(variant, the run's steps)`, `None` first.
    pub runs: Vec<(Variant, ExampleSteps)>,
    /// Per step of the unablated run: the active heads.
    pub oracle: Vec<Vec<(usize, usize)>>,
}

/// Heads whose label at a step is at least 0.5, from a `n_layers * n_heads` row.
pub fn active(labels: &[f32], n_heads: usize) -> Vec<(usize, usize)> {
    labels
        .iter()
        .enumerate()
        .filter(|(_, &v)| v >= 0.5)
        .map(|(i, _)| (i / n_heads, i % n_heads))
        .collect()
}

/// Run `ex` unablated, then under each ablation variant in `mode` (a mode without
/// calibration: `zero-output` or `uniform-attention`).
pub fn ablate_example(
    lm: &LoadedModel,
    ex: &Example,
    cfg: &TraceConfig,
    static_heads: &[(usize, usize)],
    mode: AblationMode,
    seed: u64,
) -> Result<ExampleAblation> {
    let mc = lm.model.config();
    let nh = mc.n_heads;
    let none = Interventions::new();
    let base = record(lm, ex, cfg, None, &mut |_| none.clone())?;
    let oracle: Vec<Vec<(usize, usize)>> = base.labels.iter().map(|l| active(l, nh)).collect();
    let mut runs = vec![(Variant::None, base)];
    for variant in [Variant::Dynamic, Variant::Static, Variant::Random] {
        let mut failed = None;
        let mut edits_at = |t: usize| -> Interventions {
            let heads = oracle.get(t).cloned().unwrap_or_default();
            let set = match variant {
                Variant::Dynamic | Variant::None => heads,
                Variant::Static => static_heads.iter().take(heads.len()).copied().collect(),
                Variant::Random => {
                    HeadSet::random(mc.n_layers, nh, heads.len(), seed.wrapping_add(t as u64))
                        .map(|s| s.0)
                        .unwrap_or_default()
                }
            };
            match HeadSet(set).interventions(mode, None) {
                Ok(e) => e,
                Err(e) => {
                    failed = Some(e);
                    Interventions::new()
                }
            }
        };
        let steps = record(lm, ex, cfg, None, &mut edits_at)?;
        if let Some(e) = failed {
            return Err(e);
        }
        runs.push((variant, steps));
    }
    Ok(ExampleAblation { runs, oracle })
}

/// After silencing the dynamic heads: heads active at a step that were not active there
/// unablated, and how many of them are in the static set.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Compensation {
    /// Steps compared (the shorter of the two runs).
    pub steps: usize,
    /// Newly active (step, head) pairs.
    pub new_active: usize,
    /// Of those, in the static set.
    pub in_static: usize,
    /// Distinct heads among the newly active ones.
    pub distinct_heads: BTreeSet<(usize, usize)>,
}

impl Compensation {
    /// Add one example: `oracle` per step of the unablated run, `ablated` the dynamic
    /// run's labels.
    pub fn add(
        &mut self,
        oracle: &[Vec<(usize, usize)>],
        ablated: &ExampleSteps,
        static_heads: &[(usize, usize)],
        n_heads: usize,
    ) {
        let stat: BTreeSet<_> = static_heads.iter().collect();
        for (before, labels) in oracle.iter().zip(&ablated.labels) {
            self.steps += 1;
            let before: BTreeSet<_> = before.iter().collect();
            for h in active(labels, n_heads) {
                if !before.contains(&h) {
                    self.new_active += 1;
                    self.in_static += usize::from(stat.contains(&h));
                    self.distinct_heads.insert(h);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::heads::trace::ExampleSteps;

    #[test]
    fn active_heads_are_read_row_major() {
        let l = [0.0, 1.0, 0.0, 0.0, 0.0, 0.7];
        assert_eq!(active(&l, 3), vec![(0, 1), (1, 2)]);
    }

    #[test]
    fn compensation_counts_only_newly_active_heads() {
        // 2 layers x 2 heads; step 0 had (0, 1) active, step 1 nothing
        let oracle = vec![vec![(0, 1)], vec![]];
        let ablated = ExampleSteps {
            features: vec![vec![]; 2],
            labels: vec![vec![0.0, 1.0, 1.0, 0.0], vec![0.0, 0.0, 0.0, 1.0]],
            tokens: vec![1, 2],
        };
        let mut c = Compensation::default();
        c.add(&oracle, &ablated, &[(1, 0)], 2);
        // step 0: (1, 0) is new and static; step 1: (1, 1) is new, not static
        assert_eq!((c.steps, c.new_active, c.in_static), (2, 2, 1));
        assert_eq!(c.distinct_heads.len(), 2);
    }
}
