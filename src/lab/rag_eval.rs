//! RAG experiments from a spec: every question of every task answered under every
//! variant (closed book, all paragraphs, `once`, `every_n`, `rind`, `retrieval_heads`),
//! retrieving with BM25 from the task's paragraph pool (every question's paragraphs,
//! deduplicated, indexed in memory). One JSON line per (task, question, variant) in
//! `records.jsonl`, so a run resumes; `run.json` ([`RagRun`]) names the model, numerics,
//! CPU and arithmetic fingerprint of the records, and a resumed run of another is refused. [`write_report`]
//! writes `summary.json` (em, f1, retrievals, generated_tokens, secs) and `README.md`.
//!
//! ```toml
//! name = "rag"
//! model = "smollm2-135m"
//! max_new = 24
//! probe = "probes/{model}/hotpotqa.json"                # for retrieval_heads
//! ranking = "policies/rankings/{model}/locos-niah.json"  # its watched heads: the top 9
//! watched_heads = 9
//!
//! [[task]]
//! name = "hotpotqa"
//! file = "hotpotqa/hotpot_dev_distractor_200.jsonl"
//! format = "hotpotqa"
//!
//! [[variant]]
//! name = "rind"
//! rag = { trigger = { type = "rind", threshold = 1.0 } }
//! ```
//!
//! A task may be split into folds for cross-fitting: each fold's questions are answered
//! with a probe trained on other questions (its card lists them; a probe that saw any of
//! the fold's questions is refused), and the report pools the folds:
//!
//! ```toml
//! [[task]]
//! name = "hotpotqa"
//! file = "hotpotqa/hotpot_dev_distractor_200.jsonl"
//! format = "hotpotqa"
//! fold = [
//!     { rows = [0, 100], probe = "probes/{model}/hotpotqa-rows-100-200.json" },
//!     { rows = [100, 200], probe = "probes/{model}/hotpotqa-rows-0-100.json" },
//! ]
//! ```
//!
//! `[[rate_match]]` compares triggers at matched retrieval rates: each variant of
//! `first` against the variant of `second` that retrieved most nearly as often.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use crate::artifact::{read_versioned, Versioned};
use crate::lab::eval::run::{append_jsonl, open_append, read_jsonl};
use crate::lab::plot::{interval_panels, Panel};
use crate::lab::stats::{bootstrap95, format_p, mean_se, sign_flip_p};
use crate::metrics::Metric;
use crate::model::{LoadedModel, ModelId};
use crate::policy::ranking::Ranking;
use crate::probe::Probe;
use crate::provenance::Made;
use crate::rag::corpus::{pool, CorpusFormat};
use crate::rag::dragin::{
    answer, AnswerOptions, HeadSignal, InContextHeads, Instrumented, RagConfig, SegmentSource,
};
use crate::rag::qa::{self, QaItem};
use crate::rag::text::Stopwords;
use crate::rag::trigger::TriggerConfig;
use crate::rag::Bm25Index;
use crate::results::{write_atomic, write_experiment, ResultRecord, SCHEMA_VERSION};
use crate::{Error, Result};

/// A RAG experiment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RagSpec {
    pub name: String,
    /// A known model name or a GGUF path.
    pub model: String,
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// Tokens per answer segment at most.
    #[serde(default = "default_max_new")]
    pub max_new: usize,
    /// Prompt through the model's chat template (else raw completion).
    #[serde(default = "default_chat")]
    pub chat: bool,
    /// The stopword list, under the data directory.
    #[serde(default = "default_stopwords")]
    pub stopwords: PathBuf,
    /// The probe card of `retrieval_heads` variants (`{model}` is the model's name).
    #[serde(default)]
    pub probe: Option<String>,
    /// The ranking whose top heads `retrieval_heads` watches.
    #[serde(default)]
    pub ranking: Option<String>,
    #[serde(default = "default_watched")]
    pub watched_heads: usize,
    #[serde(rename = "task")]
    pub tasks: Vec<RagTask>,
    #[serde(rename = "variant")]
    pub variants: Vec<Variant>,
    /// Pairs `[a, b]` of variants whose F1 difference the report gives question by
    /// question, besides every variant against the first one.
    #[serde(default)]
    pub compare: Vec<[String; 2]>,
    /// Variants compared at matched retrieval rates.
    #[serde(default, rename = "rate_match")]
    pub rate_matches: Vec<RateMatch>,
}

/// Each variant of `first` against the variant of `second` whose retrievals per
/// question (on the same task) are closest to its own: triggers compared at the same
/// retrieval budget, matched on the rate and never on F1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateMatch {
    pub first: Vec<String>,
    pub second: Vec<String>,
}

fn default_max_new() -> usize {
    24
}
fn default_chat() -> bool {
    true
}
fn default_stopwords() -> PathBuf {
    PathBuf::from("stopwords/snowball_en.txt")
}
fn default_watched() -> usize {
    9
}

