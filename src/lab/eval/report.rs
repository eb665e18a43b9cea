//! Reports of a run: `summary.json` (flat records, [`crate::results::ResultRecord`]), a
//! Markdown README with tables per task and metric, and SVG plots of each metric against
//! k (and against k as a share of all heads), one line per head selection.
//!
//! Everything is computed from the record lines alone (all shards merged), so a resumed
//! or sharded run summarises exactly like an uninterrupted one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use plotters::prelude::{Color, Palette, Palette99, SeriesLabelPosition};

use crate::lab::eval::run::{read_all_records, read_json, ExampleRecord, RunInfo, BASELINE};
use crate::lab::eval::spec::TaskSource;
use crate::lab::plot::{self, line_chart, Chart, Mark};
use crate::lab::stats::{bootstrap95, format_p, interval95, sign_flip_p, two_way_interval95};
use crate::provenance::machine;
use crate::results::{write_atomic, write_experiment, ResultRecord, SCHEMA_VERSION};
use crate::{Error, Result};

/// Group key of a summary number.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Group {
    task: String,
    context_tokens: Option<usize>,
    selection: String,
    seed: Option<u64>,
    k: usize,
}

/// The summary of the records in `dir`, in the flat record format.
pub fn summarize(info: &RunInfo, records: &[ExampleRecord]) -> Vec<ResultRecord> {
    // Controls: only items the unablated model answered correctly count.
    let dropped: BTreeSet<(&str, &str)> = records
        .iter()
        .filter(|r| r.kept == Some(false))
        .map(|r| (r.task.as_str(), r.example.as_str()))
        .collect();
    let random: BTreeSet<&str> = info
        .spec
        .selections
        .iter()
        .filter(|s| s.random_seeds.is_some())
        .map(|s| s.name.as_str())
        .collect();
    let mut groups: BTreeMap<Group, Vec<&ExampleRecord>> = BTreeMap::new();
    for r in records {
        if dropped.contains(&(r.task.as_str(), r.example.as_str())) {
            continue;
        }
        let by_length = matches!(
            TaskSource::parse(&r.task),
            Ok(TaskSource::Needle(_) | TaskSource::Babilong(_))
        );
        let lengths = if by_length {
            vec![None, Some(r.context_tokens)]
        } else {
            vec![None]
        };
        let seeds = if random.contains(r.selection.as_str()) {
            vec![None, r.seed]
        } else {
            vec![r.seed]
        };
        for &context_tokens in &lengths {
            for &seed in &seeds {
                groups
                    .entry(Group {
                        task: r.task.clone(),
                        context_tokens,
                        selection: r.selection.clone(),
                        seed,
                        k: r.k,
                    })
                    .or_default()
                    .push(r);
            }
        }
    }
    let record = |g: &Group, metric: &str, value: f64, n: usize| ResultRecord {
        schema_version: SCHEMA_VERSION,
        experiment: info.spec.name.clone(),
        model: info.model.clone(),
        model_sha256: info.model_sha256.clone(),
        task: Some(g.task.clone()),
        context_tokens: g.context_tokens,
        selection: Some(g.selection.clone()),
        k: Some(g.k),
        seed: g.seed,
        mode: Some(info.spec.mode.name().to_string()),
        policy: Some("full".into()),
        metric: metric.to_string(),
        value,
        n,
        ci95: None,
        p_value: None,
        made: info.made.clone(),
    };
    let mut out = Vec::new();
    for (g, rs) in &groups {
        let pooled = g.seed.is_none() && random.contains(g.selection.as_str());
        for m in &info.spec.metrics {
            let vals: Vec<f64> = rs
                .iter()
                .filter_map(|r| r.scores.get(m.name()))
                .copied()
                .collect();
            if !vals.is_empty() {
                let ci = if pooled {
                    seeds_by_examples(rs, m.name())
                        .map_or_else(|| interval95(&vals), |v| two_way_interval95(&v))
                } else {
                    interval95(&vals)
                };
                let mut rec = record(g, m.name(), mean(&vals), vals.len());
                rec.ci95 = Some([ci.0, ci.1]);
                out.push(rec);
            }
        }
    }
    out.extend(comparisons(info, records, &dropped, &random, &record));
    // Controls: the pool and the share the unablated model got right.
    let mut pools: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for r in records.iter().filter(|r| r.selection == BASELINE) {
        if let Some(kept) = r.kept {
            let e = pools.entry(r.task.as_str()).or_default();
            e.0 += 1;
            e.1 += usize::from(kept);
        }
    }
    for (task, (pool, kept)) in pools {
        let g = Group {
            task: task.to_string(),
            context_tokens: None,
            selection: BASELINE.into(),
            seed: None,
            k: 0,
        };
        out.push(record(&g, "pool_size", pool as f64, pool));
        out.push(record(&g, "kept_fraction", kept as f64 / pool as f64, pool));
    }
    out
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// A pooled random cell's scores as one row per seed over the examples every seed
/// answered (in one order), for [`two_way_interval95`]; `None` with fewer than two
/// seeds or no common example.
fn seeds_by_examples(rs: &[&ExampleRecord], metric: &str) -> Option<Vec<Vec<f64>>> {
    let mut by_seed: BTreeMap<Option<u64>, BTreeMap<(&str, usize), f64>> = BTreeMap::new();
    for r in rs {
        if let Some(v) = r.scores.get(metric) {
            by_seed
                .entry(r.seed)
                .or_default()
                .insert((r.example.as_str(), r.context_tokens), *v);
        }
    }
    let first = by_seed.values().next()?;
    let common: Vec<(&str, usize)> = first
        .keys()
        .filter(|e| by_seed.values().all(|m| m.contains_key(*e)))
        .copied()
        .collect();
    if by_seed.len() < 2 || common.is_empty() {
        return None;
    }
    Some(
        by_seed
            .values()
            .map(|m| common.iter().map(|e| m[e]).collect())
            .collect(),
    )
}

/// Per (task, length or all, k), the first metric of every pair of selections on the
/// examples both answered: the mean difference with a 95% bootstrap interval and the
/// paired sign-flip test's p-value (exact McNemar for 0/1 scores). A random selection
/// counts as its per-example mean over its seeds, so its test is conditional on the
/// head sets drawn. Records: selection `"A - B"`, metric `<metric>_diff`.
fn comparisons(
    info: &RunInfo,
    records: &[ExampleRecord],
    dropped: &BTreeSet<(&str, &str)>,
    random: &BTreeSet<&str>,
    record: &dyn Fn(&Group, &str, f64, usize) -> ResultRecord,
) -> Vec<ResultRecord> {
    let Some(metric) = info.spec.metrics.first().map(|m| m.name()) else {
        return Vec::new();
    };
    // (task, k, selection) -> (example, length) -> scores over seeds
    type Cell<'a> = BTreeMap<(&'a str, usize), Vec<f64>>;
    let mut cells: BTreeMap<(&str, usize, &str), Cell> = BTreeMap::new();
    for r in records {
        if r.selection == BASELINE || dropped.contains(&(r.task.as_str(), r.example.as_str())) {
            continue;
        }
        if let Some(v) = r.scores.get(metric) {
            cells
                .entry((r.task.as_str(), r.k, r.selection.as_str()))
                .or_default()
                .entry((r.example.as_str(), r.context_tokens))
                .or_default()
                .push(*v);
        }
    }
    let mut out = Vec::new();
    for ((task, k, a), ea) in &cells {
        for ((task_b, k_b, b), eb) in cells.range((*task, *k, "")..) {
            if (task_b, k_b) != (task, k) || b <= a {
                continue;
            }
            // The non-random selection first, so that differences read "ranking - random".
            let (a, b, ea, eb) = if random.contains(a) && !random.contains(b) {
                (b, a, eb, ea)
            } else {
                (a, b, ea, eb)
            };
            let pairs: Vec<(usize, f64)> = ea
                .iter()
                .filter_map(|(e, va)| Some((e.1, mean(va) - mean(eb.get(e)?))))
                .collect();
            let mut lengths: Vec<Option<usize>> = vec![None];
            if matches!(
                TaskSource::parse(task),
                Ok(TaskSource::Needle(_) | TaskSource::Babilong(_))
            ) {
                let mut l: Vec<usize> = pairs.iter().map(|p| p.0).collect();
                l.sort_unstable();
                l.dedup();
                if l.len() > 1 {
                    lengths.extend(l.into_iter().map(Some));
                }
            }
            for len in lengths {
                let d: Vec<f64> = pairs
                    .iter()
                    .filter(|p| len.is_none_or(|l| p.0 == l))
                    .map(|p| p.1)
                    .collect();
                if d.is_empty() {
                    continue;
                }
                let g = Group {
                    task: task.to_string(),
                    context_tokens: len,
                    selection: format!("{a} - {b}"),
                    seed: None,
                    k: *k,
                };
                let ci = bootstrap95(&d);
                let mut rec = record(&g, &format!("{metric}_diff"), mean(&d), d.len());
                rec.ci95 = Some([ci.0, ci.1]);
                rec.p_value = Some(sign_flip_p(&d));
                out.push(rec);
            }
        }
    }
    out
}

