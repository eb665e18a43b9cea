//! KV caches: the plain per-layer cache ([`KvCache`], every head keeps every position)
//! and the per-head cache of a policy ([`HeadCache`]), made of one [`store`] per
//! (layer, KV head). Caches only store; the attention that reads them is in
//! `crate::model::attention`.

pub mod heads;
pub mod plain;
pub mod store;

pub use heads::{HeadCache, TopK};
pub use plain::KvCache;
pub use store::{ColdFormat, KvBytes, Retention, INT8_BLOCK};
