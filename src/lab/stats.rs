//! The few statistics the reports use: a mean with its standard error, a 95% interval
//! for a mean (Wilson's for 0/1 scores, a percentile bootstrap otherwise), a bootstrap
//! over groups of rows for pooled statistics, and a paired sign-flip test (exact McNemar
//! when the scores are 0/1).

use crate::rng::SplitMix64;

/// Mean and standard error of `xs` (the sample standard deviation over `sqrt(n)`; 0 for
/// a single value).
pub(crate) fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, (var / n).sqrt())
}

/// z of a two-sided 95% interval.
const Z95: f64 = 1.959_963_984_540_054;

/// Resamples of the bootstrap interval.
const BOOTSTRAP_ROUNDS: usize = 4000;

/// Wilson's 95% score interval for `successes` out of `n` (`(0, 1)` when `n` is 0).
pub(crate) fn wilson(successes: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (n, p) = (n as f64, successes as f64 / n as f64);
    let z2 = Z95 * Z95;
    let centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
    let half = Z95 / (1.0 + z2 / n) * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// A 95% interval for the mean of `xs`: Wilson's when every value is 0 or 1, else
/// [`bootstrap95`].
pub(crate) fn interval95(xs: &[f64]) -> (f64, f64) {
    if xs.iter().all(|&x| x == 0.0 || x == 1.0) {
        let ones = xs.iter().filter(|&&x| x == 1.0).count();
        return wilson(ones, xs.len());
    }
    bootstrap95(xs)
}

/// The 2.5th and 97.5th percentiles of the means of 4,000 bootstrap resamples of `xs`
/// (seeded, so a report is reproducible); for differences, where Wilson's interval does
/// not apply.
pub(crate) fn bootstrap95(xs: &[f64]) -> (f64, f64) {
    let mut rng = SplitMix64::new(xs.len() as u64, 0xB0075);
    let mut means: Vec<f64> = (0..BOOTSTRAP_ROUNDS)
        .map(|_| (0..xs.len()).map(|_| xs[rng.below(xs.len())]).sum::<f64>() / xs.len() as f64)
        .collect();
    percentiles95(&mut means)
}

/// A 95% interval for a statistic of grouped rows (a prompt's steps are not independent,
/// so prompts are resampled whole): `stat` of each of 4,000 seeded resamples of `groups`
/// drawn with replacement, 2.5th and 97.5th percentiles. Resamples where `stat` is
/// undefined (`None`) are left out; `None` when every one is.
pub(crate) fn group_bootstrap95<G>(
    groups: &[G],
    stat: impl Fn(&[&G]) -> Option<f64>,
) -> Option<[f64; 2]> {
    if groups.is_empty() {
        return None;
    }
    let mut rng = SplitMix64::new(groups.len() as u64, 0x6_B007);
    let mut picked: Vec<&G> = Vec::with_capacity(groups.len());
    let mut values = Vec::with_capacity(BOOTSTRAP_ROUNDS);
    for _ in 0..BOOTSTRAP_ROUNDS {
        picked.clear();
        picked.extend((0..groups.len()).map(|_| &groups[rng.below(groups.len())]));
        values.extend(stat(&picked));
    }
    if values.is_empty() {
        return None;
    }
    let (lo, hi) = percentiles95(&mut values);
    Some([lo, hi])
}

/// The 2.5th and 97.5th percentiles of `v` (sorted in place).
fn percentiles95(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.025), at(0.975))
}

/// A 95% interval for the mean of a seeds x examples table (every row the same
/// examples in the same order), where both the seeds (e.g. random head sets) and the
/// examples are samples: each of 4,000 seeded resamples draws rows and columns with
/// replacement; the 2.5th and 97.5th percentiles of their means. Falls back to
/// [`interval95`] over every value with a single row.
pub(crate) fn two_way_interval95(table: &[Vec<f64>]) -> (f64, f64) {
    let (rows, cols) = (table.len(), table.first().map_or(0, Vec::len));
    if rows < 2 || cols == 0 {
        return interval95(&table.concat());
    }
    let mut rng = SplitMix64::new((rows * cols) as u64, 0x2_BA7);
    let mut means: Vec<f64> = (0..BOOTSTRAP_ROUNDS)
        .map(|_| {
            let rs: Vec<usize> = (0..rows).map(|_| rng.below(rows)).collect();
            let cs: Vec<usize> = (0..cols).map(|_| rng.below(cols)).collect();
            rs.iter()
                .map(|&r| cs.iter().map(|&c| table[r][c]).sum::<f64>())
                .sum::<f64>()
                / (rows * cols) as f64
        })
        .collect();
    percentiles95(&mut means)
}

/// Nonzero differences up to which [`sign_flip_p`] enumerates every sign pattern.
const EXACT_UP_TO: usize = 20;

/// Draws of the Monte Carlo sign-flip test beyond that.
const FLIP_ROUNDS: usize = 20_000;