/// A question file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RagTask {
    pub name: String,
    /// Under the data directory.
    pub file: PathBuf,
    pub format: CorpusFormat,
    #[serde(default)]
    pub limit: Option<usize>,
    /// Cross-fitting: the folds' questions are answered (in fold order), each fold with
    /// its own probe. Empty: every question, with the spec's probe.
    #[serde(default, rename = "fold")]
    pub folds: Vec<Fold>,
}

/// A range of a task's questions and the probe that answers them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fold {
    /// Questions `rows[0]..rows[1]` of the file (0-based, end excluded).
    pub rows: [usize; 2],
    /// The probe card (`{model}` is the model's name); its card's `data.examples` must
    /// hold none of the fold's question ids.
    pub probe: String,
}

/// A named RAG configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    pub name: String,
    pub rag: RagConfig,
    /// Which engine generates the answers.
    #[serde(default)]
    pub engine: EngineKind,
    /// Only these tasks (default: all).
    #[serde(default)]
    pub tasks: Option<Vec<String>>,
}

impl Variant {
    fn runs_on(&self, task: &str) -> bool {
        self.tasks
            .as_ref()
            .is_none_or(|t| t.iter().any(|name| name == task))
    }
}

/// The engine of a variant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// The instrumented model generates, observing inline.
    #[default]
    Instrumented,
    /// mistral.rs generates and streams; the instrumented model re-reads the tokens.
    Mistralrs,
}

impl RagSpec {
    /// Read and check a spec file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let spec: RagSpec = toml::from_str(&text)
            .map_err(|e| Error::invalid("spec", format!("{}: {}", path.display(), e.message())))?;
        for v in &spec.variants {
            v.rag
                .validate()
                .map_err(|e| Error::invalid("variant", format!("`{}`: {e}", v.name)))?;
            if let Some(unknown) = v
                .tasks
                .iter()
                .flatten()
                .find(|t| !spec.tasks.iter().any(|task| &&task.name == t))
            {
                return Err(Error::invalid(
                    "variant",
                    format!("`{}`: no task named `{unknown}`", v.name),
                ));
            }
            if v.engine == EngineKind::Mistralrs && v.rag.in_context.is_some() {
                return Err(Error::invalid(
                    "variant",
                    format!(
                        "`{}`: in-context retrieval masks heads of the instrumented engine only",
                        v.name
                    ),
                ));
            }
        }
        for task in &spec.tasks {
            let mut rows: Vec<[usize; 2]> = task.folds.iter().map(|f| f.rows).collect();
            rows.sort_unstable();
            if let Some([a, b]) = rows.iter().find(|[a, b]| a >= b) {
                return Err(Error::invalid(
                    "fold",
                    format!("task `{}`: rows {a}..{b} are empty", task.name),
                ));
            }
            if let Some(w) = rows.windows(2).find(|w| w[1][0] < w[0][1]) {
                return Err(Error::invalid(
                    "fold",
                    format!(
                        "task `{}`: rows {}..{} and {}..{} overlap",
                        task.name, w[0][0], w[0][1], w[1][0], w[1][1]
                    ),
                ));
            }
        }
        if let Some(unknown) = spec
            .compare
            .iter()
            .flatten()
            .chain(
                spec.rate_matches
                    .iter()
                    .flat_map(|m| m.first.iter().chain(&m.second)),
            )
            .find(|c| !spec.variants.iter().any(|v| &&v.name == c))
        {
            return Err(Error::invalid(
                "compare",
                format!("no variant named `{unknown}` (in `compare` or `rate_match`)"),
            ));
        }
        if spec.variants.is_empty() || spec.tasks.is_empty() {
            return Err(Error::invalid(
                "spec",
                "needs at least one [[task]] and one [[variant]]",
            ));
        }
        Ok(spec)
    }
}

/// One answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RagRecord {
    pub task: String,
    pub id: String,
    pub variant: String,
    pub answer: String,
    pub answers: Vec<String>,
    pub em: f64,
    pub f1: f64,
    pub retrievals: usize,
    pub queries: Vec<String>,
    pub generated_tokens: usize,
    pub secs: f64,
    pub retriever_errors: Vec<String>,
}

/// `run.json` of a RAG run folder: the model and how the folder's records were made.
/// Records are keyed by (task, question, variant), so a spec may gain variants between
/// runs; a run with another model, numerics, CPU or arithmetic fingerprint is refused
/// (greedy answers differ).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RagRun {
    pub schema_version: u32,
    pub model: String,
    pub model_sha256: String,
    /// Numerics, CPU, build, command line and date of the first run into the folder, or
    /// of the first run that recorded the arithmetic fingerprint (`note` says which
    /// records are older than what this file records).
    #[serde(flatten)]
    pub made: Made,
}

