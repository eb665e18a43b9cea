//! `headwise parity`: the instrumented model against mistral.rs, prompt by prompt.

use clap::Args;
use headwise::engine::mistralrs::MistralRsEngine;
use headwise::model::{LoadedModel, Numerics};
use headwise::parity::{self, PromptParity, GREEDY_TOKENS};

use super::ModelArgs;

#[derive(Args, Debug)]
pub struct ParityArgs {
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
    println!("| prompt | tokens | max abs dlogit | mean abs dlogit | top-1 agree | greedy {GREEDY_TOKENS} tokens |");
    println!("| --- | ---: | ---: | ---: | ---: | --- |");
    let report = parity::run(&ours, &reference, &mut |p| println!("{}", row(p)))?;
    let verdict = if report.passes() { "PASS" } else { "FAIL" };
    println!(
        "\ntop-1 agreement {:.2}% of positions (bar 99%); identical greedy continuations {}/{} (bar 7/8): {verdict}",
        100.0 * report.top1_rate(),
        report.identical(),
        report.prompts.len()
    );
    if !report.passes() {
        anyhow::bail!("parity bar not met");
    }
    Ok(())
}
