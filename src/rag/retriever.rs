//! The retriever interface: a query in, the best `k` passages out.

use serde::{Deserialize, Serialize};

use crate::Result;

/// One retrieved passage with its score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hit {
    pub id: String,
    pub title: String,
    pub text: String,
    /// BM25 score (higher is better).
    pub score: f32,
}

/// Most passages one search may ask for.
pub const MAX_K: usize = 1000;

/// Anything that finds passages for a query.
pub trait Retriever: Send + Sync {
    /// The best `k` passages for `query`, best first; `k` beyond [`MAX_K`] is an
    /// [`crate::Error::InvalidArgument`].
    fn search(&self, query: &str, k: usize) -> Result<Vec<Hit>>;
}
