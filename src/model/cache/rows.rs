//! Rows of keys or values in one encoding ([`RowFormat`]): what a per-head store holds
//! in memory, for its hot rows and for a tiered head's cold tier. f32 rows are read in
//! place; f16 and 8-bit rows are decoded to f32 when a query reads them: a decode step
//! a few rows at a time as it goes (`Run`), a prefill or a tiered head's cold tier
//! whole.
//!
//! The 8-bit encoding is llama.cpp's `q8_0` (its `-ctk q8_0 -ctv q8_0` KV cache): blocks
//! of [`Q8_BLOCK`] values, each with one f16 scale `d = absmax / 127` and the values
//! rounded to `x / d`, 34 bytes per 32 values. A row narrower than a block, or not a
//! multiple of it, ends in a shorter block with its own scale.
//!
//! Rows can be shared copy-on-write (`Rows::share`): the rows held so far move behind
//! an [`Arc`] that clones of the rows read in place (a prompt prefix prefilled once and
//! continued by many sequences), and each holder appends rows of its own after them. A
//! write into a shared row first gives the writer its own copy of them all.

use std::borrow::Cow;
use std::sync::Arc;

use half::f16;
use serde::{Deserialize, Serialize};

/// Values per scale in the 8-bit encoding.
pub const Q8_BLOCK: usize = 32;

/// How a store encodes its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RowFormat {
    /// 4 bytes per value, exact.
    #[default]
    F32,
    /// IEEE half precision: 2 bytes per value.
    F16,
    /// 8-bit blocks with an f16 scale (llama.cpp's `q8_0`): 1.0625 bytes per value.
    #[serde(alias = "int8")]
    Q8_0,
}

impl RowFormat {
    /// Its name in TOML and reports.
    pub fn name(self) -> &'static str {
        match self {
            RowFormat::F32 => "f32",
            RowFormat::F16 => "f16",
            RowFormat::Q8_0 => "q8_0",
        }
    }

    /// Bytes that `rows` rows of `d` values take in this encoding.
    pub fn bytes(self, d: usize, rows: usize) -> usize {
        match self {
            RowFormat::F32 => rows * d * 4,
            RowFormat::F16 => rows * d * 2,
            RowFormat::Q8_0 => rows * (d + d.div_ceil(Q8_BLOCK) * 2),
        }
    }
}

#[derive(Debug, Clone)]
enum Data {
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// `q`: the values, row-major; `d`: one scale per block, row-major.
    Q8 {
        q: Vec<i8>,
        d: Vec<f16>,
    },
}

impl Data {
    /// No rows of `format` yet, room for `rows` rows of `d` values.
    fn new(format: RowFormat, d: usize, rows: usize) -> Self {
        match format {
            RowFormat::F32 => Data::F32(Vec::with_capacity(rows * d)),
            RowFormat::F16 => Data::F16(Vec::with_capacity(rows * d)),
            RowFormat::Q8_0 => Data::Q8 {
                q: Vec::with_capacity(rows * d),
                d: Vec::with_capacity(rows * d.div_ceil(Q8_BLOCK)),
            },
        }
    }

    fn format(&self) -> RowFormat {
        match self {
            Data::F32(_) => RowFormat::F32,
            Data::F16(_) => RowFormat::F16,
            Data::Q8 { .. } => RowFormat::Q8_0,
        }
    }

    /// Rows of `d` values held.
    fn rows(&self, d: usize) -> usize {
        match self {
            Data::F32(v) => v.len() / d,
            Data::F16(v) => v.len() / d,
            Data::Q8 { q, .. } => q.len() / d,
        }
    }

    /// Rows of `d` values it has room for.
    fn capacity(&self, d: usize) -> usize {
        match self {
            Data::F32(v) => v.capacity() / d,
            Data::F16(v) => v.capacity() / d,
            Data::Q8 { q, .. } => q.capacity() / d,
        }
    }