/// Write `summary.json`, `README.md` and the plots for the run in `dir`.
pub fn write_report(dir: &Path) -> Result<Vec<ResultRecord>> {
    let info: RunInfo = read_json(&dir.join("run.json"))?;
    let records = read_all_records(dir)?;
    if records.is_empty() {
        return Err(Error::invalid(
            "report",
            format!("{}: no records yet", dir.display()),
        ));
    }
    let summary = summarize(&info, &records);
    let total_heads = info.n_layers * info.n_heads;
    let mut md = format!(
        "# {} on {}\n\nModel sha256 `{}`; {} layers x {} heads = {total_heads} heads. \
         Ablation mode **{}**. Each cell is a metric's mean over examples, its 95% \
         interval in square brackets (Wilson's for 0/1 scores, else a bootstrap over \
         examples; a pooled random row resamples its seeds and the examples both) and the \
         number of answers in parentheses; k = 0 is the unablated model.\n\n",
        info.spec.name,
        info.model,
        info.model_sha256,
        info.n_layers,
        info.n_heads,
        info.spec.mode.name()
    );
    md.push_str(&format!(
        "Produced by:\n\n```\n{}\n```\n\nSpec (`run.json` holds it in full): tasks {}; \
         k in {:?}; selections {}.\n\n",
        info.made.command,
        info.spec
            .tasks
            .iter()
            .map(|t| format!("`{}`", t.name))
            .collect::<Vec<_>>()
            .join(", "),
        info.spec.k,
        info.spec
            .selections
            .iter()
            .map(|s| format!("`{}`", s.name))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let secs: f64 = records.iter().map(|r| r.secs).sum();
    md.push_str(&format!(
        "Wall time: {:.0} s of generation for {} answers ({:.2} s each) on {}.\n\n",
        secs,
        records.len(),
        secs / records.len() as f64,
        machine()
    ));
    let tasks: Vec<String> = info.spec.tasks.iter().map(|t| t.name.clone()).collect();
    for task in &tasks {
        let of_task: Vec<&ResultRecord> = summary
            .iter()
            .filter(|r| r.task.as_deref() == Some(task))
            .collect();
        if of_task.is_empty() {
            continue;
        }
        let task_secs: f64 = records
            .iter()
            .filter(|r| &r.task == task)
            .map(|r| r.secs)
            .sum();
        md.push_str(&format!("## {task}\n\n{task_secs:.0} s of generation.\n\n"));
        if let Some(pool) = of_task.iter().find(|r| r.metric == "kept_fraction") {
            md.push_str(&format!(
                "Pool of {} items; the unablated model answered {:.0}% correctly; only those \
                 are ablated, so k = 0 is 1.0 in accuracy by construction.\n\n",
                pool.n,
                100.0 * pool.value
            ));
        }
        for metric in info.spec.metrics.iter().map(|m| m.name()) {
            let rows: Vec<&ResultRecord> = of_task
                .iter()
                .copied()
                .filter(|r| r.metric == metric)
                .collect();
            md.push_str(&format!("### {task}: {metric}\n\n"));
            let lengths: BTreeSet<Option<usize>> = rows.iter().map(|r| r.context_tokens).collect();
            for len in &lengths {
                let cells: Vec<&ResultRecord> = rows
                    .iter()
                    .copied()
                    .filter(|r| r.context_tokens == *len)
                    .collect();
                if lengths.len() > 1 && len.is_none() {
                    md.push_str("All lengths:\n\n");
                } else if let Some(l) = len {
                    md.push_str(&format!("Context {l} tokens:\n\n"));
                }
                md.push_str(&table(&cells));
                md.push('\n');
            }
            let overall: Vec<&ResultRecord> = rows
                .iter()
                .copied()
                .filter(|r| r.context_tokens.is_none())
                .collect();
            let series = series(&overall);
            if series.iter().any(|(_, pts, _)| pts.len() > 2) {
                let title = format!(
                    "{task}: {metric} vs heads ablated ({})",
                    info.spec.mode.name()
                );
                let name = format!("{task}-{metric}");
                let svg = line_plot(&title, "k (heads ablated)", metric, &series)?;
                write_atomic(&dir.join(format!("{name}.svg")), svg.as_bytes())?;
                let frac: Vec<Series> = series
                    .iter()
                    .map(|(n, pts, bars)| {
                        let pts = pts
                            .iter()
                            .map(|&(k, v)| (100.0 * k / total_heads as f64, v))
                            .collect();
                        (n.clone(), pts, bars.clone())
                    })
                    .collect();
                let svg = line_plot(&title, "heads ablated, % of all heads", metric, &frac)?;
                write_atomic(&dir.join(format!("{name}-fraction.svg")), svg.as_bytes())?;
                md.push_str(&format!(
                    "![{name} vs k]({name}.svg) ![{name} vs share of heads]({name}-fraction.svg)\n\n"
                ));
            }
        }
    }
    let diffs: Vec<&ResultRecord> = summary.iter().filter(|r| r.p_value.is_some()).collect();
    if !diffs.is_empty() {
        md.push_str(&paired_section(&diffs));
    }
    write_experiment(dir, &md, &summary, &info.made)?;
    Ok(summary)
}

/// The paired comparisons ([`comparisons`]) as one table per task.
fn paired_section(diffs: &[&ResultRecord]) -> String {
    let mut md = String::from(
        "## Paired comparisons\n\nPer task and k, each pair of selections on the examples both \
         answered: the mean per-example difference of the first metric (first minus second) \
         with a 95% bootstrap interval, and the two-sided p-value of the paired sign-flip test \
         (exact McNemar for 0/1 scores; not corrected for the number of comparisons). A random \
         selection enters as each example's mean over its seeds, so its test holds the drawn \
         head sets fixed.\n\n",
    );
    let tasks: BTreeSet<&str> = diffs.iter().filter_map(|r| r.task.as_deref()).collect();
    for task in tasks {
        md.push_str(&format!(
            "### {task}\n\n| k | comparison | context | n | difference [95%] | p |\n|---:|---|---:|---:|---|---:|\n"
        ));
        for r in diffs.iter().filter(|r| r.task.as_deref() == Some(task)) {
            let [lo, hi] = r.ci95.unwrap_or([r.value, r.value]);
            md.push_str(&format!(
                "| {} | {} | {} | {} | {:+.3} [{lo:+.2}, {hi:+.2}] | {} |\n",
                r.k.unwrap_or(0),
                r.selection.as_deref().unwrap_or(""),
                r.context_tokens
                    .map_or("all".to_string(), |c| c.to_string()),
                r.n,
                r.value,
                format_p(r.p_value.unwrap_or(1.0))
            ));
        }
        md.push('\n');
    }
    md
}

/// A table row's cells: k -> the cell's record.
type Row<'a> = BTreeMap<usize, &'a ResultRecord>;

/// A plotted line: its name, its (x, y) points and each point's 95% interval.
type Series = (String, Vec<(f64, f64)>, Vec<(f64, f64)>);

/// A cell: `mean [low, high] (n)`, or `mean (n)` without an interval.
fn cell(r: &ResultRecord) -> String {
    match r.ci95 {
        Some([lo, hi]) => format!("{:.3} [{lo:.2}, {hi:.2}] ({})", r.value, r.n),
        None => format!("{:.3} ({})", r.value, r.n),
    }
}

/// A Markdown table: one row per selection (random seeds pooled, plus each seed), one
/// column per k.
fn table(cells: &[&ResultRecord]) -> String {
    let ks: BTreeSet<usize> = cells.iter().filter_map(|r| r.k).collect();
    let mut rows: BTreeMap<(String, Option<u64>), Row> = BTreeMap::new();
    let baseline = cells
        .iter()
        .copied()
        .find(|r| r.selection.as_deref() == Some(BASELINE));
    for r in cells
        .iter()
        .copied()
        .filter(|r| r.selection.as_deref() != Some(BASELINE))
    {
        rows.entry((r.selection.clone().unwrap_or_default(), r.seed))
            .or_default()
            .insert(r.k.unwrap_or(0), r);
    }
    let mut out = String::from("| selection |");
    for k in &ks {
        out.push_str(&format!(" k={k} |"));
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(ks.len()));
    out.push('\n');
    if rows.is_empty() {
        rows.insert((BASELINE.to_string(), None), BTreeMap::new());
    }
    for ((sel, seed), vals) in &rows {
        let name = match seed {
            Some(s) => format!("{sel} (seed {s})"),
            None => sel.clone(),
        };
        out.push_str(&format!("| {name} |"));
        for k in &ks {
            let v = if *k == 0 {
                baseline
            } else {
                vals.get(k).copied()
            };
            match v {
                Some(r) => out.push_str(&format!(" {} |", cell(r))),
                None => out.push_str(" - |"),
            }
        }
        out.push('\n');
    }
    out
}

/// One line per selection (random: pooled over seeds), each starting at the baseline,
/// with each point's interval.
fn series(rows: &[&ResultRecord]) -> Vec<Series> {
    let ci = |r: &ResultRecord| r.ci95.map_or((r.value, r.value), |[lo, hi]| (lo, hi));
    let baseline = rows
        .iter()
        .find(|r| r.selection.as_deref() == Some(BASELINE))
        .map(|r| (r.value, ci(r)));
    // selection -> (k, value, interval) per point
    type Point = (f64, f64, (f64, f64));
    let mut lines: BTreeMap<String, Vec<Point>> = BTreeMap::new();
    for r in rows {
        let sel = r.selection.clone().unwrap_or_default();
        if sel == BASELINE || r.seed.is_some() {
            continue;
        }
        lines
            .entry(sel)
            .or_default()
            .push((r.k.unwrap_or(0) as f64, r.value, ci(r)));
    }
    lines
        .into_iter()
        .map(|(name, mut pts)| {
            if let Some((b, bar)) = baseline {
                pts.push((0.0, b, bar));
            }
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let bars = pts.iter().map(|p| p.2).collect();
            (name, pts.iter().map(|p| (p.0, p.1)).collect(), bars)
        })
        .collect()
}

/// An SVG line chart, y in [0, 1].
pub fn line_plot(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Result<String> {
    let x_max = series
        .iter()
        .flat_map(|(_, p, _)| p.iter().map(|q| q.0))
        .fold(1.0, f64::max);
    let y_max = series
        .iter()
        .flat_map(|(_, p, bars)| p.iter().map(|q| q.1).chain(bars.iter().map(|b| b.1)))
        .fold(1.0, f64::max);
    let chart = Chart {
        title,
        title_size: 16,
        x_label,
        y_label,
        x_range: 0.0..x_max * 1.02,
        y_range: 0.0..y_max * 1.05,
        log_y: false,
        x_ticks: None,
        legend: SeriesLabelPosition::UpperRight,
        size: (640, 400),
    };
    let lines: Vec<plot::Series<f64>> = series
        .iter()
        .enumerate()
        .map(|(i, (name, points, bars))| plot::Series {
            name: name.clone(),
            points: points.clone(),
            color: Palette99::pick(i).to_rgba(),
            mark: Mark::Line { width: 2, dot: 3 },
            bars: bars.clone(),
        })
        .collect();
    line_chart(&chart, &lines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::eval::spec::EvalSpec;
    use crate::lab::stats::wilson;
    use crate::provenance::Made;

    fn info() -> RunInfo {
        let dir = std::env::temp_dir().join(format!("headwise-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("spec.toml");
        std::fs::write(
            &path,
            "name = \"t\"\nmodel = \"smollm2-135m\"\nmode = \"mean-output\"\nk = [0, 2]\n\
             metrics = [\"accuracy\"]\n[[task]]\nname = \"control_city\"\nlimit = 9\n\
             [[selection]]\nname = \"top\"\nranking = \"r.json\"\n\
             [[selection]]\nname = \"random\"\nrandom_seeds = [0, 1]\n",
        )
        .unwrap();
        let spec = EvalSpec::load(&path).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        RunInfo {
            schema_version: 1,
            spec,
            model: "m".into(),
            model_sha256: "00".into(),
            n_layers: 2,
            n_heads: 2,
            made: Made::now("fast"),
        }
    }

    fn rec(example: usize, selection: &str, seed: Option<u64>, k: usize, v: f64) -> ExampleRecord {
        ExampleRecord {
            task: "control_city".into(),
            example: format!("e{example}"),
            context_tokens: 0,
            selection: selection.into(),
            seed,
            k,
            mode: "mean-output".into(),
            prediction: String::new(),
            scores: [("accuracy".to_string(), v)].into(),
            kept: Some(true),
            secs: 0.0,
        }
    }

    #[test]
    fn cells_carry_intervals_and_pairs_are_tested_on_shared_examples() {
        // Nine examples: the top heads break all of them; random seed 0 breaks none and
        // seed 1 breaks the first three.
        let mut records = Vec::new();
        for e in 0..9 {
            records.push(rec(e, BASELINE, None, 0, 1.0));
            records.push(rec(e, "top", None, 2, 0.0));
            records.push(rec(e, "random", Some(0), 2, 1.0));
            records.push(rec(e, "random", Some(1), 2, if e < 3 { 0.0 } else { 1.0 }));
        }
        let summary = summarize(&info(), &records);
        let find = |sel: &str, metric: &str| {
            summary
                .iter()
                .find(|r| {
                    r.selection.as_deref() == Some(sel) && r.metric == metric && r.seed.is_none()
                })
                .unwrap()
        };
        let top = find("top", "accuracy");
        assert_eq!((top.value, top.n), (0.0, 9));
        let (lo, hi) = wilson(0, 9);
        assert_eq!(top.ci95, Some([lo, hi]));
        // The pooled random cell: 15 of 18, its interval from resampling seeds too, so
        // it must reach below seed 1's own mean (6/9).
        let random = find("random", "accuracy");
        assert!((random.value - 15.0 / 18.0).abs() < 1e-12);
        let [rlo, rhi] = random.ci95.unwrap();
        assert!(rlo < 6.0 / 9.0 && rhi == 1.0, "{rlo} {rhi}");
        // top - random, per example: -1 (examples 3-8) and -0.5 (examples 0-2); all nine
        // differences negative, so the exact sign-flip p is 2 / 2^9.
        let d = find("top - random", "accuracy_diff");
        assert_eq!(d.n, 9);
        assert!((d.value + 7.5 / 9.0).abs() < 1e-12);
        assert!((d.p_value.unwrap() - 2.0 / 512.0).abs() < 1e-12);
        let [dlo, dhi] = d.ci95.unwrap();
        assert!((-1.0..=-0.5).contains(&dlo) && dlo <= d.value && d.value <= dhi && dhi <= -0.5);
    }
}
