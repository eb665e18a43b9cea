//! Reference engines: mistral.rs, loaded from the same GGUF file.

pub mod mistralrs;
