//! `headwise parity`: the instrumented model against a reference engine, mistral.rs
//! (llama models) or llama.cpp (Gemma 3), prompt by prompt.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use headwise::model::{Architecture, Config, GgufFile, LoadedModel, ModelId, Numerics};
use headwise::provenance::{machine, Made};
use headwise::reference::llama_cpp::LlamaCppBins;
#[cfg(feature = "mistralrs")]
use headwise::reference::mistralrs::MistralRsEngine;
use headwise::reference::parity::llama_cpp::{
    self, GreedyParity, LlamaCppReport, PPL_CHUNKS, PPL_CTX,
};
#[cfg(feature = "mistralrs")]
use headwise::reference::parity::{self, ParityReport, PromptParity};
use headwise::reference::parity::{Divergence, GREEDY_TOKENS};
use headwise::results::{recorder, write_experiment, ResultRecord};

use super::{LlamaCppArgs, ModelArgs};

/// The engine compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Reference {
    /// mistral.rs for llama models, llama.cpp for Gemma 3.
    Auto,
    /// mistral.rs 0.8 compiled into this binary.
    Mistralrs,
    /// llama.cpp's `llama-server` and `llama-perplexity` binaries.
    #[value(name = "llama.cpp")]
    LlamaCpp,
}

/// One record per prompt and metric, plus the overall verdict numbers.
#[cfg(feature = "mistralrs")]
fn records(report: &ParityReport, id: &ModelId, made: &Made) -> Vec<ResultRecord> {
    let experiment = format!("parity-{}", made.numerics);
    let rec = recorder(&experiment, id, Some("none"), made);
    let mut out = Vec::new();
    for p in &report.prompts {
        let task = format!("parity-{}", p.name);
        out.push(rec(
            &task,
            Some(p.tokens),
            "max_abs_dlogit",
            p.max_abs_diff as f64,
            p.tokens,
        ));
        out.push(rec(
            &task,
            Some(p.tokens),
            "mean_abs_dlogit",
            p.mean_abs_diff as f64,
            p.tokens,
        ));
        out.push(rec(
            &task,
            Some(p.tokens),
            "top1_agreement",
            p.top1_agree as f64 / p.tokens.max(1) as f64,
            p.tokens,
        ));
        out.push(rec(
            &task,
            Some(p.tokens),
            "greedy_identical",
            f64::from(u8::from(p.divergence.is_none())),
            GREEDY_TOKENS,
        ));
    }
    let total: usize = report.prompts.iter().map(|p| p.tokens).sum();
    out.push(rec(
        "parity-all",
        None,
        "top1_agreement",
        report.top1_rate(),
        total,
    ));
    out.push(rec(
        "parity-all",
        None,
        "greedy_identical",
        report.identical() as f64,
        report.prompts.len(),
    ));
    out
}

