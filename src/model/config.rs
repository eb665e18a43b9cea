//! Model hyper-parameters read from GGUF metadata.
//!
//! One [`Config`] describes every supported architecture; what differs between them is
//! spelled out per layer ([`Config::layer`]) so that a new architecture (Gemma 3's
//! sliding-window and global layers, Qwen's QK-norm) is an addition to
//! [`Architecture`] and [`Config::from_gguf`], not a rewrite of the forward pass.

use candle_core::quantized::gguf_file::{Content, Value};

use crate::{Error, Result};

/// The model families headwise can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// Llama-style decoder (SmolLM2, Llama 2/3): pre-RMSNorm, SwiGLU, interleaved RoPE.
    Llama,
    /// Gemma 3: embeddings scaled by `sqrt(d_model)`, RMSNorm before and after attention
    /// and the FFN, per-head RMSNorm of queries and keys, GELU-tanh gated FFN, RoPE on
    /// halves of each head, and sliding-window layers with every sixth layer global.
    Gemma3,
}

impl Architecture {
    /// Every architecture name accepted in `general.architecture`.
    pub const SUPPORTED: &'static [&'static str] = &["llama", "gemma3"];

    /// Parse the GGUF `general.architecture` string.
    pub fn from_gguf_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Architecture::Llama),
            "gemma3" => Ok(Architecture::Gemma3),
            other => Err(Error::UnsupportedArchitecture {
                arch: other.to_string(),
                supported: Self::SUPPORTED.join(", "),
            }),
        }
    }

    /// The GGUF metadata prefix of this architecture (`llama.block_count`, ...).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Gemma3 => "gemma3",
        }
    }
}

/// How a layer rotates query and key dimensions by position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    /// Pairs `(2i, 2i + 1)` (llama.cpp's "normal" mode, used for `llama` GGUF files).
    Interleaved,
    /// Pairs `(i, i + d_head / 2)` (llama.cpp's "neox" mode, used for Gemma).
    Halves,
}

/// Sliding-window attention as Gemma 3 lays it out: every `global_every`-th layer
/// (`layer % global_every == global_every - 1`) attends to the whole context with the
/// model's RoPE base; the others see only the `size` most recent positions (the query's
/// own included) and use `local_rope_base`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SlidingWindow {
    /// Positions a local layer sees, the query's own included.
    pub size: usize,
    /// Period of the global layers.
    pub global_every: usize,
    /// RoPE base of the local layers.
    pub local_rope_base: f32,
}

/// Gemma 3's period of global layers and local RoPE base, as llama.cpp runs it (the GGUF
/// stores only the window size).
const GEMMA3_GLOBAL_EVERY: usize = 6;
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

/// What one layer's attention looks like.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSpec {
    /// RoPE frequency base used by this layer.
    pub rope_base: f32,
    /// How RoPE pairs dimensions.
    pub rope_style: RopeStyle,
    /// `Some(w)`: the layer sees only the `w` most recent positions (the query's own
    /// included), and the KV cache keeps only those.
    pub window: Option<usize>,
}

/// Hyper-parameters of a decoder-only transformer.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Config {
    pub architecture: Architecture,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Query heads per layer.
    pub n_heads: usize,
    /// Key/value heads per layer (GQA: `n_heads` is a multiple of it).
    pub n_kv_heads: usize,
    /// Residual stream width.
    pub d_model: usize,
    /// Width of one head's query, key and value.
    pub d_head: usize,
    /// Hidden width of the feed-forward block.
    pub d_ff: usize,
    /// Vocabulary size (rows of the embedding table).
    pub vocab_size: usize,
    /// Context window the model was trained for, in tokens.
    pub context_length: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE frequency base (of the global layers when there is a sliding window).
    pub rope_base: f32,
    /// Sliding-window layers, if the architecture has them.
    pub sliding_window: Option<SlidingWindow>,
}

