//! The model: GGUF loading, configuration, tokenizer and chat template, and the
//! instrumented transformer with its KV cache, observation and intervention interfaces.

mod attention;
pub mod cache;
pub mod chat;
pub mod config;
pub mod embedding;
mod fast_exp;
pub mod fetch;
pub mod generate;
pub mod ggml;
pub mod ggml_quant;
pub mod gguf;
pub mod intervene;
pub mod kernels;
pub mod linear;
pub mod loaded;
pub mod observe;
pub mod rope;
pub mod session;
pub mod tokenizer;
pub mod transformer;

pub use cache::{HeadCache, KvBytes, KvCache, Retention, RowFormat, TopK};
pub use config::{Architecture, Config, LayerSpec, RopeStyle, SlidingWindow};
pub use generate::{entropy, generate, GenerateOptions, Generation, Sampler, Sampling, StopReason};
pub use gguf::{GgufFile, ModelId};
pub use intervene::{HeadEdit, Interventions, KeyRestriction, OutputEdit, QueryEdit};
pub use linear::{Linear, Numerics};
pub use loaded::{LoadedModel, TextStream};
pub use observe::{last_row, Capture, NoObserver, Observer, Recorder, Tee, Wants};
pub use rope::Rope;
pub use session::{step_batch, BatchStep, Cache, Session};
pub use transformer::{argmax, CacheMut, DecodeParts, DecodeRow, Logits, Model, DEFAULT_CHUNK};
