//! The eval harness's ablation modes on tiny random-weight models, each checked against
//! an independent computation (other weights, the observed attention, a recorder's
//! averages) rather than against its own code path.

mod common;

use common::{max_diff, tiny_config, tiny_gemma_config, Weights};
use headwise::model::{
    HeadCache, Interventions, Logits, Model, ModelId, NoObserver, Numerics, Recorder, Wants,
};
use headwise::policy::ablation::{AblationMode, Calibration, HeadSet};
use headwise::provenance::Made;

const TOKENS: &[u32] = &[5, 17, 3, 56, 42, 42, 8, 60, 1, 33, 21];
const CALIBRATION: &[&[u32]] = &[&[2, 9, 4, 57, 13], &[50, 51, 52, 8, 44]];

fn logits(model: &Model, tokens: &[u32], edits: &Interventions) -> Vec<Vec<f32>> {
    let mut cache = HeadCache::plain(model.config(), tokens.len());
    model
        .forward(tokens, &mut cache, Logits::All, &mut NoObserver, edits)
        .unwrap()
        .to_vec2()
        .unwrap()
}

fn id() -> ModelId {
    ModelId {
        name: "tiny".into(),
        sha256: "00".into(),
    }
}

fn calibration(model: &Model) -> Calibration {
    let prompts: Vec<Vec<u32>> = CALIBRATION.iter().map(|p| p.to_vec()).collect();
    Calibration::compute(model, &id(), &prompts, "tiny", &Made::now("fast")).unwrap()
}

fn all_modes() -> [AblationMode; 4] {
    [
        AblationMode::ZeroOutput,
        AblationMode::MeanOutput,
        AblationMode::MeanQuery,
        AblationMode::UniformAttention,
    ]
}

#[test]
fn k_zero_reproduces_the_unablated_logits_exactly_in_every_mode() {
    for cfg in [tiny_config(), tiny_gemma_config()] {
        let model = Weights::random(cfg, 11).model(Numerics::Fast);
        let plain = logits(&model, TOKENS, &Interventions::new());
        let calib = calibration(&model);
        for mode in all_modes() {
            let edits = HeadSet(vec![]).interventions(mode, Some(&calib)).unwrap();
            assert_eq!(logits(&model, TOKENS, &edits), plain, "{mode:?}");
        }
    }
}

