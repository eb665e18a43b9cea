//! The kvpress-leaderboard view of a KV-budget sweep: per context length, each policy's
//! mean score over every task, against `full` on the same examples, at the compression
//! ratio it reached (`1 - resident KV bytes / full's`), and the plot of score against
//! compression ratio with one line per series.

use std::collections::BTreeMap;

use plotters::style::{Color, Palette, Palette99};

use crate::lab::plot::{line_chart, Chart, Mark, Series};
use crate::lab::stats::mean_se;
use crate::Result;

/// One answer: its score (the task's first metric) and the memory it kept.
#[derive(Debug, Clone)]
pub(crate) struct Scored {
    pub task: String,
    pub example: String,
    pub context: usize,
    pub policy: String,
    pub score: f64,
    /// Resident hot KV bytes over `full`'s on the same example.
    pub kv_fraction: f64,
    pub kv_hot: usize,
    pub prefill_peak: usize,
}

/// A policy at one context length, over the examples `full` also answered.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    pub policy: String,
    pub series: String,
    pub context: usize,
    pub n: usize,
    pub score: f64,
    /// `full`'s mean on the same examples.
    pub full_score: f64,
    /// Mean per-example score minus `full`'s, and the half-width of its 95% interval
    /// (1.96 standard errors of the paired differences).
    pub diff: (f64, f64),
    /// `1 - mean kv_fraction`.
    pub ratio: f64,
    pub kv_hot: f64,
    pub prefill_peak: f64,
}

/// The rows of every context length, policies in `order` (`(name, series)`), each
/// paired with `full` by (task, example).
pub(crate) fn rows(scored: &[Scored], order: &[(String, String)], full: &str) -> Vec<Row> {
    let full_scores: BTreeMap<(&str, &str), f64> = scored
        .iter()
        .filter(|s| s.policy == full)
        .map(|s| ((s.task.as_str(), s.example.as_str()), s.score))
        .collect();
    let mut contexts: Vec<usize> = scored.iter().map(|s| s.context).collect();
    contexts.sort_unstable();
    contexts.dedup();
    let mut out = Vec::new();
    for context in contexts {
        for (policy, series) in order {
            let paired: Vec<(&Scored, f64)> = scored
                .iter()
                .filter(|s| s.context == context && &s.policy == policy)
                .filter_map(|s| {
                    let f = full_scores.get(&(s.task.as_str(), s.example.as_str()))?;
                    Some((s, *f))
                })
                .collect();
            if paired.is_empty() {
                continue;
            }
            let n = paired.len();
            let mean =
                |f: &dyn Fn(&(&Scored, f64)) -> f64| paired.iter().map(f).sum::<f64>() / n as f64;
            let diffs: Vec<f64> = paired.iter().map(|(s, f)| s.score - f).collect();
            let (d, se) = mean_se(&diffs);
            out.push(Row {
                policy: policy.clone(),
                series: series.clone(),
                context,
                n,
                score: mean(&|(s, _)| s.score),
                full_score: mean(&|(_, f)| *f),
                diff: (d, 1.96 * se),
                ratio: 1.0 - mean(&|(s, _)| s.kv_fraction),
                kv_hot: mean(&|(s, _)| s.kv_hot as f64),
                prefill_peak: mean(&|(s, _)| s.prefill_peak as f64),
            });
        }
    }
    out
}

/// Rows whose compression ratios differ by at most this much hold the same memory.
const SAME_RATIO: f64 = 0.005;

/// Two policies of different series at the same compression ratio and context length:
/// the first's mean score minus the second's on the examples both answered, and the
/// half-width of its 95% interval (1.96 standard errors of the paired differences).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Pair {
    pub first: String,
    pub second: String,
    pub ratio: f64,
    pub n: usize,
    pub diff: (f64, f64),
}

