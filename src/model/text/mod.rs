//! Text to token ids and back: the tokenizer built from GGUF metadata and the chat
//! template rendered from it.

pub mod chat;
pub mod tokenizer;
