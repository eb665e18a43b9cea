//! Weights interleaved [`GROUP`] rows to a group, so that one 32-bit lane of a vector
//! holds one weight row: the kernels broadcast four activation bytes to every
//! lane, complete each row's integer sum over a block, and then spend one conversion and
//! one or two fused multiply-adds on it. One row, a decode step, and a batch of activation
//! rows run the same kernel; the weights of a group are unpacked once per block for all
//! the activation rows of a pass.
//!
//! **Layout.** Rows are padded with zero blocks to a multiple of [`GROUP`]. Group `g`'s
//! block `b` takes `GROUP * block_bytes` bytes at `(g * blocks + b) * that`: the sixteen
//! rows' `d` (f16), for Q4_1 their `m` (f16), for Q5_0 the low and then the high halves of
//! their fifth-bit words (u16 each: bits of the elements `0..16`, then `16..32`), then
//! runs of 64 code bytes, run `k` holding in bytes `4l..4l + 4` row `l`'s code bytes
//! `4k..4k + 4`. Q4_1 and Q5_0 have four runs: the low nibbles of run `k` are the block's
//! elements `4k..4k + 4`, the high nibbles the elements `16 + 4k..16 + 4k + 4`. Q8_0 has
//! eight, each code stored plus 128 (`q ^ 0x80`), so that it is the unsigned operand of
//! `vpdpbusd`; `128 * sum(q_x)` is subtracted from the block's sum afterwards (AVX2
//! restores the sign instead: `vpmaddubsw` would saturate on unsigned codes up to 255).
//! Q5_0's codes enter the products unsigned too, as `q` in `0..32` (its nibble and its
//! fifth bit, joined in registers: on AVX-512 each lane's four bits of a run looked up in
//! a sixteen-entry table with `vpermd`, on the 256-bit sets the byte holding them spread
//! over the lane's four bytes with `vpshufb` and compared bit by bit), and
//! `16 * sum(q_x)` is subtracted. The same bytes as the file's blocks, reordered.
//!
//! **The floats.** Row `r` against activation row `x`, from `acc = 0`, block after
//! block, with `s = sum_j q_rj q_xj` (exact in any order: at most `32 * 128 * 127 < 2^24`,
//! so its conversion is exact too): Q4_1 `acc = fma(d_r * d_x, float(s), acc)`, then
//! `acc = fma(m_r, d_x * sum_j q_xj, acc)`; Q8_0 and Q5_0 (`s` over its signed values
//! `q - 16`) the first of the two. AVX-512 VNNI
//! (sixteen rows per register), AVX-VNNI and AVX2 (eight) and the portable loop all compute
//! exactly that, so a result depends neither on the instruction set nor on the other
//! activation rows computed with it.

use half::f16;

use super::blocks::{Activations, Format, QK};
use super::isa::{Isa, Supported};

/// Weight rows per group: one per 32-bit lane of a 512-bit register.
pub(super) const GROUP: usize = 16;

/// Activation rows per pass over a group on AVX-512 (their accumulators and integer sums
/// stay in the 32 registers).
const PASS_512: usize = 8;

/// The same on AVX2 and AVX-VNNI (16 registers).
const PASS_256: usize = 4;

/// Bytes of one block of a group: [`GROUP`] file blocks.
fn chunk_bytes(format: Format) -> usize {
    GROUP * format.block_bytes()
}

/// Where a chunk's runs of codes begin (after the scales), and how many runs it has.
fn runs(format: Format) -> (usize, usize) {
    match format {
        Format::Q4_1 => (4 * GROUP, 4),
        Format::Q5_0 => (6 * GROUP, 4),
        Format::Q8_0 => (2 * GROUP, 8),
    }
}

/// Where a file block's code bytes begin, and what a stored code byte is XORed with.
fn file_codes(format: Format) -> (usize, u8) {
    match format {
        Format::Q4_1 => (4, 0),
        Format::Q5_0 => (6, 0),
        Format::Q8_0 => (2, 0x80),
    }
}

