//! The KV cache ([`HeadCache`]): one [`store`] per (layer, KV head) holding its rows in a
//! [`RowFormat`] ([`rows`]), every position (the plain cache) or what a policy's
//! [`Retention`] keeps. Caches only store; the attention that reads them is in
//! `crate::model::attention`.

pub mod heads;
pub mod rows;
pub mod store;

pub use heads::{HeadCache, TopK};
pub use rows::{RowFormat, Q8_BLOCK};
pub use store::{KvBytes, Retention};
