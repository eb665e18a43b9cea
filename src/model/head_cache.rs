//! A KV cache that stores every (layer, KV head) separately, so that heads can keep
//! different amounts of history and the memory saved is real.
//!
//! Each KV head has a [`Retention`]:
//!
//! * [`Retention::Full`]: every position, in a buffer that grows with the context;
//! * [`Retention::Stream`]: the first `sink` positions and the `window` most recent ones
//!   in a fixed ring of `sink + window` rows (a StreamingLLM / DuoAttention streaming
//!   head); position `p >= sink` lives in slot `sink + (p - sink) % window`;
//! * [`Retention::Tiered`]: a `Stream` ring in memory that every step reads (the hot
//!   tier) plus the whole history in a compressed cold tier ([`ColdFormat`]) that only
//!   steps where the head is marked active ([`HeadCache::set_active`]) read.
//!
//! Layers with the model's own sliding window (Gemma 3's local layers) always keep just
//! that window (`Stream { sink: 0, window }`), whatever was asked for them.
//!
//! Keys are stored after RoPE, so a key keeps its absolute position wherever its row
//! sits. At a decode step every stored row is visible to the query (it is exactly what
//! the retention allows); in a prefill chunk the visible rows are masked per query.
//! Query heads can further be restricted at decode steps to their top-k keys
//! ([`TopK`]), plus a sink and a recent window.
//!
//! Memory is counted from the allocations themselves ([`HeadCache::bytes`]): the hot
//! tier is every f32 key and value buffer's capacity, the cold tier every compressed
//! buffer's capacity, scales included.

use std::borrow::Cow;

use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::model::attention::{self, KvRows};
use crate::model::{Config, KvCache};
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

/// Restrict a query head, at decode steps, to its `k` highest-scoring keys plus the
/// first `sink` positions and the `window` most recent ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopK {
    pub k: usize,
    pub sink: usize,
    pub window: usize,
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

    fn max(self, other: KvBytes) -> KvBytes {
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
type Readable<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>);

/// The stored rows of one KV head.
#[derive(Debug, Clone)]
struct HeadStore {
    retention: Retention,
    d: usize,
    /// Row-major `(rows, d)`; row `i` holds position `i` (full) or the ring's slot `i`.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// Tiered heads: every position, compressed.
    cold: Option<(ColdRows, ColdRows)>,
}

