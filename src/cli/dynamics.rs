//! `headwise heads dynamics`: how dynamic the retrieval heads of a trace are, and how
//! well the hidden state predicts them (CCA by lag); `headwise heads dynamic-ablation`:
//! silencing each step's active heads against static and random ones.

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use headwise::lab::eval::Example;
use headwise::lab::heads::cca::{cca_by_lag, cca_svg, CcaConfig};
use headwise::lab::heads::dynamic_ablation::{
    prompt_outcome, summarize, AblationSummary, PromptOutcome, Share,
};
use headwise::lab::heads::dynamics::{dynamics, long_tail_svg, ActiveRule};
use headwise::lab::heads::trace::{Effective, Trace, TraceConfig};
use headwise::lab::tasks::{self, Encoder, Haystack, TaskKind, TaskSpec};
use headwise::model::{arithmetic_fingerprint, LoadedModel, ModelId, Numerics};
use headwise::policy::ablation::AblationMode;
use headwise::policy::ranking::Ranking;
use headwise::probe::LabelKind;
use headwise::provenance::Made;
use headwise::results::write_atomic;

#[derive(Args, Debug)]
pub struct DynamicsArgs {
    /// The trace (`.json` card or `.safetensors`) from `headwise heads trace`.
    trace: PathBuf,
    /// The static ranking to compare against (its top-k heads).
    #[arg(long = "static")]
    static_ranking: PathBuf,
    /// Size of the static set.
    #[arg(long, default_value_t = 20)]
    k: usize,
    /// Lags of the CCA (hidden state at step n, scores at step n + lag).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3,4,5")]
    lags: Vec<usize>,
    /// Most PCA components per side of the CCA (short traces need fewer).
    #[arg(long, default_value_t = CcaConfig::default().max_components)]
    max_components: usize,
    /// Where the report goes [default: eval/results/<model>/dynamics].
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The top-`k` heads of a ranking file, refusing a ranking of another model than
/// `model` (`sha256`).
fn static_heads(
    path: &Path,
    k: usize,
    sha256: &str,
    model: &str,
) -> anyhow::Result<Vec<(usize, usize)>> {
    let ranking = Ranking::load(path)?;
    if ranking.provenance.model_sha256 != sha256 {
        anyhow::bail!(
            "{} ranks {}, not {model}",
            path.display(),
            ranking.provenance.model
        );
    }
    Ok(ranking.top(k).iter().map(|h| (h.layer, h.head)).collect())
}

pub fn run(args: DynamicsArgs) -> anyhow::Result<()> {
    let (trace, card) = Trace::load(&args.trace)?;
    let static_heads = static_heads(
        &args.static_ranking,
        args.k,
        &card.model_sha256,
        &card.model,
    )?;
    let d = dynamics(&trace, &static_heads, ActiveRule::TopStatic)?;
    let cca_cfg = CcaConfig {
        max_components: args.max_components,
        ..CcaConfig::default()
    };
    let cca = cca_by_lag(&trace, &args.lags, &cca_cfg)?;
    let task = card
        .task
        .get("kind")
        .or_else(|| card.task.get("task"))
        .and_then(|t| t.as_str())
        .unwrap_or("trace")
        .to_string();
    let out = args.out.unwrap_or_else(|| {
        PathBuf::from("eval/results")
            .join(&card.model)
            .join("dynamics")
    });
    let static_name = args
        .static_ranking
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tail = long_tail_svg(
        &d,
        &format!("{task}: activation frequency by head rank, {}", card.model),
    )?;
    write_atomic(&out.join(format!("{task}-long-tail.svg")), tail.as_bytes())?;
    let svg = cca_svg(
        &cca,
        &format!("{task}: CCA(hidden at n, scores at n + lag)"),
    )?;
    write_atomic(&out.join(format!("{task}-cca.svg")), svg.as_bytes())?;
    // The statistics are of the trace, computed with its numerics.
    let made = Made::now(&card.made.numerics);
    let mut md = format!(
        "# Dynamic retrieval heads: {task} on {}\n\nTrace: {} prompts, {} steps ({}). Static \
         set: top-{} of `{static_name}`. Produced by:\n\n```\n{}\n```\n\n",
        card.model, card.prompts, card.steps, card.made.command, args.k, made.command
    );
    md.push_str(&d.to_markdown());
    md.push_str(&format!(
        "\n![long tail]({task}-long-tail.svg)\n\n## CCA by lag\n\nPCA to 95% (hidden) and \
         99% (scores) variance, at most {} components, fitted on 70% of the prompts; \
         `train` is in-sample (what the paper most likely reports), `test` the held-out \
         prompts.\n\n| lag | pairs train/test | components x/y | first (train) | first \
         (test) | mean top-m (train) | mean top-m (test) |\n|---:|---:|---:|---:|---:|---:|---:|\n",
        args.max_components
    ));
    for p in &cca {
        md.push_str(&format!(
            "| {} | {}/{} | {}/{} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
            p.lag,
            p.n_train,
            p.n_test,
            p.components_x,
            p.components_y,
            p.first_train,
            p.first_test,
            p.mean_top_train,
            p.mean_top_test
        ));
    }
    md.push_str(&format!(
        "\n![CCA]({task}-cca.svg)\n\n{}\n",
        made.markdown()
    ));
    write_atomic(&out.join(format!("{task}.md")), md.as_bytes())?;
    let json = serde_json::json!({"dynamics": d, "cca": cca, "trace": card});
    write_json(&out.join(format!("{task}.json")), json, &made)?;
    print!("{md}");
    Ok(())
}

#[derive(Args, Debug)]
pub struct DynamicAblationArgs {
    /// The static ranking whose top heads are the static variant (and the set the
    /// compensation analysis compares against).
    #[arg(long = "static")]
    static_ranking: PathBuf,
    /// Size of the static set.
    #[arg(long, default_value_t = 20)]
    k: usize,
    /// How silenced heads are silenced.
    #[arg(long, default_value = "uniform-attention",
          value_parser = super::named(&AblationMode::ALL, AblationMode::name))]
    mode: AblationMode,
    /// NIAH haystack lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024")]
    lengths: Vec<usize>,
    /// NIAH needle depths.
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.75")]
    depths: Vec<f64>,
    /// Seeds per (length, depth) cell; they start at 100, apart from the trace's seeds.
    #[arg(long, default_value_t = 3)]
    trials: u64,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 12)]
    max_new: usize,
    /// Fewest prompts the unablated model must answer: a grid of fewer prompts is
    /// refused before anything runs, and a run with fewer writes no report (its prompts
    /// are kept: rerun with more --trials to add seeds to them).
    #[arg(long, default_value_t = 1)]
    min_correct: usize,
    /// Data folder (the essays).
    #[arg(long, env = "HEADWISE_DATA_DIR", default_value = "../shared/data")]
    data_dir: PathBuf,
    /// Where the report goes [default: eval/results/<model>/dynamics].
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    model: super::ModelArgs,
}

