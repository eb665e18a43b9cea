//! Running an experiment: build every example, resolve head selections and calibration
//! (all checks before any generation), then answer each example once unablated and once
//! per (selection, seed, k), appending one JSON line per answer so that an interrupted
//! run resumes where it stopped. Answers are generated in batches
//! ([`generate_batch`]): each prompt prefilled alone, their
//! decode steps run together, every answer's tokens those it gets alone.
//!
//! ## Files in the output folder
//!
//! - `run.json`: the spec, the model's identity and the provenance; a later run into the
//!   same folder must have the same spec (up to `--limit` and `--shard`) and numerics;
//! - `records.jsonl` (or `records.shard-{i}-of-{n}.jsonl`): one [`ExampleRecord`] a line;
//! - `calibration.json`: the calibration means (mean modes), reused on resume.
//!
//! ## Why no KV prefix is shared between settings
//!
//! Every ablation here acts from the first prompt token on (the head is silenced on the
//! whole sequence, as in the papers), so the keys and values of every layer above the
//! lowest ablated one differ between settings from position 0: there is no shared prefix
//! to reuse. What is shared is done once: tokenization, the unablated baseline (one run
//! per example, used by every selection) and the calibration means.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use crate::lab::eval::controls;
use crate::lab::eval::datasets::ruler::{self, RulerTask};
use crate::lab::eval::datasets::{babilong, hotpotqa, musique, Loaded};
use crate::lab::eval::spec::{EvalSpec, Seeds, TaskEntry, TaskSource};
use crate::lab::eval::Example;
use crate::lab::tasks::{self, Encoder, Haystack, TaskSpec};
use crate::metrics::Metric;
use crate::model::{generate_batch, GenerateOptions, Interventions, LoadedModel, ModelId};
use crate::policy::ablation::{Calibration, HeadSet};
use crate::policy::ranking::Ranking;
use crate::provenance::Made;
use crate::results::write_atomic;
use crate::{Error, Result};

/// Version of `run.json` and of the record lines.
pub const RUN_SCHEMA_VERSION: u32 = 1;

/// The selection name of the unablated baseline (k = 0).
pub const BASELINE: &str = "none";

/// Collects a generated answer: stops at a stop token or at the first newline after some
/// text; the answer is the first line, trimmed. A multi-line answer (a list) runs to a
/// stop token or the token limit, its lines joined by spaces.
pub(crate) struct AnswerText<'a> {
    lm: &'a LoadedModel,
    ids: Vec<u32>,
    text: String,
    failed: Option<Error>,
    multi_line: bool,
}

impl<'a> AnswerText<'a> {
    pub(crate) fn new(lm: &'a LoadedModel) -> Self {
        Self {
            lm,
            ids: Vec::new(),
            text: String::new(),
            failed: None,
            multi_line: false,
        }
    }

    /// The answer to an example of `task`: multi-line for RULER's list tasks (values,
    /// names, words), else the first line.
    pub(crate) fn for_task(lm: &'a LoadedModel, task: &str) -> Self {
        Self {
            multi_line: RulerTask::parse(task).is_some_and(RulerTask::lists),
            ..Self::new(lm)
        }
    }

    /// Take one generated token; `false` when generation should stop.
    pub(crate) fn push(&mut self, tok: u32) -> bool {
        if self.lm.special.stop.contains(&tok) {
            return false;
        }
        self.ids.push(tok);
        match self.lm.decode(&self.ids) {
            Ok(t) => self.text = t,
            Err(e) => {
                self.failed = Some(e);
                return false;
            }
        }
        self.multi_line || !self.text.trim_start().contains('\n')
    }

    /// The answer's first line (every line, joined by spaces, for a multi-line answer),
    /// trimmed.
    pub(crate) fn finish(self) -> Result<String> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if self.multi_line {
            return Ok(self.text.split_whitespace().collect::<Vec<_>>().join(" "));
        }
        Ok(self
            .text
            .trim_start()
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string())
    }
}

/// One answer: which example, which ablation, what came out, how it scored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExampleRecord {
    pub task: String,
    pub example: String,
    pub context_tokens: usize,
    /// The selection's name, or [`BASELINE`] for k = 0.
    pub selection: String,
    /// The random seed of a random selection.
    pub seed: Option<u64>,
    pub k: usize,
    /// The ablation mode (also recorded for k = 0, where it changes nothing).
    pub mode: String,
    /// The generated answer, up to the first newline, trimmed.
    pub prediction: String,
    /// Metric name -> value.
    pub scores: BTreeMap<String, f64>,
    /// Controls only: whether the unablated model answered correctly (only such items
    /// are ablated).
    pub kept: Option<bool>,
    /// Seconds this answer took: its share of its batch's wall time (answers generated
    /// together share their batch's time equally).
    pub secs: f64,
}

