//! `headwise eval run|report|kv-budget|kv-examples|kv-report`: ablation experiments and KV-budget
//! sweeps from spec files.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use headwise::lab::eval::kv_budget::{self, BudgetSpec};
use headwise::lab::eval::report::write_report;
use headwise::lab::eval::run::{RunOptions, Runner, Shard};
use headwise::lab::eval::spec::EvalSpec;
use headwise::lock::OutputLock;
use headwise::model::{arithmetic_fingerprint, LoadedModel, ModelId, Numerics};
use headwise::provenance::Made;

use super::{LlamaCppArgs, ModelArgs};

#[derive(Subcommand, Debug)]
pub enum EvalCommand {
    /// Run an experiment spec (resumes an interrupted run), then write its report.
    Run {
        #[command(flatten)]
        sweep: SweepArgs,
        /// Run only shard `i/n` of every task's examples (0-based); `eval report` merges
        /// the shards' records.
        #[arg(long)]
        shard: Option<String>,
        /// Answers generated at once: one decode step for all of them, each with the
        /// tokens it gets alone (more memory: one cache each).
        #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=256))]
        batch: u64,
    },
    /// (Re)write `summary.json`, `README.md` and plots from a run folder's records (all
    /// shards).
    Report {
        /// The run folder (`eval/results/<model>/<name>`).
        dir: PathBuf,
    },
    /// Run a KV-budget sweep (accuracy and speed of compression policies against resident
    /// KV bytes; resumes an interrupted run), then write its report.
    KvBudget(SweepArgs),
    /// Write a KV-budget spec's examples (prompt ids, where the question starts, answers,
    /// the metric) as JSON lines, for other tools to answer the same examples.
    KvExamples {
        #[command(flatten)]
        sweep: SweepArgs,
        /// The file to write.
        #[arg(long)]
        to: PathBuf,
    },
    /// Perplexity with the KV cache in f32, f16 and q8_0, headwise's stores beside
    /// `llama-perplexity -ctk/-ctv` on the same text: what fewer bits cost each engine.
    KvQuant {
        #[command(flatten)]
        llama: LlamaCppArgs,
        /// The result folder [default: eval/results/<model>/kv-quant].
        #[arg(long)]
        out: Option<PathBuf>,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// (Re)write the report of a KV-budget folder from its records.
    KvReport {
        /// The run folder (`eval/results/<model>/<name>`).
        dir: PathBuf,
    },
    /// Run a RAG experiment (closed book, all paragraphs, retrieval triggers; resumes an
    /// interrupted run), then write its report.
    Rag {
        #[command(flatten)]
        sweep: SweepArgs,
        /// Only (re)write the report from the records already there (e.g. of a run
        /// stopped part-way); generate nothing. The report records this command's
        /// --numerics: give the run's.
        #[arg(long)]
        report_only: bool,
    },
}

/// The arguments of every command that runs a spec against one model.
#[derive(Args, Debug)]
pub struct SweepArgs {
    /// The spec file (TOML), e.g. `eval/ablation-smollm2.toml`,
    /// `eval/kv-budget-smollm2.toml`, `eval/rag-smollm2.toml`.
    spec: PathBuf,
    /// At most this many examples per task (the first ones).
    #[arg(long)]
    limit: Option<usize>,
    /// Results root: the run writes to `<out>/<model>/<spec name>/`.
    #[arg(long, default_value = "eval/results")]
    out: PathBuf,
    /// Another data directory than the spec's.
    #[arg(long, env = "HEADWISE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(cmd: EvalCommand) -> anyhow::Result<()> {
    match cmd {
        EvalCommand::Run {
            sweep:
                SweepArgs {
                    spec,
                    limit,
                    out,
                    data_dir,
                    model,
                },
            shard,
            batch,
        } => {
            let mut spec = EvalSpec::load(&spec)?;
            if data_dir.is_some() {
                spec.data_dir = data_dir;
            }
            let shard = shard
                .as_deref()
                .map(Shard::parse)
                .transpose()?
                .unwrap_or(Shard::ALL);
            let model = model.or_model(&spec.model);
            let path = model.resolve()?;
            let id = ModelId::of_file(&path)?;
            let numerics = model.numerics_or(Numerics::Fast);
            let lm = LoadedModel::load(&path, numerics)?;
            let out_dir = out.join(&id.name).join(&spec.name);
            let _lock = OutputLock::acquire(
                &out_dir,
                &format!("run-shard-{}-of-{}", shard.index, shard.count),
            )?;
            let opts = RunOptions {
                out_dir,
                limit,
                shard,
                batch: batch as usize,
                made: resumable_made(&lm, numerics)?,
            };
            let runner = Runner::prepare(spec, &lm, &id, opts)?;
            for w in &runner.warnings {
                eprintln!("note: {w}");
            }
            let bar = super::progress(
                runner.planned() as u64,
                "{bar:40} {pos}/{len} answers, {elapsed} elapsed, ETA {eta} {msg}",
            );
            let stats = runner.run(Some(&bar))?;
            bar.finish_and_clear();
            eprintln!(
                "{} answers generated in {:.0} s, {} from an earlier run, {} skipped (controls \
                 the unablated model got wrong)",
                stats.generated, stats.secs, stats.resumed, stats.filtered
            );
            report(runner.out_dir().to_path_buf())
        }
        EvalCommand::Report { dir } => report(dir),
        EvalCommand::KvBudget(SweepArgs {
            spec,
            limit,
            out,
            data_dir,
            model,
        }) => {
            let mut spec = BudgetSpec::load(&spec)?;
            if data_dir.is_some() {
                spec.data_dir = data_dir;
            }
            let model = model.or_model(&spec.model);
            let path = model.resolve()?;
            let id = ModelId::of_file(&path)?;
            let numerics = model.numerics_or(Numerics::Fast);
            let lm = LoadedModel::load(&path, numerics)?;
            let dir = out.join(&id.name).join(&spec.name);
            let _lock = OutputLock::acquire(&dir, "kv-budget")?;
            let bar = super::progress(
                0,
                "{bar:40} {pos}/{len} answers, {elapsed} elapsed, ETA {eta} {msg}",
            );
            let made = resumable_made(&lm, numerics)?;
            let n = kv_budget::run(&spec, &lm, &id, &dir, limit, &made, Some(&bar))?;
            bar.finish_and_clear();
            eprintln!("{n} answers generated");
            kv_report(dir)
        }
        EvalCommand::KvQuant { llama, out, model } => {
            use headwise::lab::kv_quant;
            use headwise::reference::llama_cpp::LlamaCppBins;
            let path = model.resolve()?;
            let id = ModelId::of_file(&path)?;
            let bins = LlamaCppBins::find(llama.llama_bin.as_deref(), &path)?;
            let numerics = model.numerics_or(Numerics::Fast);
            let lm = LoadedModel::load(&path, numerics)?;
            let made = Made::now(numerics.name());
            let rows = kv_quant::run(&lm, &bins, &path, &llama.data_dir, &mut |r| {
                eprintln!("{} {}: perplexity {:.4}", r.engine, r.cache, r.ppl);
            })?;
            let dir = out.unwrap_or_else(|| {
                PathBuf::from("eval/results")
                    .join(&id.name)
                    .join("kv-quant")
            });
            kv_quant::write_report(&dir, &id, bins.dir(), &rows, &made)?;
            eprintln!("wrote {}", dir.display());
            Ok(())
        }
        EvalCommand::KvExamples { sweep, to } => {
            let mut spec = BudgetSpec::load(&sweep.spec)?;
            if sweep.data_dir.is_some() {
                spec.data_dir = sweep.data_dir;
            }
            let model = sweep.model.or_model(&spec.model);
            let path = model.resolve()?;
            let id = ModelId::of_file(&path)?;
            let numerics = model.numerics_or(Numerics::Fast);
            let lm = LoadedModel::load(&path, numerics)?;
            let examples = kv_budget::examples(&spec, &lm, sweep.limit)?;
            let answers = (&id, lm.special.stop.as_slice(), spec.max_new);
            kv_budget::write_examples(&to, &examples, answers, &Made::now(numerics.name()))?;
            eprintln!("wrote {} examples to {}", examples.len(), to.display());
            Ok(())
        }
        EvalCommand::KvReport { dir } => kv_report(dir),
        EvalCommand::Rag { sweep, report_only } => rag(sweep, report_only),
    }
}

/// The provenance of a run that continues its folder across processes: this process's,
/// with the fingerprint of the model's arithmetic, so that records are continued only by
/// a build that computes the same floats.
fn resumable_made(lm: &LoadedModel, numerics: Numerics) -> anyhow::Result<Made> {
    Ok(Made::now(numerics.name()).with_arithmetic(arithmetic_fingerprint(&lm.model)?))
}

fn rag(args: SweepArgs, report_only: bool) -> anyhow::Result<()> {
    use headwise::lab::rag_eval::{self as rag_eval, RagSpec};
    let SweepArgs {
        spec,
        limit,
        out,
        data_dir,
        model,
    } = args;
    let spec = RagSpec::load(&spec)?;
    let data_dir = data_dir
        .or_else(|| spec.data_dir.clone())
        .unwrap_or_else(|| PathBuf::from("../shared/data"));
    let path = model.or_model(&spec.model).resolve()?;
    let id = ModelId::of_file(&path)?;
    let numerics = model.numerics_or(Numerics::Fast);
    let lm = LoadedModel::load(&path, numerics)?;
    let dir = out.join(&id.name).join(&spec.name);
    let _lock = OutputLock::acquire(&dir, "rag")?;
    let bar = super::progress(
        0,
        "{bar:40} {pos}/{len} answers, {elapsed} elapsed, ETA {eta}",
    );
    let made = resumable_made(&lm, numerics)?;
    let n = match report_only {
        true => 0,
        false => rag_eval::run(&spec, &lm, &id, &data_dir, &dir, limit, &made, Some(&bar))?,
    };
    bar.finish_and_clear();
    // The report names the command that generates the records.
    let made = Made {
        command: made.command.replace(" --report-only", ""),
        ..made
    };
    let summary = rag_eval::write_report(&dir, &spec, &id, &made)?;
    eprintln!(
        "{n} answers generated; wrote {} summary numbers and README.md to {}",
        summary.len(),
        dir.display()
    );
    Ok(())
}

fn kv_report(dir: PathBuf) -> anyhow::Result<()> {
    let summary = kv_budget::write_report(&dir)?;
    eprintln!(
        "wrote {} summary numbers, README.md and plots to {}",
        summary.len(),
        dir.display()
    );
    Ok(())
}

fn report(dir: PathBuf) -> anyhow::Result<()> {
    let summary = write_report(&dir)?;
    eprintln!(
        "wrote {} summary numbers, README.md and plots to {}",
        summary.len(),
        dir.display()
    );
    Ok(())
}
