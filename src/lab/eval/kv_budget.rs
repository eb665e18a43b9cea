//! Accuracy against resident KV memory: every example answered under every policy of a
//! spec, with the bytes each policy kept and the decode speed it reached.
//!
//! ```toml
//! name = "kv-budget"
//! model = "smollm2-135m"
//! max_new = 12
//!
//! [[task]]
//! name = "niah"
//! lengths = [1024, 2048, 4096, 8000]
//! depths = [0.2, 0.5, 0.8]
//! seeds = [1]
//!
//! [speed]                      # decode tok/s: exactly `tokens` tokens at each length
//! lengths = [2048, 4096, 8000]
//! tokens = 32
//!
//! [[policy]]
//! name = "full"
//! series = "full"              # the line it belongs to in the plots
//! policy = { type = "full" }
//!
//! [[policy]]
//! name = "static-locos-9"
//! series = "static-locos"
//! policy = { type = "static_heads", prefill = "full_then_evict", heads = { ranking = "policies/rankings/{model}/locos-niah.json", select = { top_k = 9 } } }
//! ```
//!
//! Every `full_then_evict` policy shares one full prefill per example (the prompt's
//! representations are then identical across policies, and only what each head keeps
//! for decoding differs); presses told where the question starts share one prefill of
//! the context (the attention presses one run with the attention all of them read, the
//! key-only presses an unobserved one); `stream` policies prefill on their own. The `dynamic_oracle`
//! labels come from a full-cache run of the same example on the shared prefill.
//! `records.jsonl` gets one line per (example, policy), so a run resumes where it
//! stopped; `headwise eval report`-style output (`summary.json`, `README.md`, SVGs) is
//! written by [`write_report`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use figment::providers::{Format, Toml};
use figment::Figment;
use indicatif::ProgressBar;
use plotters::style::{Color, Palette, Palette99};
use serde::{Deserialize, Serialize};

use crate::lab::eval::datasets::ruler::RulerTask;
use crate::lab::eval::leaderboard::{self, Scored};
use crate::lab::eval::run::{
    append_jsonl, open_append, read_json, read_jsonl, to_json, AnswerText, Sources,
};
use crate::lab::eval::spec::TaskEntry;
use crate::lab::eval::Example;
use crate::lab::heads::trace::{record_steps, Effective, TraceConfig};
use crate::lab::plot::{line_chart, Chart, Mark, Series};
use crate::lab::tasks::Encoder;
use crate::metrics::Metric;
use crate::model::{GenerateOptions, Interventions, LoadedModel, ModelId};
use crate::policy::evict::Observe;
use crate::policy::{generate, prefill_need, DynamicSource, Plan, Policy, PrefillNeed, Prefilled};
use crate::probe::LabelKind;
use crate::provenance::Made;
use crate::results::{write_atomic, write_experiment, ResultRecord, SCHEMA_VERSION};
use crate::{Error, Result};

/// Version of `run.json` and of the record lines.
pub const BUDGET_SCHEMA_VERSION: u32 = 1;

/// A whole sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetSpec {
    pub name: String,
    /// A known model name or a GGUF path.
    pub model: String,
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// Tokens generated at most per answer (generation also stops at a newline).
    #[serde(default = "default_max_new")]
    pub max_new: usize,
    #[serde(rename = "task", default)]
    pub tasks: Vec<TaskEntry>,
    #[serde(default)]
    pub speed: Option<SpeedSpec>,
    #[serde(rename = "policy")]
    pub policies: Vec<NamedPolicy>,
}

fn default_max_new() -> usize {
    12
}

/// Decode speed at fixed lengths: one NIAH prompt per length, exactly `tokens` tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeedSpec {
    pub lengths: Vec<usize>,
    pub tokens: usize,
}

/// One policy of the sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedPolicy {
    /// Unique name in the records.
    pub name: String,
    /// The curve it belongs to (`static-locos`, `random`, ...).
    pub series: String,
    /// Checked when the spec is read.
    pub policy: Policy,
}

