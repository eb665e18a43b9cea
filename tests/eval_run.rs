//! The eval runner on the real model: an interrupted and resumed run summarises exactly
//! like an uninterrupted one, shards merge to the same summary, answers batched by 2, 3
//! or 7 are those answered one at a time, and a folder holding a run of another spec, or
//! one made on another CPU, is refused.

mod common;

use std::path::{Path, PathBuf};

use headwise::lab::eval::report::write_report;
use headwise::lab::eval::run::{read_all_records, RunOptions, Runner, Shard, BASELINE};
use headwise::lab::eval::spec::EvalSpec;
use headwise::model::{arithmetic_fingerprint, LoadedModel, ModelId, Numerics};
use headwise::provenance::Made;

fn spec() -> EvalSpec {
    let ranking = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("policies/rankings/SmolLM2-135M-Instruct.Q4_1/locos-niah.json");
    let text = format!(
        r#"
name = "resume-test"
model = "smollm2-135m"
mode = "mean-output"
k = [0, 3]
metrics = ["em", "accuracy"]
max_new = 6

[calibration]
name = "control_city"
limit = 3

[[task]]
name = "control_arithmetic"
limit = 5

[[selection]]
name = "locos-niah"
ranking = "{}"

[[selection]]
name = "random"
random_seeds = [0, 1]
"#,
        ranking.display()
    );
    let dir = scratch("spec");
    let path = dir.join("spec.toml");
    std::fs::write(&path, text).unwrap();
    EvalSpec::load(&path).unwrap()
}

/// A fresh folder for one caller, removed when the returned value drops: the tests run
/// in parallel in one process, so each call gets its own (two tests writing and reading
/// `spec.toml` in one shared folder read each other's half-written file).
fn scratch(tag: &str) -> common::Scratch {
    common::Scratch::dir(&format!("eval-{tag}"))
}

/// The provenance of every run here, one fixed date so that summaries of runs made at
/// different times compare equal.
fn made() -> Made {
    Made {
        date: "2026-12-01T00:00:00Z".into(),
        ..Made::now(Numerics::Fast.name())
    }
}

fn run(lm: &LoadedModel, id: &ModelId, dir: &Path, shard: Shard, batch: usize) -> usize {
    let opts = RunOptions {
        out_dir: dir.to_path_buf(),
        limit: None,
        shard,
        batch,
        made: made(),
    };
    let runner = Runner::prepare(spec(), lm, id, opts).unwrap();
    runner.run(None).unwrap().generated
}

fn summary(dir: &Path) -> String {
    write_report(dir).unwrap();
    std::fs::read_to_string(dir.join("summary.json")).unwrap()
}