impl Config {
    /// Bytes of f32 keys and values a decode step reads at `context` positions: every
    /// layer's rows in view (a sliding-window layer's window at most).
    pub fn kv_view_bytes(&self, context: usize) -> usize {
        (0..self.n_layers)
            .map(|l| {
                let seen = self.layer(l).window.map_or(context, |w| w.min(context));
                2 * seen * self.n_kv_heads * self.d_head * std::mem::size_of::<f32>()
            })
            .sum()
    }

    /// Query heads that share one KV head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// The KV head that query head `head` reads (GQA).
    pub fn kv_head(&self, head: usize) -> usize {
        head / self.group_size()
    }

    /// Attention details of layer `layer`.
    pub fn layer(&self, layer: usize) -> LayerSpec {
        let rope_style = match self.architecture {
            Architecture::Llama => RopeStyle::Interleaved,
            Architecture::Gemma3 => RopeStyle::Halves,
        };
        match self.sliding_window {
            Some(sw) if layer % sw.global_every != sw.global_every - 1 => LayerSpec {
                rope_base: sw.local_rope_base,
                rope_style,
                window: Some(sw.size),
            },
            _ => LayerSpec {
                rope_base: self.rope_base,
                rope_style,
                window: None,
            },
        }
    }

    /// Read the configuration from GGUF metadata.
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let md = &content.metadata;
        let arch_name = get_str(md, "general.architecture")?;
        let architecture = Architecture::from_gguf_name(arch_name)?;
        let p = architecture.gguf_name();
        let key = |k: &str| format!("{p}.{k}");
        let n_heads = get_usize(md, &key("attention.head_count"))?;
        let d_model = get_usize(md, &key("embedding_length"))?;
        let n_kv_heads = match md.get(&key("attention.head_count_kv")) {
            Some(_) => get_usize(md, &key("attention.head_count_kv"))?,
            None => n_heads,
        };
        let d_head = match md.get(&key("attention.key_length")) {
            Some(_) => get_usize(md, &key("attention.key_length"))?,
            None => d_model / n_heads.max(1),
        };
        let vocab_size = match md.get(&key("vocab_size")) {
            Some(_) => get_usize(md, &key("vocab_size"))?,
            None => match md.get("tokenizer.ggml.tokens") {
                Some(Value::Array(tokens)) => tokens.len(),
                _ => {
                    return Err(Error::Metadata {
                        key: key("vocab_size"),
                        reason: "missing, and no tokenizer.ggml.tokens to count".into(),
                    })
                }
            },
        };
        let sliding_window = match (architecture, md.get(&key("attention.sliding_window"))) {
            (Architecture::Gemma3, Some(_)) => Some(SlidingWindow {
                size: get_usize(md, &key("attention.sliding_window"))?,
                global_every: GEMMA3_GLOBAL_EVERY,
                local_rope_base: GEMMA3_LOCAL_ROPE_BASE,
            }),
            (Architecture::Gemma3, None) => {
                return Err(Error::Metadata {
                    key: key("attention.sliding_window"),
                    reason: "missing (Gemma 3 needs the local layers' window)".into(),
                })
            }
            (Architecture::Llama, _) => None,
        };
        let cfg = Config {
            architecture,
            n_layers: get_usize(md, &key("block_count"))?,
            n_heads,
            n_kv_heads,
            d_model,
            d_head,
            d_ff: get_usize(md, &key("feed_forward_length"))?,
            vocab_size,
            context_length: get_usize(md, &key("context_length"))?,
            rms_eps: get_f64(md, &key("attention.layer_norm_rms_epsilon"))?,
            rope_base: match md.get(&key("rope.freq_base")) {
                Some(_) => get_f64(md, &key("rope.freq_base"))? as f32,
                None => 10_000.0,
            },
            sliding_window,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check the invariants the forward pass relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| {
            Err(Error::Metadata {
                key: format!("{}.{key}", self.architecture.gguf_name()),
                reason,
            })
        };
        if self.n_layers == 0 || self.n_heads == 0 || self.n_kv_heads == 0 || self.d_head == 0 {
            return bad(
                "block_count/head_count",
                format!(
                    "layers {}, heads {}, kv heads {}, head dim {}: all must be positive",
                    self.n_layers, self.n_heads, self.n_kv_heads, self.d_head
                ),
            );
        }
        // Far above any real model, low enough that products of two sizes (heads x head
        // dim, context x layers) cannot overflow: a corrupt header fails here, not in an
        // allocation.
        for (key, v) in [
            ("block_count", self.n_layers),
            ("attention.head_count", self.n_heads),
            ("attention.head_count_kv", self.n_kv_heads),
            ("attention.key_length", self.d_head),
            ("embedding_length", self.d_model),
            ("feed_forward_length", self.d_ff),
            ("vocab_size", self.vocab_size),
            ("context_length", self.context_length),
        ] {
            if v > MAX_SIZE {
                return bad(key, format!("{v} (at most {MAX_SIZE})"));
            }
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return bad(
                "attention.layer_norm_rms_epsilon",
                format!("{} (must be a positive number)", self.rms_eps),
            );
        }
        if !(self.rope_base.is_finite() && self.rope_base > 0.0) {
            return bad(
                "rope.freq_base",
                format!("{} (must be a positive number)", self.rope_base),
            );
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(
                "attention.head_count_kv",
                format!(
                    "{} query heads are not a multiple of {} KV heads",
                    self.n_heads, self.n_kv_heads
                ),
            );
        }
        if !self.d_head.is_multiple_of(2) {
            return bad(
                "attention.key_length",
                format!("head dim {} must be even for RoPE", self.d_head),
            );
        }
        if let Some(sw) = &self.sliding_window {
            if sw.size == 0 || sw.size > self.context_length || sw.global_every == 0 {
                return bad(
                    "attention.sliding_window",
                    format!(
                        "window {} with a global layer every {}: the window must be 1..={} \
                         (the context) and the period positive",
                        sw.size, sw.global_every, self.context_length
                    ),
                );
            }
        }
        if self.context_length == 0 || self.vocab_size == 0 {
            return bad(
                "context_length",
                "context and vocabulary must be non-empty".into(),
            );
        }
        Ok(())
    }
}

