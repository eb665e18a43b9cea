//! Batch invariance of the batched decode step (`model::step_batch`): eight sequences
//! with different prompts, prompt lengths, caches (per-head retentions, quantized rows,
//! top-k restrictions), edits and observers join a running batch at different steps
//! and leave it at different steps; every step's logits and observed hidden states
//! must be bit-identical to the same sequence run alone through `Session::step`, in
//! every numerics, on tiny llama and Gemma 3 models whose matrices are stored in
//! quantized blocks (so the integer kernels run, as on a real model file). And
//! `generate_batch` gives every job the tokens and logits `generate` gives it alone.
//! Prompt positions run as rows of a batch (several per sequence and step, beside
//! other sequences' steps) give the bits of one-token steps alone.

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::Tensor;
use common::{tiny_config, tiny_gemma_config, Weights};
use headwise::model::{
    argmax, generate, generate_batch, step_batch, BatchStep, Config, GenerateOptions, HeadCache,
    Interventions, Model, NoObserver, Numerics, Observer, OutputEdit, Recorder, Retention,
    RowFormat, Session, TopK, Wants,
};

/// A llama whose every matrix width is whole 32-value blocks.
fn llama() -> Config {
    Config {
        d_model: 64,
        d_head: 16,
        n_heads: 4,
        n_kv_heads: 2,
        d_ff: 96,
        ..tiny_config()
    }
}

/// The tiny Gemma 3 (sliding window of 5 on local layers) with whole-block widths.
fn gemma() -> Config {
    Config {
        d_ff: 64,
        ..tiny_gemma_config()
    }
}

/// One sequence of the test: what it runs and when it is in the batch.
struct Seq {
    prompt: Vec<u32>,
    /// The batch step at which it joins (after its own prefill).
    join: usize,
    /// Decode steps it runs before it leaves.
    steps: usize,
    /// Index into [`caches`]'s kinds.
    kind: usize,
    edits: Interventions,
    /// Record the final hidden state and residual stream of every step.
    observe: bool,
}

fn seqs(cfg: &Config) -> Vec<Seq> {
    let v = cfg.vocab_size as u32;
    let prompt = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32).map(|i| (i * 7 + seed * 13 + 1) % v).collect()
    };
    let mut ablated = Interventions::new();
    ablated.set_output(0, 1, OutputEdit::Zero);
    (0..8)
        .map(|i| Seq {
            prompt: prompt([3, 11, 2, 17, 6, 9, 1, 14][i], i as u32),
            join: [0, 0, 0, 1, 1, 2, 2, 2][i],
            steps: [9, 5, 7, 4, 10, 3, 6, 5][i],
            kind: i % 6,
            edits: if i == 4 {
                ablated.clone()
            } else {
                Interventions::new()
            },
            observe: i % 3 == 1,
        })
        .collect()
}

/// A per-head cache of kind `kind`: every store full; rings; rings and full stores
/// mixed with tiered ones; q8_0 rows; f16 rows; top-k on some query heads.
fn head_cache(cfg: &Config, kind: usize, capacity: usize) -> HeadCache {
    let n = cfg.n_layers * cfg.n_kv_heads;
    let retention: Vec<Retention> = (0..n)
        .map(|i| match (kind, i % 3) {
            (1, _) => Retention::Stream { sink: 1, window: 4 },
            (2, 0) => Retention::Full,
            (2, 1) => Retention::Tiered {
                sink: 1,
                window: 3,
                cold: RowFormat::Q8_0,
            },
            (2, _) => Retention::Stream { sink: 0, window: 5 },
            _ => Retention::Full,
        })
        .collect();
    let rows = match kind {
        3 => RowFormat::Q8_0,
        4 => RowFormat::F16,
        _ => RowFormat::F32,
    };
    let mut cache = HeadCache::new(cfg, &retention, rows, capacity).unwrap();
    if kind == 2 {
        let active: Vec<bool> = (0..n).map(|i| i % 2 == 0).collect();
        cache.set_active(&active).unwrap();
    }
    if kind == 5 {
        let topk = TopK {
            k: 2,
            sink: 1,
            window: 2,
        };
        cache.set_topk(cfg.n_layers - 1, 0, Some(topk)).unwrap();
        cache.set_topk(0, cfg.n_heads - 1, Some(topk)).unwrap();
    }
    cache
}

/// What one sequence's decode steps gave: logits, and the observed final hidden state
/// and last residual of every step.
#[derive(Debug, Clone, PartialEq)]
struct Trace {
    logits: Vec<Vec<f32>>,
    observed: Vec<Vec<f32>>,
}

