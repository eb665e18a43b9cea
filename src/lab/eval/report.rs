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
        made: info.made.clone(),
    };
    let mut out = Vec::new();
    for (g, rs) in &groups {
        for m in &info.spec.metrics {
            let vals: Vec<f64> = rs
                .iter()
                .filter_map(|r| r.scores.get(m.name()))
                .copied()
                .collect();
            if !vals.is_empty() {
                out.push(record(g, m.name(), mean(&vals), vals.len()));
            }
        }
    }
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
         Ablation mode **{}**. Each cell is a metric's mean over examples with \
         the number of examples in brackets; k = 0 is the unablated model.\n\n",
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
            if series.iter().any(|(_, pts)| pts.len() > 2) {
                let title = format!(
                    "{task}: {metric} vs heads ablated ({})",
                    info.spec.mode.name()
                );
                let name = format!("{task}-{metric}");
                let svg = line_plot(&title, "k (heads ablated)", metric, &series)?;
                write_atomic(&dir.join(format!("{name}.svg")), svg.as_bytes())?;
                let frac: Vec<Series> = series
                    .iter()
                    .map(|(n, pts)| {
                        let pts = pts
                            .iter()
                            .map(|&(k, v)| (100.0 * k / total_heads as f64, v))
                            .collect();
                        (n.clone(), pts)
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
    write_experiment(dir, &md, &summary, &info.made)?;
    Ok(summary)
}

/// A table row's cells: k -> (value, n).
type Row = BTreeMap<usize, (f64, usize)>;

/// A plotted line: its name and its (x, y) points.
type Series = (String, Vec<(f64, f64)>);

/// A Markdown table: one row per selection (random seeds pooled, plus each seed), one
/// column per k.
fn table(cells: &[&ResultRecord]) -> String {
    let ks: BTreeSet<usize> = cells.iter().filter_map(|r| r.k).collect();
    let mut rows: BTreeMap<(String, Option<u64>), Row> = BTreeMap::new();
    let baseline = cells
        .iter()
        .find(|r| r.selection.as_deref() == Some(BASELINE));
    for r in cells
        .iter()
        .filter(|r| r.selection.as_deref() != Some(BASELINE))
    {
        rows.entry((r.selection.clone().unwrap_or_default(), r.seed))
            .or_default()
            .insert(r.k.unwrap_or(0), (r.value, r.n));
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
                baseline.map(|b| (b.value, b.n))
            } else {
                vals.get(k).copied()
            };
            match v {
                Some((v, n)) => out.push_str(&format!(" {v:.3} ({n}) |")),
                None => out.push_str(" - |"),
            }
        }
        out.push('\n');
    }
    out
}

/// One line per selection (random: pooled over seeds), each starting at the baseline.
fn series(rows: &[&ResultRecord]) -> Vec<Series> {
    let baseline = rows
        .iter()
        .find(|r| r.selection.as_deref() == Some(BASELINE))
        .map(|r| r.value);
    let mut lines: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in rows {
        let sel = r.selection.clone().unwrap_or_default();
        if sel == BASELINE || r.seed.is_some() {
            continue;
        }
        lines
            .entry(sel)
            .or_default()
            .push((r.k.unwrap_or(0) as f64, r.value));
    }
    lines
        .into_iter()
        .map(|(name, mut pts)| {
            if let Some(b) = baseline {
                pts.push((0.0, b));
            }
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (name, pts)
        })
        .collect()
}

/// An SVG line chart, y in [0, 1].
pub fn line_plot(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Result<String> {
    let x_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .fold(1.0, f64::max);
    let y_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
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
        .map(|(i, (name, points))| plot::Series {
            name: name.clone(),
            points: points.clone(),
            color: Palette99::pick(i).to_rgba(),
            mark: Mark::Line { width: 2, dot: 3 },
        })
        .collect();
    line_chart(&chart, &lines)
}
