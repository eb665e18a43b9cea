//! Block dot products of one Q5_0 weight row against `R` activation rows (1-4): the inner
//! loop of that format's [`BlockMatrix`](super::BlockMatrix) products, one implementation
//! per instruction set (Q4_1 and Q8_0, held interleaved, have their own: `interleaved`).
//!
//! All of them compute the same floats. Per block, the integer products are summed in
//! eight lanes of four adjacent elements (what `vpdpbusd` does, and `vpmaddubsw` followed
//! by `vpmaddwd` with ones), each lane is converted to f32 (exactly: `|sum| < 2^24`) and
//! fused-multiply-added with the block's scale `d_w * d_x` into one of two accumulators
//! (even and odd blocks, so consecutive blocks do not wait on each other); the two are
//! added and the lanes summed as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`. The
//! portable loop follows that order with `f32::mul_add`, so a result does not depend on
//! the CPU, and a row's result does not depend on the other rows computed with it.
//!
//! The x86 kernels multiply unsigned by signed bytes: Q5_0's codes are unpacked to the
//! signed bytes `q - 16`, and each block is fed `|q_w|` and the activation with `q_w`'s
//! sign moved onto it (same products). Every value stays in `[-127, 127]`, so
//! `vpmaddubsw`'s 16-bit pair sums (at most `2 * 127 * 127`) cannot saturate. One block
//! per 256-bit register on every instruction set, AVX-512 VNNI included (its 256-bit
//! `vpdpbusd`).

use half::f16;

use super::blocks::{q5_0_codes, Activations, Format, QK};
use super::isa::Isa;

/// An [`Isa`] that this CPU was checked to run (else [`Isa::Portable`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Supported(Isa);

impl Supported {
    /// `isa` if the CPU runs it, else the portable loop.
    pub(super) fn new(isa: Isa) -> Self {
        Supported(if isa.supported() { isa } else { Isa::Portable })
    }

    /// The instruction set that runs.
    pub(super) fn isa(self) -> Isa {
        self.0
    }
}

