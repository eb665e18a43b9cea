//! `headwise heads trace`: per-step retrieval-head labels with hidden states. Each
//! prompt's steps are appended to `.<stem>.partial.jsonl` beside the output as they are
//! recorded, so an interrupted trace resumes, and another grid (more seeds or rows)
//! reuses the prompts it shares with the file; the file goes when the trace is written
//! and holds no prompt of another grid.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use headwise::lab::eval::datasets::hotpotqa;
use headwise::lab::eval::Example;
use headwise::lab::heads::trace::{
    record, Effective, ExampleSteps, Trace, TraceCard, TraceConfig, SCHEMA_VERSION,
};
use headwise::lab::tasks::{self, Encoder, Haystack, TaskKind, TaskSpec};
use headwise::lock::OutputLock;
use headwise::model::{arithmetic_fingerprint, Interventions, LoadedModel, ModelId, Numerics};
use headwise::probe::LabelKind;
use headwise::provenance::{self, Made};
use headwise::rag::corpus::CorpusFormat;
use headwise::rag::qa;
use headwise::results::write_atomic;

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
    let file_name = stem
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| anyhow::anyhow!("--out {}: not a file stem", stem.display()))?;
    let dir = match stem.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let _lock = OutputLock::acquire(&dir, &format!("trace-{file_name}"))?;
    let header = PartialHeader {
        model_sha256: id.sha256.clone(),
        task: name.to_string(),
        config: cfg,
        numerics: numerics.name().to_string(),
        cpu: provenance::cpu(),
        arithmetic: Some(arithmetic_fingerprint(&lm.model)?),
    };
    let partial = dir.join(format!(".{file_name}.partial.jsonl"));
    let mut done = resume(&partial, &header)?;
    // Rewrite the file whole (a line cut by an interruption goes), keeping the prompts of
    // other grids too, then append each new prompt as it is done.
    let mut text = serde_json::to_string(&header)? + "\n";
    for (id, (tokens, steps)) in &done {
        let line = PartialPrompt {
            id: id.clone(),
            tokens: *tokens,
            steps: steps.clone(),
        };
        text += &(serde_json::to_string(&line)? + "\n");
    }
    write_atomic(&partial, text.as_bytes())?;
    let mut log = std::fs::OpenOptions::new().append(true).open(&partial)?;
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
        let tokens = tokens_hash(&ex.prompt, gold.as_deref());
        let steps = match done.remove(&ex.id) {
            Some((stored, steps)) if stored == tokens => steps,
            // not stored, or stored for other tokens (the later line wins on resume)
            _ => {
                let steps = record(&lm, ex, &cfg, gold.as_deref(), &mut |_| none.clone())?;
                let line = PartialPrompt {
                    id: ex.id.clone(),
                    tokens,
                    steps,
                };
                log.write_all((serde_json::to_string(&line)? + "\n").as_bytes())?;
                log.flush()?;
                line.steps
            }
        };
        trace.push(i, &steps)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
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
    // The file goes unless it holds prompts of another grid.
    if done.is_empty() {
        std::fs::remove_file(&partial)?;
    }
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

/// The first line of a trace's partial file: the run its prompts belong to. Under the
/// same header a prompt's line is reused by any grid that holds the same id and tokens
/// ([`PartialPrompt::tokens`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct PartialHeader {
    model_sha256: String,
    task: String,
    config: TraceConfig,
    numerics: String,
    /// [`provenance::cpu`]: greedy steps differ between kernels.
    cpu: String,
    /// [`arithmetic_fingerprint`]: the same CPU with another build may give other floats.
    /// Absent in files written before it was recorded.
    #[serde(default)]
    arithmetic: Option<String>,
}

/// One prompt's steps, a line of the partial file.
#[derive(serde::Serialize, serde::Deserialize)]
struct PartialPrompt {
    id: String,
    /// [`tokens_hash`] of the prompt and the forced answer: an id does not fix every
    /// detail of the text (a depth is named in whole percent, the haystack by its folder),
    /// so a line is reused only for the same tokens.
    tokens: u64,
    steps: ExampleSteps,
}

/// FNV-1a (64-bit) over `prompt` then `forced`, as little-endian bytes: fixed forever, so
/// partial files written by one build are read by the next.
fn tokens_hash(prompt: &[u32], forced: Option<&[u32]>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let parts = [prompt, &[u32::MAX], forced.unwrap_or(&[])];
    for t in parts.into_iter().flatten() {
        for b in t.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The prompts already in `partial` for the same run, by id; a file of another run is an
/// error, and a line cut by an interruption is dropped (its prompt is traced again).
fn resume(
    partial: &Path,
    header: &PartialHeader,
) -> anyhow::Result<HashMap<String, (u64, ExampleSteps)>> {
    let text = match std::fs::read_to_string(partial) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => anyhow::bail!("{}: {e}", partial.display()),
    };
    let mut lines = text.lines();
    let Some(first) = lines.next() else {
        return Ok(HashMap::new());
    };
    let found: PartialHeader = serde_json::from_str(first)
        .map_err(|e| anyhow::anyhow!("{}: unreadable header ({e})", partial.display()))?;
    // a file written before the fingerprint was recorded is compared without it
    let expected = PartialHeader {
        arithmetic: found.arithmetic.as_ref().and(header.arithmetic.clone()),
        ..header.clone()
    };
    if found != expected {
        anyhow::bail!(
            "{} holds prompts of a different trace (model, task, --max-new, --teacher, --sink, --window, numerics, CPU or arithmetic fingerprint: made on {}); remove it to start over",
            partial.display(),
            found.cpu
        );
    }
    let done: HashMap<String, (u64, ExampleSteps)> = lines
        .filter_map(|l| serde_json::from_str::<PartialPrompt>(l).ok())
        .map(|p| (p.id, (p.tokens, p.steps)))
        .collect();
    if !done.is_empty() {
        eprintln!(
            "resuming: {} prompts already traced in {}",
            done.len(),
            partial.display()
        );
    }
    Ok(done)
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
