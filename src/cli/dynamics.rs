//! `headwise heads dynamics`: how dynamic the retrieval heads of a trace are, and how
//! well the hidden state predicts them (CCA by lag); `headwise heads dynamic-ablation`:
//! silencing each step's active heads against static and random ones.

use std::path::{Path, PathBuf};

use clap::Args;
use headwise::lab::eval::Example;
use headwise::lab::heads::cca::{cca_by_lag, cca_svg, CcaConfig};
use headwise::lab::heads::dynamic_ablation::{ablate_example, Compensation, Variant};
use headwise::lab::heads::dynamics::{dynamics, long_tail_svg, ActiveRule};
use headwise::lab::heads::trace::{Effective, Trace, TraceConfig};
use headwise::lab::tasks::{self, Encoder, Haystack, TaskKind, TaskSpec};
use headwise::metrics::contains_answer;
use headwise::model::{LoadedModel, ModelId, Numerics};
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
    let cfg = TraceConfig {
        label_kind: LabelKind::Binary,
        effective: Effective::default(),
        max_new: args.max_new,
        teacher: false,
    };
    let bar = super::progress(
        examples.len() as u64,
        "{bar:40} {pos}/{len} prompts, {elapsed} elapsed, ETA {eta}",
    );
    let variants = [
        Variant::None,
        Variant::Dynamic,
        Variant::Static,
        Variant::Random,
    ];
    let mut correct = [0usize; 4];
    let mut silenced = [0usize; 4];
    let mut steps = [0usize; 4];
    let mut comp = Compensation::default();
    let n_heads = lm.model.config().n_heads;
    for (i, ex) in examples.iter().enumerate() {
        let a = ablate_example(&lm, ex, &cfg, &static_heads, args.mode, i as u64)?;
        for (v, run) in &a.runs {
            let slot = variants
                .iter()
                .position(|x| x == v)
                .ok_or(headwise::Error::Internal("every variant run is listed"))?;
            let text = lm.decode(&run.tokens)?;
            correct[slot] += usize::from(contains_answer(&ex.answers, &text) == 1.0);
            steps[slot] += run.tokens.len();
            if *v != Variant::None {
                silenced[slot] += a
                    .oracle
                    .iter()
                    .take(run.tokens.len())
                    .map(Vec::len)
                    .sum::<usize>();
            }
            if *v == Variant::Dynamic {
                comp.add(&a.oracle, run, &static_heads, n_heads);
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let n = examples.len();
    let out = args.out.unwrap_or_else(|| {
        PathBuf::from("eval/results")
            .join(&id.name)
            .join("dynamics")
    });
    let made = Made::now(numerics.name());
    let mut md = format!(
        "# Dynamic ablation on NIAH: {}\n\n{n} NIAH prompts (lengths {:?}, depths {:?}, seeds \
         100..{}), greedy, {} tokens at most; heads silenced by `{}` at each step only (the \
         prompt runs unablated). Static set: top-{} of `{}`. Produced by:\n\n```\n{}\n```\n\n\
         | variant | accuracy | heads silenced per step |\n|---|---:|---:|\n",
        id.name,
        args.lengths,
        args.depths,
        100 + args.trials,
        args.max_new,
        args.mode.name(),
        args.k,
        args.static_ranking.display(),
        made.command
    );
    let mut rows = Vec::new();
    for (i, v) in variants.iter().enumerate() {
        let acc = correct[i] as f64 / n as f64;
        let per_step = silenced[i] as f64 / steps[i].max(1) as f64;
        md.push_str(&format!(
            "| {v:?} | {acc:.3} ({}/{n}) | {per_step:.2} |\n",
            correct[i]
        ));
        rows.push(serde_json::json!({"variant": v, "accuracy": acc, "n": n, "silenced_per_step": per_step}));
    }
    let share = comp.in_static as f64 / comp.new_active.max(1) as f64;
    md.push_str(&format!(
        "\nCompensation: with the dynamic heads silenced, {} (step, head) activations over {} \
         steps were new (heads not active at that step unablated), from {} distinct heads; \
         {:.1}% of them are in the static top-{}.\n",
        comp.new_active,
        comp.steps,
        comp.distinct_heads.len(),
        100.0 * share,
        args.k
    ));
    md.push_str(&format!("\n{}\n", made.markdown()));
    write_atomic(&out.join("niah-ablation.md"), md.as_bytes())?;
    let json = serde_json::json!({
        "model": id.name, "model_sha256": id.sha256, "mode": args.mode.name(),
        "variants": rows, "compensation": comp, "static_in_compensation": share,
    });
    write_json(&out.join("niah-ablation.json"), json, &made)?;
    print!("{md}");
    Ok(())
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