impl Versioned for RagRun {
    const KIND: &'static str = "RAG run";
    const SCHEMA_VERSION: u32 = 1;
}

/// Check `out/run.json` against this run, or write it when the folder has none (or has
/// one without an arithmetic fingerprint): a folder of another model, numerics, CPU or
/// arithmetic is an error. `records` is how many records the folder holds already.
fn check_run(out: &Path, id: &ModelId, made: &Made, records: usize) -> Result<()> {
    let path = out.join("run.json");
    if path.exists() {
        let old: RagRun = read_versioned(&path)?;
        if old.model_sha256 != id.sha256 {
            return Err(Error::invalid(
                "out",
                format!(
                    "{} holds answers of another model ({}); use another --out",
                    out.display(),
                    old.model
                ),
            ));
        }
        if !old.made.resumable_by(made) {
            return Err(Error::invalid(
                "out",
                format!(
                    "{} holds answers made with {}; use another --out",
                    out.display(),
                    old.made.mismatch(made)
                ),
            ));
        }
        // rewritten only when the folder's note gains something: a folder from before the
        // fingerprint (from now on checked against this one), or one continued on another
        // CPU of the same fingerprint
        let continued = made.continuing(&old.made);
        if continued.note == old.made.note {
            return Ok(());
        }
        let info = RagRun {
            made: continued,
            ..old
        };
        let json =
            serde_json::to_vec_pretty(&info).map_err(|e| Error::invalid("json", e.to_string()))?;
        return write_atomic(&path, &json);
    }
    let note = (records > 0).then(|| {
        format!("{records} records predate this file: their numerics and CPU were not recorded")
    });
    let info = RagRun {
        schema_version: RagRun::SCHEMA_VERSION,
        model: id.name.clone(),
        model_sha256: id.sha256.clone(),
        made: Made {
            note,
            ..made.clone()
        },
    };
    let json =
        serde_json::to_vec_pretty(&info).map_err(|e| Error::invalid("json", e.to_string()))?;
    write_atomic(&path, &json)
}

