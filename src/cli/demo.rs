//! `headwise demo`: the tool's main job on built-in defaults. A long document with one
//! fact hidden in it (the built-in synthetic notes), one question about the fact, answered
//! under the full cache and under a compression policy that keeps the whole history only
//! on retrieval heads; prints both answers and the KV memory each held.

use std::path::PathBuf;

use clap::Args;
use headwise::model::text::chat::ChatMessage;
use headwise::policy::{GenerateOutput, GenerateRequest, Policy, Prompt, Runtime};
use headwise::synthetic::synthetic_notes;

use super::ModelArgs;

/// The fact the built-in document hides (after note 51), and the question about it.
const FACT: &str = "4817";
const NEEDLE_AFTER: usize = 50;
const QUESTION: &str = "What is the secret number of the archive? Answer with the number only.";

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// The compression policy to compare with the full cache.
    #[arg(long, default_value = "policies/static-locos.toml")]
    policy: PathBuf,
    /// Notes in the document (~26 tokens each in SmolLM2's tokenizer); the fact follows
    /// note 51, so more notes put it further before the question.
    #[arg(long, default_value_t = 80, value_parser = clap::value_parser!(u64).range(60..=2000))]
    notes: u64,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..=256))]
    max_tokens: u64,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if !args.policy.exists() {
        anyhow::bail!(
            "{}: no such policy file (run from the repository's root, or pass --policy FILE)",
            args.policy.display()
        );
    }
    let policy = Policy::load(&args.policy, &[])?;
    let path = args.model.resolve()?;
    eprintln!("loading {}", path.display());
    let full = Runtime::builder().model(&path).build()?;
    let compressed = full.with_policy(&policy, ".".as_ref())?;

    let document = synthetic_notes(args.notes as usize, Some(NEEDLE_AFTER));
    let request = GenerateRequest::new(
        Prompt::Chat(vec![ChatMessage::user(format!(
            "{document}\nQuestion: {QUESTION}"
        ))]),
        args.max_tokens as usize,
    );
    let prompt_tokens = full.encode(&request.prompt)?.len();
    // What the model reads after the fact: the notes after it and the question.
    let after = document.split_once(FACT).map_or("", |(_, rest)| rest);
    let after_tokens = full
        .encode(&Prompt::Text(format!("{after}\nQuestion: {QUESTION}")))?
        .len();
    println!(
        "{}: a {prompt_tokens}-token document of {} notes with one fact in it (\"The secret \
         number of the archive is {FACT}\", after note {}, about {after_tokens} tokens before \
         the end).\nQuestion: {QUESTION}\n",
        full.model_id().name,
        args.notes,
        NEEDLE_AFTER + 1
    );
    let a = answer(&full, &request, "full")?;
    let name = args
        .policy
        .file_stem()
        .map_or_else(|| "policy".into(), |s| s.to_string_lossy().into_owned());
    let b = answer(&compressed, &request, &name)?;
    let (peak_full, peak_policy) = (a.stats.kv.peak.total(), b.stats.kv.peak.total());
    println!(
        "\n{name} held {:.1}% of the full cache's peak KV memory ({} against {}); its answer \
         {} the fact, the full cache's {}.",
        100.0 * peak_policy as f64 / peak_full.max(1) as f64,
        mib(peak_policy),
        mib(peak_full),
        holds(&b),
        holds(&a),
    );
    Ok(())
}

/// Generate the answer under `runtime`, printing it with its memory and speed.
fn answer(
    runtime: &Runtime,
    request: &GenerateRequest,
    name: &str,
) -> anyhow::Result<GenerateOutput> {
    let out = runtime.generate(request, &mut |_| true)?;
    let s = &out.stats;
    println!(
        "{name:>14}: {:?}\n{:>14}  KV peak {} (hot {}, cold {}); prefill {:.0} tok/s, decode {:.0} tok/s",
        out.text.trim(),
        "",
        mib(s.kv.peak.total()),
        mib(s.kv.peak.hot),
        mib(s.kv.peak.cold),
        s.prefill_tok_s,
        s.decode_tok_s,
    );
    Ok(out)
}

fn holds(out: &GenerateOutput) -> &'static str {
    if out.text.contains(FACT) {
        "holds"
    } else {
        "misses"
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}
