//! Panels for batches of Q5_0 rows: one weight row against up to [`PANEL`] activation
//! rows in one pass, so each weight block is unpacked once for all of them and every row
//! costs a few vector instructions per block (integer dot product, conversion, scale,
//! fused multiply-add) instead of about a dozen in [`super::dot`]'s kernels, which
//! rebuild each row's scales from scalars. One block per 256-bit register on every
//! instruction set (`vpdpbusd` on the VNNI sets, `vpmaddubsw` + `vpmaddwd` on AVX2), the
//! codes unpacked to `q - 16`; as many rows as two accumulators per row leave registers
//! for. (Q4_1 and Q8_0 are interleaved and have their own kernels for any number of rows.)
//!
//! The floats are [`super::dot`]'s, lane for lane: every row keeps its own even- and
//! odd-block accumulators and sees the same fused multiply-adds in the same order; its
//! scale `d_w * d_x` is the same product (the activation row's `d_x` is laid out once per
//! panel as a vector and multiplied by the weight's `d_w`). So a row's result does not
//! depend on the batch it runs in or on which kernel computed it.

use super::blocks::{Activations, Format};
use super::dot::Supported;
use super::isa::Isa;

/// Most activation rows of one panel: two accumulators per row, and registers left for
/// the weight block and its scale.
pub(super) const PANEL: usize = 6;

/// At most [`PANEL`] activation rows laid out for the panel kernels.
pub(super) struct Panel<'a> {
    rows: &'a [&'a Activations],
    /// Owned here, read through `scales`: row `r`, block pair `p` at `r * pairs + p`
    /// (`pairs` = blocks / 2 rounded up): `d_x` of block `2p` in lanes 0-7 and of block
    /// `2p + 1` in lanes 8-15 (zero past the last block).
    _pair_scales: Vec<[f32; 16]>,
    /// Per row, the start of its codes and of its pair scales, as plain pointers: the
    /// kernels' row loops then unroll with their accumulators in registers (indexing
    /// the slices kept them in memory), and nothing is recomputed per weight row.
    codes: [*const i8; PANEL],
    scales: [*const f32; PANEL],
    /// Blocks per row.
    blocks: usize,
}

// SAFETY: the pointers address `rows`' codes and the panel's own `pair_scales`, which
// nothing mutates while the panel lives; the panel is only read.
unsafe impl Sync for Panel<'_> {}

impl<'a> Panel<'a> {
    /// Lay out `rows` (1 to [`PANEL`], all of one length).
    ///
    /// Panics if `rows` is empty, longer than [`PANEL`], or its rows differ in length.
    pub(super) fn new(rows: &'a [&'a Activations]) -> Self {
        assert!(
            (1..=PANEL).contains(&rows.len()),
            "a panel holds 1 to {PANEL} rows"
        );
        let blocks = rows[0].blocks();
        assert!(
            rows.iter().all(|r| r.blocks() == blocks),
            "panel rows differ in length"
        );
        let pairs = blocks.div_ceil(2);
        let mut pair_scales = Vec::with_capacity(rows.len() * pairs);
        for row in rows {
            for p in 0..pairs {
                let even = row.scales[2 * p][0];
                let odd = row.scales.get(2 * p + 1).map_or(0.0, |s| s[0]);
                pair_scales.push(std::array::from_fn(|l| if l < 8 { even } else { odd }));
            }
        }
        let codes = std::array::from_fn(|r| rows.get(r).map_or(std::ptr::null(), |x| x.q.as_ptr()));
        let scales = std::array::from_fn(|r| {
            pair_scales
                .get(r * pairs..)
                .map_or(std::ptr::null(), |s| s.as_ptr().cast())
        });
        Self {
            rows,
            _pair_scales: pair_scales,
            blocks,
            codes,
            scales,
        }
    }

    fn blocks(&self) -> usize {
        self.blocks
    }

    /// The first `N` rows' code and pair-scale pointers.
    #[inline(always)]
    fn pointers<const N: usize>(&self) -> ([*const i8; N], [*const f32; N]) {
        (
            std::array::from_fn(|r| self.codes[r]),
            std::array::from_fn(|r| self.scales[r]),
        )
    }
}

/// Whether [`weight_row`] runs on `isa`: AVX2, AVX-VNNI and AVX-512 VNNI.
pub(super) fn runs(isa: Supported) -> bool {
    isa.isa() != Isa::Portable
}