/// Run every (task, question, variant) not yet in `out/records.jsonl`; returns how many
/// answers were generated. `made` describes this run (its numerics and CPU must match
/// the folder's `run.json`).
#[allow(clippy::too_many_arguments)]
pub fn run(
    spec: &RagSpec,
    lm: &LoadedModel,
    id: &ModelId,
    data_dir: &Path,
    out: &Path,
    limit: Option<usize>,
    made: &Made,
    bar: Option<&ProgressBar>,
) -> Result<usize> {
    let stop = Stopwords::load(&data_dir.join(&spec.stopwords))?;
    let uses_heads = |v: &Variant| {
        matches!(v.rag.trigger, TriggerConfig::RetrievalHeads { .. }) || v.rag.in_context.is_some()
    };
    let uses_probe = |v: &Variant| {
        matches!(v.rag.trigger, TriggerConfig::RetrievalHeads { .. })
            || v.rag
                .in_context
                .is_some_and(|ic| ic.heads == InContextHeads::Probe)
    };
    let sub = |s: &Option<String>, what: &str| {
        s.as_ref()
            .map(|p| PathBuf::from(p.replace("{model}", &id.name)))
            .ok_or_else(|| {
                Error::invalid(
                    what,
                    "retrieval_heads and in-context variants need it in the spec",
                )
            })
    };
    // Per task, whether a variant on it uses a probe: the spec's probe for the tasks
    // without folds, each fold's own for the others.
    let needs_probe: Vec<bool> = spec
        .tasks
        .iter()
        .map(|t| {
            spec.variants
                .iter()
                .any(|v| v.runs_on(&t.name) && uses_probe(v))
        })
        .collect();
    let spec_probe_used = spec
        .tasks
        .iter()
        .zip(&needs_probe)
        .any(|(t, &needs)| needs && t.folds.is_empty());
    let probe = match spec_probe_used {
        true => Some(Probe::load(&sub(&spec.probe, "probe")?)?),
        false => None,
    };
    let watched: Vec<usize> = match spec.variants.iter().any(uses_heads) {
        true => {
            let ranking = Ranking::load(&sub(&spec.ranking, "ranking")?)?;
            let cfg = lm.model.config();
            ranking.check_model(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads)?;
            let n_heads = cfg.n_heads;
            ranking
                .top(spec.watched_heads)
                .iter()
                .map(|h| h.layer * n_heads + h.head)
                .collect()
        }
        false => Vec::new(),
    };
    #[cfg(feature = "mistralrs")]
    let mistralrs = match spec
        .variants
        .iter()
        .any(|v| v.engine == EngineKind::Mistralrs)
    {
        true => Some(crate::reference::mistralrs::MistralRsEngine::load(
            &lm.path,
        )?),
        false => None,
    };
    let engine_of = |v: &Variant| -> Result<&dyn SegmentSource> {
        match v.engine {
            EngineKind::Instrumented => Ok(&Instrumented),
            #[cfg(feature = "mistralrs")]
            EngineKind::Mistralrs => Ok(mistralrs
                .as_ref()
                .ok_or(Error::Internal("mistral.rs is loaded for its variants"))?),
            #[cfg(not(feature = "mistralrs"))]
            EngineKind::Mistralrs => Err(Error::invalid(
                "engine",
                "mistralrs: this build has no mistral.rs (feature `mistralrs`)",
            )),
        }
    };
    // Every task's questions and every fold's probe, checked before any answer.
    let questions: Vec<Vec<QaItem>> = spec
        .tasks
        .iter()
        .map(|t| qa::load(&data_dir.join(&t.file), t.format, None))
        .collect::<Result<_>>()?;
    let folds: Vec<Vec<(Vec<&QaItem>, Option<Probe>)>> = spec
        .tasks
        .iter()
        .zip(&questions)
        .zip(&needs_probe)
        .map(|((t, all), &needs)| fold_questions(t, all, &id.name, needs))
        .collect::<Result<_>>()?;
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let path = out.join("records.jsonl");
    let done: BTreeSet<(String, String, String)> = read_jsonl::<RagRecord>(&path)?
        .into_iter()
        .map(|r| (r.task, r.id, r.variant))
        .collect();
    check_run(out, id, made, done.len())?;
    let mut file = open_append(&path)?;
    let mut generated = 0;
    for ((task, all), folds) in spec.tasks.iter().zip(&questions).zip(&folds) {
        let passages = pool(all.iter().flat_map(|q| {
            q.paragraphs
                .iter()
                .map(|p| (p.title.as_str(), p.text.as_str()))
        }));
        let index = Bm25Index::in_memory(&passages)?;
        let variants: Vec<&Variant> = spec
            .variants
            .iter()
            .filter(|v| v.runs_on(&task.name))
            .collect();
        let mut items: Vec<(&QaItem, Option<&Probe>)> = folds
            .iter()
            .flat_map(|(questions, own)| {
                let p = own.as_ref().or(probe.as_ref());
                questions.iter().map(move |q| (*q, p))
            })
            .collect();
        if let Some(n) = [task.limit, limit].into_iter().flatten().min() {
            items.truncate(n);
        }
        if let Some(b) = bar {
            b.inc_length((items.len() * variants.len()) as u64);
        }
        for (item, item_probe) in items {
            let signal = HeadSignal {
                probe: item_probe,
                heads: &watched,
            };
            for v in variants.iter().copied() {
                if done.contains(&(task.name.clone(), item.id.clone(), v.name.clone())) {
                    // An earlier run's answer: counted, and the time estimate restarted
                    // so that it reflects only answers generated.
                    if let Some(b) = bar {
                        b.inc(1);
                        b.reset_eta();
                    }
                    continue;
                }
                let opts = AnswerOptions {
                    max_new: spec.max_new,
                    chat: spec.chat,
                    engine: engine_of(v)?,
                };
                let a = answer(lm, item, &v.rag, Some(&index), &stop, Some(signal), opts)?;
                let record = RagRecord {
                    task: task.name.clone(),
                    id: item.id.clone(),
                    variant: v.name.clone(),
                    em: Metric::Em.score(&item.answers, &a.answer),
                    f1: Metric::F1.score(&item.answers, &a.answer),
                    answer: a.answer,
                    answers: item.answers.clone(),
                    retrievals: a.retrievals.len(),
                    queries: a.retrievals.into_iter().map(|r| r.query).collect(),
                    generated_tokens: a.generated_tokens,
                    secs: a.secs,
                    retriever_errors: a.retriever_errors,
                };
                append_jsonl(&mut file, &path, &record)?;
                generated += 1;
                if let Some(b) = bar {
                    b.inc(1);
                }
            }
        }
    }
    Ok(generated)
}

/// A task's questions in answering order, fold by fold, each fold with its probe (loaded
/// when a variant needs one, and refused if it was trained on any of the fold's
/// questions); without folds, every question in one group with no probe of its own.
fn fold_questions<'a>(
    task: &RagTask,
    all: &'a [QaItem],
    model: &str,
    needs_probe: bool,
) -> Result<Vec<(Vec<&'a QaItem>, Option<Probe>)>> {
    if task.folds.is_empty() {
        return Ok(vec![(all.iter().collect(), None)]);
    }
    task.folds
        .iter()
        .map(|fold| {
            let [start, end] = fold.rows;
            let questions = all.get(start..end).ok_or_else(|| {
                Error::invalid(
                    "fold",
                    format!(
                        "task `{}`: rows {start}..{end}, but the file has {} questions",
                        task.name,
                        all.len()
                    ),
                )
            })?;
            let probe = match needs_probe {
                true => {
                    let path = PathBuf::from(fold.probe.replace("{model}", model));
                    let probe = Probe::load(&path)?;
                    check_unseen(&probe.card().data, &path, questions)?;
                    Some(probe)
                }
                false => None,
            };
            Ok((questions.iter().collect(), probe))
        })
        .collect()
}

