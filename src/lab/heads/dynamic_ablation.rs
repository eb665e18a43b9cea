//! Dynamic ablation ("Retrieval Heads are Dynamic", 2026): at every generation step, silence the heads
//! that are active at that step (oracle labels from the unablated run), against as many
//! static top heads or random heads at the same step; and the compensation analysis:
//! which heads become active once the dynamic ones are silenced.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::lab::eval::Example;
use crate::lab::heads::trace::{record, ExampleSteps, TraceConfig};
use crate::lab::stats::{sign_flip_p, wilson};
use crate::metrics::contains_answer;
use crate::model::{Interventions, LoadedModel};
use crate::policy::ablation::{AblationMode, HeadSet};
use crate::Result;

/// Which heads a run silences at step `t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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

impl Variant {
    /// Every variant, in the order [`PromptOutcome`]'s arrays hold them.
    pub const ALL: [Variant; 4] = [
        Variant::None,
        Variant::Dynamic,
        Variant::Static,
        Variant::Random,
    ];
}

/// One example under every variant.
#[derive(Debug, Clone)]
struct ExampleAblation {
    /// `(variant, the run's steps)`, `None` first.
    runs: Vec<(Variant, ExampleSteps)>,
    /// Per step of the unablated run: the active heads.
    oracle: Vec<Vec<(usize, usize)>>,
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
fn ablate_example(
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
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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
    /// Add another prompt's counts.
    pub fn merge(&mut self, other: &Compensation) {
        self.steps += other.steps;
        self.new_active += other.new_active;
        self.in_static += other.in_static;
        self.distinct_heads
            .extend(other.distinct_heads.iter().copied());
    }

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

/// What one prompt gave under every variant (arrays in [`Variant::ALL`] order): the line
/// a run appends per prompt and resumes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptOutcome {
    pub id: String,
    pub context_tokens: usize,
    /// Whether the generated text holds the answer.
    pub correct: [bool; 4],
    /// Tokens generated.
    pub steps: [usize; 4],
    /// Heads silenced, summed over the steps.
    pub silenced: [usize; 4],
    /// Heads newly active once the dynamic ones are silenced.
    pub compensation: Compensation,
    /// (step, head) activations of the unablated run, and how many of them fall on the
    /// static set: the base rate compensation is read against.
    pub base_active: usize,
    pub base_on_static: usize,
}

/// The random heads' seed of a prompt: FNV-1a of its id, so that a prompt draws the same
/// heads whatever grid it is part of (a grown run reuses earlier prompts).
pub fn prompt_seed(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Run `ex` under every variant (`ablate_example`, random heads seeded by
/// [`prompt_seed`]) and count what the report needs.
pub fn prompt_outcome(
    lm: &LoadedModel,
    ex: &Example,
    cfg: &TraceConfig,
    static_heads: &[(usize, usize)],
    mode: AblationMode,
) -> Result<PromptOutcome> {
    let a = ablate_example(lm, ex, cfg, static_heads, mode, prompt_seed(&ex.id))?;
    let n_heads = lm.model.config().n_heads;
    let stat: BTreeSet<&(usize, usize)> = static_heads.iter().collect();
    let mut out = PromptOutcome {
        id: ex.id.clone(),
        context_tokens: ex.context_tokens,
        correct: [false; 4],
        steps: [0; 4],
        silenced: [0; 4],
        compensation: Compensation::default(),
        base_active: a.oracle.iter().map(Vec::len).sum(),
        base_on_static: a
            .oracle
            .iter()
            .flatten()
            .filter(|h| stat.contains(h))
            .count(),
    };
    for (slot, v) in Variant::ALL.iter().enumerate() {
        let Some((_, run)) = a.runs.iter().find(|(w, _)| w == v) else {
            continue;
        };
        out.correct[slot] = contains_answer(&ex.answers, &lm.decode(&run.tokens)?) == 1.0;
        out.steps[slot] = run.tokens.len();
        if *v != Variant::None {
            out.silenced[slot] = a.oracle.iter().take(run.tokens.len()).map(Vec::len).sum();
        }
        if *v == Variant::Dynamic {
            out.compensation.add(&a.oracle, run, static_heads, n_heads);
        }
    }
    Ok(out)
}

/// A share with its Wilson 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Share {
    pub hits: usize,
    pub n: usize,
    pub value: f64,
    pub ci95: [f64; 2],
}

impl Share {
    fn of(hits: usize, n: usize) -> Self {
        let (lo, hi) = wilson(hits, n);
        Share {
            hits,
            n,
            value: hits as f64 / n.max(1) as f64,
            ci95: [lo, hi],
        }
    }
}

/// A variant over the prompts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VariantRow {
    pub variant: Variant,
    /// Accuracy over every prompt.
    pub accuracy: Share,
    /// Accuracy over the prompts the unablated model answered (1 for `None`).
    pub kept: Share,
    /// Heads silenced per generated token.
    pub silenced_per_step: f64,
}

/// Two variants on the prompts the unablated model answered: exact McNemar.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairedTest {
    pub a: Variant,
    pub b: Variant,
    /// Prompts `a` answered and `b` did not, and the reverse.
    pub only_a: usize,
    pub only_b: usize,
    pub p_value: f64,
}

