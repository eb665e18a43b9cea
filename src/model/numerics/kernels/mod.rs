//! The quantized matrix kernels of [`Numerics::Fast`](crate::model::Numerics::Fast):
//! weights stay in GGUF's own 32-element blocks ([`Format::Q4_1`], [`Format::Q5_0`] and
//! [`Format::Q8_0`] as the file stores them, interleaved sixteen rows to a group; Q4_K as
//! Q4_1 blocks of its 32-weight sub-blocks, every other type requantized to Q8_0), and no
//! f32 copy of a weight is kept.
//!
//! * [`isa`]: which instruction set runs, chosen at run time (`HEADWISE_ISA` caps it);
//! * [`blocks`]: the block layouts, activation rows quantized to 8 bits, dequantization;
//! * `interleaved`: the kernels, sixteen weight rows per group, one 32-bit lane each,
//!   against any number of activation rows; one implementation per instruction set, all
//!   computing the same floats;
//! * [`matrix`]: [`BlockMatrix`], the product of a block matrix with activation rows
//!   (decode, batches and prefill alike), and the f32 tiles it is measured against.

pub mod blocks;
mod interleaved;
pub mod isa;
pub mod matrix;

pub use blocks::{Activations, Format, QK};

/// Bytes ahead of what they read that the integer kernels and the decode attention loops
/// prefetch: on the Xeon here (model 207) the hardware prefetchers alone left a one-row
/// pass over Gemma's blocks, and the decode attention's key stream, at about half the
/// machine's read bandwidth (1 KiB and 2 KiB measured alike; the distance was not varied on
/// the AMD EPYC).
pub(crate) const PREFETCH_BYTES: usize = 1024;
pub use isa::Isa;
pub use matrix::BlockMatrix;
