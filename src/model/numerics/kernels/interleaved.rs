//! Q4_1 weights interleaved [`GROUP`] rows to a group, so that one 32-bit lane of a
//! vector holds one weight row: the kernels broadcast four activation bytes to every
//! lane, complete each row's integer sum over a block, and then spend one conversion and
//! two fused multiply-adds on it. One row, a decode step, and a batch of activation rows
//! run the same kernel; the weights of a group are unpacked once per block for all the
//! activation rows of a pass.
//!
//! **Layout.** Rows are padded with zero blocks to a multiple of [`GROUP`]. Group `g`'s
//! block `b` takes [`CHUNK`] bytes at `(g * blocks + b) * CHUNK`: the sixteen rows' `d`
//! (f16), their `m` (f16), then four runs of 64 code bytes. Run `k` holds, in bytes
//! `4l..4l + 4`, row `l`'s code bytes `4k..4k + 4`: their low nibbles are the elements
//! `4k..4k + 4` of the block, their high nibbles the elements `16 + 4k..16 + 4k + 4`. The
//! same bytes as the file's blocks, reordered.
//!
//! **The floats.** Row `r` against activation row `x`, from `acc = 0`, block after
//! block: `acc = fma(d_r * d_x, float(sum_j q_rj q_xj), acc)`, then
//! `acc = fma(m_r, d_x * sum_j q_xj, acc)`. The integer sum is exact in any order
//! (`|sum| <= 32 * 15 * 128 < 2^24`, so its conversion is exact too). AVX-512 VNNI (sixteen
//! rows per register), AVX-VNNI and AVX2 (eight) and the portable loop all compute
//! exactly that, so a result depends neither on the instruction set nor on the other
//! activation rows computed with it.

use half::f16;

use super::blocks::{Activations, QK};
use super::dot::Supported;
use super::isa::Isa;

/// Weight rows per group: one per 32-bit lane of a 512-bit register.
pub(super) const GROUP: usize = 16;

/// Bytes of one Q4_1 block in the file: f16 `d`, f16 `m`, 16 bytes of nibbles.
const BLOCK: usize = 20;

/// Bytes of one block of a group: [`GROUP`] file blocks.
const CHUNK: usize = GROUP * BLOCK;

/// Offset of the first run of codes in a chunk (after the sixteen `d` and `m`).
const CODES: usize = 4 * GROUP;

/// Activation rows per pass over a group on AVX-512 (their accumulators and integer sums
/// stay in the 32 registers).
const PASS_512: usize = 8;

/// The same on AVX2 and AVX-VNNI (16 registers).
const PASS_256: usize = 4;

/// Row-major Q4_1 `blocks` of a `(rows, cols)` matrix, interleaved.
///
/// Panics if `blocks` is not `rows * cols / QK` blocks.
pub(super) fn interleave(blocks: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let nb = cols / QK;
    assert_eq!(
        blocks.len(),
        rows * nb * BLOCK,
        "Q4_1 blocks do not fit the shape"
    );
    let mut out = vec![0u8; rows.div_ceil(GROUP) * nb * CHUNK];
    for (r, row) in blocks.chunks_exact(nb * BLOCK).enumerate() {
        for (b, src) in row.chunks_exact(BLOCK).enumerate() {
            let (g, l) = (r / GROUP, r % GROUP);
            let chunk = &mut out[(g * nb + b) * CHUNK..][..CHUNK];
            chunk[2 * l..2 * l + 2].copy_from_slice(&src[0..2]);
            chunk[2 * GROUP + 2 * l..][..2].copy_from_slice(&src[2..4]);
            for k in 0..4 {
                chunk[CODES + 64 * k + 4 * l..][..4].copy_from_slice(&src[4 + 4 * k..][..4]);
            }
        }
    }
    out
}

/// Block `b` of row `r` in the file's layout, from interleaved `data` with `nb` blocks per
/// row.
pub(super) fn file_block(data: &[u8], nb: usize, r: usize, b: usize) -> [u8; BLOCK] {
    let (g, l) = (r / GROUP, r % GROUP);
    let chunk = &data[(g * nb + b) * CHUNK..][..CHUNK];
    let mut blk = [0u8; BLOCK];
    blk[0..2].copy_from_slice(&chunk[2 * l..2 * l + 2]);
    blk[2..4].copy_from_slice(&chunk[2 * GROUP + 2 * l..][..2]);
    for k in 0..4 {
        blk[4 + 4 * k..][..4].copy_from_slice(&chunk[CODES + 64 * k + 4 * l..][..4]);
    }
    blk
}