pub fn run_ablation(args: DynamicAblationArgs) -> anyhow::Result<()> {
    if args.mode.needs_calibration() {
        anyhow::bail!(
            "--mode {} needs calibration means; use zero-output or uniform-attention",
            args.mode.name()
        );
    }
    let path = args.model.resolve()?;
    let id = ModelId::of_file(&path)?;
    let static_heads = static_heads(&args.static_ranking, args.k, &id.sha256, &id.name)?;
    let numerics = args.model.numerics_or(Numerics::Fast);
    let lm = LoadedModel::load(&path, numerics)?;
    let enc = Encoder::from_model(&lm);
    let spec = TaskSpec {
        kind: TaskKind::Niah,
        lengths: args.lengths.clone(),
        depths: args.depths.clone(),
        seeds: (100..100 + args.trials).collect(),
    };
    let hay = Haystack::from_dir(&args.data_dir.join("haystack/paul_graham"))?;
    let examples: Vec<Example> = tasks::generate(&spec, &enc, &hay)?
        .iter()
        .map(Example::from_trial)
        .collect();
    if examples.len() < args.min_correct {
        anyhow::bail!(
            "--min-correct {} cannot be met: the grid holds {} prompts ({} lengths x {} depths x {} seeds); raise --trials",
            args.min_correct,
            examples.len(),
            args.lengths.len(),
            args.depths.len(),
            args.trials
        );
    }
    let cfg = TraceConfig {
        label_kind: LabelKind::Binary,
        effective: Effective::default(),
        max_new: args.max_new,
        teacher: false,
    };
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from("eval/results")
            .join(&id.name)
            .join("dynamics")
    });
    std::fs::create_dir_all(&out)?;
    // One line per prompt, so that a long run resumes where it stopped; a larger grid
    // (more seeds) reuses the prompts it shares with the file.
    let header = serde_json::json!({
        "model_sha256": id.sha256,
        "static": static_heads,
        "mode": args.mode.name(),
        "max_new": args.max_new,
        "numerics": numerics.name(),
        "cpu": headwise::provenance::cpu(),
        "arithmetic": arithmetic_fingerprint(&lm.model)?,
        "random_heads": "seeded by prompt id",
    });
    let partial = out.join(".niah-ablation.partial.jsonl");
    let mut outcomes: Vec<PromptOutcome> = read_partial(&partial, &header)?;
    let in_grid: HashSet<&str> = examples.iter().map(|e| e.id.as_str()).collect();
    let mut text = serde_json::to_string(&header)? + "\n";
    for o in &outcomes {
        text += &(serde_json::to_string(o)? + "\n");
    }
    write_atomic(&partial, text.as_bytes())?;
    let all_in_grid = outcomes.iter().all(|o| in_grid.contains(o.id.as_str()));
    outcomes.retain(|o| in_grid.contains(o.id.as_str()));
    let done: HashSet<String> = outcomes.iter().map(|o| o.id.clone()).collect();
    let mut log = std::fs::OpenOptions::new().append(true).open(&partial)?;
    let bar = super::progress(
        examples.len() as u64,
        "{bar:40} {pos}/{len} prompts, {elapsed} elapsed, ETA {eta} {msg}",
    );
    bar.set_position(done.len() as u64);
    for ex in &examples {
        if done.contains(&ex.id) {
            continue;
        }
        let o = prompt_outcome(&lm, ex, &cfg, &static_heads, args.mode)?;
        writeln!(log, "{}", serde_json::to_string(&o)?)?;
        log.flush()?;
        outcomes.push(o);
        let correct = outcomes.iter().filter(|o| o.correct[0]).count();
        bar.set_message(format!("{correct} answered unablated"));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let s = summarize(&outcomes);
    let correct = s.variants[0].accuracy.hits;
    if correct < args.min_correct {
        anyhow::bail!(
            "{correct} of {} prompts answered unablated, fewer than --min-correct {}: no report written; the prompts are kept in {} (rerun with more --trials to add seeds)",
            s.prompts,
            args.min_correct,
            partial.display()
        );
    }
    let made = Made::now(numerics.name());
    let md = ablation_markdown(&args, &id.name, &s, &made);
    write_atomic(&out.join("niah-ablation.md"), md.as_bytes())?;
    let json = serde_json::json!({
        "model": id.name, "model_sha256": id.sha256, "mode": args.mode.name(),
        "static": args.static_ranking, "k": args.k, "summary": s,
    });
    write_json(&out.join("niah-ablation.json"), json, &made)?;
    if all_in_grid {
        std::fs::remove_file(&partial)?;
    }
    print!("{md}");
    Ok(())
}

