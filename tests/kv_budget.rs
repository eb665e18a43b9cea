//! The KV-budget sweep on the real model: a run cut short and resumed reports exactly
//! like one run straight through; kv_fraction is 1 for `full` and below 1 for a
//! streaming policy; a folder holding another spec is refused.

mod common;

use headwise::lab::eval::kv_budget::{run, write_report, BudgetSpec};
use headwise::model::{LoadedModel, ModelId, Numerics};
use headwise::provenance::Made;

/// A fresh scratch folder, removed when the returned value drops.
fn scratch(tag: &str) -> common::Scratch {
    common::Scratch::dir(&format!("kv-{tag}"))
}

fn spec(data: &std::path::Path, window: usize) -> BudgetSpec {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = format!(
        r#"
name = "kv-test"
model = "smollm2-135m"
data_dir = "{}"
max_new = 4

[[task]]
name = "niah"
lengths = [300]
depths = [0.5]
seeds = [1, 2]

[[policy]]
name = "full"
series = "full"
policy = {{ type = "full" }}

[[policy]]
name = "window"
series = "window"
policy = {{ type = "window", window = {window}, sink = 4, prefill = "full_then_evict" }}

[[policy]]
name = "locos-9"
series = "static-locos"
policy = {{ type = "static_heads", window = {window}, heads = {{ ranking = "{root}/policies/rankings/{{model}}/locos-niah.json", select = {{ top_k = 9 }} }} }}
"#,
        data.display()
    );
    let dir = scratch(&format!("spec{window}"));
    let path = dir.join("spec.toml");
    std::fs::write(&path, text).unwrap();
    BudgetSpec::load(&path).unwrap()
}

#[test]
fn a_resumed_sweep_reports_like_an_uninterrupted_one() {
    let Some(data) = common::data_dir() else {
        return;
    };
    let path = common::real_model();
    let id = ModelId::of_file(&path).unwrap();
    let lm = LoadedModel::load(&path, Numerics::Fast).unwrap();
    let first = spec(&data, 64);
    let made = Made::now(Numerics::Fast.name());
    let whole = scratch("whole");
    assert_eq!(run(&first, &lm, &id, &whole, None, &made, None).unwrap(), 6);
    let summary = write_report(&whole).unwrap();
    let value = |policy: &str, metric: &str| {
        summary
            .iter()
            .find(|r| r.policy.as_deref() == Some(policy) && r.metric == metric)
            .map(|r| r.value)
            .unwrap()
    };
    assert_eq!(value("full", "kv_fraction"), 1.0);
    let window = value("window", "kv_fraction");
    assert!(window > 0.0 && window < 0.5, "{window}");
    let locos = value("locos-9", "kv_fraction");
    assert!(locos > window && locos < 1.0, "{locos}");
    // interrupted after the first example (and a line cut in half), then resumed
    let cut = scratch("cut");
    run(&first, &lm, &id, &cut, Some(1), &made, None).unwrap();
    let records = cut.join("records.jsonl");
    let text = std::fs::read_to_string(&records).unwrap();
    std::fs::write(&records, &text[..text.len() - 20]).unwrap();
    assert_eq!(run(&first, &lm, &id, &cut, None, &made, None).unwrap(), 4);
    let a = std::fs::read_to_string(whole.join("summary.json")).unwrap();
    write_report(&cut).unwrap();
    let b = std::fs::read_to_string(cut.join("summary.json")).unwrap();
    // identical up to the measured speeds
    let strip = |s: &str| -> Vec<serde_json::Value> {
        let v: Vec<serde_json::Value> = serde_json::from_str(s).unwrap();
        v.into_iter()
            .filter(|r| r["metric"] != "decode_tok_s")
            .collect()
    };
    assert_eq!(strip(&a), strip(&b));
    // another spec into the same folder is refused before any generation
    let other = spec(&data, 32);
    let err = run(&other, &lm, &id, &cut, None, &made, None).unwrap_err();
    assert!(err.to_string().contains("another spec"), "{err}");
}