/// What identifies a record within a run.
type Key = (String, String, String, Option<u64>, usize);

impl ExampleRecord {
    fn key(&self) -> Key {
        (
            self.task.clone(),
            self.example.clone(),
            self.selection.clone(),
            self.seed,
            self.k,
        )
    }
}

/// `run.json`: what was run on which model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub schema_version: u32,
    pub spec: EvalSpec,
    pub model: String,
    pub model_sha256: String,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Numerics, build, command line and date of the latest run into this folder.
    #[serde(flatten)]
    pub made: Made,
}

/// Which part of the examples this process runs: example `i` of each task when
/// `i % count == index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// Everything.
    pub const ALL: Shard = Shard { index: 0, count: 1 };

    /// Parse `i/n` (0-based `i < n`).
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || Error::invalid("shard", format!("`{s}` (expected i/n with 0 <= i < n)"));
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (
            i.trim().parse().map_err(|_| bad())?,
            n.trim().parse().map_err(|_| bad())?,
        );
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Self { index, count })
    }

    fn records_file(&self) -> String {
        if self.count == 1 {
            "records.jsonl".into()
        } else {
            format!("records.shard-{}-of-{}.jsonl", self.index, self.count)
        }
    }
}

/// Options of one run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The output folder.
    pub out_dir: PathBuf,
    /// At most this many examples per task (the first ones).
    pub limit: Option<usize>,
    /// Which examples this process runs.
    pub shard: Shard,
    /// Answers generated at once (one batched decode step for all of them; the same
    /// tokens as one at a time).
    pub batch: usize,
    /// Provenance of the files the run writes (its numerics: the model's).
    pub made: Made,
}

/// One ablation setting: heads to silence under a name.
struct Setting {
    selection: String,
    seed: Option<u64>,
    k: usize,
    edits: Interventions,
}

/// A task's examples and the settings each of them runs.
struct TaskPlan {
    name: String,
    is_control: bool,
    examples: Vec<Example>,
    /// Indices into [`Runner::settings`] (the baseline excluded).
    settings: Vec<usize>,
}

/// One answer to generate: an example under one setting's edits.
struct Unit<'a> {
    ex: &'a Example,
    key: Key,
    edits: &'a Interventions,
}

/// Where a run's answers go: the records file, the counts, the progress bar.
struct Records<'b> {
    file: std::fs::File,
    path: PathBuf,
    stats: RunStats,
    bar: Option<&'b ProgressBar>,
}

impl Records<'_> {
    /// `n` more answers generated (a batch's, at once: the bar's time estimate then sees
    /// the batch's rate, not one answer per batch).
    fn tick(&self, n: usize) {
        if let Some(bar) = self.bar {
            bar.inc(n as u64);
        }
    }

    /// `n` answers accounted for without running (from an earlier run, or skipped): the
    /// time estimate restarts, so that it reflects only answers generated.
    fn skip(&self, n: usize) {
        if let (Some(bar), true) = (self.bar, n > 0) {
            bar.inc(n as u64);
            bar.reset_eta();
        }
    }
}

/// A prepared experiment: everything checked, examples built, edits resolved.
pub struct Runner<'a> {
    spec: EvalSpec,
    lm: &'a LoadedModel,
    info: RunInfo,
    opts: RunOptions,
    tasks: Vec<TaskPlan>,
    settings: Vec<Setting>,
    baseline: Interventions,
    /// Notes for the user: skipped dataset rows, reused files.
    pub warnings: Vec<String>,
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    /// Answers generated now.
    pub generated: usize,
    /// Answers found in the records from an earlier run.
    pub resumed: usize,
    /// Settings not run because a control item was answered wrongly unablated.
    pub filtered: usize,
    /// Seconds spent generating now.
    pub secs: f64,
}

