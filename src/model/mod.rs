//! The model, from the bottom: [`file`](mod@file) (GGUF reading, fetching), [`text`] (tokenizer,
//! chat template) and [`numerics`] (how weights multiply), none of which imports anything
//! above it; then the configuration, the caches, attention, the instrumented transformer
//! with its observation and intervention interfaces, the [`Session`] that runs it, and
//! decoding.

mod attention;
pub mod cache;
pub mod config;
pub mod file;
pub mod fingerprint;
pub mod generate;
pub mod intervene;
pub mod loaded;
pub mod numerics;
pub mod observe;
pub mod rope;
pub mod session;
pub mod text;
pub mod transformer;

pub use cache::{HeadCache, KvBytes, Retention, RowFormat, TopK};
pub use config::{Architecture, Config, LayerSpec, RopeStyle, SlidingWindow};
pub use file::gguf::{GgufFile, ModelId};
pub use fingerprint::arithmetic_fingerprint;
pub use generate::{
    entropy, generate, generate_batch, GenerateOptions, Generation, Sampler, Sampling, StopReason,
};
pub use intervene::{HeadEdit, Interventions, KeyRestriction, OutputEdit, QueryEdit};
pub use loaded::{LoadedModel, TextStream};
pub use numerics::{Linear, Numerics};
pub use observe::{last_row, Capture, NoObserver, Observer, Recorder, Tee, Wants};
pub use rope::Rope;
pub use session::{step_batch, BatchStep, Session};
pub use transformer::{argmax, DecodeParts, DecodeRow, Logits, Model, DEFAULT_CHUNK};
