//! A model file opened once for everything: weights, tokenizer, special tokens and chat
//! template, with the helpers the CLI and the experiments share.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::model::file::gguf::GgufFile;
use crate::model::text::chat::{ChatMessage, ChatTemplate};
use crate::model::text::tokenizer::{decode_ids, encode_ids, tokenizer_from_gguf, SpecialTokens};
use crate::model::{Config, Model, Numerics};
use crate::{Error, Result};

/// An instrumented model with its tokenizer, loaded from one GGUF file.
pub struct LoadedModel {
    /// The instrumented transformer.
    pub model: Model,
    /// Tokenizer built from the file's metadata.
    pub tokenizer: Tokenizer,
    /// BOS/EOS and every id that ends a turn.
    pub special: SpecialTokens,
    /// The file's chat template, if it has one.
    pub chat_template: Option<ChatTemplate>,
    /// Where it was loaded from.
    pub path: PathBuf,
}

impl LoadedModel {
    /// Open `path` and build everything.
    pub fn load(path: &Path, numerics: Numerics) -> Result<Self> {
        let mut file = GgufFile::open(path)?;
        let cfg = Config::from_gguf(file.content())?;
        let (tokenizer, special) = tokenizer_from_gguf(file.content())?;
        let chat_template = ChatTemplate::from_gguf(file.content())?;
        file.release_tokenizer_metadata();
        let model = Model::from_source(cfg, &mut file, numerics)?;
        Ok(Self {
            model,
            tokenizer,
            special,
            chat_template,
            path: path.to_path_buf(),
        })
    }

    /// Token ids of `text`; `add_special` adds BOS where the model expects it.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        encode_ids(&self.tokenizer, text, add_special)
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        decode_ids(&self.tokenizer, ids)
    }

    /// Prompt ids of a chat rendered with the file's template (generation prompt added).
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| Error::ChatTemplate("the model file has no chat template".into()))?;
        let text = template.render(messages, true)?;
        self.encode(&text, false)
    }
}

/// Turns a growing list of token ids into text pieces as soon as they are complete
/// UTF-8 (a multi-byte character may span several byte-level tokens).
#[derive(Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    printed: usize,
}

impl TextStream {
    /// Add one token; returns the newly completed text, if any.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = tokenizer
            .decode(&self.ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        if text.ends_with('\u{FFFD}') || text.len() <= self.printed {
            return Ok(None);
        }
        let piece = text.get(self.printed..).map(str::to_string);
        self.printed = text.len();
        Ok(piece)
    }
}
