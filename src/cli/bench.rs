//! `headwise bench`: prefill and decode speed and peak memory of the instrumented engine
//! and of mistral.rs (same binary, same run), each measurement in a fresh process; and
//! the scoring, probe and serving benches. Each writes its result folder (--out).

use std::path::PathBuf;
use std::process::Command;

use clap::Args;
use headwise::lab::bench::{
    peak_rss_bytes, speed_records, table, write_report, BenchRecord, StepBytes,
};
use headwise::model::numerics::kernels::Isa;
use headwise::model::{
    generate, Architecture, Config, GenerateOptions, GgufFile, Interventions, LoadedModel, ModelId,
    NoObserver, Numerics,
};
use headwise::provenance::Made;
use headwise::results::{recorder, ResultRecord};
use headwise::synthetic::synthetic_notes;
use headwise::wait;

use super::ModelArgs;

/// A benchmark other than engine speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchWhat {
    /// The cost of scoring one 2k-token retrieval-head trial against a plain generation
    /// over the same tokens.
    Scoring,
    /// The probe's time per decode step as a fraction of one decode step of the model
    /// (needs --probe).
    Probe,
    /// Requests/s and tokens/s of `headwise serve` on loopback at several client
    /// concurrencies, per policy; writes a report to --out.
    Serve,
    /// The fast numerics' matrix kernels alone, on the model's own weights: one pass over
    /// every decode matrix at 1-32 activation rows on each instruction set this CPU runs,
    /// and at 64 and 256 rows the prefill product beside the dequantized tiles alone.
    Kernels,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// What to measure [default: prefill and decode speed of the engines].
    #[arg(value_enum)]
    what: Option<BenchWhat>,
    /// Prompt lengths in tokens (`bench serve`: the first is the document's length, in
    /// whole notes, before the chat template and the request's own line).
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    prompt_tokens: Vec<usize>,
    /// Tokens generated per measurement.
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Engines to measure.
    #[arg(long, value_delimiter = ',', default_value = "instrumented,mistralrs")]
    engines: Vec<String>,
    /// Also run llama.cpp's `llama-bench` binary (2 threads) on the same GGUF and add its
    /// rows (see ../shared/tools/build-llama-bench.sh in the workplace); `bench serve`
    /// runs the `llama-server` of the same folder as its anchor (`-np` the largest
    /// concurrency, `-cb`, 2 threads).
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// Also run another headwise binary's instrumented engine, as `NAME=PATH` (e.g.
    /// `before=/tmp/headwise-d7d7c22`): a before/after comparison in one run, its rows
    /// under NAME.
    #[arg(long, value_parser = parse_baseline)]
    baseline: Option<(String, PathBuf)>,
    /// Rounds of the engine bench: every engine at every length once per round, in an
    /// order rotated from round to round; rows are medians, ratios paired within rounds.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=50))]
    rounds: u16,
    /// The probe card (`bench probe`), e.g. probes/<model>/niah.json.
    #[arg(long)]
    probe: Option<PathBuf>,
    /// `bench serve`: concurrent clients, one level each.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// `bench serve`: the server's batch limits to compare, one server each
    /// [default: the largest concurrency].
    #[arg(long, value_delimiter = ',')]
    max_batch: Vec<usize>,
    /// `bench serve`: the server's prefix cache sizes to compare (MiB, 0: off), one
    /// server each.
    #[arg(long, value_delimiter = ',', default_value = "256")]
    prefix_cache_mib: Vec<f64>,
    /// `bench serve`: the server's KV budgets to compare (MiB), one server each
    /// [default: no budget].
    #[arg(long, value_delimiter = ',')]
    kv_budget_mib: Vec<f64>,
    /// `bench serve`: prompt positions the server prefills per scheduler iteration
    /// [default: one prefill chunk].
    #[arg(long)]
    prefill_tokens: Option<usize>,
    /// `bench serve`: the server's prefill chunks to compare (positions per forward pass
    /// of a prompt), one server each.
    #[arg(long, value_delimiter = ',', default_value = "256")]
    prefill_chunk: Vec<usize>,
    /// `bench serve`: measure every policy's levels a second time with per-token
    /// introspection (`"headwise": {"explain": true}`): its cost.
    #[arg(long)]
    explain: bool,
    /// `bench serve`: every request is one document followed by its own question
    /// (a shared prefix) instead of its own first line followed by the document.
    #[arg(long)]
    shared_prefix: bool,
    /// `bench serve`: policy presets to measure (files policies/<name>.toml).
    #[arg(long, value_delimiter = ',', default_value = "full,static-locos")]
    policies: Vec<String>,
    /// `bench serve`: requests per level (at least two per client).
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// The result folder [default: eval/results/<model>/bench, or bench-scoring,
    /// bench-probe, serve-bench].
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[arg(long)]
    engine: String,
    #[arg(long)]
    prompt_tokens: usize,
    #[arg(long)]
    decode_tokens: usize,
    /// `llama-bench` (engine `llama.cpp`).
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.what == Some(BenchWhat::Probe) {
        return probe(&args);
    }
    if args.what == Some(BenchWhat::Scoring) {
        return scoring(&args);
    }
    if args.what == Some(BenchWhat::Kernels) {
        return kernels(&args);
    }
    if args.what == Some(BenchWhat::Serve) {
        return serve(&args);
    }
    if args.decode_tokens < 2 {
        anyhow::bail!(
            "--decode-tokens must be at least 2 (decode speed is measured after the first token)"
        );
    }
    let path = args.model.resolve()?;
    let cfg = Config::from_gguf(GgufFile::open(&path)?.content())?;
    let numerics = args.model.numerics_or(Numerics::Fast);
    let exe = std::env::current_exe()?;
    eprintln!("measuring the read bandwidth ...");
    let bandwidth = headwise::lab::bench::read_bandwidth();
    let mut engines = args.engines.clone();
    if args.llama_bench.is_some() {
        engines.push(LLAMA_CPP.into());
    }
    let mut engines: Vec<(String, PathBuf)> =
        engines.into_iter().map(|e| (e, exe.clone())).collect();
    if let Some((name, path)) = &args.baseline {
        engines.push((name.clone(), path.clone()));
    }
    let rounds = usize::from(args.rounds);
    let mut records: Vec<BenchRecord> = Vec::new();
    for round in 0..rounds {
        // Rotate the order so that no engine always runs first (or right after another).
        let mut order = engines.clone();
        let shift = round % order.len().max(1);
        order.rotate_left(shift);
        for &n in &args.prompt_tokens {
            for (engine, bin) in &order {
                if engine == "mistralrs" && cfg.architecture != Architecture::Llama {
                    if round == 0 {
                        eprintln!(
                            "skipping mistralrs at {n} prompt tokens: mistral.rs 0.8 cannot load {:?} from GGUF",
                            cfg.architecture
                        );
                    }
                    continue;
                }
                eprintln!(
                    "round {}/{rounds}: measuring {engine} at {n} prompt tokens ...",
                    round + 1
                );
                let mut record = measure(&args, engine, bin, &path, numerics, n)?;
                record.round = round;
                records.push(record);
            }
        }
    }
    let table = table(&records, Some(bandwidth));
    print!("{table}");
    let id = ModelId::of_file(&path)?;
    let made = Made::now(numerics.name());
    let body = format!(
        "Prefill of synthetic prompts and decode of {} tokens after them, each engine in a \
         fresh process (peak RSS its own), {rounds} round(s) with the engines' order \
         rotated; summary.json: task = engine, ratios under `instrumented-vs-<engine>`.\
         \n\n{table}",
        args.decode_tokens
    );
    let records = speed_records(&id, &records, Some(bandwidth), &made);
    report(
        args.out.as_ref(),
        &id,
        "bench",
        "Engine speed",
        &body,
        &records,
        &made,
    )
}

