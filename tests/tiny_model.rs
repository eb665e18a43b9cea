//! Structure and invariants of the instrumented forward pass on tiny random-weight llama
//! models built in-process, checked against an independent brute-force pass
//! (`common::brute_force_logits`: plain f64-accumulating loops, no candle).

mod common;

use common::{brute_force_logits, max_diff, no_edits, tiny_config, BruteEdits, Weights};
use headwise::model::{
    HeadCache, Interventions, KeyRestriction, Logits, Model, NoObserver, Numerics, OutputEdit,
    Recorder, Wants,
};

const TOKENS: &[u32] = &[5, 17, 3, 96, 42, 42, 8, 60, 1, 33, 71];

fn logits_all(model: &Model, tokens: &[u32], edits: &Interventions) -> candle_core::Tensor {
    let mut cache = HeadCache::plain(model.config(), tokens.len());
    model
        .forward(tokens, &mut cache, Logits::All, &mut NoObserver, edits)
        .unwrap()
}

#[test]
fn forward_matches_brute_force_in_every_numerics() {
    let w = Weights::random(tiny_config(), 1);
    let want = brute_force_logits(&w, TOKENS, &no_edits());
    for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
        let got = logits_all(&w.model(numerics), TOKENS, &Interventions::new());
        assert_eq!(got.dims(), &[TOKENS.len(), 97]);
        let d = max_diff(&got, &want);
        assert!(d < 1e-4, "{numerics:?}: max |diff| {d}");
    }
}