/// Two-sided p-value of the paired sign-flip (permutation) test that the differences
/// `d` (one per example: A's score minus B's) are centred on 0: the share of the
/// 2^n sign patterns whose |sum| is at least the observed one. Exact up to 20 nonzero
/// differences, else over 20,000 seeded random patterns (plus the observed one). With
/// 0/1 scores the differences are -1, 0, 1 and this is the exact McNemar test. 1 when
/// every difference is 0.
pub(crate) fn sign_flip_p(d: &[f64]) -> f64 {
    let nz: Vec<f64> = d.iter().copied().filter(|&x| x != 0.0).collect();
    if nz.is_empty() {
        return 1.0;
    }
    let observed = nz.iter().sum::<f64>().abs();
    // Sums equal to the observed one up to rounding count as at least as extreme.
    let tol = 1e-9 * nz.iter().map(|x| x.abs()).sum::<f64>();
    let extreme = |signs: &mut dyn FnMut(usize) -> bool| {
        let s: f64 = nz
            .iter()
            .enumerate()
            .map(|(i, x)| if signs(i) { -x } else { *x })
            .sum();
        s.abs() >= observed - tol
    };
    if nz.len() <= EXACT_UP_TO {
        let patterns = 1u64 << nz.len();
        let hits = (0..patterns)
            .filter(|&m| extreme(&mut |i| m >> i & 1 == 1))
            .count();
        return hits as f64 / patterns as f64;
    }
    let mut rng = SplitMix64::new(nz.len() as u64, 0xF11B);
    let hits = (0..FLIP_ROUNDS)
        .filter(|_| extreme(&mut |_| rng.next_u64() & 1 == 1))
        .count();
    (hits + 1) as f64 / (FLIP_ROUNDS + 1) as f64
}

/// A p-value as reports print it: three decimals, or `< 0.001`.
pub(crate) fn format_p(p: f64) -> String {
    match p {
        p if p < 0.001 => "< 0.001".to_string(),
        p => format!("{p:.3}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_standard_error_by_hand() {
        // 1, 2, 3: mean 2, sample variance 1, se 1 / sqrt(3)
        let (m, se) = mean_se(&[1.0, 2.0, 3.0]);
        assert!((m - 2.0).abs() < 1e-12);
        assert!((se - 1.0 / 3f64.sqrt()).abs() < 1e-12);
        assert_eq!(mean_se(&[5.0]), (5.0, 0.0));
    }

    #[test]
    fn wilson_matches_published_values() {
        // Newcombe (1998), Table I: 81/263 -> 0.2553-0.3662; 15/148 -> 0.0624-0.1605;
        // 0/20 -> 0-0.1611.
        let close =
            |a: (f64, f64), b: (f64, f64)| (a.0 - b.0).abs() < 5e-5 && (a.1 - b.1).abs() < 5e-5;
        assert!(
            close(wilson(81, 263), (0.2553, 0.3662)),
            "{:?}",
            wilson(81, 263)
        );
        assert!(
            close(wilson(15, 148), (0.0624, 0.1605)),
            "{:?}",
            wilson(15, 148)
        );
        assert!(close(wilson(0, 20), (0.0, 0.1611)), "{:?}", wilson(0, 20));
        assert_eq!(interval95(&[1.0, 0.0, 1.0, 1.0]), wilson(3, 4));
        assert_eq!(bootstrap95(&[0.0; 5]), (0.0, 0.0));
    }

    #[test]
    fn bootstrap_interval_brackets_the_mean_and_narrows_with_n() {
        let small: Vec<f64> = (0..10).map(|i| i as f64 / 10.0 + 0.05).collect();
        let large: Vec<f64> = small.iter().cycle().take(1000).copied().collect();
        let (a, b) = interval95(&small);
        let (c, d) = interval95(&large);
        assert!(a < 0.5 && 0.5 < b && c < 0.5 && 0.5 < d);
        assert!(d - c < (b - a) / 5.0, "{a} {b} {c} {d}");
        // The normal approximation for n = 1000: 0.5 +- 1.96 * 0.2872 / sqrt(1000).
        assert!((d - c - 2.0 * Z95 * 0.28723 / 1000f64.sqrt()).abs() < 0.005);
    }

    #[test]
    fn two_way_interval_widens_with_the_spread_between_seeds() {
        // The same examples under seeds that agree, and under seeds that differ by a
        // constant: only the second interval carries the between-seed spread.
        let row: Vec<f64> = (0..40).map(|i| (i % 4) as f64 / 4.0).collect();
        let agree = vec![row.clone(); 5];
        let differ: Vec<Vec<f64>> = (0..5)
            .map(|s| row.iter().map(|x| x + 0.2 * s as f64).collect())
            .collect();
        let (a, b) = two_way_interval95(&agree);
        let (c, d) = two_way_interval95(&differ);
        assert!(a < 0.375 && 0.375 < b, "{a} {b}");
        assert!(c < 0.775 && 0.775 < d, "{c} {d}");
        assert!(d - c > 2.0 * (b - a), "{a} {b} {c} {d}");
        assert_eq!(two_way_interval95(&[vec![1.0, 0.0]]), wilson(1, 2));
    }

    #[test]
    fn sign_flip_is_the_exact_mcnemar_test_on_zero_one_scores() {
        // 9 discordant pairs all one way: p = 2 / 2^9.
        let mut d = vec![1.0; 9];
        d.extend([0.0; 11]);
        assert!((sign_flip_p(&d) - 2.0 / 512.0).abs() < 1e-12);
        // 8 against 1: P(X <= 1) + P(X >= 8) for Bin(9, 1/2) = 20 / 512.
        let mut d = vec![1.0; 8];
        d.push(-1.0);
        assert!((sign_flip_p(&d) - 20.0 / 512.0).abs() < 1e-12);
        assert_eq!(sign_flip_p(&[0.0, 0.0]), 1.0);
        assert_eq!(sign_flip_p(&[1.0, -1.0]), 1.0);
    }

    #[test]
    fn monte_carlo_sign_flip_agrees_with_the_binomial_tail() {
        // 30 discordant pairs, 22 one way: exact two-sided binomial p = 0.016124.
        let mut d = vec![1.0; 22];
        d.extend([-1.0; 8]);
        let p = sign_flip_p(&d);
        assert!((p - 0.016124).abs() < 0.003, "{p}");
    }
}