/// Largest size a model's metadata may give for any dimension.
pub const MAX_SIZE: usize = 1 << 24;

fn get<'a>(md: &'a std::collections::HashMap<String, Value>, key: &str) -> Result<&'a Value> {
    md.get(key).ok_or_else(|| Error::Metadata {
        key: key.to_string(),
        reason: "missing".into(),
    })
}

fn type_error(key: &str, want: &str, got: &Value) -> Error {
    Error::Metadata {
        key: key.to_string(),
        reason: format!("expected {want}, found {:?}", got.value_type()),
    }
}

/// A metadata string.
pub(crate) fn get_str<'a>(
    md: &'a std::collections::HashMap<String, Value>,
    key: &str,
) -> Result<&'a str> {
    let v = get(md, key)?;
    v.to_string()
        .map(|s| s.as_str())
        .map_err(|_| type_error(key, "a string", v))
}

/// A non-negative integer of any GGUF integer type.
pub(crate) fn get_usize(md: &std::collections::HashMap<String, Value>, key: &str) -> Result<usize> {
    let v = get(md, key)?;
    let n: Option<i128> = match v {
        Value::U8(x) => Some(*x as i128),
        Value::I8(x) => Some(*x as i128),
        Value::U16(x) => Some(*x as i128),
        Value::I16(x) => Some(*x as i128),
        Value::U32(x) => Some(*x as i128),
        Value::I32(x) => Some(*x as i128),
        Value::U64(x) => Some(*x as i128),
        Value::I64(x) => Some(*x as i128),
        _ => None,
    };
    match n {
        Some(n) if n >= 0 => usize::try_from(n).map_err(|_| type_error(key, "a size", v)),
        Some(_) => Err(Error::Metadata {
            key: key.to_string(),
            reason: "negative".into(),
        }),
        None => Err(type_error(key, "an integer", v)),
    }
}