impl BudgetSpec {
    /// Read and check a spec file.
    pub fn load(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::invalid(
                "spec",
                format!("{}: no such file", path.display()),
            ));
        }
        let spec: BudgetSpec = Figment::from(Toml::file(path))
            .extract()
            .map_err(|e| Error::invalid("spec", crate::error::figment_message(&e)))?;
        spec.validate()
            .map_err(|e| Error::invalid("spec", format!("{}: {e}", path.display())))?;
        Ok(spec)
    }

    fn validate(&self) -> Result<()> {
        let mut names = BTreeSet::new();
        for p in &self.policies {
            if !names.insert(p.name.as_str()) {
                return Err(Error::invalid("policy", format!("`{}` twice", p.name)));
            }
        }
        if !self.policies.iter().any(|p| p.policy == Policy::full()) {
            return Err(Error::invalid(
                "policy",
                "the sweep needs a `full` policy (the reference for kv_fraction)",
            ));
        }
        if self.max_new == 0 || self.speed.as_ref().is_some_and(|s| s.tokens < 2) {
            return Err(Error::invalid("max_new", "at least 1 (speed: tokens >= 2)"));
        }
        if self.tasks.is_empty() && self.speed.is_none() {
            return Err(Error::invalid("task", "no task and no [speed] section"));
        }
        Ok(())
    }

    /// The data directory [default: `../shared/data`].
    pub fn data_dir(&self) -> PathBuf {
        self.data_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("../shared/data"))
    }
}

/// `run.json`: the spec and the model it ran on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetRun {
    pub schema_version: u32,
    pub spec: BudgetSpec,
    pub model: String,
    pub model_sha256: String,
    /// KV heads a policy can choose between (layers without their own window).
    pub candidate_kv_heads: usize,
    /// Numerics, build, command line and date of the latest run into the folder.
    #[serde(flatten)]
    pub made: Made,
}

/// One answer under one policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetRecord {
    /// The task, or `speed`.
    pub task: String,
    pub example: String,
    pub context_tokens: usize,
    pub policy: String,
    pub series: String,
    pub prediction: String,
    /// Metric name -> score.
    pub scores: BTreeMap<String, f64>,
    /// KV heads kept whole in the hot tier.
    pub full_kv_heads: usize,
    /// Resident KV bytes at the end, hot and cold.
    pub kv_hot: usize,
    pub kv_cold: usize,
    pub prefill_peak: usize,
    pub generated: usize,
    pub decode_tok_s: f64,
    /// Prompt tokens per second up to the first token (a shared prefill counts in full).
    #[serde(default)]
    pub prefill_tok_s: f64,
    pub mean_active_kv_heads: Option<f64>,
}

impl BudgetRecord {
    fn key(&self) -> (String, String, String) {
        (self.task.clone(), self.example.clone(), self.policy.clone())
    }
}

fn metrics_for(task: &str) -> Vec<Metric> {
    match (task, RulerTask::parse(task)) {
        (_, Some(ruler)) => vec![ruler.metric()],
        ("hotpotqa" | "musique", _) => vec![Metric::Em, Metric::F1],
        _ => vec![Metric::Accuracy],
    }
}

/// The examples of `spec`'s tasks for the model `lm`, at most `limit` per task (the
/// first ones), in the order a run answers them: `(task, example)`. Warnings about the
/// data go to stderr.
pub fn examples(
    spec: &BudgetSpec,
    lm: &LoadedModel,
    limit: Option<usize>,
) -> Result<Vec<(String, Example)>> {
    let enc = Encoder::from_model(lm);
    let data_dir = spec.data_dir();
    let mut sources = Sources::new(&data_dir);
    let mut warnings = Vec::new();
    let mut out = Vec::new();
    for entry in &spec.tasks {
        let mut examples = sources.examples(entry, &enc, &mut warnings)?;
        if let Some(n) = limit {
            examples.truncate(n);
        }
        out.extend(examples.into_iter().map(|e| (entry.name.clone(), e)));
    }
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    Ok(out)
}

/// One line of an examples export (`headwise eval kv-examples`): the task, the metric a
/// run scores it by, and the example (prompt ids, where the question starts, answers).
#[derive(Debug, Clone, Serialize)]
pub struct ExportedExample<'a> {
    pub task: &'a str,
    pub metric: &'static str,
    pub example: &'a Example,
}

