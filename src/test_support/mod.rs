//! Support for the library's unit tests: the real models, fetched with the same
//! [`crate::model::file::fetch::ensure`] the integration tests and `headwise model fetch` use,
//! their tokenizers, and the evaluation data. A missing input is a `SKIPPED:` line, or a
//! failure under `HEADWISE_REQUIRE_ALL=1` (see [`require`]).

pub(crate) mod require;

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::Content;
use tokenizers::Tokenizer;

use crate::model::file::fetch::{self, KnownModel};
use crate::model::text::tokenizer::{tokenizer_from_gguf, SpecialTokens};
use crate::model::Config;

pub(crate) use require::data;

/// A real model's tokenizer, special tokens and context length.
pub(crate) type RealTokenizer = (Tokenizer, SpecialTokens, usize);

/// The GGUF of `model`, fetched into the models folder once per test process, or `None`
/// (after [`require::unavailable`]) when it cannot be had.
fn model_path(model: &KnownModel, cell: &'static OnceLock<Option<PathBuf>>) -> Option<PathBuf> {
    cell.get_or_init(|| match fetch::ensure(&require::models_dir(), model) {
        Ok(f) => Some(f.path().to_path_buf()),
        Err(e) => {
            require::unavailable(&format!("model {} could not be fetched: {e}", model.name));
            None
        }
    })
    .clone()
}

/// Tokenizer, special tokens and context length read from the model's GGUF.
fn load(path: PathBuf) -> RealTokenizer {
    let mut f = std::fs::File::open(&path).expect("open model");
    let content = Content::read(&mut f).expect("read GGUF metadata");
    let (tok, special) = tokenizer_from_gguf(&content).expect("tokenizer");
    let cfg = Config::from_gguf(&content).expect("config");
    (tok, special, cfg.context_length)
}

/// SmolLM2-135M-Instruct's tokenizer.
pub(crate) fn smollm2() -> Option<RealTokenizer> {
    static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    model_path(&fetch::SMOLLM2, &PATH).map(load)
}

/// Gemma 3 270M's tokenizer.
pub(crate) fn gemma3() -> Option<RealTokenizer> {
    static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    model_path(&fetch::GEMMA3_270M, &PATH).map(load)
}
