//! The library's error type: one `thiserror` enum with structured variants.
//!
//! Every variant renders as one line that names the problem, so the binary can print it
//! and exit non-zero; nothing in the library panics on bad input.

use std::path::PathBuf;

/// Everything that can go wrong in headwise.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model file is not a readable GGUF file (wrong magic, truncated, bad metadata).
    #[error("{path}: not a valid GGUF file: {reason}")]
    BadGguf { path: PathBuf, reason: String },
    /// The GGUF is valid but describes an architecture headwise cannot run.
    #[error("unsupported architecture `{arch}` (supported: {supported})")]
    UnsupportedArchitecture { arch: String, supported: String },
    /// A metadata key the architecture needs is missing or has the wrong type.
    #[error("GGUF metadata `{key}`: {reason}")]
    Metadata { key: String, reason: String },
    /// A tensor the architecture needs is missing or has the wrong shape.
    #[error("GGUF tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    /// Tokenizer construction, encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template could not be parsed or rendered.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The prompt does not fit the model's context window.
    #[error("prompt of {prompt} tokens plus {max_new} new tokens exceeds the context of {context} tokens")]
    ContextOverflow {
        prompt: usize,
        max_new: usize,
        context: usize,
    },
    /// A request parameter is out of its allowed range.
    #[error("invalid {name}: {reason}")]
    InvalidArgument { name: String, reason: String },
    /// A (layer, head) address does not exist in the model.
    #[error(
        "head ({layer}, {head}) does not exist: the model has {n_layers} layers x {n_heads} heads"
    )]
    BadHead {
        layer: usize,
        head: usize,
        n_layers: usize,
        n_heads: usize,
    },
    /// Fetching a model failed (pip missing, download failed, checksum mismatch).
    #[error("model fetch: {0}")]
    Fetch(String),
    /// The mistral.rs reference engine failed.
    #[error("mistral.rs: {0}")]
    Engine(String),
    /// The llama.cpp reference binaries failed or are missing.
    #[error("llama.cpp: {0}")]
    LlamaCpp(String),
    /// A tensor operation failed inside candle.
    #[error("tensor op: {0}")]
    Candle(#[from] candle_core::Error),
}

/// Result alias for headwise.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// [`Error::BadHead`] unless (layer, head) exists in a model of `n_layers x n_heads`.
    pub fn check_head(layer: usize, head: usize, n_layers: usize, n_heads: usize) -> Result<()> {
        if layer >= n_layers || head >= n_heads {
            return Err(Error::BadHead {
                layer,
                head,
                n_layers,
                n_heads,
            });
        }
        Ok(())
    }

    /// An [`Error::InvalidArgument`].
    pub fn invalid(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name: name.into(),
            reason: reason.into(),
        }
    }
}