impl<'a> Runner<'a> {
    /// Check the spec against the model, the rankings, the data and the output folder,
    /// build every example and the calibration means: every error a run can hit before
    /// it generates surfaces here.
    pub fn prepare(
        spec: EvalSpec,
        lm: &'a LoadedModel,
        id: &ModelId,
        opts: RunOptions,
    ) -> Result<Self> {
        spec.validate()?;
        if opts.batch == 0 {
            return Err(Error::invalid("batch", "0 (must be at least 1)"));
        }
        let cfg = lm.model.config();
        let n_total = cfg.n_layers * cfg.n_heads;
        let all_k = spec
            .k
            .iter()
            .chain(spec.tasks.iter().flat_map(|t| t.k.iter().flatten()));
        if let Some(k) = all_k.copied().find(|&k| k > n_total) {
            return Err(Error::invalid(
                "k",
                format!(
                    "{k} is more than {}'s {n_total} heads ({} layers x {})",
                    id.name, cfg.n_layers, cfg.n_heads
                ),
            ));
        }
        if spec.mode.needs_calibration() && spec.calibration.is_none() {
            return Err(Error::invalid(
                "calibration",
                format!(
                    "mode {} needs a [calibration] task (its means come from there)",
                    spec.mode.name()
                ),
            ));
        }
        let info = RunInfo {
            schema_version: RUN_SCHEMA_VERSION,
            spec: spec.clone(),
            model: id.name.clone(),
            model_sha256: id.sha256.clone(),
            n_layers: cfg.n_layers,
            n_heads: cfg.n_heads,
            made: opts.made.clone(),
        };
        let info = check_run_info(&opts.out_dir, info)?;
        let mut warnings = Vec::new();

        // Selections: rankings must be of this model.
        let mut rankings = BTreeMap::new();
        for s in &spec.selections {
            if let Some(path) = &s.ranking {
                let r = Ranking::load(path)?;
                if r.provenance.model_sha256 != id.sha256 {
                    return Err(Error::invalid(
                        "selection",
                        format!(
                            "`{}`: {} ranks {} (sha256 {}), not {} ({})",
                            s.name,
                            path.display(),
                            r.provenance.model,
                            r.provenance.model_sha256,
                            id.name,
                            id.sha256
                        ),
                    ));
                }
                r.check_model(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads)?;
                rankings.insert(s.name.clone(), r);
            }
        }

        // Examples (data problems surface here, before calibration and generation).
        let enc = Encoder::from_model(lm);
        let data_dir = spec.data_dir();
        let mut sources = Sources::new(&data_dir);
        let mut tasks = Vec::new();
        for entry in &spec.tasks {
            let mut examples = sources.examples(entry, &enc, &mut warnings)?;
            if let Some(n) = opts.limit {
                examples.truncate(n);
            }
            if examples.is_empty() {
                return Err(Error::invalid(
                    "task",
                    format!("{}: no example to run", entry.name),
                ));
            }
            tasks.push((entry, examples));
        }

        // Calibration (mean modes only), disjoint from every evaluation prompt.
        let calibration = match (&spec.calibration, spec.mode.needs_calibration()) {
            (Some(entry), true) => {
                let examples = sources.examples(entry, &enc, &mut warnings)?;
                let eval_prompts: BTreeSet<&[u32]> = tasks
                    .iter()
                    .flat_map(|(_, ex)| ex.iter().map(|e| e.prompt.as_slice()))
                    .collect();
                if let Some(e) = examples
                    .iter()
                    .find(|e| eval_prompts.contains(e.prompt.as_slice()))
                {
                    return Err(Error::invalid(
                        "calibration",
                        format!(
                            "calibration example {} is also an evaluation prompt; \
                             use other seeds or rows",
                            e.id
                        ),
                    ));
                }
                let ids: Vec<&str> = examples.iter().map(|e| e.id.as_str()).collect();
                let source = format!("{}: {}", entry.name, ids.join(","));
                Some(calibration(
                    lm,
                    id,
                    &opts,
                    &examples,
                    &source,
                    &mut warnings,
                )?)
            }
            _ => None,
        };

        // Settings: one per (selection, seed, k > 0).
        let mut settings = Vec::new();
        let mut index: BTreeMap<(String, usize), Vec<usize>> = BTreeMap::new();
        let ks: BTreeSet<usize> = spec
            .k
            .iter()
            .chain(spec.tasks.iter().flat_map(|t| t.k.iter().flatten()))
            .copied()
            .filter(|&k| k > 0)
            .collect();
        for s in &spec.selections {
            for &k in &ks {
                let sets: Vec<(Option<u64>, HeadSet)> =
                    match (&s.random_seeds, &rankings.get(&s.name)) {
                        (Some(seeds), _) => seeds
                            .iter()
                            .map(|&seed| {
                                HeadSet::random(cfg.n_layers, cfg.n_heads, k, seed)
                                    .map(|h| (Some(seed), h))
                            })
                            .collect::<Result<_>>()?,
                        (None, Some(r)) => vec![(None, HeadSet::top_k(r, k)?)],
                        (None, None) => unreachable!("validated: a ranking or random seeds"),
                    };
                for (seed, heads) in sets {
                    index
                        .entry((s.name.clone(), k))
                        .or_default()
                        .push(settings.len());
                    settings.push(Setting {
                        selection: s.name.clone(),
                        seed,
                        k,
                        edits: heads.interventions(spec.mode, calibration.as_ref())?,
                    });
                }
            }
        }
        let tasks = tasks
            .into_iter()
            .map(|(entry, examples)| {
                let ks = entry.k.as_ref().unwrap_or(&spec.k);
                let chosen = |name: &str| {
                    entry
                        .selections
                        .as_ref()
                        .is_none_or(|s| s.iter().any(|x| x == name))
                };
                let settings = spec
                    .selections
                    .iter()
                    .filter(|s| chosen(&s.name))
                    .flat_map(|s| {
                        ks.iter()
                            .filter(|&&k| k > 0)
                            .flat_map(|&k| index[&(s.name.clone(), k)].clone())
                            .collect::<Vec<_>>()
                    })
                    .collect();
                let is_control =
                    matches!(TaskSource::parse(&entry.name), Ok(TaskSource::Control(_)));
                let examples = examples
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| i % opts.shard.count == opts.shard.index)
                    .map(|(_, e)| e)
                    .collect();
                TaskPlan {
                    name: entry.name.clone(),
                    is_control,
                    examples,
                    settings,
                }
            })
            .collect();
        Ok(Self {
            baseline: HeadSet(vec![]).interventions(spec.mode, calibration.as_ref())?,
            spec,
            lm,
            info,
            opts,
            tasks,
            settings,
            warnings,
        })
    }

    /// Answers the run will hold when complete (controls count every setting).
    pub fn planned(&self) -> usize {
        self.tasks
            .iter()
            .map(|t| t.examples.len() * (1 + t.settings.len()))
            .sum()
    }

    /// Run every answer not already recorded, appending records as they come. Per task,
    /// the unablated baselines run first (a control's decides whether its settings run),
    /// then every setting of the kept examples; answers run `batch` at a time
    /// ([`generate_batch`]: the same tokens as one at a time).
    pub fn run(&self, bar: Option<&ProgressBar>) -> Result<RunStats> {
        let dir = &self.opts.out_dir;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        write_atomic(&dir.join("run.json"), &to_json(&self.info)?)?;
        let path = dir.join(self.opts.shard.records_file());
        let done: BTreeMap<Key, ExampleRecord> = read_records(&path)?
            .into_iter()
            .map(|r| (r.key(), r))
            .collect();
        let mut out = Records {
            file: open_append(&path)?,
            path,
            stats: RunStats::default(),
            bar,
        };
        let t0 = Instant::now();
        for task in &self.tasks {
            // The baselines: whether a control item is kept comes from its record.
            let mut kept: BTreeMap<String, Option<bool>> = BTreeMap::new();
            let mut todo = Vec::new();
            let mut skipped = 0;
            for ex in &task.examples {
                let u = self.unit(task, ex, None);
                match done.get(&u.key) {
                    Some(r) => {
                        kept.insert(ex.id.clone(), r.kept);
                        out.stats.resumed += 1;
                        skipped += 1;
                    }
                    None => todo.push(u),
                }
            }
            out.skip(skipped);
            for r in self.answer_all(task, &todo, &mut out)? {
                kept.insert(r.example, r.kept);
            }
            // The settings of every example kept.
            let (mut todo, mut skipped) = (Vec::new(), 0);
            for ex in &task.examples {
                for &i in &task.settings {
                    let u = self.unit(task, ex, Some(i));
                    if kept.get(&ex.id).copied().flatten() == Some(false) {
                        out.stats.filtered += 1;
                        skipped += 1;
                    } else if done.contains_key(&u.key) {
                        out.stats.resumed += 1;
                        skipped += 1;
                    } else {
                        todo.push(u);
                    }
                }
            }
            out.skip(skipped);
            self.answer_all(task, &todo, &mut out)?;
        }
        out.stats.secs = t0.elapsed().as_secs_f64();
        Ok(out.stats)
    }

    /// `ex` of `task` unablated (`None`) or under setting `i`.
    fn unit<'s>(&'s self, task: &TaskPlan, ex: &'s Example, setting: Option<usize>) -> Unit<'s> {
        let (selection, seed, k, edits) = match setting {
            None => (BASELINE.to_string(), None, 0, &self.baseline),
            Some(i) => {
                let s = &self.settings[i];
                (s.selection.clone(), s.seed, s.k, &s.edits)
            }
        };
        Unit {
            ex,
            key: (task.name.clone(), ex.id.clone(), selection, seed, k),
            edits,
        }
    }

    /// Answer `units` of `task`, `batch` at a time, appending each batch's records once
    /// it ends; the records, in order. A record's `secs` is its share of its batch's
    /// wall time.
    fn answer_all(
        &self,
        task: &TaskPlan,
        units: &[Unit<'_>],
        out: &mut Records<'_>,
    ) -> Result<Vec<ExampleRecord>> {
        let mode = self.spec.mode.name();
        let opts = GenerateOptions {
            max_new: self.spec.max_new,
            stop: self.lm.special.stop.clone(),
            ..GenerateOptions::default()
        };
        let mut records = Vec::with_capacity(units.len());
        for chunk in units.chunks(self.opts.batch) {
            if let Some(bar) = out.bar {
                bar.set_message(format!("{} {}", task.name, chunk[0].ex.id));
            }
            let start = Instant::now();
            let jobs: Vec<(&[u32], &Interventions)> = chunk
                .iter()
                .map(|u| (u.ex.prompt.as_slice(), u.edits))
                .collect();
            let mut answers: Vec<AnswerText> = chunk
                .iter()
                .map(|u| AnswerText::for_task(self.lm, &u.ex.task))
                .collect();
            generate_batch(&self.lm.model, &jobs, &opts, &mut |i, tok, _| {
                answers[i].push(tok)
            })?;
            let secs = start.elapsed().as_secs_f64() / chunk.len() as f64;
            for (u, answer) in chunk.iter().zip(answers) {
                let prediction = answer.finish()?;
                let scores: BTreeMap<String, f64> = self
                    .spec
                    .metrics
                    .iter()
                    .map(|m| (m.name().to_string(), m.score(&u.ex.answers, &prediction)))
                    .collect();
                let (task_name, example, selection, seed, k) = u.key.clone();
                let kept = (k == 0 && task.is_control)
                    .then(|| Metric::Accuracy.score(&u.ex.answers, &prediction) == 1.0);
                let record = ExampleRecord {
                    task: task_name,
                    example,
                    context_tokens: u.ex.context_tokens,
                    selection,
                    seed,
                    k,
                    mode: mode.to_string(),
                    prediction,
                    scores,
                    kept,
                    secs,
                };
                append_jsonl(&mut out.file, &out.path, &record)?;
                out.stats.generated += 1;
                records.push(record);
            }
            out.tick(chunk.len());
        }
        Ok(records)
    }

    /// The folder the run writes to.
    pub fn out_dir(&self) -> &Path {
        &self.opts.out_dir
    }
}

