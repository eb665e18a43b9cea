//! Block layouts of the weights (GGUF's own bytes) and of the activation rows they are
//! multiplied with.
//!
//! * Q4_1, 20 bytes per 32 weights: f16 `d`, f16 `m`, 16 bytes whose low nibbles hold
//!   elements `0..16` and high nibbles `16..32`; `w = d * q + m`, `q` in `0..16`.
//! * Q5_0, 22 bytes per 32 weights: f16 `d`, a little-endian u32 whose bit `j` is the
//!   fifth bit of element `j`, then 16 bytes of low nibbles laid out as Q4_1's;
//!   `w = d * (q - 16)`, `q` in `0..32`.
//! * Q8_0, 34 bytes per 32 weights: f16 `d`, 32 signed bytes; `w = d * q`.
//!
//! An activation row is quantized per block of 32 to signed bytes in `[-127, 127]` with an
//! f32 scale (`x ≈ d_x * q_x`, `d_x = max|x| / 127`), so a block's contribution to a dot
//! product is `d_w * d_x * dot(q_w, q_x)` (Q4_1 adds `m * d_x * sum(q_x)`).

use half::f16;

use crate::model::numerics::fast_exp::{held_integer, ROUND};

/// Elements per block, weights and activations alike.
pub const QK: usize = 32;

/// A weight block layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// GGUF Q4_1.
    Q4_1,
    /// GGUF Q5_0.
    Q5_0,
    /// GGUF Q8_0.
    Q8_0,
}

impl Format {
    /// Every layout.
    pub const ALL: [Format; 3] = [Format::Q4_1, Format::Q5_0, Format::Q8_0];

    /// The layout of a GGUF tensor type that is kept as the file stores it; `None` for
    /// the others.
    pub fn of(dtype: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType;
        match dtype {
            GgmlDType::Q4_1 => Some(Format::Q4_1),
            GgmlDType::Q5_0 => Some(Format::Q5_0),
            GgmlDType::Q8_0 => Some(Format::Q8_0),
            _ => None,
        }
    }

    /// Bytes of one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q8_0 => 34,
        }
    }

    /// Dequantize whole blocks `blocks` into `out` (`QK` floats per block), with the
    /// arithmetic of ggml's `dequantize_row_*` (`q * d + m`, `(q - 16) * d`, `q * d`): the
    /// values candle's `QTensor::dequantize` gives. The tests' reading of the file layout,
    /// against which the interleaved blocks are checked (the kernels read those in place).
    #[cfg(test)]
    pub(super) fn dequantize(self, blocks: &[u8], out: &mut [f32]) {
        // Written as straight loops over the block's two halves, which the compiler turns
        // into vector code; each value is the same one product (and, for Q4_1, one sum).
        for (blk, o) in blocks
            .chunks_exact(self.block_bytes())
            .zip(out.chunks_exact_mut(QK))
        {
            let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            match self {
                Format::Q4_1 => {
                    let (lo, hi) = o.split_at_mut(QK / 2);
                    let m = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                    for ((a, b), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&blk[4..20]) {
                        *a = (q & 0x0F) as f32 * d + m;
                        *b = (q >> 4) as f32 * d + m;
                    }
                }
                Format::Q5_0 => {
                    let high = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                    let (lo, hi) = o.split_at_mut(QK / 2);
                    for (j, ((a, b), &q)) in lo
                        .iter_mut()
                        .zip(hi.iter_mut())
                        .zip(&blk[6..22])
                        .enumerate()
                    {
                        let qa = (q & 0x0F) as i32 | (((high >> j) & 1) << 4) as i32;
                        let qb = (q >> 4) as i32 | (((high >> (j + QK / 2)) & 1) << 4) as i32;
                        *a = (qa - 16) as f32 * d;
                        *b = (qb - 16) as f32 * d;
                    }
                }
                Format::Q8_0 => {
                    for (o, &q) in o.iter_mut().zip(&blk[2..34]) {
                        *o = q as i8 as f32 * d;
                    }
                }
            }
        }
    }
}

/// The 32 signed codes `q - 16` (in `-16..16`) of one Q5_0 block.
pub(super) fn q5_0_codes(blk: &[u8]) -> [i8; QK] {
    let high = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
    std::array::from_fn(|j| {
        let byte = blk[6 + j % (QK / 2)];
        let low = if j < QK / 2 { byte & 0x0F } else { byte >> 4 };
        (low | (((high >> j) & 1) as u8) << 4) as i8 - 16
    })
}