/// `out[i][l]` = weight row `group * GROUP + l` of interleaved `data` (`nb` blocks per
/// row) times `xs[i]`; padding rows give 0.
///
/// Panics if `out` and `xs` differ in length, an activation row is not `nb` blocks, or
/// `data` has no group `group`.
pub(super) fn group_product(
    isa: Supported,
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
    let w = &data[group * nb * CHUNK..][..nb * CHUNK];
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
                    match (isa.isa(), xs.len()) {
                        (Isa::Portable, _) => out[0] = portable(w, nb, xs[0]),
                        // SAFETY (all): `Supported` checked that the CPU has the features
                        // each function enables (every `Isa` past `Portable` includes AVX2,
                        // FMA and F16C), and the lengths were checked above.
                        $(
                            (Isa::Avx512Vnni, $n) => out.copy_from_slice(&unsafe {
                                x86::vnni_512::<$n>(w.as_ptr(), nb, std::array::from_fn(|i| xs[i]))
                            }),
                            (Isa::AvxVnni, $n) => out.copy_from_slice(&unsafe {
                                x86::avxvnni::<$n>(w.as_ptr(), nb, std::array::from_fn(|i| xs[i]))
                            }),
                            (Isa::Avx2, $n) => out.copy_from_slice(&unsafe {
                                x86::avx2::<$n>(w.as_ptr(), nb, std::array::from_fn(|i| xs[i]))
                            }),
                        )*
                        _ => unreachable!("passes hold 1 to {PASS_512} rows"),
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
            *o = portable(w, nb, x);
        }
    }
}

