//! Training probes ("Retrieval Heads are Dynamic", 2026, section on the MLP probe):
//! [`train()`] takes a recorded [`crate::lab::heads::trace::Trace`] to a
//! [`crate::probe::Probe`] whose card holds test-split metrics of the probe and of two
//! baselines (per-head linear models and the static top-k heads). Steps are split
//! 70/20/10 by prompt ([`split_by_prompt`]).

mod baselines;
mod fit;
mod metrics;
mod split;
mod train;

pub use metrics::{average_precision, best_threshold, binary_metrics, continuous_metrics};
pub use split::{split_by_prompt, Split, SPLIT_FRACTIONS};
pub use train::{train, validate_trace, TrainOptions};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::heads::trace::Trace;
    use crate::probe::{
        Activation, BaselineConfig, LabelKind, Metrics, Probe, ProbeConfig, StaticHeads,
    };
    use crate::rng::SplitMix64;
    use ndarray::{Array2, Axis};

    const D: usize = 6;

    /// 20 prompts x 5 steps of features in `+-[0.3, 1]`; labels from `label(x)`.
    fn trace(kind: LabelKind, label: impl Fn(&[f32]) -> Vec<f32>) -> Trace {
        let mut rng = SplitMix64::new(42, 0);
        let rows = 100;
        let features = Array2::from_shape_fn((rows, D), |_| {
            let magnitude = 0.3 + 0.7 * rng.next_f32();
            if rng.next_f32() < 0.5 {
                -magnitude
            } else {
                magnitude
            }
        });
        let labels: Vec<f32> = features
            .outer_iter()
            .flat_map(|r| label(r.as_slice().unwrap_or(&[])))
            .collect();
        Trace {
            label_kind: kind,
            n_layers: 2,
            n_heads: 2,
            labels: Array2::from_shape_vec((rows, 4), labels).unwrap(),
            features,
            prompt: (0..rows).map(|r| r / 5).collect(),
            step: (0..rows).map(|r| r % 5).collect(),
        }
    }

    fn binary_trace() -> Trace {
        // Head j is active when feature j is positive.
        trace(LabelKind::Binary, |x| {
            (0..4).map(|j| (x[j] > 0.0) as u8 as f32).collect()
        })
    }

    fn fast_options(epochs: usize) -> TrainOptions {
        let mut opts = TrainOptions::new(
            "tiny",
            "ab12",
            serde_json::json!({"task": "unit"}),
            crate::provenance::Made::now("fast"),
        );
        opts.probe = ProbeConfig {
            hidden: vec![32],
            dropout: 0.0,
            lr: 1e-2,
            batch_size: 16,
            max_epochs: epochs,
            early_stopping_patience: epochs,
            ..ProbeConfig::default()
        };
        opts.baselines.static_heads = StaticHeads::TopK { k: 2 };
        opts
    }

    fn train_rows(t: &Trace, opts: &TrainOptions) -> (Array2<f32>, Array2<f32>) {
        let split = split_by_prompt(&t.prompt, opts.split_seed).unwrap();
        (
            t.features.select(Axis(0), &split.train),
            t.labels.select(Axis(0), &split.train),
        )
    }

    #[test]
    fn the_probe_overfits_a_separable_binary_trace() {
        let t = binary_trace();
        let opts = fast_options(150);
        let probe = train(&t, &opts, &mut |_| {}).unwrap();
        let (x, y) = train_rows(&t, &opts);
        let scores = probe.predict_batch(x.view()).unwrap();
        let threshold = probe.threshold().unwrap();
        let rows: Vec<usize> = (0..y.nrows()).collect();
        let m = binary_metrics(scores.view(), y.view(), threshold, &rows, &[0.0; 4], 2);
        assert_eq!(m.micro_f1, 1.0, "train F1 at threshold {threshold}");
        let card = probe.card();
        assert!(card.training.epochs_run == 150 && card.training.best_epoch > 0);
        let Metrics::Binary(test) = &card.metrics.probe else {
            panic!("binary metrics expected")
        };
        assert!(test.micro_f1 > 0.9 && test.auprc.unwrap() > 0.9, "{test:?}");
        let Metrics::Binary(stat) = &card.metrics.static_topk else {
            panic!("binary metrics expected")
        };
        assert_eq!(card.baseline_fit.static_heads.len(), 2);
        assert!(stat.micro_f1 < test.micro_f1);
    }

    #[test]
    fn the_probe_fits_a_smooth_continuous_trace() {
        let t = trace(LabelKind::Continuous, |x| {
            (0..4)
                .map(|j| 0.5 + 0.4 * (x[j] - 0.5 * x[(j + 1) % D]).tanh())
                .collect()
        });
        let mut opts = fast_options(200);
        opts.probe.activation = Activation::Relu;
        let probe = train(&t, &opts, &mut |_| {}).unwrap();
        let (x, y) = train_rows(&t, &opts);
        let pred = probe.predict_batch(x.view()).unwrap();
        let rows: Vec<usize> = (0..y.nrows()).collect();
        let r2 = continuous_metrics(pred.view(), y.view(), &rows, &[0.0; 4], 2)
            .r2_micro
            .unwrap();
        assert!(r2 > 0.95, "train R^2 {r2}");
        assert_eq!(probe.threshold(), None);
        let Metrics::Continuous(linear) = &probe.card().metrics.linear else {
            panic!("continuous metrics expected")
        };
        assert!(linear.r2_micro.unwrap() > 0.5, "{linear:?}");
        assert!(probe.card().baseline_fit.ridge_lambda.is_some());
    }

    /// The same JSON up to floats within 1e-12 (relative).
    fn json_close(a: &serde_json::Value, b: &serde_json::Value) -> bool {
        use serde_json::Value;
        match (a, b) {
            (Value::Number(x), Value::Number(y)) => {
                let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                (x - y).abs() <= 1e-12 * x.abs().max(y.abs()).max(1.0)
            }
            (Value::Array(x), Value::Array(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_close(x, y))
            }
            (Value::Object(x), Value::Object(y)) => {
                x.len() == y.len()
                    && x.iter()
                        .all(|(k, v)| y.get(k).is_some_and(|w| json_close(v, w)))
            }
            _ => a == b,
        }
    }

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("headwise-probe-{tag}-{}", std::process::id()))
    }

    #[test]
    fn a_saved_probe_reloads_to_identical_predictions() {
        let t = binary_trace();
        let probe = train(&t, &fast_options(3), &mut |_| {}).unwrap();
        let dir = temp_dir("roundtrip");
        let card_path = probe.save(&dir, "p").unwrap();
        let loaded = Probe::load(&card_path).unwrap();
        let again = Probe::load_named(&dir, "p").unwrap();
        assert_eq!(loaded, again);
        assert_eq!(
            probe.predict_batch(t.features.view()).unwrap(),
            loaded.predict_batch(t.features.view()).unwrap()
        );
        let row = t.features.row(7).to_vec();
        let mut ws = loaded.workspace();
        let mut out = vec![0.0; 4];
        loaded.predict_into(&row, &mut ws, &mut out).unwrap();
        assert_eq!(probe.predict(&row).unwrap(), out);
        // The metrics come back from JSON text, whose float parsing may differ from the
        // written value in the last bit: compare them to 1e-12.
        let a = serde_json::to_value(&loaded.card().metrics).unwrap();
        let b = serde_json::to_value(&probe.card().metrics).unwrap();
        assert!(json_close(&a, &b), "{a}\n{b}");
        assert_eq!(loaded.threshold(), probe.threshold());
        assert!(loaded.card().weights.is_some() && probe.card().weights.is_none());
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn mismatched_widths_and_tampered_files_are_refused() {
        let t = binary_trace();
        let probe = train(&t, &fast_options(1), &mut |_| {}).unwrap();
        assert!(probe.check_model(D, 4, Some("AB12")).is_ok());
        let err = probe.check_model(D + 1, 4, None).unwrap_err().to_string();
        assert!(
            err.contains("width 6") && err.contains("d_model is 7"),
            "{err}"
        );
        assert!(probe.check_model(D, 5, None).is_err());
        assert!(probe.check_model(D, 4, Some("cd34")).is_err());
        assert!(probe.predict(&[0.0; D + 1]).is_err());

        let dir = temp_dir("tamper");
        let card_path = probe.save(&dir, "p").unwrap();
        let card: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&card_path).unwrap()).unwrap();
        let write = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut c = card.clone();
            edit(&mut c);
            std::fs::write(&card_path, serde_json::to_string(&c).unwrap()).unwrap();
            Probe::load(&card_path).unwrap_err().to_string()
        };
        let err = write(&|c| c["architecture"]["input_dim"] = 7.into());
        assert!(
            err.contains("norm.std") && err.contains("[6]") && err.contains("[7]"),
            "{err}"
        );
        let err = write(&|c| c["schema_version"] = 2.into());
        assert!(err.contains("schema version 2"), "{err}");
        let err = write(&|c| c["weights"]["sha256"] = "00".into());
        assert!(err.contains("SHA-256"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_traces_are_refused_naming_the_row() {
        let opts = fast_options(1);
        let mut t = binary_trace();
        t.features[[13, 2]] = f32::NAN;
        let err = train(&t, &opts, &mut |_| {}).unwrap_err().to_string();
        assert!(
            err.contains("feature row 13") && err.contains("NaN"),
            "{err}"
        );

        let mut t = binary_trace();
        t.labels[[4, 1]] = 0.5;
        let err = train(&t, &opts, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("label row 4"), "{err}");

        let mut t = binary_trace();
        t.n_heads = 3;
        let err = train(&t, &opts, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("labels have 4 columns"), "{err}");

        let mut t = binary_trace();
        t.prompt = vec![0; 100];
        let err = train(&t, &opts, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("1 prompts"), "{err}");
    }

    #[test]
    fn configs_round_trip_through_serde_and_fill_defaults() {
        let cfg = ProbeConfig::default();
        let json = serde_json::to_value(&cfg).unwrap();
        assert_eq!(serde_json::from_value::<ProbeConfig>(json).unwrap(), cfg);
        let partial: ProbeConfig = serde_json::from_str(
            r#"{"hidden": [64], "binary_loss": {"kind": "weighted_bce", "max_pos_weight": 50}}"#,
        )
        .unwrap();
        assert_eq!(partial.hidden, vec![64]);
        assert_eq!(partial.lr, ProbeConfig::default().lr);
        let b = BaselineConfig::default();
        let json = serde_json::to_value(&b).unwrap();
        assert_eq!(serde_json::from_value::<BaselineConfig>(json).unwrap(), b);
        let bad = ProbeConfig {
            dropout: 1.0,
            ..ProbeConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("dropout"));
    }
}
