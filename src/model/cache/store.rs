//! One KV head's stored rows: what a per-head cache ([`crate::model::HeadCache`]) is
//! made of. A store only stores: it appends positions, says which positions its rows
//! hold and what it has allocated; attention over it is
//! `crate::model::attention::per_head`.
//!
//! Each store keeps its history as its [`Retention`] says:
//!
//! * [`Retention::Full`]: every position, in a buffer that grows with the context;
//! * [`Retention::Stream`]: the first `sink` positions and the `window` most recent ones
//!   in a fixed ring of `sink + window` rows (a StreamingLLM / DuoAttention streaming
//!   head); position `p >= sink` lives in slot `sink + (p - sink) % window`;
//! * [`Retention::Tiered`]: a `Stream` ring in memory that every step reads (the hot
//!   tier) plus the whole history in a compressed cold tier ([`ColdFormat`]) that only
//!   steps where the head is marked active read.
//!
//! Keys are stored after RoPE, so a key keeps its absolute position wherever its row
//! sits. Memory is counted from the allocations themselves: the hot tier is the f32 key
//! and value buffers' capacity, the cold tier the compressed buffers' capacity, scales
//! included.

use std::borrow::Cow;

use half::f16;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How one KV head keeps its history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Every position.
    Full,
    /// The first `sink` positions and the `window` most recent ones.
    Stream { sink: usize, window: usize },
    /// `Stream` in the hot tier, everything in a cold tier read at active steps.
    Tiered {
        sink: usize,
        window: usize,
        cold: ColdFormat,
    },
}

/// Encoding of the cold tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ColdFormat {
    /// IEEE half precision: 2 bytes per value.
    #[default]
    F16,
    /// Signed 8-bit with one f32 scale per block of [`INT8_BLOCK`] values (absmax / 127):
    /// 1.125 bytes per value.
    Int8,
}

/// Values per scale in the int8 cold tier.
pub const INT8_BLOCK: usize = 32;

/// Resident KV bytes, per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvBytes {
    /// f32 keys and values every step may read.
    pub hot: usize,
    /// The compressed full history of tiered heads.
    pub cold: usize,
}

impl KvBytes {
    /// Hot plus cold.
    pub fn total(&self) -> usize {
        self.hot + self.cold
    }

    pub(crate) fn max(self, other: KvBytes) -> KvBytes {
        KvBytes {
            hot: self.hot.max(other.hot),
            cold: self.cold.max(other.cold),
        }
    }
}

/// A compressed, append-only copy of a head's keys or values, rows of `d` values.
#[derive(Debug, Clone)]
struct ColdRows {
    d: usize,
    data: ColdData,
}

#[derive(Debug, Clone)]
enum ColdData {
    F16(Vec<f16>),
    /// Blocks of [`INT8_BLOCK`] values within each row, one scale per block.
    Int8 {
        q: Vec<i8>,
        scales: Vec<f32>,
    },
}

impl ColdRows {
    /// Room for `rows` rows of `d` values.
    fn new(format: ColdFormat, d: usize, rows: usize) -> Self {
        let data = match format {
            ColdFormat::F16 => ColdData::F16(Vec::with_capacity(rows * d)),
            ColdFormat::Int8 => ColdData::Int8 {
                q: Vec::with_capacity(rows * d),
                scales: Vec::with_capacity(rows * d.div_ceil(INT8_BLOCK)),
            },
        };
        Self { d, data }
    }

    fn push(&mut self, row: &[f32]) {
        match &mut self.data {
            ColdData::F16(v) => v.extend(row.iter().map(|&x| f16::from_f32(x))),
            ColdData::Int8 { q, scales } => {
                for block in row.chunks(INT8_BLOCK) {
                    let absmax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let scale = absmax / 127.0;
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    scales.push(scale);
                    q.extend(block.iter().map(|&x| (x * inv).round() as i8));
                }
            }
        }
    }

    /// Append rows `rows` as f32 to `out`.
    fn read(&self, rows: std::ops::Range<usize>, out: &mut Vec<f32>) {
        let d = self.d;
        match &self.data {
            ColdData::F16(v) => {
                out.extend(v[rows.start * d..rows.end * d].iter().map(|x| x.to_f32()))
            }
            ColdData::Int8 { q, scales } => {
                let per_row = d.div_ceil(INT8_BLOCK);
                for r in rows {
                    let row = &q[r * d..(r + 1) * d];
                    for (b, block) in row.chunks(INT8_BLOCK).enumerate() {
                        let s = scales[r * per_row + b];
                        out.extend(block.iter().map(|&x| x as f32 * s));
                    }
                }
            }
        }
    }

    fn bytes(&self) -> usize {
        match &self.data {
            ColdData::F16(v) => v.capacity() * 2,
            ColdData::Int8 { q, scales } => q.capacity() + scales.capacity() * 4,
        }
    }
}

/// Keys and values `(rows, d)` a query reads: borrowed rows, or rows with a cold tier
/// dequantized after them.
pub(crate) type Readable<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>);