/// Q5_0 blocks as Q8_0 blocks of the same values: the same f16 `d`, and the codes `q - 16`
/// as signed bytes (nothing is rounded).
pub fn q5_0_to_q8_0(blocks: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(blocks.len() / 22 * 34);
    for blk in blocks.chunks_exact(Format::Q5_0.block_bytes()) {
        out.extend(&blk[..2]);
        out.extend(q5_0_codes(blk).map(|q| q as u8));
    }
    out
}

/// Bytes of one GGUF Q4_K block of 256 weights.
const Q4_K_BYTES: usize = 144;

/// Sub-block `j`'s six-bit scale and minimum (`0..8`) from the twelve packed bytes `s` of
/// a Q4_K block (ggml's `get_scale_min_k4`): sub-blocks 0-3 in the low six bits of bytes
/// `j` and `j + 4`, sub-blocks 4-7 in the nibbles of byte `j + 4` with their top two bits
/// in the top bits of bytes `j - 4` and `j`.
pub(crate) fn q4_k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// GGUF Q4_K blocks as Q4_1 blocks of the same codes. A Q4_K block holds 256 weights in
/// eight sub-blocks of 32: f16 `d` and `dmin`, twelve bytes of six-bit sub-block scales
/// `sc_j` and minimums `m_j`, then 128 bytes whose low nibbles are sub-block `2i` and high
/// nibbles sub-block `2i + 1` of each 32-byte run `i`; `w = d * sc_j * q - dmin * m_j`
/// (ggml's `dequantize_row_q4_K`). Each sub-block becomes one Q4_1 block with
/// `d = d * sc_j` and `m = -dmin * m_j` rounded to f16 (at most 2^-11 of each, relative);
/// the codes are kept. Q4_1 takes 20 bytes per 32 weights where Q4_K takes 18 and a
/// requantized Q8_0 34.
pub fn q4_k_to_q4_1(blocks: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(blocks.len() / Q4_K_BYTES * 8 * Format::Q4_1.block_bytes());
    for b in blocks.chunks_exact(Q4_K_BYTES) {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        let dmin = f16::from_le_bytes([b[2], b[3]]).to_f32();
        for j in 0..8 {
            let (sc, m) = q4_k_scale_min(&b[4..16], j);
            out.extend(f16::from_f32(d * sc as f32).to_le_bytes());
            out.extend(f16::from_f32(-dmin * m as f32).to_le_bytes());
            let run = &b[16 + 32 * (j / 2)..][..32];
            let code = |i: usize| {
                if j % 2 == 0 {
                    run[i] & 0x0F
                } else {
                    run[i] >> 4
                }
            };
            out.extend((0..QK / 2).map(|i| code(i) | (code(i + QK / 2) << 4)));
        }
    }
    out
}

/// `x` (length a multiple of [`QK`]) as Q8_0 blocks, as ggml's `quantize_row_q8_0`
/// rounds: `d = max|x| / 127` stored as f16, `q = round(x / d)` with the f32 `d`.
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK * Format::Q8_0.block_bytes());
    for xb in x.chunks_exact(QK) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(xb.iter().map(|v| round_code(v * inv) as u8));
    }
    out
}

/// `v.round() as i8` for `|v| < 127.5` (a quantization code), and `0` for NaN as that
/// cast gives, in operations the compiler vectorises ([`held_integer`]).
#[inline(always)]
fn round_code(v: f32) -> i8 {
    let r = v.round();
    let r = if r.is_nan() { 0.0 } else { r };
    held_integer(r + ROUND) as i8
}

/// One activation row in 8-bit blocks.
#[derive(Debug, Clone)]
pub struct Activations {
    /// The quantized values, one per input element.
    pub(super) q: Vec<i8>,
    /// Per block: `d_x` and `d_x * sum(q_x)` (the factor of Q4_1's `m`).
    pub(super) scales: Vec<[f32; 2]>,
    /// Per block: `128 * sum(q_x)`, what Q8_0's interleaved codes (stored as `q_w + 128`)
    /// add to a block's integer sum; an eighth of it is what Q5_0's (taken as `q_w + 16`)
    /// add.
    pub(super) excess: Vec<i32>,
}

