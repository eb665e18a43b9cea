//! The lab: the experiments that find, predict and test retrieval heads, above the
//! runtime and never imported by it. Head scoring and traces ([`heads`]), the evaluation
//! tasks and datasets ([`tasks`], [`eval`]), KV quantization's cost in perplexity beside
//! llama.cpp ([`kv_quant`]), probe training ([`probe_train`]), the RAG
//! and serving experiments ([`rag_eval`], [`serve_bench`]), the speed benchmark
//! ([`bench`](mod@bench)) and the plots and statistics their reports use (`plot`, `stats`).

pub mod bench;
pub mod eval;
pub mod heads;
pub mod kv_quant;
pub(crate) mod plot;
pub mod probe_train;
pub mod rag_eval;
pub mod serve_bench;
pub(crate) mod stats;
pub mod tasks;
