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
    /// An invariant headwise itself established did not hold: a bug, never bad input.
    #[error("internal error: {0} (a bug in headwise; please report it)")]
    Internal(&'static str),
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

/// A figment error as one line that points at the user's input: each failure as its
/// key, what is wrong, and where the value came from (the file, the environment
/// variable, or the command line), never a location in headwise's own source.
pub(crate) fn figment_message(e: &figment::Error) -> String {
    let parts: Vec<String> = e
        .clone()
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let origin = e.metadata.as_ref().map(|md| match &md.source {
                Some(figment::Source::File(path)) => path.display().to_string(),
                Some(figment::Source::Custom(what)) => what.clone(),
                Some(figment::Source::Code(_)) => "the command line".to_string(),
                None if md.name.contains("environment") => {
                    let profile = e.profile.clone().unwrap_or_default();
                    let name = md.interpolate(&profile, &e.path);
                    // figment names an `Env::prefixed` provider "`PREFIX` environment
                    // variable(s)" but interpolates the key without the prefix.
                    let prefix = md.name.split('`').nth(1).unwrap_or("");
                    match name.starts_with(prefix) {
                        true => format!("environment variable {name}"),
                        false => format!("environment variable {prefix}{name}"),
                    }
                }
                _ => md.name.to_string(),
            });
            let mut line = match key.is_empty() {
                true => e.kind.to_string(),
                false => format!("`{key}`: {}", e.kind),
            };
            if let Some(origin) = origin {
                line.push_str(&format!(" (in {origin})"));
            }
            line
        })
        .collect();
    parts.join("; ").replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use figment::providers::{Env, Format, Toml};
    use figment::Figment;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Settings {
        port: u16,
    }

    #[test]
    fn figment_errors_name_the_key_and_where_the_value_came_from() {
        let dir = std::env::temp_dir().join(format!("headwise-figment-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("s.toml");
        std::fs::write(&file, "port = \"high\"\n").unwrap();
        let e = Figment::from(Toml::file(&file))
            .extract::<Settings>()
            .unwrap_err();
        let msg = figment_message(&e);
        assert!(msg.starts_with("`port`: invalid type"), "{msg}");
        assert!(msg.contains(&format!("(in {})", file.display())), "{msg}");
        assert!(!msg.contains("src/"), "{msg}");
        // A variable no other test reads.
        std::env::set_var("HEADWISE_FIGMENT_TEST_PORT", "high");
        let e = Figment::from(Env::prefixed("HEADWISE_FIGMENT_TEST_"))
            .extract::<Settings>()
            .unwrap_err();
        std::env::remove_var("HEADWISE_FIGMENT_TEST_PORT");
        let msg = figment_message(&e);
        assert!(
            msg.contains("environment variable HEADWISE_FIGMENT_TEST_PORT"),
            "{msg}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
