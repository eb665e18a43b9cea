//! The server's settings, read with figment: built-in defaults, then the TOML file
//! (`--config`), then `HEADWISE_SERVE_*` variables, then the command line; the API keys
//! also from `HEADWISE_API_KEY`.
//!
//! ```toml
//! host = "127.0.0.1"
//! port = 8080
//! default_policy = "full"
//! max_concurrency = 2
//! api_keys = ["sk-local-1"]
//!
//! [policies]
//! static-locos = "policies/static-locos.toml"
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::model::config::MAX_SIZE;
use crate::rag::trigger::TriggerConfig;
use crate::wait::{MAX_SECS, MIN_WAIT_SECS};
use crate::{Error, Result};

/// The preset every server has, with no file: the plain full cache.
pub const FULL: &str = "full";

/// The presets offered when the config names none: `policies/<name>.toml` under the
/// base folder, each skipped with a warning when it does not resolve for the model.
pub const DEFAULT_PRESETS: [&str; 4] = ["streaming", "static-locos", "static-wu", "dynamic-probe"];

/// The ranking explain reports on when the config names none (`{model}`: the model's
/// name).
pub const EXPLAIN_RANKING: &str = "policies/rankings/{model}/locos-niah.json";

/// Most sequences a server may batch.
pub const MAX_CONCURRENCY: usize = 1024;
/// Most requests that may wait for a slot.
pub const MAX_QUEUE: usize = 1 << 16;
/// Largest request body limit (1 GiB).
pub const MAX_BODY_BYTES: usize = 1 << 30;

/// Everything `headwise serve` can be told.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    /// Address to bind; loopback unless told otherwise.
    pub host: String,
    /// Port to bind (0: any free port, printed at start).
    pub port: u16,
    /// The GGUF model file (the command line resolves the default model).
    pub model: Option<PathBuf>,
    /// The model's name in the API [default: the file's stem].
    pub served_model_name: Option<String>,
    /// Policy presets requests may choose, name to TOML file; `full` is always there.
    /// `None`: `full` plus whichever of [`DEFAULT_PRESETS`] resolve.
    pub policies: Option<BTreeMap<String, PathBuf>>,
    /// The preset of requests that name none.
    pub default_policy: String,
    /// Folder the preset files (and the rankings and probes they name) are read from.
    pub base_dir: PathBuf,
    /// Bearer tokens accepted; empty: no authentication.
    pub api_keys: Vec<String>,
    /// Sequences in the batch at once (prefilling or decoding).
    pub max_concurrency: usize,
    /// Requests waiting for a place in the batch before new ones get 429.
    pub max_queue: usize,
    /// KV memory the batch may reserve, in MiB: a request is admitted when its policy's
    /// stores at prompt + `max_tokens` positions fit beside the running ones' [default:
    /// no limit].
    pub kv_budget_mib: Option<f64>,
    /// Prompt tokens prefilled between two decode steps of the batch (whole chunks of
    /// `prefill_chunk`), so that a long prompt does not stall the running streams.
    pub prefill_tokens: usize,
    /// Positions per forward pass of a prompt's prefill: the finest step at which the
    /// scheduler can run the batch's decode between two pieces of a long prompt
    /// (smaller: shorter gaps in running streams, slower prefill). At 1, prompt
    /// positions are decode steps and run as rows of the batched step.
    pub prefill_chunk: usize,
    /// MiB of shared prompt prefixes kept so that requests starting with the same long
    /// text (one document, many questions) prefill it once per policy (0: off).
    pub prefix_cache_mib: f64,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Seconds a request may take, queueing included.
    #[serde(deserialize_with = "seconds")]
    pub request_timeout_secs: f64,
    /// Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    #[serde(deserialize_with = "seconds")]
    pub shutdown_grace_secs: f64,
    /// Seconds a client has to send a request's headers once it has begun.
    #[serde(deserialize_with = "seconds")]
    pub header_read_timeout_secs: f64,
    /// Seconds a keep-alive connection may sit idle before it is closed.
    #[serde(deserialize_with = "seconds")]
    pub idle_timeout_secs: f64,
    /// Seconds a client has to send a request's body.
    #[serde(deserialize_with = "seconds")]
    pub body_timeout_secs: f64,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_limit: usize,
    /// `max_tokens` of requests that give none (capped at `max_tokens_limit`).
    pub default_max_tokens: usize,
    /// A BM25 index folder (`headwise retriever index`): enables `"headwise": {"rag": ...}`.
    pub rag_index: Option<PathBuf>,
    /// The stopword list of RIND and QFS, one word per line (relative to `base_dir`)
    /// [default: the built-in English list, [`crate::rag::text::Stopwords::english`]].
    pub rag_stopwords: Option<PathBuf>,
    /// Retrieval triggers requests may choose by name [default: `once`, `every_n` (n = 4),
    /// `rind` (threshold 1.0)].
    pub rag_triggers: Option<BTreeMap<String, TriggerConfig>>,
    /// The head ranking whose top heads `"headwise": {"explain": ...}` reports on
    /// (relative to `base_dir`; `{model}`: the model's name) [default:
    /// `policies/rankings/{model}/locos-niah.json` when it exists, else explain is off].
    pub explain_ranking: Option<PathBuf>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        let http = crate::http::Timeouts::default();
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            model: None,
            served_model_name: None,
            policies: None,
            default_policy: FULL.into(),
            base_dir: PathBuf::from("."),
            api_keys: Vec::new(),
            max_concurrency: 2,
            max_queue: 16,
            kv_budget_mib: None,
            prefill_tokens: 256,
            prefill_chunk: crate::model::DEFAULT_CHUNK,
            prefix_cache_mib: 256.0,
            max_body_bytes: 1 << 20,
            request_timeout_secs: 300.0,
            shutdown_grace_secs: 10.0,
            header_read_timeout_secs: http.header_read.as_secs_f64(),
            idle_timeout_secs: http.idle.as_secs_f64(),
            body_timeout_secs: http.body.as_secs_f64(),
            max_tokens_limit: 2048,
            default_max_tokens: 256,
            rag_index: None,
            rag_stopwords: None,
            rag_triggers: None,
            explain_ranking: None,
        }
    }
}