impl HeadStore {
    fn new(retention: Retention, d: usize, capacity: usize) -> Self {
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
    fn push(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        if let Some((ck, cv)) = &mut self.cold {
            ck.push(k);
            cv.push(v);
        }
        let slot = match self.ring() {
            Some((sink, window)) if pos >= sink => sink + (pos - sink) % window,
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
    fn readable(&self, len: usize, active: bool) -> Readable<'_> {
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
    fn readable_positions(&self, len: usize, active: bool) -> Vec<usize> {
        let mut positions = self.positions(len);
        positions.extend(self.cold_middle(len, active));
        positions
    }

    fn bytes(&self) -> KvBytes {
        KvBytes {
            hot: (self.keys.capacity() + self.values.capacity()) * 4,
            cold: self.cold.as_ref().map_or(0, |(k, v)| k.bytes() + v.bytes()),
        }
    }
}

/// Keys and values of every (layer, KV head), each kept as its [`Retention`] says.
#[derive(Debug, Clone)]
pub struct HeadCache {
    /// `layer * n_kv_heads + kv_head`.
    stores: Vec<HeadStore>,
    n_kv_heads: usize,
    n_heads: usize,
    len: usize,
    max_len: usize,
    /// Per store: whether a tiered head reads its cold tier at the next step.
    active: Vec<bool>,
    /// Per `layer * n_heads + head`: a top-k restriction at decode steps.
    topk: Vec<Option<TopK>>,
    peak: KvBytes,
}

impl HeadCache {
    /// An empty cache; `retention` has one entry per `layer * n_kv_heads + kv_head`.
    /// `capacity` is the expected number of positions (prompt plus new tokens): full
    /// stores reserve it up front and grow beyond it only if needed.
    pub fn new(cfg: &Config, retention: &[Retention], capacity: usize) -> Result<Self> {
        let n = cfg.n_layers * cfg.n_kv_heads;
        if retention.len() != n {
            return Err(Error::invalid(
                "retention",
                format!("{} entries for {n} KV heads", retention.len()),
            ));
        }
        let capacity = capacity.clamp(1, cfg.context_length);
        let mut stores = Vec::with_capacity(n);
        for (i, &r) in retention.iter().enumerate() {
            let r = match cfg.layer(i / cfg.n_kv_heads).window {
                Some(window) => Retention::Stream { sink: 0, window },
                None => r,
            };
            if let Retention::Stream { window: 0, .. } | Retention::Tiered { window: 0, .. } = r {
                return Err(Error::invalid("window", "0 (must be at least 1)"));
            }
            stores.push(HeadStore::new(r, cfg.d_head, capacity));
        }
        Ok(Self {
            stores,
            n_kv_heads: cfg.n_kv_heads,
            n_heads: cfg.n_heads,

            len: 0,
            max_len: cfg.context_length,
            active: vec![false; n],
            topk: vec![None; cfg.n_layers * cfg.n_heads],
            peak: KvBytes::default(),
        })
    }

    /// A cache holding what `kv` holds (a prefill run with the plain cache), each head
    /// then keeping only what its retention allows ("full prefill, then evict").
    pub fn from_kv(
        cfg: &Config,
        kv: &KvCache,
        retention: &[Retention],
        capacity: usize,
    ) -> Result<Self> {
        let mut cache = Self::new(cfg, retention, capacity)?;
        let d = cfg.d_head;
        for layer in 0..cfg.n_layers {
            let Some((keys, values, start)) = kv.layer_rows(layer)? else {
                continue;
            };
            let (keys, values) = (keys.to_vec3::<f32>()?, values.to_vec3::<f32>()?);
            for kv_head in 0..cfg.n_kv_heads {
                let store = &mut cache.stores[layer * cfg.n_kv_heads + kv_head];
                if start > 0 && !matches!(store.retention, Retention::Stream { sink: 0, .. }) {
                    return Err(Error::invalid(
                        "cache",
                        format!("layer {layer} dropped positions a full store needs"),
                    ));
                }
                for (i, (k, v)) in keys[kv_head].iter().zip(&values[kv_head]).enumerate() {
                    debug_assert_eq!(k.len(), d);
                    store.push(start + i, k, v);
                }
            }
        }
        cache.len = kv.len();
        cache.peak = cache.bytes();
        Ok(cache)
    }

    /// Positions stored so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Mark which tiered KV heads read their cold tier at the next steps
    /// (`layer * n_kv_heads + kv_head`); other heads ignore the flag.
    pub fn set_active(&mut self, active: &[bool]) -> Result<()> {
        if active.len() != self.active.len() {
            return Err(Error::invalid(
                "active heads",
                format!("{} flags for {} KV heads", active.len(), self.active.len()),
            ));
        }
        self.active.copy_from_slice(active);
        Ok(())
    }

    /// Restrict (layer, query head) at decode steps to its top-k keys (`None`: lift it).
    pub fn set_topk(&mut self, layer: usize, head: usize, topk: Option<TopK>) -> Result<()> {
        let n_layers = self.stores.len() / self.n_kv_heads;
        Error::check_head(layer, head, n_layers, self.n_heads)?;
        self.topk[layer * self.n_heads + head] = topk;
        Ok(())
    }

    /// Bytes allocated now.
    pub fn bytes(&self) -> KvBytes {
        self.stores.iter().fold(KvBytes::default(), |acc, s| {
            let b = s.bytes();
            KvBytes {
                hot: acc.hot + b.hot,
                cold: acc.cold + b.cold,
            }
        })
    }

    /// The largest [`HeadCache::bytes`] seen after any forward step.
    pub fn peak_bytes(&self) -> KvBytes {
        self.peak
    }

    /// Attention of one layer for queries at positions `start..start + q`: stores the
    /// new keys and values `(n_kv_heads, q, d_head)` (after RoPE) and attends with
    /// `queries` `(n_heads, q, d_head)` (after RoPE) over what each head keeps.
    /// Returns `(n_heads, q, d_head)`.
    pub(crate) fn attend(
        &mut self,
        layer: usize,
        queries: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        start: usize,
    ) -> Result<Tensor> {
        let (nh, q_len, dh) = queries.dims3()?;
        if start + q_len > self.max_len {
            return Err(Error::ContextOverflow {
                prompt: start + q_len,
                max_new: 0,
                context: self.max_len,
            });
        }
        if start != self.len {
            return Err(Error::invalid(
                "cache",
                format!("chunk at {start}, cache holds {}", self.len),
            ));
        }
        let nkv = self.n_kv_heads;
        let group = nh / nkv;
        let base = layer * nkv;
        let new_k = keys.to_vec3::<f32>()?;
        let new_v = values.to_vec3::<f32>()?;
        if q_len == 1 {
            for h in 0..nkv {
                self.stores[base + h].push(start, &new_k[h][0], &new_v[h][0]);
            }
            let len = start + 1;
            let active = &self.active;
            let stores = &self.stores[base..base + nkv];
            let reads: Vec<Readable> = stores
                .par_iter()
                .enumerate()
                .map(|(h, s)| s.readable(len, active[base + h]))
                .collect();
            let q: Vec<f32> = queries.flatten_all()?.to_vec1()?;
            let masks: Vec<Option<Vec<f32>>> = (0..nh)
                .map(|h| {
                    self.topk[layer * self.n_heads + h].map(|tk| {
                        let kv = h / group;
                        let pos = stores[kv].readable_positions(len, active[base + kv]);
                        topk_bias(&q[h * dh..(h + 1) * dh], &reads[kv].0, &pos, len - 1, tk)
                    })
                })
                .collect();
            let rows: Vec<KvRows> = reads
                .iter()
                .map(|(k, v)| KvRows {
                    keys: k,
                    values: v,
                    len: k.len() / dh,
                })
                .collect();
            let masks: Vec<Option<&[f32]>> = masks.iter().map(|m| m.as_deref()).collect();
            let (out, _) = attention::decode_rows(&q, dh, &rows, &masks, false);
            return Ok(Tensor::from_vec(out, (nh, 1, dh), &Device::Cpu)?);
        }
        // A prefill chunk: per KV head, the rows stored before it plus the chunk's own.
        let mut outs = Vec::with_capacity(nkv);
        for h in 0..nkv {
            let store = &self.stores[base + h];
            let (mut k, mut v, mut pos) = if start == 0 {
                (Vec::new(), Vec::new(), Vec::new())
            } else {
                let (k, v) = store.readable(start, true);
                (
                    k.into_owned(),
                    v.into_owned(),
                    store.readable_positions(start, true),
                )
            };
            for t in 0..q_len {
                k.extend_from_slice(&new_k[h][t]);
                v.extend_from_slice(&new_v[h][t]);
                pos.push(start + t);
            }
            let n = pos.len();
            let qg = queries.narrow(0, h * group, group)?.contiguous()?;
            let kt = Tensor::from_vec(k, (1, n, dh), &Device::Cpu)?;
            let vt = Tensor::from_vec(v, (1, n, dh), &Device::Cpu)?;
            // A full head's rows are positions `0..start + q` in order: plain causal
            // attention, by query blocks. A ring (and a tiered head, whose cold rows
            // follow its ring's) is masked by its rows' positions, one `(q, n)` mask for
            // every query head of the group.
            let out = match store.retention {
                Retention::Full => attention::blocked(&qg, &kt, &vt, start, None, None)?,
                Retention::Stream { sink, window } => {
                    let mask = ring_mask(&pos, start, q_len, Some((sink, window)))?;
                    attention::batched(&qg, &kt, &vt, None, Some(&mask))?.0
                }
                Retention::Tiered { .. } => {
                    let mask = ring_mask(&pos, start, q_len, None)?;
                    attention::batched(&qg, &kt, &vt, None, Some(&mask))?.0
                }
            };
            outs.push(out);
        }
        for h in 0..nkv {
            for t in 0..q_len {
                self.stores[base + h].push(start + t, &new_k[h][t], &new_v[h][t]);
            }
        }
        Ok(Tensor::cat(&outs, 0)?)
    }

    /// Advance the length by `q` positions once every layer stored them.
    pub(crate) fn commit(&mut self, q: usize) {
        self.len += q;
        self.peak = self.peak.max(self.bytes());
    }
}

/// The additive mask `(q, n)` of a prefill chunk: query `start + t` sees the key at
/// `positions[j]` when it is not in the future and, for a ring `(sink, window)`, when it
/// is a sink position or within the window.
fn ring_mask(
    positions: &[usize],
    start: usize,
    q: usize,
    ring: Option<(usize, usize)>,
) -> Result<Tensor> {
    let mask: Vec<f32> = (0..q)
        .flat_map(|t| {
            let query = start + t;
            positions.iter().map(move |&p| {
                let visible =
                    p <= query && ring.is_none_or(|(sink, window)| p < sink || p + window > query);
                if visible {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (q, positions.len()), &Device::Cpu)?)
}

/// Additive bias over a head's readable rows that keeps the `k` best-scoring keys, the
/// first `sink` positions and the `window` most recent ones for a query at `query`.
fn topk_bias(q: &[f32], keys: &[f32], positions: &[usize], query: usize, tk: TopK) -> Vec<f32> {
    let d = q.len();
    let protected = |p: usize| p < tk.sink || p + tk.window > query;
    let mut scores: Vec<(f32, usize)> = positions
        .iter()
        .enumerate()
        .filter(|(_, &p)| !protected(p))
        .map(|(i, _)| {
            let k = &keys[i * d..(i + 1) * d];
            (q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>(), i)
        })
        .collect();
    let mut bias: Vec<f32> = positions
        .iter()
        .map(|&p| if protected(p) { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    let k = tk.k.min(scores.len());
    if k > 0 {
        scores.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0));
        for &(_, i) in &scores[..k] {
            bias[i] = 0.0;
        }
    }
    bias
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

    #[test]
    fn topk_keeps_the_best_keys_the_sink_and_the_window() {
        // query (1, 0); key j scores j's first component
        let positions: Vec<usize> = (0..8).collect();
        let scores = [5.0, 0.0, 9.0, 1.0, 8.0, 2.0, 0.0, 0.0];
        let keys: Vec<f32> = scores.iter().flat_map(|&s| [s, 0.0]).collect();
        let tk = TopK {
            k: 2,
            sink: 1,
            window: 2,
        };
        let bias = topk_bias(&[1.0, 0.0], &keys, &positions, 7, tk);
        let kept: Vec<usize> = (0..8).filter(|&i| bias[i] == 0.0).collect();
        assert_eq!(kept, vec![0, 2, 4, 6, 7]);
    }
}