    /// Append row `r` of `src` (the same format, rows of `d` values).
    fn extend_row(&mut self, src: &Data, r: usize, d: usize) {
        let blocks = d.div_ceil(Q8_BLOCK);
        match (src, self) {
            (Data::F32(a), Data::F32(b)) => b.extend_from_slice(&a[r * d..(r + 1) * d]),
            (Data::F16(a), Data::F16(b)) => b.extend_from_slice(&a[r * d..(r + 1) * d]),
            (Data::Q8 { q, d: s }, Data::Q8 { q: oq, d: os }) => {
                oq.extend_from_slice(&q[r * d..(r + 1) * d]);
                os.extend_from_slice(&s[r * blocks..(r + 1) * blocks]);
            }
            _ => unreachable!("rows keep their format"),
        }
    }

    /// `parts` one after the other (all of one format, rows of `d` values), with room
    /// for `room` more rows.
    fn joined(parts: &[&Data], d: usize, room: usize) -> Self {
        let rows: usize = parts.iter().map(|p| p.rows(d)).sum();
        let mut all = Data::new(parts[0].format(), d, rows + room);
        for part in parts {
            match (part, &mut all) {
                (Data::F32(a), Data::F32(b)) => b.extend_from_slice(a),
                (Data::F16(a), Data::F16(b)) => b.extend_from_slice(a),
                (Data::Q8 { q, d: s }, Data::Q8 { q: oq, d: os }) => {
                    oq.extend_from_slice(q);
                    os.extend_from_slice(s);
                }
                _ => unreachable!("rows keep their format"),
            }
        }
        all
    }

    /// Append rows `range` as f32 to `out`.
    fn read(&self, d: usize, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        let at = out.len();
        out.resize(at + range.len() * d, 0.0);
        Run::of(self).read(d, range, &mut out[at..]);
    }

    /// Bytes allocated.
    fn bytes(&self) -> usize {
        match self {
            Data::F32(v) => v.capacity() * 4,
            Data::F16(v) => v.capacity() * 2,
            Data::Q8 { q, d } => q.capacity() + d.capacity() * 2,
        }
    }
}

/// Rows of `d` values in one run as a store holds them, borrowed: what a decode step
/// reads in place, a few rows at a time decoded to f32 ([`Run::read`]) where they are
/// not f32 already.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Run<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    /// `q`: the values, row-major; `scales`: one per block, row-major.
    Q8 {
        q: &'a [i8],
        scales: &'a [f16],
    },
}

impl<'a> Run<'a> {
    /// No rows.
    pub(crate) const EMPTY: Run<'static> = Run::F32(&[]);

    fn of(data: &'a Data) -> Self {
        match data {
            Data::F32(v) => Run::F32(v),
            Data::F16(v) => Run::F16(v),
            Data::Q8 { q, d } => Run::Q8 { q, scales: d },
        }
    }

    /// Rows of `d` values held.
    pub(crate) fn rows(&self, d: usize) -> usize {
        match self {
            Run::F32(v) => v.len() / d,
            Run::F16(v) => v.len() / d,
            Run::Q8 { q, .. } => q.len() / d,
        }
    }

    /// The rows themselves where they are stored as f32.
    pub(crate) fn as_f32(&self) -> Option<&'a [f32]> {
        match *self {
            Run::F32(v) => Some(v),
            _ => None,
        }
    }

    /// Rows `..r` and `r..` (rows of `d` values).
    pub(crate) fn split_at(self, r: usize, d: usize) -> (Self, Self) {
        let blocks = d.div_ceil(Q8_BLOCK);
        match self {
            Run::F32(v) => {
                let (a, b) = v.split_at(r * d);
                (Run::F32(a), Run::F32(b))
            }
            Run::F16(v) => {
                let (a, b) = v.split_at(r * d);
                (Run::F16(a), Run::F16(b))
            }
            Run::Q8 { q, scales } => {
                let ((qa, qb), (sa, sb)) = (q.split_at(r * d), scales.split_at(r * blocks));
                (Run::Q8 { q: qa, scales: sa }, Run::Q8 { q: qb, scales: sb })
            }
        }
    }

    /// Rows `range` (rows of `d` values) as f32 into `out` (`range.len() * d` floats):
    /// f16 widened, 8-bit values times their block's scale.
    pub(crate) fn read(&self, d: usize, range: std::ops::Range<usize>, out: &mut [f32]) {
        let values = range.start * d..range.end * d;
        match self {
            Run::F32(v) => out.copy_from_slice(&v[values]),
            Run::F16(v) => widen(&v[values], out),
            Run::Q8 { q, scales } => {
                let blocks = d.div_ceil(Q8_BLOCK);
                for (i, r) in range.enumerate() {
                    let row = q[r * d..(r + 1) * d].chunks(Q8_BLOCK);
                    let dst = out[i * d..(i + 1) * d].chunks_mut(Q8_BLOCK);
                    for (b, (block, dst)) in row.zip(dst).enumerate() {
                        let s = scales[r * blocks + b].to_f32();
                        dst.iter_mut()
                            .zip(block)
                            .for_each(|(o, &x)| *o = x as f32 * s);
                    }
                }
            }
        }
    }
}

