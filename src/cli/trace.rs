//! `headwise heads trace`: per-step retrieval-head labels with hidden states.

use std::collections::HashSet;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use headwise::lab::eval::datasets::hotpotqa;
use headwise::lab::eval::Example;
use headwise::lab::heads::trace::{
    record, Effective, Trace, TraceCard, TraceConfig, SCHEMA_VERSION,
};
use headwise::lab::tasks::{self, Encoder, Haystack, TaskKind, TaskSpec};
use headwise::model::{Interventions, LoadedModel, ModelId, Numerics};
use headwise::probe::LabelKind;
use headwise::provenance::Made;
use headwise::rag::corpus::CorpusFormat;
use headwise::rag::qa;

use super::ModelArgs;

/// Which task to trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TraceTask {
    /// Binary labels: the head copies the generated token from the needle.
    Niah,
    /// Continuous labels: attention mass on the supporting sentences.
    Hotpotqa,
}

#[derive(Args, Debug)]
pub struct TraceArgs {
    #[arg(long, value_enum)]
    task: TraceTask,
    /// NIAH haystack lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024")]
    lengths: Vec<usize>,
    /// NIAH needle depths.
    #[arg(long, value_delimiter = ',', default_value = "0,0.25,0.5,0.75,1")]
    depths: Vec<f64>,
    /// NIAH seeds per (length, depth) cell.
    #[arg(long, default_value_t = 2)]
    trials: u64,
    /// HotpotQA: the first N rows.
    #[arg(long, default_value_t = 40, conflicts_with = "rows")]
    limit: usize,
    /// HotpotQA: rows START..END of the file (0-based, END excluded), e.g. the half of a
    /// two-fold cross-fitting (`eval/rag-crossfit-*.toml`).
    #[arg(long, value_parser = parse_rows)]
    rows: Option<[usize; 2]>,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 16)]
    max_new: usize,
    /// Teacher-force the gold answer (` {answer}`) instead of generating [default for
    /// hotpotqa, where SmolLM2 often ends its turn at once; NIAH generates].
    #[arg(long)]
    teacher: Option<bool>,
    /// Continuous labels: attention-sink positions left out of the effective context.
    #[arg(long, default_value_t = Effective::default().sink)]
    sink: usize,
    /// Continuous labels: most recent positions left out of the effective context.
    #[arg(long, default_value_t = Effective::default().window)]
    window: usize,
    /// Data folder (essays for NIAH, HotpotQA rows).
    #[arg(long, env = "HEADWISE_DATA_DIR", default_value = "../shared/data")]
    data_dir: PathBuf,
    /// Output stem: writes STEM.safetensors and STEM.json [default:
    /// probes/<model>/traces/<task>].
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(args: TraceArgs) -> anyhow::Result<()> {
    let path = args.model.resolve()?;
    let id = ModelId::of_file(&path)?;
    let numerics = args.model.numerics_or(Numerics::Fast);
    let lm = LoadedModel::load(&path, numerics)?;
    let enc = Encoder::from_model(&lm);
    let (examples, task, kind) = match args.task {
        TraceTask::Niah => {
            let spec = TaskSpec {
                kind: TaskKind::Niah,
                lengths: args.lengths.clone(),
                depths: args.depths.clone(),
                seeds: (0..args.trials).collect(),
            };
            let hay = Haystack::from_dir(&args.data_dir.join("haystack/paul_graham"))?;
            let trials = tasks::generate(&spec, &enc, &hay)?;
            let ex: Vec<Example> = trials.iter().map(Example::from_trial).collect();
            (ex, serde_json::to_value(&spec)?, LabelKind::Binary)
        }
        TraceTask::Hotpotqa => {
            let file = args
                .data_dir
                .join("hotpotqa/hotpot_dev_distractor_200.jsonl");
            let (mut loaded, task) = match args.rows {
                None => (
                    hotpotqa::load(&file, &enc, Some(args.limit))?,
                    serde_json::json!({"task": "hotpotqa", "file": file, "limit": args.limit}),
                ),
                Some([start, end]) => (
                    hotpotqa::load(&file, &enc, None)?,
                    serde_json::json!({"task": "hotpotqa", "file": file, "rows": [start, end]}),
                ),
            };
            match args.rows {
                None => loaded
                    .skipped
                    .iter()
                    .for_each(|s| eprintln!("note: skipped {s}")),
                // Skipped rows carry file lines, not row numbers: count the range's losses.
                Some([start, end]) => {
                    let ids = row_ids(&file, [start, end])?;
                    loaded.examples.retain(|e| ids.contains(&e.id));
                    if loaded.examples.len() < ids.len() {
                        eprintln!(
                            "note: {} of the {} questions of rows {start}..{end} skipped (too long or malformed)",
                            ids.len() - loaded.examples.len(),
                            ids.len()
                        );
                    }
                }
            }
            (loaded.examples, task, LabelKind::Continuous)
        }
    };
    if examples.is_empty() {
        anyhow::bail!("no example to trace");
    }
    let cfg = TraceConfig {
        label_kind: kind,
        effective: Effective {
            sink: args.sink,
            window: args.window,
        },
        max_new: args.max_new,
        teacher: args.teacher.unwrap_or(args.task == TraceTask::Hotpotqa),
    };
    let mc = lm.model.config();
    let mut trace = Trace::empty(kind, mc.n_layers, mc.n_heads, mc.d_model);
    let bar = super::progress(
        examples.len() as u64,
        "{bar:40} {pos}/{len} prompts, {elapsed} elapsed, ETA {eta} {msg}",
    );
    let none = Interventions::new();
    for (i, ex) in examples.iter().enumerate() {
        bar.set_message(ex.id.clone());
        let gold = if cfg.teacher {
            Some(enc.encode(&format!(" {}", ex.answers[0]))?)
        } else {
            None
        };
        let steps = record(&lm, ex, &cfg, gold.as_deref(), &mut |_| none.clone())?;
        trace.push(i, &steps)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let name = match args.task {
        TraceTask::Niah => "niah",
        TraceTask::Hotpotqa => "hotpotqa",
    };
    let stem = args.out.unwrap_or_else(|| {
        PathBuf::from("probes")
            .join(&id.name)
            .join("traces")
            .join(name)
    });
    let steps_active = trace
        .labels
        .rows()
        .into_iter()
        .filter(|r| r.iter().any(|&v| v >= 0.5))
        .count();
    let card = TraceCard {
        schema_version: SCHEMA_VERSION,
        model: id.name.clone(),
        model_sha256: id.sha256.clone(),
        task,
        config: cfg,
        label_kind: kind,
        n_layers: mc.n_layers,
        n_heads: mc.n_heads,
        d_model: mc.d_model,
        prompts: examples.len(),
        steps: trace.len(),
        label_mean: trace.labels.mean().unwrap_or(0.0) as f64,
        steps_with_active_head: steps_active,
        examples: examples.iter().map(|e| e.id.clone()).collect(),
        made: Made::now(numerics.name()),
    };
    trace.save(&stem, &card)?;
    eprintln!(
        "{} prompts, {} steps ({} with an active head), label mean {:.4}: {}.json/.safetensors",
        card.prompts,
        card.steps,
        steps_active,
        card.label_mean,
        stem.display()
    );
    Ok(())
}

/// `START..END` (END excluded, START < END).
fn parse_rows(s: &str) -> Result<[usize; 2], String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("`{s}` is not a row range START..END"))?;
    let num = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|_| format!("`{x}` in `{s}` is not a row number"))
    };
    let (start, end) = (num(a)?, num(b)?);
    if start >= end {
        return Err(format!("the row range `{s}` is empty"));
    }
    Ok([start, end])
}

/// The question ids of rows `rows[0]..rows[1]` of a HotpotQA file (the rows the RAG
/// evaluation's folds name: every non-blank line is a row).
fn row_ids(file: &std::path::Path, rows: [usize; 2]) -> anyhow::Result<HashSet<String>> {
    let items = qa::load(file, CorpusFormat::Hotpotqa, Some(rows[1]))?;
    if items.len() < rows[1] {
        anyhow::bail!(
            "rows {}..{}: {} has {} questions",
            rows[0],
            rows[1],
            file.display(),
            items.len()
        );
    }
    Ok(items[rows[0]..].iter().map(|q| q.id.clone()).collect())
}