/// One engine at `n` prompt tokens in a fresh worker process of `exe` (this binary, or
/// the `--baseline` one, whose instrumented engine runs and is named `engine`).
fn measure(
    args: &BenchArgs,
    engine: &str,
    exe: &std::path::Path,
    model: &std::path::Path,
    numerics: Numerics,
    n: usize,
) -> anyhow::Result<BenchRecord> {
    let is_baseline = args
        .baseline
        .as_ref()
        .is_some_and(|(name, _)| name == engine);
    let mut worker = Command::new(exe);
    worker
        .arg("bench-worker")
        .args([
            "--engine",
            if is_baseline { "instrumented" } else { engine },
        ])
        .args(["--prompt-tokens", &n.to_string()])
        .args(["--decode-tokens", &args.decode_tokens.to_string()])
        .arg("--model")
        .arg(model)
        .args(["--numerics", numerics.name()]);
    if let (LLAMA_CPP, Some(bin)) = (engine, &args.llama_bench) {
        worker.arg("--llama-bench").arg(bin);
    }
    let out = wait::output_within(
        &mut worker,
        wait::setting(wait::BENCH_TIMEOUT)?,
        &format!("the {engine} bench worker"),
        wait::BENCH_TIMEOUT.0,
    )?;
    if !out.status.success() {
        anyhow::bail!(
            "{engine} at {n} tokens failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The record is the worker's last line (an older baseline binary may print more).
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "the {engine} bench worker printed no record: {}",
                stdout.trim()
            )
        })?;
    let mut record: BenchRecord = serde_json::from_str(line)?;
    record.engine = engine.to_string();
    Ok(record)
}