impl ServeConfig {
    /// The retrieval triggers requests may choose.
    pub fn triggers(&self) -> BTreeMap<String, TriggerConfig> {
        self.rag_triggers.clone().unwrap_or_else(|| {
            BTreeMap::from([
                ("once".to_string(), TriggerConfig::Once),
                ("every_n".to_string(), TriggerConfig::EveryN { n: 4 }),
                ("rind".to_string(), TriggerConfig::Rind { threshold: 1.0 }),
            ])
        })
    }

    /// Defaults, then `file` (if any), then `HEADWISE_SERVE_*` and `HEADWISE_API_KEY`.
    pub fn load(file: Option<&Path>) -> Result<Self> {
        let mut fig = Figment::from(Serialized::defaults(ServeConfig::default()));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(Error::invalid(
                    "config",
                    format!("{}: no such file", path.display()),
                ));
            }
            fig = fig.merge(Toml::file(path));
        }
        fig = fig.merge(Env::prefixed("HEADWISE_SERVE_"));
        let mut cfg: ServeConfig = fig.extract().map_err(|e| {
            let where_ = file
                .map(|p| format!("{}: ", p.display()))
                .unwrap_or_default();
            Error::invalid(
                "config",
                format!("{where_}{}", crate::error::figment_message(&e)),
            )
        })?;
        if let Ok(key) = std::env::var("HEADWISE_API_KEY") {
            if !key.is_empty() {
                cfg.api_keys.push(key);
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// [`ServeConfig::kv_budget_mib`] in bytes.
    pub fn kv_budget_bytes(&self) -> Option<usize> {
        self.kv_budget_mib.map(|m| (m * 1024.0 * 1024.0) as usize)
    }

    /// The HTTP timeouts of [`crate::http::serve`].
    pub fn timeouts(&self) -> crate::http::Timeouts {
        crate::http::Timeouts {
            header_read: Duration::from_secs_f64(self.header_read_timeout_secs),
            idle: Duration::from_secs_f64(self.idle_timeout_secs),
            body: Duration::from_secs_f64(self.body_timeout_secs),
        }
    }

    /// Reject settings the server cannot run with.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("max_concurrency", self.max_concurrency, 1, MAX_CONCURRENCY),
            ("max_queue", self.max_queue, 0, MAX_QUEUE),
            ("prefill_tokens", self.prefill_tokens, 1, MAX_SIZE),
            ("prefill_chunk", self.prefill_chunk, 1, MAX_SIZE),
            ("max_body_bytes", self.max_body_bytes, 1, MAX_BODY_BYTES),
            ("max_tokens_limit", self.max_tokens_limit, 1, MAX_SIZE),
            ("default_max_tokens", self.default_max_tokens, 1, MAX_SIZE),
        ];
        for (name, v, min, max) in sizes {
            if !(min..=max).contains(&v) {
                return Err(Error::invalid(
                    name,
                    format!("{v} (allowed: {min}..={max})"),
                ));
            }
        }
        let cache = self.prefix_cache_mib;
        if !(cache.is_finite() && (0.0..=(1u64 << 30) as f64).contains(&cache)) {
            return Err(Error::invalid(
                "prefix_cache_mib",
                format!("{cache} (must be a number of MiB, 0 for none)"),
            ));
        }
        if let Some(mib) = self.kv_budget_mib {
            if !(mib.is_finite() && mib > 0.0 && mib <= (1u64 << 30) as f64) {
                return Err(Error::invalid(
                    "kv_budget_mib",
                    format!("{mib} (must be a positive number of MiB)"),
                ));
            }
        }
        for (name, v, min) in [
            ("request_timeout_secs", self.request_timeout_secs, 0.0),
            ("shutdown_grace_secs", self.shutdown_grace_secs, 0.0),
            (
                "header_read_timeout_secs",
                self.header_read_timeout_secs,
                MIN_WAIT_SECS,
            ),
            ("idle_timeout_secs", self.idle_timeout_secs, MIN_WAIT_SECS),
            ("body_timeout_secs", self.body_timeout_secs, MIN_WAIT_SECS),
        ] {
            if !(v.is_finite() && (min..=MAX_SECS).contains(&v)) {
                return Err(Error::invalid(
                    name,
                    format!("{} (allowed: {min}..={MAX_SECS} seconds)", short(v)),
                ));
            }
        }
        for t in self.rag_triggers.iter().flat_map(|m| m.values()) {
            t.validate()?;
        }
        if self.api_keys.iter().any(|k| k.is_empty()) {
            return Err(Error::invalid("api_keys", "an empty key"));
        }
        Ok(())
    }
}