/// Outcomes already in `partial` for the same model, static set, mode, length and
/// numerics; a file of another run is an error.
fn read_partial(partial: &Path, header: &serde_json::Value) -> anyhow::Result<Vec<PromptOutcome>> {
    let text = match std::fs::read_to_string(partial) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => anyhow::bail!("{}: {e}", partial.display()),
    };
    let mut lines = text.lines();
    let found: serde_json::Value = lines
        .next()
        .map(serde_json::from_str)
        .transpose()
        .map_err(|e| anyhow::anyhow!("{}: unreadable header ({e})", partial.display()))?
        .unwrap_or(serde_json::Value::Null);
    // a file written before the CPU or the arithmetic fingerprint was recorded is
    // compared without it
    let mut expected = header.clone();
    for field in ["cpu", "arithmetic"] {
        if found.get(field).is_none() {
            if let Some(fields) = expected.as_object_mut() {
                fields.remove(field);
            }
        }
    }
    if found != expected {
        anyhow::bail!(
            "{} holds prompts of a different run (model, static set, --mode, --max-new, numerics, CPU or arithmetic fingerprint: made on {}); remove it to start over",
            partial.display(),
            found["cpu"].as_str().unwrap_or("an unrecorded CPU")
        );
    }
    // a line cut by an interruption is dropped and its prompt redone
    let out: Vec<PromptOutcome> = lines.filter_map(|l| serde_json::from_str(l).ok()).collect();
    eprintln!(
        "resuming: {} prompts already done in {}",
        out.len(),
        partial.display()
    );
    Ok(out)
}