/// A float (f32 or f64).
pub(crate) fn get_f64(md: &std::collections::HashMap<String, Value>, key: &str) -> Result<f64> {
    let v = get(md, key)?;
    match v {
        Value::F32(x) => Ok(*x as f64),
        Value::F64(x) => Ok(*x),
        _ => Err(type_error(key, "a float", v)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// 2 llama layers, 6 query heads over 2 KV heads of 8 values.
    pub(crate) fn tiny() -> Config {
        Config {
            architecture: Architecture::Llama,
            n_layers: 2,
            n_heads: 6,
            n_kv_heads: 2,
            d_model: 48,
            d_head: 8,
            d_ff: 64,
            vocab_size: 100,
            context_length: 256,
            rms_eps: 1e-5,
            rope_base: 10_000.0,
            sliding_window: None,
        }
    }

    #[test]
    fn gemma3_layers_alternate_five_local_and_one_global() {
        let mut cfg = tiny();
        cfg.architecture = Architecture::Gemma3;
        cfg.n_layers = 18;
        cfg.sliding_window = Some(SlidingWindow {
            size: 512,
            global_every: GEMMA3_GLOBAL_EVERY,
            local_rope_base: GEMMA3_LOCAL_ROPE_BASE,
        });
        let global: Vec<usize> = (0..18).filter(|&l| cfg.layer(l).window.is_none()).collect();
        assert_eq!(global, vec![5, 11, 17]);
        assert_eq!(cfg.layer(5).rope_base, 10_000.0);
        assert_eq!(cfg.layer(4).rope_base, GEMMA3_LOCAL_ROPE_BASE);
        assert_eq!(cfg.layer(4).rope_style, RopeStyle::Halves);
        assert_eq!(tiny().layer(0).rope_style, RopeStyle::Interleaved);
        cfg.sliding_window = Some(SlidingWindow {
            size: 0,
            global_every: 6,
            local_rope_base: 1e4,
        });
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("gemma3.attention.sliding_window"), "{err}");
    }

    #[test]
    fn gqa_maps_consecutive_query_heads_to_one_kv_head() {
        let cfg = tiny();
        let kv: Vec<usize> = (0..6).map(|h| cfg.kv_head(h)).collect();
        assert_eq!(kv, vec![0, 0, 0, 1, 1, 1]);
    }

    #[test]
    fn validate_rejects_heads_not_divisible_by_kv_heads() {
        let mut cfg = tiny();
        cfg.n_kv_heads = 4;
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("not a multiple"), "{err}");
    }

    #[test]
    fn sizes_beyond_the_bound_and_bad_norms_are_refused_by_key() {
        type Edit = fn(&mut Config);
        let cases: [(Edit, &str); 4] = [
            (
                |c| c.n_layers = MAX_SIZE + 1,
                "`llama.block_count`: 16777217",
            ),
            (|c| c.context_length = usize::MAX, "llama.context_length"),
            (|c| c.rms_eps = f64::NAN, "layer_norm_rms_epsilon"),
            (|c| c.rope_base = 0.0, "rope.freq_base"),
        ];
        for (edit, needle) in cases {
            let mut cfg = tiny();
            edit(&mut cfg);
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        assert!(tiny().validate().is_ok());
    }

    #[test]
    fn unknown_architecture_is_named() {
        let err = Architecture::from_gguf_name("mamba")
            .unwrap_err()
            .to_string();
        assert!(err.contains("mamba") && err.contains("llama"), "{err}");
    }

    #[test]
    fn config_round_trips_through_serde() {
        let cfg = tiny();
        let json = serde_json::to_string(&cfg).unwrap();
        let back: Config = serde_json::from_str(&json).unwrap();
        assert_eq!(cfg, back);
    }
}
