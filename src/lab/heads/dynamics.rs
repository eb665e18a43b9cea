//! How dynamic are the retrieval heads? Statistics of a per-step [`Trace`] against a
//! static head set (the top-k of a dataset-aggregated ranking), after "Retrieval Heads are
//! Dynamic" (2026): per-step Jaccard with the static set, adjacent-step Jaccard, the
//! entropy of the head-activation distribution and its long tail.
//!
//! Conventions, all in one place:
//! - **Active set at a step.** Binary labels: the heads whose label is `>= 0.5`
//!   ([`ActiveRule`] is ignored). Continuous labels: [`ActiveRule`], by default the `k`
//!   highest-scoring heads with `k` = the static set's size; heads scoring `<= 0` are
//!   never active, so a step where fewer than `k` heads score above zero has a smaller set.
//! - **Empty sets.** Jaccard with the static set is taken over the steps whose active set
//!   is non-empty (the static set is never empty, so the union is never empty); the mean
//!   with empty steps counted as 0 is reported beside it. Adjacent-step pairs where both
//!   sets are empty are skipped (and counted): Jaccard(∅, ∅) is undefined, and calling it 1
//!   would reward steps where nothing retrieves. One empty, one not: 0.
//! - **Adjacent steps** are steps `s` and `s + 1` of the same prompt; steps of different
//!   prompts are never paired.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use plotters::prelude::{Color, SeriesLabelPosition, BLUE, RED};
use serde::Serialize;

use crate::lab::heads::trace::Trace;
use crate::lab::plot::{line_chart, Chart, Mark, Series};
use crate::probe::LabelKind;
use crate::{Error, Result};

/// How continuous labels become an active set at each step (binary labels ignore it).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ActiveRule {
    /// The `k` highest-scoring heads, `k` = the static set's size (the default, so the
    /// dynamic and static sets have the same size, as the paper compares them).
    #[default]
    TopStatic,
    /// The `k` highest-scoring heads.
    TopK(usize),
    /// Every head scoring at least this much.
    Threshold(f32),
}

/// Mean and order statistics of a sample; quantiles interpolate linearly between order
/// statistics (numpy's default).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    pub min: f64,
    pub q25: f64,
    pub median: f64,
    pub q75: f64,
    pub max: f64,
}

/// One head in the activation-frequency ranking.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeadFrequency {
    /// 1-based; most frequently active first, ties by (layer, head).
    pub rank: usize,
    pub layer: usize,
    pub head: usize,
    /// Steps at which the head is active.
    pub count: usize,
    /// `count / steps`.
    pub frequency: f64,
    /// Whether the head is in the static set.
    pub is_static: bool,
}

/// Dynamism statistics of one trace against one static head set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Dynamics {
    /// The active-set rule in words (`label >= 0.5`, `top-20 by score`, `score >= 0.3`).
    pub active_rule: String,
    pub label_kind: LabelKind,
    /// `n_layers * n_heads`.
    pub n_heads_total: usize,
    /// Size of the static set.
    pub k: usize,
    pub steps: usize,
    pub prompts: usize,
    /// Steps whose active set is empty.
    pub empty_steps: usize,
    /// Mean active-set size over all steps.
    pub mean_active_size: f64,
    /// Jaccard(step's active set, static set) over the steps with a non-empty active set.
    pub jaccard_static: Summary,
    /// The same mean with empty steps counted as 0.
    pub jaccard_static_mean_with_empty: f64,
    /// Mean Jaccard of steps `s` and `s + 1` of the same prompt, pairs of two empty sets
    /// skipped; `None` when no pair is left.
    pub adjacent_jaccard_mean: Option<f64>,
    /// Adjacent pairs averaged over.
    pub adjacent_pairs: usize,
    /// Adjacent pairs skipped because both sets are empty.
    pub adjacent_pairs_both_empty: usize,
    /// Shannon entropy of the activation distribution (each head's activation count over
    /// the total count of all heads), natural log.
    ///
    /// The paper's "entropy > 3.0" is most likely in nats: natural log is the default of
    /// `scipy.stats.entropy` and of torch's distributions, and `e^3 ≈ 20` makes 3.0 the
    /// entropy of a uniform spread over 20 heads, exactly the size of the static top-20 the
    /// paper contrasts the dynamic heads with ("activity spreads beyond the top-20"). In
    /// bits 3.0 would mean only 8 effective heads out of ~1000, hardly a long tail.
    pub entropy_nats: f64,
    /// The same entropy in bits (`entropy_nats / ln 2`).
    pub entropy_bits: f64,
    /// The largest possible entropy, `ln(n_heads_total)` (every head equally often).
    pub entropy_max_nats: f64,
    /// `exp(entropy_nats)`: the number of equally active heads with the same entropy.
    pub effective_heads: f64,
    /// Heads active at one step at least.
    pub distinct_active: usize,
    /// Every head, most frequently active first (the long-tail plot).
    pub frequency_by_rank: Vec<HeadFrequency>,
    /// Static heads among the `k` most frequently active heads.
    pub static_in_top_frequent: usize,
    /// Jaccard(static set, `k` most frequently active heads).
    pub jaccard_static_top_frequent: f64,
    /// 95% intervals of the mean Jaccard with the static set, the adjacent-step Jaccard
    /// and the entropy: prompts resampled with replacement (their steps together, since
    /// the steps of one prompt are not independent), 1,000 seeded rounds, 2.5th and 97.5th
    /// percentiles.
    pub intervals: DynamicsIntervals,
}