/// The stored rows of one KV head.
#[derive(Debug, Clone)]
pub(crate) struct HeadStore {
    pub(crate) retention: Retention,
    d: usize,
    /// Row-major `(rows, d)`; row `i` holds position `i` (full), the ring's slot `i`,
    /// or the position `kept[i]` (pressed).
    keys: Vec<f32>,
    values: Vec<f32>,
    /// Tiered heads: every position, compressed.
    cold: Option<(ColdRows, ColdRows)>,
    /// A full store a press evicted from: the position each row holds (the rows it
    /// kept, then every position appended after). `None`: row `i` holds what the
    /// retention's arithmetic says.
    kept: Option<Vec<usize>>,
}

impl HeadStore {
    pub(crate) fn new(retention: Retention, d: usize, capacity: usize) -> Self {
        let rows = match retention {
            Retention::Full => capacity,
            Retention::Stream { sink, window } | Retention::Tiered { sink, window, .. } => {
                (sink + window).min(capacity)
            }
        };
        let cold = match retention {
            Retention::Tiered { cold, .. } => Some((
                ColdRows::new(cold, d, capacity),
                ColdRows::new(cold, d, capacity),
            )),
            _ => None,
        };
        Self {
            retention,
            d,
            keys: Vec::with_capacity(rows * d),
            values: Vec::with_capacity(rows * d),
            cold,
            kept: None,
        }
    }

    /// `(sink, window)` of a ring, `None` for a full store.
    fn ring(&self) -> Option<(usize, usize)> {
        match self.retention {
            Retention::Full => None,
            Retention::Stream { sink, window } | Retention::Tiered { sink, window, .. } => {
                Some((sink, window))
            }
        }
    }

    /// Rows currently filled.
    fn rows(&self) -> usize {
        self.keys.len() / self.d
    }

    /// Store position `pos` (the next one: positions arrive in order).
    pub(crate) fn push(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        if let Some((ck, cv)) = &mut self.cold {
            ck.push(k);
            cv.push(v);
        }
        let rows = self.rows();
        let slot = match (&mut self.kept, self.retention) {
            (Some(kept), _) => {
                kept.push(pos);
                rows
            }
            (None, Retention::Stream { sink, window } | Retention::Tiered { sink, window, .. })
                if pos >= sink =>
            {
                sink + (pos - sink) % window
            }
            _ => pos,
        };
        let d = self.d;
        if slot >= self.rows() {
            // A ring filled from a window that starts mid-stream (a sliding-window
            // layer's prefill) fills its slots out of order; every slot is written before
            // a query reads it, as the window holds at least as many positions.
            self.keys.resize((slot + 1) * d, 0.0);
            self.values.resize((slot + 1) * d, 0.0);
        }
        self.keys[slot * d..(slot + 1) * d].copy_from_slice(k);
        self.values[slot * d..(slot + 1) * d].copy_from_slice(v);
    }

    /// Absolute position of every filled row when `len` positions were stored.
    fn positions(&self, len: usize) -> Vec<usize> {
        if let Some(kept) = &self.kept {
            return kept.clone();
        }
        let rows = self.rows();
        match self.ring() {
            None => (0..rows).collect(),
            Some((sink, window)) => (0..rows)
                .map(|i| {
                    if i < sink {
                        i
                    } else {
                        let r = i - sink;
                        sink + r + window * ((len - 1 - sink - r) / window)
                    }
                })
                .collect(),
        }
    }

    /// The cold positions an active tiered head reads besides its ring, given `len`
    /// stored positions: those between the sink and the window.
    fn cold_middle(&self, len: usize, active: bool) -> std::ops::Range<usize> {
        match (active, &self.cold, self.ring()) {
            (true, Some(_), Some((sink, window))) => sink..len.saturating_sub(window).max(sink),
            _ => 0..0,
        }
    }