/// Row-major `blocks` of `format` of a `(rows, cols)` matrix, interleaved
/// in place: a group's rows occupy the same bytes before and after, so only one group is
/// copied aside at a time (no second copy of the matrix, even while loading).
///
/// Panics if `blocks` is not `rows * cols / QK` blocks.
pub(super) fn interleave(format: Format, mut blocks: Vec<u8>, rows: usize, cols: usize) -> Vec<u8> {
    let (nb, bb, cb) = (cols / QK, format.block_bytes(), chunk_bytes(format));
    assert_eq!(blocks.len(), rows * nb * bb, "blocks do not fit the shape");
    let ((codes, n_runs), (src_codes, flip)) = (runs(format), file_codes(format));
    let scales = src_codes / 2;
    blocks.resize(rows.div_ceil(GROUP) * nb * cb, 0);
    let mut rows_aside = vec![0u8; nb * cb];
    for group in blocks.chunks_exact_mut(nb * cb) {
        rows_aside.copy_from_slice(group);
        for (l, row) in rows_aside.chunks_exact(nb * bb).enumerate() {
            for (b, src) in row.chunks_exact(bb).enumerate() {
                let chunk = &mut group[b * cb..][..cb];
                for s in 0..scales {
                    chunk[2 * GROUP * s + 2 * l..][..2].copy_from_slice(&src[2 * s..2 * s + 2]);
                }
                for k in 0..n_runs {
                    for j in 0..4 {
                        chunk[codes + 64 * k + 4 * l + j] = src[src_codes + 4 * k + j] ^ flip;
                    }
                }
            }
        }
    }
    blocks
}

/// Block `b` of row `r` in the file's layout, from interleaved `data` of `format` with
/// `nb` blocks per row, into `out` (`format.block_bytes()` bytes).
pub(super) fn file_block(
    format: Format,
    data: &[u8],
    nb: usize,
    r: usize,
    b: usize,
    out: &mut [u8],
) {
    let cb = chunk_bytes(format);
    let ((codes, n_runs), (dst_codes, flip)) = (runs(format), file_codes(format));
    let (g, l) = (r / GROUP, r % GROUP);
    let chunk = &data[(g * nb + b) * cb..][..cb];
    for s in 0..dst_codes / 2 {
        out[2 * s..2 * s + 2].copy_from_slice(&chunk[2 * GROUP * s + 2 * l..][..2]);
    }
    for k in 0..n_runs {
        for j in 0..4 {
            out[dst_codes + 4 * k + j] = chunk[codes + 64 * k + 4 * l + j] ^ flip;
        }
    }
}

/// Block `b` of row `r` of interleaved `data` (`format`, `nb` blocks per row) as its
/// [`QK`] values, with the arithmetic of ggml's `dequantize_row_*` (`q * d + m`,
/// `(q - 16) * d`, `q * d`), read in place.
pub(super) fn dequantize_block(
    format: Format,
    data: &[u8],
    nb: usize,
    r: usize,
    b: usize,
    out: &mut [f32],
) {
    let (codes, n_runs) = runs(format);
    let cb = chunk_bytes(format);
    let (g, l) = (r / GROUP, r % GROUP);
    let chunk = &data[(g * nb + b) * cb..][..cb];
    let half = |at: usize| f16::from_le_bytes([chunk[at], chunk[at + 1]]).to_f32();
    let d = half(2 * l);
    let at = |k: usize| &chunk[codes + 64 * k + 4 * l..][..4];
    match format {
        Format::Q4_1 => {
            let m = half(2 * GROUP + 2 * l);
            let (lo, hi) = out[..QK].split_at_mut(QK / 2);
            for k in 0..n_runs {
                for (j, &byte) in at(k).iter().enumerate() {
                    lo[4 * k + j] = (byte & 0x0F) as f32 * d + m;
                    hi[4 * k + j] = (byte >> 4) as f32 * d + m;
                }
            }
        }
        Format::Q5_0 => {
            let fifth = q5_0_fifth_bits(chunk, l);
            let (lo, hi) = out[..QK].split_at_mut(QK / 2);
            for k in 0..n_runs {
                for (j, &byte) in at(k).iter().enumerate() {
                    let [a, b] = q5_0_pair(byte, fifth, 4 * k + j);
                    lo[4 * k + j] = (a - 16) as f32 * d;
                    hi[4 * k + j] = (b - 16) as f32 * d;
                }
            }
        }
        Format::Q8_0 => {
            for k in 0..n_runs {
                for (j, &byte) in at(k).iter().enumerate() {
                    out[4 * k + j] = (byte ^ 0x80) as i8 as f32 * d;
                }
            }
        }
    }
}

/// Row `l`'s fifth-bit words in a Q5_0 chunk: bit `e` of the first is element `e`'s, of
/// the second element `16 + e`'s.
fn q5_0_fifth_bits(chunk: &[u8], l: usize) -> [u32; 2] {
    let word = |at: usize| u16::from_le_bytes([chunk[at], chunk[at + 1]]) as u32;
    [word(2 * GROUP + 2 * l), word(4 * GROUP + 2 * l)]
}