/// See [`Dynamics::intervals`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DynamicsIntervals {
    pub jaccard_static: [f64; 2],
    pub adjacent_jaccard: Option<[f64; 2]>,
    pub entropy_nats: [f64; 2],
}

/// Bootstrap rounds of [`Dynamics::intervals`].
const PROMPT_ROUNDS: usize = 1000;

/// What one prompt adds to the statistics.
#[derive(Default)]
struct PromptPart {
    with_static: Vec<f64>,
    adjacent: Vec<f64>,
    /// (head, activations)
    counts: Vec<(usize, usize)>,
}

/// [`Dynamics::intervals`] from each prompt's part.
fn prompt_intervals(parts: &[PromptPart], n_heads_total: usize) -> DynamicsIntervals {
    let mut rng = crate::rng::SplitMix64::new(parts.len() as u64, 0xD1_A4);
    let mut j = Vec::with_capacity(PROMPT_ROUNDS);
    let mut a = Vec::with_capacity(PROMPT_ROUNDS);
    let mut e = Vec::with_capacity(PROMPT_ROUNDS);
    let mut counts = vec![0usize; n_heads_total];
    for _ in 0..PROMPT_ROUNDS {
        let (mut js, mut jn, mut as_, mut an) = (0.0, 0usize, 0.0, 0usize);
        counts.iter_mut().for_each(|c| *c = 0);
        for _ in 0..parts.len() {
            let p = &parts[rng.below(parts.len())];
            js += p.with_static.iter().sum::<f64>();
            jn += p.with_static.len();
            as_ += p.adjacent.iter().sum::<f64>();
            an += p.adjacent.len();
            p.counts.iter().for_each(|&(h, c)| counts[h] += c);
        }
        if jn > 0 {
            j.push(js / jn as f64);
        }
        if an > 0 {
            a.push(as_ / an as f64);
        }
        e.push(entropy(&counts));
    }
    let ci = |v: &mut Vec<f64>| -> Option<[f64; 2]> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Some([at(0.025), at(0.975)])
    };
    DynamicsIntervals {
        jaccard_static: ci(&mut j).unwrap_or([f64::NAN; 2]),
        adjacent_jaccard: ci(&mut a),
        entropy_nats: ci(&mut e).unwrap_or([f64::NAN; 2]),
    }
}

/// Shannon entropy (nats) of the distribution `counts / sum`; 0 for no counts.
fn entropy(counts: &[usize]) -> f64 {
    let total: usize = counts.iter().sum();
    -counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total as f64;
            p * p.ln()
        })
        .sum::<f64>()
}