/// `src` widened to f32 into `dst` (an exact conversion): eight values per instruction
/// where the CPU has F16C, else one at a time.
pub(crate) fn widen(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU runs F16C and AVX.
        return unsafe { widen_f16c(src, dst) };
    }
    dst.iter_mut().zip(src).for_each(|(d, x)| *d = x.to_f32());
}

/// [`widen`] with F16C.
///
/// # Safety
///
/// The CPU runs F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16c(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let whole = src.len().min(dst.len()) / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: `i + 8 <= whole` values of both slices.
        let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
    }
    let rest = dst[whole..].iter_mut().zip(&src[whole..]);
    rest.for_each(|(d, x)| *d = x.to_f32());
}

/// Rows of `d` values in one [`RowFormat`]: the shared rows first (if any), then its
/// own.
#[derive(Debug, Clone)]
pub(crate) struct Rows {
    d: usize,
    /// Rows shared with other holders ([`Rows::share`]), read in place, never written.
    shared: Option<Arc<Data>>,
    data: Data,
}

impl Rows {
    /// No rows yet, room for `rows`.
    pub(crate) fn new(format: RowFormat, d: usize, rows: usize) -> Self {
        Self {
            d,
            shared: None,
            data: Data::new(format, d, rows),
        }
    }

    /// Room for `rows` rows in all (shared ones included), allocated exactly (nothing
    /// changes when there is room already): a copied store made ready for the positions
    /// still to come.
    pub(crate) fn reserve_rows(&mut self, rows: usize) {
        fn room<T>(v: &mut Vec<T>, n: usize) {
            v.reserve_exact(n.saturating_sub(v.len()));
        }
        let rows = rows.saturating_sub(self.shared_rows());
        let (d, blocks) = (self.d, self.d.div_ceil(Q8_BLOCK));
        match &mut self.data {
            Data::F32(v) => room(v, rows * d),
            Data::F16(v) => room(v, rows * d),
            Data::Q8 { q, d: scales } => {
                room(q, rows * d);
                room(scales, rows * blocks);
            }
        }
    }

    fn format(&self) -> RowFormat {
        self.data.format()
    }

    /// Values per row.
    pub(crate) fn d(&self) -> usize {
        self.d
    }

    /// Rows held, shared ones included.
    pub(crate) fn len(&self) -> usize {
        self.shared_rows() + self.data.rows(self.d)
    }

