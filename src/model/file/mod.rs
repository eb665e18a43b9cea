//! Model files: reading GGUF (header, metadata, tensors, the file's sha256) and fetching
//! the known models. Nothing here knows what the tensors compute.

pub mod fetch;
pub mod gguf;