/// Check the trace's shapes and that no (prompt, step) repeats; returns the row of every
/// (prompt, step).
fn step_index(trace: &Trace) -> Result<HashMap<(usize, usize), usize>> {
    let rows = trace.labels.nrows();
    if rows == 0 {
        return Err(Error::invalid("trace", "no steps"));
    }
    let heads = trace.n_layers * trace.n_heads;
    if heads == 0 || trace.labels.ncols() != heads {
        return Err(Error::invalid(
            "trace",
            format!(
                "labels have {} columns for {} layers x {} heads",
                trace.labels.ncols(),
                trace.n_layers,
                trace.n_heads
            ),
        ));
    }
    if trace.features.nrows() != rows || trace.prompt.len() != rows || trace.step.len() != rows {
        return Err(Error::invalid(
            "trace",
            format!(
                "row counts disagree: labels {rows}, features {}, prompt {}, step {}",
                trace.features.nrows(),
                trace.prompt.len(),
                trace.step.len()
            ),
        ));
    }
    let mut index = HashMap::with_capacity(rows);
    for (row, (&p, &s)) in trace.prompt.iter().zip(&trace.step).enumerate() {
        if let Some(first) = index.insert((p, s), row) {
            return Err(Error::invalid(
                "trace",
                format!("rows {first} and {row} are both prompt {p} step {s}"),
            ));
        }
    }
    Ok(index)
}

/// Row pairs `(step s, step s + lag)` of the same prompt, in row order of the first; a
/// pair is formed only when both steps exist, so pairs never cross prompts. Also checks
/// the trace's shapes.
pub(crate) fn lag_pairs(trace: &Trace, lag: usize) -> Result<Vec<(usize, usize)>> {
    let index = step_index(trace)?;
    Ok((0..trace.prompt.len())
        .filter_map(|row| {
            let key = (trace.prompt[row], trace.step[row].checked_add(lag)?);
            index.get(&key).map(|&later| (row, later))
        })
        .collect())
}

/// Jaccard overlap `|a ∩ b| / |a ∪ b|`; `None` when both are empty.
fn jaccard(a: &BTreeSet<usize>, b: &BTreeSet<usize>) -> Option<f64> {
    let union = a.union(b).count();
    (union > 0).then(|| a.intersection(b).count() as f64 / union as f64)
}

/// Mean and quantiles of a non-empty sample.
fn summary(values: &[f64]) -> Summary {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let q = |p: f64| {
        let pos = p * (v.len() - 1) as f64;
        let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
        v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
    };
    Summary {
        n: v.len(),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        min: v[0],
        q25: q(0.25),
        median: q(0.5),
        q75: q(0.75),
        max: v[v.len() - 1],
    }
}

/// The active set (head columns) of every step, and the rule in words.
fn active_sets(
    trace: &Trace,
    k: usize,
    rule: ActiveRule,
) -> Result<(Vec<BTreeSet<usize>>, String)> {
    if let Some((i, _)) = trace
        .labels
        .iter()
        .enumerate()
        .find(|(_, x)| !x.is_finite())
    {
        let cols = trace.labels.ncols();
        return Err(Error::invalid(
            "trace",
            format!(
                "label at row {}, column {} is not finite",
                i / cols,
                i % cols
            ),
        ));
    }
    let rows = trace.labels.rows().into_iter();
    match (trace.label_kind, rule) {
        (LabelKind::Binary, _) => Ok((
            rows.map(|r| (0..r.len()).filter(|&c| r[c] >= 0.5).collect())
                .collect(),
            "label >= 0.5".into(),
        )),
        (LabelKind::Continuous, ActiveRule::Threshold(t)) => {
            if !t.is_finite() {
                return Err(Error::invalid("active rule", "threshold is not finite"));
            }
            Ok((
                rows.map(|r| (0..r.len()).filter(|&c| r[c] >= t).collect())
                    .collect(),
                format!("score >= {t}"),
            ))
        }
        (LabelKind::Continuous, ActiveRule::TopStatic | ActiveRule::TopK(_)) => {
            let k = if let ActiveRule::TopK(n) = rule { n } else { k };
            let sets = rows
                .map(|r| {
                    let mut cols: Vec<usize> = (0..r.len()).filter(|&c| r[c] > 0.0).collect();
                    cols.sort_by(|&a, &b| r[b].total_cmp(&r[a]).then(a.cmp(&b)));
                    cols.into_iter().take(k).collect()
                })
                .collect();
            Ok((sets, format!("top-{k} by score (score > 0)")))
        }
    }
}

