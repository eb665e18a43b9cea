//! The arithmetic fingerprint that guards resumed runs: it is the same on every thread
//! count (the work whose split changes the floats is split the same way on any pool),
//! it tells models with different weights or numerics apart, and on the real model it
//! is the same on 1, 2, 8 and 16 threads.

mod common;

use candle_core::quantized::GgmlDType;
use common::{tiny_config, Weights};
use headwise::model::{arithmetic_fingerprint, LoadedModel, Model, Numerics};

/// `f` on a pool of `threads` threads.
fn on_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// A tiny model whose matrices are whole 8-bit blocks (so the fast numerics take their
/// block kernels) with one KV head and room for the fingerprint's 296-position prompt,
/// long enough that a decode step splits each head's keys into several parts.
fn blocky(seed: u64, numerics: Numerics) -> Model {
    let mut cfg = tiny_config();
    cfg.n_heads = 4;
    cfg.n_kv_heads = 1;
    cfg.d_model = 64;
    cfg.d_head = 16;
    cfg.d_ff = 128;
    cfg.context_length = 512;
    Weights::random(cfg, seed).model_as(numerics, GgmlDType::Q8_0)
}

#[test]
fn the_fingerprint_is_the_same_on_every_thread_count() {
    for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
        let model = blocky(3, numerics);
        let one = on_threads(1, || arithmetic_fingerprint(&model).unwrap());
        assert_eq!(one.len(), 16, "{one}");
        assert!(one.chars().all(|c| c.is_ascii_hexdigit()), "{one}");
        for threads in [2, 3, 4] {
            let many = on_threads(threads, || arithmetic_fingerprint(&model).unwrap());
            assert_eq!(many, one, "{numerics:?} on {threads} threads");
        }
    }
}

#[test]
fn other_weights_or_numerics_give_another_fingerprint() {
    let fast = arithmetic_fingerprint(&blocky(3, Numerics::Fast)).unwrap();
    assert_eq!(
        arithmetic_fingerprint(&blocky(3, Numerics::Fast)).unwrap(),
        fast
    );
    assert_ne!(
        arithmetic_fingerprint(&blocky(4, Numerics::Fast)).unwrap(),
        fast
    );
    assert_ne!(
        arithmetic_fingerprint(&blocky(3, Numerics::Ggml)).unwrap(),
        fast
    );
}

#[test]
fn the_real_model_has_one_fingerprint_on_every_thread_count() {
    let lm = LoadedModel::load(&common::real_model(), Numerics::Fast).unwrap();
    let one = on_threads(1, || arithmetic_fingerprint(&lm.model).unwrap());
    for threads in [2, 8, 16] {
        let many = on_threads(threads, || arithmetic_fingerprint(&lm.model).unwrap());
        assert_eq!(many, one, "{threads} threads");
    }
}
