//! Panels for batches: one weight row against up to [`PANEL`] activation rows in one
//! pass on AVX-512 VNNI, so each pair of weight blocks is unpacked once for all of them
//! and every row costs four vector instructions per pair (integer dot product,
//! conversion, scale, fused multiply-add) instead of about a dozen in
//! [`super::dot`]'s kernels, which rebuild each row's scales from scalars.
//!
//! The floats are [`super::dot`]'s, lane for lane: every row keeps its own even- and
//! odd-block accumulators (the two halves of one 512-bit register) and sees the same
//! fused multiply-adds in the same order; its scale `d_w * d_x` is the same product
//! (the activation row's pair of `d_x` is laid out once per panel as a vector and
//! multiplied by the weight's pair of `d_w`); Q4_1's offset `sum_b m_w * (d_x sum q_x)`
//! is summed block after block as there, one lane per row. So a row's result does not
//! depend on the batch it runs in or on which kernel computed it.

use super::blocks::{Activations, Format};
use super::dot::Supported;
use super::isa::Isa;

/// Most activation rows of one panel (one 512-bit lane each for Q4_1's offsets).
pub(super) const PANEL: usize = 16;

/// At most [`PANEL`] activation rows laid out for the panel kernels.
pub(super) struct Panel<'a> {
    rows: &'a [&'a Activations],
    /// Owned here, read through `scales`: row `r`, block pair `p` at `r * pairs + p`:
    /// `d_x` of block `2p` in lanes 0-7 and of block `2p + 1` in lanes 8-15.
    _pair_scales: Vec<[f32; 16]>,
    /// Block `b`: lane `r` is row `r`'s `d_x * sum(q_x)`, zero past the last row.
    sums: Vec<[f32; PANEL]>,
    /// Per row, the start of its codes and of its pair scales, as plain pointers: the
    /// kernels' row loops then unroll with their accumulators in registers (indexing
    /// the slices kept them in memory), and nothing is recomputed per weight row.
    codes: [*const i8; PANEL],
    scales: [*const f32; PANEL],
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
        let pairs = blocks / 2;
        let mut pair_scales = Vec::with_capacity(rows.len() * pairs);
        for row in rows {
            for p in 0..pairs {
                let (even, odd) = (row.scales[2 * p][0], row.scales[2 * p + 1][0]);
                pair_scales.push(std::array::from_fn(|l| if l < 8 { even } else { odd }));
            }
        }
        let sums = (0..blocks)
            .map(|b| std::array::from_fn(|r| rows.get(r).map_or(0.0, |row| row.scales[b][1])))
            .collect();
        let codes = std::array::from_fn(|r| rows.get(r).map_or(std::ptr::null(), |x| x.q.as_ptr()));
        let scales = std::array::from_fn(|r| {
            pair_scales
                .get(r * pairs..)
                .map_or(std::ptr::null(), |s| s.as_ptr().cast())
        });
        Self {
            rows,
            _pair_scales: pair_scales,
            sums,
            codes,
            scales,
        }
    }

    fn blocks(&self) -> usize {
        self.sums.len()
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

/// Whether [`weight_row`] runs `format` on `isa`: AVX-512 VNNI, Q4_1 and Q8_0.
pub(super) fn runs(isa: Supported, format: Format) -> bool {
    isa.isa() == Isa::Avx512Vnni && matches!(format, Format::Q4_1 | Format::Q8_0)
}

/// `out[r] = sum over blocks of row `w` (`format`) times `panel`'s row `r`.
///
/// Panics unless [`runs`] holds, `out` has one place per row, and `w` is one row of
/// `panel`'s length.
pub(super) fn weight_row(isa: Supported, format: Format, panel: &Panel, w: &[u8], out: &mut [f32]) {
    assert!(
        runs(isa, format),
        "no panel kernel for {format:?} on {}",
        isa.isa()
    );
    assert_eq!(out.len(), panel.rows.len(), "one result per panel row");
    assert_eq!(
        w.len(),
        panel.blocks() * format.block_bytes(),
        "block row and panel differ in length"
    );
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! dispatch {
            ($($n:literal)*) => {
                match (out.len(), format) {
                    // SAFETY (all): `runs` checked that the CPU has AVX-512 VNNI (with BW,
                    // VL, F, AVX2, FMA, F16C: `Isa::Avx512Vnni::supported`), and the
                    // lengths were checked above.
                    $(
                        ($n, Format::Q4_1) => out.copy_from_slice(&unsafe { x86::q4_1::<$n>(panel, w) }),
                        ($n, Format::Q8_0) => out.copy_from_slice(&unsafe { x86::q8_0::<$n>(panel, w) }),
                    )*
                    _ => unreachable!("checked above"),
                }
            };
        }
        dispatch!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no panel kernel off x86-64");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::blocks::QK;
    use super::super::dot::x86::{
        dot_vnni, halves, hsum, join_ps, q4_1_nibbles as nibbles, q8_0_pair,
    };
    use super::super::PREFETCH_BYTES as PREFETCH;
    use super::Panel;

    /// Q4_1 row `w` against the panel's `N` rows.
    #[target_feature(enable = "avx512vnni,avx512bw,avx512vl,avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn q4_1<const N: usize>(panel: &Panel, w: &[u8]) -> [f32; N] {
        // (d, m) of a block as f32 lanes 0 and 1.
        let dm =
            |blk: *const u8| _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
        let nb = panel.blocks();
        let pairs = nb / 2;
        let (qs, dxs) = panel.pointers::<N>();
        let mut acc = [_mm512_setzero_ps(); N];
        // Lane r: row r's `sum m_w * d_x * sum(q_x)`, block after block.
        let mut offsets = _mm512_setzero_ps();
        for p in 0..pairs {
            let b = 2 * p;
            let (b0, b1) = (w.as_ptr().add(b * 20), w.as_ptr().add((b + 1) * 20));
            _mm_prefetch::<_MM_HINT_T0>(b0.wrapping_add(PREFETCH) as *const i8);
            let wv = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles(b0)), nibbles(b1), 1);
            let (dm0, dm1) = (dm(b0), dm(b1));
            let d = join_ps(_mm256_broadcastss_ps(dm0), _mm256_broadcastss_ps(dm1));
            for (i, dm) in [(b, dm0), (b + 1, dm1)] {
                let m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
                let sums = _mm512_loadu_ps(panel.sums[i].as_ptr());
                offsets = _mm512_add_ps(offsets, _mm512_mul_ps(m, sums));
            }
            for r in 0..N {
                let xv = _mm512_loadu_si512(qs[r].add(b * QK) as *const __m512i);
                let dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv));
                let dx = _mm512_loadu_ps(dxs[r].add(16 * p));
                acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, dx), acc[r]);
            }
        }
        let tail = (nb % 2 == 1).then(|| {
            let b = nb - 1;
            let blk = w.as_ptr().add(b * 20);
            let dm = dm(blk);
            let m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
            let sums = _mm512_loadu_ps(panel.sums[b].as_ptr());
            (b, blk, _mm_cvtss_f32(dm), _mm512_mul_ps(m, sums))
        });
        if let Some((_, _, _, m_sums)) = tail {
            offsets = _mm512_add_ps(offsets, m_sums);
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), offsets);
        std::array::from_fn(|r| {
            let (mut even, odd) = halves(acc[r]);
            if let Some((b, blk, d, _)) = tail {
                let xv = _mm256_loadu_si256(panel.rows[r].q.as_ptr().add(b * QK) as *const __m256i);
                let dot = _mm256_cvtepi32_ps(dot_vnni(nibbles(blk), xv));
                let scale = _mm256_set1_ps(d * panel.rows[r].scales[b][0]);
                even = _mm256_fmadd_ps(dot, scale, even);
            }
            hsum(_mm256_add_ps(even, odd)) + lanes[r]
        })
    }

    /// Q8_0 row `w` against the panel's `N` rows: each weight's sign moved onto the
    /// activation under a mask, as in the one-row kernel.
    #[target_feature(enable = "avx512vnni,avx512bw,avx512vl,avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn q8_0<const N: usize>(panel: &Panel, w: &[u8]) -> [f32; N] {
        let d = |blk: *const u8| {
            let bits = (blk as *const u16).read_unaligned() as i32;
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
        };
        let codes = |blk: *const u8| _mm256_loadu_si256(blk.add(2) as *const __m256i);
        let nb = panel.blocks();
        let pairs = nb / 2;
        let (qs, dxs) = panel.pointers::<N>();
        let mut acc = [_mm512_setzero_ps(); N];
        for p in 0..pairs {
            let b = 2 * p;
            let (b0, b1) = (w.as_ptr().add(b * 34), w.as_ptr().add((b + 1) * 34));
            _mm_prefetch::<_MM_HINT_T0>(b0.wrapping_add(PREFETCH) as *const i8);
            let (wabs, negative) = q8_0_pair(b0, b1);
            let dw = join_ps(_mm256_set1_ps(d(b0)), _mm256_set1_ps(d(b1)));
            for r in 0..N {
                let xv = _mm512_loadu_si512(qs[r].add(b * QK) as *const __m512i);
                let signed = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
                let dot =
                    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, signed));
                let dx = _mm512_loadu_ps(dxs[r].add(16 * p));
                acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, dx), acc[r]);
            }
        }
        std::array::from_fn(|r| {
            let (mut even, odd) = halves(acc[r]);
            if nb % 2 == 1 {
                let b = nb - 1;
                let blk = w.as_ptr().add(b * 34);
                let wv = codes(blk);
                let xv = _mm256_loadu_si256(panel.rows[r].q.as_ptr().add(b * QK) as *const __m256i);
                let dot =
                    _mm256_cvtepi32_ps(dot_vnni(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)));
                let scale = _mm256_set1_ps(d(blk) * panel.rows[r].scales[b][0]);
                even = _mm256_fmadd_ps(dot, scale, even);
            }
            hsum(_mm256_add_ps(even, odd))
        })
    }
}
