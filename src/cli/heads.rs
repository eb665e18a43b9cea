//! `headwise heads score|show|compare|export|import`: retrieval-head rankings, and the
//! files other tools read (`policy::atlas`).

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use clap::{Subcommand, ValueEnum};
use headwise::lab::heads::run::{aggregate, LocosSteps, Scorer, TrialOutcome};
use headwise::lab::heads::stability;
use headwise::lab::tasks::{self, Haystack, TaskKind, TaskSpec};
use headwise::model::{arithmetic_fingerprint, Config, GgufFile, LoadedModel, ModelId, Numerics};
use headwise::policy::atlas::{self, AtlasFormat};
use headwise::policy::presses::{DEFAULT_SINK, DEFAULT_WINDOW};
use headwise::policy::ranking::{
    check_comparable, jaccard_top_k, spearman, Acceptance, Provenance, Ranking, TopKStability,
};
use headwise::provenance::{Made, NO_MODEL};

use super::ModelArgs;

/// Which score to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Method {
    Wu,
    Locos,
    /// Both, from the same trials.
    All,
}

/// Which steps LOCOS scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Steps {
    Greedy,
    Teacher,
}

impl Steps {
    fn steps(self) -> LocosSteps {
        match self {
            Steps::Greedy => LocosSteps::Greedy,
            Steps::Teacher => LocosSteps::Teacher,
        }
    }
}

/// Which trials to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Task {
    Niah,
    Nolima,
    NolimaControl,
}