#[test]
fn resumed_and_sharded_runs_summarise_like_an_uninterrupted_one() {
    let path = common::real_model();
    let id = ModelId::of_file(&path).unwrap();
    let lm = LoadedModel::load(&path, Numerics::Fast).unwrap();

    let whole = scratch("whole");
    let generated = run(&lm, &id, &whole, Shard::ALL, 1);
    assert!(generated >= 5, "at least the baselines: {generated}");
    let want = summary(&whole);
    assert!(want.contains("\"kept_fraction\""), "{want}");
    let records: Vec<serde_json::Value> = serde_json::from_str(&want).unwrap();
    assert!(records
        .iter()
        .all(|r| r["numerics"] == "fast" && r["command"] != ""));

    // Interrupt: keep two whole lines and half of the third, then resume.
    let cut = scratch("cut");
    std::fs::copy(whole.join("run.json"), cut.join("run.json")).unwrap();
    std::fs::copy(whole.join("calibration.json"), cut.join("calibration.json")).unwrap();
    let text = std::fs::read_to_string(whole.join("records.jsonl")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let partial = format!(
        "{}\n{}\n{}",
        lines[0],
        lines[1],
        &lines[2][..lines[2].len() / 2]
    );
    std::fs::write(cut.join("records.jsonl"), partial).unwrap();
    let again = run(&lm, &id, &cut, Shard::ALL, 3);
    assert_eq!(
        again,
        generated - 2,
        "only the missing answers are generated"
    );
    assert_eq!(summary(&cut), want);
    // Running a complete folder again generates nothing.
    assert_eq!(run(&lm, &id, &cut, Shard::ALL, 3), 0);

    // Two shards into one folder merge to the same summary (and batches of 7 and 2 give
    // the answers of batches of 1).
    let sharded = scratch("shards");
    let a = run(&lm, &id, &sharded, Shard::parse("0/2").unwrap(), 7);
    let b = run(&lm, &id, &sharded, Shard::parse("1/2").unwrap(), 2);
    assert_eq!(a + b, generated);
    assert_eq!(summary(&sharded), want);

    // One unablated baseline per example.
    let records = read_all_records(&whole).unwrap();
    let base: Vec<_> = records.iter().filter(|r| r.selection == BASELINE).collect();
    assert_eq!(base.len(), 5);
}

#[test]
fn a_changed_spec_does_not_mix_into_an_old_run() {
    let path = common::real_model();
    let id = ModelId::of_file(&path).unwrap();
    let lm = LoadedModel::load(&path, Numerics::Fast).unwrap();
    let dir = scratch("changed");
    let mut s = spec();
    s.tasks[0].limit = Some(1);
    s.k = vec![0];
    // as `eval run` makes it: with the fingerprint of the model's arithmetic
    let now = made().with_arithmetic(arithmetic_fingerprint(&lm.model).unwrap());
    let opts = |dir: &Path| RunOptions {
        out_dir: dir.to_path_buf(),
        limit: None,
        shard: Shard::ALL,
        batch: 4,
        made: now.clone(),
    };
    Runner::prepare(s.clone(), &lm, &id, opts(&dir))
        .unwrap()
        .run(None)
        .unwrap();
    let mut changed = s.clone();
    changed.max_new = 3;
    let err = Runner::prepare(changed, &lm, &id, opts(&dir))
        .err()
        .expect("a different spec is refused")
        .to_string();
    assert!(err.contains("holds a run of another spec"), "{err}");
    // the same spec, but the folder's run was made on another CPU without a fingerprint:
    // its greedy outputs may differ, so the records must not mix
    let run_json = dir.join("run.json");
    let mut info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&run_json).unwrap()).unwrap();
    let fingerprinted = info.clone();
    info["cpu"] = "Another CPU, avx2 fma f16c".into();
    info.as_object_mut().unwrap().remove("arithmetic");
    std::fs::write(&run_json, serde_json::to_vec(&info).unwrap()).unwrap();
    let err = Runner::prepare(s.clone(), &lm, &id, opts(&dir))
        .err()
        .expect("a run made on another CPU is refused")
        .to_string();
    assert!(
        err.contains("made with CPU \"Another CPU, avx2 fma f16c\", not"),
        "{err}"
    );
    // another CPU that computed the same floats (the same fingerprint) continues the
    // folder, whose run.json then names the CPU of the earlier records
    let mut info = fingerprinted;
    info["cpu"] = "Another CPU, avx2 fma f16c".into();
    std::fs::write(&run_json, serde_json::to_vec(&info).unwrap()).unwrap();
    Runner::prepare(s.clone(), &lm, &id, opts(&dir))
        .unwrap()
        .run(None)
        .unwrap();
    let continued: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&run_json).unwrap()).unwrap();
    assert_eq!(continued["cpu"], now.cpu.as_str());
    let note = continued["note"].as_str().unwrap_or_default();
    assert!(
        note.ends_with("ran on Another CPU, avx2 fma f16c, with the same arithmetic fingerprint"),
        "{continued}"
    );
    // this CPU, but a build whose arithmetic gave other floats
    assert_eq!(info["arithmetic"], now.arithmetic.as_str());
    info["cpu"] = now.cpu.as_str().into();
    info["arithmetic"] = "0000000000000000".into();
    std::fs::write(&run_json, serde_json::to_vec(&info).unwrap()).unwrap();
    let err = Runner::prepare(s, &lm, &id, opts(&dir))
        .err()
        .expect("a run of other arithmetic is refused")
        .to_string();
    assert!(
        err.contains(&format!(
            "made with arithmetic fingerprint \"0000000000000000\", not \"{}\"",
            now.arithmetic
        )),
        "{err}"
    );
}
