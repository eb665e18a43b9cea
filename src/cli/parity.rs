//! `headwise parity`: the instrumented model against mistral.rs, prompt by prompt.

use clap::Args;
use headwise::engine::mistralrs::MistralRsEngine;
use headwise::model::{LoadedModel, Numerics};
use headwise::parity::{self, PromptParity, GREEDY_TOKENS};

use std::path::PathBuf;

use headwise::model::ModelId;
use headwise::parity::ParityReport;
use headwise::results::{write_experiment, ResultRecord, SCHEMA_VERSION};

use super::ModelArgs;

/// One record per prompt and metric, plus the overall verdict numbers.
fn records(report: &ParityReport, id: &ModelId, numerics: Numerics) -> Vec<ResultRecord> {
    let record =
        |task: &str, tokens: Option<usize>, metric: &str, value: f64, n: usize| ResultRecord {
            schema_version: SCHEMA_VERSION,
            experiment: format!(
                "parity-{}",
                if numerics == Numerics::Reference {
                    "reference"
                } else {
                    "fast"
                }
            ),
            model: id.name.clone(),
            model_sha256: id.sha256.clone(),
            task: Some(task.to_string()),
            context_tokens: tokens,
            selection: Some("none".into()),
            k: None,
            seed: None,
            mode: None,
            policy: Some("full".into()),
            metric: metric.to_string(),
            value,
            n,
        };
    let mut out = Vec::new();
    for p in &report.prompts {
        let task = format!("parity-{}", p.name);
        out.push(record(
            &task,
            Some(p.tokens),
            "max_abs_dlogit",
            p.max_abs_diff as f64,
            p.tokens,
        ));
        out.push(record(
            &task,
            Some(p.tokens),
            "mean_abs_dlogit",
            p.mean_abs_diff as f64,
            p.tokens,
        ));
        out.push(record(
            &task,
            Some(p.tokens),
            "top1_agreement",
            p.top1_agree as f64 / p.tokens.max(1) as f64,
            p.tokens,
        ));
        out.push(record(
            &task,
            Some(p.tokens),
            "greedy_identical",
            f64::from(u8::from(p.divergence.is_none())),
            GREEDY_TOKENS,
        ));
    }
    let total: usize = report.prompts.iter().map(|p| p.tokens).sum();
    out.push(record(
        "parity-all",
        None,
        "top1_agreement",
        report.top1_rate(),
        total,
    ));
    out.push(record(
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
    /// Also write the report (README.md + summary.json) into this folder, e.g.
    /// eval/results/SmolLM2-135M-Instruct.Q4_1/parity.
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

fn row(p: &PromptParity) -> String {
    let greedy = match &p.divergence {
        None => format!("identical ({GREEDY_TOKENS})"),
        Some(d) => format!(
            "differs at {} (top-2 gap ours {:.4}, mistral.rs {:.4}{})",
            d.step,
            d.gap_ours,
            d.gap_reference,
            if d.near_tie() { ", near-tie" } else { "" }
        ),
    };
    format!(
        "| {} | {} | {:.4} | {:.5} | {:.2}% | {} |",
        p.name,
        p.tokens,
        p.max_abs_diff,
        p.mean_abs_diff,
        100.0 * p.top1_agree as f64 / p.tokens.max(1) as f64,
        greedy
    )
}

pub fn run(args: ParityArgs) -> anyhow::Result<()> {
    let path = args.model.resolve()?;
    let numerics = args.model.numerics_or(Numerics::Reference);
    eprintln!(
        "loading {} (instrumented, {:?} numerics)",
        path.display(),
        numerics
    );
    let ours = LoadedModel::load(&path, numerics)?;
    eprintln!("loading {} (mistral.rs, F32)", path.display());
    let reference = MistralRsEngine::load(&path)?;
    let started = std::time::Instant::now();
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
    if let Some(dir) = &args.out {
        let id = ModelId::of_file(&path)?;
        let readme = format!(
            "# Parity: instrumented ({numerics:?} numerics) vs mistral.rs\n\nModel `{}` (sha256 `{}`).\n\n{}\n\n{summary}\n\nCommand: `headwise parity --numerics {} --out {}` ({:.0} s wall time, {} CPU threads).\n",
            id.name,
            id.sha256,
            table.join("\n"),
            if numerics == Numerics::Reference { "reference" } else { "fast" },
            dir.display(),
            started.elapsed().as_secs_f64(),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
        );
        write_experiment(dir, &readme, &records(&report, &id, numerics))?;
        eprintln!("wrote {}", dir.display());
    }
    if !report.passes() {
        anyhow::bail!("parity bar not met");
    }
    Ok(())
}