/// Compute (or reuse from `<out_dir>/calibration.json`, when of the same prompts,
/// numerics and CPU) the calibration means.
fn calibration(
    lm: &LoadedModel,
    id: &ModelId,
    opts: &RunOptions,
    examples: &[Example],
    source: &str,
    warnings: &mut Vec<String>,
) -> Result<Calibration> {
    let path = opts.out_dir.join("calibration.json");
    if path.exists() {
        let c = Calibration::load(&path, id)?;
        if c.source == source && c.made.resumable_by(&opts.made) {
            warnings.push(format!("reusing {}", path.display()));
            return Ok(c);
        }
    }
    let prompts: Vec<Vec<u32>> = examples.iter().map(|e| e.prompt.clone()).collect();
    let c = Calibration::compute(&lm.model, id, &prompts, source, &opts.made)?;
    c.write(&path)?;
    Ok(c)
}

/// Refuse to mix runs of different specs, models, numerics or CPUs in one folder;
/// returns `info` with the note a folder of records older than the recorded CPU needs.
fn check_run_info(dir: &Path, info: RunInfo) -> Result<RunInfo> {
    let path = dir.join("run.json");
    if !path.exists() {
        return Ok(info);
    }
    let old: RunInfo = read_json(&path)?;
    if old.model_sha256 != info.model_sha256 || old.spec != info.spec {
        return Err(Error::invalid(
            "output",
            format!(
                "{} holds a run of another spec or model ({}); use another experiment name \
                 or move the folder away",
                dir.display(),
                old.model,
            ),
        ));
    }
    if !old.made.resumable_by(&info.made) {
        return Err(Error::invalid(
            "output",
            format!(
                "{} holds a run made with {}: its records would mix with this run's; use \
                 another experiment name or move the folder away",
                dir.display(),
                old.made.mismatch(&info.made)
            ),
        ));
    }
    let made = info.made.continuing(&old.made);
    Ok(RunInfo { made, ..info })
}

