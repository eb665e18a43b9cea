//! KV caches: the plain per-layer cache ([`KvCache`], every head keeps every position)
//! and the per-head cache of a policy ([`HeadCache`]), made of one [`store`] per
//! (layer, KV head) holding its rows in a [`RowFormat`] ([`rows`]). Caches only store; the attention that reads them is in
//! `crate::model::attention`.

pub mod heads;
pub mod plain;
pub mod rows;
pub mod store;

pub use heads::{HeadCache, TopK};
pub use plain::KvCache;
pub use rows::{RowFormat, Q8_BLOCK};
pub use store::{KvBytes, Retention};