fn row(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn recorder() -> Recorder {
    Recorder::new(Wants {
        final_hidden: true,
        residual: true,
        ..Wants::default()
    })
}

/// What `recorder` captured at its last step.
fn captured(recorder: &Recorder) -> Vec<f32> {
    let step = recorder.steps.last().unwrap();
    let mut out = row(step.final_hidden.as_ref().unwrap());
    out.extend(row(step.residual.last().unwrap()));
    out
}

/// Prefill all of `seq`'s prompt but its last token.
fn prefilled<'m>(model: &'m Model, seq: &Seq, cache: HeadCache) -> Session<'m> {
    let mut session = Session::with_cache(model, cache);
    let head = &seq.prompt[..seq.prompt.len() - 1];
    if !head.is_empty() {
        session.prefill(head, &mut NoObserver, &seq.edits).unwrap();
    }
    session
}

/// Each sequence alone: prefill, then greedy single-sequence steps.
fn alone(model: &Model, seqs: &[Seq], cache: &dyn Fn(&Seq) -> HeadCache) -> Vec<Trace> {
    seqs.iter()
        .map(|seq| steps_alone(prefilled(model, seq, cache(seq)), seq))
        .collect()
}

/// `seq`'s greedy single-sequence steps from `session`, which holds its prompt but the
/// last token.
fn steps_alone(mut session: Session, seq: &Seq) -> Trace {
    let mut token = *seq.prompt.last().unwrap();
    let mut trace = Trace {
        logits: Vec::new(),
        observed: Vec::new(),
    };
    for _ in 0..seq.steps {
        let mut rec = recorder();
        let logits = if seq.observe {
            session.step(token, &mut rec, &seq.edits).unwrap()
        } else {
            session.step(token, &mut NoObserver, &seq.edits).unwrap()
        };
        if seq.observe {
            trace.observed.push(captured(&rec));
        }
        trace.logits.push(row(&logits));
        token = argmax(&logits).unwrap();
    }
    trace
}

/// All sequences through one batch: each joins at its step and leaves when done. With
/// `prompts_in = Some(piece)` each joins with an empty cache and its prompt (but the
/// last token) runs as rows of the batch, at most `piece` positions per step, beside
/// the other sequences' prompt rows and decode steps; otherwise it joins prefilled.
fn batched(
    model: &Model,
    seqs: &[Seq],
    cache: &dyn Fn(&Seq) -> HeadCache,
    prompts_in: Option<usize>,
) -> Vec<Trace> {
    let mut traces: Vec<Trace> = seqs
        .iter()
        .map(|_| Trace {
            logits: Vec::new(),
            observed: Vec::new(),
        })
        .collect();
    let head = |seq: &Seq| seq.prompt.len() - 1;
    // (sequence, session, prompt positions run, next token)
    let mut running: Vec<(usize, Session, usize, u32)> = Vec::new();
    let (mut sizes, mut mixed) = (Vec::new(), false);
    for t in 0.. {
        for (i, seq) in seqs.iter().enumerate().filter(|(_, s)| s.join == t) {
            let (session, done) = match prompts_in {
                Some(_) => (Session::with_cache(model, cache(seq)), 0),
                None => (prefilled(model, seq, cache(seq)), head(seq)),
            };
            running.push((i, session, done, *seq.prompt.last().unwrap()));
        }
        running.retain(|(i, ..)| traces[*i].logits.len() < seqs[*i].steps);
        if running.is_empty() && seqs.iter().all(|s| s.join <= t) {
            break;
        }
        sizes.push(running.len());
        let mut recorders: Vec<Recorder> = running.iter().map(|_| recorder()).collect();
        let mut nothing: Vec<NoObserver> = running.iter().map(|_| NoObserver).collect();
        let mut batch: Vec<BatchStep> = running
            .iter_mut()
            .zip(recorders.iter_mut().zip(nothing.iter_mut()))
            .map(|((i, session, done, token), (rec, none))| {
                let seq = &seqs[*i];
                let (prompt, end) = (&seq.prompt, head(seq));
                match *done < end {
                    true => BatchStep {
                        session,
                        tokens: &prompt[*done..(*done + prompts_in.unwrap_or(1)).min(end)],
                        logits: false,
                        observer: none,
                        edits: &seq.edits,
                    },
                    false => BatchStep {
                        session,
                        tokens: std::slice::from_ref(token),
                        logits: true,
                        observer: if seq.observe { rec } else { none },
                        edits: &seq.edits,
                    },
                }
            })
            .collect();
        let rows: Vec<usize> = batch.iter().map(|b| b.tokens.len()).collect();
        mixed |= batch.iter().any(|b| !b.logits) && batch.iter().any(|b| b.logits);
        let logits = step_batch(&mut batch).unwrap();
        drop(batch);
        for ((((i, _, done, token), l), rec), n) in
            running.iter_mut().zip(&logits).zip(&recorders).zip(rows)
        {
            let Some(l) = l else {
                *done += n;
                continue;
            };
            traces[*i].logits.push(row(l));
            if seqs[*i].observe {
                traces[*i].observed.push(captured(rec));
            }
            *token = argmax(l).unwrap();
        }
    }
    // All eight ran in one step (a batch as large as the row count from which a single
    // sequence's prefill takes another product), and the batch size changed; prompt
    // rows ran beside decode steps.
    assert_eq!(sizes.iter().max(), Some(&8), "batch sizes {sizes:?}");
    assert!(
        sizes.windows(2).any(|w| w[0] != w[1]),
        "batch sizes {sizes:?}"
    );
    assert_eq!(
        mixed,
        prompts_in.is_some(),
        "prompt rows beside decode steps"
    );
    traces
}