/// Refuse a probe whose card's `data` (at `path`) lists any of `questions` among the
/// examples it was trained on (`data.examples`), or does not list them at all.
fn check_unseen(data: &serde_json::Value, path: &Path, questions: &[QaItem]) -> Result<()> {
    let seen: BTreeSet<&str> = data
        .get("examples")
        .and_then(|e| e.as_array())
        .ok_or_else(|| {
            Error::invalid(
                "probe",
                format!(
                    "{}: the card does not list the questions it was trained on \
                     (`data.examples`), so a fold cannot be checked against them; \
                     retrain it with `headwise policy train-probe`",
                    path.display()
                ),
            )
        })?
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    let overlap: Vec<&str> = questions
        .iter()
        .map(|q| q.id.as_str())
        .filter(|id| seen.contains(id))
        .collect();
    match overlap.first() {
        Some(first) => Err(Error::invalid(
            "fold",
            format!(
                "{} was trained on {} of the fold's questions (e.g. {first}): a fold needs \
                 a probe trained on other questions",
                path.display(),
                overlap.len()
            ),
        )),
        None => Ok(()),
    }
}

/// For every two variants with the same RAG settings on different engines: on how many
/// questions both ran, they gave the same answer and retrieved with the same queries
/// (QFS queries come from attention, so equal queries mean equal observations).
fn engine_agreement(spec: &RagSpec, records: &[RagRecord]) -> String {
    let by_key: BTreeMap<(&str, &str, &str), &RagRecord> = records
        .iter()
        .map(|r| ((r.variant.as_str(), r.task.as_str(), r.id.as_str()), r))
        .collect();
    let mut md = String::new();
    for (i, a) in spec.variants.iter().enumerate() {
        for b in &spec.variants[i + 1..] {
            if a.rag != b.rag || a.engine == b.engine {
                continue;
            }
            let (mut n, mut answers, mut queries) = (0, 0, 0);
            for ra in records.iter().filter(|r| r.variant == a.name) {
                let Some(rb) = by_key.get(&(b.name.as_str(), ra.task.as_str(), ra.id.as_str()))
                else {
                    continue;
                };
                n += 1;
                answers += usize::from(ra.answer == rb.answer);
                queries += usize::from(ra.queries == rb.queries);
            }
            if md.is_empty() {
                md.push_str(
                    "\n| engines compared | questions | same answer | same retrieval queries |\n\
                     |---|---:|---:|---:|\n",
                );
            }
            md.push_str(&format!(
                "| `{}` vs `{}` | {n} | {answers} | {queries} |\n",
                a.name, b.name
            ));
        }
    }
    md
}

/// F1 of every (task, variant, question).
type F1Table<'a> = BTreeMap<(&'a str, &'a str, &'a str), f64>;

fn f1_table(records: &[RagRecord]) -> F1Table<'_> {
    records
        .iter()
        .map(|r| ((r.task.as_str(), r.variant.as_str(), r.id.as_str()), r.f1))
        .collect()
}

/// The cells `n | ΔF1 ± se | [lo, hi] | p | higher / lower / same` of F1 of `a` minus F1
/// of `b` on the questions of `task` both answered; `None` when there are none.
fn paired_cells(f1: &F1Table, task: &str, a: &str, b: &str) -> Option<String> {
    let diffs: Vec<f64> = f1
        .iter()
        .filter(|((t, v, _), _)| *t == task && *v == a)
        .filter_map(|((t, _, id), fa)| f1.get(&(*t, b, *id)).map(|fb| fa - fb))
        .collect();
    if diffs.is_empty() {
        return None;
    }
    let (mean, se) = mean_se(&diffs);
    let (lo, hi) = bootstrap95(&diffs);
    let count = |f: fn(&f64) -> bool| diffs.iter().filter(|d| f(d)).count();
    Some(format!(
        "{} | {mean:+.3} ± {se:.3} | [{lo:+.3}, {hi:+.3}] | {} | {} / {} / {}",
        diffs.len(),
        format_p(sign_flip_p(&diffs)),
        count(|d| *d > 0.0),
        count(|d| *d < 0.0),
        count(|d| *d == 0.0)
    ))
}

const PAIRED_NOTE: &str = "mean ± standard error of the per-question difference, its 95% \
     bootstrap interval, the two-sided p-value of the paired sign-flip test (not corrected \
     for the number of comparisons), and on how many questions the first variant scored \
     higher / lower / the same";