/// The codes `q` (in `0..32`) of elements `e` and `16 + e` of a Q5_0 row, from their code
/// byte (the low nibble `e`'s, the high one `16 + e`'s) and the row's fifth-bit words.
fn q5_0_pair(byte: u8, [low, high]: [u32; 2], e: usize) -> [i32; 2] {
    [
        (byte & 0x0F) as i32 | (((low >> e) & 1) << 4) as i32,
        (byte >> 4) as i32 | (((high >> e) & 1) << 4) as i32,
    ]
}

/// `out[i][l]` = weight row `group * GROUP + l` of interleaved `data` (`format`, `nb`
/// blocks per row) times `xs[i]`; padding rows give 0.
///
/// Panics if `out` and `xs` differ in length, an activation row is not `nb` blocks, or
/// `data` has no group `group`.
pub(super) fn group_product(
    isa: Supported,
    format: Format,
    data: &[u8],
    nb: usize,
    group: usize,
    xs: &[&Activations],
    out: &mut [[f32; GROUP]],
) {
    assert_eq!(out.len(), xs.len(), "one result per activation row");
    assert!(
        xs.iter().all(|x| x.blocks() == nb && x.q.len() == nb * QK),
        "activation rows and weight rows differ in length"
    );
    let cb = chunk_bytes(format);
    let w = &data[group * nb * cb..][..nb * cb];
    #[cfg(target_arch = "x86_64")]
    {
        let pass = match isa.isa() {
            Isa::Portable => 1,
            Isa::Avx512Vnni => PASS_512,
            Isa::Avx2 | Isa::AvxVnni => PASS_256,
        };
        for (xs, out) in xs.chunks(pass).zip(out.chunks_mut(pass)) {
            macro_rules! dispatch {
                ($($n:literal)*) => {
                    match (isa.isa(), format, xs.len()) {
                        (Isa::Portable, _, _) => out[0] = portable(format, w, nb, xs[0]),
                        // SAFETY (all): `Supported` checked that the CPU has the features
                        // each function enables (every `Isa` past `Portable` includes AVX2,
                        // FMA and F16C), and the lengths were checked above.
                        $(
                            (Isa::Avx512Vnni, Format::Q4_1, $n) => out.copy_from_slice(&unsafe {
                                x86::q4_1_512::<$n>(w.as_ptr(), nb, std::array::from_fn(|i| xs[i]))
                            }),
                            (Isa::Avx512Vnni, Format::Q5_0, $n) => out.copy_from_slice(&unsafe {
                                x86::q5_0_512::<$n>(w.as_ptr(), nb, std::array::from_fn(|i| xs[i]))
                            }),
                            (Isa::Avx512Vnni, Format::Q8_0, $n) => out.copy_from_slice(&unsafe {
                                x86::q8_0_512::<$n>(w.as_ptr(), nb, std::array::from_fn(|i| xs[i]))
                            }),
                        )*
                        (Isa::AvxVnni, Format::Q4_1, n) => pass_256!(n, q4_1_avxvnni),
                        (Isa::AvxVnni, Format::Q5_0, n) => pass_256!(n, q5_0_avxvnni),
                        (Isa::AvxVnni, Format::Q8_0, n) => pass_256!(n, q8_0_avxvnni),
                        (Isa::Avx2, Format::Q4_1, n) => pass_256!(n, q4_1_avx2),
                        (Isa::Avx2, Format::Q5_0, n) => pass_256!(n, q5_0_avx2),
                        (Isa::Avx2, Format::Q8_0, n) => pass_256!(n, q8_0_avx2),
                        _ => unreachable!("passes hold 1 to {PASS_512} rows"),
                    }
                };
            }
            macro_rules! pass_256 {
                ($n:expr, $kernel:ident) => {
                    match $n {
                        // SAFETY: as above.
                        1 => out.copy_from_slice(&unsafe {
                            x86::$kernel::<1>(w.as_ptr(), nb, [xs[0]])
                        }),
                        2 => out.copy_from_slice(&unsafe {
                            x86::$kernel::<2>(w.as_ptr(), nb, [xs[0], xs[1]])
                        }),
                        3 => out.copy_from_slice(&unsafe {
                            x86::$kernel::<3>(w.as_ptr(), nb, [xs[0], xs[1], xs[2]])
                        }),
                        _ => out.copy_from_slice(&unsafe {
                            x86::$kernel::<4>(w.as_ptr(), nb, [xs[0], xs[1], xs[2], xs[3]])
                        }),
                    }
                };
            }
            dispatch!(1 2 3 4 5 6 7 8);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        for (x, o) in xs.iter().zip(out) {
            *o = portable(format, w, nb, x);
        }
    }
}

/// The portable loop: one group's blocks `w` against `x`, in the kernels' order.
fn portable(format: Format, w: &[u8], nb: usize, x: &Activations) -> [f32; GROUP] {
    let (codes, _) = runs(format);
    let mut acc = [0f32; GROUP];
    for (b, chunk) in w.chunks_exact(chunk_bytes(format)).take(nb).enumerate() {
        let xq = &x.q[b * QK..(b + 1) * QK];
        let [dx, dx_sum] = x.scales[b];
        for (l, a) in acc.iter_mut().enumerate() {
            let half = |at: usize| f16::from_le_bytes([chunk[at], chunk[at + 1]]).to_f32();
            let code = |k: usize, j: usize| chunk[codes + 64 * k + 4 * l + j];
            let mut sum = 0i32;
            match format {
                Format::Q4_1 => {
                    for k in 0..4 {
                        for j in 0..4 {
                            let byte = code(k, j);
                            sum += (byte & 0x0F) as i32 * xq[4 * k + j] as i32
                                + (byte >> 4) as i32 * xq[16 + 4 * k + j] as i32;
                        }
                    }
                }
                Format::Q5_0 => {
                    let fifth = q5_0_fifth_bits(chunk, l);
                    for k in 0..4 {
                        for j in 0..4 {
                            let e = 4 * k + j;
                            let [a, b] = q5_0_pair(code(k, j), fifth, e);
                            sum += (a - 16) * xq[e] as i32 + (b - 16) * xq[16 + e] as i32;
                        }
                    }
                }
                Format::Q8_0 => {
                    for k in 0..8 {
                        for j in 0..4 {
                            sum += (code(k, j) ^ 0x80) as i8 as i32 * xq[4 * k + j] as i32;
                        }
                    }
                }
            }
            *a = (half(2 * l) * dx).mul_add(sum as f32, *a);
            if format == Format::Q4_1 {
                *a = half(2 * GROUP + 2 * l).mul_add(dx_sum, *a);
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::blocks::{Activations, QK};
    use super::super::PREFETCH_BYTES as PREFETCH;
    use super::GROUP;

    /// Bytes of a Q4_1 chunk, and where its codes begin.
    const Q4_1: (usize, usize) = (GROUP * 20, 4 * GROUP);

    /// Bytes of a Q5_0 chunk, and where its codes begin.
    const Q5_0: (usize, usize) = (GROUP * 22, 6 * GROUP);

    /// Bytes of a Q8_0 chunk, and where its codes begin.
    const Q8_0: (usize, usize) = (GROUP * 34, 2 * GROUP);

    /// The activation's four code bytes at `q` in every 32-bit lane (a broadcast load).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn four_512(q: *const i8) -> __m512i {
        _mm512_broadcastd_epi32(_mm_loadu_si32(q as *const u8))
    }

    /// The same in eight lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn four_256(q: *const i8) -> __m256i {
        _mm256_broadcastd_epi32(_mm_loadu_si32(q as *const u8))
    }

    /// Prefetch the chunk `PREFETCH` bytes ahead of `at`, `bytes` long, every 64-byte
    /// line of it (one line in four sufficed on the Xeon, whose hardware prefetchers
    /// fetch the neighbours, but not on the AMD EPYC: results README, "On the AMD EPYC
    /// after the interleaved kernels").
    #[inline(always)]
    unsafe fn prefetch(at: *const u8, bytes: usize) {
        for line in (0..bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH + line) as *const i8);
        }
    }

    /// A kernel: one group (`w`, `nb` blocks) against `R` activation rows `$x`, `$lanes`
    /// weight rows per register of type `$f32s` (`$zero`, `$store`), the group's
    /// `GROUP / $lanes` parts in turn (`$part`). Per block `$b` at `$chunk` (its codes from
    /// byte `$codes`), `$sum` leaves every row's integer sums in `$sums` (from `$izero`) and
    /// `$tail` folds them into the accumulators `$acc`.
    macro_rules! kernel {
        (
            $name:ident, $features:literal, $layout:expr, $lanes:literal,
            ($f32s:ty, $zero:ident, $izero:ident, $store:ident),
            |$x:ident, $part:ident, $b:ident, $chunk:ident, $codes:ident, $sums:ident, $acc:ident|
            $sum:block $tail:block
        ) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<const R: usize>(
                w: *const u8,
                nb: usize,
                $x: [&Activations; R],
            ) -> [[f32; GROUP]; R] {
                let (bytes, $codes) = $layout;
                let mut out = [[0f32; GROUP]; R];
                for $part in 0..GROUP / $lanes {
                    let mut $acc: [$f32s; R] = [$zero(); R];
                    for $b in 0..nb {
                        let $chunk = w.add($b * bytes);
                        if $part == 0 {
                            prefetch($chunk, bytes);
                        }
                        let mut $sums = [$izero(); R];
                        $sum
                        $tail
                    }
                    for r in 0..R {
                        $store(out[r].as_mut_ptr().add($lanes * $part), $acc[r]);
                    }
                }
                out
            }
        };
    }

    kernel!(
        q4_1_512, "avx512vnni,avx512bw,avx512f,avx2,fma,f16c", Q4_1, 16,
        (__m512, _mm512_setzero_ps, _mm512_setzero_si512, _mm512_storeu_ps),
        |x, _part, b, chunk, codes, sums, acc| {
            let low = _mm512_set1_epi8(0x0F);
            for k in 0..4 {
                let run = _mm512_loadu_si512(chunk.add(codes + 64 * k) as *const __m512i);
                let lo = _mm512_and_si512(run, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(run), low);
                for r in 0..R {
                    let q = x[r].q.as_ptr().add(b * QK);
                    sums[r] = _mm512_dpbusd_epi32(sums[r], lo, four_512(q.add(4 * k)));
                    sums[r] = _mm512_dpbusd_epi32(sums[r], hi, four_512(q.add(16 + 4 * k)));
                }
            }
        }
        {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(chunk as *const __m256i));
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(chunk.add(2 * GROUP) as *const __m256i));
            for r in 0..R {
                let [dx, dx_sum] = x[r].scales[b];
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(dx));
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums[r]), acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx_sum), acc[r]);
            }
        }
    );

    /// Bytes `j` of entry `v`: `0x10` where bit `j` of `v` is set (`j` in `0..4`).
    const FIFTH: [i32; 16] = {
        let mut table = [0i32; 16];
        let mut v = 0;
        while v < 16 {
            let mut j = 0;
            while j < 4 {
                table[v] |= (((v >> j) & 1) as i32) << (8 * j + 4);
                j += 1;
            }
            v += 1;
        }
        table
    };

    /// Q5_0's fifth bits of run `k` in place: bits `4k..4k + 4` of each lane of `words`
    /// as `0x10` in the lane's four bytes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fifth_512(words: __m512i, k: usize) -> __m512i {
        let shifted = _mm512_srl_epi32(words, _mm_cvtsi32_si128(4 * k as i32));
        let nibble = _mm512_and_si512(shifted, _mm512_set1_epi32(0x0F));
        _mm512_permutexvar_epi32(nibble, _mm512_loadu_si512(FIFTH.as_ptr() as *const __m512i))
    }

    /// The same in eight lanes: byte `k / 2` of each lane spread to its four bytes, then
    /// one bit kept per byte.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn fifth_256(words: __m256i, k: usize) -> __m256i {
        let (l1, l2, l3) = (0x0404_0404, 0x0808_0808, 0x0C0C_0C0C);
        let lane = _mm256_setr_epi32(0, l1, l2, l3, 0, l1, l2, l3);
        let pick = _mm256_add_epi8(lane, _mm256_set1_epi8((k / 2) as i8));
        let select = _mm256_set1_epi32((0x0804_0201u32 << (4 * (k % 2))) as i32);
        let bits = _mm256_and_si256(_mm256_shuffle_epi8(words, pick), select);
        _mm256_and_si256(_mm256_cmpeq_epi8(bits, select), _mm256_set1_epi8(0x10))
    }

    kernel!(
        q5_0_512, "avx512vnni,avx512bw,avx512f,avx2,fma,f16c", Q5_0, 16,
        (__m512, _mm512_setzero_ps, _mm512_setzero_si512, _mm512_storeu_ps),
        |x, _part, b, chunk, codes, sums, acc| {
            let low = _mm512_set1_epi8(0x0F);
            let words = |at: usize| _mm512_cvtepu16_epi32(_mm256_loadu_si256(chunk.add(at) as *const __m256i));
            let (fifth_lo, fifth_hi) = (words(2 * GROUP), words(4 * GROUP));
            for k in 0..4 {
                let run = _mm512_loadu_si512(chunk.add(codes + 64 * k) as *const __m512i);
                let lo = _mm512_or_si512(_mm512_and_si512(run, low), fifth_512(fifth_lo, k));
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(run), low);
                let hi = _mm512_or_si512(hi, fifth_512(fifth_hi, k));
                for r in 0..R {
                    let q = x[r].q.as_ptr().add(b * QK);
                    sums[r] = _mm512_dpbusd_epi32(sums[r], lo, four_512(q.add(4 * k)));
                    sums[r] = _mm512_dpbusd_epi32(sums[r], hi, four_512(q.add(16 + 4 * k)));
                }
            }
        }
        {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(chunk as *const __m256i));
            for r in 0..R {
                let s = _mm512_sub_epi32(sums[r], _mm512_set1_epi32(x[r].excess[b] >> 3));
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(x[r].scales[b][0]));
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), acc[r]);
            }
        }
    );

    kernel!(
        q8_0_512, "avx512vnni,avx512bw,avx512f,avx2,fma,f16c", Q8_0, 16,
        (__m512, _mm512_setzero_ps, _mm512_setzero_si512, _mm512_storeu_ps),
        |x, _part, b, chunk, codes, sums, acc| {
            for k in 0..8 {
                let run = _mm512_loadu_si512(chunk.add(codes + 64 * k) as *const __m512i);
                for r in 0..R {
                    let q = x[r].q.as_ptr().add(b * QK);
                    sums[r] = _mm512_dpbusd_epi32(sums[r], run, four_512(q.add(4 * k)));
                }
            }
        }
        {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(chunk as *const __m256i));
            for r in 0..R {
                let s = _mm512_sub_epi32(sums[r], _mm512_set1_epi32(x[r].excess[b]));
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(x[r].scales[b][0]));
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), acc[r]);
            }
        }
    );

    /// `acc` plus the sums of four adjacent products of unsigned `u` and signed `s` bytes,
    /// per i32 lane (AVX2: pair sums in i16, which `2 * 128 * 127` cannot saturate).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn add_dot_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(u, s);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    /// AVX2's Q4_1 and Q5_0 step: the pair sums of unsigned `u` (codes below 16 or 32)
    /// and signed `s` bytes added to `acc`'s i16 lanes. A Q4_1 block adds eight pair sums
    /// to each lane, each within `2 * 15 * 127`, so a lane stays within `30_480` and never
    /// wraps; a Q5_0 half block four, each within `2 * 31 * 127`: within `31_496`. The
    /// lanes widen once per block or half block ([`widen_avx2`]), not once per step as
    /// [`add_dot_avx2`] does.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn add_pairs_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s))
    }

    /// The i32 sums of adjacent i16 lanes: a Q4_1 block's, or a Q5_0 half block's, sums
    /// after [`add_pairs_avx2`].
    #[inline]
    #[target_feature(enable = "avx2")]
    fn widen_avx2(acc: __m256i) -> __m256i {
        _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
    }

    /// AVX-VNNI's sums are i32 already.
    #[inline]
    fn widen_avxvnni(acc: __m256i) -> __m256i {
        acc
    }

    /// The same with one VEX-encoded `vpdpbusd` (AVX-VNNI).
    #[inline]
    #[target_feature(enable = "avxvnni")]
    fn add_dot_avxvnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, u, s)
    }

    /// AVX2's Q8_0 step: the stored codes (plus 128) back to signed, their absolute values
    /// times the activation with their signs (no pair sum above `2 * 128 * 127`), so no
    /// excess to subtract.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn add_q8_0_avx2(acc: __m256i, stored: __m256i, x: __m256i) -> __m256i {
        let w = _mm256_xor_si256(stored, _mm256_set1_epi8(0x80u8 as i8));
        add_dot_avx2(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
    }

    /// AVX-VNNI's Q8_0 step: `vpdpbusd` on the stored codes; the excess is subtracted
    /// after the block.
    #[inline]
    #[target_feature(enable = "avxvnni")]
    fn add_q8_0_avxvnni(acc: __m256i, stored: __m256i, x: __m256i) -> __m256i {
        add_dot_avxvnni(acc, stored, x)
    }

    /// The 256-bit kernels of one instruction set, eight weight rows per register (the
    /// group's two halves in turn): Q4_1 and Q5_0 given the set's accumulating step
    /// `$add_dot` and `$widen`, which turns accumulated lanes into i32 sums, Q8_0 given
    /// its Q8_0 step `$add_q8_0` and whether that step leaves the excess to subtract.
    macro_rules! narrow {
        (
            $q4_1:ident, $q5_0:ident, $q8_0:ident, $features:literal,
            $add_dot:ident, $widen:ident, $add_q8_0:ident, $excess:literal
        ) => {
            kernel!(
                $q4_1, $features, Q4_1, 8,
                (__m256, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_storeu_ps),
                |x, half, b, chunk, codes, sums, acc| {
                    let low = _mm256_set1_epi8(0x0F);
                    for k in 0..4 {
                        let at = chunk.add(codes + 64 * k + 32 * half);
                        let run = _mm256_loadu_si256(at as *const __m256i);
                        let lo = _mm256_and_si256(run, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(run), low);
                        for r in 0..R {
                            let q = x[r].q.as_ptr().add(b * QK);
                            let xl = four_256(q.add(4 * k));
                            let xh = four_256(q.add(16 + 4 * k));
                            sums[r] = $add_dot($add_dot(sums[r], lo, xl), hi, xh);
                        }
                    }
                }
                {
                    let at = |offset: usize| chunk.add(offset + 16 * half) as *const __m128i;
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(at(0)));
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(at(2 * GROUP)));
                    for r in 0..R {
                        let [dx, dx_sum] = x[r].scales[b];
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(dx));
                        let sum = _mm256_cvtepi32_ps($widen(sums[r]));
                        acc[r] = _mm256_fmadd_ps(scale, sum, acc[r]);
                        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx_sum), acc[r]);
                    }
                }
            );

            kernel!(
                $q5_0, $features, Q5_0, 8,
                (__m256, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_storeu_ps),
                |x, half, b, chunk, codes, sums, acc| {
                    let low = _mm256_set1_epi8(0x0F);
                    let words = |at: usize| {
                        let at = chunk.add(at + 16 * half) as *const __m128i;
                        _mm256_cvtepu16_epi32(_mm_loadu_si128(at))
                    };
                    let (fifth_lo, fifth_hi) = (words(2 * GROUP), words(4 * GROUP));
                    // Two runs at a time, widened after each pair (AVX2's i16 lanes).
                    for pair in 0..2 {
                        let mut part = [_mm256_setzero_si256(); R];
                        for k in 2 * pair..2 * pair + 2 {
                            let at = chunk.add(codes + 64 * k + 32 * half);
                            let run = _mm256_loadu_si256(at as *const __m256i);
                            let lo = _mm256_and_si256(run, low);
                            let lo = _mm256_or_si256(lo, fifth_256(fifth_lo, k));
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(run), low);
                            let hi = _mm256_or_si256(hi, fifth_256(fifth_hi, k));
                            for r in 0..R {
                                let q = x[r].q.as_ptr().add(b * QK);
                                let xl = four_256(q.add(4 * k));
                                let xh = four_256(q.add(16 + 4 * k));
                                part[r] = $add_dot($add_dot(part[r], lo, xl), hi, xh);
                            }
                        }
                        for r in 0..R {
                            sums[r] = _mm256_add_epi32(sums[r], $widen(part[r]));
                        }
                    }
                }
                {
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(chunk.add(16 * half) as *const __m128i));
                    for r in 0..R {
                        let s = _mm256_sub_epi32(sums[r], _mm256_set1_epi32(x[r].excess[b] >> 3));
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(x[r].scales[b][0]));
                        acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc[r]);
                    }
                }
            );

            kernel!(
                $q8_0, $features, Q8_0, 8,
                (__m256, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_storeu_ps),
                |x, half, b, chunk, codes, sums, acc| {
                    for k in 0..8 {
                        let at = chunk.add(codes + 64 * k + 32 * half);
                        let run = _mm256_loadu_si256(at as *const __m256i);
                        for r in 0..R {
                            let q = x[r].q.as_ptr().add(b * QK);
                            sums[r] = $add_q8_0(sums[r], run, four_256(q.add(4 * k)));
                        }
                    }
                }
                {
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(chunk.add(16 * half) as *const __m128i));
                    for r in 0..R {
                        let s = if $excess {
                            _mm256_sub_epi32(sums[r], _mm256_set1_epi32(x[r].excess[b]))
                        } else {
                            sums[r]
                        };
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(x[r].scales[b][0]));
                        acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc[r]);
                    }
                }
            );
        };
    }

    narrow!(
        q4_1_avx2,
        q5_0_avx2,
        q8_0_avx2,
        "avx2,fma,f16c",
        add_pairs_avx2,
        widen_avx2,
        add_q8_0_avx2,
        false
    );
    narrow!(
        q4_1_avxvnni,
        q5_0_avxvnni,
        q8_0_avxvnni,
        "avxvnni,avx2,fma,f16c",
        add_dot_avxvnni,
        widen_avxvnni,
        add_q8_0_avxvnni,
        true
    );
}