#[test]
fn zero_output_on_every_head_of_a_layer_equals_a_model_without_that_layers_attention() {
    for cfg in [tiny_config(), tiny_gemma_config()] {
        let w = Weights::random(cfg.clone(), 12);
        let layer = 1;
        let heads = HeadSet((0..cfg.n_heads).map(|h| (layer, h)).collect());
        let edits = heads.interventions(AblationMode::ZeroOutput, None).unwrap();
        let ablated = logits(&w.model(Numerics::Fast), TOKENS, &edits);
        // Independent: the same weights with the layer's output projection zeroed.
        let mut cut = w.clone();
        cut.layers[layer].wo.fill(0.0);
        let model = cut.model(Numerics::Fast);
        let mut cache = HeadCache::plain(model.config(), TOKENS.len());
        let want = model
            .forward(
                TOKENS,
                &mut cache,
                Logits::All,
                &mut NoObserver,
                &Interventions::new(),
            )
            .unwrap();
        let d = max_diff(&want, &ablated);
        assert!(d < 1e-4, "{:?}: max |diff| {d}", cfg.architecture);
        let plain = logits(&w.model(Numerics::Fast), TOKENS, &Interventions::new());
        let moved = plain
            .iter()
            .flatten()
            .zip(ablated.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(moved > 1e-3, "the ablation must matter");
    }
}

#[test]
fn uniform_attention_spreads_the_heads_attention_evenly_over_visible_keys() {
    for cfg in [tiny_config(), tiny_gemma_config()] {
        let model = Weights::random(cfg.clone(), 13).model(Numerics::Fast);
        let (layer, head) = (1, 2);
        let edits = HeadSet(vec![(layer, head)])
            .interventions(AblationMode::UniformAttention, None)
            .unwrap();
        let mut rec = Recorder::new(Wants {
            attention: true,
            ..Wants::default()
        });
        let mut cache = HeadCache::plain(model.config(), TOKENS.len());
        model
            .forward(TOKENS, &mut cache, Logits::Last, &mut rec, &edits)
            .unwrap();
        let probs: Vec<Vec<Vec<f32>>> = rec.steps[0].attention[layer].to_vec3().unwrap();
        // Layer 1 of the tiny Gemma is a sliding-window layer: the window bounds the keys.
        let window = cfg
            .sliding_window
            .filter(|sw| layer % sw.global_every != sw.global_every - 1)
            .map_or(usize::MAX, |sw| sw.size);
        for (t, row) in probs[head].iter().enumerate() {
            let visible = (t + 1).min(window);
            for (j, &p) in row.iter().enumerate() {
                let want = if j <= t && t - j < window {
                    1.0 / visible as f32
                } else {
                    0.0
                };
                assert!((p - want).abs() < 1e-6, "query {t} key {j}: {p} vs {want}");
            }
        }
        // Another head of the layer keeps its own, uneven attention.
        let other = &probs[(head + 1) % cfg.n_heads][TOKENS.len() - 1];
        let spread =
            other.iter().fold(0f32, |m, &p| m.max(p)) - other.iter().fold(1f32, |m, &p| m.min(p));
        assert!(spread > 1e-3);
    }
}

#[test]
fn calibration_means_are_the_average_a_recorder_sees_past_position_zero() {
    let model = Weights::random(tiny_config(), 14).model(Numerics::Fast);
    let calib = calibration(&model);
    let cfg = model.config();
    let (layer, head) = (1, 4);
    let mut out_sum = vec![0f64; cfg.d_head];
    let mut q_sum = vec![0f64; cfg.d_head];
    let mut n = 0;
    for p in CALIBRATION {
        let mut rec = Recorder::new(Wants {
            head_outputs: true,
            queries: true,
            ..Wants::default()
        });
        let mut cache = HeadCache::plain(cfg, p.len());
        model
            .forward(p, &mut cache, Logits::Last, &mut rec, &Interventions::new())
            .unwrap();
        let outs: Vec<Vec<Vec<f32>>> = rec.steps[0].head_outputs[layer].to_vec3().unwrap();
        let qs: Vec<Vec<Vec<f32>>> = rec.steps[0].queries[layer].to_vec3().unwrap();
        for t in 1..p.len() {
            for c in 0..cfg.d_head {
                out_sum[c] += outs[t][head][c] as f64;
                q_sum[c] += qs[t][head][c] as f64;
            }
            n += 1;
        }
    }
    assert_eq!(calib.n_positions, n);
    let out = calib.output(layer, head).unwrap();
    let q = calib.query(layer, head).unwrap();
    for c in 0..cfg.d_head {
        assert!((out[c] as f64 - out_sum[c] / n as f64).abs() < 1e-5);
        assert!((q[c] as f64 - q_sum[c] / n as f64).abs() < 1e-5);
    }
}

#[test]
fn mean_query_replaces_the_query_before_rope() {
    // Calibrate on one two-token prompt: the mean over positions past the first is
    // position 1's own query. Ablating layer 0's heads with it then changes nothing on
    // that prompt (position 0 attends only to itself whatever its query), and it must
    // change the logits on a longer prompt.
    let model = Weights::random(tiny_config(), 15).model(Numerics::Fast);
    let prompt = [7u32, 31];
    let calib = Calibration::compute(
        &model,
        &id(),
        &[prompt.to_vec()],
        "pair",
        &Made::now("fast"),
    )
    .unwrap();
    let heads = HeadSet((0..model.config().n_heads).map(|h| (0, h)).collect());
    let edits = heads
        .interventions(AblationMode::MeanQuery, Some(&calib))
        .unwrap();
    let plain = logits(&model, &prompt, &Interventions::new());
    let d = max_diff_rows(&logits(&model, &prompt, &edits), &plain);
    assert!(d < 1e-5, "max |diff| {d}");
    let longer = [7u32, 31, 64, 2];
    let d = max_diff_rows(
        &logits(&model, &longer, &edits),
        &logits(&model, &longer, &Interventions::new()),
    );
    assert!(d > 1e-3, "the ablation must matter: {d}");
}

fn max_diff_rows(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}
