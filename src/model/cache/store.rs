//! One KV head's stored rows: what the KV cache ([`crate::model::HeadCache`]) is made
//! of. A store only stores: it appends positions, says which positions its rows hold (in
//! order, where they run consecutively to the last one) and what it has allocated;
//! attention over it is in `crate::model::attention`.
//!
//! Each store keeps its history as its [`Retention`] says:
//!
//! * [`Retention::Full`]: every position, in a buffer that grows with the context;
//! * [`Retention::Stream`]: the first `sink` positions and the `window` most recent ones
//!   in a fixed ring of `sink + window` rows (a StreamingLLM / DuoAttention streaming
//!   head); position `p >= sink` lives in slot `sink + (p - sink) % window`;
//! * [`Retention::Tiered`]: a `Stream` ring in memory that every step reads (the hot
//!   tier) plus the whole history in a compressed cold tier that only steps where the
//!   head is marked active read.
//!
//! Rows are held in a [`RowFormat`]: the hot rows in the cache's (f32 unless a policy
//! quantizes the KV), the cold tier in its own. Keys are stored after RoPE, so a key
//! keeps its absolute position wherever its row sits. Memory is counted from the
//! allocations themselves: the hot tier is the key and value buffers' capacity, the
//! cold tier the compressed buffers', scales included.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::model::cache::rows::{RowFormat, Rows, Run};
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
        cold: RowFormat,
    },
}

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

impl std::iter::Sum for KvBytes {
    fn sum<I: Iterator<Item = KvBytes>>(iter: I) -> KvBytes {
        iter.fold(KvBytes::default(), |acc, b| KvBytes {
            hot: acc.hot + b.hot,
            cold: acc.cold + b.cold,
        })
    }
}

/// Keys and values `(rows, d)` a query reads: borrowed rows, or rows decoded from a
/// quantized store or with a cold tier decoded after them.
pub type Readable<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>);

/// Keys or values `(rows, d)` in two parts, one after the other: rows shared with other
/// caches (a prompt prefix, [`HeadStore::share`]) and the store's own, or a ring's two
/// halves oldest first ([`HeadStore::in_order`]); each borrowed where stored as f32.
pub(crate) type Parts<'a> = [Cow<'a, [f32]>; 2];

/// Keys or values `(rows, d)` in two runs as the store holds them (f32, f16 or 8-bit),
/// one after the other like [`Parts`]; nothing decoded.
pub(crate) type Runs<'a> = [Run<'a>; 2];