/// Per task, F1 of `a` minus F1 of `b` on the questions both answered
/// ([`paired_cells`]): every variant against the first, then the spec's `compare` pairs.
fn paired_differences(spec: &RagSpec, records: &[RagRecord]) -> String {
    let f1 = f1_table(records);
    let first = &spec.variants[0].name;
    let pairs = spec.variants[1..]
        .iter()
        .map(|v| [v.name.clone(), first.clone()])
        .chain(spec.compare.iter().cloned());
    let mut md = String::new();
    for [a, b] in pairs {
        for task in &spec.tasks {
            let Some(cells) = paired_cells(&f1, &task.name, &a, &b) else {
                continue;
            };
            if md.is_empty() {
                md.push_str(&format!(
                    "\nF1 differences on the same questions ({PAIRED_NOTE}):\n\n\
                     | task | variants | n | ΔF1 | 95% CI | p | higher / lower / same |\n\
                     |---|---|---:|---:|---|---:|---:|\n"
                ));
            }
            md.push_str(&format!("| {} | `{a}` − `{b}` | {cells} |\n", task.name));
        }
    }
    md
}

/// Per task and `[[rate_match]]`: each `first` variant against the `second` variant
/// whose retrievals per question are closest to its own, as in [`paired_differences`].
fn rate_matched(spec: &RagSpec, records: &[RagRecord]) -> String {
    let f1 = f1_table(records);
    let rate = |task: &str, variant: &str| {
        let r: Vec<f64> = records
            .iter()
            .filter(|r| r.task == task && r.variant == variant)
            .map(|r| r.retrievals as f64)
            .collect();
        (!r.is_empty()).then(|| mean_se(&r).0)
    };
    let mut md = String::new();
    for m in &spec.rate_matches {
        for task in &spec.tasks {
            let t = task.name.as_str();
            for a in &m.first {
                let Some(ra) = rate(t, a) else { continue };
                let Some((b, rb)) = m
                    .second
                    .iter()
                    .filter_map(|b| rate(t, b).map(|rb| (b, rb)))
                    .min_by(|x, y| (x.1 - ra).abs().total_cmp(&(y.1 - ra).abs()))
                else {
                    continue;
                };
                let Some(cells) = paired_cells(&f1, t, a, b) else {
                    continue;
                };
                if md.is_empty() {
                    md.push_str(&format!(
                        "\nTriggers at matched retrieval rates: each variant against the one \
                         of the other group that retrieved most nearly as often on the task \
                         (matched on the rate, never on F1); F1 differences as above \
                         ({PAIRED_NOTE}):\n\n\
                         | task | variant (retrievals / question) | matched with | n | ΔF1 | 95% CI | p | higher / lower / same |\n\
                         |---|---|---|---:|---:|---|---:|---:|\n"
                    ));
                }
                md.push_str(&format!(
                    "| {t} | `{a}` ({ra:.2}) | `{b}` ({rb:.2}) | {cells} |\n"
                ));
            }
        }
    }
    md
}

/// The folds of cross-fitted tasks, for the report.
fn folds_note(spec: &RagSpec) -> String {
    let mut md = String::new();
    for task in spec.tasks.iter().filter(|t| !t.folds.is_empty()) {
        md.push_str(&format!(
            "\nCross-fitted `{}`: every variant that uses a probe answers ",
            task.name
        ));
        let parts: Vec<String> = task
            .folds
            .iter()
            .map(|f| format!("rows {}..{} with `{}`", f.rows[0], f.rows[1], f.probe))
            .collect();
        md.push_str(&parts.join(", "));
        md.push_str(
            " (each probe's card lists its training questions; none is among the rows it \
             answers); the rows are pooled in every table.\n",
        );
    }
    md
}

