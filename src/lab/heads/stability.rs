//! How much a ranking's top heads depend on which trials were run: the accepted trials
//! are resampled with replacement, each resample scored as the full set is
//! ([`scores`]), and its top-k compared with the full set's top-k by Jaccard overlap.
//! A mean Jaccard near 1 says the top-k set is a property of the model on this task;
//! well below 1 says more trials are needed before the set is read as one.

use crate::lab::heads::run::TrialOutcome;
use crate::policy::ranking::TopKStability;
use crate::rng::SplitMix64;

/// Which score a ranking holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Wu et al.'s token-match credit: mean per trial.
    Wu,
    /// LOCOS logit contribution: mean per scored step.
    Locos,
}

/// The scores of `trials` (all counted, accepted or not: pass the accepted ones),
/// `(n_layers * n_heads)` row-major, and the number of units averaged over (trials for
/// Wu, scored steps for LOCOS). An empty set gives zeros.
pub fn scores(trials: &[&TrialOutcome], method: Method, len: usize) -> (Vec<f64>, usize) {
    let mut sum = vec![0.0; len];
    let mut units = 0;
    for t in trials {
        let (v, n) = match method {
            Method::Wu => (&t.wu, 1),
            Method::Locos => (&t.locos, t.locos_steps),
        };
        units += n;
        sum.iter_mut().zip(v).for_each(|(a, b)| *a += b);
    }
    let scale = 1.0 / units.max(1) as f64;
    sum.iter_mut().for_each(|a| *a *= scale);
    (sum, units)
}

/// Indices of the `k` highest scores, ties to the lower index (the order
/// [`crate::policy::ranking::Ranking::top`] gives).
fn top_k(scores: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    order.truncate(k);
    order.sort_unstable();
    order
}

fn jaccard(a: &[usize], b: &[usize]) -> f64 {
    let shared = a.iter().filter(|x| b.contains(x)).count();
    let union = a.len() + b.len() - shared;
    if union == 0 {
        1.0
    } else {
        shared as f64 / union as f64
    }
}

/// Bootstrap stability of the top-`k` sets for each of `ks`: `rounds` resamples of
/// `trials` (the accepted ones) with replacement, seeded by `seed`. Empty when there are
/// no trials.
pub fn bootstrap_top_k(
    trials: &[&TrialOutcome],
    method: Method,
    len: usize,
    ks: &[usize],
    rounds: usize,
    seed: u64,
) -> Vec<TopKStability> {
    if trials.is_empty() || rounds == 0 {
        return Vec::new();
    }
    let (full, _) = scores(trials, method, len);
    let full_top: Vec<Vec<usize>> = ks.iter().map(|&k| top_k(&full, k)).collect();
    let mut rng = SplitMix64::new(seed, 0x5AB1_E5E7);
    let mut overlaps = vec![Vec::with_capacity(rounds); ks.len()];
    let mut sample: Vec<&TrialOutcome> = Vec::with_capacity(trials.len());
    for _ in 0..rounds {
        sample.clear();
        sample.extend((0..trials.len()).map(|_| trials[rng.below(trials.len())]));
        let (s, _) = scores(&sample, method, len);
        for (i, &k) in ks.iter().enumerate() {
            overlaps[i].push(jaccard(&top_k(&s, k), &full_top[i]));
        }
    }
    ks.iter()
        .zip(overlaps)
        .map(|(&k, mut j)| {
            j.sort_by(f64::total_cmp);
            TopKStability {
                k,
                mean_jaccard: j.iter().sum::<f64>() / j.len() as f64,
                p05_jaccard: j[(j.len() - 1) * 5 / 100],
                rounds,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trial(wu: Vec<f64>, locos: Vec<f64>, steps: usize) -> TrialOutcome {
        TrialOutcome {
            id: String::new(),
            context_tokens: 0,
            generated: String::new(),
            tokens: Vec::new(),
            recall: 1.0,
            wu,
            locos,
            locos_steps: steps,
        }
    }

    #[test]
    fn scores_average_per_trial_for_wu_and_per_step_for_locos() {
        let a = trial(vec![1.0, 0.0], vec![4.0, 2.0], 2);
        let b = trial(vec![0.0, 3.0], vec![2.0, 0.0], 1);
        let (wu, n) = scores(&[&a, &b], Method::Wu, 2);
        assert_eq!((wu, n), (vec![0.5, 1.5], 2));
        let (lo, n) = scores(&[&a, &b], Method::Locos, 2);
        assert_eq!((lo, n), (vec![2.0, 2.0 / 3.0], 3));
    }

    #[test]
    fn identical_trials_give_a_stable_top_k() {
        let t = trial(vec![3.0, 1.0, 2.0, 0.0], vec![0.0; 4], 0);
        let s = bootstrap_top_k(&[&t, &t, &t], Method::Wu, 4, &[1, 2], 50, 7);
        assert_eq!(s.len(), 2);
        assert!(s
            .iter()
            .all(|x| x.mean_jaccard == 1.0 && x.p05_jaccard == 1.0));
    }

    #[test]
    fn mean_overlap_matches_the_resampling_probability_worked_out_by_hand() {
        // Two trials: A puts head 0 first (2.0), B head 1 (1.0). The full top-1 is head 0
        // (means 1.0 vs 0.5). A resample of two trials is {A,A}, {A,B}, {B,A} or {B,B},
        // each with probability 1/4; only {B,B} ranks head 1 first, so the expected
        // Jaccard of the top-1 is 3/4, and its 5th percentile 0.
        let a = trial(vec![2.0, 0.0], vec![0.0; 2], 0);
        let b = trial(vec![0.0, 1.0], vec![0.0; 2], 0);
        let s = bootstrap_top_k(&[&a, &b], Method::Wu, 2, &[1], 4000, 1);
        assert!((s[0].mean_jaccard - 0.75).abs() < 0.03, "{:?}", s[0]);
        assert_eq!(s[0].p05_jaccard, 0.0);
        assert!(bootstrap_top_k(&[], Method::Wu, 2, &[1], 10, 1).is_empty());
    }
}
