//! Compression policies: which KV heads keep their whole history (static rankings or a
//! per-step probe), which attend only to their top-k keys, which are ablated; resolved
//! against a model ([`Plan`]) and run over the per-head cache
//! ([`crate::model::HeadCache`]) so that the memory saved is real.
//!
//! - [`ranking`]: static rankings of the heads (the files under `policies/rankings/`);
//! - [`ablation`]: head sets, ablation modes and the mean-ablation calibration;
//! - [`config`]: the policies as TOML (`policies/*.toml` are the presets);
//! - [`plan`]: a policy resolved against one model;
//! - [`generate()`]: generation under a plan, with its KV statistics;
//! - [`runtime`]: the library API, [`Runtime`].

pub mod ablation;
pub mod config;
pub mod generate;
pub mod plan;
pub mod ranking;
pub mod runtime;

pub use config::{Gqa, HeadChoice, PolicyConfig, Prefill, Selection};
pub use generate::{generate, KvStats, PolicyGeneration, Prefilled};
pub use plan::{Dynamic, DynamicSource, Plan};
pub use runtime::{
    GenerateOutput, GenerateRequest, GenerationStats, Prompt, Runtime, RuntimeBuilder, Step,
};