/// Read a JSON file into `T`, naming the file on error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::invalid("file", format!("{}: {e}", path.display())))
}

pub(crate) fn to_json<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec_pretty(v).map_err(|e| Error::invalid("json", e.to_string()))
}

/// Read a records file. A last line cut short by an interruption is dropped (and cut
/// from the file, so appending continues on a clean line); a malformed line elsewhere is
/// an error naming the line.
pub fn read_records(path: &Path) -> Result<Vec<ExampleRecord>> {
    read_jsonl(path)
}

/// Open a records file for appending, creating it if missing.
pub(crate) fn open_append(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::io(path, e))
}

/// Append `record` as one JSON line to `file` (opened for appending at `path`) and flush
/// it, so an interrupted run loses at most the line being written.
pub(crate) fn append_jsonl<T: Serialize>(
    file: &mut std::fs::File,
    path: &Path,
    record: &T,
) -> Result<()> {
    let mut line =
        serde_json::to_string(record).map_err(|e| Error::invalid("record", e.to_string()))?;
    line.push('\n');
    file.write_all(line.as_bytes())
        .and_then(|_| file.flush())
        .map_err(|e| Error::io(path, e))
}

/// [`read_records`] for any record type: one JSON value a line.
pub fn read_jsonl<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    if complete.len() != text.len() {
        write_atomic(path, complete.as_bytes())?;
    }
    complete
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                Error::invalid("records", format!("{}:{}: {e}", path.display(), i + 1))
            })
        })
        .collect()
}

