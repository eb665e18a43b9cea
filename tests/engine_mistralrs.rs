//! The mistral.rs reference engine on the real model (SmolLM2-135M-Instruct, Q4_1 GGUF).
//!
//! The model is `HEADWISE_MODEL`, or fetched into the models folder like every other
//! real-model test (`common::real_model`). All tests share one
//! loaded engine (loading takes seconds); the engine serializes requests itself.
#![cfg(feature = "mistralrs")]

mod common;

use std::sync::OnceLock;
use std::time::Instant;

use headwise::reference::mistralrs::MistralRsEngine;

/// SmolLM2's vocabulary size (GGUF `tokenizer.ggml.tokens`, and the output layer rows).
const VOCAB: usize = 49152;

fn engine() -> &'static MistralRsEngine {
    static ENGINE: OnceLock<MistralRsEngine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let path = common::real_model();
        let start = Instant::now();
        let engine = MistralRsEngine::load(&path)
            .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
        eprintln!("[timing] load: {:.2?} ({engine:?})", start.elapsed());
        engine
    })
}

/// Id of a single-token string, looked up through the engine's own tokenizer.
fn single_token(text: &str) -> u32 {
    let ids = engine().tokenize(text, false).expect("tokenize");
    assert_eq!(ids.len(), 1, "{text:?} should be one token, got {ids:?}");
    ids[0]
}

#[test]
fn tokenize_returns_ids_in_vocab() {
    let text = "The capital of France is";
    let ids = engine().tokenize(text, false).expect("tokenize");
    assert!(!ids.is_empty());
    assert!(ids.iter().all(|&id| (id as usize) < VOCAB), "{ids:?}");
    // SmolLM2's GGUF tokenizer adds no BOS: special tokens change nothing here.
    let with_special = engine().tokenize(text, true).expect("tokenize");
    assert_eq!(ids, with_special);
    // Special-token text maps to one special id; EOS of the instruct model is <|im_end|>.
    let im_end = single_token("<|im_end|>");
    assert!(
        engine().eos_token_ids().contains(&im_end),
        "eos ids {:?} should contain <|im_end|> = {im_end}",
        engine().eos_token_ids()
    );
    eprintln!(
        "ids of {text:?}: {ids:?}; eos ids {:?}",
        engine().eos_token_ids()
    );
}

#[test]
fn tokenize_splits_digits_one_by_one() {
    // SmolLM2's vocabulary has no multi-digit tokens.
    let ids = engine().tokenize("12345", false).expect("tokenize");
    assert_eq!(ids.len(), 5, "{ids:?}");
}

#[test]
fn logits_have_one_row_per_token() {
    let ids = engine()
        .tokenize("The quick brown fox jumps over the lazy dog.", false)
        .expect("tokenize");
    let start = Instant::now();
    let logits = engine().logits(&ids).expect("logits");
    eprintln!(
        "[timing] logits for {} tokens: {:.2?}",
        ids.len(),
        start.elapsed()
    );
    assert_eq!(logits.dims(), &[ids.len(), VOCAB]);
    assert_eq!(logits.dtype(), candle_core::DType::F32);
    assert!(logits.device().is_cpu());
    let values: Vec<Vec<f32>> = logits.to_vec2().expect("to_vec2");
    assert!(values.iter().flatten().all(|v| v.is_finite()));

    // Teacher forcing is causal: the logits of a prefix are the prefix of the logits.
    let prefix = engine().logits(&ids[..4]).expect("logits of prefix");
    let prefix: Vec<Vec<f32>> = prefix.to_vec2().expect("to_vec2");
    for (row, (a, b)) in prefix.iter().zip(&values).enumerate() {
        let max_diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(max_diff < 1e-3, "row {row}: max |diff| = {max_diff}");
    }
}

#[test]
fn logits_of_a_long_prompt() {
    // ~1500 tokens of varied text (digits are one token each in SmolLM2).
    let text: String = (0..100)
        .map(|i| format!("Item {i} of the list is the number {}. ", i * 37 % 1000))
        .collect();
    let ids = engine().tokenize(&text, false).expect("tokenize");
    assert!(ids.len() > 1024, "only {} tokens", ids.len());
    let start = Instant::now();
    let logits = engine().logits(&ids).expect("logits");
    eprintln!(
        "[timing] logits for {} tokens: {:.2?}",
        ids.len(),
        start.elapsed()
    );
    assert_eq!(logits.dims(), &[ids.len(), VOCAB]);
}

