//! The policy presets on the real models: every preset parses, resolves against the
//! model it names files for, and runs; on a long prompt the compressed policies
//! keep fewer resident bytes than `full`, and `full` reproduces the plain generation; a
//! committed ranking exported to the atlas formats and imported again chooses the same
//! heads.

mod common;

use std::path::Path;

use headwise::model::text::chat::ChatMessage;
use headwise::model::{
    generate as plain_generate, Config, GenerateOptions, GgufFile, Interventions, ModelId,
    Observer, Retention, Wants,
};
use headwise::model::{LoadedModel, Numerics};
use headwise::policy::atlas::{self, AtlasFormat};
use headwise::policy::presses::kvzip::RepeatPrompt;
use headwise::policy::ranking::Ranking;
use headwise::policy::{GenerateRequest, Plan, Policy, Prompt, Runtime};
use headwise::provenance::Made;

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

#[test]
fn a_ranking_exported_and_imported_again_chooses_the_same_heads_on_the_real_model() {
    // SmolLM2's committed LOCOS ranking through both atlas formats: the JSON keeps every
    // query head's score, so static_heads picks the same heads; the pattern keeps each KV
    // head's maximum, so picking KV heads by it (`gqa = "any"` over a top-k that is a
    // multiple of the group) gives the KV heads with the best maxima.
    let path = common::real_model();
    let cfg = Config::from_gguf(GgufFile::open(&path).unwrap().content()).unwrap();
    let id = ModelId::of_file(&path).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let source = root.join("policies/rankings/SmolLM2-135M-Instruct.Q4_1/locos-niah.json");
    let original = Ranking::load(&source).unwrap();
    let dir = std::env::temp_dir().join(format!("headwise-atlas-real-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let resolve = |ranking: &Path, k: usize| {
        let text = format!(
            "type = \"static_heads\"\nheads = {{ ranking = \"{}\", select = {{ top_k = {k} }} }}",
            ranking.display()
        );
        let policy: Policy = toml::from_str(&text).unwrap();
        Plan::resolve(&policy, &cfg, &id, &dir).unwrap().retention
    };
    let json = dir.join("heads.json");
    atlas::export(
        &original,
        AtlasFormat::HeadsJson,
        &json,
        (0, 0),
        Made::now("none"),
    )
    .unwrap();
    let imported =
        atlas::import(AtlasFormat::HeadsJson, &json, &cfg, &id, Made::now("none")).unwrap();
    let scores = |r: &Ranking| r.heads.iter().map(|h| h.score).collect::<Vec<f64>>();
    assert_eq!(scores(&imported), scores(&original));
    imported.write(&dir.join("from-json.json")).unwrap();
    assert_eq!(
        resolve(&dir.join("from-json.json"), 27),
        resolve(&source, 27)
    );

    let pattern = dir.join("pattern");
    atlas::export(
        &original,
        AtlasFormat::Duo,
        &pattern,
        (16, 256),
        Made::now("none"),
    )
    .unwrap();
    let imported = atlas::import(AtlasFormat::Duo, &pattern, &cfg, &id, Made::now("none")).unwrap();
    imported.write(&dir.join("from-duo.json")).unwrap();
    let kept = resolve(&dir.join("from-duo.json"), 9 * cfg.group_size());
    let mut best: Vec<(f64, usize)> = original
        .kv_heads
        .iter()
        .enumerate()
        .map(|(i, k)| (k.max, i))
        .collect();
    best.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut want = vec![false; kept.len()];
    best.iter().take(9).for_each(|&(_, i)| want[i] = true);
    let got: Vec<bool> = kept.iter().map(|r| *r == Retention::Full).collect();
    assert_eq!(got, want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn kvzip_re_reads_a_chat_context_after_its_instruction_on_both_models() {
    const CONTEXT: &str = "The lighthouse keeper on Arran counted forty-one ships in March.";
    for path in [common::real_model(), common::real_gemma()] {
        let lm = LoadedModel::load(&path, Numerics::Fast).unwrap();
        let repeat = RepeatPrompt::of(&lm).unwrap();
        // The pressed part of a query-agnostic prompt: the template's opening (without a
        // template, BOS) and the context, up to the question.
        let opening_and_context = match lm.chat_template {
            Some(_) => lm.chat_prompt(&[ChatMessage::user(CONTEXT)]).unwrap(),
            None => lm.encode(CONTEXT, true).unwrap(),
        };
        let context = lm.encode(CONTEXT, false).unwrap();
        let at = (0..opening_and_context.len())
            .find(|&i| opening_and_context[i..].starts_with(&context))
            .unwrap();
        let pressed = &opening_and_context[..at + context.len()];
        let passes = repeat.passes(pressed, 2048);
        assert_eq!(passes.len(), 1, "{}", path.display());
        let (keys, ids) = &passes[0];
        // The template's opening is found and not re-read; the context is, whole.
        assert_eq!(keys, &(at..pressed.len()), "{}", path.display());
        let text = lm.decode(ids).unwrap();
        assert!(
            text.starts_with("\n\nRepeat the previous context exactly."),
            "{text:?}"
        );
        assert!(text.ends_with(CONTEXT), "{text:?}");
        // After the instruction and the turn change, the model itself starts to repeat
        // the context: the premise the scores rest on.
        let mut prompt = pressed.to_vec();
        prompt.extend(&ids[..ids.len() - context.len()]);
        let opts = GenerateOptions {
            max_new: 4,
            ..GenerateOptions::default()
        };
        let g = plain_generate(
            &lm.model,
            &prompt,
            &opts,
            &mut headwise::model::NoObserver,
            &Interventions::new(),
            &mut |_, _| true,
        )
        .unwrap();
        assert_eq!(
            g.tokens,
            context[..4],
            "{}: {:?}",
            path.display(),
            lm.decode(&g.tokens)
        );
    }
}