/// `NAME=PATH` of `--baseline`: a name that is not an engine's, and an existing file.
fn parse_baseline(s: &str) -> Result<(String, PathBuf), String> {
    let (name, path) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected NAME=PATH"))?;
    if name.is_empty() || ["instrumented", "mistralrs", LLAMA_CPP].contains(&name) {
        return Err(format!(
            "`{name}`: the baseline needs a name of its own (not empty, not an engine's)"
        ));
    }
    let path = PathBuf::from(path);
    if !path.is_file() {
        return Err(format!("{}: no such file", path.display()));
    }
    Ok((name.to_string(), path))
}

/// Write a bench's result folder: `--out`, or `eval/results/<model>/<folder>`.
fn report(
    out: Option<&PathBuf>,
    id: &ModelId,
    folder: &str,
    title: &str,
    body: &str,
    records: &[ResultRecord],
    made: &Made,
) -> anyhow::Result<()> {
    let out = out_dir(out, id, folder);
    write_report(&out, &format!("{title}: {}", id.name), body, records, made)?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

/// `--out`, or `eval/results/<model>/<name>`.
fn out_dir(out: Option<&PathBuf>, id: &ModelId, name: &str) -> PathBuf {
    out.cloned()
        .unwrap_or_else(|| PathBuf::from("eval/results").join(&id.name).join(name))
}

/// The engine name of llama.cpp's rows.
const LLAMA_CPP: &str = "llama.cpp";

/// `llama-bench` (2 threads, 2 repetitions) at one prompt length, run from a worker so
/// that the worker's children are llama-bench alone: prompt processing of `n` tokens, and
/// generation of `decode` tokens after `n` tokens of context (`-d n`), the same two
/// quantities the other engines report; the peak RSS is the larger child's `ru_maxrss`.
fn llama_bench(
    bin: &std::path::Path,
    model: &std::path::Path,
    n: usize,
    decode: usize,
) -> anyhow::Result<BenchRecord> {
    let rate = |extra: &[String]| -> anyhow::Result<f64> {
        let out = wait::output_within(
            Command::new(bin)
                .arg("-m")
                .arg(model)
                .args(["-t", "2", "-r", "2", "-o", "json"])
                .args(extra),
            wait::setting(wait::BENCH_TIMEOUT)?,
            "llama-bench",
            wait::BENCH_TIMEOUT.0,
        )
        .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", bin.display()))?;
        if !out.status.success() {
            anyhow::bail!(
                "llama-bench failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
        rows.first()
            .and_then(|r| r["avg_ts"].as_f64())
            .ok_or_else(|| anyhow::anyhow!("llama-bench printed no result for {extra:?}"))
    };
    let prompt = rate(&["-p".into(), n.to_string(), "-n".into(), "0".into()])?;
    let gen = rate(&[
        "-p".into(),
        "0".into(),
        "-n".into(),
        decode.to_string(),
        "-d".into(),
        n.to_string(),
    ])?;
    Ok(BenchRecord {
        engine: LLAMA_CPP.into(),
        prompt_tokens: n,
        decode_tokens: decode,
        prefill_tok_s: prompt,
        decode_tok_s: gen,
        peak_rss_bytes: children_peak_rss(),
        isa: None,
        step_bytes: None,
        decode_parts: None,
        round: 0,
    })
}

/// The largest peak RSS among this process's waited-for children (bytes).
fn children_peak_rss() -> Option<u64> {
    // SAFETY: `getrusage` writes one `rusage` into the zeroed value it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        (libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) == 0).then_some(usage)
    }?;
    // Linux reports kilobytes.
    u64::try_from(usage.ru_maxrss).ok().map(|kb| kb * 1024)
}

/// A prompt of exactly `n` tokens.
fn prompt_ids(
    lm_encode: &dyn Fn(&str) -> anyhow::Result<Vec<u32>>,
    n: usize,
) -> anyhow::Result<Vec<u32>> {
    let mut notes = n / 8 + 8;
    loop {
        let ids = lm_encode(&synthetic_notes(notes, None))?;
        if ids.len() >= n {
            return Ok(ids[..n].to_vec());
        }
        notes *= 2;
    }
}

pub fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    let path: PathBuf = args.model.resolve()?;
    let record = match args.engine.as_str() {
        "instrumented" => {
            let lm = LoadedModel::load(&path, args.model.numerics_or(Numerics::Fast))?;
            let ids = prompt_ids(&|t| Ok(lm.encode(t, true)?), args.prompt_tokens)?;
            let opts = GenerateOptions {
                max_new: args.decode_tokens,
                ..GenerateOptions::default()
            };
            let run = |ids: &[u32], opts: &GenerateOptions| {
                generate(
                    &lm.model,
                    ids,
                    opts,
                    &mut NoObserver,
                    &Interventions::new(),
                    &mut |_, _| true,
                )
            };
            // Warm-up: touch every weight once.
            run(
                &ids[..16.min(ids.len())],
                &GenerateOptions {
                    max_new: 2,
                    ..opts.clone()
                },
            )?;
            let g = run(&ids, &opts)?;
            let context = ids.len() + g.tokens.len();
            BenchRecord {
                engine: args.engine.clone(),
                prompt_tokens: ids.len(),
                decode_tokens: g.tokens.len(),
                prefill_tok_s: g.prefill_tok_s(),
                decode_tok_s: g.decode_tok_s(),
                peak_rss_bytes: peak_rss_bytes(),
                isa: Some(Isa::active().name().into()),
                step_bytes: Some(StepBytes {
                    weights: lm.model.decode_weight_bytes() as u64,
                    kv: lm.model.config().kv_view_bytes(context) as u64,
                }),
                decode_parts: Some(lm.model.time_decode_parts(context, 5)?),
                round: 0,
            }
        }
        #[cfg(feature = "mistralrs")]
        "mistralrs" => {
            let engine = headwise::reference::mistralrs::MistralRsEngine::load(&path)?;
            let ids = prompt_ids(&|t| Ok(engine.tokenize(t, true)?), args.prompt_tokens)?;
            engine.generate_timed(&ids[..16.min(ids.len())], 2)?;
            let (tokens, stats) = engine.generate_timed(&ids, args.decode_tokens)?;
            BenchRecord {
                engine: args.engine.clone(),
                prompt_tokens: ids.len(),
                decode_tokens: tokens.len(),
                prefill_tok_s: stats.prefill_tok_s,
                decode_tok_s: stats.decode_tok_s,
                peak_rss_bytes: peak_rss_bytes(),
                isa: None,
                step_bytes: None,
                decode_parts: None,
                round: 0,
            }
        }
        LLAMA_CPP => {
            let bin = args
                .llama_bench
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("engine llama.cpp needs --llama-bench PATH"))?;
            llama_bench(bin, &path, args.prompt_tokens, args.decode_tokens)?
        }
        other => anyhow::bail!("unknown engine `{other}` (instrumented, mistralrs, llama.cpp)"),
    };
    println!("{}", serde_json::to_string(&record)?);
    Ok(())
}