/// Write `examples` to `path` as JSON lines, atomically: a first line with the model's
/// identity, the token ids that end an answer (`stop`), the most tokens an answer may
/// have (`max_new`) and `made`, then one [`ExportedExample`] per line.
pub fn write_examples(
    path: &Path,
    examples: &[(String, Example)],
    (id, stop, max_new): (&ModelId, &[u32], usize),
    made: &Made,
) -> Result<()> {
    let header = serde_json::json!({
        "schema_version": BUDGET_SCHEMA_VERSION,
        "kind": "kv-budget examples",
        "model": id.name,
        "model_sha256": id.sha256,
        "stop": stop,
        "max_new": max_new,
        "made": made,
    });
    let mut text = header.to_string();
    text.push('\n');
    for (task, example) in examples {
        let metric = metrics_for(task)
            .first()
            .map(|m| m.name())
            .ok_or_else(|| Error::invalid("task", format!("{task} has no metric")))?;
        let line = ExportedExample {
            task,
            metric,
            example,
        };
        text.push_str(
            &serde_json::to_string(&line).map_err(|e| Error::invalid("examples", e.to_string()))?,
        );
        text.push('\n');
    }
    write_atomic(path, text.as_bytes())
}

/// Run (or resume) a sweep into `out`; `limit` caps examples per task.
pub fn run(
    spec: &BudgetSpec,
    lm: &LoadedModel,
    id: &ModelId,
    out: &Path,
    limit: Option<usize>,
    made: &Made,
    bar: Option<&ProgressBar>,
) -> Result<usize> {
    let cfg = lm.model.config();
    // Resolve everything first: bad policies fail before any generation.
    let base = Path::new(".");
    let plans: Vec<(&NamedPolicy, Plan)> = spec
        .policies
        .iter()
        .map(|p| {
            Plan::resolve(&p.policy, cfg, id, base)
                .and_then(|plan| plan.with_text(lm))
                .map(|plan| (p, plan))
                .map_err(|e| Error::invalid("policy", format!("`{}`: {e}", p.name)))
        })
        .collect::<Result<_>>()?;
    // What a press that re-reads the context feeds the model (the same for every plan).
    let repeat = plans.iter().find_map(|(_, p)| p.repeat.as_deref());
    let mut info = BudgetRun {
        schema_version: BUDGET_SCHEMA_VERSION,
        spec: spec.clone(),
        model: id.name.clone(),
        model_sha256: id.sha256.clone(),
        candidate_kv_heads: plans[0].1.candidate_kv_heads(),
        made: made.clone(),
    };
    let run_json = out.join("run.json");
    if run_json.exists() {
        let old: BudgetRun = read_json(&run_json)?;
        if old.spec != info.spec || old.model_sha256 != info.model_sha256 {
            return Err(Error::invalid(
                "out",
                format!(
                    "{} holds a run of another spec or model; use another --out",
                    out.display()
                ),
            ));
        }
        if !old.made.resumable_by(made) {
            return Err(Error::invalid(
                "out",
                format!(
                    "{} holds a run made with {}; use another --out",
                    out.display(),
                    old.made.mismatch(made)
                ),
            ));
        }
        info.made = info.made.continuing(&old.made);
    }
    let enc = Encoder::from_model(lm);
    let data_dir = spec.data_dir();
    let mut sources = Sources::new(&data_dir);
    let mut warnings = Vec::new();
    let mut work: Vec<(String, Example, Option<usize>)> = examples(spec, lm, limit)?
        .into_iter()
        .map(|(task, e)| (task, e, None))
        .collect();
    if let Some(speed) = &spec.speed {
        let entry = TaskEntry {
            name: "niah".into(),
            lengths: speed.lengths.clone(),
            depths: vec![0.5],
            seeds: Some(crate::lab::eval::spec::Seeds::List(vec![999])),
            limit: None,
            k: None,
            selections: None,
        };
        for e in sources.examples(&entry, &enc, &mut warnings)? {
            work.push(("speed".into(), e, Some(speed.tokens)));
        }
    }
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    write_atomic(&run_json, &to_json(&info)?)?;
    let path = out.join("records.jsonl");
    let done: BTreeSet<(String, String, String)> = read_jsonl::<BudgetRecord>(&path)?
        .iter()
        .map(BudgetRecord::key)
        .collect();
    let mut file = open_append(&path)?;
    if let Some(bar) = bar {
        bar.set_length((work.len() * plans.len()) as u64);
    }
    let mut written = 0;
    for (task, ex, fixed) in &work {
        let todo: Vec<&(&NamedPolicy, Plan)> = plans
            .iter()
            .filter(|(p, _)| !done.contains(&(task.clone(), ex.id.clone(), p.name.clone())))
            .collect();
        if let Some(bar) = bar {
            // Answers of an earlier run: counted, and the time estimate restarted so
            // that it reflects only answers generated.
            if todo.len() < plans.len() {
                bar.inc((plans.len() - todo.len()) as u64);
                bar.reset_eta();
            }
            bar.set_message(format!("{task} {}", ex.id));
        }
        if todo.is_empty() {
            continue;
        }
        let max_new = fixed.unwrap_or(spec.max_new);
        let capacity = ex.prompt.len() + max_new;
        let opts = GenerateOptions {
            max_new,
            context_len: ex.question_start,
            stop: if fixed.is_some() {
                Vec::new()
            } else {
                lm.special.stop.clone()
            },
            ..GenerateOptions::default()
        };
        // One full prefill per prompt length the plans prefill (the whole prompt; the
        // context, for presses told where the question starts), observing the attention
        // their presses read. Policies that ablate heads prefill with their own edits.
        let need = |p: &Plan| -> Result<Option<PrefillNeed>> {
            Ok(prefill_need(p, ex.prompt.len(), &opts)?.filter(|_| p.edits.is_empty()))
        };
        // Keyed by (length, whether attention is observed, whether the context is re-read):
        // presses that read only keys get an unobserved prefill, which runs the fast path
        // and is timed alone, and KVzip's reconstruction is timed apart from the rest.
        let key = |n: &PrefillNeed| {
            let reconstructs = matches!(n.observe, Observe::Reconstruct { .. });
            (n.len, n.observe != Observe::Keys, reconstructs)
        };
        let mut needs: BTreeMap<(usize, bool, bool), Vec<Observe>> = BTreeMap::new();
        for (_, p) in &todo {
            if let Some(n) = need(p)? {
                needs.entry(key(&n)).or_default().push(n.observe);
            }
        }
        let shared: BTreeMap<(usize, bool, bool), Prefilled> = needs
            .iter()
            .map(|(&key, observes)| {
                let pre = &ex.prompt[..key.0];
                let edits = Interventions::new();
                Prefilled::observed(&lm.model, &edits, pre, capacity, observes, repeat)
                    .map(|p| (key, p))
            })
            .collect::<Result<_>>()?;
        let oracle = match (
            shared.get(&(ex.prompt.len(), false, false)),
            todo.iter()
                .any(|(p, _)| p.policy.name() == "dynamic_oracle"),
        ) {
            (Some(pre), true) => Some(oracle_labels(lm, ex, max_new, pre)?),
            _ => None,
        };
        for (named, plan) in todo {
            let t0 = Instant::now();
            let prefilled = need(plan)?.and_then(|n| shared.get(&key(&n)));
            let mut answer = AnswerText::for_task(lm, task);
            let labels = plan
                .dynamic
                .as_ref()
                .filter(|d| matches!(d.source, DynamicSource::Oracle))
                .and(oracle.as_deref());
            let g = generate(
                &lm.model,
                plan,
                &ex.prompt,
                &opts,
                prefilled,
                labels,
                &mut |tok, _, _| answer.push(tok) || fixed.is_some(),
            )?;
            let prediction = answer.finish()?;
            let scores = if fixed.is_some() {
                BTreeMap::new()
            } else {
                metrics_for(task)
                    .into_iter()
                    .map(|m| (m.name().to_string(), m.score(&ex.answers, &prediction)))
                    .collect()
            };
            let record = BudgetRecord {
                task: task.clone(),
                example: ex.id.clone(),
                context_tokens: ex.context_tokens,
                policy: named.name.clone(),
                series: named.series.clone(),
                prediction,
                scores,
                full_kv_heads: plan.full_kv_heads(),
                kv_hot: g.kv.end.hot,
                kv_cold: g.kv.end.cold,
                prefill_peak: g.kv.prefill_peak,
                generated: g.generation.tokens.len(),
                decode_tok_s: g.generation.decode_tok_s(),
                prefill_tok_s: g.generation.prefill_tok_s(),
                mean_active_kv_heads: g.kv.mean_active_kv_heads,
            };
            append_jsonl(&mut file, &path, &record)?;
            written += 1;
            if let Some(bar) = bar {
                bar.inc(1);
                bar.set_message(format!(
                    "{task} {} {} ({:.0}s)",
                    ex.id,
                    named.name,
                    t0.elapsed().as_secs_f64()
                ));
            }
        }
    }
    Ok(written)
}