#[test]
fn logits_reject_empty_and_out_of_vocab_input() {
    assert!(engine().logits(&[]).is_err());
    assert!(engine().logits(&[1, VOCAB as u32 + 10]).is_err());
}

#[test]
fn greedy_continuation_names_paris() {
    // SmolLM2 adds no BOS (add_special_tokens is a no-op for its GGUF tokenizer).
    let ids = engine()
        .tokenize("The capital of France is", true)
        .expect("tokenize");
    let start = Instant::now();
    let new = engine().generate_greedy(&ids, 8, true).expect("generate");
    eprintln!(
        "[timing] greedy 8 tokens after {}: {:.2?}",
        ids.len(),
        start.elapsed()
    );
    assert!(!new.is_empty() && new.len() <= 8, "{new:?}");
    let paris = single_token(" Paris");
    assert!(
        new.iter().take(3).any(|&t| t == paris),
        "expected ' Paris' ({paris}) among the first tokens of {new:?}"
    );

    // The greedy tokens are the argmax of the teacher-forced logits of the same engine.
    let mut all = ids.clone();
    all.extend_from_slice(&new);
    let logits: Vec<Vec<f32>> = engine()
        .logits(&all[..all.len() - 1])
        .expect("logits")
        .to_vec2()
        .expect("to_vec2");
    for (step, &token) in new.iter().enumerate() {
        let row = &logits[ids.len() - 1 + step];
        let best = row[token as usize];
        assert!(
            row.iter().all(|&v| v <= best + 1e-4),
            "step {step}: token {token} is not the argmax of the teacher-forced logits"
        );
    }

    // Deterministic.
    let again = engine().generate_greedy(&ids, 8, true).expect("generate");
    assert_eq!(new, again);
}

#[test]
fn a_dropped_stream_is_cancelled_and_the_engine_goes_on() {
    let ids = engine()
        .tokenize("The capital of France is", true)
        .expect("tokenize");
    let whole = engine().generate_greedy(&ids, 12, true).expect("generate");
    // Streamed to the end: the same tokens.
    let mut seen = Vec::new();
    let streamed = engine()
        .stream_greedy(&ids, 12, &mut |t| {
            seen.push(t);
            Ok(true)
        })
        .expect("stream");
    assert_eq!((&streamed, &seen), (&whole, &whole));
    // Dropped after three tokens: three delivered, and the next request is served in
    // full (the cancelled sequence does not hold the engine).
    let mut count = 0;
    let cut = engine()
        .stream_greedy(&ids, 12, &mut |_| {
            count += 1;
            Ok(count < 3)
        })
        .expect("stream");
    assert_eq!(cut, whole[..3]);
    let after = engine().generate_greedy(&ids, 12, true).expect("generate");
    assert_eq!(after, whole);
    // An error from the callback ends the stream and comes back.
    let err = engine()
        .stream_greedy(&ids, 12, &mut |_| {
            Err(headwise::Error::invalid("callback", "stop"))
        })
        .unwrap_err();
    assert!(err.to_string().contains("stop"), "{err}");
}

#[test]
fn greedy_runs_past_eos_when_asked() {
    // Greedy SmolLM2 answers "The answer is 4" and then emits <|im_end|> (7th token).
    let prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";
    let ids = engine().tokenize(prompt, false).expect("tokenize");
    let eos = engine().eos_token_ids().to_vec();

    let stopping = engine().generate_greedy(&ids, 12, true).expect("generate");
    let running = engine().generate_greedy(&ids, 12, false).expect("generate");
    eprintln!("stop_on_eos: {stopping:?}; no stop: {running:?}; eos {eos:?}");
    // Stopped on EOS, which is the last token returned.
    assert!(stopping.len() < 12, "{stopping:?}");
    assert!(
        stopping.last().is_some_and(|t| eos.contains(t)),
        "{stopping:?}"
    );
    // Without stopping, the same tokens and then more after EOS, up to the limit.
    assert_eq!(running.len(), 12, "{running:?}");
    assert_eq!(&running[..stopping.len()], &stopping[..]);
    assert_eq!(
        engine().generate_greedy(&ids, 0, false).expect("generate"),
        Vec::<u32>::new()
    );
}

