//! How the weights multiply, in each [`Numerics`]: linear layers and the token embedding
//! over GGUF tensors, the normalisation and gate of each numerics ([`Ops`]), the fast
//! numerics' block kernels, llama.cpp's arithmetic, and a vectorised `exp`. Reads tensors
//! from [`crate::model::file`]; knows nothing of layers, caches or attention.

pub mod activation;
pub mod embedding;
pub(crate) mod fast_exp;
pub mod ggml;
pub mod ggml_quant;
pub mod kernels;
pub mod linear;
pub mod ops;

pub use linear::{Linear, Numerics};
pub use ops::Ops;