/// Every pair of `rows` (one context length) from different series whose compression
/// ratios agree within [`SAME_RATIO`], in row order, paired by (task, example).
pub(crate) fn pairs(scored: &[Scored], rows: &[Row]) -> Vec<Pair> {
    let score_of = |policy: &str, context: usize| -> BTreeMap<(&str, &str), f64> {
        scored
            .iter()
            .filter(|s| s.policy == policy && s.context == context)
            .map(|s| ((s.task.as_str(), s.example.as_str()), s.score))
            .collect()
    };
    let mut out = Vec::new();
    for (i, a) in rows.iter().enumerate() {
        for b in &rows[i + 1..] {
            if a.series == b.series || (a.ratio - b.ratio).abs() > SAME_RATIO {
                continue;
            }
            let (sa, sb) = (
                score_of(&a.policy, a.context),
                score_of(&b.policy, b.context),
            );
            let diffs: Vec<f64> = sa
                .iter()
                .filter_map(|(k, x)| sb.get(k).map(|y| x - y))
                .collect();
            if diffs.is_empty() {
                continue;
            }
            let (d, se) = mean_se(&diffs);
            out.push(Pair {
                first: a.policy.clone(),
                second: b.policy.clone(),
                ratio: (a.ratio + b.ratio) / 2.0,
                n: diffs.len(),
                diff: (d, 1.96 * se),
            });
        }
    }
    out
}

/// A difference and the half-width of its interval as `+d (+lo to +hi)`.
fn interval((d, half): (f64, f64)) -> String {
    format!("{d:+.3} ({:+.3} to {:+.3})", d - half, d + half)
}

/// [`pairs`] as a Markdown table.
pub(crate) fn pairs_table(pairs: &[Pair]) -> String {
    let mut md = String::from(
        "| policy | against | compression ratio | score difference (95% CI) | n |\n\
         |---|---|---:|---:|---:|\n",
    );
    for p in pairs {
        md.push_str(&format!(
            "| {} | {} | {:.3} | {} | {} |\n",
            p.first,
            p.second,
            p.ratio,
            interval(p.diff),
            p.n
        ));
    }
    md
}

/// The rows of one context length as a Markdown table.
pub(crate) fn table(rows: &[Row]) -> String {
    let mut md = String::from(
        "| policy | compression ratio | score | full on the same | score − full (95% CI) | score / full | KV hot MiB | prefill peak MiB | n |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let relative = if r.full_score > 0.0 {
            format!("{:.2}", r.score / r.full_score)
        } else {
            "-".into()
        };
        md.push_str(&format!(
            "| {} | {:.3} | {:.3} | {:.3} | {} | {relative} | {:.2} | {:.2} | {} |\n",
            r.policy,
            r.ratio,
            r.score,
            r.full_score,
            interval(r.diff),
            r.kv_hot / 1048576.0,
            r.prefill_peak / 1048576.0,
            r.n
        ));
    }
    md
}