/// `out[r] = sum over blocks of Q5_0 row `w` times `x[r]`.
///
/// Panics if `w` is not `x[r].blocks()` Q5_0 blocks for every `r` (callers check shapes
/// once per matrix).
pub(super) fn weight_row<const R: usize>(
    isa: Supported,
    x: [&Activations; R],
    w: &[u8],
) -> [f32; R] {
    for xr in &x {
        assert!(
            w.len() == xr.blocks() * Format::Q5_0.block_bytes() && xr.q.len() == xr.blocks() * QK,
            "block row and activation row differ in length"
        );
    }
    match isa.0 {
        Isa::Portable => std::array::from_fn(|r| portable(x[r], w)),
        // SAFETY (all three): `Supported` checked that the CPU has the features the
        // function enables (every `Isa` past `Portable` includes AVX2, FMA and F16C), and
        // the lengths were checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::q5_0_avx2(x, w) },
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => unsafe { x86::q5_0_avxvnni(x, w) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { x86::q5_0_vnni(x, w) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => std::array::from_fn(|r| portable(x[r], w)),
    }
}

/// The portable loop over Q5_0 blocks, in the lane order of the x86 kernels.
fn portable(x: &Activations, w: &[u8]) -> f32 {
    let mut acc = [[0f32; 8]; 2];
    let mut q = [0i32; QK];
    for (b, blk) in w.chunks_exact(Format::Q5_0.block_bytes()).enumerate() {
        let xq = &x.q[b * QK..(b + 1) * QK];
        let dx = x.scales[b][0];
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        for (o, c) in q.iter_mut().zip(q5_0_codes(blk)) {
            *o = c as i32;
        }
        let scale = d * dx;
        for (lane, a) in acc[b % 2].iter_mut().enumerate() {
            let dot: i32 = (4 * lane..4 * lane + 4).map(|e| q[e] * xq[e] as i32).sum();
            *a = (dot as f32).mul_add(scale, *a);
        }
    }
    let v: [f32; 8] = std::array::from_fn(|i| acc[0][i] + acc[1][i]);
    let s4: [f32; 4] = std::array::from_fn(|i| v[i + 4] + v[i]);
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::super::blocks::{Activations, QK};
    use super::super::PREFETCH_BYTES as PREFETCH;

    /// Eight i32 lanes, each the sum of four adjacent products of unsigned `u` and signed
    /// `s` bytes (pair sums in i16 first: no saturation for values within 127).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::model::numerics::kernels) fn dot_avx2(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// The same lanes with one EVEX-encoded `vpdpbusd` (AVX-512 VNNI).
    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl")]
    pub(in crate::model::numerics::kernels) fn dot_vnni(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }

    /// The same lanes with one VEX-encoded `vpdpbusd` (AVX-VNNI).
    #[inline]
    #[target_feature(enable = "avxvnni")]
    pub(in crate::model::numerics::kernels) fn dot_avxvnni(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
    }

    /// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
    #[inline]
    #[target_feature(enable = "avx")]
    pub(in crate::model::numerics::kernels) fn hsum(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)))
    }

    /// One instruction set's kernel over blocks of signed codes: `$dot` sums
    /// four adjacent products of unsigned and signed bytes into each of eight i32 lanes.
    macro_rules! signed {
        ($signed:ident, $features:literal, $dot:ident) => {
            /// Row `w` of blocks of `BYTES` bytes, each an f16 `d` and 32 signed codes
            /// that `codes` reads from the block's start, against `R` activation rows.
            #[target_feature(enable = $features)]
            unsafe fn $signed<const R: usize, const BYTES: usize>(
                x: [&Activations; R],
                w: &[u8],
                codes: impl Fn(*const u8) -> __m256i,
            ) -> [f32; R] {
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                let nb = x[0].blocks();
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * BYTES);
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH) as *const i8);
                    let bits = (blk as *const u16).read_unaligned() as i32;
                    let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
                    let wv = codes(blk);
                    let wabs = _mm256_abs_epi8(wv);
                    for r in 0..R {
                        let xv = _mm256_loadu_si256(x[r].q.as_ptr().add(b * QK) as *const __m256i);
                        let dot = _mm256_cvtepi32_ps($dot(wabs, _mm256_sign_epi8(xv, wv)));
                        let scale = _mm256_set1_ps(d * x[r].scales[b][0]);
                        acc[r][b % 2] = _mm256_fmadd_ps(dot, scale, acc[r][b % 2]);
                    }
                }
                let mut out = [0f32; R];
                for r in 0..R {
                    out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
                }
                out
            }
        };
    }

    signed!(signed_avx2, "avx2,fma,f16c", dot_avx2);

    /// Byte `i` is all ones where bit `i` of `bits` is set, else zero.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn bit_bytes(bits: u32) -> __m256i {
        // Byte i takes byte i / 8 of `bits` (each 128-bit half indexes its own copy)...
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        // ...and keeps bit i % 8 of it.
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select)
    }

    /// A Q5_0 block's 32 codes as the signed bytes `q - 16`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::model::numerics::kernels) unsafe fn q5_0_signed(blk: *const u8) -> __m256i {
        let low = _mm_set1_epi8(0x0F);
        let high = (blk.add(2) as *const u32).read_unaligned();
        let packed = _mm_loadu_si128(blk.add(6) as *const __m128i);
        let lo = _mm_and_si128(packed, low);
        let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
        // `q - 16` is the nibble where the fifth bit is set, else the nibble with the
        // high four bits set (the byte `nibble - 16`).
        _mm256_or_si256(
            _mm256_set_m128i(hi, lo),
            _mm256_andnot_si256(bit_bytes(high), _mm256_set1_epi8(0xF0u8 as i8)),
        )
    }

    /// Q5_0 row `w` against `R` activation rows: each block's codes unpacked to the signed
    /// bytes `q - 16`, then multiplied as Q8_0's.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q5_0_avx2<const R: usize>(x: [&Activations; R], w: &[u8]) -> [f32; R] {
        signed_avx2::<R, 22>(x, w, |blk| q5_0_signed(blk))
    }
    signed!(signed_avxvnni, "avxvnni,avx2,fma,f16c", dot_avxvnni);

    /// Q5_0 row `w` against `R` activation rows on AVX-VNNI.
    #[target_feature(enable = "avxvnni,avx2,fma,f16c")]
    pub(super) unsafe fn q5_0_avxvnni<const R: usize>(x: [&Activations; R], w: &[u8]) -> [f32; R] {
        signed_avxvnni::<R, 22>(x, w, |blk| q5_0_signed(blk))
    }

    signed!(
        signed_vnni256,
        "avx512vnni,avx512vl,avx2,fma,f16c",
        dot_vnni
    );

    /// Q5_0 row `w` against `R` activation rows on AVX-512 VNNI, one block per 256-bit
    /// register (Q5_0's blocks are not paired).
    #[target_feature(enable = "avx512vnni,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn q5_0_vnni<const R: usize>(x: [&Activations; R], w: &[u8]) -> [f32; R] {
        signed_vnni256::<R, 22>(x, w, |blk| q5_0_signed(blk))
    }
}