/// Time `f` `n` times and return the median in seconds.
fn median_secs(n: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut t = Vec::with_capacity(n);
    for _ in 0..n {
        let start = std::time::Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[n / 2])
}

/// `headwise bench kernels`: seconds per pass over every decode matrix of the model
/// (the fast numerics' blocks) at several activation-row counts, per instruction set,
/// each the median of 7; and the speed-up of each set over the portable loop at the same
/// rows, measured in the same run.
fn kernels(args: &BenchArgs) -> anyhow::Result<()> {
    let path = args.model.resolve()?;
    let id = ModelId::of_file(&path)?;
    let lm = LoadedModel::load(&path, Numerics::Fast)?;
    let matrices: Vec<_> = lm
        .model
        .matrices()
        .into_iter()
        .filter_map(|l| l.blocks())
        .collect();
    let bytes: usize = matrices.iter().map(|m| m.bytes()).sum();
    let widest = matrices.iter().map(|m| m.cols()).max().unwrap_or(0);
    let x: Vec<f32> = (0..256 * widest)
        .map(|i| ((i * 7919) % 61) as f32 / 30.0 - 1.0)
        .collect();
    let pass =
        |rows: usize, f: &dyn Fn(&headwise::model::numerics::kernels::BlockMatrix, &[f32])| {
            median_secs(7, || {
                for m in &matrices {
                    f(m, &x[..rows * m.cols()]);
                }
                Ok(())
            })
        };
    // (path, rows, seconds per pass)
    let mut rows_measured: Vec<(String, usize, f64)> = Vec::new();
    for isa in Isa::available() {
        for rows in [1, 2, 4, 8, 16, 32] {
            eprintln!("{isa}: {rows} rows ...");
            let t = pass(rows, &|m, x| {
                m.quantized_product(x, rows, isa);
            })?;
            rows_measured.push((isa.name().into(), rows, t));
        }
    }
    for rows in [64, 256] {
        eprintln!("prefill and tiled: {rows} rows ...");
        let t = pass(rows, &|m, x| {
            m.matmul(x, rows);
        })?;
        rows_measured.push(("prefill".into(), rows, t));
        let t = pass(rows, &|m, x| {
            m.tiled_product(x, rows);
        })?;
        rows_measured.push(("tiled".into(), rows, t));
    }
    let portable = |rows: usize| {
        rows_measured
            .iter()
            .find(|(p, r, _)| p == "portable" && *r == rows)
            .map(|m| m.2)
    };
    let mut md = format!(
        "One pass over the {} decode matrices of the model ({:.1} MiB of blocks), \
         median of 7, in this process; the speed-up is over the portable loop at the same \
         rows in the same run. `prefill`: the product prefill runs (the integer kernels on \
         the instruction set that runs); `tiled`: every matrix through dequantized f32 \
         tiles and `gemm`, the prefill path before the integer kernels took it.\n\n\
         | path | activation rows | ms per pass | us per row per pass | weight GB/s | \
         speed-up over portable |\n| --- | ---: | ---: | ---: | ---: | ---: |\n",
        matrices.len(),
        bytes as f64 / (1 << 20) as f64
    );
    let made = Made::now(Numerics::Fast.name());
    let record = recorder("bench-kernels", &id, None, &made);
    let mut records = Vec::new();
    for (p, rows, t) in &rows_measured {
        let speedup = portable(*rows).map_or("-".to_string(), |b| format!("{:.2}x", b / t));
        md.push_str(&format!(
            "| {p} | {rows} | {:.3} | {:.1} | {:.2} | {speedup} |\n",
            1e3 * t,
            1e6 * t / *rows as f64,
            bytes as f64 / t / 1e9
        ));
        let task = format!("{p} x{rows}");
        records.push(record(&task, None, "seconds_per_pass", *t, 7));
        records.push(record(&task, None, "weight_bytes_s", bytes as f64 / t, 7));
    }
    print!("{md}");
    report(
        args.out.as_ref(),
        &id,
        "bench-kernels",
        "Matrix kernels",
        &md,
        &records,
        &made,
    )
}