    /// Keys and values `(rows, d)` a query may read, given `len` stored positions: the
    /// filled rows (borrowed), and for an active tiered head also its cold middle,
    /// dequantized after them.
    pub(crate) fn readable(&self, len: usize, active: bool) -> Readable<'_> {
        let middle = self.cold_middle(len, active);
        match &self.cold {
            Some((ck, cv)) if !middle.is_empty() => {
                let (mut keys, mut values) = (self.keys.clone(), self.values.clone());
                ck.read(middle.clone(), &mut keys);
                cv.read(middle, &mut values);
                (Cow::Owned(keys), Cow::Owned(values))
            }
            _ => (Cow::Borrowed(&self.keys), Cow::Borrowed(&self.values)),
        }
    }

    /// The positions of [`HeadStore::readable`]'s rows.
    pub(crate) fn readable_positions(&self, len: usize, active: bool) -> Vec<usize> {
        let mut positions = self.positions(len);
        positions.extend(self.cold_middle(len, active));
        positions
    }

    /// Whether a press evicted from this store (its rows are not positions in order).
    pub(crate) fn is_pressed(&self) -> bool {
        self.kept.is_some()
    }

    /// Keys `(rows, d)` row-major as stored.
    pub(crate) fn keys(&self) -> &[f32] {
        &self.keys
    }

    /// Keep only rows `rows` (ascending) of a full store, with room for `room` more
    /// positions: a press's eviction. The buffers are reallocated at their new size, so
    /// the memory is given back.
    pub(crate) fn keep(&mut self, rows: &[usize], room: usize) -> Result<()> {
        if self.retention != Retention::Full {
            return Err(Error::invalid(
                "press",
                "only a store that keeps every position can be pressed",
            ));
        }
        let (d, held) = (self.d, self.rows());
        if rows.windows(2).any(|w| w[0] >= w[1]) || rows.last().is_some_and(|&r| r >= held) {
            return Err(Error::invalid(
                "press",
                format!("rows to keep must ascend within the {held} stored"),
            ));
        }
        let positions = self.positions(held);
        let mut keys = Vec::with_capacity((rows.len() + room) * d);
        let mut values = Vec::with_capacity((rows.len() + room) * d);
        let mut kept = Vec::with_capacity(rows.len() + room);
        for &r in rows {
            keys.extend_from_slice(&self.keys[r * d..(r + 1) * d]);
            values.extend_from_slice(&self.values[r * d..(r + 1) * d]);
            kept.push(positions[r]);
        }
        (self.keys, self.values, self.kept) = (keys, values, Some(kept));
        Ok(())
    }

    pub(crate) fn bytes(&self) -> KvBytes {
        KvBytes {
            hot: (self.keys.capacity() + self.values.capacity()) * 4,
            cold: self.cold.as_ref().map_or(0, |(k, v)| k.bytes() + v.bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(retention: Retention) -> HeadStore {
        HeadStore::new(retention, 2, 64)
    }

    #[test]
    fn a_ring_keeps_exactly_the_sink_and_the_last_window_positions() {
        let mut s = store(Retention::Stream { sink: 2, window: 3 });
        for pos in 0..11 {
            s.push(pos, &[pos as f32, 0.0], &[0.0, pos as f32]);
            let len = pos + 1;
            let mut held = s.positions(len);
            // every row holds the key of the position the ring says it holds
            for (i, &p) in held.iter().enumerate() {
                assert_eq!(s.keys[i * 2] as usize, p, "len {len}");
                assert_eq!(s.values[i * 2 + 1] as usize, p, "len {len}");
            }
            held.sort_unstable();
            let want: Vec<usize> = (0..len).filter(|&p| p < 2 || p + 3 >= len).collect();
            assert_eq!(held, want, "len {len}");
        }
        assert_eq!(s.keys.capacity(), 5 * 2);
    }

    #[test]
    fn a_pressed_store_keeps_its_rows_and_appends_after_them() {
        let mut s = store(Retention::Full);
        for pos in 0..6 {
            s.push(pos, &[pos as f32, 0.0], &[0.0, pos as f32]);
        }
        s.keep(&[1, 4], 2).unwrap();
        s.push(6, &[6.0, 0.0], &[0.0, 6.0]);
        assert_eq!(s.positions(7), vec![1, 4, 6]);
        assert_eq!(s.keys(), &[1.0, 0.0, 4.0, 0.0, 6.0, 0.0]);
        assert_eq!(s.values, vec![0.0, 1.0, 0.0, 4.0, 0.0, 6.0]);
        // reallocated: 2 kept + 2 to come, keys and values, 2 floats each
        assert_eq!(s.bytes().hot, (2 + 2) * 2 * 2 * 4);
        // a pressed store is pressed again by row, a ring never
        s.keep(&[0, 2], 0).unwrap();
        assert_eq!(s.positions(7), vec![1, 6]);
        assert!(s.keep(&[2, 1], 0).is_err());
        assert!(s.keep(&[5], 0).is_err());
        let mut ring = store(Retention::Stream { sink: 1, window: 2 });
        ring.push(0, &[0.0, 0.0], &[0.0, 0.0]);
        assert!(ring.keep(&[0], 0).is_err());
    }

    #[test]
    fn the_cold_tier_round_trips_within_its_precision() {
        let row: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        for (format, tol) in [(ColdFormat::F16, 2e-3), (ColdFormat::Int8, 3.0 / 127.0)] {
            let mut c = ColdRows::new(format, 64, 2);
            c.push(&row);
            c.push(&row);
            let mut out = Vec::new();
            c.read(1..2, &mut out);
            let err = row
                .iter()
                .zip(&out)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= tol, "{format:?}: {err}");
        }
        // 2 rows of 64: f16 2 bytes a value, int8 1 byte plus a 4-byte scale per 32
        assert_eq!(ColdRows::new(ColdFormat::F16, 64, 2).bytes(), 256);
        assert_eq!(ColdRows::new(ColdFormat::Int8, 64, 2).bytes(), 128 + 16);
        // a row narrower than a block has one scale
        let mut narrow = ColdRows::new(ColdFormat::Int8, 8, 3);
        for r in 0..3 {
            narrow.push(&row[r * 8..(r + 1) * 8]);
        }
        let mut out = Vec::new();
        narrow.read(1..3, &mut out);
        let err = row[8..24]
            .iter()
            .zip(&out)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 3.0 / 127.0, "{err}");
        assert_eq!(narrow.bytes(), 24 + 3 * 4);
    }
}