fn check(name: &str, alone: Vec<Trace>, batched: Vec<Trace>, seqs: &[Seq]) {
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert_eq!(a.logits.len(), seqs[i].steps, "{name}: sequence {i} steps");
        assert!(
            a == b,
            "{name}: sequence {i} differs in a batch (first step that differs: {:?})",
            a.logits.iter().zip(&b.logits).position(|(x, y)| x != y)
        );
    }
}

#[test]
fn a_sequence_decodes_the_same_bits_alone_and_in_any_batch() {
    for (arch, cfg) in [("llama", llama()), ("gemma", gemma())] {
        let w = Weights::random(cfg.clone(), 41);
        for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
            for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
                let model = w.model_as(numerics, dtype);
                let seqs = seqs(&cfg);
                let capacity = |s: &Seq| s.prompt.len() + s.steps;
                let name = format!("{arch} {numerics:?} {dtype:?} per-head");
                let heads = |s: &Seq| head_cache(&cfg, s.kind, capacity(s));
                check(
                    &name,
                    alone(&model, &seqs, &heads),
                    batched(&model, &seqs, &heads, None),
                    &seqs,
                );
                let name = format!("{arch} {numerics:?} {dtype:?} plain");
                let plain = |s: &Seq| HeadCache::plain(&cfg, capacity(s));
                check(
                    &name,
                    alone(&model, &seqs, &plain),
                    batched(&model, &seqs, &plain, None),
                    &seqs,
                );
            }
        }
    }
}

/// Each sequence alone from an empty cache: every prompt token but the last run by
/// `Session::step` (a pass of one token), then greedy steps.
fn stepped_alone(model: &Model, seqs: &[Seq], cache: &dyn Fn(&Seq) -> HeadCache) -> Vec<Trace> {
    seqs.iter()
        .map(|seq| {
            let mut session = Session::with_cache(model, cache(seq));
            for &t in &seq.prompt[..seq.prompt.len() - 1] {
                session.step(t, &mut NoObserver, &seq.edits).unwrap();
            }
            steps_alone(session, seq)
        })
        .collect()
}

#[test]
fn prompt_positions_run_as_rows_of_a_batch_give_the_bits_of_single_steps() {
    for (arch, cfg) in [("llama", llama()), ("gemma", gemma())] {
        let w = Weights::random(cfg.clone(), 47);
        for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
            for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
                let mut model = w.model_as(numerics, dtype);
                let seqs = seqs(&cfg);
                let heads = |s: &Seq| head_cache(&cfg, s.kind, s.prompt.len() + s.steps);
                let want = stepped_alone(&model, &seqs, &heads);
                for piece in [1, 3, 16] {
                    let name = format!("{arch} {numerics:?} {dtype:?} pieces of {piece}");
                    check(
                        &name,
                        want.clone(),
                        batched(&model, &seqs, &heads, Some(piece)),
                        &seqs,
                    );
                }
                // A prefill in chunks of one position runs its prompt as one such row.
                model.set_chunk(1);
                let name = format!("{arch} {numerics:?} {dtype:?} chunks of 1");
                check(&name, want, alone(&model, &seqs, &heads), &seqs);
            }
        }
    }
}

#[test]
fn a_batch_refuses_sessions_of_different_models() {
    let cfg = llama();
    let a = Weights::random(cfg.clone(), 1).model_as(Numerics::Fast, GgmlDType::Q8_0);
    let b = Weights::random(cfg.clone(), 2).model_as(Numerics::Fast, GgmlDType::Q8_0);
    let (mut sa, mut sb) = (Session::new(&a, 8), Session::new(&b, 8));
    let edits = Interventions::new();
    let (mut oa, mut ob) = (NoObserver, NoObserver);
    let mut batch = vec![
        BatchStep {
            session: &mut sa,
            tokens: &[1],
            logits: true,
            observer: &mut oa,
            edits: &edits,
        },
        BatchStep {
            session: &mut sb,
            tokens: &[2],
            logits: true,
            observer: &mut ob,
            edits: &edits,
        },
    ];
    let err = step_batch(&mut batch).unwrap_err().to_string();
    assert!(err.contains("different models"), "{err}");
    assert!(step_batch(&mut []).unwrap().is_empty());
}

