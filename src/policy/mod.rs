//! Compression policies: which KV heads keep their whole history (static rankings or a
//! per-step probe), which attend only to their top-k keys, which are ablated; resolved
//! against a model ([`Plan`]) and run over the per-head cache
//! ([`crate::model::HeadCache`]) so that the memory saved is real.
//!
//! - [`presses`]: the policies, one file each, and their registry (the TOML `type`s);
//! - [`select`]: how head-level policies score and pick heads (shared by all of them);
//! - [`evict`]: how token-eviction policies score positions and keep the best;
//! - [`config`]: reading a policy (TOML, environment, overrides) and checking it once
//!   into a [`Policy`];
//! - [`plan`]: a policy resolved against one model;
//! - [`ranking`]: static rankings of the heads (the files under `policies/rankings/`);
//! - [`atlas`]: rankings to and from DuoAttention pattern folders and retrieval-head
//!   JSON;
//! - [`ablation`]: head sets, ablation modes and the mean-ablation calibration;
//! - [`generate()`]: generation under a plan, with its KV statistics;
//! - [`explain`]: per-token introspection (entropy, what the retrieval heads read, the
//!   probe's choice);
//! - [`runtime`]: the library API, [`Runtime`];
//! - [`scheduler`]: continuous batching of many generations, [`Scheduler`];
//! - [`stream`]: a generation in the scheduler's batch as an async stream of events;
//! - [`prefix`]: shared prompt prefixes, prefilled once, for the scheduler.

pub mod ablation;
pub mod atlas;
pub mod config;
pub mod evict;
pub mod explain;
pub mod generate;
pub mod plan;
pub mod prefix;
pub mod presses;
pub mod ranking;
pub mod runtime;
pub mod scheduler;
pub mod select;
pub mod stream;

pub use config::Policy;
pub use explain::{ExplainConfig, TokenExplain};
pub use generate::{
    generate, prefill_need, Decoding, KvStats, PolicyGeneration, PrefillNeed, Prefilled,
};
pub use plan::{Dynamic, DynamicSource, Plan, Prefill};
pub use presses::{PolicyConfig, Press};
pub use runtime::{
    GenerateOutput, GenerateRequest, GenerationStats, Prompt, Runtime, RuntimeBuilder, Step,
};
pub use scheduler::{Load, Scheduler, SchedulerConfig, Sink};
pub use select::{Gqa, HeadChoice, Selection};
pub use stream::{GenerationStream, StreamEvent};
