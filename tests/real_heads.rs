//! Retrieval-head scoring on the real SmolLM2: a short needle-in-a-haystack trial is
//! retrieved and credits heads under both scores, and an interrupted `heads score` run
//! resumes without redoing finished trials, grows to a larger grid and refuses to rank
//! on fewer accepted trials than asked; the dynamic ablation does the same with its
//! prompts.

mod common;

use common::real_model;
use headwise::lab::heads::run::{LocosSteps, Scorer, TrialOutcome};
use headwise::lab::tasks::{generate, Encoder, Haystack, TaskKind, TaskSpec};
use headwise::model::{LoadedModel, ModelId, Numerics};
use std::path::Path;

fn spec() -> TaskSpec {
    TaskSpec {
        kind: TaskKind::Niah,
        lengths: vec![256],
        depths: vec![0.5],
        seeds: vec![0, 1],
    }
}

#[test]
fn a_retrieved_needle_credits_heads_under_both_scores() {
    let Some(essays) = common::data("haystack/paul_graham") else {
        return;
    };
    let lm = LoadedModel::load(&real_model(), Numerics::Fast).unwrap();
    let haystack = Haystack::from_dir(&essays).unwrap();
    let trials = generate(&spec(), &Encoder::from_model(&lm), &haystack).unwrap();
    let scorer = Scorer::new(&lm).unwrap();
    let outcomes: Vec<TrialOutcome> = trials
        .iter()
        .map(|t| scorer.trial(t, 24).unwrap())
        .collect();
    let accepted: Vec<&TrialOutcome> = outcomes.iter().filter(|o| o.accepted()).collect();
    assert!(
        !accepted.is_empty(),
        "{:?}",
        outcomes.iter().map(|o| &o.generated).collect::<Vec<_>>()
    );
    for o in &accepted {
        // the answer's 8 tokens (a space and 7 digits) were found and scored
        assert_eq!(o.locos_steps, 8, "{}", o.generated);
        assert!(
            o.wu.iter().any(|&s| s > 0.0),
            "no head copied from the needle"
        );
        assert!(o.locos.iter().any(|&s| s > 0.0));
    }
    // Teacher forcing scores the gold answer's tokens; Wu still comes from greedy steps.
    let teacher = Scorer::new(&lm)
        .unwrap()
        .with_locos_steps(LocosSteps::Teacher);
    let trial = trials.iter().find(|t| t.id == accepted[0].id).unwrap();
    let t = teacher.trial(trial, 24).unwrap();
    assert_eq!(t.locos_steps, trial.answer_tokens.len());
    assert_eq!(
        (&t.wu, &t.generated),
        (&accepted[0].wu, &accepted[0].generated)
    );
    assert!(t.locos.iter().any(|&s| s > 0.0));
}

