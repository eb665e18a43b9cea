//! Retrieval-head scoring on the real SmolLM2: a short needle-in-a-haystack trial is
//! retrieved and credits heads under both scores, and an interrupted `heads score` run
//! resumes without redoing finished trials.

mod common;

use common::real_model;
use headwise::lab::heads::run::{LocosSteps, Scorer, TrialOutcome};
use headwise::lab::tasks::{generate, Encoder, Haystack, TaskKind, TaskSpec};
use headwise::model::{LoadedModel, ModelId, Numerics};

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
fn an_interrupted_run_resumes_without_redoing_finished_trials() {
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
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_headwise"))
        .args(["heads", "score", "--method", "wu", "--task", "niah"])
        .args([
            "--lengths",
            "256",
            "--depths",
            "0.5",
            "--trials",
            "2",
            "--synthetic-haystack",
        ])
        .arg("--model")
        .arg(&model)
        .arg("--out-dir")
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{err}");
    assert!(err.contains("resuming: 1 trials already done"), "{err}");
    let ranking = headwise::policy::ranking::Ranking::load(&dir.join("wu-niah.json")).unwrap();
    assert_eq!(ranking.provenance.trials_run, 2);
    assert!(!partial.exists());
    std::fs::remove_dir_all(&out).unwrap();
}