/// `headwise bench scoring`: one NIAH trial of 2,000 haystack tokens scored (observed
/// greedy generation, Wu and LOCOS) against the same prefill and the same decode steps
/// unobserved, medians of three runs each, in this process.
fn scoring(args: &BenchArgs) -> anyhow::Result<()> {
    use headwise::lab::heads::run::Scorer;
    use headwise::lab::tasks::{self, Haystack, TaskKind, TaskSpec};
    use headwise::model::Session;
    let path = args.model.resolve()?;
    let numerics = args.model.numerics_or(Numerics::Fast);
    let lm = LoadedModel::load(&path, numerics)?;
    let spec = TaskSpec {
        kind: TaskKind::Niah,
        lengths: vec![2000],
        depths: vec![0.5],
        seeds: vec![0],
    };
    let trial = tasks::generate(
        &spec,
        &tasks::Encoder::from_model(&lm),
        &Haystack::synthetic(),
    )?
    .remove(0);
    let max_new = 24;
    let scorer = Scorer::new(&lm)?;
    let outcome = scorer.trial(&trial, max_new)?;
    let steps = outcome.tokens;
    let none = Interventions::new();
    let plain = median_secs(3, || {
        let mut session = Session::new(&lm.model, trial.prompt.len() + max_new);
        session.prefill(&trial.prompt, &mut NoObserver, &none)?;
        for &t in &steps {
            session.step(t, &mut NoObserver, &none)?;
        }
        Ok(())
    })?;
    let scored = median_secs(3, || {
        scorer.trial(&trial, max_new)?;
        Ok(())
    })?;
    let line = format!(
        "scoring one trial of {} prompt tokens and {} generated: {:.2} s; plain prefill + decode of the same tokens: {:.2} s; ratio {:.2}x (goal <= 1.3x)",
        trial.prompt.len(),
        steps.len(),
        scored,
        plain,
        scored / plain
    );
    println!("{line}");
    let id = ModelId::of_file(&path)?;
    let made = Made::now(numerics.name());
    let record = recorder("bench-scoring", &id, None, &made);
    let n = trial.prompt.len();
    let records = [
        record("niah", Some(n), "scored_s", scored, 3),
        record("niah", Some(n), "plain_s", plain, 3),
        record("niah", Some(n), "ratio", scored / plain, 3),
    ];
    let body = format!(
        "One synthetic NIAH trial scored (observed greedy generation, Wu and LOCOS) against \
         the same prefill and decode steps unobserved; medians of three runs.\n\n{line}"
    );
    report(
        args.out.as_ref(),
        &id,
        "bench-scoring",
        "Cost of scoring",
        &body,
        &records,
        &made,
    )
}