#[test]
fn a_bad_row_fails_the_batch_before_any_cache_changes() {
    let cfg = llama();
    let model = Weights::random(cfg.clone(), 3).model_as(Numerics::Fast, GgmlDType::Q8_0);
    let (mut sa, mut sb) = (Session::new(&model, 8), Session::new(&model, 8));
    let edits = Interventions::new();
    let (mut oa, mut ob) = (NoObserver, NoObserver);
    let bad = [cfg.vocab_size as u32];
    let mut batch = vec![
        BatchStep {
            session: &mut sa,
            tokens: &[1],
            logits: true,
            observer: &mut oa,
            edits: &edits,
        },
        BatchStep {
            session: &mut sb,
            tokens: &bad,
            logits: true,
            observer: &mut ob,
            edits: &edits,
        },
    ];
    let err = step_batch(&mut batch).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    drop(batch);
    assert_eq!((sa.position(), sb.position()), (0, 0));
}

#[test]
fn a_row_of_several_tokens_runs_as_steps_and_needs_a_plain_observer() {
    let cfg = llama();
    let model = Weights::random(cfg.clone(), 5).model_as(Numerics::Fast, GgmlDType::Q8_0);
    let edits = Interventions::new();
    fn row(
        session: &mut Session,
        observer: &mut dyn Observer,
        edits: &Interventions,
    ) -> headwise::Result<Vec<f32>> {
        let mut batch = vec![BatchStep {
            session,
            tokens: &[1, 2],
            logits: true,
            observer,
            edits,
        }];
        let logits = step_batch(&mut batch)?.pop().flatten().unwrap();
        Ok(logits.flatten_all()?.to_vec1()?)
    }
    // On the plain cache, as on a policy's, the row is two steps.
    let mut plain = Session::new(&model, 8);
    let got = row(&mut plain, &mut NoObserver, &edits).unwrap();
    let mut steps = Session::new(&model, 8);
    steps.step(1, &mut NoObserver, &edits).unwrap();
    let want = steps.step(2, &mut NoObserver, &edits).unwrap();
    assert_eq!(got, want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    assert_eq!(plain.position(), 2);
    let mut heads = Session::with_cache(&model, head_cache(&cfg, 0, 8));
    let err = row(&mut heads, &mut recorder(), &edits)
        .unwrap_err()
        .to_string();
    assert!(err.contains("final hidden state"), "{err}");
    assert_eq!(heads.position(), 0);
}

#[test]
fn generate_batch_gives_each_job_what_generate_gives_it_alone() {
    for (arch, cfg) in [("llama", llama()), ("gemma", gemma())] {
        let w = Weights::random(cfg.clone(), 43);
        for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
            let model = w.model_as(numerics, GgmlDType::Q4_1);
            let seqs = seqs(&cfg);
            let opts = GenerateOptions {
                max_new: 9,
                ..GenerateOptions::default()
            };
            // Sequence i stops itself after `seq.steps` tokens (9 is the limit), so
            // sequences leave the batch at different steps.
            let alone: Vec<(Vec<u32>, Vec<Vec<f32>>)> = seqs
                .iter()
                .map(|s| {
                    let mut logits = Vec::new();
                    let g = generate(
                        &model,
                        &s.prompt,
                        &opts,
                        &mut NoObserver,
                        &s.edits,
                        &mut |_, l| {
                            logits.push(row(l));
                            logits.len() < s.steps
                        },
                    )
                    .unwrap();
                    (g.tokens, logits)
                })
                .collect();
            let jobs: Vec<(&[u32], &Interventions)> = seqs
                .iter()
                .map(|s| (s.prompt.as_slice(), &s.edits))
                .collect();
            let mut logits = vec![Vec::new(); seqs.len()];
            let batched = generate_batch(&model, &jobs, &opts, &mut |i, _, l| {
                logits[i].push(row(l));
                logits[i].len() < seqs[i].steps
            })
            .unwrap();
            for (i, (a, g)) in alone.iter().zip(&batched).enumerate() {
                let name = format!("{arch} {numerics:?} sequence {i}");
                assert_eq!(a.0.len(), seqs[i].steps.min(9), "{name}: tokens");
                assert_eq!(a.0, g.tokens, "{name}: tokens");
                assert!(a.1 == logits[i], "{name}: logits differ");
                assert_eq!(g.prompt_tokens, seqs[i].prompt.len(), "{name}");
            }
        }
    }
}
