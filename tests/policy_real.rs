//! The policy presets on the real models: every preset parses, resolves against the
//! model it names files for, and runs; on a long prompt the compressed policies
//! keep fewer resident bytes than `full`, and `full` reproduces the plain generation.

mod common;

use std::path::Path;

use headwise::model::{
    generate as plain_generate, GenerateOptions, Interventions, Observer, Wants,
};
use headwise::policy::{GenerateRequest, Policy, Prompt, Runtime};

/// Wants the final hidden state and keeps nothing: with it, the plain generation runs the
/// prompt's last token as its own decode step, the schedule every policy runs. (In the
/// fast numerics a prefill row is an f32 product and a decode row an 8-bit one, so the
/// two schedules differ in the last bits of that token's logits, and greedy tokens can
/// part a few steps later: measured on an AVX-512 Xeon, tokens 7 and 8 of 8.)
struct SplitLastToken;

impl Observer for SplitLastToken {
    fn wants(&self) -> Wants {
        Wants {
            final_hidden: true,
            ..Wants::default()
        }
    }
}

fn presets() -> Vec<std::path::PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
    let mut v: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_preset_parses_and_validates() {
    let names: Vec<String> = presets()
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "full",
        "streaming",
        "static-locos",
        "static-wu",
        "dynamic-probe",
    ] {
        assert!(names.iter().any(|n| n == want), "missing preset {want}");
    }
    for p in presets() {
        Policy::load(&p, &[]).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
}

fn long_prompt() -> String {
    let words = [
        "river", "valley", "farmer", "market", "winter", "stone", "bridge", "village", "morning",
        "garden",
    ];
    (0..1500)
        .map(|i| words[(i * 7 + i / 3) % words.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn presets_run_on_smollm2_and_save_memory() {
    let model = common::real_model();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let request = GenerateRequest::new(Prompt::Text(long_prompt()), 8);
    let mut hot = std::collections::BTreeMap::new();
    for p in presets() {
        let runtime = Runtime::builder()
            .model(&model)
            .policy(Policy::load(&p, &[]).unwrap())
            .base_dir(root)
            .build()
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let out = runtime.generate(&request, &mut |_| true).unwrap();
        assert_eq!(out.stats.generated_tokens, out.tokens.len());
        assert!(
            out.stats.prompt_tokens > 1000,
            "{}",
            out.stats.prompt_tokens
        );
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "full" {
            // the full policy reproduces the plain generation on the same schedule
            let lm = runtime.model();
            let ids = runtime.encode(&request.prompt).unwrap();
            let opts = GenerateOptions {
                max_new: 8,
                stop: lm.special.stop.clone(),
                ..GenerateOptions::default()
            };
            let g = plain_generate(
                &lm.model,
                &ids,
                &opts,
                &mut SplitLastToken,
                &Interventions::new(),
                &mut |_, _| true,
            )
            .unwrap();
            assert_eq!(g.tokens, out.tokens);
        }
        hot.insert(name, out.stats.kv.end.hot);
    }
    let full = hot["full"];
    for (name, bytes) in &hot {
        if name != "full" {
            assert!(*bytes < full / 2, "{name}: {bytes} of {full}");
        }
    }
}

#[test]
fn presets_resolve_on_gemma_where_it_has_the_files() {
    let model = common::real_gemma();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for p in presets() {
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        let built = Runtime::builder()
            .model(&model)
            .policy(Policy::load(&p, &[]).unwrap())
            .base_dir(root)
            .build();
        match name.as_str() {
            // no NIAH probe was trained for Gemma: a clear error at build time
            "dynamic-probe" => {
                let err = built.unwrap_err().to_string();
                assert!(err.contains("gemma-3-270m-q4_k_m/niah.json"), "{err}");
            }
            _ => {
                let rt = built.unwrap_or_else(|e| panic!("{name}: {e}"));
                // only the 3 global layers' KV heads can be chosen
                assert_eq!(rt.plan().candidate_kv_heads(), 3);
            }
        }
    }
}
