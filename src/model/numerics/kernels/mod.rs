//! The quantized matrix kernels of [`Numerics::Fast`](crate::model::Numerics::Fast):
//! weights stay in GGUF's own 32-element blocks ([`Format::Q4_1`] and [`Format::Q8_0`]
//! as the file stores them, interleaved sixteen rows to a group; [`Format::Q5_0`] row after
//! row; Q4_K as Q4_1 blocks of its 32-weight sub-blocks, every other type requantized to
//! Q8_0), and no f32 copy of a weight is kept.
//!
//! * [`isa`]: which instruction set runs, chosen at run time (`HEADWISE_ISA` caps it);
//! * [`blocks`]: the block layouts, activation rows quantized to 8 bits, dequantization;
//! * `interleaved`: Q4_1's and Q8_0's kernels, sixteen weight rows per group, one 32-bit
//!   lane each, against any number of activation rows; one implementation per instruction
//!   set, all computing the same floats;
//! * `dot`: the block dot products of one Q5_0 weight row against 1-4 activation rows,
//!   one implementation per instruction set, all computing the same floats;
//! * `panel`: the same floats for up to six activation rows per Q5_0 weight row (batches);
//! * [`matrix`]: [`BlockMatrix`], the product of a block matrix with activation rows:
//!   integer dot products for a few rows (decode, small batches), dequantized weight
//!   tiles through a cache-sized f32 buffer and `gemm` for many (prefill).

pub mod blocks;
mod dot;
mod interleaved;
pub mod isa;
pub mod matrix;
mod panel;

pub use blocks::{Activations, Format, QK};

/// Bytes ahead of what they read that the integer kernels and the decode attention loops
/// prefetch: on the Xeon here (model 207) the hardware prefetchers alone left a one-row
/// pass over Gemma's blocks, and the decode attention's key stream, at about half the
/// machine's read bandwidth (1 KiB and 2 KiB measured alike; the distance was not varied on
/// the AMD EPYC).
pub(crate) const PREFETCH_BYTES: usize = 1024;
pub use isa::Isa;
pub use matrix::BlockMatrix;