/// The portable loop: one group's blocks `w` against `x`, in the kernels' order.
fn portable(w: &[u8], nb: usize, x: &Activations) -> [f32; GROUP] {
    let mut acc = [0f32; GROUP];
    for (b, chunk) in w.chunks_exact(CHUNK).take(nb).enumerate() {
        let xq = &x.q[b * QK..(b + 1) * QK];
        let [dx, dx_sum] = x.scales[b];
        for (l, a) in acc.iter_mut().enumerate() {
            let half = |at: usize| f16::from_le_bytes([chunk[at], chunk[at + 1]]).to_f32();
            let (d, m) = (half(2 * l), half(2 * GROUP + 2 * l));
            let mut sum = 0i32;
            for k in 0..4 {
                for j in 0..4 {
                    let byte = chunk[CODES + 64 * k + 4 * l + j];
                    sum += (byte & 0x0F) as i32 * xq[4 * k + j] as i32
                        + (byte >> 4) as i32 * xq[16 + 4 * k + j] as i32;
                }
            }
            *a = (d * dx).mul_add(sum as f32, *a);
            *a = m.mul_add(dx_sum, *a);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::blocks::{Activations, QK};
    use super::super::dot::x86::dot_avx2;
    use super::super::PREFETCH_BYTES as PREFETCH;
    use super::{CHUNK, CODES, GROUP};

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

    /// One group against `R` activation rows, sixteen weight rows per 512-bit register.
    #[target_feature(enable = "avx512vnni,avx512bw,avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn vnni_512<const R: usize>(
        w: *const u8,
        nb: usize,
        x: [&Activations; R],
    ) -> [[f32; GROUP]; R] {
        let low = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let chunk = w.add(b * CHUNK);
            _mm_prefetch::<_MM_HINT_T0>(chunk.wrapping_add(PREFETCH) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(chunk.wrapping_add(PREFETCH + 256) as *const i8);
            let mut sums = [_mm512_setzero_si512(); R];
            for k in 0..4 {
                let run = _mm512_loadu_si512(chunk.add(CODES + 64 * k) as *const __m512i);
                let lo = _mm512_and_si512(run, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(run), low);
                for r in 0..R {
                    let q = x[r].q.as_ptr().add(b * QK);
                    sums[r] = _mm512_dpbusd_epi32(sums[r], lo, four_512(q.add(4 * k)));
                    sums[r] = _mm512_dpbusd_epi32(sums[r], hi, four_512(q.add(16 + 4 * k)));
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(chunk as *const __m256i));
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(chunk.add(2 * GROUP) as *const __m256i));
            for r in 0..R {
                let [dx, dx_sum] = x[r].scales[b];
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(dx));
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums[r]), acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx_sum), acc[r]);
            }
        }
        let mut out = [[0f32; GROUP]; R];
        for r in 0..R {
            _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
        }
        out
    }

    /// `acc` plus the sums of four adjacent products of unsigned `u` and signed `s` bytes,
    /// per i32 lane (AVX2: pair sums in i16, which 15 * 128 * 2 cannot saturate).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn add_dot_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi32(acc, dot_avx2(u, s))
    }

    /// The same with one VEX-encoded `vpdpbusd` (AVX-VNNI).
    #[inline]
    #[target_feature(enable = "avxvnni")]
    fn add_dot_avxvnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, u, s)
    }

    /// One group against `R` activation rows, eight weight rows per 256-bit register (the
    /// group's two halves in turn), given the instruction set's accumulating dot product.
    macro_rules! narrow {
        ($name:ident, $features:literal, $add_dot:ident) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<const R: usize>(
                w: *const u8,
                nb: usize,
                x: [&Activations; R],
            ) -> [[f32; GROUP]; R] {
                let low = _mm256_set1_epi8(0x0F);
                let mut out = [[0f32; GROUP]; R];
                for half in 0..2 {
                    let mut acc = [_mm256_setzero_ps(); R];
                    for b in 0..nb {
                        let chunk = w.add(b * CHUNK);
                        if half == 0 {
                            _mm_prefetch::<_MM_HINT_T0>(chunk.wrapping_add(PREFETCH) as *const i8);
                            _mm_prefetch::<_MM_HINT_T0>(
                                chunk.wrapping_add(PREFETCH + 256) as *const i8
                            );
                        }
                        let mut sums = [_mm256_setzero_si256(); R];
                        for k in 0..4 {
                            let at = chunk.add(CODES + 64 * k + 32 * half);
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
                        let at = |offset: usize| chunk.add(offset + 16 * half) as *const __m128i;
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(at(0)));
                        let m = _mm256_cvtph_ps(_mm_loadu_si128(at(2 * GROUP)));
                        for r in 0..R {
                            let [dx, dx_sum] = x[r].scales[b];
                            let scale = _mm256_mul_ps(d, _mm256_set1_ps(dx));
                            acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums[r]), acc[r]);
                            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx_sum), acc[r]);
                        }
                    }
                    for r in 0..R {
                        _mm256_storeu_ps(out[r].as_mut_ptr().add(8 * half), acc[r]);
                    }
                }
                out
            }
        };
    }

    narrow!(avx2, "avx2,fma,f16c", add_dot_avx2);
    narrow!(avxvnni, "avxvnni,avx2,fma,f16c", add_dot_avxvnni);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random Q4_1 blocks: every nibble, scales of both signs.
    fn random_blocks(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let mut out = Vec::new();
        for _ in 0..rows * cols / QK {
            for _ in 0..2 {
                let v = (next() % 2001) as f32 / 1000.0 - 1.0;
                out.extend(f16::from_f32(v).to_le_bytes());
            }
            out.extend((0..16).map(|_| next() as u8));
        }
        out
    }

    #[test]
    fn interleaving_keeps_every_block_and_pads_with_zeros() {
        let (rows, cols) = (21, 96);
        let blocks = random_blocks(rows, cols, 3);
        let data = interleave(&blocks, rows, cols);
        assert_eq!(data.len(), 2 * 3 * CHUNK);
        for r in 0..32 {
            for b in 0..3 {
                let want: [u8; BLOCK] = if r < rows {
                    blocks[(r * 3 + b) * BLOCK..][..BLOCK].try_into().unwrap()
                } else {
                    [0; BLOCK]
                };
                assert_eq!(file_block(&data, 3, r, b), want, "row {r} block {b}");
            }
        }
    }

    /// The portable loop against a direct reading of the file's blocks: each block's
    /// nibbles, scales and the activation's codes, with the module's order of operations.
    #[test]
    fn the_portable_loop_follows_the_definition() {
        let (rows, cols) = (19, 64);
        let blocks = random_blocks(rows, cols, 9);
        let data = interleave(&blocks, rows, cols);
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.3)
            .collect();
        let x = Activations::quantize(&x);
        for g in 0..2 {
            let got = portable(&data[g * 2 * CHUNK..][..2 * CHUNK], 2, &x);
            for (l, got) in got.iter().enumerate() {
                let r = g * GROUP + l;
                let mut want = 0f32;
                for b in 0..2 {
                    if r >= rows {
                        break;
                    }
                    let blk = &blocks[(r * 2 + b) * BLOCK..][..BLOCK];
                    let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    let m = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                    let sum: i32 = (0..QK)
                        .map(|e| {
                            let byte = blk[4 + e % 16];
                            let code = if e < 16 { byte & 0x0F } else { byte >> 4 };
                            code as i32 * x.q[b * QK + e] as i32
                        })
                        .sum();
                    want = (d * x.scales[b][0]).mul_add(sum as f32, want);
                    want = m.mul_add(x.scales[b][1], want);
                }
                assert_eq!(got.to_bits(), want.to_bits(), "row {r}");
            }
        }
    }
}