/// `v` as written by a person: `1e308`, not its 309 digits.
fn short(v: f64) -> String {
    match v.is_finite() && v != 0.0 && !(1e-3..1e6).contains(&v.abs()) {
        true => format!("{v:e}"),
        false => format!("{v}"),
    }
}

/// A number of seconds, as a number or as a string holding one: environment variables
/// reach figment as strings when it does not read them as numbers itself (`1e300`), and
/// such a value must be refused for its range, not for its type.
fn seconds<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Secs {
        Number(f64),
        Text(String),
    }
    match Secs::deserialize(d)? {
        Secs::Number(v) => Ok(v),
        Secs::Text(t) => t
            .trim()
            .parse::<f64>()
            .map_err(|_| serde::de::Error::custom(format!("`{t}` is not a number of seconds"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_overrides_defaults_and_bad_values_fail() {
        let dir = std::env::temp_dir().join(format!("headwise-serve-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("serve.toml");
        std::fs::write(
            &path,
            "port = 9000\nmax_concurrency = 4\n[policies]\nsl = \"policies/static-locos.toml\"\n",
        )
        .unwrap();
        let cfg = ServeConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.port, 9000);
        assert_eq!(cfg.max_concurrency, 4);
        assert_eq!(cfg.host, "127.0.0.1");
        assert_eq!(cfg.policies.unwrap().len(), 1);

        std::fs::write(&path, "max_concurrency = 0\n").unwrap();
        let err = ServeConfig::load(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("max_concurrency"), "{err}");
        std::fs::write(&path, "colour = 3\n").unwrap();
        let err = ServeConfig::load(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("colour"), "{err}");
        assert!(ServeConfig::load(Some(&dir.join("missing.toml"))).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_kv_budget_must_be_a_positive_number_of_mib() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let cfg = ServeConfig {
                kv_budget_mib: Some(bad),
                ..ServeConfig::default()
            };
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains("kv_budget_mib"), "{err}");
        }
        let cfg = ServeConfig {
            kv_budget_mib: Some(1.5),
            ..ServeConfig::default()
        };
        cfg.validate().unwrap();
        assert_eq!(cfg.kv_budget_bytes(), Some(1_572_864));
    }

    #[test]
    fn the_example_file_states_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("headwise.toml");
        let mut cfg = ServeConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.policies.take().unwrap().len(), 3);
        cfg.api_keys
            .retain(|_| std::env::var("HEADWISE_API_KEY").is_err());
        assert_eq!(cfg, ServeConfig::default());
    }
}
