//! The eval harness: tasks as [`Example`]s ([`datasets`], [`controls`] and the needle
//! generators of [`crate::lab::tasks`]), head ablations ([`crate::policy::ablation`]), experiment specs
//! ([`spec`]), runs that resume and shard ([`run`]), reports ([`report`]), and the
//! accuracy-against-memory sweeps of the compression policies ([`kv_budget`], with the
//! score-against-compression-ratio view of `leaderboard`).

pub mod controls;
pub mod datasets;
pub mod example;
pub mod kv_budget;
pub(crate) mod leaderboard;
pub mod report;
pub mod run;
pub mod spec;

pub use example::{Example, PromptBuilder};