#[test]
fn chat_stream_renders_the_gguf_chat_template() {
    let question = "What is the capital of France?";
    let messages = vec![("user".to_string(), question.to_string())];
    let mut pieces = Vec::new();
    let start = Instant::now();
    let stats = engine()
        .chat_stream(&messages, 24, None, None, &mut |t| {
            pieces.push(t.to_string())
        })
        .expect("chat");
    eprintln!(
        "[timing] chat 24 tokens: {:.2?}; {stats:?}; text {:?}",
        start.elapsed(),
        pieces.concat()
    );
    assert!(pieces.len() > 1, "{pieces:?}");
    assert!(
        stats.generated_tokens >= 1 && stats.generated_tokens <= 24,
        "{stats:?}"
    );
    assert!(
        stats.decode_tok_s > 0.0 || stats.generated_tokens <= 1,
        "{stats:?}"
    );
    assert!(!pieces.concat().contains("<|im"), "{:?}", pieces.concat());

    // SmolLM2's template (from the GGUF) adds its default system prompt when there is
    // none; the same text completed raw gives the same prompt and the same answer.
    let rendered = format!(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    );
    let rendered_ids = engine().tokenize(&rendered, true).expect("tokenize");
    assert_eq!(stats.prompt_tokens, rendered_ids.len());
    let mut raw = String::new();
    let raw_stats = engine()
        .complete_stream(&rendered, 24, None, None, &mut |t| raw.push_str(t))
        .expect("complete");
    assert_eq!(raw_stats.prompt_tokens, rendered_ids.len());
    assert_eq!(raw_stats.generated_tokens, stats.generated_tokens);
    assert_eq!(pieces.concat(), raw);
}

#[test]
fn complete_stream_matches_greedy_tokens() {
    let prompt = "The capital of France is";
    let mut text = String::new();
    let stats = engine()
        .complete_stream(prompt, 6, None, None, &mut |t| text.push_str(t))
        .expect("complete");
    eprintln!("complete: {text:?}; {stats:?}");
    let ids = engine().tokenize(prompt, true).expect("tokenize");
    assert_eq!(stats.prompt_tokens, ids.len());
    let greedy = engine().generate_greedy(&ids, 6, true).expect("generate");
    assert_eq!(stats.generated_tokens, greedy.len());
    assert!(text.contains("Paris"), "{text:?}");
    assert!(stats.prefill_tok_s > 0.0, "{stats:?}");
}

#[test]
fn sampling_parameters_are_validated() {
    let mut sink = |_: &str| {};
    assert!(engine()
        .complete_stream("Hi", 4, Some(-1.0), None, &mut sink)
        .is_err());
    assert!(engine()
        .complete_stream("Hi", 4, Some(0.8), Some(0.0), &mut sink)
        .is_err());
    assert!(engine()
        .complete_stream("Hi", 0, None, None, &mut sink)
        .is_err());
    assert!(engine().chat_stream(&[], 4, None, None, &mut sink).is_err());
    // Sampling with a temperature runs.
    let stats = engine()
        .complete_stream("Once upon a time", 4, Some(0.8), Some(0.95), &mut sink)
        .expect("sampled completion");
    assert!(stats.generated_tokens >= 1);
}

#[test]
fn generate_timed_runs_the_full_length() {
    let prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";
    let ids = engine().tokenize(prompt, false).expect("tokenize");
    let (tokens, stats) = engine().generate_timed(&ids, 12).expect("generate");
    eprintln!("timed: {stats:?}");
    assert_eq!(
        tokens,
        engine().generate_greedy(&ids, 12, false).expect("generate")
    );
    assert_eq!(stats.prompt_tokens, ids.len());
    assert_eq!(stats.generated_tokens, 12);
    assert!(
        stats.prefill_tok_s > 0.0 && stats.decode_tok_s > 0.0,
        "{stats:?}"
    );
}

#[test]
fn generation_past_the_context_is_refused() {
    let ids = engine().tokenize("Hello", false).expect("tokenize");
    let err = engine()
        .generate_greedy(&ids, engine().max_seq_len(), false)
        .expect_err("must not fit");
    assert!(
        matches!(err, headwise::Error::ContextOverflow { .. }),
        "{err}"
    );
}