#[test]
fn an_interrupted_run_resumes_grows_and_holds_back_a_ranking_on_too_few_trials() {
    let Some(essays) = common::data("haystack/paul_graham") else {
        return;
    };
    let data_dir = essays
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    let model = real_model();
    let out = std::env::temp_dir().join(format!("headwise-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let id = ModelId::of_file(&model).unwrap();
    let dir = out.join(&id.name);
    std::fs::create_dir_all(&dir).unwrap();
    // What an interrupted run leaves: the header, one finished trial and a cut line.
    let header = serde_json::json!({
        "model_sha256": id.sha256,
        "spec": serde_json::to_value(spec()).unwrap(),
        "max_new": 24,
        "locos_steps": "greedy",
    });
    let done = TrialOutcome {
        id: "niah-L256-D50-s0".into(),
        context_tokens: 256,
        generated: " 1234567".into(),
        tokens: vec![],
        recall: 0.0,
        wu: vec![0.0; 270],
        locos: vec![0.0; 270],
        locos_steps: 0,
    };
    let partial = dir.join(".niah.partial.jsonl");
    std::fs::write(
        &partial,
        format!(
            "{header}\n{}\n{{\"id\": \"niah-L2",
            serde_json::to_string(&done).unwrap()
        ),
    )
    .unwrap();
    let score = |trials: &str, min_accepted: &str| {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_headwise"))
            .args(["heads", "score", "--method", "all", "--task", "niah"])
            .args(["--lengths", "256", "--depths", "0.5", "--data-dir"])
            .arg(&data_dir)
            .args(["--trials", trials, "--min-accepted", min_accepted])
            .arg("--model")
            .arg(&model)
            .arg("--out-dir")
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr).to_string();
        (run.status.success(), err)
    };
    // A grid of 2 trials cannot give 3 accepted ones: refused before any trial runs.
    let (ok, err) = score("2", "3");
    assert!(
        !ok && err.contains("--min-accepted 3 cannot be met: the grid holds 2 trials"),
        "{err}"
    );
    assert!(!dir.join("wu-niah.json").exists());
    // The stored trial was not accepted (recall 0), so 2 accepted of 2 cannot be reached:
    // no ranking, and the finished trials stay for the next run.
    let (ok, err) = score("2", "2");
    assert!(!ok, "{err}");
    assert!(err.contains("resuming: 1 trials already done"), "{err}");
    assert!(
        err.contains("fewer than --min-accepted 2: no ranking written"),
        "{err}"
    );
    assert!(!dir.join("wu-niah.json").exists());
    let lines = std::fs::read_to_string(&partial).unwrap().lines().count();
    assert_eq!(lines, 3, "header and two trials");
    // A larger grid reuses both and runs only the new trials: four more seeds, so that
    // the model answers at least one (with the integer prefill it misses seeds 1 and 2
    // and answers seed 3; with f32 prefill tiles it answered one of the first two).
    let (ok, err) = score("6", "1");
    assert!(ok, "{err}");
    assert!(err.contains("resuming: 2 trials already done"), "{err}");
    for method in ["wu", "locos"] {
        let ranking =
            headwise::policy::ranking::Ranking::load(&dir.join(format!("{method}-niah.json")))
                .unwrap();
        let p = &ranking.provenance;
        assert_eq!(
            (p.trials_run, p.task["seeds"].as_array().unwrap().len()),
            (6, 6)
        );
        let ks: Vec<usize> = p.stability.iter().map(|s| s.k).collect();
        assert_eq!(ks, [5, 10, 20]);
        for s in &p.stability {
            assert_eq!(s.rounds, 1000);
            assert!((0.0..=1.0).contains(&s.p05_jaccard) && (0.0..=1.0).contains(&s.mean_jaccard));
        }
    }
    assert!(!partial.exists());
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn dynamic_ablation_refuses_too_small_grids_resumes_and_grows() {
    let Some(essays) = common::data("haystack/paul_graham") else {
        return;
    };
    let data_dir = essays
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    let model = real_model();
    let ranking = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("policies/rankings/SmolLM2-135M-Instruct.Q4_1/locos-niah.json");
    let out = std::env::temp_dir().join(format!("headwise-dynabl-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = |trials: &str, min_correct: &str| {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_headwise"))
            .args(["heads", "dynamic-ablation", "--static"])
            .arg(&ranking)
            .args(["--lengths", "256", "--depths", "0.5", "--max-new", "8"])
            .args([
                "--trials",
                trials,
                "--min-correct",
                min_correct,
                "--data-dir",
            ])
            .arg(&data_dir)
            .arg("--model")
            .arg(&model)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        (
            run.status.success(),
            String::from_utf8_lossy(&run.stderr).to_string(),
        )
    };
    let (ok, err) = run("2", "3");
    assert!(
        !ok && err.contains("--min-correct 3 cannot be met: the grid holds 2 prompts"),
        "{err}"
    );
    assert!(!out.join("niah-ablation.md").exists());
    // A finished prompt the unablated model got wrong, as an earlier run would have left it.
    std::fs::create_dir_all(&out).unwrap();
    let id = ModelId::of_file(&model).unwrap();
    let top: Vec<(usize, usize)> = headwise::policy::ranking::Ranking::load(&ranking)
        .unwrap()
        .top(20)
        .iter()
        .map(|h| (h.layer, h.head))
        .collect();
    let header = serde_json::json!({
        "model_sha256": id.sha256, "static": top, "mode": "uniform-attention",
        "max_new": 8, "numerics": "fast", "random_heads": "seeded by prompt id",
    });
    let missed = headwise::lab::heads::dynamic_ablation::PromptOutcome {
        id: "niah-L256-D50-s100".into(),
        context_tokens: 256,
        correct: [false; 4],
        steps: [8; 4],
        silenced: [0; 4],
        compensation: Default::default(),
        base_active: 0,
        base_on_static: 0,
    };
    let partial = out.join(".niah-ablation.partial.jsonl");
    std::fs::write(
        &partial,
        format!("{header}\n{}\n", serde_json::to_string(&missed).unwrap()),
    )
    .unwrap();
    // Seed 101 is answered, seed 100 (above) is not: 1 of 2, short of 2.
    let (ok, err) = run("2", "2");
    assert!(!ok, "{err}");
    assert!(err.contains("resuming: 1 prompts already done"), "{err}");
    assert!(
        err.contains("fewer than --min-correct 2: no report written"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(&partial).unwrap().lines().count(),
        3
    );
    // Two more seeds: the report counts all four prompts. Seed 100 was written as missed
    // and 101 is answered (the first run says so); whether 102 and 103 are answered rests
    // on the last bits of the fast numerics (under 2e82903 one was, under 595f0a3 both),
    // so 2 or 3 prompts are kept, and at least 2 for the report to be written.
    let (ok, err) = run("4", "2");
    assert!(ok, "{err}");
    assert!(err.contains("resuming: 2 prompts already done"), "{err}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("niah-ablation.json")).unwrap())
            .unwrap();
    assert_eq!(report["summary"]["prompts"], 4);
    let kept = report["summary"]["variants"][0]["kept"]["n"]
        .as_u64()
        .unwrap();
    assert!((2..=3).contains(&kept), "{kept} prompts kept");
    assert!(!partial.exists());
    std::fs::remove_dir_all(&out).unwrap();
}