#[cfg(test)]
mod tests {
    use super::super::blocks::q5_0_codes;
    use super::*;

    /// Random blocks of `format`: every code byte (and fifth bit), scales of both signs.
    fn random_blocks(format: Format, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let scales = if format == Format::Q4_1 { 2 } else { 1 };
        let mut out = Vec::new();
        for _ in 0..rows * cols / QK {
            for _ in 0..scales {
                let v = (next() % 2001) as f32 / 1000.0 - 1.0;
                out.extend(f16::from_f32(v).to_le_bytes());
            }
            out.extend((0..format.block_bytes() - 2 * scales).map(|_| next() as u8));
        }
        out
    }

    #[test]
    fn interleaving_keeps_every_block_and_pads_with_zeros() {
        for format in Format::ALL {
            let (rows, cols, bb) = (21, 96, format.block_bytes());
            let blocks = random_blocks(format, rows, cols, 3);
            let data = interleave(format, blocks.clone(), rows, cols);
            assert_eq!(data.len(), 2 * 3 * chunk_bytes(format));
            let mut got = vec![0u8; bb];
            for r in 0..32 {
                for b in 0..3 {
                    file_block(format, &data, 3, r, b, &mut got);
                    if r < rows {
                        assert_eq!(
                            got,
                            blocks[(r * 3 + b) * bb..][..bb],
                            "{format:?} row {r} block {b}"
                        );
                    } else {
                        // Padding: zero scales (and, for Q8_0, zero codes).
                        assert!(got[..2].iter().all(|&v| v == 0), "{format:?} row {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn blocks_dequantize_in_place_as_the_file_blocks_do() {
        for format in Format::ALL {
            let (rows, cols, bb) = (21, 96, format.block_bytes());
            let blocks = random_blocks(format, rows, cols, 5);
            let data = interleave(format, blocks.clone(), rows, cols);
            let (mut got, mut want) = ([0f32; QK], [0f32; QK]);
            for r in 0..rows {
                for b in 0..3 {
                    dequantize_block(format, &data, 3, r, b, &mut got);
                    format.dequantize(&blocks[(r * 3 + b) * bb..][..bb], &mut want);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{format:?} row {r} block {b}");
                }
            }
        }
    }

    /// The portable loop against a direct reading of the file's blocks: each block's
    /// codes, scales and the activation's codes, with the module's order of operations.
    #[test]
    fn the_portable_loop_follows_the_definition() {
        for format in Format::ALL {
            let (rows, cols, bb) = (19, 64, format.block_bytes());
            let blocks = random_blocks(format, rows, cols, 9);
            let data = interleave(format, blocks.clone(), rows, cols);
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.3)
                .collect();
            let x = Activations::quantize(&x);
            let cb = chunk_bytes(format);
            for g in 0..2 {
                let got = portable(format, &data[g * 2 * cb..][..2 * cb], 2, &x);
                for (l, got) in got.iter().enumerate() {
                    let r = g * GROUP + l;
                    let mut want = 0f32;
                    for b in 0..2 {
                        if r >= rows {
                            break;
                        }
                        let blk = &blocks[(r * 2 + b) * bb..][..bb];
                        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                        let code = |e: usize| match format {
                            Format::Q4_1 => {
                                let byte = blk[4 + e % 16];
                                (if e < 16 { byte & 0x0F } else { byte >> 4 }) as i32
                            }
                            Format::Q5_0 => q5_0_codes(blk)[e] as i32,
                            Format::Q8_0 => blk[2 + e] as i8 as i32,
                        };
                        let sum: i32 = (0..QK).map(|e| code(e) * x.q[b * QK + e] as i32).sum();
                        want = (d * x.scales[b][0]).mul_add(sum as f32, want);
                        if format == Format::Q4_1 {
                            let m = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                            want = m.mul_add(x.scales[b][1], want);
                        }
                    }
                    assert_eq!(got.to_bits(), want.to_bits(), "{format:?} row {r}");
                }
            }
        }
    }
}
