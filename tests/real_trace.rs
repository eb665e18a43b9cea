//! Per-step labels on the real model: a NIAH answer copied from the needle lights up
//! retrieval heads at the steps that copy it, teacher forcing records exactly the forced
//! tokens, and `heads trace` resumes from its partial file.

mod common;

use headwise::lab::eval::Example;
use headwise::lab::heads::trace::{record, Effective, ExampleSteps, Trace, TraceConfig};
use headwise::lab::tasks::{self, Encoder, Haystack, TaskKind, TaskSpec};
use headwise::model::{Interventions, LoadedModel, ModelId, Numerics};
use headwise::probe::LabelKind;

#[test]
fn niah_steps_that_copy_the_needle_have_active_heads() {
    let Some(data) = common::data_dir() else {
        return;
    };
    let hay = Haystack::from_dir(&data.join("haystack/paul_graham")).unwrap();
    let lm = LoadedModel::load(&common::real_model(), Numerics::Fast).unwrap();
    let enc = Encoder::from_model(&lm);
    let spec = TaskSpec {
        kind: TaskKind::Niah,
        lengths: vec![256],
        depths: vec![0.5],
        seeds: (0..6).collect(),
    };
    let trials = tasks::generate(&spec, &enc, &hay).unwrap();
    let cfg = TraceConfig {
        label_kind: LabelKind::Binary,
        effective: Effective::default(),
        max_new: 10,
        teacher: false,
    };
    let none = Interventions::new();
    let mc = lm.model.config();
    let (mut copying, mut lit) = (0, 0);
    for trial in &trials {
        let ex = Example::from_trial(trial);
        let steps = record(&lm, &ex, &cfg, None, &mut |_| none.clone()).unwrap();
        assert!(!steps.tokens.is_empty());
        for (f, l) in steps.features.iter().zip(&steps.labels) {
            assert_eq!((f.len(), l.len()), (mc.d_model, mc.n_layers * mc.n_heads));
            assert!(l.iter().all(|&v| v == 0.0 || v == 1.0));
        }
        // Steps that emit an answer token copied from the needle: some head should point
        // at it.
        for (i, t) in steps.tokens.iter().enumerate() {
            if trial.answer_tokens.contains(t) {
                copying += 1;
                lit += usize::from(steps.labels[i].contains(&1.0));
            }
        }
    }
    assert!(copying > 0, "the model should copy some needle");
    assert!(
        lit * 2 >= copying,
        "{lit} of {copying} copying steps have an active head"
    );
    // Teacher forcing feeds exactly the gold answer.
    let forced = &trials[0].answer_tokens;
    let ex = Example::from_trial(&trials[0]);
    let teacher = record(&lm, &ex, &cfg, Some(forced), &mut |_| none.clone()).unwrap();
    assert_eq!(&teacher.tokens, forced);
}

