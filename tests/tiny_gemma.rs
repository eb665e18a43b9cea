//! The Gemma 3 path of the instrumented forward pass on a tiny random-weight model built
//! in-process (sliding window of 5, every second layer global, MQA, QK-norm, pre and
//! post norms, GELU), checked against the independent brute-force pass of
//! `common::brute_force_logits`.

mod common;

use common::{brute_force_logits, max_diff, no_edits, tiny_gemma_config, BruteEdits, Weights};
use headwise::model::{
    HeadCache, Interventions, KeyRestriction, Logits, Model, NoObserver, Numerics, Recorder, Wants,
};

/// Deterministic token ids below the tiny vocabulary of 61.
fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 61).collect()
}

/// Every position's logits, one decode step at a time from an empty cache.
fn stepwise(model: &Model, toks: &[u32], edits: &Interventions) -> Vec<Vec<f32>> {
    let mut cache = HeadCache::plain(model.config(), 1);
    toks.iter()
        .map(|&t| {
            model
                .forward(&[t], &mut cache, Logits::Last, &mut NoObserver, edits)
                .unwrap()
                .get(0)
                .unwrap()
                .to_vec1()
                .unwrap()
        })
        .collect()
}

/// How far each numerics may be from the f32 brute force: `Ggml` looks GELU up in ggml's
/// f16 table (a relative error of up to 2^-11 per value); the others compute it in f32.
fn tolerance(numerics: Numerics) -> f32 {
    match numerics {
        Numerics::Ggml => 5e-3,
        Numerics::Fast | Numerics::Reference => 1e-4,
    }
}

#[test]
fn prefill_and_decode_match_brute_force_in_every_numerics() {
    let w = Weights::random(tiny_gemma_config(), 21);
    let toks = tokens(13);
    let want = brute_force_logits(&w, &toks, &no_edits());
    for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
        let mut model = w.model(numerics);
        for chunk in [256, 1, 3, 4, 7] {
            model.set_chunk(chunk);
            let mut cache = HeadCache::plain(model.config(), 4);
            let got = model
                .forward(
                    &toks,
                    &mut cache,
                    Logits::All,
                    &mut NoObserver,
                    &Interventions::new(),
                )
                .unwrap();
            let d = max_diff(&got, &want);
            assert!(
                d < tolerance(numerics),
                "{numerics:?}, chunk {chunk}: max |diff| {d}"
            );
        }
        let d = max_diff(
            &candle_core::Tensor::new(
                stepwise(&model, &toks, &Interventions::new()),
                &candle_core::Device::Cpu,
            )
            .unwrap(),
            &want,
        );
        assert!(
            d < tolerance(numerics),
            "{numerics:?} decode: max |diff| {d}"
        );
    }
}

#[test]
fn long_decode_past_the_window_matches_brute_force_and_keeps_little_kv() {
    let mut cfg = tiny_gemma_config();
    cfg.context_length = 400;
    let w = Weights::random(cfg, 22);
    let toks = tokens(300);
    let want = brute_force_logits(&w, &toks, &no_edits());
    let model = w.model(Numerics::Fast);
    let got = stepwise(&model, &toks, &Interventions::new());
    let got = candle_core::Tensor::new(got, &candle_core::Device::Cpu).unwrap();
    let d = max_diff(&got, &want);
    assert!(d < 1e-4, "max |diff| {d}");
    // The two global layers hold all 300 positions; each windowed one only its window
    // of 5 (a ring), not 300.
    let mut cache = HeadCache::plain(model.config(), 300);
    model
        .forward(
            &toks,
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap();
    let per_position = 2 * 16 * 4; // keys and values, one KV head of 16 f32
    assert_eq!(cache.bytes().total(), (2 * 300 + 2 * 5) * per_position);
    let err = cache.truncate(2).unwrap_err().to_string();
    assert!(err.contains("cannot rewind"), "{err}");
}

#[test]
fn observed_attention_is_indexed_by_absolute_position_on_every_layer() {
    let model = Weights::random(tiny_gemma_config(), 23).model(Numerics::Fast);
    let toks = tokens(12);
    let mut cache = HeadCache::plain(model.config(), 4);
    model
        .forward(
            &toks[..11],
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap();
    let mut rec = Recorder::new(Wants::all());
    model
        .forward(
            &toks[11..],
            &mut cache,
            Logits::Last,
            &mut rec,
            &Interventions::new(),
        )
        .unwrap();
    let step = &rec.steps[0];
    assert_eq!(step.attention.len(), 4);
    for (layer, probs) in step.attention.iter().enumerate() {
        assert_eq!(probs.dims(), &[4, 1, 12], "layer {layer}");
        let rows: Vec<Vec<Vec<f32>>> = probs.to_vec3().unwrap();
        for row in rows {
            let row = &row[0];
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            let local = layer % 2 == 0;
            // a local layer (window 5) puts no weight on positions 0..7
            let outside: f32 = row[..7].iter().sum();
            assert_eq!(local, outside == 0.0, "layer {layer}: {row:?}");
        }
    }
}

#[test]
fn key_restrictions_compose_with_the_window() {
    let w = Weights::random(tiny_gemma_config(), 24);
    let toks = tokens(12);
    let mut edits = Interventions::new();
    // head 2 of the global layer 1 and head 0 of the local layer 2 see sink 1 + window 2
    for (layer, head) in [(1, 2), (2, 0)] {
        edits.restrict_keys(
            layer,
            head,
            KeyRestriction::SinkWindow { sink: 1, window: 2 },
        );
    }
    let visible = |l: usize, h: usize, q: usize, k: usize| {
        !([(1, 2), (2, 0)].contains(&(l, h))) || k < 1 || k + 2 > q
    };
    let want = brute_force_logits(
        &w,
        &toks,
        &BruteEdits {
            visible: &visible,
            output: &|_, _| None,
            stored: &|_, _, row| row.to_vec(),
        },
    );
    for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
        let model = w.model(numerics);
        let mut cache = HeadCache::plain(model.config(), 4);
        let got = model
            .forward(&toks, &mut cache, Logits::All, &mut NoObserver, &edits)
            .unwrap();
        let tol = tolerance(numerics);
        assert!(max_diff(&got, &want) < tol, "{numerics:?} prefill");
        let got =
            candle_core::Tensor::new(stepwise(&model, &toks, &edits), &candle_core::Device::Cpu)
                .unwrap();
        assert!(max_diff(&got, &want) < tol, "{numerics:?} decode");
    }
}