/// Every record in `dir` (all shards).
pub fn read_all_records(dir: &Path) -> Result<Vec<ExampleRecord>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("records") && n.ends_with(".jsonl"))
        })
        .collect();
    paths.sort();
    let mut all = Vec::new();
    for p in paths {
        all.extend(read_records(&p)?);
    }
    Ok(all)
}

/// Builds examples from the data directory, loading each haystack once.
pub(crate) struct Sources<'d> {
    data_dir: &'d Path,
    haystack: Option<Haystack>,
}

impl<'d> Sources<'d> {
    pub(crate) fn new(data_dir: &'d Path) -> Self {
        Self {
            data_dir,
            haystack: None,
        }
    }

    fn dir(&self, sub: &str) -> Result<PathBuf> {
        let p = self.data_dir.join(sub);
        if !p.exists() {
            return Err(Error::invalid(
                "data",
                format!(
                    "{} not found (the data directory is {}; set data_dir in the spec)",
                    p.display(),
                    self.data_dir.display()
                ),
            ));
        }
        Ok(p)
    }

    fn haystack(&mut self) -> Result<&Haystack> {
        if self.haystack.is_none() {
            let dir = self.dir("haystack/paul_graham")?;
            self.haystack = Some(Haystack::from_dir(&dir)?);
        }
        self.haystack
            .as_ref()
            .ok_or(Error::Internal("the haystack was just loaded"))
    }