/// Dynamism statistics of `trace` against `static_heads` ((layer, head) pairs, typically
/// a ranking's top-20), reading active sets by the module's conventions.
///
/// Errors: a malformed or empty trace, non-finite labels, an empty static set, a static
/// head outside the model or listed twice, no head active at any step.
pub fn dynamics(
    trace: &Trace,
    static_heads: &[(usize, usize)],
    rule: ActiveRule,
) -> Result<Dynamics> {
    step_index(trace)?;
    if static_heads.is_empty() {
        return Err(Error::invalid("static heads", "empty"));
    }
    let mut static_set = BTreeSet::new();
    for &(layer, head) in static_heads {
        Error::check_head(layer, head, trace.n_layers, trace.n_heads)?;
        if !static_set.insert(layer * trace.n_heads + head) {
            return Err(Error::invalid(
                "static heads",
                format!("({layer}, {head}) listed twice"),
            ));
        }
    }
    let k = static_set.len();
    let (sets, active_rule) = active_sets(trace, k, rule)?;
    let steps = sets.len();
    let n_heads_total = trace.labels.ncols();

    let mut counts = vec![0usize; n_heads_total];
    sets.iter().flatten().for_each(|&c| counts[c] += 1);
    let total: usize = counts.iter().sum();
    if total == 0 {
        return Err(Error::invalid(
            "trace",
            format!("no head is active at any step under `{active_rule}`"),
        ));
    }

    let with_static: Vec<f64> = sets
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| jaccard(s, &static_set))
        .collect();
    let empty_steps = steps - with_static.len();

    let mut adjacent = Vec::new();
    let mut both_empty = 0;
    // The same numbers per prompt, for the intervals.
    let mut parts: BTreeMap<usize, PromptPart> = BTreeMap::new();
    for (row, set) in sets.iter().enumerate() {
        let part = parts.entry(trace.prompt[row]).or_default();
        if !set.is_empty() {
            part.with_static.extend(jaccard(set, &static_set));
        }
        part.counts.extend(set.iter().map(|&h| (h, 1)));
    }
    for (a, b) in lag_pairs(trace, 1)? {
        match jaccard(&sets[a], &sets[b]) {
            Some(j) => {
                adjacent.push(j);
                parts.entry(trace.prompt[a]).or_default().adjacent.push(j);
            }
            None => both_empty += 1,
        }
    }
    let parts: Vec<PromptPart> = parts.into_values().collect();
    let entropy_nats = entropy(&counts);

    let mut order: Vec<usize> = (0..n_heads_total).collect();
    order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
    let frequency_by_rank: Vec<HeadFrequency> = order
        .iter()
        .enumerate()
        .map(|(i, &c)| HeadFrequency {
            rank: i + 1,
            layer: c / trace.n_heads,
            head: c % trace.n_heads,
            count: counts[c],
            frequency: counts[c] as f64 / steps as f64,
            is_static: static_set.contains(&c),
        })
        .collect();
    let top_frequent: BTreeSet<usize> = order.iter().take(k).copied().collect();

    Ok(Dynamics {
        active_rule,
        label_kind: trace.label_kind,
        n_heads_total,
        k,
        steps,
        prompts: trace.prompt.iter().collect::<BTreeSet<_>>().len(),
        empty_steps,
        mean_active_size: total as f64 / steps as f64,
        jaccard_static: summary(&with_static),
        jaccard_static_mean_with_empty: with_static.iter().sum::<f64>() / steps as f64,
        adjacent_jaccard_mean: (!adjacent.is_empty())
            .then(|| adjacent.iter().sum::<f64>() / adjacent.len() as f64),
        adjacent_pairs: adjacent.len(),
        adjacent_pairs_both_empty: both_empty,
        entropy_nats,
        entropy_bits: entropy_nats / std::f64::consts::LN_2,
        entropy_max_nats: (n_heads_total as f64).ln(),
        effective_heads: entropy_nats.exp(),
        distinct_active: counts.iter().filter(|&&c| c > 0).count(),
        frequency_by_rank,
        static_in_top_frequent: top_frequent.intersection(&static_set).count(),
        jaccard_static_top_frequent: jaccard(&top_frequent, &static_set).unwrap_or(0.0),
        intervals: prompt_intervals(&parts, n_heads_total),
    })
}