/// Per-step retrieval labels (Wu's per-step test) of a greedy full-cache run from the
/// shared prefill: the oracle's head choice.
fn oracle_labels(
    lm: &LoadedModel,
    ex: &Example,
    max_new: usize,
    pre: &Prefilled,
) -> Result<Vec<Vec<f32>>> {
    let cfg = TraceConfig {
        label_kind: LabelKind::Binary,
        effective: Effective::default(),
        max_new,
        teacher: false,
    };
    let steps = record_steps(
        lm,
        ex,
        &cfg,
        None,
        &mut |_| Interventions::new(),
        pre.cache().clone(),
    )?;
    Ok(steps.labels)
}

/// A point of an accuracy plot: (series, kv_fraction, value).
type PlotPoint = (String, f64, f64);

/// Mean of `f` over records.
/// The length a record is grouped by: its context, or 0 for the datasets whose
/// examples keep their natural lengths.
fn context_of(r: &BudgetRecord) -> usize {
    if r.task == "hotpotqa" || r.task == "musique" {
        0
    } else {
        r.context_tokens
    }
}

fn mean(records: &[&BudgetRecord], f: impl Fn(&BudgetRecord) -> f64) -> f64 {
    records.iter().map(|r| f(r)).sum::<f64>() / records.len().max(1) as f64
}