impl Task {
    fn kind(self) -> TaskKind {
        match self {
            Task::Niah => TaskKind::Niah,
            Task::Nolima => TaskKind::Nolima,
            Task::NolimaControl => TaskKind::NolimaControl,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Task::Niah => "niah",
            Task::Nolima => "nolima",
            Task::NolimaControl => "nolima-control",
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum HeadsCommand {
    /// Score every head on generated trials and write
    /// <out-dir>/<model>/<method>-<task>.json with a heatmap next to it.
    Score {
        #[arg(long, value_enum)]
        method: Method,
        #[arg(long, value_enum)]
        task: Task,
        /// Haystack lengths in tokens.
        #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048,4096")]
        lengths: Vec<usize>,
        /// Needle depths as fractions of the haystack.
        #[arg(long, value_delimiter = ',', default_value = "0,0.25,0.5,0.75,1")]
        depths: Vec<f64>,
        /// Trials (seeds) per (length, depth) cell.
        #[arg(long, default_value_t = 2)]
        trials: u64,
        /// First seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Tokens generated per trial.
        #[arg(long, default_value_t = 24)]
        max_new: usize,
        /// LOCOS steps: the model's own greedy steps that produce the answer, or the
        /// gold answer teacher-forced after the prompt (an extra pass per trial).
        #[arg(long, value_enum, default_value_t = Steps::Greedy)]
        locos_steps: Steps,
        /// Data folder; its haystack/paul_graham essays are the haystack.
        #[arg(long, env = "HEADWISE_DATA_DIR", default_value = "../shared/data")]
        data_dir: PathBuf,
        /// Use the built-in synthetic haystack instead of the data folder.
        #[arg(long)]
        synthetic_haystack: bool,
        /// Where rankings go.
        #[arg(long, default_value = "policies/rankings")]
        out_dir: PathBuf,
        /// Fewest accepted trials a ranking may rest on: a grid with fewer trials is
        /// refused before anything runs, and a run that accepts fewer writes no ranking
        /// (its trials are kept: rerun with more --trials to add seeds to them).
        #[arg(long, default_value_t = 1)]
        min_accepted: usize,
        /// Bootstrap resamples of the accepted trials for the top-5/10/20 stability the
        /// ranking records.
        #[arg(long, default_value_t = 1000)]
        bootstrap: usize,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Record per-step (dynamic) retrieval-head labels with the hidden state of each
    /// step: a trace dataset for `heads dynamics` and `policy train-probe`.
    Trace(super::trace::TraceArgs),
    /// Dynamism statistics of a trace against a static ranking, and CCA by lag.
    Dynamics(super::dynamics::DynamicsArgs),
    /// NIAH accuracy when each step's active heads (oracle labels) are silenced at that
    /// step, against as many static or random heads; plus which heads compensate.
    DynamicAblation(super::dynamics::DynamicAblationArgs),
    /// Print the top heads of a ranking file.
    Show {
        file: PathBuf,
        #[arg(long, default_value_t = 20)]
        top: usize,
    },
    /// Spearman rank correlation and top-K Jaccard overlap of two rankings.
    Compare {
        a: PathBuf,
        b: PathBuf,
        #[arg(long, default_value_t = 20)]
        top: usize,
    },
    /// Write a ranking as a DuoAttention pattern folder (a layer x KV head
    /// `full_attention_heads.tsv` and a `config.json`) or as a `{"L-H": [scores]}`
    /// retrieval-head JSON (Wu et al.'s and LOCOS's).
    Export {
        file: PathBuf,
        #[arg(long, value_parser = super::named(&AtlasFormat::ALL, AtlasFormat::name))]
        to: AtlasFormat,
        /// The folder (duo) or file (heads-json) to write.
        #[arg(long)]
        out: PathBuf,
        /// Attention-sink positions a pattern's streaming heads keep.
        #[arg(long, default_value_t = DEFAULT_SINK)]
        sink: usize,
        /// Recent positions a pattern's streaming heads keep.
        #[arg(long, default_value_t = DEFAULT_WINDOW)]
        recent: usize,
    },
    /// Make a ranking (for `static_heads`) from a DuoAttention pattern folder or a
    /// retrieval-head JSON; the file's shape must be the model's.
    Import {
        /// The pattern folder or JSON file.
        path: PathBuf,
        #[arg(long, value_parser = super::named(&AtlasFormat::ALL, AtlasFormat::name))]
        from: AtlasFormat,
        /// The ranking file to write.
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        model: ModelArgs,
    },
}

pub fn run(cmd: HeadsCommand) -> anyhow::Result<()> {
    match cmd {
        HeadsCommand::Trace(args) => super::trace::run(args),
        HeadsCommand::Dynamics(args) => super::dynamics::run(args),
        HeadsCommand::DynamicAblation(args) => super::dynamics::run_ablation(args),
        HeadsCommand::Show { file, top } => {
            let r = Ranking::load(&file)?;
            let p = &r.provenance;
            println!(
                "{} {} on {}: {} of {} trials accepted, {} steps",
                p.method,
                p.task.get("kind").and_then(|k| k.as_str()).unwrap_or("?"),
                p.model,
                p.trials_accepted,
                p.trials_run,
                p.steps
            );
            print_stability(&p.stability);
            println!(
                "| rank | layer | head | kv head | score |\n| ---: | ---: | ---: | ---: | ---: |"
            );
            for (i, s) in r.top(top).iter().enumerate() {
                println!(
                    "| {} | {} | {} | {} | {:.4} |",
                    i + 1,
                    s.layer,
                    s.head,
                    s.kv_head,
                    s.score
                );
            }
            Ok(())
        }
        HeadsCommand::Compare { a, b, top } => {
            let (ra, rb) = (Ranking::load(&a)?, Ranking::load(&b)?);
            check_comparable(&ra, &rb)?;
            let sa: Vec<f64> = ra.heads.iter().map(|s| s.score).collect();
            let sb: Vec<f64> = rb.heads.iter().map(|s| s.score).collect();
            println!(
                "Spearman {:.3}; top-{top} Jaccard {:.3}",
                spearman(&sa, &sb),
                jaccard_top_k(&ra, &rb, top)
            );
            Ok(())
        }
        HeadsCommand::Export {
            file,
            to,
            out,
            sink,
            recent,
        } => {
            let r = Ranking::load(&file)?;
            atlas::export(&r, to, &out, (sink, recent), Made::now(NO_MODEL))?;
            eprintln!("wrote {}", out.display());
            Ok(())
        }
        HeadsCommand::Import {
            path,
            from,
            out,
            model,
        } => {
            let model_path = model.resolve()?;
            let cfg = Config::from_gguf(GgufFile::open(&model_path)?.content())?;
            let id = ModelId::of_file(&model_path)?;
            let r = atlas::import(from, &path, &cfg, &id, Made::now(NO_MODEL))?;
            r.write(&out)?;
            eprintln!("wrote {}", out.display());
            Ok(())
        }
        HeadsCommand::Score {
            method,
            task,
            lengths,
            depths,
            trials,
            seed,
            max_new,
            locos_steps,
            data_dir,
            synthetic_haystack,
            out_dir,
            min_accepted,
            bootstrap,
            model,
        } => {
            let spec = TaskSpec {
                kind: task.kind(),
                lengths,
                depths,
                seeds: (seed..seed + trials).collect(),
            };
            let args = ScoreArgs {
                method,
                task,
                spec,
                max_new,
                locos_steps: locos_steps.steps(),
                data_dir,
                synthetic_haystack,
                out_dir,
                min_accepted,
                bootstrap,
                model,
            };
            score(&args)
        }
    }
}

struct ScoreArgs {
    method: Method,
    task: Task,
    spec: TaskSpec,
    max_new: usize,
    locos_steps: LocosSteps,
    data_dir: PathBuf,
    synthetic_haystack: bool,
    out_dir: PathBuf,
    min_accepted: usize,
    bootstrap: usize,
    model: ModelArgs,
}

/// The first line of a partial-results file: what run the outcomes below belong to.
/// Trials of the same model, task kind, generation length, LOCOS steps, numerics and
/// haystack are interchangeable (a trial's id fixes its length, depth and seed), so a run
/// with a larger grid resumes a smaller one's file.
#[derive(serde::Serialize, serde::Deserialize)]
struct PartialHeader {
    model_sha256: String,
    spec: serde_json::Value,
    max_new: usize,
    locos_steps: LocosSteps,
    /// Absent in files written before it was recorded (those runs used `fast` and the
    /// data folder's haystack unless their command said otherwise).
    #[serde(default)]
    numerics: Option<String>,
    #[serde(default)]
    haystack: Option<String>,
    /// The CPU ([`headwise::provenance::cpu`]): greedy outputs differ between kernels.
    /// Absent in files written before it was recorded.
    #[serde(default)]
    cpu: Option<String>,
    /// [`arithmetic_fingerprint`]: the same CPU with another build may give other floats.
    /// Absent in files written before it was recorded.
    #[serde(default)]
    arithmetic: Option<String>,
}

impl PartialHeader {
    /// Whether the outcomes under `self` can be reused by a run described by `now`.
    fn serves(&self, now: &PartialHeader) -> bool {
        let known = |a: &Option<String>, b: &Option<String>| a.is_none() || a == b;
        self.model_sha256 == now.model_sha256
            && self.spec.get("kind") == now.spec.get("kind")
            && self.max_new == now.max_new
            && self.locos_steps == now.locos_steps
            && known(&self.numerics, &now.numerics)
            && known(&self.haystack, &now.haystack)
            && known(&self.cpu, &now.cpu)
            && known(&self.arithmetic, &now.arithmetic)
    }
}

/// The heads' top-k sizes whose bootstrap stability a ranking records.
const STABILITY_KS: [usize; 3] = [5, 10, 20];

fn score(args: &ScoreArgs) -> anyhow::Result<()> {
    let path = args.model.resolve()?;
    let id = ModelId::of_file(&path)?;
    let dir = args.out_dir.join(&id.name);
    let _lock = headwise::lock::OutputLock::acquire(&dir, &format!("score-{}", args.task.name()))?;
    let methods: &[&str] = match args.method {
        Method::Wu => &["wu"],
        Method::Locos => &["locos"],
        Method::All => &["wu", "locos"],
    };
    let targets: Vec<PathBuf> = methods
        .iter()
        .map(|m| dir.join(format!("{m}-{}.json", args.task.name())))
        .collect();
    for t in &targets {
        if t.exists() {
            let old = Ranking::load(t)?;
            if old.provenance.model_sha256 != id.sha256 {
                anyhow::bail!(
                    "{} ranks another model (sha256 {}), not {} ({}); move it away first",
                    t.display(),
                    old.provenance.model_sha256,
                    id.name,
                    id.sha256
                );
            }
        }
    }
    let numerics = args.model.numerics_or(Numerics::Fast);
    let lm = LoadedModel::load(&path, numerics)?;
    let haystack = if args.synthetic_haystack {
        Haystack::synthetic()
    } else {
        Haystack::from_dir(&args.data_dir.join("haystack/paul_graham"))?
    };
    let trials = tasks::generate(&args.spec, &tasks::Encoder::from_model(&lm), &haystack)?;
    if trials.len() < args.min_accepted {
        anyhow::bail!(
            "--min-accepted {} cannot be met: the grid holds {} trials ({} lengths x {} depths x {} seeds, one depth at length 0); raise --trials",
            args.min_accepted,
            trials.len(),
            args.spec.lengths.len(),
            args.spec.depths.len(),
            args.spec.seeds.len()
        );
    }
    std::fs::create_dir_all(&dir)?;
    let spec_json = serde_json::to_value(&args.spec)?;
    let header = PartialHeader {
        model_sha256: id.sha256.clone(),
        spec: spec_json.clone(),
        max_new: args.max_new,
        locos_steps: args.locos_steps,
        numerics: Some(numerics.name().to_string()),
        haystack: Some(haystack.name().to_string()),
        cpu: Some(headwise::provenance::cpu()),
        arithmetic: Some(arithmetic_fingerprint(&lm.model)?),
    };
    let partial = dir.join(format!(
        ".{}{}.partial.jsonl",
        args.task.name(),
        partial_suffix(args.locos_steps, numerics)
    ));
    let kept = resume(&partial, &header)?;
    // Trials of this grid already done; the file keeps the others too (a smaller grid
    // run on a larger grid's file must not delete its trials).
    let in_grid: HashSet<&str> = trials.iter().map(|t| t.id.as_str()).collect();
    let mut outcomes: Vec<TrialOutcome> = kept
        .iter()
        .filter(|o| in_grid.contains(o.id.as_str()))
        .cloned()
        .collect();
    let done: HashSet<String> = outcomes.iter().map(|o| o.id.clone()).collect();
    // Rewrite the file with what was read back, so that a line cut by an interruption
    // does not swallow the next one.
    let mut text = serde_json::to_string(&header)? + "\n";
    for o in &kept {
        text += &(serde_json::to_string(o)? + "\n");
    }
    headwise::results::write_atomic(&partial, text.as_bytes())?;
    let mut log = std::fs::OpenOptions::new().append(true).open(&partial)?;
    let bar = super::progress(
        trials.len() as u64,
        "{bar:40} {pos}/{len} trials, {elapsed} elapsed, ETA {eta} {msg}",
    );
    bar.set_position(done.len() as u64);
    let scorer = Scorer::new(&lm)?.with_locos_steps(args.locos_steps);
    for trial in trials.iter().filter(|t| !done.contains(&t.id)) {
        let o = scorer.trial(trial, args.max_new)?;
        writeln!(log, "{}", serde_json::to_string(&o)?)?;
        log.flush()?;
        outcomes.push(o);
        let accepted = outcomes.iter().filter(|o| o.accepted()).count();
        bar.set_message(format!("{accepted} accepted"));
        bar.inc(1);
    }
    bar.finish();
    let cfg = lm.model.config();
    let (wu, locos, accepted, steps) = aggregate(&outcomes, cfg.n_layers, cfg.n_heads);
    if accepted < args.min_accepted {
        anyhow::bail!(
            "{accepted} of {} trials accepted, fewer than --min-accepted {}: no ranking written; the trials are kept in {} (rerun with more --trials to add seeds)",
            outcomes.len(),
            args.min_accepted,
            partial.display()
        );
    }
    let accepted_trials: Vec<&TrialOutcome> = outcomes.iter().filter(|o| o.accepted()).collect();
    let mut acceptance: Vec<Acceptance> = Vec::new();
    for &len in &args.spec.lengths {
        let at: Vec<&TrialOutcome> = outcomes
            .iter()
            .filter(|o| o.context_tokens == len)
            .collect();
        let accepted = at.iter().filter(|o| o.accepted()).count();
        println!("{len:>6} tokens: {accepted}/{} trials accepted", at.len());
        acceptance.push(Acceptance {
            context_tokens: len,
            run: at.len(),
            accepted,
        });
    }
    let made = Made::now(numerics.name());
    for (m, target) in methods.iter().zip(&targets) {
        let (scores, steps, which) = if *m == "wu" {
            (&wu, accepted, stability::Method::Wu)
        } else {
            (&locos, steps, stability::Method::Locos)
        };
        let stable = stability::bootstrap_top_k(
            &accepted_trials,
            which,
            cfg.n_layers * cfg.n_heads,
            &STABILITY_KS,
            args.bootstrap,
            0,
        );
        let r = Ranking::new(
            Provenance {
                model: id.name.clone(),
                model_sha256: id.sha256.clone(),
                method: m.to_string(),
                task: spec_json.clone(),
                trials_run: outcomes.len(),
                trials_accepted: accepted,
                acceptance: acceptance.clone(),
                step_source: if *m == "wu" {
                    "greedy".to_string()
                } else {
                    args.locos_steps.name().to_string()
                },
                steps,
                stability: stable,
                made: made.clone(),
            },
            scores,
            cfg.n_kv_heads,
        );
        r.write(target)?;
        headwise::results::write_atomic(&target.with_extension("svg"), r.heatmap_svg().as_bytes())?;
        println!(
            "wrote {} ({accepted} of {} trials accepted)",
            target.display(),
            outcomes.len()
        );
        print_stability(&r.provenance.stability);
    }
    // The trials file goes once its every trial is in a written ranking.
    if kept.iter().all(|o| in_grid.contains(o.id.as_str())) {
        std::fs::remove_file(&partial)?;
    }
    Ok(())
}

/// Outcomes already in `partial` for the same run; a partial file of another run is an
/// error rather than silently mixed in.
fn resume(partial: &Path, header: &PartialHeader) -> anyhow::Result<Vec<TrialOutcome>> {
    let Ok(file) = std::fs::File::open(partial) else {
        return Ok(Vec::new());
    };
    let mut lines = std::io::BufReader::new(file).lines();
    let Some(first) = lines.next().transpose()? else {
        return Ok(Vec::new());
    };
    let found: PartialHeader = serde_json::from_str(&first)
        .map_err(|e| anyhow::anyhow!("{}: unreadable header ({e})", partial.display()))?;
    if !found.serves(header) {
        anyhow::bail!(
            "{} holds trials of a different run (model, task, --max-new, --locos-steps, numerics, haystack, CPU or arithmetic fingerprint: made on {}); remove it to start over",
            partial.display(),
            found.cpu.as_deref().unwrap_or("an unrecorded CPU")
        );
    }
    let mut out = Vec::new();
    for line in lines {
        let line = line?;
        // a line cut by an interruption is dropped and its trial redone
        if let Ok(o) = serde_json::from_str::<TrialOutcome>(&line) {
            out.push(o);
        }
    }
    eprintln!(
        "resuming: {} trials already done in {}",
        out.len(),
        partial.display()
    );
    Ok(out)
}

/// The partial file's name part after the task: empty for the default greedy steps and
/// fast numerics (so files of earlier runs keep resuming), else what differs, so that runs
/// of other steps or numerics into the same folder keep their trials apart.
fn partial_suffix(steps: LocosSteps, numerics: Numerics) -> String {
    let mut s = String::new();
    if steps != LocosSteps::Greedy {
        s += &format!("-{}", steps.name());
    }
    if numerics != Numerics::Fast {
        s += &format!("-{}", numerics.name());
    }
    s
}

/// The stability lines `heads score` and `heads show` print.
fn print_stability(stability: &[TopKStability]) {
    for s in stability {
        println!(
            "top-{} bootstrap Jaccard with the full set: mean {:.3}, 5th percentile {:.3} ({} resamples)",
            s.k, s.mean_jaccard, s.p05_jaccard, s.rounds
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_file_serves_only_runs_on_the_same_cpu() {
        let header = |cpu: Option<&str>| PartialHeader {
            model_sha256: "abc".into(),
            spec: serde_json::json!({"kind": "niah"}),
            max_new: 8,
            locos_steps: LocosSteps::Greedy,
            numerics: Some("fast".into()),
            haystack: Some("data".into()),
            cpu: cpu.map(str::to_string),
            arithmetic: None,
        };
        let here = header(Some("AMD EPYC, avx2 fma f16c"));
        assert!(here.serves(&here));
        assert!(!header(Some("Intel Xeon, avx2 avx512f")).serves(&here));
        // a file written before the CPU was recorded
        assert!(header(None).serves(&here));
        // the same CPU, but another build's floats; a file from before the fingerprint
        let with = |a: &str| PartialHeader {
            arithmetic: Some(a.into()),
            ..header(Some("AMD EPYC, avx2 fma f16c"))
        };
        assert!(with("0123").serves(&with("0123")));
        assert!(!with("0123").serves(&with("4567")));
        assert!(here.serves(&with("4567")));
    }
}
