//! `headwise model fetch|info|fingerprint`.

use std::path::PathBuf;

use clap::Subcommand;
use headwise::model::file::fetch::{self, Fetched, DEFAULT_MODELS_DIR};
use headwise::model::{arithmetic_fingerprint, Config, GgufFile, LoadedModel, Numerics};
use headwise::provenance::Made;

use super::ModelArgs;

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Fetch a known model (default: smollm2-135m) into the models directory; a model
    /// already there with the right sha256 is left alone.
    Fetch {
        /// Model name.
        #[arg(default_value = "smollm2-135m")]
        name: String,
        /// Target directory.
        #[arg(long, env = "HEADWISE_MODELS_DIR", default_value = DEFAULT_MODELS_DIR)]
        models_dir: PathBuf,
    },
    /// Print the configuration read from a GGUF file's metadata and its tensor types.
    Info {
        /// GGUF file.
        path: PathBuf,
    },
    /// Print the fingerprint of the model's arithmetic in this build, on this CPU, with
    /// these numerics: a hash of the exact floats of a fixed computation. A resumed
    /// evaluation (`eval run`, `eval kv-budget`, `eval rag`) continues a folder only with
    /// the fingerprint its `run.json` records (`arithmetic`).
    Fingerprint {
        #[command(flatten)]
        model: ModelArgs,
    },
}

pub fn run(cmd: ModelCommand) -> anyhow::Result<()> {
    match cmd {
        ModelCommand::Fetch { name, models_dir } => {
            let model = fetch::known(&name)?;
            match fetch::ensure(&models_dir, model)? {
                Fetched::AlreadyPresent(p) => {
                    println!("{} already present, sha256 ok", p.display())
                }
                Fetched::Downloaded(p) => {
                    println!("fetched {} (sha256 {})", p.display(), model.sha256)
                }
            }
        }
        ModelCommand::Info { path } => {
            let file = GgufFile::open(&path)?;
            let cfg = Config::from_gguf(file.content())?;
            println!("{}", serde_json::to_string_pretty(&cfg)?);
            let mut types = std::collections::BTreeMap::<String, usize>::new();
            for info in file.content().tensor_infos.values() {
                *types.entry(format!("{:?}", info.ggml_dtype)).or_default() += 1;
            }
            let types: Vec<String> = types.iter().map(|(t, n)| format!("{t} x{n}")).collect();
            println!("tensor types: {}", types.join(", "));
        }
        ModelCommand::Fingerprint { model } => {
            let path = model.resolve()?;
            let numerics = model.numerics_or(Numerics::Fast);
            let lm = LoadedModel::load(&path, numerics)?;
            let made = Made::now(numerics.name());
            println!(
                "{}  {} {} numerics, {}, commit {}",
                arithmetic_fingerprint(&lm.model)?,
                path.display(),
                made.numerics,
                made.cpu,
                made.git_commit.as_deref().unwrap_or("unknown")
            );
        }
    }
    Ok(())
}