/// The whole report's numbers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AblationSummary {
    pub prompts: usize,
    pub variants: Vec<VariantRow>,
    pub tests: Vec<PairedTest>,
    pub compensation: Compensation,
    /// Share of the newly active heads that are static, and the base rate: the share of
    /// the unablated run's activations on the static set.
    pub compensation_in_static: Share,
    pub base_rate_in_static: Share,
}

/// Summarise `outcomes`.
pub fn summarize(outcomes: &[PromptOutcome]) -> AblationSummary {
    let n = outcomes.len();
    let kept: Vec<&PromptOutcome> = outcomes.iter().filter(|o| o.correct[0]).collect();
    let variants = Variant::ALL
        .iter()
        .enumerate()
        .map(|(i, &variant)| {
            let steps: usize = outcomes.iter().map(|o| o.steps[i]).sum();
            let silenced: usize = outcomes.iter().map(|o| o.silenced[i]).sum();
            VariantRow {
                variant,
                accuracy: Share::of(outcomes.iter().filter(|o| o.correct[i]).count(), n),
                kept: Share::of(kept.iter().filter(|o| o.correct[i]).count(), kept.len()),
                silenced_per_step: silenced as f64 / steps.max(1) as f64,
            }
        })
        .collect();
    let tests = [(1, 2), (1, 3), (2, 3)]
        .iter()
        .map(|&(i, j)| {
            let d: Vec<f64> = kept
                .iter()
                .map(|o| f64::from(u8::from(o.correct[i])) - f64::from(u8::from(o.correct[j])))
                .collect();
            PairedTest {
                a: Variant::ALL[i],
                b: Variant::ALL[j],
                only_a: d.iter().filter(|&&x| x > 0.0).count(),
                only_b: d.iter().filter(|&&x| x < 0.0).count(),
                p_value: sign_flip_p(&d),
            }
        })
        .collect();
    let mut compensation = Compensation::default();
    for o in outcomes {
        compensation.merge(&o.compensation);
    }
    AblationSummary {
        prompts: n,
        variants,
        tests,
        compensation_in_static: Share::of(compensation.in_static, compensation.new_active),
        base_rate_in_static: Share::of(
            outcomes.iter().map(|o| o.base_on_static).sum(),
            outcomes.iter().map(|o| o.base_active).sum(),
        ),
        compensation,
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

    fn outcome(correct: [bool; 4], comp: (usize, usize), base: (usize, usize)) -> PromptOutcome {
        PromptOutcome {
            id: String::new(),
            context_tokens: 0,
            correct,
            steps: [4; 4],
            silenced: [0, 4, 4, 4],
            compensation: Compensation {
                steps: 4,
                new_active: comp.0,
                in_static: comp.1,
                distinct_heads: BTreeSet::new(),
            },
            base_active: base.0,
            base_on_static: base.1,
        }
    }

    #[test]
    fn prompt_seeds_are_fnv1a_of_the_id() {
        // Published FNV-1a 64 test vectors: "" and "a".
        assert_eq!(prompt_seed(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(prompt_seed("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn summary_counts_kept_prompts_and_tests_them_pairwise() {
        // 10 prompts answered unablated: dynamic breaks all 10, static 2, random none; one
        // prompt the unablated model missed is left out of the kept rows and the tests.
        let mut o: Vec<PromptOutcome> = (0..10)
            .map(|i| outcome([true, false, i >= 2, true], (3, 1), (10, 5)))
            .collect();
        o.push(outcome([false, false, false, true], (0, 0), (10, 0)));
        let s = summarize(&o);
        assert_eq!(s.prompts, 11);
        let kept: Vec<(usize, usize)> =
            s.variants.iter().map(|v| (v.kept.hits, v.kept.n)).collect();
        assert_eq!(kept, [(10, 10), (0, 10), (8, 10), (10, 10)]);
        assert_eq!(s.variants[3].accuracy.hits, 11);
        assert_eq!(s.variants[1].silenced_per_step, 1.0);
        // dynamic vs static: 0 against 8 discordant, exact p = 2 / 2^8
        let t = &s.tests[0];
        assert_eq!(
            (t.a, t.b, t.only_a, t.only_b),
            (Variant::Dynamic, Variant::Static, 0, 8)
        );
        assert!((t.p_value - 2.0 / 256.0).abs() < 1e-12);
        assert_eq!(s.tests[2].only_b, 2);
        assert_eq!(
            (s.compensation_in_static.hits, s.compensation_in_static.n),
            (10, 30)
        );
        assert_eq!(
            (s.base_rate_in_static.hits, s.base_rate_in_static.n),
            (50, 110)
        );
        assert_eq!(s.base_rate_in_static.ci95, {
            let (a, b) = wilson(50, 110);
            [a, b]
        });
    }
}