#[derive(Args, Debug)]
pub struct ParityArgs {
    /// The engine to compare against.
    #[arg(long, value_enum, default_value_t = Reference::Auto)]
    reference: Reference,
    #[command(flatten)]
    llama: LlamaCppArgs,
    /// Also write the report (README.md + summary.json) into this folder, e.g.
    /// eval/results/SmolLM2-135M-Instruct.Q4_1/parity.
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

/// "identical" or where and how closely the continuations split.
fn greedy_cell(divergence: Option<&Divergence>, ours: &str, reference: &str) -> String {
    match divergence {
        None => format!("identical ({GREEDY_TOKENS})"),
        Some(d) => format!(
            "differs at {} (top-2 gap {ours} {:.4}, {reference} {:.4}{})",
            d.step,
            d.gap_ours,
            d.gap_reference,
            if d.near_tie() { ", near-tie" } else { "" }
        ),
    }
}

pub fn run(args: ParityArgs) -> anyhow::Result<()> {
    let path = args.model.resolve()?;
    let reference = match args.reference {
        Reference::Auto => {
            let cfg = Config::from_gguf(GgufFile::open(&path)?.content())?;
            match cfg.architecture {
                Architecture::Llama => Reference::Mistralrs,
                Architecture::Gemma3 => Reference::LlamaCpp,
            }
        }
        r => r,
    };
    // Each reference engine's own arithmetic, unless --numerics says otherwise.
    let numerics = args.model.numerics_or(match reference {
        Reference::LlamaCpp => Numerics::Ggml,
        _ => Numerics::Reference,
    });
    let started = std::time::Instant::now();
    let passed = match reference {
        Reference::LlamaCpp => run_llama_cpp(&args, &path, numerics, started)?,
        #[cfg(feature = "mistralrs")]
        _ => run_mistralrs(&args, &path, numerics, started)?,
        #[cfg(not(feature = "mistralrs"))]
        _ => anyhow::bail!("this build has no mistral.rs (feature `mistralrs` off)"),
    };
    if !passed {
        anyhow::bail!("parity bar not met");
    }
    Ok(())
}

/// Write the report folder if `--out` asked for one.
fn write_report(
    args: &ParityArgs,
    title: &str,
    body: &str,
    started: std::time::Instant,
    records: &dyn Fn(&ModelId, &Made) -> Vec<ResultRecord>,
    path: &Path,
    made: &Made,
) -> anyhow::Result<()> {
    let Some(dir) = &args.out else {
        return Ok(());
    };
    let id = ModelId::of_file(path)?;
    let readme = format!(
        "# {title}\n\nModel `{}` (sha256 `{}`).\n\n{body}\n\nCommand: `{}` ({:.0} s wall time, {}).\n",
        id.name,
        id.sha256,
        made.command,
        started.elapsed().as_secs_f64(),
        machine(),
    );
    write_experiment(dir, &readme, &records(&id, made), made)?;
    eprintln!("wrote {}", dir.display());
    Ok(())
}

#[cfg(feature = "mistralrs")]
fn row(p: &PromptParity) -> String {
    format!(
        "| {} | {} | {:.4} | {:.5} | {:.2}% | {} |",
        p.name,
        p.tokens,
        p.max_abs_diff,
        p.mean_abs_diff,
        100.0 * p.top1_agree as f64 / p.tokens.max(1) as f64,
        greedy_cell(p.divergence.as_ref(), "ours", "mistral.rs")
    )
}

#[cfg(feature = "mistralrs")]
fn run_mistralrs(
    args: &ParityArgs,
    path: &Path,
    numerics: Numerics,
    started: std::time::Instant,
) -> anyhow::Result<bool> {
    eprintln!(
        "loading {} (instrumented, {numerics:?} numerics)",
        path.display()
    );
    let ours = LoadedModel::load(path, numerics)?;
    eprintln!("loading {} (mistral.rs, F32)", path.display());
    let reference = MistralRsEngine::load(path)?;
    let mut table = vec![
        format!("| prompt | tokens | max abs dlogit | mean abs dlogit | top-1 agree | greedy {GREEDY_TOKENS} tokens |"),
        "| --- | ---: | ---: | ---: | ---: | --- |".to_string(),
    ];
    table.iter().for_each(|l| println!("{l}"));
    let report = parity::run(&ours, &reference, &mut |p| {
        let line = row(p);
        println!("{line}");
        table.push(line);
    })?;
    let verdict = if report.passes() { "PASS" } else { "FAIL" };
    let summary = format!(
        "top-1 agreement {:.2}% of positions (bar 99%); identical greedy continuations {}/{} (bar 7/8): {verdict}",
        100.0 * report.top1_rate(),
        report.identical(),
        report.prompts.len()
    );
    println!("\n{summary}");
    write_report(
        args,
        &format!("Parity: instrumented ({numerics:?} numerics) vs mistral.rs"),
        &format!("{}\n\n{summary}", table.join("\n")),
        started,
        &|id, made| records(&report, id, made),
        path,
        &Made::now(numerics.name()),
    )?;
    Ok(report.passes())
}

fn llama_row(p: &GreedyParity) -> String {
    format!(
        "| {} | {} | {} | {} | {} | {} |",
        p.name,
        p.tokens,
        if p.same_ids { "same" } else { "differ" },
        greedy_cell(p.divergence.as_ref(), "ours", "llama.cpp"),
        greedy_cell(p.divergence_default.as_ref(), "ours", "llama.cpp default"),
        greedy_cell(p.divergence_self.as_ref(), "f32", "default"),
    )
}

fn llama_records(report: &LlamaCppReport, id: &ModelId, made: &Made) -> Vec<ResultRecord> {
    let experiment = format!("parity-llama-cpp-{}", made.numerics);
    let rec = recorder(&experiment, id, Some("none"), made);
    let scored = PPL_CHUNKS * (PPL_CTX - PPL_CTX / 2 - 1);
    let mut out = vec![
        rec(
            "perplexity-pg-essays",
            Some(PPL_CTX),
            "ppl_headwise",
            report.ppl_ours,
            scored,
        ),
        rec(
            "perplexity-pg-essays",
            Some(PPL_CTX),
            "ppl_llama_cpp",
            report.ppl_reference,
            scored,
        ),
        rec(
            "perplexity-pg-essays",
            Some(PPL_CTX),
            "ppl_rel_diff",
            report.ppl_rel_diff(),
            scored,
        ),
    ];
    for p in &report.prompts {
        let same = f64::from(u8::from(p.divergence.is_none()));
        out.push(rec(
            &format!("parity-{}", p.name),
            Some(p.tokens),
            "greedy_identical",
            same,
            GREEDY_TOKENS,
        ));
    }
    out.push(rec(
        "parity-all",
        None,
        "greedy_identical",
        report.identical() as f64,
        report.prompts.len(),
    ));
    out
}

fn run_llama_cpp(
    args: &ParityArgs,
    path: &Path,
    numerics: Numerics,
    started: std::time::Instant,
) -> anyhow::Result<bool> {
    let bins = LlamaCppBins::find(args.llama.llama_bin.as_deref(), path)?;
    eprintln!(
        "llama.cpp binaries: {} (built for the {} path; ggml numerics follow it)",
        bins.dir().display(),
        bins.simd().map_or("unknown", |s| s.name())
    );
    eprintln!(
        "loading {} (instrumented, {numerics:?} numerics)",
        path.display()
    );
    let mut ours = LoadedModel::load(path, numerics)?;
    let mut table = vec![
        format!(
            "| prompt | tokens | headwise tokenizer vs llama.cpp | greedy {GREEDY_TOKENS}: headwise vs llama.cpp (f32 attention) | headwise vs llama.cpp (default attention) | llama.cpp f32 vs default attention |"
        ),
        "| --- | ---: | --- | --- | --- | --- |".to_string(),
    ];
    eprintln!(
        "perplexity: llama-perplexity and headwise on {PPL_CHUNKS} chunks of {PPL_CTX} tokens ..."
    );
    let mut printed_header = false;
    let report = llama_cpp::run(&mut ours, &bins, path, &args.llama.data_dir, &mut |p| {
        if !printed_header {
            table.iter().for_each(|l| println!("{l}"));
            printed_header = true;
        }
        let line = llama_row(p);
        println!("{line}");
        table.push(line);
    })?;
    let verdict = if report.passes() { "PASS" } else { "FAIL" };
    let ppl = format!(
        "Perplexity on the first {} tokens of the Paul Graham essays (../shared/data/haystack/paul_graham, files in name order, first 12,000 characters; {PPL_CHUNKS} chunks of {PPL_CTX}, second half of each scored, as `llama-perplexity -c {PPL_CTX} --chunks {PPL_CHUNKS}` does): headwise {:.4}, llama.cpp {:.4}, relative difference {:.3}% (bar 1%); headwise's tokenizer gives {} ids on this text.",
        PPL_CHUNKS * PPL_CTX,
        report.ppl_ours,
        report.ppl_reference,
        100.0 * report.ppl_rel_diff(),
        if report.ppl_same_ids { "the same" } else { "different" },
    );
    let n = report.prompts.len();
    let summary = format!(
        "llama.cpp's build takes ggml's {} kernels, and headwise's ggml numerics followed them. Identical greedy continuations {}/{n} (bar 7/8); perplexity within {:.3}% (bar 1%): {verdict}. For scale: headwise equals llama.cpp with its default attention (f16 KV cache, flash attention) on {}/{n}, and llama.cpp's two attention settings agree with each other on {}/{n}.",
        report.simd.name(),
        report.identical(),
        100.0 * report.ppl_rel_diff(),
        report.identical_default(),
        report.identical_self(),
    );
    println!("\n{ppl}\n\n{summary}");
    write_report(
        args,
        &format!("Parity: instrumented ({numerics:?} numerics) vs llama.cpp"),
        &format!("{ppl}\n\n{}\n\n{summary}", table.join("\n")),
        started,
        &|id, made| llama_records(&report, id, made),
        path,
        &Made::now(numerics.name()),
    )?;
    Ok(report.passes())
}
