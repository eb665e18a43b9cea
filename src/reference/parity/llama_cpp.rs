//! Parity between the instrumented model and llama.cpp, the reference for Gemma 3
//! (mistral.rs cannot load Gemma 3 from GGUF): perplexity on a fixed text in chunks of
//! 512 tokens against `llama-perplexity`, and 32 greedy tokens on the fixed
//! [`super::prompts`] against `llama-server`. Both engines run on the token ids
//! of llama.cpp's own tokenizer, so the comparison is about the model; whether headwise's
//! tokenizer gives the same ids is reported beside it.
//!
//! llama.cpp runs with its parity settings ([`Attention::F32`]: plain f32 attention, cache
//! cells that are positions, kernels the instrumented model's `ggml` numerics reproduce
//! bit for bit). To show how sensitive greedy continuations are to arithmetic alone,
//! llama.cpp with its defaults (f16 cache, flash attention, repacked weights) is compared
//! too: with the parity run and with the instrumented model.

use std::path::Path;

use crate::model::numerics::ggml::Simd;
use crate::model::{LoadedModel, Numerics};
use crate::reference::llama_cpp::{Attention, LlamaCppBins, LlamaServer};
use crate::reference::parity::{divergence, greedy_trace, prompts, Divergence, GREEDY_TOKENS};
use crate::reference::perplexity::perplexity;
use crate::reference::GreedyTrace;
use crate::{Error, Result};

/// Tokens per perplexity chunk.
pub const PPL_CTX: usize = 512;
/// Chunks scored (2,048 tokens).
pub const PPL_CHUNKS: usize = 4;
/// Largest accepted relative difference of the two perplexities.
pub const MAX_PPL_REL_DIFF: f64 = 0.01;
/// Required prompts (of 8) with identical greedy continuations.
pub const MIN_IDENTICAL: usize = 7;
/// Characters of essay text taken for the perplexity text (about 2,600 tokens).
const PPL_CHARS: usize = 12_000;

/// Greedy parity of one prompt.
#[derive(Debug, Clone)]
pub struct GreedyParity {
    /// Short label.
    pub name: String,
    /// Prompt tokens.
    pub tokens: usize,
    /// Whether headwise's tokenizer gives llama.cpp's ids for the prompt.
    pub same_ids: bool,
    /// The instrumented model's continuation.
    pub ours: GreedyTrace,
    /// llama.cpp's continuation ([`Attention::F32`]).
    pub reference: GreedyTrace,
    /// First difference of ours and `reference`, if any.
    pub divergence: Option<Divergence>,
    /// llama.cpp's continuation with its default attention.
    pub reference_default: GreedyTrace,
    /// First difference of ours and `reference_default`.
    pub divergence_default: Option<Divergence>,
    /// First difference of `reference` and `reference_default`: llama.cpp against itself.
    pub divergence_self: Option<Divergence>,
}

/// Everything [`run`] measured.
#[derive(Debug, Clone)]
pub struct LlamaCppReport {
    /// Perplexity of the instrumented model.
    pub ppl_ours: f64,
    /// `llama-perplexity`'s final estimate on the same text.
    pub ppl_reference: f64,
    /// Whether headwise's tokenizer gives the same ids on the perplexity text.
    pub ppl_same_ids: bool,
    /// One entry per prompt.
    pub prompts: Vec<GreedyParity>,
    /// The x86 path the instrumented model's `ggml` arithmetic followed.
    pub simd: Simd,
}

impl LlamaCppReport {
    /// `|ppl_ours / ppl_reference - 1|`.
    pub fn ppl_rel_diff(&self) -> f64 {
        (self.ppl_ours / self.ppl_reference - 1.0).abs()
    }

    /// Prompts whose continuations are identical.
    pub fn identical(&self) -> usize {
        self.prompts
            .iter()
            .filter(|p| p.divergence.is_none())
            .count()
    }

    /// Prompts where ours equals llama.cpp with its default attention.
    pub fn identical_default(&self) -> usize {
        self.prompts
            .iter()
            .filter(|p| p.divergence_default.is_none())
            .count()
    }

    /// Prompts where llama.cpp's two attention settings give the same continuation.
    pub fn identical_self(&self) -> usize {
        self.prompts
            .iter()
            .filter(|p| p.divergence_self.is_none())
            .count()
    }