impl Activations {
    /// Quantize `x`, whose length is a multiple of [`QK`].
    pub fn quantize(x: &[f32]) -> Self {
        let mut q = vec![0i8; x.len()];
        let mut scales = Vec::with_capacity(x.len() / QK);
        let mut excess = Vec::with_capacity(x.len() / QK);
        for (xb, qb) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for (o, v) in qb.iter_mut().zip(xb) {
                *o = round_code(v * inv);
                sum += *o as i32;
            }
            scales.push([d, d * sum as f32]);
            excess.push(128 * sum);
        }
        Self { q, scales, excess }
    }

    /// Number of blocks.
    pub fn blocks(&self) -> usize {
        self.scales.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_as_the_saturating_cast_does() {
        let mut v = -127.49f32;
        while v < 127.5 {
            assert_eq!(round_code(v), v.round() as i8, "{v}");
            v += 0.0137;
        }
        for v in [
            -127.5f32 + 1e-5,
            -0.5,
            -0.0,
            0.5,
            1.5,
            2.5,
            126.5,
            127.49,
            f32::NAN,
        ] {
            assert_eq!(round_code(v), v.round() as i8, "{v}");
        }
    }

    #[test]
    fn q8_0_round_trip_is_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.37)
            .collect();
        let blocks = quantize_q8_0(&x);
        assert_eq!(blocks.len(), 2 * Format::Q8_0.block_bytes());
        let mut y = vec![0f32; 64];
        Format::Q8_0.dequantize(&blocks, &mut y);
        for (b, (xb, yb)) in x.chunks(QK).zip(y.chunks(QK)).enumerate() {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, c) in xb.iter().zip(yb) {
                assert!(
                    (a - c).abs() <= amax / 127.0 * 0.51 + 1e-3,
                    "block {b}: {a} vs {c}"
                );
            }
        }
    }

    #[test]
    fn q5_0_codes_follow_the_layout_and_convert_to_q8_0_exactly() {
        // d = 0.5; element j's fifth bit set for j = 1 and j = 17 only; low nibble of
        // element j is j % 16 (elements 16.. read the high nibbles).
        let mut blk = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        blk.extend(((1u32 << 1) | (1u32 << 17)).to_le_bytes());
        blk.extend((0..16u8).map(|j| j | (j << 4)));
        let want: Vec<i8> = (0..32)
            .map(|j| (j % 16) as i8 + if j % 16 == 1 { 16 } else { 0 } - 16)
            .collect();
        assert_eq!(q5_0_codes(&blk).to_vec(), want);
        let mut values = vec![0f32; 32];
        Format::Q5_0.dequantize(&blk, &mut values);
        let mut again = vec![0f32; 32];
        Format::Q8_0.dequantize(&q5_0_to_q8_0(&blk), &mut again);
        assert_eq!(values, again);
        assert_eq!((values[0], values[1], values[17]), (-8.0, 0.5, 0.5));
    }

    #[test]
    fn dequantize_gives_every_element_its_definition() {
        // Random bytes for codes and bits, finite f16 scales; the value of element j is
        // computed one element at a time from the layout in the module header.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut byte = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        };
        for format in Format::ALL {
            let n = 37;
            let mut blocks = Vec::new();
            for _ in 0..n {
                let scale = half::f16::from_f32((byte() as f32 - 128.0) / 512.0);
                let min = half::f16::from_f32((byte() as f32 - 128.0) / 64.0);
                blocks.extend(scale.to_le_bytes());
                if format == Format::Q4_1 {
                    blocks.extend(min.to_le_bytes());
                }
                let header = if format == Format::Q4_1 { 4 } else { 2 };
                blocks.extend((header..format.block_bytes()).map(|_| byte()));
            }
            assert_eq!(blocks.len(), n * format.block_bytes());
            let mut got = vec![0f32; n * QK];
            format.dequantize(&blocks, &mut got);
            for (b, blk) in blocks.chunks_exact(format.block_bytes()).enumerate() {
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                for j in 0..QK {
                    let want = match format {
                        Format::Q4_1 => {
                            let m = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                            let byte = blk[4 + j % 16];
                            let q = if j < 16 { byte & 0x0F } else { byte >> 4 };
                            q as f32 * d + m
                        }
                        Format::Q5_0 => q5_0_codes(blk)[j] as f32 * d,
                        Format::Q8_0 => blk[2 + j] as i8 as f32 * d,
                    };
                    let v = got[b * QK + j];
                    assert_eq!(
                        v.to_bits(),
                        want.to_bits(),
                        "{format:?} block {b} element {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn activations_record_their_scales_and_sums() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 8.0).collect();
        let a = Activations::quantize(&x);
        assert_eq!(a.blocks(), 1);
        assert_eq!(a.q[31], 127);
        let sum: i32 = a.q.iter().map(|&v| v as i32).sum();
        assert_eq!(a.scales[0], [23.0 / 127.0, 23.0 / 127.0 * sum as f32]);
        assert_eq!(a.excess[0], 128 * sum);
        assert!(Activations::quantize(&[0.0; 32]).q.iter().all(|&v| v == 0));
    }
}
