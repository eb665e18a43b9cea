//! `headwise policy train-probe`: train a probe that predicts each step's retrieval
//! heads from the hidden state, with its linear and static baselines.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use headwise::lab::heads::trace::Trace;
use headwise::lab::probe_train::{train, TrainOptions};
use headwise::probe::Metrics;
use headwise::provenance::Made;

#[derive(Subcommand, Debug)]
pub enum PolicyCommand {
    /// Train an MLP probe on a trace from `headwise heads trace`; writes
    /// <out>/<name>.safetensors and <name>.json (the card, with test-split metrics of the
    /// probe and both baselines).
    TrainProbe(TrainProbeArgs),
}

#[derive(Args, Debug)]
pub struct TrainProbeArgs {
    /// The trace (`.json` card or `.safetensors`).
    trace: PathBuf,
    /// The probe's name [default: the trace's task].
    #[arg(long)]
    name: Option<String>,
    /// Hidden layer sizes.
    #[arg(long, value_delimiter = ',')]
    hidden: Option<Vec<usize>>,
    /// Dropout after each hidden layer.
    #[arg(long)]
    dropout: Option<f32>,
    /// Most epochs (early stopping usually ends sooner).
    #[arg(long)]
    epochs: Option<usize>,
    /// Learning rate of AdamW.
    #[arg(long)]
    lr: Option<f64>,
    /// Seed of the prompt split.
    #[arg(long, default_value_t = 0)]
    split_seed: u64,
    /// Output folder [default: probes/<model>].
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(cmd: PolicyCommand) -> anyhow::Result<()> {
    match cmd {
        PolicyCommand::TrainProbe(args) => train_probe(args),
    }
}

fn train_probe(args: TrainProbeArgs) -> anyhow::Result<()> {
    let (trace, card) = Trace::load(&args.trace)?;
    let task = card
        .task
        .get("kind")
        .or_else(|| card.task.get("task"))
        .and_then(|t| t.as_str())
        .unwrap_or("probe")
        .to_string();
    let data = serde_json::json!({
        "trace": args.trace,
        "task": card.task,
        "prompts": card.prompts,
        "steps": card.steps,
        "trace_command": card.made.command,
        // Which questions the probe saw, so that an evaluation can refuse to score it on them.
        "examples": card.examples,
    });
    // The probe learned from hidden states computed with the trace's numerics.
    let made = Made::now(&card.made.numerics);
    let mut opts = TrainOptions::new(card.model.clone(), card.model_sha256.clone(), data, made);
    if let Some(h) = args.hidden {
        opts.probe.hidden = h;
    }
    if let Some(d) = args.dropout {
        opts.probe.dropout = d;
    }
    if let Some(e) = args.epochs {
        opts.probe.max_epochs = e;
    }
    if let Some(lr) = args.lr {
        opts.probe.lr = lr;
    }
    opts.split_seed = args.split_seed;
    let bar = super::progress(
        opts.probe.max_epochs as u64,
        "{bar:40} epoch {pos}/{len}, {elapsed} elapsed {msg}",
    );
    let probe = train(&trace, &opts, &mut |log| {
        bar.set_position(log.epoch as u64);
        bar.set_message(format!(
            "train {:.4}, val {:.4}, lr {:.1e}",
            log.train_loss, log.val_loss, log.lr
        ));
    })?;
    bar.finish_and_clear();
    let out = args
        .out
        .unwrap_or_else(|| PathBuf::from("probes").join(&card.model));
    let name = args.name.unwrap_or(task);
    let path = probe.save(&out, &name)?;
    let m = &probe.card().metrics;
    eprintln!("test split ({}):", path.display());
    for (who, metrics) in [
        ("probe", &m.probe),
        ("linear", &m.linear),
        ("static top-k", &m.static_topk),
    ] {
        eprintln!("  {who:>12}: {}", describe(metrics));
    }
    Ok(())
}

/// ` [lo, hi]` of a 95% interval, or nothing.
fn interval(ci: Option<[f64; 2]>) -> String {
    ci.map_or(String::new(), |[lo, hi]| format!(" [{lo:.3}, {hi:.3}]"))
}

/// One line of headline numbers.
fn describe(m: &Metrics) -> String {
    match m {
        Metrics::Binary(b) => format!(
            "micro F1 {:.3}{}, macro F1 {:.3}, AUPRC {}, precision {:.3}, recall {:.3} at {:.3}",
            b.micro_f1,
            interval(b.micro_f1_ci95),
            b.macro_f1,
            b.auprc.map_or("-".into(), |a| format!("{a:.3}")),
            b.precision,
            b.recall,
            b.threshold
        ),
        Metrics::Continuous(c) => format!(
            "R^2 micro {}{}, mean per head {}, MSE {:.5}",
            c.r2_micro.map_or("-".into(), |a| format!("{a:.3}")),
            interval(c.r2_micro_ci95),
            c.r2_mean_per_head.map_or("-".into(), |a| format!("{a:.3}")),
            c.mse
        ),
    }
}