impl Dynamics {
    /// A Markdown table of the statistics beside the paper's numbers (Llama 3.1/3.2, Qwen,
    /// Phi; static set = top-20 Wu heads).
    pub fn to_markdown(&self) -> String {
        let j = &self.jaccard_static;
        let iv = &self.intervals;
        let bracket = |c: [f64; 2]| format!("[{:.3}, {:.3}]", c[0], c[1]);
        let adjacent = match self.adjacent_jaccard_mean {
            Some(m) => format!(
                "{m:.3} {} ({} pairs; {} both-empty pairs skipped)",
                iv.adjacent_jaccard.map_or(String::new(), bracket),
                self.adjacent_pairs,
                self.adjacent_pairs_both_empty
            ),
            None => "n/a (no adjacent pair with an active head)".into(),
        };
        let mut md = format!(
            "Active set: {}; {} steps over {} prompts; static set k = {} of {} heads. In \
             square brackets: 95% intervals from resampling prompts (1,000 rounds).\n\n\
             | statistic | this trace | paper |\n|---|---|---|\n",
            self.active_rule, self.steps, self.prompts, self.k, self.n_heads_total
        );
        let rows = [
            (
                format!("Jaccard(step set, static top-{}), non-empty steps", self.k),
                format!(
                    "{:.3} {} (median {:.3}, min {:.3}, max {:.3}; {} steps)",
                    j.mean,
                    bracket(iv.jaccard_static),
                    j.median,
                    j.min,
                    j.max,
                    j.n
                ),
                "0.18-0.46 (static top-20)",
            ),
            (
                "same, empty steps counted as 0".into(),
                format!("{:.3}", self.jaccard_static_mean_with_empty),
                "-",
            ),
            ("adjacent-step Jaccard".into(), adjacent, "0.28-0.51"),
            (
                "activation entropy".into(),
                format!(
                    "{:.3} nats {} = {:.3} bits (max {:.3} nats; {:.1} effective heads)",
                    self.entropy_nats,
                    bracket(iv.entropy_nats),
                    self.entropy_bits,
                    self.entropy_max_nats,
                    self.effective_heads
                ),
                "> 3.0 (most likely nats)",
            ),
            (
                "distinct heads ever active".into(),
                format!(
                    "{} of {} (k = {})",
                    self.distinct_active, self.n_heads_total, self.k
                ),
                "long tail",
            ),
            (
                "steps with no active head".into(),
                format!("{} of {}", self.empty_steps, self.steps),
                "-",
            ),
            (
                "mean active-set size".into(),
                format!("{:.2}", self.mean_active_size),
                "-",
            ),
            (
                format!("static set among the {} most active heads", self.k),
                format!(
                    "{} of {} (Jaccard {:.3})",
                    self.static_in_top_frequent, self.k, self.jaccard_static_top_frequent
                ),
                "-",
            ),
        ];
        for (name, ours, paper) in rows {
            md.push_str(&format!("| {name} | {ours} | {paper} |\n"));
        }
        md
    }
}