/// `headwise bench probe`: median time of one probe prediction (on the real hidden
/// state of each step) against the median decode step of the model after a prompt of
/// `--prompt-tokens` (first value) synthetic tokens, in this process.
fn probe(args: &BenchArgs) -> anyhow::Result<()> {
    use headwise::model::{Recorder, Session, Wants};
    use headwise::probe::Probe;
    let card = args
        .probe
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("bench probe needs --probe CARD.json"))?;
    let probe = Probe::load(card)?;
    let path = args.model.resolve()?;
    let id = ModelId::of_file(&path)?;
    let numerics = args.model.numerics_or(Numerics::Fast);
    let lm = LoadedModel::load(&path, numerics)?;
    let cfg = lm.model.config();
    probe.check_model(cfg.d_model, cfg.n_layers * cfg.n_heads, Some(&id.sha256))?;
    let n = args.prompt_tokens.first().copied().unwrap_or(512);
    let prompt = lm.encode(&headwise::synthetic::synthetic_notes(n, None), false)?;
    let prompt = &prompt[..n.min(prompt.len())];
    let none = Interventions::new();
    let steps = args.decode_tokens.max(8);
    let mut session = Session::new(&lm.model, prompt.len() + steps + 1);
    session.prefill(prompt, &mut NoObserver, &none)?;
    let mut step_secs = Vec::with_capacity(steps);
    let mut probe_secs = Vec::with_capacity(steps);
    let mut ws = probe.workspace();
    let mut out = vec![0f32; probe.output_dim()];
    let mut token = prompt[prompt.len() - 1];
    for _ in 0..steps {
        let mut rec = Recorder::new(Wants {
            final_hidden: true,
            ..Wants::default()
        });
        let t0 = std::time::Instant::now();
        let logits = session.step(token, &mut rec, &none)?;
        step_secs.push(t0.elapsed().as_secs_f64());
        token = headwise::model::argmax(&logits)?;
        let hidden: Vec<f32> = rec.steps[0]
            .final_hidden
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no hidden state observed"))?
            .flatten_all()?
            .to_vec1()?;
        // Many repetitions per step, so the timer's resolution does not matter.
        let reps = 200;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            probe.predict_into(&hidden, &mut ws, &mut out)?;
        }
        probe_secs.push(t0.elapsed().as_secs_f64() / reps as f64);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (step, pred) = (median(&mut step_secs), median(&mut probe_secs));
    let line = format!(
        "probe {} ({} -> {:?} -> {}): {:.1} us per step; model decode step at {} tokens: {:.2} ms; probe / step = {:.2}% (goal <= 3%)",
        card.display(),
        probe.input_dim(),
        probe.card().architecture.hidden,
        probe.output_dim(),
        pred * 1e6,
        prompt.len(),
        step * 1e3,
        100.0 * pred / step
    );
    println!("{line}");
    let made = Made::now(numerics.name());
    let record = recorder("bench-probe", &id, None, &made);
    // The task: the probe's name.
    let task = card
        .file_stem()
        .map_or(String::new(), |s| s.to_string_lossy().into_owned());
    let records = [
        record(&task, Some(prompt.len()), "probe_s", pred, steps),
        record(&task, Some(prompt.len()), "decode_step_s", step, steps),
        record(
            &task,
            Some(prompt.len()),
            "probe_fraction",
            pred / step,
            steps,
        ),
    ];
    let body = format!(
        "Median time of one probe prediction on each decode step's hidden state against \
         the median decode step, over {steps} steps after a synthetic prompt.\n\n{line}"
    );
    report(
        args.out.as_ref(),
        &id,
        "bench-probe",
        "Cost of the probe",
        &body,
        &records,
        &made,
    )
}