/// `parts` as one run of rows (borrowed when one part is empty).
fn joined(parts: Parts<'_>) -> Cow<'_, [f32]> {
    match parts {
        [first, rest] if first.is_empty() => rest,
        [first, rest] => Cow::Owned([&first[..], &rest[..]].concat()),
    }
}

/// `parts` as one run read from float `at` on, then its first `at` floats (a ring read
/// oldest first).
fn turned(parts: Parts<'_>, at: usize) -> Parts<'_> {
    match joined(parts) {
        Cow::Borrowed(s) => [Cow::Borrowed(&s[at..]), Cow::Borrowed(&s[..at])],
        Cow::Owned(mut v) => {
            v.rotate_left(at);
            [Cow::Owned(v), Cow::Borrowed(&[])]
        }
    }
}

/// The stored rows of one KV head.
#[derive(Debug, Clone)]
pub(crate) struct HeadStore {
    pub(crate) retention: Retention,
    /// Row `i` holds position `i` (full), the ring's slot `i`, or the position `kept[i]`
    /// (pressed).
    keys: Rows,
    values: Rows,
    /// Tiered heads: every position, compressed.
    cold: Option<(Rows, Rows)>,
    /// A full store a press evicted from: the position each row holds (the rows it
    /// kept, then every position appended after). `None`: row `i` holds what the
    /// retention's arithmetic says.
    kept: Option<Vec<usize>>,
}

impl HeadStore {
    /// An empty store of rows of `d` values held as `format`, sized for `capacity`
    /// positions.
    pub(crate) fn new(retention: Retention, format: RowFormat, d: usize, capacity: usize) -> Self {
        let rows = match retention {
            Retention::Full => capacity,
            Retention::Stream { sink, window } | Retention::Tiered { sink, window, .. } => {
                (sink + window).min(capacity)
            }
        };
        let cold = match retention {
            Retention::Tiered { cold, .. } => {
                Some((Rows::new(cold, d, capacity), Rows::new(cold, d, capacity)))
            }
            _ => None,
        };
        Self {
            retention,
            keys: Rows::new(format, d, rows),
            values: Rows::new(format, d, rows),
            cold,
            kept: None,
        }
    }

    /// What [`HeadStore::new`] allocates for these arguments, without allocating.
    pub(crate) fn projected(
        retention: Retention,
        format: RowFormat,
        d: usize,
        capacity: usize,
    ) -> KvBytes {
        let (rows, cold) = match retention {
            Retention::Full => (capacity, None),
            Retention::Stream { sink, window } => ((sink + window).min(capacity), None),
            Retention::Tiered { sink, window, cold } => ((sink + window).min(capacity), Some(cold)),
        };
        KvBytes {
            hot: 2 * format.bytes(d, rows),
            cold: cold.map_or(0, |c| 2 * c.bytes(d, capacity)),
        }
    }

    /// Room for a sequence of `capacity` positions, as [`HeadStore::new`] would have
    /// allocated it (for a store no press has evicted from).
    pub(crate) fn reserve(&mut self, capacity: usize) {
        let rows = match self.ring() {
            None => capacity,
            Some((sink, window)) => (sink + window).min(capacity),
        };
        self.keys.reserve_rows(rows);
        self.values.reserve_rows(rows);
        if let Some((k, v)) = &mut self.cold {
            k.reserve_rows(capacity);
            v.reserve_rows(capacity);
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
        self.keys.len()
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
        // A ring filled from a window that starts mid-stream (a cache retained from one
        // whose ring had turned) fills its slots out of order; every slot is written
        // before a query reads it, as the window holds at least as many positions.
        self.keys.write(slot, k);
        self.values.write(slot, v);
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
    /// filled rows (borrowed where stored as f32, in place where shared), and for an
    /// active tiered head also its cold middle, dequantized after them.
    pub(crate) fn parts(&self, len: usize, active: bool) -> (Parts<'_>, Parts<'_>) {
        let middle = self.cold_middle(len, active);
        let (keys, values) = (self.keys.as_f32(), self.values.as_f32());
        match &self.cold {
            Some((ck, cv)) if !middle.is_empty() => {
                let (mut keys, mut values) = (keys.concat(), values.concat());
                ck.read(middle.clone(), &mut keys);
                cv.read(middle, &mut values);
                let none = || Cow::Borrowed(&[][..]);
                ([Cow::Owned(keys), none()], [Cow::Owned(values), none()])
            }
            _ => (keys, values),
        }
    }

    /// Whether the store holds a run of consecutive positions ending at the last one: a
    /// full store no press evicted from (every position), or a ring without sinks of
    /// the layer's own sliding `window` (its last `window` positions).
    pub(crate) fn holds_in_order(&self, window: Option<usize>) -> bool {
        match self.retention {
            Retention::Full => self.kept.is_none(),
            Retention::Stream { sink: 0, window: w } => window == Some(w),
            _ => false,
        }
    }

    /// Keys and values in position order, given `len` stored positions, for a store that
    /// [holds them in order](HeadStore::holds_in_order) (`None` for any other): a ring's
    /// two halves read oldest first. Borrowed where stored as f32.
    pub(crate) fn in_order(
        &self,
        len: usize,
        window: Option<usize>,
    ) -> Option<(Parts<'_>, Parts<'_>)> {
        if !self.holds_in_order(window) {
            return None;
        }
        let Some((_, w)) = self.ring() else {
            return Some((self.keys.as_f32(), self.values.as_f32()));
        };
        // The oldest position held, `len - rows`, sits in slot `(len - rows) % w`.
        let oldest = (len - self.rows()) % w * self.keys.d();
        Some((
            turned(self.keys.as_f32(), oldest),
            turned(self.values.as_f32(), oldest),
        ))
    }

    /// [`HeadStore::parts`] as the stored runs themselves, nothing decoded; `None` where
    /// an active tiered head reads its cold middle (rows of two formats).
    pub(crate) fn runs(&self, len: usize, active: bool) -> Option<(Runs<'_>, Runs<'_>)> {
        self.cold_middle(len, active)
            .is_empty()
            .then(|| (self.keys.runs(), self.values.runs()))
    }

    /// [`HeadStore::in_order`] as the stored runs themselves, nothing decoded.
    pub(crate) fn in_order_runs(
        &self,
        len: usize,
        window: Option<usize>,
    ) -> Option<(Runs<'_>, Runs<'_>)> {
        if !self.holds_in_order(window) {
            return None;
        }
        let Some((_, w)) = self.ring() else {
            return Some((self.keys.runs(), self.values.runs()));
        };
        // As in `in_order`: the oldest position held sits in slot `(len - rows) % w`.
        let oldest = (len - self.rows()) % w;
        let d = self.keys.d();
        // `share` leaves a ring's rows alone: they are all its own (`None` otherwise).
        fn turn(runs: Runs<'_>, oldest: usize, d: usize) -> Option<Runs<'_>> {
            let [shared, own] = runs;
            let (newer, older) = own.split_at(oldest, d);
            (shared.rows(d) == 0).then_some([older, newer])
        }
        Some((
            turn(self.keys.runs(), oldest, d)?,
            turn(self.values.runs(), oldest, d)?,
        ))
    }

    /// [`HeadStore::parts`] as one run of keys and one of values.
    pub(crate) fn readable(&self, len: usize, active: bool) -> Readable<'_> {
        let (keys, values) = self.parts(len, active);
        (joined(keys), joined(values))
    }

    /// Share the rows that are only ever appended to (a full store's, a tiered head's
    /// cold tier), so that clones read them in place: a prompt prefix continued by
    /// other sequences. A ring's rows are rewritten as it turns, so clones copy them.
    pub(crate) fn share(&mut self) {
        if self.retention == Retention::Full && self.kept.is_none() {
            self.keys.share();
            self.values.share();
        }
        if let Some((k, v)) = &mut self.cold {
            k.share();
            v.share();
        }
    }

    /// Bytes of [`HeadStore::bytes`] shared with another holder.
    pub(crate) fn shared_bytes(&self) -> KvBytes {
        self.sum_rows(Rows::shared_bytes)
    }

    /// Bytes of [`HeadStore::bytes`] behind a share, whoever else holds them.
    pub(crate) fn bytes_behind_shares(&self) -> KvBytes {
        self.sum_rows(Rows::bytes_behind_share)
    }

    /// `bytes` of the hot rows' keys and values and of the cold tier's.
    fn sum_rows(&self, bytes: impl Fn(&Rows) -> usize) -> KvBytes {
        KvBytes {
            hot: bytes(&self.keys) + bytes(&self.values),
            cold: self.cold.as_ref().map_or(0, |(k, v)| bytes(k) + bytes(v)),
        }
    }

    /// The positions of [`HeadStore::readable`]'s rows.
    pub(crate) fn readable_positions(&self, len: usize, active: bool) -> Vec<usize> {
        let mut positions = self.positions(len);
        positions.extend(self.cold_middle(len, active));
        positions
    }

    /// Whether [`HeadStore::truncate`] can go back to any position when `held` are
    /// stored: a full store no press evicted from, or a ring that has not turned yet.
    pub(crate) fn can_rewind(&self, held: usize) -> bool {
        self.kept.is_none()
            && self
                .ring()
                .is_none_or(|(sink, window)| held <= sink + window)
    }

    /// Forget the positions from `len` on (for a store that [can rewind](HeadStore::can_rewind)).
    pub(crate) fn truncate(&mut self, len: usize) {
        let rows = len.min(self.rows());
        self.keys.truncate(rows);
        self.values.truncate(rows);
        if let Some((k, v)) = &mut self.cold {
            k.truncate(len);
            v.truncate(len);
        }
    }

    /// Whether a press evicted from this store (its rows are not positions in order).
    pub(crate) fn is_pressed(&self) -> bool {
        self.kept.is_some()
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
        let held = self.rows();
        if rows.windows(2).any(|w| w[0] >= w[1]) || rows.last().is_some_and(|&r| r >= held) {
            return Err(Error::invalid(
                "press",
                format!("rows to keep must ascend within the {held} stored"),
            ));
        }
        let positions = self.positions(held);
        let mut kept = Vec::with_capacity(rows.len() + room);
        kept.extend(rows.iter().map(|&r| positions[r]));
        self.keys = self.keys.select(rows, room);
        self.values = self.values.select(rows, room);
        self.kept = Some(kept);
        Ok(())
    }

    /// Bytes allocated, shared rows included.
    pub(crate) fn bytes(&self) -> KvBytes {
        self.sum_rows(Rows::bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(retention: Retention) -> HeadStore {
        HeadStore::new(retention, RowFormat::F32, 2, 64)
    }

    #[test]
    fn a_ring_keeps_exactly_the_sink_and_the_last_window_positions() {
        let mut s = store(Retention::Stream { sink: 2, window: 3 });
        for pos in 0..11 {
            s.push(pos, &[pos as f32, 0.0], &[0.0, pos as f32]);
            let len = pos + 1;
            let mut held = s.positions(len);
            // every row holds the key of the position the ring says it holds
            let (keys, values) = s.readable(len, false);
            for (i, &p) in held.iter().enumerate() {
                assert_eq!(keys[i * 2] as usize, p, "len {len}");
                assert_eq!(values[i * 2 + 1] as usize, p, "len {len}");
            }
            held.sort_unstable();
            let want: Vec<usize> = (0..len).filter(|&p| p < 2 || p + 3 >= len).collect();
            assert_eq!(held, want, "len {len}");
        }
        assert_eq!(s.bytes().hot, 2 * 5 * 2 * 4);
    }

    #[test]
    fn a_ring_of_the_layers_window_reads_its_positions_oldest_first() {
        let window = Retention::Stream { sink: 0, window: 3 };
        let (mut ring, mut full) = (store(window), store(Retention::Full));
        for pos in 0..8 {
            for s in [&mut ring, &mut full] {
                s.push(pos, &[pos as f32, 1.0], &[1.0, pos as f32]);
            }
            let len = pos + 1;
            for (s, first) in [(&ring, len.saturating_sub(3)), (&full, 0)] {
                let (keys, values) = s.in_order(len, Some(3)).unwrap();
                let (keys, values) = (keys.concat(), values.concat());
                let want: Vec<f32> = (first..len).flat_map(|p| [p as f32, 1.0]).collect();
                assert_eq!(keys, want, "len {len}");
                let want: Vec<f32> = (first..len).flat_map(|p| [1.0, p as f32]).collect();
                assert_eq!(values, want, "len {len}");
            }
        }
        // Only a ring of the layer's own window without sinks, and an unpressed full
        // store, hold their positions in order.
        assert!(ring.in_order(8, Some(4)).is_none() && ring.in_order(8, None).is_none());
        assert!(store(Retention::Stream { sink: 1, window: 2 })
            .in_order(0, Some(3))
            .is_none());
        full.keep(&[0, 5], 0).unwrap();
        assert!(full.in_order(8, None).is_none());
    }

    #[test]
    fn full_stores_and_rings_that_have_not_turned_rewind() {
        let mut full = store(Retention::Full);
        let mut ring = store(Retention::Stream { sink: 1, window: 3 });
        for pos in 0..4 {
            for s in [&mut full, &mut ring] {
                s.push(pos, &[pos as f32, 0.0], &[0.0, pos as f32]);
            }
        }
        for s in [&mut full, &mut ring] {
            assert!(s.can_rewind(4));
            s.truncate(2);
            s.push(2, &[9.0, 0.0], &[0.0, 9.0]);
            assert_eq!(
                s.readable(3, false).0.as_ref(),
                &[0.0, 0.0, 1.0, 0.0, 9.0, 0.0]
            );
        }
        // A ring that turned no longer holds what a rewind would need.
        ring.push(3, &[3.0, 0.0], &[0.0, 3.0]);
        ring.push(4, &[4.0, 0.0], &[0.0, 4.0]);
        assert!(!ring.can_rewind(5) && full.can_rewind(3));
        full.keep(&[0], 0).unwrap();
        assert!(!full.can_rewind(3));
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
        let (keys, values) = s.readable(7, false);
        assert_eq!(keys.as_ref(), &[1.0, 0.0, 4.0, 0.0, 6.0, 0.0]);
        assert_eq!(values.as_ref(), &[0.0, 1.0, 0.0, 4.0, 0.0, 6.0]);
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
    fn full_stores_and_cold_tiers_are_shared_and_rings_are_copied() {
        let ring = Retention::Stream { sink: 1, window: 2 };
        let tiered = Retention::Tiered {
            sink: 1,
            window: 2,
            cold: RowFormat::F16,
        };
        for retention in [Retention::Full, ring, tiered] {
            // Key (position, holder): both holders wrote positions 0-4 as holder 1.
            let mut a = store(retention);
            for pos in 0..5 {
                a.push(pos, &[pos as f32, 1.0], &[1.0, pos as f32]);
            }
            a.share();
            let mut b = a.clone();
            let shared = a.shared_bytes();
            assert_eq!(
                shared.hot > 0,
                retention == Retention::Full,
                "{retention:?}"
            );
            assert_eq!(shared.cold > 0, retention == tiered, "{retention:?}");
            for pos in 5..8 {
                a.push(pos, &[pos as f32, 1.0], &[1.0, pos as f32]);
                b.push(pos, &[pos as f32, 2.0], &[2.0, pos as f32]);
            }
            for (holder, s) in [(1.0, &a), (2.0, &b)] {
                let (keys, values) = s.readable(8, true);
                let positions = s.readable_positions(8, true);
                assert_eq!(keys.len(), 2 * positions.len());
                for (i, &p) in positions.iter().enumerate() {
                    let who = if p < 5 { 1.0 } else { holder };
                    assert_eq!(keys[2 * i..2 * i + 2], [p as f32, who], "{retention:?}");
                    assert_eq!(values[2 * i..2 * i + 2], [who, p as f32], "{retention:?}");
                }
            }
        }
    }
}