    /// The bar: perplexity within 1% and identical continuations on 7 of 8 prompts
    /// (scaled to the prompt count).
    pub fn passes(&self) -> bool {
        let need = (MIN_IDENTICAL * self.prompts.len()).div_ceil(8);
        self.ppl_rel_diff() <= MAX_PPL_REL_DIFF && self.identical() >= need
    }
}

/// The fixed perplexity text: the Paul Graham essays of `data_dir/haystack/paul_graham`
/// in file-name order, joined by blank lines, cut to the first `PPL_CHARS` characters.
pub fn perplexity_text(data_dir: &Path) -> Result<String> {
    let dir = data_dir.join("haystack/paul_graham");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|e| Error::io(&dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    files.sort();
    let mut text = String::new();
    for f in files {
        if text.chars().count() >= PPL_CHARS {
            break;
        }
        text.push_str(&std::fs::read_to_string(&f).map_err(|e| Error::io(&f, e))?);
        text.push_str("\n\n");
    }
    let text: String = text.chars().take(PPL_CHARS).collect();
    if text.chars().count() < PPL_CHARS {
        return Err(Error::invalid(
            "data dir",
            format!(
                "{} holds fewer than {PPL_CHARS} characters of essays",
                dir.display()
            ),
        ));
    }
    Ok(text)
}

/// Run the comparison; `on_prompt` sees each prompt's result as it is measured. In `ggml`
/// numerics the model is set to follow the x86 path of llama.cpp's build
/// ([`crate::model::Model::set_ggml_simd`]) first.
pub fn run(
    ours: &mut LoadedModel,
    bins: &LlamaCppBins,
    model_path: &Path,
    data_dir: &Path,
    on_prompt: &mut dyn FnMut(&GreedyParity),
) -> Result<LlamaCppReport> {
    if ours.model.numerics() == Numerics::Ggml {
        let simd = bins.simd().ok_or_else(|| {
            Error::LlamaCpp(format!(
                "the llama.cpp build in {} takes neither ggml's AVX2 + FMA nor its AVX-512 \
                 kernels (its system_info), so `ggml` numerics cannot follow it",
                bins.dir().display()
            ))
        })?;
        ours.model.set_ggml_simd(simd);
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let text = perplexity_text(data_dir)?;
    let text_file = std::env::temp_dir().join(format!("headwise-ppl-{}.txt", std::process::id()));
    std::fs::write(&text_file, &text).map_err(|e| Error::io(&text_file, e))?;
    let ppl_reference = bins.perplexity(model_path, &text_file, PPL_CTX, PPL_CHUNKS, threads);
    let _ = std::fs::remove_file(&text_file);
    let ppl_reference = ppl_reference?.0;

    let server = LlamaServer::start(bins, model_path, 4096, threads, Attention::F32)?;
    let server_default = LlamaServer::start(bins, model_path, 4096, threads, Attention::Default)?;
    let ids = server.tokenize(&text, true)?;
    let ppl_same_ids = ours.encode(&text, true).is_ok_and(|o| o == ids);
    let bos = ids[0];
    let ppl_ours = perplexity(&ours.model, &ids, PPL_CTX, PPL_CHUNKS, bos)?;

    let mut prompts_out = Vec::new();
    for (name, text) in prompts() {
        let ids = server.tokenize(&text, true)?;
        let same_ids = ours.encode(&text, true).is_ok_and(|o| o == ids);
        let reference = server.greedy(&ids, GREEDY_TOKENS)?;
        let reference_default = server_default.greedy(&ids, GREEDY_TOKENS)?;
        let mine = greedy_trace(&ours.model, &ids, GREEDY_TOKENS)?;
        let p = GreedyParity {
            name: name.to_string(),
            tokens: ids.len(),
            same_ids,
            divergence: divergence(&mine, &reference),
            divergence_default: divergence(&mine, &reference_default),
            divergence_self: divergence(&reference, &reference_default),
            ours: mine,
            reference,
            reference_default,
        };
        on_prompt(&p);
        prompts_out.push(p);
    }
    Ok(LlamaCppReport {
        ppl_ours,
        ppl_reference,
        ppl_same_ids,
        prompts: prompts_out,
        simd: ours.model.ggml_simd(),
    })
}
