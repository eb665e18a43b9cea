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

/// The thread count that work whose split changes the floats is split for, whatever the
/// size of the pool that runs it: the f32 weight tiles of
/// [`kernels::BlockMatrix::tiled_product`] (the width `gemm` sums over; the baseline
/// `headwise bench kernels` measures) and a decode step's parts of each KV head's keys (merged by rescaling). So a
/// sequence's logits are the same on 1, 2 or 16 threads, and records made on one machine
/// are reproduced by a run on another with the same kernels (the arithmetic fingerprint,
/// `crate::model::fingerprint`, checks it). Two, the machines' count: their floats are
/// the ones every record before this constant was made with. A larger pool takes the
/// same tasks, fewer per thread: four tiles per tiled product (more for products whose
/// f32 tiles would be larger), and four parts of the keys per decode step shared among
/// the KV heads (at least one each), so a pool of more than four threads leaves some
/// threads idle in those two places.
pub(crate) const PARTITION_THREADS: usize = 2;
