//! Key and value rows in a store's own encoding (f32, f16 or `q8_0`, a
//! [`Run`](crate::model::cache::rows::Run)'s), read by the decode kernels in place: a row
//! at a time, and within a row a vector of floats at a time, widened as it is loaded. The
//! floats are those [`Run::read`](crate::model::cache::rows::Run::read) decodes: f16
//! widened exactly, an 8-bit value converted to f32 and multiplied by its block's scale
//! (one rounding), so a kernel reading them gives the bits it gives over the rows decoded
//! first, with half or a quarter of the bytes read from memory.

use half::f16;

use crate::model::cache::rows::Q8_BLOCK;

/// Rows of `d` values, row-major, in one encoding, borrowed: what a decode kernel reads.
/// A view made by [`Encoded::row`] is one row, and its values are indexed from 0.
pub(super) trait Encoded<'a>: Copy {
    /// Row `r` of rows of `d` values.
    fn row(self, r: usize, d: usize) -> Self;

    /// Value `i` as f32.
    fn at(self, i: usize) -> f32;

    /// Values `i..i + N` as f32.
    #[inline(always)]
    fn array<const N: usize>(self, i: usize) -> [f32; N] {
        std::array::from_fn(|j| self.at(i + j))
    }

    /// The values themselves where they are f32.
    fn as_f32(self) -> Option<&'a [f32]>;

    /// Asks for the cache lines [`PREFETCH_BYTES`](crate::model::numerics::kernels::PREFETCH_BYTES)
    /// past each line of the values (a hint only: results do not change).
    fn prefetch(self);

    /// Values `i..i + 8` as f32.
    ///
    /// # Safety
    ///
    /// The values lie in the view, `i` is a multiple of 8, and the CPU runs AVX and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256;

    /// Values `i..i + 16` as f32.
    ///
    /// # Safety
    ///
    /// The values lie in the view, `i` is a multiple of 16, and the CPU runs AVX-512 F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512;
}

/// `$body` with `$view` bound to the rows of a [`Run`](crate::model::cache::rows::Run) of
/// rows of `$d` values as an [`Encoded`] view of their encoding (compiled once for each).
macro_rules! with_encoded {
    ($run:expr, $d:expr, |$view:ident| $body:expr) => {
        match $run {
            $crate::model::cache::rows::Run::F32($view) => $body,
            $crate::model::cache::rows::Run::F16($view) => $body,
            $crate::model::cache::rows::Run::Q8 { q, scales } => {
                let $view = $crate::model::attention::encoded::Q8Rows::new(q, scales, $d);
                $body
            }
        }
    };
}
pub(super) use with_encoded;

/// `bytes` bytes from `start` prefetched, as [`Encoded::prefetch`] says.
#[inline(always)]
fn prefetch_bytes(start: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..bytes).step_by(64) {
        use crate::model::numerics::kernels::PREFETCH_BYTES;
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let at = start.wrapping_add(line + PREFETCH_BYTES);
        // SAFETY: a prefetch does not fault or read memory architecturally, whatever the
        // address; SSE is part of every x86-64 CPU.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, bytes);
}

impl<'a> Encoded<'a> for &'a [f32] {
    #[inline(always)]
    fn row(self, r: usize, d: usize) -> Self {
        &self[r * d..(r + 1) * d]
    }

    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        self[i]
    }

    #[inline(always)]
    fn array<const N: usize>(self, i: usize) -> [f32; N] {
        let values = &self[i..i + N];
        std::array::from_fn(|j| values[j])
    }

    #[inline(always)]
    fn as_f32(self) -> Option<&'a [f32]> {
        Some(self)
    }

    #[inline(always)]
    fn prefetch(self) {
        prefetch_bytes(self.as_ptr().cast(), 4 * self.len())
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller keeps `i..i + 8` in the view.
        std::arch::x86_64::_mm256_loadu_ps(self.as_ptr().add(i))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller keeps `i..i + 16` in the view.
        std::arch::x86_64::_mm512_loadu_ps(self.as_ptr().add(i))
    }
}

impl<'a> Encoded<'a> for &'a [f16] {
    #[inline(always)]
    fn row(self, r: usize, d: usize) -> Self {
        &self[r * d..(r + 1) * d]
    }

    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        self[i].to_f32()
    }

    #[inline(always)]
    fn as_f32(self) -> Option<&'a [f32]> {
        None
    }

    #[inline(always)]
    fn prefetch(self) {
        prefetch_bytes(self.as_ptr().cast(), 2 * self.len())
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::{_mm256_cvtph_ps, _mm_loadu_si128};
        // SAFETY: the caller keeps `i..i + 8` (16 bytes) in the view.
        _mm256_cvtph_ps(_mm_loadu_si128(self.as_ptr().add(i).cast()))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::{_mm256_loadu_si256, _mm512_cvtph_ps};
        // SAFETY: the caller keeps `i..i + 16` (32 bytes) in the view.
        _mm512_cvtph_ps(_mm256_loadu_si256(self.as_ptr().add(i).cast()))
    }
}