#[test]
fn last_logits_are_the_last_row_of_all() {
    let model = Weights::random(tiny_config(), 2).model(Numerics::Fast);
    let all = logits_all(&model, TOKENS, &Interventions::new());
    let mut cache = HeadCache::plain(model.config(), 4);
    let last = model
        .forward(
            TOKENS,
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap();
    assert_eq!(last.dims(), &[1, 97]);
    let want: Vec<Vec<f32>> = vec![all.get(TOKENS.len() - 1).unwrap().to_vec1().unwrap()];
    assert!(max_diff(&last, &want) < 1e-5);
    assert_eq!(cache.len(), TOKENS.len());
}

#[test]
fn gqa_query_heads_read_their_own_kv_head() {
    // Hide every key but the query's own from the heads of KV group 1 only: the result
    // must equal the brute force that applies the same rule to heads 3..6, which read KV
    // head 1. Were the mapping wrong (e.g. head % n_kv), a different set of heads would
    // be affected and the logits would disagree.
    let w = Weights::random(tiny_config(), 3);
    let model = w.model(Numerics::Fast);
    let mut edits = Interventions::new();
    for l in 0..2 {
        for h in 3..6 {
            edits.restrict_keys(l, h, KeyRestriction::Ranges(vec![]));
        }
    }
    let got = logits_all(&model, TOKENS, &edits);
    let brute = BruteEdits {
        visible: &|_, h, _, _| h < 3,
        output: &|_, _| None,
        stored: &|_, _, row| row.to_vec(),
    };
    let want = brute_force_logits(&w, TOKENS, &brute);
    assert!(max_diff(&got, &want) < 1e-4);
    let plain = brute_force_logits(&w, TOKENS, &no_edits());
    assert!(max_diff(&got, &plain) > 1e-3, "the restriction must matter");
}

#[test]
fn causal_masking_hides_the_future() {
    let model = Weights::random(tiny_config(), 4).model(Numerics::Fast);
    let a = logits_all(&model, TOKENS, &Interventions::new());
    let mut other = TOKENS.to_vec();
    for t in other.iter_mut().skip(6) {
        *t = (*t + 11) % 97;
    }
    let b = logits_all(&model, &other, &Interventions::new());
    let a6 = a.narrow(0, 0, 6).unwrap();
    let b6: Vec<Vec<f32>> = b.narrow(0, 0, 6).unwrap().to_vec2().unwrap();
    assert!(max_diff(&a6, &b6) < 1e-6);
    let a7 = a.narrow(0, 6, 1).unwrap();
    let b7: Vec<Vec<f32>> = b.narrow(0, 6, 1).unwrap().to_vec2().unwrap();
    assert!(max_diff(&a7, &b7) > 1e-3);
}

#[test]
fn incremental_decode_with_kv_cache_equals_full_recompute() {
    let model = Weights::random(tiny_config(), 5).model(Numerics::Fast);
    let full = logits_all(&model, TOKENS, &Interventions::new());
    // Start with a capacity of 1 so the cache must grow (and copy) several times.
    let mut cache = HeadCache::plain(model.config(), 1);
    let mut rows = Vec::new();
    for &t in TOKENS {
        let l = model
            .forward(
                &[t],
                &mut cache,
                Logits::Last,
                &mut NoObserver,
                &Interventions::new(),
            )
            .unwrap();
        rows.push(l.get(0).unwrap().to_vec1::<f32>().unwrap());
    }
    let d = max_diff(&full, &rows);
    assert!(d <= 1e-4, "max |diff| {d}");
}

#[test]
fn chunked_prefill_equals_unchunked() {
    let w = Weights::random(tiny_config(), 6);
    let whole = logits_all(&w.model(Numerics::Fast), TOKENS, &Interventions::new());
    for chunk in [1, 3, 4, 5] {
        let mut model = w.model(Numerics::Fast);
        model.set_chunk(chunk);
        let chunked: Vec<Vec<f32>> = logits_all(&model, TOKENS, &Interventions::new())
            .to_vec2()
            .unwrap();
        let d = max_diff(&whole, &chunked);
        assert!(d <= 1e-4, "chunk {chunk}: max |diff| {d}");
    }
}

#[test]
fn zeroing_a_head_equals_removing_its_output_projection_slice() {
    let w = Weights::random(tiny_config(), 7);
    let (layer, head) = (1, 4);
    let mut edits = Interventions::new();
    edits.set_output(layer, head, OutputEdit::Zero);
    let edited = logits_all(&w.model(Numerics::Fast), TOKENS, &edits);

    // A separate computation: the same model with W_O's columns of that head set to zero.
    let mut cut = w.clone();
    let (d, dh, nh) = (w.cfg.d_model, w.cfg.d_head, w.cfg.n_heads);
    for row in 0..d {
        for c in head * dh..(head + 1) * dh {
            cut.layers[layer].wo[row * nh * dh + c] = 0.0;
        }
    }
    let removed: Vec<Vec<f32>> =
        logits_all(&cut.model(Numerics::Fast), TOKENS, &Interventions::new())
            .to_vec2()
            .unwrap();
    assert!(max_diff(&edited, &removed) < 1e-5);
    let plain = logits_all(&w.model(Numerics::Fast), TOKENS, &Interventions::new());
    assert!(max_diff(&plain, &removed) > 1e-4, "the head must matter");
}

#[test]
fn replacing_a_head_output_and_sink_window_match_brute_force() {
    let w = Weights::random(tiny_config(), 8);
    let mean: Vec<f32> = (0..8).map(|i| 0.1 * i as f32 - 0.3).collect();
    let mut edits = Interventions::new();
    edits.set_output(0, 2, OutputEdit::Replace(mean.clone()));
    edits.restrict_keys(1, 0, KeyRestriction::SinkWindow { sink: 2, window: 3 });
    let got = logits_all(&w.model(Numerics::Fast), TOKENS, &edits);
    let brute = BruteEdits {
        visible: &|l, h, q, k| !(l == 1 && h == 0) || k < 2 || k + 3 > q,
        output: &|l, h| (l == 0 && h == 2).then(|| mean.clone()),
        stored: &|_, _, row| row.to_vec(),
    };
    let want = brute_force_logits(&w, TOKENS, &brute);
    assert!(max_diff(&got, &want) < 1e-4);
}

#[test]
fn an_all_zero_attention_bias_changes_nothing() {
    let model = Weights::random(tiny_config(), 9).model(Numerics::Fast);
    let plain = logits_all(&model, TOKENS, &Interventions::new());
    let mut edits = Interventions::new();
    for l in 0..2 {
        for h in 0..6 {
            edits.set_bias(l, h, vec![0.0; TOKENS.len()]);
        }
    }
    let biased: Vec<Vec<f32>> = logits_all(&model, TOKENS, &edits).to_vec2().unwrap();
    assert!(max_diff(&plain, &biased) < 1e-6);
}

#[test]
fn observation_returns_what_was_asked_and_nothing_else() {
    let model = Weights::random(tiny_config(), 10).model(Numerics::Fast);
    let cfg = model.config().clone();
    let mut cache = HeadCache::plain(&cfg, 16);
    let mut quiet = Recorder::new(Wants::default());
    model
        .forward(
            &TOKENS[..4],
            &mut cache,
            Logits::Last,
            &mut quiet,
            &Interventions::new(),
        )
        .unwrap();
    assert_eq!(quiet.steps.len(), 1);
    let s = &quiet.steps[0];
    assert!(s.attention.is_empty() && s.head_outputs.is_empty() && s.residual.is_empty());
    assert!(s.final_hidden.is_none());

    let mut rec = Recorder::new(Wants::all());
    model
        .forward(
            &[TOKENS[4]],
            &mut cache,
            Logits::Last,
            &mut rec,
            &Interventions::new(),
        )
        .unwrap();
    let step = &rec.steps[0];
    assert_eq!(step.start, 4);
    assert_eq!(step.attention.len(), cfg.n_layers);
    assert_eq!(step.attention[0].dims(), &[cfg.n_heads, 1, 5]);
    assert_eq!(step.head_outputs[1].dims(), &[1, cfg.n_heads, cfg.d_head]);
    assert_eq!(step.residual[1].dims(), &[1, cfg.d_model]);
    assert_eq!(
        step.final_hidden.as_ref().unwrap().dims(),
        &[1, cfg.d_model]
    );
    // Attention rows are distributions.
    let rows: Vec<Vec<Vec<f32>>> = step.attention[1].to_vec3().unwrap();
    for head in rows {
        let sum: f32 = head[0].iter().sum();
        assert!((sum - 1.0).abs() < 1e-5);
    }
}

#[test]
fn bad_heads_and_tokens_are_errors_not_panics() {
    let model = Weights::random(tiny_config(), 11).model(Numerics::Fast);
    let mut edits = Interventions::new();
    edits.set_output(2, 0, OutputEdit::Zero);
    let mut cache = HeadCache::plain(model.config(), 4);
    let err = model
        .forward(&[1, 2], &mut cache, Logits::Last, &mut NoObserver, &edits)
        .unwrap_err();
    assert!(err.to_string().contains("head (2, 0)"), "{err}");
    let err = model
        .forward(
            &[1000],
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("vocabulary"), "{err}");
    let long = vec![1u32; 129];
    let err = model
        .forward(
            &long,
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("context"), "{err}");
}

#[test]
fn head_output_projection_is_the_heads_slice_of_w_o() {
    let w = Weights::random(tiny_config(), 12);
    let model = w.model(Numerics::Fast);
    let (d, dh, nh) = (w.cfg.d_model, w.cfg.d_head, w.cfg.n_heads);
    let (layer, head) = (1, 5);
    let got: Vec<Vec<f32>> = model
        .head_output_projection(layer, head)
        .unwrap()
        .to_vec2()
        .unwrap();
    assert_eq!((got.len(), got[0].len()), (d, dh));
    for (row, values) in got.iter().enumerate() {
        for (c, v) in values.iter().enumerate() {
            assert_eq!(*v, w.layers[layer].wo[row * nh * dh + head * dh + c]);
        }
    }
    assert!(model.head_output_projection(2, 0).is_err());
    assert_eq!(model.embeddings().unwrap().dims(), &[97, 48]);
}

#[test]
fn truncating_the_cache_and_continuing_equals_a_fresh_run() {
    let model = Weights::random(tiny_config(), 13).model(Numerics::Fast);
    let cfg = model.config().clone();
    let mut cache = HeadCache::plain(&cfg, 4);
    let bytes = |positions: usize| 2 * cfg.n_layers * cfg.n_kv_heads * positions * cfg.d_head * 4;
    let run = |tokens: &[u32], cache: &mut HeadCache| {
        model
            .forward(
                tokens,
                cache,
                Logits::Last,
                &mut NoObserver,
                &Interventions::new(),
            )
            .unwrap()
    };
    run(&TOKENS[..3], &mut cache);
    assert_eq!(cache.bytes().total(), bytes(4)); // the room asked for
    run(&TOKENS[3..], &mut cache); // grows past it
    let grown = cache.bytes().total();
    assert!(grown >= bytes(TOKENS.len()), "{grown}");
    cache.truncate(5).unwrap();
    assert_eq!(cache.bytes().total(), grown, "the room stays");
    assert_eq!(cache.len(), 5);
    let again = model
        .forward(
            &[77, 78],
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap();
    let mut fresh_tokens = TOKENS[..5].to_vec();
    fresh_tokens.extend([77, 78]);
    let fresh = logits_all(&model, &fresh_tokens, &Interventions::new());
    let want: Vec<Vec<f32>> = vec![fresh.get(6).unwrap().to_vec1().unwrap()];
    assert!(max_diff(&again, &want) < 1e-5);
}

#[test]
fn a_session_steps_token_by_token_to_the_brute_force_logits() {
    use headwise::model::Session;
    let w = Weights::random(tiny_config(), 9);
    let want = brute_force_logits(&w, TOKENS, &no_edits());
    for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
        let model = w.model(numerics);
        let mut session = Session::new(&model, TOKENS.len());
        let (prompt, rest) = TOKENS.split_at(4);
        let mut rows = vec![session
            .prefill(prompt, &mut NoObserver, &Interventions::new())
            .unwrap()];
        assert_eq!(session.position(), 4);
        for &t in rest {
            rows.push(
                session
                    .step(t, &mut NoObserver, &Interventions::new())
                    .unwrap(),
            );
        }
        assert_eq!(session.position(), TOKENS.len());
        let got = candle_core::Tensor::cat(&rows, 0).unwrap();
        let d = max_diff(&got, &want[3..]);
        assert!(d < 1e-4, "{numerics:?}: max |diff| {d}");
    }
}

/// A session's token choice against the distribution its step's logits define, computed
/// here from the logits' values: greedy takes the argmax; at a temperature the draws'
/// frequencies follow `softmax(logits / T)`; under top-p every draw lies in the nucleus
/// (the fewest most probable tokens holding at least `p` of the mass); invalid settings
/// are errors.
#[test]
fn session_samples_from_the_distribution_its_logits_define() {
    use headwise::model::{Sampling, Session};
    let w = Weights::random(tiny_config(), 3);
    let model = w.model(Numerics::Fast);
    let mut session = Session::new(&model, TOKENS.len());
    let logits = session
        .prefill(TOKENS, &mut NoObserver, &Interventions::new())
        .unwrap();
    let values: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
    let best = (0..values.len())
        .max_by(|&a, &b| values[a].total_cmp(&values[b]))
        .unwrap();
    assert_eq!(session.sample(&logits).unwrap(), best as u32);

    let temperature = 0.25;
    let max = values
        .iter()
        .copied()
        .fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
    let weights: Vec<f64> = values
        .iter()
        .map(|&v| ((v as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let probs: Vec<f64> = weights.iter().map(|w| w / total).collect();
    let sampling = |top_p| Sampling {
        temperature: Some(temperature),
        top_p,
        seed: 11,
    };
    let draws = 20_000;
    let mut counts = vec![0usize; probs.len()];
    let mut s = Session::new(&model, 1)
        .with_sampling(sampling(None))
        .unwrap();
    for _ in 0..draws {
        counts[s.sample(&logits).unwrap() as usize] += 1;
    }
    for (token, (&c, &p)) in counts.iter().zip(&probs).enumerate() {
        let freq = c as f64 / draws as f64;
        let bound = 5.0 * (p * (1.0 - p) / draws as f64).sqrt() + 1e-3;
        assert!(
            (freq - p).abs() < bound,
            "token {token}: {freq} drawn, p = {p}"
        );
    }

    let top_p = 0.5;
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let mut mass = 0.0;
    let nucleus: Vec<usize> = order
        .iter()
        .copied()
        .take_while(|&i| {
            let inside = mass < top_p;
            mass += probs[i];
            inside
        })
        .collect();
    assert!(
        nucleus.len() < probs.len(),
        "the test's nucleus must exclude tokens"
    );
    let mut s = Session::new(&model, 1)
        .with_sampling(sampling(Some(top_p)))
        .unwrap();
    for _ in 0..2_000 {
        let token = s.sample(&logits).unwrap() as usize;
        assert!(
            nucleus.contains(&token),
            "{token} outside the nucleus {nucleus:?}"
        );
    }

    for bad in [
        sampling(Some(0.0)),
        sampling(Some(1.5)),
        Sampling {
            temperature: Some(f64::NAN),
            ..Sampling::default()
        },
    ] {
        assert!(
            Session::new(&model, 1).with_sampling(bad).is_err(),
            "{bad:?}"
        );
    }
}