/// Score against compression ratio for one context length, a line per series (its
/// points in ratio order).
pub(crate) fn plot(rows: &[Row], title: &str) -> Result<String> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        match series.iter_mut().find(|(name, _)| *name == r.series) {
            Some((_, points)) => points.push((r.ratio, r.score)),
            None => series.push((r.series.clone(), vec![(r.ratio, r.score)])),
        }
    }
    let lines: Vec<Series<f64>> = series
        .into_iter()
        .enumerate()
        .map(|(i, (name, mut points))| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series {
                name,
                points,
                color: Palette99::pick(i).to_rgba(),
                mark: Mark::Line { width: 2, dot: 4 },
                bars: Vec::new(),
            }
        })
        .collect();
    let y_max = rows.iter().map(|r| r.score).fold(0.1, f64::max);
    let chart = Chart {
        title,
        title_size: 16,
        x_label: "compression ratio (1 - resident KV bytes / full's)",
        y_label: "mean score over tasks",
        x_range: 0.0..1.0,
        y_range: 0.0..(y_max * 1.15).min(1.05),
        log_y: false,
        x_ticks: None,
        legend: plotters::chart::SeriesLabelPosition::UpperRight,
        size: (720, 460),
    };
    line_chart(&chart, &lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(task: &str, example: &str, policy: &str, score: f64, kv_fraction: f64) -> Scored {
        Scored {
            task: task.into(),
            example: example.into(),
            context: 1024,
            policy: policy.into(),
            score,
            kv_fraction,
            kv_hot: 100,
            prefill_peak: 200,
        }
    }

    #[test]
    fn policies_at_the_same_ratio_are_compared_on_the_examples_both_answered() {
        let scored = vec![
            s("a", "e1", "full", 1.0, 1.0),
            s("a", "e2", "full", 1.0, 1.0),
            s("a", "e3", "full", 1.0, 1.0),
            s("a", "e1", "snap", 0.0, 0.5),
            s("a", "e2", "snap", 1.0, 0.5),
            s("a", "e3", "snap", 0.0, 0.5),
            s("a", "e1", "zip", 1.0, 0.5),
            s("a", "e2", "zip", 1.0, 0.5),
            // e3 not answered by zip: left out of the pair
            s("a", "e1", "half", 1.0, 0.25),
            s("a", "e2", "half", 1.0, 0.25),
        ];
        let order = [
            ("full", "full"),
            ("snap", "snapkv"),
            ("zip", "kvzip"),
            ("half", "other"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()));
        let board = rows(&scored, &order, "full");
        let got = pairs(&scored, &board);
        // Only snap and zip hold the same memory (ratio 0.5); full (0) and half (0.75) differ.
        assert_eq!(got.len(), 1);
        let p = &got[0];
        assert_eq!(
            (p.first.as_str(), p.second.as_str(), p.n),
            ("snap", "zip", 2)
        );
        // differences -1 and 0: mean -0.5, sd 0.707, se 0.5
        assert!((p.diff.0 + 0.5).abs() < 1e-12);
        assert!((p.diff.1 - 1.96 * 0.5).abs() < 1e-12);
        assert!((p.ratio - 0.5).abs() < 1e-12);
        assert!(pairs_table(&got).contains("| snap | zip | 0.500 | -0.500"));
    }

    #[test]
    fn rows_pair_each_policy_with_full_on_the_same_examples() {
        let scored = vec![
            s("a", "e1", "full", 1.0, 1.0),
            s("a", "e2", "full", 0.0, 1.0),
            s("b", "e1", "full", 1.0, 1.0),
            s("a", "e1", "press", 0.0, 0.25),
            s("a", "e2", "press", 1.0, 0.25),
            s("b", "e1", "press", 1.0, 0.75),
            // an example full did not answer is left out
            s("b", "e9", "press", 1.0, 0.5),
        ];
        let order = [("full", "full"), ("press", "p")].map(|(a, b)| (a.to_string(), b.to_string()));
        let rows = rows(&scored, &order, "full");
        assert_eq!(rows.len(), 2);
        let press = &rows[1];
        assert_eq!(press.n, 3);
        assert!((press.score - 2.0 / 3.0).abs() < 1e-12);
        assert!((press.full_score - 2.0 / 3.0).abs() < 1e-12);
        // differences -1, +1, 0: mean 0, sd 1, se 1/sqrt(3)
        assert!(press.diff.0.abs() < 1e-12);
        assert!((press.diff.1 - 1.96 / 3f64.sqrt()).abs() < 1e-12);
        // mean kv fraction (0.25 + 0.25 + 0.75) / 3
        assert!((press.ratio - (1.0 - 1.25 / 3.0)).abs() < 1e-12);
        let md = table(&rows);
        assert!(
            md.contains("| press | 0.583 | 0.667 | 0.667 | +0.000 (-1.132 to +1.132) | 1.00 |"),
            "{md}"
        );
        assert!(plot(&rows, "test").unwrap().contains("<svg"));
    }
}