/// The long-tail plot as SVG: each head's activation frequency (fraction of steps active)
/// by frequency rank, log y, the static heads marked. Heads never active cannot sit on a
/// log axis and are left out; the caption counts them.
pub fn long_tail_svg(d: &Dynamics, title: &str) -> Result<String> {
    let shown: Vec<&HeadFrequency> = d.frequency_by_rank.iter().filter(|h| h.count > 0).collect();
    if shown.is_empty() {
        return Err(Error::invalid("long-tail plot", "no head is ever active"));
    }
    let never = d.frequency_by_rank.len() - shown.len();
    let static_never = d
        .frequency_by_rank
        .iter()
        .filter(|h| h.count == 0 && h.is_static)
        .count();
    // whole decades (the bottom one just inside), so the log axis has labelled ticks;
    // frequencies are at most 1
    let y_max = 10f64
        .powf((shown[0].frequency * 1.0001).log10().ceil())
        .min(1.2);
    let y_min = 0.99 * 10f64.powf((shown[shown.len() - 1].frequency * 0.9999).log10().floor());
    let caption = format!("{title} ({never} heads never active, {static_never} of them static)");
    let chart = Chart {
        title: &caption,
        title_size: 15,
        x_label: "head rank by activation frequency",
        y_label: "fraction of steps active (log)",
        x_range: 0..shown.len() + 1,
        y_range: y_min..y_max,
        log_y: true,
        x_ticks: None,
        legend: SeriesLabelPosition::UpperRight,
        size: (720, 420),
    };
    let point = |h: &&HeadFrequency| (h.rank, h.frequency);
    let series = [
        Series {
            name: "all heads".into(),
            points: shown.iter().map(point).collect(),
            color: BLUE.to_rgba(),
            mark: Mark::Line { width: 1, dot: 2 },
            bars: Vec::new(),
        },
        Series {
            name: format!("static top-{}", d.k),
            points: shown.iter().filter(|h| h.is_static).map(point).collect(),
            color: RED.to_rgba(),
            mark: Mark::Ring { radius: 5 },
            bars: Vec::new(),
        },
    ];
    line_chart(&chart, &series)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    /// A binary trace of one layer x 4 heads from per-step active sets.
    fn binary_trace(steps: &[(usize, usize, &[usize])]) -> Trace {
        let mut labels = Array2::zeros((steps.len(), 4));
        for (row, (_, _, heads)) in steps.iter().enumerate() {
            for &h in *heads {
                labels[[row, h]] = 1.0;
            }
        }
        Trace {
            label_kind: LabelKind::Binary,
            n_layers: 1,
            n_heads: 4,
            features: Array2::zeros((steps.len(), 2)),
            labels,
            prompt: steps.iter().map(|s| s.0).collect(),
            step: steps.iter().map(|s| s.1).collect(),
        }
    }

    #[test]
    fn intervals_resample_whole_prompts() {
        // Prompts of two kinds: steps {0,1} (Jaccard 1 with the static set) or {2,3}
        // (Jaccard 0), two steps each. Prompts of one kind only: the interval is that
        // point; both kinds: it brackets the mean 1/2 and stays inside [0, 1].
        let same: Vec<(usize, usize, &[usize])> = (0..6)
            .flat_map(|p| [(p, 0, &[0usize, 1][..]), (p, 1, &[0, 1][..])])
            .collect();
        let d = dynamics(
            &binary_trace(&same),
            &[(0, 0), (0, 1)],
            ActiveRule::default(),
        )
        .unwrap();
        assert_eq!(d.intervals.jaccard_static, [1.0, 1.0]);
        assert_eq!(d.intervals.adjacent_jaccard, Some([1.0, 1.0]));
        let ln2 = 2f64.ln();
        assert!((d.intervals.entropy_nats[0] - ln2).abs() < 1e-12);
        let mixed: Vec<(usize, usize, &[usize])> = (0..20)
            .flat_map(|p| {
                let heads: &[usize] = if p % 2 == 0 { &[0, 1] } else { &[2, 3] };
                [(p, 0, heads), (p, 1, heads)]
            })
            .collect();
        let d = dynamics(
            &binary_trace(&mixed),
            &[(0, 0), (0, 1)],
            ActiveRule::default(),
        )
        .unwrap();
        let [lo, hi] = d.intervals.jaccard_static;
        assert!(0.0 < lo && lo < 0.5 && 0.5 < hi && hi < 1.0, "{lo} {hi}");
        // Whole prompts move together: per-step resampling would give a narrower
        // interval (40 steps instead of 20 prompts); this one is at least as wide as the
        // binomial spread of 20 prompts, +-1.96 * 0.5 / sqrt(20) = +-0.22, give or take.
        assert!(hi - lo > 0.3, "{lo} {hi}");
        assert!(d.intervals.entropy_nats[1] <= 4f64.ln() + 1e-12);
    }

    #[test]
    fn jaccard_entropy_and_ranks_on_hand_computed_sets() {
        // prompt 0: {0,1}, {1,2}, {}; prompt 1: {3}, {0,1}; static {0,1}
        let t = binary_trace(&[
            (0, 0, &[0, 1]),
            (0, 1, &[1, 2]),
            (0, 2, &[]),
            (1, 0, &[3]),
            (1, 1, &[0, 1]),
        ]);
        let d = dynamics(&t, &[(0, 0), (0, 1)], ActiveRule::default()).unwrap();
        assert_eq!((d.steps, d.prompts, d.empty_steps, d.k), (5, 2, 1, 2));
        // with static: 1, 1/3, 0, 1 over the 4 non-empty steps
        assert!((d.jaccard_static.mean - 7.0 / 12.0).abs() < 1e-12);
        assert!((d.jaccard_static_mean_with_empty - 7.0 / 15.0).abs() < 1e-12);
        assert_eq!(d.jaccard_static.min, 0.0);
        assert_eq!(d.jaccard_static.max, 1.0);
        // sorted 0, 1/3, 1, 1: median (1/3 + 1) / 2
        assert!((d.jaccard_static.median - 2.0 / 3.0).abs() < 1e-12);
        // adjacent: {0,1}-{1,2} = 1/3, {1,2}-{} = 0, {3}-{0,1} = 0
        assert_eq!((d.adjacent_pairs, d.adjacent_pairs_both_empty), (3, 0));
        assert!((d.adjacent_jaccard_mean.unwrap() - 1.0 / 9.0).abs() < 1e-12);
        // counts 2, 3, 1, 1 of 7
        let h = -[2.0, 3.0, 1.0, 1.0]
            .iter()
            .map(|c: &f64| c / 7.0 * (c / 7.0).ln())
            .sum::<f64>();
        assert!((d.entropy_nats - h).abs() < 1e-12);
        assert!(
            (d.entropy_nats - 1.277034).abs() < 1e-6,
            "{}",
            d.entropy_nats
        );
        assert!(
            (d.entropy_bits - 1.842371).abs() < 1e-6,
            "{}",
            d.entropy_bits
        );
        assert!((d.entropy_max_nats - 4f64.ln()).abs() < 1e-12);
        assert_eq!(d.distinct_active, 4);
        assert!((d.mean_active_size - 7.0 / 5.0).abs() < 1e-12);
        let ranked: Vec<(usize, usize)> = d
            .frequency_by_rank
            .iter()
            .map(|h| (h.head, h.count))
            .collect();
        assert_eq!(ranked, vec![(1, 3), (0, 2), (2, 1), (3, 1)]);
        assert!((d.frequency_by_rank[0].frequency - 0.6).abs() < 1e-12);
        assert_eq!(
            (d.static_in_top_frequent, d.jaccard_static_top_frequent),
            (2, 1.0)
        );
        let md = d.to_markdown();
        assert!(md.contains("| adjacent-step Jaccard | 0.111"), "{md}");
        assert!(md.contains("0.18-0.46"));
        let svg = long_tail_svg(&d, "tiny").unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("static top-2"),
            "{svg}"
        );
    }

    #[test]
    fn adjacent_pairs_never_cross_prompts() {
        // identical sets at the end of prompt 0 and the start of prompt 1: pairing them
        // would add a Jaccard of 1; a gap in the steps (2 -> 4) is no pair either
        let t = binary_trace(&[
            (0, 0, &[2]),
            (0, 1, &[0, 1]),
            (1, 0, &[0, 1]),
            (1, 1, &[3]),
            (1, 2, &[]),
            (1, 4, &[]),
        ]);
        let d = dynamics(&t, &[(0, 0)], ActiveRule::default()).unwrap();
        // pairs: {2}-{0,1} = 0, {0,1}-{3} = 0, {3}-{} = 0
        assert_eq!((d.adjacent_pairs, d.adjacent_pairs_both_empty), (3, 0));
        assert_eq!(d.adjacent_jaccard_mean, Some(0.0));
        let pairs = lag_pairs(&t, 1).unwrap();
        assert_eq!(pairs, vec![(0, 1), (2, 3), (3, 4)]);
        assert!(pairs.iter().all(|&(a, b)| t.prompt[a] == t.prompt[b]));
        // two empty neighbours are skipped, not scored
        let t = binary_trace(&[(0, 0, &[1]), (0, 1, &[]), (0, 2, &[])]);
        let d = dynamics(&t, &[(0, 1)], ActiveRule::default()).unwrap();
        assert_eq!((d.adjacent_pairs, d.adjacent_pairs_both_empty), (1, 1));
        // single-step prompts have no pairs at all
        let t = binary_trace(&[(0, 0, &[1]), (1, 0, &[1])]);
        let d = dynamics(&t, &[(0, 1)], ActiveRule::default()).unwrap();
        assert_eq!(d.adjacent_jaccard_mean, None);
    }

    #[test]
    fn continuous_rules_take_top_k_or_threshold() {
        let mut t = binary_trace(&[(0, 0, &[]), (0, 1, &[])]);
        t.label_kind = LabelKind::Continuous;
        t.labels = ndarray::array![[0.9, 0.1, 0.5, 0.0], [0.2, 0.2, 0.0, 0.7]];
        let sets = |rule| active_sets(&t, 2, rule).unwrap().0;
        let s = |v: &[usize]| v.iter().copied().collect::<BTreeSet<usize>>();
        assert_eq!(sets(ActiveRule::TopStatic), vec![s(&[0, 2]), s(&[3, 0])]);
        // zero scores are never active, even when k asks for more
        assert_eq!(
            sets(ActiveRule::TopK(4)),
            vec![s(&[0, 1, 2]), s(&[0, 1, 3])]
        );
        assert_eq!(sets(ActiveRule::Threshold(0.5)), vec![s(&[0, 2]), s(&[3])]);
        let d = dynamics(&t, &[(0, 0), (0, 2)], ActiveRule::TopStatic).unwrap();
        assert_eq!(d.active_rule, "top-2 by score (score > 0)");
        assert!((d.jaccard_static.mean - (1.0 + 1.0 / 3.0) / 2.0).abs() < 1e-12);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let t = binary_trace(&[(0, 0, &[1]), (0, 1, &[0])]);
        let e = |r: Result<Dynamics>| r.unwrap_err().to_string();
        assert!(e(dynamics(&t, &[], ActiveRule::default())).contains("empty"));
        assert!(e(dynamics(&t, &[(1, 0)], ActiveRule::default())).contains("does not exist"));
        assert!(e(dynamics(&t, &[(0, 4)], ActiveRule::default())).contains("does not exist"));
        assert!(e(dynamics(&t, &[(0, 1), (0, 1)], ActiveRule::default())).contains("twice"));
        let mut bad = t.clone();
        bad.labels[[1, 2]] = f32::NAN;
        assert!(e(dynamics(&bad, &[(0, 1)], ActiveRule::default())).contains("row 1, column 2"));
        let mut bad = t.clone();
        bad.step[1] = 0;
        assert!(e(dynamics(&bad, &[(0, 1)], ActiveRule::default())).contains("both prompt 0"));
        let mut bad = t.clone();
        bad.prompt.pop();
        assert!(e(dynamics(&bad, &[(0, 1)], ActiveRule::default())).contains("disagree"));
        let empty = binary_trace(&[]);
        assert!(e(dynamics(&empty, &[(0, 1)], ActiveRule::default())).contains("no steps"));
        let silent = binary_trace(&[(0, 0, &[]), (0, 1, &[])]);
        assert!(e(dynamics(&silent, &[(0, 1)], ActiveRule::default())).contains("no head"));
        let mut cont = t.clone();
        cont.label_kind = LabelKind::Continuous;
        let r = dynamics(&cont, &[(0, 1)], ActiveRule::Threshold(f32::NAN));
        assert!(e(r).contains("threshold"));
    }
}
