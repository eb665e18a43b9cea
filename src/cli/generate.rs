//! `headwise generate`: stream a generation to stdout, speeds to stderr.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use headwise::model::text::chat::ChatMessage;
use headwise::model::{
    generate, GenerateOptions, Interventions, LoadedModel, NoObserver, Numerics, Sampling,
    TextStream,
};

use headwise::policy::{GenerateRequest, Policy, Prompt, Runtime};

use super::{read_utf8, ModelArgs};

/// Which engine generates.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// headwise's own instrumented forward pass.
    Instrumented,
    /// mistral.rs, compiled into the same binary.
    #[cfg(feature = "mistralrs")]
    Mistralrs,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The prompt text.
    #[arg(
        long,
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    prompt: Option<String>,
    /// Read the prompt from a UTF-8 file (for long prompts).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature (omit or 0 for greedy).
    #[arg(long)]
    temperature: Option<f64>,
    /// Nucleus sampling mass in (0, 1].
    #[arg(long)]
    top_p: Option<f64>,
    /// Sampling seed [default: 0]; the instrumented engine only (mistral.rs samples with
    /// its own fixed seed).
    #[arg(long)]
    seed: Option<u64>,
    /// Engine.
    #[arg(long, value_enum, default_value = "instrumented")]
    engine: Engine,
    /// A compression policy (TOML, e.g. policies/static-locos.toml); prints its KV stats.
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Override a policy key (`window=128`, `heads.select.top_k=9`); repeatable. Without
    /// --policy, these alone define it (`type=window`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The probe of a dynamic_heads policy (overrides the file's).
    #[arg(long)]
    probe: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let prompt = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_utf8(f)?,
        (None, None) => anyhow::bail!("give --prompt or --prompt-file"),
    };
    if args.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    let sampling = Sampling {
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed.unwrap_or(0),
    };
    sampling.validate()?;
    let path = args.model.resolve()?;
    let policy = match (&args.policy, args.set.is_empty(), &args.probe) {
        (Some(file), _, _) => Some(Policy::load(file, &args.set)?),
        (None, false, _) => Some(Policy::from_overrides(&args.set)?),
        (None, true, Some(_)) => anyhow::bail!("--probe needs a dynamic_heads --policy"),
        (None, true, None) => None,
    };
    if let Some(policy) = policy {
        if args.engine != Engine::Instrumented {
            anyhow::bail!("--policy runs on the instrumented engine");
        }
        return with_policy(&args, &prompt, sampling, &path, policy);
    }
    match args.engine {
        Engine::Instrumented => instrumented(&args, &prompt, sampling, &path),
        #[cfg(feature = "mistralrs")]
        Engine::Mistralrs if args.seed.is_some() => anyhow::bail!(
            "--seed is not supported by --engine mistralrs: mistral.rs seeds its sampler \
             with a fixed value of its own; use --engine instrumented"
        ),
        #[cfg(feature = "mistralrs")]
        Engine::Mistralrs => reference(&args, &prompt, &path),
    }
}

fn with_policy(
    args: &GenerateArgs,
    prompt: &str,
    sampling: Sampling,
    path: &std::path::Path,
    policy: Policy,
) -> anyhow::Result<()> {
    let mut builder = Runtime::builder().model(path).policy(policy);
    if let Some(probe) = &args.probe {
        builder = builder.probe(probe);
    }
    let runtime = builder.build()?;
    let prompt = if args.chat {
        Prompt::Chat(vec![ChatMessage {
            role: "user".into(),
            content: prompt.to_string(),
        }])
    } else {
        Prompt::Text(prompt.to_string())
    };
    let request = GenerateRequest {
        prompt,
        max_tokens: args.max_tokens,
        sampling,
        ignore_eos: false,
        explain: None,
    };
    let mut stdout = std::io::stdout().lock();
    let out = runtime.generate(&request, &mut |step| {
        let _ = write!(stdout, "{}", step.text);
        let _ = stdout.flush();
        true
    })?;
    writeln!(stdout)?;
    eprintln!("{}", out.stats);
    Ok(())
}

fn instrumented(
    args: &GenerateArgs,
    prompt: &str,
    sampling: Sampling,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    let numerics = args.model.numerics_or(Numerics::Fast);
    let lm = LoadedModel::load(path, numerics)?;
    let ids = if args.chat {
        lm.chat_prompt(&[ChatMessage {
            role: "user".into(),
            content: prompt.to_string(),
        }])?
    } else {
        lm.encode(prompt, true)?
    };
    let opts = GenerateOptions {
        max_new: args.max_tokens,
        sampling,
        stop: lm.special.stop.clone(),
        context_len: None,
    };
    let mut stream = TextStream::default();
    let mut stdout = std::io::stdout().lock();
    let mut failure = None;
    let gen = generate(
        &lm.model,
        &ids,
        &opts,
        &mut NoObserver,
        &Interventions::new(),
        &mut |tok, _| {
            if lm.special.stop.contains(&tok) {
                return true;
            }
            match stream.push(&lm.tokenizer, tok) {
                Ok(Some(piece)) => {
                    let _ = write!(stdout, "{piece}");
                    let _ = stdout.flush();
                    true
                }
                Ok(None) => true,
                Err(e) => {
                    failure = Some(e);
                    false
                }
            }
        },
    )?;
    if let Some(e) = failure {
        return Err(e.into());
    }
    writeln!(stdout)?;
    eprintln!(
        "instrumented ({:?}): prompt {} tokens, prefill {:.1} tok/s; generated {} tokens, decode {:.1} tok/s",
        numerics,
        gen.prompt_tokens,
        gen.prefill_tok_s(),
        gen.tokens.len(),
        gen.decode_tok_s()
    );
    Ok(())
}

#[cfg(feature = "mistralrs")]
fn reference(args: &GenerateArgs, prompt: &str, path: &std::path::Path) -> anyhow::Result<()> {
    use headwise::reference::mistralrs::MistralRsEngine;
    let engine = MistralRsEngine::load(path)?;
    let mut stdout = std::io::stdout().lock();
    let mut print = |piece: &str| {
        let _ = write!(stdout, "{piece}");
        let _ = stdout.flush();
    };
    let stats = if args.chat {
        let messages = [("user".to_string(), prompt.to_string())];
        engine.chat_stream(
            &messages,
            args.max_tokens,
            args.temperature,
            args.top_p,
            &mut print,
        )?
    } else {
        engine.complete_stream(
            prompt,
            args.max_tokens,
            args.temperature,
            args.top_p,
            &mut print,
        )?
    };
    println!();
    eprintln!(
        "mistral.rs: prompt {} tokens, prefill {:.1} tok/s; generated {} tokens, decode {:.1} tok/s",
        stats.prompt_tokens, stats.prefill_tok_s, stats.generated_tokens, stats.decode_tok_s
    );
    Ok(())
}
