//! RAG experiments from a spec: every question of every task answered under every
//! variant (closed book, all paragraphs, `once`, `every_n`, `rind`, `retrieval_heads`),
//! retrieving with BM25 from the task's paragraph pool (every question's paragraphs,
//! deduplicated, indexed in memory). One JSON line per (task, question, variant) in
//! `records.jsonl`, so a run resumes; [`write_report`] writes `summary.json` (em, f1,
//! retrievals, generated_tokens, secs) and `README.md`.
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

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use crate::lab::eval::run::{append_jsonl, open_append, read_jsonl};
use crate::lab::plot::{interval_panels, Panel};
use crate::lab::stats::mean_se;
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
        if let Some(unknown) = spec
            .compare
            .iter()
            .flatten()
            .find(|c| !spec.variants.iter().any(|v| &&v.name == c))
        {
            return Err(Error::invalid(
                "compare",
                format!("no variant named `{unknown}`"),
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

/// Run every (task, question, variant) not yet in `out/records.jsonl`; returns how many
/// answers were generated.
pub fn run(
    spec: &RagSpec,
    lm: &LoadedModel,
    id: &ModelId,
    data_dir: &Path,
    out: &Path,
    limit: Option<usize>,
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
    let probe = match spec.variants.iter().any(uses_probe) {
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
    let signal = HeadSignal {
        probe: probe.as_ref(),
        heads: &watched,
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
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let path = out.join("records.jsonl");
    let done: BTreeSet<(String, String, String)> = read_jsonl::<RagRecord>(&path)?
        .into_iter()
        .map(|r| (r.task, r.id, r.variant))
        .collect();
    let mut file = open_append(&path)?;
    let mut generated = 0;
    for task in &spec.tasks {
        let all = qa::load(&data_dir.join(&task.file), task.format, None)?;
        let passages = pool(all.iter().flat_map(|q| {
            q.paragraphs
                .iter()
                .map(|p| (p.title.as_str(), p.text.as_str()))
        }));
        let index = Bm25Index::in_memory(&passages)?;
        let n = [task.limit, limit]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(all.len());
        let items: Vec<&QaItem> = all.iter().take(n).collect();
        let variants: Vec<&Variant> = spec
            .variants
            .iter()
            .filter(|v| v.runs_on(&task.name))
            .collect();
        if let Some(b) = bar {
            b.inc_length((items.len() * variants.len()) as u64);
        }
        for item in items {
            for v in variants.iter().copied() {
                if let Some(b) = bar {
                    b.inc(1);
                }
                if done.contains(&(task.name.clone(), item.id.clone(), v.name.clone())) {
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
            }
        }
    }
    Ok(generated)
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

/// Per task, F1 of `a` minus F1 of `b` on the questions both answered: mean ± standard
/// error of the paired differences, and on how many questions `a` scored higher, lower or
/// the same. Every variant against the first, then the spec's `compare` pairs.
fn paired_differences(spec: &RagSpec, records: &[RagRecord]) -> String {
    let f1: BTreeMap<(&str, &str, &str), f64> = records
        .iter()
        .map(|r| ((r.task.as_str(), r.variant.as_str(), r.id.as_str()), r.f1))
        .collect();
    let first = &spec.variants[0].name;
    let pairs = spec.variants[1..]
        .iter()
        .map(|v| [v.name.clone(), first.clone()])
        .chain(spec.compare.iter().cloned());
    let mut md = String::new();
    for [a, b] in pairs {
        for task in &spec.tasks {
            let diffs: Vec<f64> = f1
                .iter()
                .filter(|((t, v, _), _)| *t == task.name && *v == a)
                .filter_map(|((t, _, id), fa)| f1.get(&(*t, b.as_str(), *id)).map(|fb| fa - fb))
                .collect();
            if diffs.is_empty() {
                continue;
            }
            if md.is_empty() {
                md.push_str(
                    "\nF1 differences on the same questions (mean ± standard error of the \
                     per-question difference; questions where the first variant scored \
                     higher / lower / the same):\n\n\
                     | task | variants | n | ΔF1 | higher / lower / same |\n\
                     |---|---|---:|---:|---:|\n",
                );
            }
            let (mean, se) = mean_se(&diffs);
            let count = |f: fn(&f64) -> bool| diffs.iter().filter(|d| f(d)).count();
            md.push_str(&format!(
                "| {} | `{a}` − `{b}` | {} | {mean:+.3} ± {se:.3} | {} / {} / {} |\n",
                task.name,
                diffs.len(),
                count(|d| *d > 0.0),
                count(|d| *d < 0.0),
                count(|d| *d == 0.0)
            ));
        }
    }
    md
}

/// Write `summary.json` and `README.md` of a run folder from its records, in the
/// spec's variant order; `made` is the provenance of the run (its command the one that
/// generates the records).
pub fn write_report(
    dir: &Path,
    spec: &RagSpec,
    id: &ModelId,
    made: &Made,
) -> Result<Vec<ResultRecord>> {
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
    md.push_str(&paired_differences(spec, &records));
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
        // b - a = 0.5, -0.25, 0: mean 0.083, sd 0.382, se 0.220
        assert!(
            md.contains("| t | `b` − `a` | 3 | +0.083 ± 0.220 | 1 / 1 / 1 |"),
            "{md}"
        );
        assert!(
            md.contains("| t | `c` − `a` | 1 | +1.000 ± 0.000 | 1 / 0 / 0 |"),
            "{md}"
        );
        assert!(
            md.contains("| t | `c` − `b` | 1 | +0.500 ± 0.000 | 1 / 0 / 0 |"),
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
}