    /// Rows shared with other holders.
    fn shared_rows(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.rows(self.d))
    }

    /// Make every row held so far shared: clones then read them in place instead of
    /// copying them, and each holder appends its own rows after them. The shared rows
    /// are allocated exactly; this holder keeps the room it had for more.
    pub(crate) fn share(&mut self) {
        let d = self.d;
        if self.data.rows(d) == 0 && self.shared.is_some() {
            return;
        }
        let room = self.data.capacity(d) - self.data.rows(d);
        let parts: Vec<&Data> = self
            .shared
            .iter()
            .map(|s| &**s)
            .chain([&self.data])
            .collect();
        self.shared = Some(Arc::new(Data::joined(&parts, d, 0)));
        self.data = Data::new(self.format(), d, room);
    }

    /// Keep only the first `rows` rows (a shared part cut short is copied first); the
    /// room stays allocated.
    pub(crate) fn truncate(&mut self, rows: usize) {
        if rows < self.shared_rows() {
            self.unshare();
        }
        let own = rows.saturating_sub(self.shared_rows());
        let (d, blocks) = (self.d, self.d.div_ceil(Q8_BLOCK));
        match &mut self.data {
            Data::F32(v) => v.truncate(own * d),
            Data::F16(v) => v.truncate(own * d),
            Data::Q8 { q, d: scales } => {
                q.truncate(own * d);
                scales.truncate(own * blocks);
            }
        }
    }

    /// Own a copy of the shared rows (before a write into one of them).
    fn unshare(&mut self) {
        if let Some(shared) = self.shared.take() {
            let room = self.data.capacity(self.d) - self.data.rows(self.d);
            self.data = Data::joined(&[&shared, &self.data], self.d, room);
        }
    }

    /// Bytes of the shared rows while another holder reads them too (what this holder
    /// would not free by dropping them).
    pub(crate) fn shared_bytes(&self) -> usize {
        self.shared
            .as_ref()
            .filter(|s| Arc::strong_count(s) > 1)
            .map_or(0, |s| s.bytes())
    }

    /// Bytes of the shared rows, whoever else holds them (what a clone reads in place).
    pub(crate) fn bytes_behind_share(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.bytes())
    }

    /// Write `row` (`d` values) as row `slot`; a slot past the end first grows the rows
    /// to it (the rows between are zeros until written). A shared slot is written in
    /// this holder's own copy of the rows.
    pub(crate) fn write(&mut self, slot: usize, row: &[f32]) {
        debug_assert_eq!(row.len(), self.d);
        if slot < self.shared_rows() {
            self.unshare();
        }
        let slot = slot - self.shared_rows();
        let d = self.d;
        let blocks = d.div_ceil(Q8_BLOCK);
        if slot >= self.data.rows(d) {
            let rows = slot + 1;
            match &mut self.data {
                Data::F32(v) => v.resize(rows * d, 0.0),
                Data::F16(v) => v.resize(rows * d, f16::ZERO),
                Data::Q8 { q, d: scales } => {
                    q.resize(rows * d, 0);
                    scales.resize(rows * blocks, f16::ZERO);
                }
            }
        }
        let at = slot * d..(slot + 1) * d;
        match &mut self.data {
            Data::F32(v) => v[at].copy_from_slice(row),
            Data::F16(v) => v[at]
                .iter_mut()
                .zip(row)
                .for_each(|(o, &x)| *o = f16::from_f32(x)),
            Data::Q8 { q, d: scales } => {
                let blocks_out = q[at].chunks_mut(Q8_BLOCK).zip(row.chunks(Q8_BLOCK));
                for (b, (out, block)) in blocks_out.enumerate() {
                    let absmax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let scale = absmax / 127.0;
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    scales[slot * blocks + b] = f16::from_f32(scale);
                    out.iter_mut()
                        .zip(block)
                        .for_each(|(o, &x)| *o = (x * inv).round() as i8);
                }
            }
        }
    }

    /// Append a row.
    pub(crate) fn push(&mut self, row: &[f32]) {
        self.write(self.len(), row);
    }

    /// The part holding row `r`, and the row's index in it.
    fn locate(&self, r: usize) -> (&Data, usize) {
        match &self.shared {
            Some(s) if r < s.rows(self.d) => (s, r),
            _ => (&self.data, r - self.shared_rows()),
        }
    }

    /// Append rows `range` as f32 to `out`.
    pub(crate) fn read(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        let split = self.shared_rows();
        if let Some(s) = &self.shared {
            s.read(self.d, range.start.min(split)..range.end.min(split), out);
        }
        let own = range.start.max(split) - split..range.end.max(split) - split;
        self.data.read(self.d, own, out);
    }

    /// Every row `(rows, d)` as f32 in two parts, the shared rows then the own ones:
    /// borrowed when stored as f32, else decoded (all into the first part).
    pub(crate) fn as_f32(&self) -> [Cow<'_, [f32]>; 2] {
        match (&self.shared, &self.data) {
            (None, Data::F32(v)) => [Cow::Borrowed(&[]), Cow::Borrowed(v)],
            (Some(s), Data::F32(v)) => match &**s {
                Data::F32(sv) => [Cow::Borrowed(sv), Cow::Borrowed(v)],
                _ => unreachable!("rows keep their format"),
            },
            _ => {
                let mut out = Vec::with_capacity(self.len() * self.d);
                self.read(0..self.len(), &mut out);
                [Cow::Owned(out), Cow::Borrowed(&[])]
            }
        }
    }

    /// Every row in place, in two runs: the shared rows, then the own ones.
    pub(crate) fn runs(&self) -> [Run<'_>; 2] {
        [
            self.shared.as_deref().map_or(Run::EMPTY, Run::of),
            Run::of(&self.data),
        ]
    }

    /// Rows `rows` (in that order), in the same format, with room for `room` more: all
    /// the selection's own.
    pub(crate) fn select(&self, rows: &[usize], room: usize) -> Self {
        let mut out = Self::new(self.format(), self.d, rows.len() + room);
        for &r in rows {
            let (part, i) = self.locate(r);
            out.data.extend_row(part, i, self.d);
        }
        out
    }

    /// Bytes allocated, shared rows included.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes_behind_share() + self.data.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row as f32, the two parts of [`Rows::as_f32`] joined.
    fn all(rows: &Rows) -> Vec<f32> {
        rows.as_f32().concat()
    }

    /// A row of `n` values spread over about +-3.
    fn row(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + seed) * 0.37).sin() * 3.0)
            .collect()
    }

    #[test]
    fn f16_widens_to_the_f32_of_every_bit_pattern() {
        // Every f16 (NaNs only as NaNs), in a run long enough for whole vectors and a
        // remainder, against `half`'s own conversion one value at a time.
        let all: Vec<f16> = (0..=u16::MAX)
            .map(f16::from_bits)
            .chain([f16::ONE; 5])
            .collect();
        let mut out = vec![0f32; all.len()];
        widen(&all, &mut out);
        for (x, y) in all.iter().zip(&out) {
            let want = f32::from(*x);
            assert!(
                want.to_bits() == y.to_bits() || (want.is_nan() && y.is_nan()),
                "{:#06x}",
                x.to_bits()
            );
        }
    }

    #[test]
    fn each_format_round_trips_within_its_precision_and_counts_its_bytes() {
        // (format, worst error for values within +-3, bytes of 2 rows of 64)
        let cases = [
            (RowFormat::F32, 0.0, 2 * 64 * 4),
            (RowFormat::F16, 2e-3, 2 * 64 * 2),
            // half a step of absmax / 127, plus the f16 scale's rounding
            (
                RowFormat::Q8_0,
                3.0 / 254.0 + 3.0 * 1e-3,
                2 * 64 + 2 * 2 * 2,
            ),
        ];
        for (format, tol, bytes) in cases {
            let mut rows = Rows::new(format, 64, 2);
            rows.push(&row(64, 0.0));
            rows.push(&row(64, 5.0));
            let mut out = Vec::new();
            rows.read(1..2, &mut out);
            let err = row(64, 5.0)
                .iter()
                .zip(&out)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= tol, "{format:?}: {err}");
            assert_eq!(rows.bytes(), bytes, "{format:?}");
            assert_eq!(all(&rows).len(), 128);
        }
    }

    #[test]
    fn q8_0_rounds_each_block_to_its_own_scale_like_llama_cpp() {
        // a block of 32 whose absmax is 127 has scale 1: values round to integers
        let mut block: Vec<f32> = (0..32).map(|i| i as f32 * 3.9 - 60.2).collect();
        block[7] = -127.0;
        // a second block of 8 (a 40-wide row) with a scale of its own
        let tail = [0.5f32, -0.25, 0.0, 0.125, 0.0, 0.0, 0.0, 0.0];
        let mut r = Rows::new(RowFormat::Q8_0, 40, 1);
        r.push(&[block.clone(), tail.to_vec()].concat());
        let mut out = Vec::new();
        r.read(0..1, &mut out);
        for (i, (&x, &y)) in block.iter().zip(&out).enumerate() {
            assert_eq!(y, x.round(), "value {i}");
        }
        // tail: scale 0.5 / 127 (rounded to f16), values x / scale rounded
        let s = f16::from_f32(0.5 / 127.0).to_f32();
        for (&x, &y) in tail.iter().zip(&out[32..]) {
            assert_eq!(y, (x * (127.0 / 0.5)).round() * s);
        }
        // a zero block stays zero
        let mut z = Rows::new(RowFormat::Q8_0, 4, 1);
        z.push(&[0.0; 4]);
        assert_eq!(all(&z), [0.0; 4]);
    }

    #[test]
    fn rows_are_written_in_any_slot_and_selected_in_their_format() {
        for format in [RowFormat::F32, RowFormat::F16, RowFormat::Q8_0] {
            let mut r = Rows::new(format, 2, 4);
            // a ring filled out of order: slot 2 before slots 0 and 1, slot 1 twice (rows
            // whose absmax is 127 have a q8_0 scale of 1: every format holds them exactly)
            r.write(2, &[2.0, -127.0]);
            r.write(0, &[0.0, 0.0]);
            r.write(1, &[1.0, -1.0]);
            r.write(1, &[127.0, -3.0]);
            assert_eq!(r.len(), 3);
            let want = [0.0, 0.0, 127.0, -3.0, 2.0, -127.0];
            assert_eq!(all(&r), want, "{format:?}");
            let s = r.select(&[2, 0], 3);
            assert_eq!(s.format(), format);
            assert_eq!(all(&s), [2.0, -127.0, 0.0, 0.0], "{format:?}");
            assert_eq!(s.bytes(), Rows::new(format, 2, 5).bytes());
        }
        // `int8`, the cold tier's earlier name, still reads as q8_0
        let f: RowFormat = serde_json::from_str("\"int8\"").unwrap();
        assert_eq!(f, RowFormat::Q8_0);
    }

    #[test]
    fn shared_rows_are_read_in_place_and_copied_only_when_written() {
        for format in [RowFormat::F32, RowFormat::F16, RowFormat::Q8_0] {
            let mut a = Rows::new(format, 2, 3);
            a.push(&[1.0, -127.0]);
            a.push(&[2.0, 127.0]);
            a.share();
            let mut b = a.clone();
            // `a` and `b` read the same two rows, then append their own.
            assert_eq!(
                a.shared_bytes(),
                Rows::new(format, 2, 2).bytes(),
                "{format:?}"
            );
            a.push(&[3.0, 127.0]);
            b.push(&[4.0, 127.0]);
            b.push(&[5.0, 127.0]);
            assert_eq!(all(&a), [1.0, -127.0, 2.0, 127.0, 3.0, 127.0], "{format:?}");
            assert_eq!(all(&b)[4..], [4.0, 127.0, 5.0, 127.0], "{format:?}");
            let mut out = Vec::new();
            b.read(1..3, &mut out);
            assert_eq!(out, [2.0, 127.0, 4.0, 127.0], "{format:?}");
            assert_eq!(all(&b.select(&[3, 0], 0)), [5.0, 127.0, 1.0, -127.0]);
            // Sharing again moves `a`'s own row behind a new share; `b` keeps the old.
            a.share();
            assert_eq!(a.len(), 3);
            assert_eq!(a.shared_bytes(), 0, "nobody else holds the new share");
            // A write into a shared row (a ring wrapping) gives `b` its own copy.
            b.write(0, &[9.0, 127.0]);
            assert_eq!(b.shared_bytes(), 0);
            assert_eq!(all(&b), [9.0, 127.0, 2.0, 127.0, 4.0, 127.0, 5.0, 127.0]);
            assert_eq!(
                all(&a)[..2],
                [1.0, -127.0],
                "{format:?}: the other holder is untouched"
            );
        }
    }
}