/// Write `summary.json` and `README.md` of a run folder from its records, in the
/// spec's variant order; `made` is the provenance of the run (its command the one that
/// generates the records), with the numerics and CPU of the folder's `run.json` when it
/// has one (the report may be written on another machine, or without `--numerics`).
pub fn write_report(
    dir: &Path,
    spec: &RagSpec,
    id: &ModelId,
    made: &Made,
) -> Result<Vec<ResultRecord>> {
    let run_json = dir.join("run.json");
    let made = &match run_json.exists() {
        true => {
            let run = read_versioned::<RagRun>(&run_json)?.made;
            Made {
                numerics: run.numerics,
                cpu: run.cpu,
                arithmetic: run.arithmetic,
                note: run.note,
                ..made.clone()
            }
        }
        false => made.clone(),
    };
    let records: Vec<RagRecord> = read_jsonl(&dir.join("records.jsonl"))?;
    let mut groups: BTreeMap<(String, String), Vec<&RagRecord>> = BTreeMap::new();
    for r in &records {
        groups
            .entry((r.task.clone(), r.variant.clone()))
            .or_default()
            .push(r);
    }
    let mut summary = Vec::new();
    let mut panels: Vec<Panel> = Vec::new();
    let mut md = format!(
        "# RAG: {}\n\nCommand: `{}`\n\nBM25 (tantivy) over each task's paragraph pool; greedy answers of at most {} tokens \
         per segment; EM/F1 with SQuAD normalisation, mean ± standard error over questions.\n\n\
         | task | variant | n | EM | F1 | retrievals / question | tokens / question | s / question |\n\
         |---|---|---:|---:|---:|---:|---:|---:|\n",
        id.name, made.command, spec.max_new
    );
    for task in &spec.tasks {
        let mut f1s = Vec::new();
        for v in &spec.variants {
            let Some(rs) = groups.get(&(task.name.clone(), v.name.clone())) else {
                f1s.push(None);
                continue;
            };
            let col =
                |f: fn(&RagRecord) -> f64| mean_se(&rs.iter().map(|r| f(r)).collect::<Vec<_>>());
            let em = col(|r| r.em);
            let f1 = col(|r| r.f1);
            let ret = col(|r| r.retrievals as f64);
            let tok = col(|r| r.generated_tokens as f64);
            let secs = col(|r| r.secs);
            f1s.push(Some(f1));
            md.push_str(&format!(
                "| {} | {} | {} | {:.3} ± {:.3} | {:.3} ± {:.3} | {:.2} | {:.1} | {:.2} |\n",
                task.name,
                v.name,
                rs.len(),
                em.0,
                em.1,
                f1.0,
                f1.1,
                ret.0,
                tok.0,
                secs.0
            ));
            for (metric, value) in [
                ("em", em.0),
                ("f1", f1.0),
                ("retrievals", ret.0),
                ("generated_tokens", tok.0),
                ("secs", secs.0),
            ] {
                summary.push(ResultRecord {
                    schema_version: SCHEMA_VERSION,
                    experiment: spec.name.clone(),
                    model: id.name.clone(),
                    model_sha256: id.sha256.clone(),
                    task: Some(task.name.clone()),
                    context_tokens: None,
                    selection: None,
                    k: None,
                    seed: None,
                    mode: None,
                    policy: Some(v.name.clone()),
                    metric: metric.into(),
                    value,
                    n: rs.len(),
                    ci95: None,
                    p_value: None,
                    made: made.clone(),
                });
            }
        }
        if f1s.iter().any(Option::is_some) {
            panels.push((task.name.clone(), f1s));
        }
    }
    if !panels.is_empty() {
        let names: Vec<String> = spec.variants.iter().map(|v| v.name.clone()).collect();
        let svg = interval_panels(
            &format!("RAG F1 by variant, {} (mean ± standard error)", id.name),
            "F1",
            &names,
            &panels,
            (1000, 120 + 28 * names.len() as u32),
        )?;
        write_atomic(&dir.join("f1.svg"), svg.as_bytes())?;
        md.push_str("\n![F1 by variant](f1.svg)\n");
    }
    md.push_str(&folds_note(spec));
    md.push_str(&paired_differences(spec, &records));
    md.push_str(&rate_matched(spec, &records));
    md.push_str(&engine_agreement(spec, &records));
    md.push_str("\nVariants:\n\n");
    for v in &spec.variants {
        md.push_str(&format!(
            "- `{}` ({} engine{}): {}\n",
            v.name,
            serde_json::to_value(v.engine)
                .ok()
                .and_then(|e| e.as_str().map(str::to_string))
                .unwrap_or_default(),
            v.tasks
                .as_ref()
                .map(|t| format!(", {} only", t.join(", ")))
                .unwrap_or_default(),
            serde_json::to_string(&v.rag).unwrap_or_default()
        ));
    }
    write_experiment(dir, &md, &summary, made)?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = r#"
name = "rag"
model = "smollm2"
compare = [["c", "b"]]

[[task]]
name = "t"
file = "t.jsonl"
format = "hotpotqa"

[[variant]]
name = "a"
rag = { trigger = { type = "never" } }

[[variant]]
name = "b"
rag = { trigger = { type = "once" } }

[[variant]]
name = "c"
rag = { trigger = { type = "every_n", n = 2 } }
"#;

    fn record(variant: &str, id: &str, f1: f64) -> RagRecord {
        RagRecord {
            task: "t".into(),
            id: id.into(),
            variant: variant.into(),
            answer: String::new(),
            answers: Vec::new(),
            em: 0.0,
            f1,
            retrievals: 0,
            queries: Vec::new(),
            generated_tokens: 0,
            secs: 0.0,
            retriever_errors: Vec::new(),
        }
    }

    #[test]
    fn paired_differences_use_only_questions_both_variants_answered() {
        let spec: RagSpec = toml::from_str(SPEC).unwrap();
        let mut records = vec![
            record("a", "q1", 0.0),
            record("a", "q2", 0.5),
            record("a", "q3", 0.25),
            record("b", "q1", 0.5),
            record("b", "q2", 0.25),
            record("b", "q3", 0.25),
            // c answered q1 only: one pair against a and one against b
            record("c", "q1", 1.0),
        ];
        let md = paired_differences(&spec, &records);
        // b - a = 0.5, -0.25, 0: mean 0.083, sd 0.382, se 0.220; a resample of three
        // equal values has probability 1/27 > 2.5%, so the interval is the extremes;
        // every sign pattern of the two nonzero differences sums to at least 0.25 in
        // size, so p = 1
        assert!(
            md.contains(
                "| t | `b` − `a` | 3 | +0.083 ± 0.220 | [-0.250, +0.500] | 1.000 | 1 / 1 / 1 |"
            ),
            "{md}"
        );
        assert!(
            md.contains(
                "| t | `c` − `a` | 1 | +1.000 ± 0.000 | [+1.000, +1.000] | 1.000 | 1 / 0 / 0 |"
            ),
            "{md}"
        );
        assert!(
            md.contains(
                "| t | `c` − `b` | 1 | +0.500 ± 0.000 | [+0.500, +0.500] | 1.000 | 1 / 0 / 0 |"
            ),
            "{md}"
        );
        records.retain(|r| r.variant == "a");
        assert!(paired_differences(&spec, &records).is_empty());
    }

    #[test]
    fn a_comparison_of_an_unknown_variant_is_refused() {
        let dir = std::env::temp_dir().join(format!("headwise-rag-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("spec.toml");
        std::fs::write(&path, SPEC.replace("[\"c\", \"b\"]", "[\"c\", \"z\"]")).unwrap();
        let err = RagSpec::load(&path).unwrap_err().to_string();
        assert!(err.contains("no variant named `z`"), "{err}");
        std::fs::write(&path, SPEC).unwrap();
        assert!(RagSpec::load(&path).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rate_matching_pairs_each_variant_with_the_nearest_retrieval_rate() {
        let mut spec: RagSpec = toml::from_str(SPEC).unwrap();
        spec.rate_matches = vec![RateMatch {
            first: vec!["c".into()],
            second: vec!["a".into(), "b".into()],
        }];
        let with = |variant: &str, id: &str, f1: f64, retrievals: usize| RagRecord {
            retrievals,
            ..record(variant, id, f1)
        };
        let records = vec![
            with("a", "q1", 0.0, 0),
            with("a", "q2", 0.0, 0),
            with("b", "q1", 0.25, 3),
            with("b", "q2", 0.5, 1),
            with("c", "q1", 1.0, 2),
            with("c", "q2", 0.5, 2),
        ];
        // c retrieves 2 per question, b 2, a 0: c is matched with b; c - b = 0.75, 0
        let md = rate_matched(&spec, &records);
        assert!(
            md.contains(
                "| t | `c` (2.00) | `b` (2.00) | 2 | +0.375 ± 0.375 | [+0.000, +0.750] | 1.000 | 1 / 0 / 1 |"
            ),
            "{md}"
        );
        assert!(!md.contains("`a` (0.00)"), "{md}");
    }

    #[test]
    fn overlapping_or_empty_folds_are_refused() {
        let dir = std::env::temp_dir().join(format!("headwise-rag-folds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("spec.toml");
        let with_folds = |folds: &str| {
            SPEC.replace(
                "format = \"hotpotqa\"\n",
                &format!("format = \"hotpotqa\"\nfold = {folds}\n"),
            )
        };
        for (folds, error) in [
            (
                r#"[{ rows = [0, 10], probe = "a.json" }, { rows = [5, 20], probe = "b.json" }]"#,
                "rows 0..10 and 5..20 overlap",
            ),
            (
                r#"[{ rows = [3, 3], probe = "a.json" }]"#,
                "rows 3..3 are empty",
            ),
        ] {
            std::fs::write(&path, with_folds(folds)).unwrap();
            let err = RagSpec::load(&path).unwrap_err().to_string();
            assert!(err.contains(error), "{err}");
        }
        let good =
            r#"[{ rows = [10, 20], probe = "a.json" }, { rows = [0, 10], probe = "b.json" }]"#;
        std::fs::write(&path, with_folds(good)).unwrap();
        assert_eq!(RagSpec::load(&path).unwrap().tasks[0].folds.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_probe_trained_on_a_folds_questions_is_refused() {
        let question = |id: &str| QaItem {
            id: id.into(),
            question: String::new(),
            answers: Vec::new(),
            paragraphs: Vec::new(),
        };
        let fold = [question("q3"), question("q4")];
        let path = Path::new("p.json");
        let trained_on = |ids: &[&str]| serde_json::json!({ "examples": ids });
        assert!(check_unseen(&trained_on(&["q1", "q2"]), path, &fold).is_ok());
        let err = check_unseen(&trained_on(&["q1", "q4"]), path, &fold)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("trained on 1 of the fold's questions (e.g. q4)"),
            "{err}"
        );
        let err = check_unseen(&serde_json::json!({ "prompts": 60 }), path, &fold)
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not list the questions"), "{err}");
    }
}