/// `summary.json`, `README.md` and the plots of a sweep folder.
pub fn write_report(dir: &Path) -> Result<Vec<ResultRecord>> {
    let info: BudgetRun = read_json(&dir.join("run.json"))?;
    // The first record of each (task, example, policy) counts.
    let mut seen = BTreeSet::new();
    let records: Vec<BudgetRecord> = read_jsonl::<BudgetRecord>(&dir.join("records.jsonl"))?
        .into_iter()
        .filter(|r| seen.insert(r.key()))
        .collect();
    if records.is_empty() {
        return Err(Error::invalid(
            "report",
            format!("{}: no records", dir.display()),
        ));
    }
    // Full policy's hot bytes per example: the denominator of kv_fraction.
    let full_name = info
        .spec
        .policies
        .iter()
        .find(|p| p.policy == Policy::full())
        .map(|p| p.name.clone())
        .ok_or_else(|| Error::invalid("report", "run.json names no `full` policy"))?;
    let full_bytes: BTreeMap<(String, String), usize> = records
        .iter()
        .filter(|r| r.policy == full_name)
        .map(|r| ((r.task.clone(), r.example.clone()), r.kv_hot))
        .collect();
    let fraction = |r: &BudgetRecord| -> f64 {
        full_bytes
            .get(&(r.task.clone(), r.example.clone()))
            .map_or(f64::NAN, |&f| r.kv_hot as f64 / f as f64)
    };
    let order: Vec<&NamedPolicy> = info.spec.policies.iter().collect();
    // Group: (task, context) -> policy -> records.
    let mut groups: BTreeMap<(String, usize), BTreeMap<String, Vec<&BudgetRecord>>> =
        BTreeMap::new();
    for r in &records {
        groups
            .entry((r.task.clone(), context_of(r)))
            .or_default()
            .entry(r.policy.clone())
            .or_default()
            .push(r);
    }
    let mut summary = Vec::new();
    let mut readme = format!(
        "# KV budget: accuracy against resident KV memory ({})\n\n\
         Command: `{}`\n\nModel: {} (sha256 `{}`); {} KV heads a policy can choose between \
         (the others keep the model's own sliding window).\n\n\
         `kv_fraction` is the policy's resident hot KV bytes at the end of the answer over \
         the `full` policy's on the same example (counted from the allocations); `cold` is \
         the dynamic policies' compressed history, reported apart. Policies marked \
         `full_then_evict` share one full prefill per example, and token presses told where \
         the question starts one prefill of the context (one observed for the attention \
         presses, one not for the key-only ones); only what each head keeps for decoding \
         differs.\n\n",
        info.spec.name, info.made.command, info.model, info.model_sha256, info.candidate_kv_heads
    );
    let push = |summary: &mut Vec<ResultRecord>,
                task: &str,
                ctx: Option<usize>,
                p: &NamedPolicy,
                metric: &str,
                value: f64,
                n: usize| {
        summary.push(ResultRecord {
            schema_version: SCHEMA_VERSION,
            experiment: info.spec.name.clone(),
            model: info.model.clone(),
            model_sha256: info.model_sha256.clone(),
            task: Some(task.to_string()),
            context_tokens: ctx,
            selection: Some(p.series.clone()),
            k: None,
            seed: None,
            mode: None,
            policy: Some(p.name.clone()),
            metric: metric.to_string(),
            value,
            n,
            ci95: None,
            p_value: None,
            made: info.made.clone(),
        });
    };
    // The leaderboard view: every task's score at each length, against full.
    let scored: Vec<Scored> = records
        .iter()
        .filter(|r| r.task != "speed")
        .filter_map(|r| {
            let metric = metrics_for(&r.task).first()?.name();
            Some(Scored {
                task: r.task.clone(),
                example: r.example.clone(),
                context: context_of(r),
                policy: r.policy.clone(),
                score: r.scores.get(metric).copied().unwrap_or(0.0),
                kv_fraction: fraction(r),
                kv_hot: r.kv_hot,
                prefill_peak: r.prefill_peak,
            })
        })
        .collect();
    let names: Vec<(String, String)> = order
        .iter()
        .map(|p| (p.name.clone(), p.series.clone()))
        .collect();
    let board = leaderboard::rows(&scored, &names, &full_name);
    let mut contexts: Vec<usize> = board.iter().map(|r| r.context).collect();
    contexts.dedup();
    for ctx in contexts {
        let rows: Vec<leaderboard::Row> =
            board.iter().filter(|r| r.context == ctx).cloned().collect();
        let at = if ctx > 0 {
            format!("{ctx} tokens")
        } else {
            "natural lengths".into()
        };
        readme.push_str(&format!(
            "## Every task, {at}\n\nEach policy's mean score over every task's examples (the \
             task's first metric) on the examples `full` also answered, its difference from \
             `full` on the same examples with a 95% interval (1.96 standard errors of the \
             paired differences), and its compression ratio (1 - mean kv_fraction).\n\n{}\n",
            leaderboard::table(&rows)
        ));
        let same = leaderboard::pairs(&scored, &rows);
        if !same.is_empty() {
            readme.push_str(&format!(
                "Policies of different series that hold the same memory (compression ratios \
                 within 0.005), compared on the examples both answered: the first's score \
                 minus the second's, with a 95% interval of the paired differences.\n\n{}\n",
                leaderboard::pairs_table(&same)
            ));
        }
        let name = format!("leaderboard-{ctx}");
        let svg = leaderboard::plot(&rows, &format!("score against compression ratio, {at}"))?;
        write_atomic(&dir.join(format!("{name}.svg")), svg.as_bytes())?;
        readme.push_str(&format!("![{name}]({name}.svg)\n\n"));
        for r in &rows {
            let p = order
                .iter()
                .find(|p| p.name == r.policy)
                .ok_or(Error::Internal(
                    "leaderboard rows follow the spec's policies",
                ))?;
            let ctx_opt = (ctx > 0).then_some(ctx);
            push(&mut summary, "all", ctx_opt, p, "score", r.score, r.n);
            push(
                &mut summary,
                "all",
                ctx_opt,
                p,
                "score_minus_full",
                r.diff.0,
                r.n,
            );
            push(
                &mut summary,
                "all",
                ctx_opt,
                p,
                "compression_ratio",
                r.ratio,
                r.n,
            );
        }
    }
    let mut plots: BTreeMap<String, (String, Vec<PlotPoint>)> = BTreeMap::new();
    let mut speeds: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    // The full policy's decode speed per (task, context): the baseline of the ratios.
    let full_speed: BTreeMap<(String, usize), f64> = groups
        .iter()
        .filter_map(|(key, by)| {
            let timed: Vec<&BudgetRecord> = by
                .get(&full_name)?
                .iter()
                .copied()
                .filter(|r| r.generated >= 2)
                .collect();
            (!timed.is_empty()).then(|| (key.clone(), mean(&timed, |r| r.decode_tok_s)))
        })
        .collect();
    for ((task, ctx), by_policy) in &groups {
        let ctx_opt = (*ctx > 0).then_some(*ctx);
        let metric_names: Vec<&str> = if task == "speed" {
            vec![]
        } else {
            metrics_for(task).iter().map(|m| m.name()).collect()
        };
        readme.push_str(&format!(
            "## {task}{}\n\n| policy | kv_fraction | KV hot MiB | cold MiB |{} decode tok/s | n |\n|{}\n",
            ctx_opt.map(|c| format!(", {c} tokens")).unwrap_or_default(),
            metric_names.iter().map(|m| format!(" {m} |")).collect::<String>(),
            "---|".repeat(6 + metric_names.len()),
        ));
        for p in &order {
            let Some(rs) = by_policy.get(&p.name) else {
                continue;
            };
            let n = rs.len();
            let kvf = mean(rs, fraction);
            let hot = mean(rs, |r| r.kv_hot as f64);
            let cold = mean(rs, |r| r.kv_cold as f64);
            // Decode speed needs at least two tokens (answers that stop at once have none).
            let timed: Vec<&BudgetRecord> =
                rs.iter().copied().filter(|r| r.generated >= 2).collect();
            let speed = (!timed.is_empty()).then(|| mean(&timed, |r| r.decode_tok_s));
            push(&mut summary, task, ctx_opt, p, "kv_fraction", kvf, n);
            push(&mut summary, task, ctx_opt, p, "kv_bytes", hot, n);
            push(&mut summary, task, ctx_opt, p, "kv_cold_bytes", cold, n);
            if let Some(speed) = speed {
                push(
                    &mut summary,
                    task,
                    ctx_opt,
                    p,
                    "decode_tok_s",
                    speed,
                    timed.len(),
                );
                if task == "speed" {
                    speeds
                        .entry(p.name.clone())
                        .or_default()
                        .push((*ctx as f64, speed));
                    let prefill = mean(&timed, |r| r.prefill_tok_s);
                    push(
                        &mut summary,
                        task,
                        ctx_opt,
                        p,
                        "prefill_tok_s",
                        prefill,
                        timed.len(),
                    );
                }
            }
            let mut cells = String::new();
            for m in &metric_names {
                let v = mean(rs, |r| r.scores.get(*m).copied().unwrap_or(0.0));
                push(&mut summary, task, ctx_opt, p, m, v, n);
                cells.push_str(&format!(" {v:.2} |"));
                plots
                    .entry(format!(
                        "{task}-{m}{}",
                        ctx_opt.map(|c| format!("-{c}")).unwrap_or_default()
                    ))
                    .or_insert_with(|| (m.to_string(), Vec::new()))
                    .1
                    .push((p.series.clone(), kvf, v));
            }
            let speed = match (speed, full_speed.get(&(task.clone(), *ctx))) {
                (Some(s), Some(f)) if task == "speed" => format!("{s:.1} ({:.2}x)", s / f),
                (Some(s), _) => format!("{s:.1}"),
                (None, _) => "-".into(),
            };
            readme.push_str(&format!(
                "| {} | {kvf:.3} | {:.2} | {:.2} |{cells} {speed} | {n} |\n",
                p.name,
                hot / 1048576.0,
                cold / 1048576.0,
            ));
        }
        readme.push('\n');
    }
    for (name, (metric, points)) in &plots {
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for (s, x, y) in points {
            series.entry(s.clone()).or_default().push((*x, *y));
        }
        let lines: Vec<Series<f64>> = series
            .into_iter()
            .enumerate()
            .map(|(i, (name, mut pts))| {
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series {
                    name,
                    points: pts,
                    color: Palette99::pick(i).to_rgba(),
                    mark: Mark::Line { width: 2, dot: 4 },
                    bars: Vec::new(),
                }
            })
            .collect();
        let chart = Chart {
            title: name,
            title_size: 16,
            x_label: "resident KV bytes / full",
            y_label: metric,
            x_range: 0.0..1.05,
            y_range: 0.0..1.05,
            log_y: false,
            x_ticks: None,
            legend: plotters::chart::SeriesLabelPosition::LowerRight,
            size: (640, 400),
        };
        let svg = line_chart(&chart, &lines)?;
        write_atomic(&dir.join(format!("{name}.svg")), svg.as_bytes())?;
        readme.push_str(&format!("![{name}]({name}.svg)\n\n"));
    }
    if !speeds.is_empty() {
        let lines: Vec<Series<f64>> = order
            .iter()
            .filter_map(|p| speeds.get(&p.name).map(|pts| (p.name.clone(), pts.clone())))
            .enumerate()
            .map(|(i, (name, points))| Series {
                name,
                points,
                color: Palette99::pick(i).to_rgba(),
                mark: Mark::Line { width: 2, dot: 4 },
                bars: Vec::new(),
            })
            .collect();
        let x_max = lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.0))
            .fold(1.0, f64::max);
        let y_max = lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.1))
            .fold(1.0, f64::max);
        let chart = Chart {
            title: "decode speed against context",
            title_size: 16,
            x_label: "context tokens",
            y_label: "decode tokens/s",
            x_range: 0.0..x_max * 1.05,
            y_range: 0.0..y_max * 1.1,
            log_y: false,
            x_ticks: None,
            legend: plotters::chart::SeriesLabelPosition::UpperRight,
            size: (720, 480),
        };
        write_atomic(
            &dir.join("decode-speed.svg"),
            line_chart(&chart, &lines)?.as_bytes(),
        )?;
        readme.push_str("![decode speed](decode-speed.svg)\n\n");
    }
    write_experiment(dir, &readme, &summary, &info.made)?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<BudgetSpec> {
        let spec: BudgetSpec = Figment::from(Toml::string(text))
            .extract()
            .map_err(|e| Error::invalid("spec", e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    const FULL: &str =
        "[[policy]]\nname = \"full\"\nseries = \"full\"\npolicy = { type = \"full\" }\n";

    #[test]
    fn specs_need_a_full_policy_unique_names_and_work() {
        let task = "name = \"x\"\nmodel = \"m\"\n[[task]]\nname = \"niah\"\n";
        assert!(parse(&format!("{task}{FULL}")).is_ok());
        let err = parse(&format!(
            "{task}[[policy]]\nname = \"w\"\nseries = \"w\"\npolicy = {{ type = \"window\" }}\n"
        ))
        .unwrap_err();
        assert!(err.to_string().contains("full"), "{err}");
        let err = parse(&format!("{task}{FULL}{FULL}")).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
        let err = parse(&format!("name = \"x\"\nmodel = \"m\"\n{FULL}")).unwrap_err();
        assert!(err.to_string().contains("no task"), "{err}");
        let err = parse(&format!(
            "{task}{FULL}[[policy]]\nname = \"w\"\nseries = \"w\"\npolicy = {{ type = \"window\", window = 0 }}\n"
        ))
        .unwrap_err();
        assert!(err.to_string().contains("window"), "{err}");
    }
}
