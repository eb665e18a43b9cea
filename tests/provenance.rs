//! Provenance in every artifact: each committed JSON file under `policies/rankings/`,
//! `probes/` and `eval/results/` names its numerics and command (an array: each record)
//! and still loads with the types that read it; reports written now carry the numerics
//! and command of the run behind them.

use std::path::{Path, PathBuf};
use std::process::Command;

use headwise::lab::eval::kv_budget::BudgetRun;
use headwise::lab::eval::run::{read_json, RunInfo};
use headwise::lab::heads::trace::TraceCard;
use headwise::policy::ablation::Calibration;
use headwise::policy::ranking::Ranking;
use headwise::probe::Probe;
use headwise::results::ResultRecord;

const ROOTS: [&str; 3] = ["policies/rankings", "probes", "eval/results"];

/// Every `*.json` under `dir`, recursively.
fn json_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let path = e.unwrap().path();
        if path.is_dir() {
            json_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "json") {
            out.push(path);
        }
    }
}

/// Load `path` with the type headwise reads it with (the dynamics reports have none).
fn load_typed(path: &Path) -> headwise::Result<()> {
    let name = path.file_name().unwrap().to_string_lossy();
    let parent = path.parent().unwrap();
    let text = path.to_string_lossy();
    if text.contains("policies/rankings/") {
        Ranking::load(path).map(drop)
    } else if text.contains("/traces/") {
        read_json::<TraceCard>(path).map(drop)
    } else if text.starts_with(&format!("{}/probes/", env!("CARGO_MANIFEST_DIR"))) {
        Probe::load(path).map(drop)
    } else if name == "summary.json" {
        read_json::<Vec<ResultRecord>>(path).map(drop)
    } else if name == "calibration.json" {
        read_json::<Calibration>(path).map(drop)
    } else if name == "run.json" && parent.join("records.jsonl").exists() {
        let raw: serde_json::Value = read_json(path)?;
        match (raw.get("candidate_kv_heads"), raw.get("spec")) {
            (Some(_), _) => read_json::<BudgetRun>(path).map(drop),
            // `eval rag` folders: the model, numerics and CPU of their answers, no spec
            (None, None) => read_json::<headwise::lab::rag_eval::RagRun>(path).map(drop),
            (None, Some(_)) => read_json::<RunInfo>(path).map(drop),
        }
    } else {
        Ok(())
    }
}

#[test]
fn every_committed_artifact_names_its_numerics_and_command_and_still_loads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ROOTS {
        json_files(&root.join(dir), &mut files);
    }
    assert!(!files.is_empty(), "no JSON artifact under {ROOTS:?}");
    let mut missing = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{}: not JSON ({e})", path.display()));
        let objects = match &value {
            serde_json::Value::Array(items) => items.iter().collect(),
            other => vec![other],
        };
        for (i, o) in objects.iter().enumerate() {
            for field in ["numerics", "command"] {
                if o[field].as_str().is_none_or(str::is_empty) {
                    missing.push(format!("{} (element {i}): `{field}`", path.display()));
                }
            }
        }
        if let Err(e) = load_typed(path) {
            missing.push(format!("{}: does not load ({e})", path.display()));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// A scratch copy of a committed run folder's `run.json` and `records.jsonl`, its
/// numerics set to `numerics`; the run's command.
fn run_folder(from: &str, tag: &str, numerics: &str) -> (PathBuf, String) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(from);
    let dir =
        std::env::temp_dir().join(format!("headwise-provenance-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("records.jsonl"), dir.join("records.jsonl")).unwrap();
    let mut run: serde_json::Value = read_json(&src.join("run.json")).unwrap();
    run["numerics"] = numerics.into();
    std::fs::write(dir.join("run.json"), run.to_string()).unwrap();
    (dir, run["command"].as_str().unwrap().to_string())
}

#[test]
fn reports_written_now_carry_the_numerics_and_command_of_their_run() {
    for (from, report, numerics) in [
        (
            "eval/results/SmolLM2-135M-Instruct.Q4_1/specificity",
            "report",
            "reference",
        ),
        (
            "eval/results/SmolLM2-135M-Instruct.Q4_1/kv-speed",
            "kv-report",
            "ggml",
        ),
    ] {
        let (dir, command) = run_folder(from, report, numerics);
        let out = Command::new(env!("CARGO_BIN_EXE_headwise"))
            .args(["eval", report])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let records: Vec<serde_json::Value> = read_json(&dir.join("summary.json")).unwrap();
        assert!(!records.is_empty());
        for r in &records {
            assert_eq!(r["numerics"], numerics, "{r}");
            assert_eq!(r["command"], command.as_str(), "{r}");
            assert!(
                r.get("headwise_version").is_some() && r.get("date").is_some(),
                "{r}"
            );
        }
        let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
        assert!(
            readme.contains(&format!("with `{numerics}` numerics")),
            "{readme}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