/// Rows in `q8_0`: `q` the values, row-major; `scales` one per block of [`Q8_BLOCK`]
/// values, `blocks` per row (a row's last block may be shorter).
#[derive(Debug, Clone, Copy)]
pub(super) struct Q8Rows<'a> {
    q: &'a [i8],
    scales: &'a [f16],
    blocks: usize,
}

impl<'a> Q8Rows<'a> {
    /// Rows of `d` values.
    pub(super) fn new(q: &'a [i8], scales: &'a [f16], d: usize) -> Self {
        Self {
            q,
            scales,
            blocks: d.div_ceil(Q8_BLOCK),
        }
    }

    /// The scale of value `i` (of a row) as f32, with F16C.
    ///
    /// # Safety
    ///
    /// Value `i` lies in the view and the CPU runs F16C.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scale(self, i: usize) -> f32 {
        use std::arch::x86_64::{_mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32};
        // SAFETY: block `i / Q8_BLOCK` of a row that holds value `i`.
        let bits = self.scales.get_unchecked(i / Q8_BLOCK).to_bits();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }
}

impl<'a> Encoded<'a> for Q8Rows<'a> {
    #[inline(always)]
    fn row(self, r: usize, d: usize) -> Self {
        Self {
            q: &self.q[r * d..(r + 1) * d],
            scales: &self.scales[r * self.blocks..(r + 1) * self.blocks],
            blocks: self.blocks,
        }
    }

    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        self.q[i] as f32 * self.scales[i / Q8_BLOCK].to_f32()
    }

    #[inline(always)]
    fn as_f32(self) -> Option<&'a [f32]> {
        None
    }

    #[inline(always)]
    fn prefetch(self) {
        prefetch_bytes(self.q.as_ptr().cast(), self.q.len())
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller keeps `i..i + 8` (8 bytes) in the view; a multiple of 8
        // lies with the next 7 in one block of 32.
        let q = _mm_loadl_epi64(self.q.as_ptr().add(i).cast());
        let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        _mm256_mul_ps(x, _mm256_set1_ps(self.scale(i)))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller keeps `i..i + 16` (16 bytes) in the view; a multiple of 16
        // lies with the next 15 in one block of 32.
        let q = _mm_loadu_si128(self.q.as_ptr().add(i).cast());
        let x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
        _mm512_mul_ps(x, _mm512_set1_ps(self.scale(i)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cache::rows::Rows;
    use crate::model::RowFormat;

    #[test]
    fn every_value_reads_as_the_rows_decode_it() {
        // Each encoding's view, value by value, in arrays and (where the CPU runs them)
        // in vectors, against the store's own decoding of its rows; rows of 72 values
        // end in a short 8-bit block.
        let (d, n) = (72, 5);
        let values: Vec<f32> = (0..n * d)
            .map(|i| ((i * 37) % 101) as f32 / 7.0 - 6.0)
            .collect();
        for format in [RowFormat::F32, RowFormat::F16, RowFormat::Q8_0] {
            let mut rows = Rows::new(format, d, n);
            values.chunks(d).for_each(|r| rows.push(r));
            let want = rows.as_f32().concat();
            let [_, run] = rows.runs();
            let mut got = Vec::new();
            with_encoded!(run, d, |view| {
                for r in 0..n {
                    let row = view.row(r, d);
                    got.extend((0..d).map(|i| row.at(i)));
                    let first: [f32; 16] = row.array(16);
                    assert_eq!(first[..], want[r * d + 16..][..16], "{format:?}");
                    #[cfg(target_arch = "x86_64")]
                    if crate::model::numerics::kernels::Isa::Avx2.supported() {
                        let mut eight = [0f32; 8];
                        // SAFETY: values 64..72 lie in the row; the CPU runs AVX and F16C.
                        unsafe {
                            let v = row.load8(64);
                            std::arch::x86_64::_mm256_storeu_ps(eight.as_mut_ptr(), v);
                        }
                        assert_eq!(eight[..], want[r * d + 64..][..8], "{format:?}");
                    }
                    #[cfg(target_arch = "x86_64")]
                    if crate::model::numerics::kernels::Isa::Avx512Vnni.supported() {
                        let mut sixteen = [0f32; 16];
                        // SAFETY: values 48..64 lie in the row; the CPU runs AVX-512 F.
                        unsafe {
                            let v = row.load16(48);
                            std::arch::x86_64::_mm512_storeu_ps(sixteen.as_mut_ptr(), v);
                        }
                        assert_eq!(sixteen[..], want[r * d + 48..][..16], "{format:?}");
                    }
                }
            });
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{format:?}");
        }
    }
}