/// `out[r] = sum over blocks of Q5_0 row `w` times `panel`'s row `r`.
///
/// Panics unless [`runs`] holds, `out` has one place per row, and `w` is one Q5_0 row of
/// `panel`'s length.
pub(super) fn weight_row(isa: Supported, panel: &Panel, w: &[u8], out: &mut [f32]) {
    assert!(runs(isa), "no panel kernel on {}", isa.isa());
    assert_eq!(out.len(), panel.rows.len(), "one result per panel row");
    assert_eq!(
        w.len(),
        panel.blocks() * Format::Q5_0.block_bytes(),
        "block row and panel differ in length"
    );
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! dispatch {
            ($($m:literal)*) => {
                match (isa.isa(), out.len()) {
                    // SAFETY (all): `runs` checked that the CPU has the instruction set
                    // (`Supported`; AVX-512 VNNI with BW, VL, F, AVX2, FMA, F16C, and
                    // AVX-VNNI with AVX2, FMA, F16C: `Isa::supported`), and the lengths
                    // and the row count were checked above.
                    $(
                        (Isa::Avx512Vnni, $m) => out.copy_from_slice(&unsafe { x86::q5_0_vnni::<$m>(panel, w) }),
                        (Isa::AvxVnni, $m) => out.copy_from_slice(&unsafe { x86::q5_0_avxvnni::<$m>(panel, w) }),
                        (Isa::Avx2, $m) => out.copy_from_slice(&unsafe { x86::q5_0_avx2::<$m>(panel, w) }),
                    )*
                    _ => unreachable!("checked above"),
                }
            };
        }
        dispatch!(1 2 3 4 5 6);
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no panel kernel off x86-64");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::blocks::QK;
    use super::super::dot::x86::{dot_avx2, dot_avxvnni, dot_vnni, hsum, q5_0_signed};
    use super::super::PREFETCH_BYTES as PREFETCH;
    use super::Panel;

    /// `$block!(b, $even)` for the even blocks `b` of `0..$nb` and `$block!(b, $odd)` for
    /// the odd ones, in order: a 256-bit panel's loop over a weight row.
    macro_rules! in_pairs {
        ($nb:expr, $block:ident, $even:ident, $odd:ident) => {
            for p in 0..$nb / 2 {
                $block!(2 * p, $even);
                $block!(2 * p + 1, $odd);
            }
            if $nb % 2 == 1 {
                $block!($nb - 1, $even);
            }
        };
    }

    /// The body of a 256-bit panel over signed codes of `$bytes`-byte
    /// blocks whose first two bytes are the f16 scale: `$codes(block)` gives the 32
    /// signed codes, each weight's sign is moved onto the activation, and blocks go in
    /// pairs so that the even and odd accumulators are named, not indexed.
    macro_rules! signed_256 {
        ($panel:ident, $w:ident, $n:ident, $bytes:literal, $dot:ident, $codes:expr) => {{
            let codes = $codes;
            let nb = $panel.blocks();
            let (qs, dxs) = $panel.pointers::<$n>();
            let mut even = [_mm256_setzero_ps(); $n];
            let mut odd = [_mm256_setzero_ps(); $n];
            macro_rules! block {
                ($b:expr, $acc:ident) => {{
                    let b = $b;
                    let blk = $w.as_ptr().add(b * $bytes);
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH) as *const i8);
                    let bits = (blk as *const u16).read_unaligned() as i32;
                    let d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
                    let wv = codes(blk);
                    let wabs = _mm256_abs_epi8(wv);
                    let half = 16 * (b / 2) + 8 * (b % 2);
                    for r in 0..$n {
                        let xv = _mm256_loadu_si256(qs[r].add(b * QK) as *const __m256i);
                        let dot = _mm256_cvtepi32_ps($dot(wabs, _mm256_sign_epi8(xv, wv)));
                        let dx = _mm256_loadu_ps(dxs[r].add(half));
                        $acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, dx), $acc[r]);
                    }
                }};
            }
            in_pairs!(nb, block, even, odd);
            std::array::from_fn(|r| hsum(_mm256_add_ps(even[r], odd[r])))
        }};
    }

    /// The 256-bit panels of one instruction set: `$dot` sums four adjacent products of
    /// unsigned and signed bytes into each of eight i32 lanes. Blocks go in pairs, so
    /// that the even and odd accumulators are named, not indexed (kept in registers).
    macro_rules! panels_256 {
        ($q5_0:ident, $features:literal, $dot:ident) => {
            /// Q5_0 row `w` against the panel's `N` rows (`N` <= [`PANEL`]): the codes
            /// unpacked to `q - 16`, each weight's sign moved onto the activation.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $q5_0<const N: usize>(panel: &Panel, w: &[u8]) -> [f32; N] {
                signed_256!(panel, w, N, 22, $dot, |blk: *const u8| q5_0_signed(blk))
            }
        };
    }

    panels_256!(q5_0_avx2, "avx2,fma,f16c", dot_avx2);
    panels_256!(q5_0_avxvnni, "avxvnni,avx2,fma,f16c", dot_avxvnni);

    /// Q5_0 on AVX-512 VNNI: the 256-bit panel with its 256-bit `vpdpbusd` (Q5_0's
    /// blocks are not paired into 512-bit registers).
    #[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn q5_0_vnni<const N: usize>(panel: &Panel, w: &[u8]) -> [f32; N] {
        signed_256!(panel, w, N, 22, dot_vnni, |blk: *const u8| q5_0_signed(blk))
    }
}