#[test]
fn an_interrupted_trace_resumes_from_its_partial_file_and_refuses_another_runs() {
    let Some(data) = common::data_dir() else {
        return;
    };
    let model = common::real_model();
    let id = ModelId::of_file(&model).unwrap();
    let dir = std::env::temp_dir().join(format!("headwise-trace-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let trace = |stem: &str, max_new: &str| {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_headwise"))
            .args(["heads", "trace", "--task", "niah", "--lengths", "256"])
            .args(["--depths", "0.5", "--trials", "2", "--max-new", max_new])
            .arg("--data-dir")
            .arg(&data)
            .arg("--model")
            .arg(&model)
            .arg("--out")
            .arg(dir.join(stem))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr).to_string();
        (run.status.success(), err)
    };
    let (ok, err) = trace("whole", "4");
    assert!(ok, "{err}");
    assert!(!dir.join(".whole.partial.jsonl").exists());
    let (whole, _) = Trace::load(&dir.join("whole.json")).unwrap();
    // The prompts the CLI traces, and their tokens' hash as the partial file records it
    // (FNV-1a over the prompt, a u32::MAX separator and the forced answer, written out
    // here from its definition).
    let lm = LoadedModel::load(&model, Numerics::Fast).unwrap();
    let hay = Haystack::from_dir(&data.join("haystack/paul_graham")).unwrap();
    let spec = TaskSpec {
        kind: TaskKind::Niah,
        lengths: vec![256],
        depths: vec![0.5],
        seeds: vec![0, 1],
    };
    let trials = tasks::generate(&spec, &Encoder::from_model(&lm), &hay).unwrap();
    let fnv = |tokens: &[u32]| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in tokens
            .iter()
            .chain([&u32::MAX])
            .flat_map(|t| t.to_le_bytes())
        {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    };
    // What an interrupted run leaves: the header, a finished prompt (made-up steps, so that
    // reuse shows), the same for the second prompt but recorded for other tokens (not to
    // be reused), a prompt of another grid and a line cut short.
    let config = TraceConfig {
        label_kind: LabelKind::Binary,
        effective: Effective::default(),
        max_new: 4,
        teacher: false,
    };
    let header = serde_json::json!({
        "model_sha256": id.sha256,
        "task": "niah",
        "config": config,
        "numerics": "fast",
        "cpu": headwise::provenance::cpu(),
    });
    let made_up = ExampleSteps {
        features: vec![vec![0.5; whole.features.ncols()]],
        labels: vec![vec![1.0; whole.labels.ncols()]],
        tokens: vec![7],
    };
    let line = |prompt: &str, tokens: u64| {
        serde_json::json!({"id": prompt, "tokens": tokens, "steps": made_up}).to_string()
    };
    let ids: Vec<String> = trials.iter().map(|t| t.id.clone()).collect();
    assert_eq!(ids, ["niah-L256-D50-s0", "niah-L256-D50-s1"]);
    let partial = dir.join(".cut.partial.jsonl");
    std::fs::write(
        &partial,
        format!(
            "{header}\n{}\n{}\n{}\n{{\"id\": \"niah-L2",
            line(&ids[0], fnv(&Example::from_trial(&trials[0]).prompt)),
            line(&ids[1], 12345),
            line("niah-L512-D50-s9", 0)
        ),
    )
    .unwrap();
    // Another --max-new is another run: refused, the file left as it was.
    let (ok, err) = trace("cut", "5");
    assert!(!ok, "{err}");
    assert!(err.contains("holds prompts of a different trace"), "{err}");
    assert!(!dir.join("cut.json").exists());
    let (ok, err) = trace("cut", "4");
    assert!(ok, "{err}");
    assert!(err.contains("resuming: 3 prompts already traced"), "{err}");
    let (cut, card) = Trace::load(&dir.join("cut.json")).unwrap();
    assert_eq!(card.prompts, 2);
    // Prompt 0 is the stored one; prompt 1 (stored for other tokens) was traced again, as
    // in the uninterrupted run.
    let rows = |t: &Trace, p: usize| -> Vec<usize> {
        (0..t.len()).filter(|&i| t.prompt[i] == p).collect()
    };
    assert_eq!(rows(&cut, 0), [0]);
    assert_eq!(cut.features.row(0).to_vec(), made_up.features[0]);
    assert_eq!(cut.labels.row(0).to_vec(), made_up.labels[0]);
    let (new, old) = (rows(&cut, 1), rows(&whole, 1));
    assert!(!new.is_empty() && new.len() == old.len());
    for (&a, &b) in new.iter().zip(&old) {
        assert_eq!(cut.features.row(a), whole.features.row(b));
        assert_eq!(cut.labels.row(a), whole.labels.row(b));
    }
    // The prompt of the other grid stays in the file for its own run.
    let left = std::fs::read_to_string(&partial).unwrap();
    assert!(left.contains("niah-L512-D50-s9"), "{left}");
    std::fs::remove_dir_all(&dir).unwrap();
}