/// `bench serve`: the server in this process, clients over loopback.
fn serve(args: &BenchArgs) -> anyhow::Result<()> {
    use headwise::lab::serve_bench::{self as bench, BenchOptions};
    use headwise::serve::{load_engine, ServeConfig};
    use std::collections::BTreeMap;
    if args.concurrency.contains(&0)
        || args.max_batch.contains(&0)
        || args.prefill_chunk.contains(&0)
        || args.requests == 0
    {
        anyhow::bail!(
            "--concurrency, --max-batch, --prefill-chunk and --requests must be at least 1"
        );
    }
    let path = args.model.resolve()?;
    let top = args.concurrency.iter().copied().max().unwrap_or(1);
    let policies: BTreeMap<String, PathBuf> = args
        .policies
        .iter()
        .filter(|p| p.as_str() != "full")
        .map(|p| (p.clone(), PathBuf::from(format!("policies/{p}.toml"))))
        .collect();
    let batches = match args.max_batch.is_empty() {
        true => vec![top],
        false => args.max_batch.clone(),
    };
    let id = ModelId::of_file(&path)?;
    // The document: whole notes, as many as fit in the first --prompt-tokens.
    let lm = headwise::model::LoadedModel::load(&path, headwise::model::Numerics::Fast)?;
    let want = args.prompt_tokens[0];
    let tokens = |notes: usize| -> anyhow::Result<usize> {
        Ok(lm.encode(&synthetic_notes(notes, None), false)?.len())
    };
    let mut notes = (want / 26).max(1);
    while notes > 1 && tokens(notes)? > want {
        notes -= 1;
    }
    while tokens(notes + 1)? <= want {
        notes += 1;
    }
    let document = synthetic_notes(notes, None);
    // llama-server's slots: the longest request (document, template, question) and its
    // new tokens.
    let slot = lm.encode(&document, true)?.len() + 128 + args.decode_tokens;
    drop(lm);
    let opts = BenchOptions {
        concurrency: args.concurrency.clone(),
        policies: args.policies.clone(),
        requests: args.requests,
        prompt: document,
        max_tokens: args.decode_tokens,
        shared: args.shared_prefix,
        explain: args.explain,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (mut rows, mut made) = (Vec::new(), None);
    let budgets: Vec<Option<f64>> = match args.kv_budget_mib.is_empty() {
        true => vec![None],
        false => args.kv_budget_mib.iter().map(|&m| Some(m)).collect(),
    };
    let budgets = &budgets;
    let chunks = &args.prefill_chunk;
    let servers = batches.iter().flat_map(|&b| {
        args.prefix_cache_mib.iter().flat_map(move |&p| {
            budgets
                .iter()
                .flat_map(move |&k| chunks.iter().map(move |&c| (b, p, k, c)))
        })
    });
    for (max_batch, prefix_cache_mib, kv_budget_mib, prefill_chunk) in servers {
        // Every client gets a place in the batch or the queue.
        let cfg = ServeConfig {
            model: Some(path.clone()),
            policies: Some(policies.clone()),
            max_concurrency: max_batch,
            max_queue: top.saturating_sub(max_batch),
            prefix_cache_mib,
            kv_budget_mib,
            prefill_tokens: args.prefill_tokens.unwrap_or(prefill_chunk),
            prefill_chunk,
            ..ServeConfig::default()
        };
        cfg.validate()?;
        let engine = std::sync::Arc::new(load_engine(&cfg)?);
        // The server loads its model with its own numerics, whatever --numerics says.
        let (_, runtime) = engine
            .runtime(None)
            .map_err(|e| anyhow::anyhow!("{}", e.message))?;
        made.get_or_insert_with(|| Made::now(runtime.model().model.numerics().name()));
        rows.extend(rt.block_on(bench::run(engine, &cfg, &opts, &mut |r| {
            eprintln!(
                "{} max batch {} prefix cache {} MiB KV budget {} MiB prefill {}/{} x{}: {} \
                 requests in {:.1} s, {:.2} req/s, {:.1} tok/s, TTFT {:.2} s, gap p50/p95 \
                 {:.0}/{:.0} ms, mean batch {:.1}, peak {:.0}",
                r.name(),
                r.max_batch,
                r.prefix_cache_mib,
                r.kv_budget_mib,
                r.prefill_chunk,
                r.prefill_tokens,
                r.concurrency,
                r.requests,
                r.wall_secs,
                r.requests_per_s,
                r.tokens_per_s,
                r.mean_ttft_s,
                r.p50_itl_s * 1e3,
                r.p95_itl_s * 1e3,
                r.mean_batch,
                r.peak_batch
            );
        }))?);
    }
    let made = made.ok_or_else(|| anyhow::anyhow!("no server was measured"))?;
    let out = out_dir(args.out.as_ref(), &id, "serve-bench");
    if let Some(bin) = &args.llama_bench {
        // headwise's rows are kept whatever happens to the anchor.
        bench::write_report(&out, &id, &rows, &made)?;
        // The anchor: llama.cpp's own server from the same folder, one slot per client.
        use headwise::reference::llama_cpp::{Attention, LlamaCppBins, LlamaServer};
        let bins = LlamaCppBins::find(bin.parent(), &path)?;
        let server =
            LlamaServer::start_parallel(&bins, &path, top * slot, 2, Attention::Default, top)?;
        rows.extend(
            rt.block_on(bench::run_anchor(server.base(), top, &opts, &mut |r| {
                eprintln!(
                    "llama-server -np {} x{}: {:.2} req/s, {:.1} tok/s, TTFT {:.2} s",
                    r.max_batch, r.concurrency, r.requests_per_s, r.tokens_per_s, r.mean_ttft_s
                );
            }))?,
        );
    }
    bench::write_report(&out, &id, &rows, &made)?;
    eprintln!("wrote {}", out.display());
    Ok(())
}