    pub(crate) fn examples(
        &mut self,
        entry: &TaskEntry,
        enc: &Encoder,
        warnings: &mut Vec<String>,
    ) -> Result<Vec<Example>> {
        let seeds = entry.seeds.as_ref().unwrap_or(&Seeds::Count(5)).list();
        let mut loaded = |l: Loaded| {
            warnings.extend(
                l.skipped
                    .iter()
                    .map(|s| format!("{}: skipped {s}", entry.name)),
            );
            l.examples
        };
        let examples = match TaskSource::parse(&entry.name)? {
            TaskSource::Needle(kind) => {
                let spec = TaskSpec {
                    kind,
                    lengths: entry.lengths.clone(),
                    depths: if entry.depths.is_empty() {
                        vec![0.5]
                    } else {
                        entry.depths.clone()
                    },
                    seeds,
                };
                let trials = tasks::generate(&spec, enc, self.haystack()?)?;
                let n = entry.limit.unwrap_or(trials.len());
                trials.iter().take(n).map(Example::from_trial).collect()
            }
            TaskSource::HotpotQa => {
                let p = self.dir("hotpotqa/hotpot_dev_distractor_200.jsonl")?;
                loaded(hotpotqa::load(&p, enc, entry.limit)?)
            }
            TaskSource::Musique => {
                let p = self.dir("musique/musique_ans_dev_150.jsonl")?;
                loaded(musique::load(&p, enc, entry.limit)?)
            }
            TaskSource::Babilong(n) => {
                let dir = self.dir("babi")?;
                self.haystack()?;
                let hay = self
                    .haystack
                    .as_ref()
                    .ok_or(Error::Internal("the haystack was just loaded"))?;
                loaded(babilong::load(
                    &dir,
                    n,
                    &entry.lengths,
                    hay,
                    enc,
                    entry.limit,
                )?)
            }
            TaskSource::Ruler(task) => {
                let qa = match task {
                    RulerTask::Qa => {
                        hotpotqa::qa_items(&self.dir("hotpotqa/hotpot_dev_distractor_200.jsonl")?)?
                    }
                    _ => Vec::new(),
                };
                let hay = self.haystack()?;
                let mut exs = ruler::generate(task, &entry.lengths, &seeds, enc, hay, &qa)?;
                exs.truncate(entry.limit.unwrap_or(exs.len()));
                exs
            }
            TaskSource::Control(kind) => controls::pool(
                kind,
                enc,
                entry.limit.unwrap_or(60),
                seeds.first().copied().unwrap_or(0),
            )?,
        };
        Ok(examples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_estimate_sees_a_batchs_answers_and_not_the_resumed_ones() {
        // 100 answers from an earlier run, then a batch of 8 generated in about 0.5 s:
        // the rate the bar estimates is the batch's (8 answers over its time), not one
        // answer per batch (about 1 below), nor the instant resumed ones (about 100). The
        // clock starts before the bar's and stops after it is read, so a slow machine
        // only moves the product up, by the stall over the batch's time.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("records.jsonl");
        let bar = ProgressBar::hidden();
        bar.set_length(1000);
        let out = Records {
            file: open_append(&path).unwrap(),
            path,
            stats: RunStats::default(),
            bar: Some(&bar),
        };
        let t0 = Instant::now();
        out.skip(100);
        std::thread::sleep(std::time::Duration::from_millis(500));
        out.tick(8);
        let answers_in_batch_time = bar.per_sec() * t0.elapsed().as_secs_f64();
        assert_eq!(bar.position(), 108);
        assert!(
            (4.0..40.0).contains(&answers_in_batch_time),
            "{answers_in_batch_time}"
        );
    }

    #[test]
    fn shards_parse_and_reject_nonsense() {
        assert_eq!(Shard::parse("1/4").unwrap(), Shard { index: 1, count: 4 });
        for bad in ["4/4", "1/0", "x/2", "3", "-1/2"] {
            assert!(Shard::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Shard::ALL.records_file(), "records.jsonl");
        assert_eq!(
            Shard::parse("0/2").unwrap().records_file(),
            "records.shard-0-of-2.jsonl"
        );
    }

    #[test]
    fn a_cut_last_line_is_dropped_and_the_file_repaired() {
        let dir = std::env::temp_dir().join(format!("headwise-records-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("records.jsonl");
        let r = ExampleRecord {
            task: "niah".into(),
            example: "a".into(),
            context_tokens: 0,
            selection: BASELINE.into(),
            seed: None,
            k: 0,
            mode: "zero-output".into(),
            prediction: "x".into(),
            scores: BTreeMap::new(),
            kept: None,
            secs: 0.5,
        };
        let line = serde_json::to_string(&r).unwrap();
        std::fs::write(&path, format!("{line}\n{}", &line[..10])).unwrap();
        assert_eq!(read_records(&path).unwrap(), vec![r.clone()]);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{line}\n"));
        // a broken line in the middle is an error naming it
        std::fs::write(&path, format!("{line}\n{{oops\n{line}\n")).unwrap();
        let err = read_records(&path).unwrap_err().to_string();
        assert!(err.contains("records.jsonl:2"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