/// The report: accuracy per variant over every prompt and over the ones answered
/// unablated (Wilson intervals), the paired tests, compensation against its base rate.
fn ablation_markdown(
    args: &DynamicAblationArgs,
    model: &str,
    s: &AblationSummary,
    made: &Made,
) -> String {
    let share = |x: &Share| {
        format!(
            "{:.3} [{:.2}, {:.2}] ({}/{})",
            x.value, x.ci95[0], x.ci95[1], x.hits, x.n
        )
    };
    let mut md = format!(
        "# Dynamic ablation on NIAH: {model}\n\n{} NIAH prompts (lengths {:?}, depths {:?}, seeds \
         100..{}), greedy, {} tokens at most; heads silenced by `{}` at each step only (the \
         prompt runs unablated). Static set: top-{} of `{}`. Produced by:\n\n```\n{}\n```\n\n\
         Accuracy = the answer occurs in the generated text; [95% Wilson interval] (correct/n). \
         \"Answered unablated\" keeps the {} prompts the unablated model got right, so its \
         `None` row is 1 by construction.\n\n\
         | variant | accuracy, all prompts | accuracy, answered unablated | heads silenced per step |\n\
         |---|---:|---:|---:|\n",
        s.prompts,
        args.lengths,
        args.depths,
        100 + args.trials,
        args.max_new,
        args.mode.name(),
        args.k,
        args.static_ranking.display(),
        made.command,
        s.variants[0].accuracy.hits,
    );
    for v in &s.variants {
        md.push_str(&format!(
            "| {:?} | {} | {} | {:.2} |\n",
            v.variant,
            share(&v.accuracy),
            share(&v.kept),
            v.silenced_per_step
        ));
    }
    md.push_str(
        "\nPaired on the prompts answered unablated (exact McNemar: the discordant prompts \
         of each pair, two-sided):\n\n| a | b | only a right | only b right | p |\n|---|---|---:|---:|---:|\n",
    );
    for t in &s.tests {
        md.push_str(&format!(
            "| {:?} | {:?} | {} | {} | {:.4} |\n",
            t.a, t.b, t.only_a, t.only_b, t.p_value
        ));
    }
    md.push_str(&format!(
        "\nCompensation: with the dynamic heads silenced, {} (step, head) activations over {} \
         steps were new (heads not active at that step unablated), from {} distinct heads; \
         {} of them are in the static top-{}. Base rate: of every activation in the \
         unablated runs, {} fall on the static top-{}.\n",
        s.compensation.new_active,
        s.compensation.steps,
        s.compensation.distinct_heads.len(),
        share(&s.compensation_in_static),
        args.k,
        share(&s.base_rate_in_static),
        args.k
    ));
    md.push_str(&format!("\n{}\n", made.markdown()));
    md
}

/// A JSON report (an object) with its provenance at the top level.
#[derive(serde::Serialize)]
struct WithMade<'a> {
    #[serde(flatten)]
    report: serde_json::Value,
    #[serde(flatten)]
    made: &'a Made,
}

/// Write the JSON object `report` with `made`'s fields beside its own.
fn write_json(path: &Path, report: serde_json::Value, made: &Made) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(&WithMade { report, made })?;
    Ok(write_atomic(path, json.as_bytes())?)
}
