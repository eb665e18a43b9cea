//! Per-step labels on the real model: a NIAH answer copied from the needle lights up
//! retrieval heads at the steps that copy it, and teacher forcing records exactly the
//! forced tokens.

mod common;

use headwise::lab::eval::Example;
use headwise::lab::heads::trace::{record, Effective, TraceConfig};
use headwise::lab::tasks::{self, Encoder, Haystack, TaskKind, TaskSpec};
use headwise::model::{Interventions, LoadedModel, Numerics};
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
