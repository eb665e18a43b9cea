//! Dynamic retrieval-augmented generation, DRAGIN-style: passages and corpora
//! ([`corpus`]), retrievers ([`bm25`] embedded, [`http`] over the Elasticsearch
//! `_search` subset, [`search_server`] serving an index through that API), and the
//! decisions of when to retrieve and what to ask ([`trigger`], over [`text`]'s words);
//! answer segments from either engine ([`segment`]) and the loop around them
//! ([`dragin`]).

pub mod bm25;
pub mod corpus;
pub mod dragin;
pub mod http;
pub mod qa;
pub mod retriever;
pub mod search_server;
pub mod segment;
pub mod text;
pub mod trigger;

pub use bm25::Bm25Index;
pub use corpus::Passage;
pub use http::HttpRetriever;
pub use retriever::{Hit, Retriever};
