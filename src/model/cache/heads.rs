//! The KV cache: every (layer, KV head) stored separately (`HeadStore`), so that heads
//! can keep different amounts of history and the memory saved is real. The plain cache
//! ([`HeadCache::plain`]) is the case where every store keeps every position.
//!
//! Layers with the model's own sliding window (Gemma 3's local layers) always keep just
//! that window (`Stream { sink: 0, window }`), whatever was asked for them. Besides the
//! stores the cache holds what the next steps read: which tiered heads read their cold
//! tier ([`HeadCache::set_active`]) and which query heads are restricted to their top-k
//! keys ([`TopK`]). The attention that reads it is in `crate::model::attention`: in the
//! model's numerics for a layer whose stores hold their positions in order, else
//! `per_head`.

use serde::{Deserialize, Serialize};

use crate::model::cache::rows::RowFormat;
use crate::model::cache::store::{HeadStore, KvBytes, Parts, Readable, Retention, Runs};
use crate::model::Config;
use crate::{Error, Result};

/// Restrict a query head, at decode steps, to its `k` highest-scoring keys plus the
/// first `sink` positions and the `window` most recent ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopK {
    pub k: usize,
    pub sink: usize,
    pub window: usize,
}

/// Keys and values of every (layer, KV head), each kept as its [`Retention`] says.
#[derive(Debug, Clone)]
pub struct HeadCache {
    /// `layer * n_kv_heads + kv_head`.
    stores: Vec<HeadStore>,
    n_kv_heads: usize,
    n_heads: usize,
    /// Per layer: the model's sliding window, if the layer has one.
    windows: Vec<Option<usize>>,
    len: usize,
    /// Positions the stores were sized for (prompt plus new tokens).
    capacity: usize,
    max_len: usize,
    /// Per store: whether a tiered head reads its cold tier at the next step.
    active: Vec<bool>,
    /// Per `layer * n_heads + head`: a top-k restriction at decode steps.
    topk: Vec<Option<TopK>>,
    peak: KvBytes,
}

impl HeadCache {
    /// An empty cache whose stores hold their rows as `format`; `retention` has one
    /// entry per `layer * n_kv_heads + kv_head`. `capacity` is the expected number of
    /// positions (prompt plus new tokens): full stores reserve it up front and grow
    /// beyond it only if needed.
    pub fn new(
        cfg: &Config,
        retention: &[Retention],
        format: RowFormat,
        capacity: usize,
    ) -> Result<Self> {
        Ok(Self::with_stores(
            cfg,
            effective(cfg, retention)?,
            format,
            capacity,
        ))
    }

    /// The cache of [`HeadCache::new`] for retentions already made effective.
    fn with_stores(
        cfg: &Config,
        retention: Vec<Retention>,
        format: RowFormat,
        capacity: usize,
    ) -> Self {
        let n = cfg.n_layers * cfg.n_kv_heads;
        let capacity = capacity.clamp(1, cfg.context_length);
        let stores = retention
            .into_iter()
            .map(|r| HeadStore::new(r, format, cfg.d_head, capacity))
            .collect();
        Self {
            stores,
            n_kv_heads: cfg.n_kv_heads,
            n_heads: cfg.n_heads,
            windows: (0..cfg.n_layers).map(|l| cfg.layer(l).window).collect(),
            len: 0,
            capacity,
            max_len: cfg.context_length,
            active: vec![false; n],
            topk: vec![None; cfg.n_layers * cfg.n_heads],
            peak: KvBytes::default(),
        }
    }

    /// The bytes [`HeadCache::new`] would allocate for these arguments (full stores
    /// reserve `capacity` rows, rings their size, tiered heads' cold tiers `capacity`
    /// rows), without allocating: what a sequence of `capacity` positions holds at most
    /// under a policy that does not press (a press only gives rows back).
    pub fn projected_bytes(
        cfg: &Config,
        retention: &[Retention],
        format: RowFormat,
        capacity: usize,
    ) -> Result<KvBytes> {
        let capacity = capacity.clamp(1, cfg.context_length);
        Ok(effective(cfg, retention)?
            .into_iter()
            .map(|r| HeadStore::projected(r, format, cfg.d_head, capacity))
            .sum())
    }

    /// The plain cache for `capacity` expected positions: every store keeps every
    /// position as f32 (a sliding-window layer its window), so attention reads it as one
    /// run of keys per head in the model's own numerics.
    pub fn plain(cfg: &Config, capacity: usize) -> Self {
        let retention = (0..cfg.n_layers * cfg.n_kv_heads)
            .map(|i| own_window(cfg, i, Retention::Full))
            .collect();
        Self::with_stores(cfg, retention, RowFormat::F32, capacity)
    }

    /// A cache holding what this one holds (a prefill run with the plain cache) as
    /// `format`, each head then keeping only what its retention allows ("full prefill,
    /// then evict"). Every store of this cache must hold its positions in order.
    pub fn retained(
        &self,
        cfg: &Config,
        retention: &[Retention],
        format: RowFormat,
        capacity: usize,
    ) -> Result<Self> {
        let mut cache = Self::new(cfg, retention, format, capacity)?;
        let d = cfg.d_head;
        for layer in 0..cfg.n_layers {
            for kv_head in 0..cfg.n_kv_heads {
                let i = layer * cfg.n_kv_heads + kv_head;
                let (keys, values) = self.stores[i]
                    .in_order(self.len, self.windows[layer])
                    .ok_or_else(|| {
                        Error::invalid("cache", "only a plain cache can be retained anew")
                    })?;
                let (keys, values) = (keys.concat(), values.concat());
                // A sliding-window layer's ring holds its last positions, and the new
                // store of that layer is the same ring; every other store holds them all.
                let start = self
                    .len
                    .checked_sub(keys.len() / d)
                    .ok_or(Error::Internal("a store holds positions past its length"))?;
                let store = &mut cache.stores[i];
                for (r, (k, v)) in keys.chunks_exact(d).zip(values.chunks_exact(d)).enumerate() {
                    store.push(start + r, k, v);
                }
            }
        }
        cache.len = self.len;
        cache.peak = cache.bytes();
        Ok(cache)
    }

    /// The same cache made ready for a sequence of `capacity` positions in all (a copy
    /// of a shared prefix continued by another request): every store gets the room
    /// [`HeadCache::new`] would give it, and the peak restarts from what it holds. A
    /// cache a press evicted from is refused.
    pub fn with_capacity(mut self, capacity: usize) -> Result<Self> {
        if self.stores.iter().any(|s| s.is_pressed()) {
            return Err(Error::invalid(
                "cache",
                "a pressed cache cannot be continued by another sequence",
            ));
        }
        let capacity = capacity.clamp(self.len.max(1), self.max_len);
        for store in &mut self.stores {
            store.reserve(capacity);
        }
        self.capacity = capacity;
        self.peak = self.bytes();
        Ok(self)
    }

    /// Positions stored so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget everything after the first `len` positions (e.g. to generate again from
    /// there). Fails, changing nothing, if a store no longer holds a position it would
    /// need: a ring that turned (a sliding-window layer's after its window) or a store a
    /// press evicted from.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len {
            return Ok(());
        }
        if let Some(i) = self.stores.iter().position(|s| !s.can_rewind(self.len)) {
            return Err(Error::invalid(
                "truncate",
                format!(
                    "layer {} KV head {} no longer holds every position up to {}: cannot \
                     rewind to {len}",
                    i / self.n_kv_heads,
                    i % self.n_kv_heads,
                    self.len
                ),
            ));
        }
        for store in &mut self.stores {
            store.truncate(len);
        }
        self.len = len;
        Ok(())
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

    /// Keys (after RoPE) and values `(rows, d_head)` row-major that (`layer`,
    /// `kv_head`) holds, decoded to f32 from a quantized store; `None` unless the store
    /// keeps every position (the stores a press may evict from).
    pub fn full_store_rows(&self, layer: usize, kv_head: usize) -> Option<Readable<'_>> {
        let store = self.stores.get(layer * self.n_kv_heads + kv_head)?;
        (store.retention == Retention::Full).then(|| store.readable(self.len, false))
    }

    /// Keep only rows `rows` (ascending indices into [`HeadCache::full_store_rows`]) of
    /// the full store (`layer`, `kv_head`), with room for the positions still to come:
    /// a press's eviction, between the prefill and the first decode step. The peak
    /// restarts from what is resident after it (the prefill reports its own).
    pub fn keep(&mut self, layer: usize, kv_head: usize, rows: &[usize]) -> Result<()> {
        let n_layers = self.stores.len() / self.n_kv_heads;
        Error::check_head(layer, kv_head, n_layers, self.n_kv_heads)?;
        let room = self.capacity.saturating_sub(self.len);
        self.stores[layer * self.n_kv_heads + kv_head].keep(rows, room)?;
        self.peak = self.bytes();
        Ok(())
    }

    /// Bytes allocated now.
    pub fn bytes(&self) -> KvBytes {
        self.stores.iter().map(HeadStore::bytes).sum()
    }

    /// Of [`HeadCache::bytes`], what is shared with another cache (rows of a prompt
    /// prefix read in place, [`HeadCache::share`]): what dropping this cache would not
    /// free.
    pub fn shared_bytes(&self) -> KvBytes {
        self.stores.iter().map(HeadStore::shared_bytes).sum()
    }

    /// Of [`HeadCache::bytes`], the rows behind a share ([`HeadCache::share`]), whoever
    /// else holds them: what a clone of this cache reads in place instead of copying.
    pub fn bytes_behind_shares(&self) -> KvBytes {
        self.stores.iter().map(HeadStore::bytes_behind_shares).sum()
    }

    /// Share the positions stored so far copy-on-write: clones of this cache (and this
    /// cache itself) read them in place and append their own positions after them. Full
    /// stores and cold tiers are shared; rings, rewritten as they turn, are copied by
    /// each clone. The same bits are read either way.
    pub fn share(&mut self) {
        for store in &mut self.stores {
            store.share();
        }
    }

    /// The largest [`HeadCache::bytes`] seen after any forward step since the cache was
    /// made or last pressed ([`HeadCache::keep`]).
    pub fn peak_bytes(&self) -> KvBytes {
        self.peak
    }

    /// Check that a chunk of `q` positions at `start` continues the cache and fits the
    /// context. A single position may lie past the cache's length: a later token of a
    /// batched row ([`crate::model::Model::decode_batch`]), whose earlier tokens are
    /// stored but committed with it at the end of the pass.
    pub(crate) fn check_chunk(&self, start: usize, q: usize) -> Result<()> {
        if start + q > self.max_len {
            return Err(Error::ContextOverflow {
                prompt: start + q,
                max_new: 0,
                context: self.max_len,
            });
        }
        if start < self.len || q > 1 && start != self.len {
            return Err(Error::invalid(
                "cache",
                format!("chunk at {start}, cache holds {}", self.len),
            ));
        }
        Ok(())
    }

    /// Whether every store of `layer` holds a run of consecutive positions ending at the
    /// last one ([`HeadStore::in_order`]) and no query head of it has a top-k: the
    /// layer reads like a plain cache.
    pub(crate) fn reads_in_order(&self, layer: usize) -> bool {
        let (stores, _) = self.layer(layer);
        stores.iter().all(|s| s.holds_in_order(self.windows[layer]))
            && (0..self.n_heads).all(|h| self.topk(layer, h).is_none())
    }

    /// Whether every layer reads like a plain cache (`HeadCache::reads_in_order`).
    pub fn is_plain(&self) -> bool {
        (0..self.windows.len()).all(|l| self.reads_in_order(l))
    }

    /// Each KV head's keys and values of `layer` in position order, given `len` stored
    /// positions; `None` unless the layer [reads in order](HeadCache::reads_in_order).
    pub(crate) fn in_order(&self, layer: usize, len: usize) -> Option<Vec<(Parts<'_>, Parts<'_>)>> {
        let (stores, _) = self.layer(layer);
        stores
            .iter()
            .map(|s| s.in_order(len, self.windows[layer]))
            .collect()
    }

    /// [`HeadCache::in_order`] as the stored runs themselves (f32, f16 or 8-bit rows),
    /// nothing decoded: what a decode step reads in place.
    pub(crate) fn in_order_runs(
        &self,
        layer: usize,
        len: usize,
    ) -> Option<Vec<(Runs<'_>, Runs<'_>)>> {
        let (stores, _) = self.layer(layer);
        stores
            .iter()
            .map(|s| s.in_order_runs(len, self.windows[layer]))
            .collect()
    }

    /// The stores of `layer` (one per KV head) and whether each reads its cold tier.
    pub(crate) fn layer(&self, layer: usize) -> (&[HeadStore], &[bool]) {
        let range = layer * self.n_kv_heads..(layer + 1) * self.n_kv_heads;
        (&self.stores[range.clone()], &self.active[range])
    }

    /// The store of (`layer`, `kv_head`), to append to.
    pub(crate) fn store_mut(&mut self, layer: usize, kv_head: usize) -> &mut HeadStore {
        &mut self.stores[layer * self.n_kv_heads + kv_head]
    }

    /// The top-k restriction of (`layer`, query `head`) at decode steps.
    pub(crate) fn topk(&self, layer: usize, head: usize) -> Option<TopK> {
        self.topk[layer * self.n_heads + head]
    }

    /// Advance the length by `q` positions once every layer stored them.
    pub(crate) fn commit(&mut self, q: usize) {
        self.len += q;
        self.peak = self.peak.max(self.bytes());
    }
}

/// The retention store `i` (`layer * n_kv_heads + kv_head`) of `cfg` gets when `r` is
/// asked: a sliding-window layer keeps its window.
fn own_window(cfg: &Config, i: usize, r: Retention) -> Retention {
    match cfg.layer(i / cfg.n_kv_heads).window {
        Some(window) => Retention::Stream { sink: 0, window },
        None => r,
    }
}

/// The retention each store of `cfg` gets for `retention` (one entry per `layer *
/// n_kv_heads + kv_head`): a sliding-window layer keeps its window whatever was asked.
/// A count that does not fit or a window of 0 is an error.
fn effective(cfg: &Config, retention: &[Retention]) -> Result<Vec<Retention>> {
    let n = cfg.n_layers * cfg.n_kv_heads;
    if retention.len() != n {
        return Err(Error::invalid(
            "retention",
            format!("{} entries for {n} KV heads", retention.len()),
        ));
    }
    retention
        .iter()
        .enumerate()
        .map(|(i, &r)| match own_window(cfg, i, r) {
            Retention::Stream { window: 0, .. } | Retention::Tiered { window: 0, .. } => {
                Err(Error::invalid("window", "0 (must be at least 1)"))
            }
            r => Ok(r),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::tests::tiny;
    use crate::model::config::SlidingWindow;

    /// [`tiny`] with every second layer global, the others a sliding window of `size`.
    fn windowed(size: usize) -> Config {
        let mut cfg = tiny();
        cfg.sliding_window = Some(SlidingWindow {
            size,
            global_every: 2,
            local_rope_base: 1e4,
        });
        cfg
    }

    #[test]
    fn projected_bytes_are_what_a_new_cache_allocates() {
        for cfg in [tiny(), windowed(5)] {
            let n = cfg.n_layers * cfg.n_kv_heads;
            let kinds = [
                Retention::Full,
                Retention::Stream { sink: 2, window: 7 },
                Retention::Tiered {
                    sink: 1,
                    window: 3,
                    cold: RowFormat::Q8_0,
                },
            ];
            let retention: Vec<Retention> = (0..n).map(|i| kinds[i % 3]).collect();
            for format in [RowFormat::F32, RowFormat::F16, RowFormat::Q8_0] {
                for capacity in [1, 6, 40, 10_000] {
                    let made = HeadCache::new(&cfg, &retention, format, capacity).unwrap();
                    let projected =
                        HeadCache::projected_bytes(&cfg, &retention, format, capacity).unwrap();
                    assert_eq!(projected, made.bytes(), "{format:?} at {capacity}");
                    assert!(projected.hot > 0);
                }
            }
        }
        assert!(HeadCache::projected_bytes(&tiny(), &[], RowFormat::F32, 4).is_err());
    }

    /// A cache of `capacity` positions with `filled` positions stored in every store.
    fn filled(
        cfg: &Config,
        retention: &[Retention],
        format: RowFormat,
        capacity: usize,
        filled: usize,
    ) -> HeadCache {
        fill(
            cfg,
            HeadCache::new(cfg, retention, format, capacity).unwrap(),
            filled,
        )
    }

    /// `cache` with positions `0..filled` stored in every store.
    fn fill(cfg: &Config, mut cache: HeadCache, filled: usize) -> HeadCache {
        for pos in 0..filled {
            let row: Vec<f32> = (0..cfg.d_head)
                .map(|i| (pos * 7 + i) as f32 / 10.0)
                .collect();
            for layer in 0..cfg.n_layers {
                for h in 0..cfg.n_kv_heads {
                    cache.store_mut(layer, h).push(pos, &row, &row);
                }
            }
            cache.commit(1);
        }
        cache
    }

    #[test]
    fn a_plain_cache_reads_in_order_and_is_retained_as_a_policy_asks() {
        let gemma = windowed(3);
        let n = gemma.n_layers * gemma.n_kv_heads;
        let plain = fill(&gemma, HeadCache::plain(&gemma, 8), 6);
        assert!(plain.is_plain());
        let ring = Retention::Stream { sink: 1, window: 2 };
        let policy = plain
            .retained(&gemma, &vec![ring; n], RowFormat::F32, 8)
            .unwrap();
        assert!(!policy.is_plain());
        let again = policy.retained(&gemma, &vec![Retention::Full; n], RowFormat::F32, 8);
        assert!(again
            .unwrap_err()
            .to_string()
            .contains("only a plain cache"));
        // Windowed layers hold their window whatever was asked; the others the ring.
        for layer in 0..gemma.n_layers {
            let window = gemma.layer(layer).window;
            assert_eq!(
                policy.reads_in_order(layer),
                window.is_some(),
                "layer {layer}"
            );
            let (stores, _) = policy.layer(layer);
            let want: Vec<usize> = match window {
                Some(w) => (6 - w..6).collect(),
                None => vec![0, 4, 5],
            };
            let mut held = stores[0].readable_positions(6, false);
            held.sort_unstable();
            assert_eq!(held, want, "layer {layer}");
        }
        // A top-k on one query head makes its layer read per head.
        let mut topk = plain.clone();
        let tk = TopK {
            k: 1,
            sink: 0,
            window: 1,
        };
        topk.set_topk(1, 0, Some(tk)).unwrap();
        assert!(topk.reads_in_order(0) && !topk.reads_in_order(1) && !topk.is_plain());
        // Rewinding past a windowed layer's turned ring fails and changes nothing.
        let mut rewound = plain.clone();
        let err = rewound.truncate(2).unwrap_err().to_string();
        assert!(err.contains("cannot rewind"), "{err}");
        assert_eq!(rewound.len(), 6);
        let global = rewound.layer(1).0[0].readable_positions(6, false);
        assert_eq!(
            global,
            (0..6).collect::<Vec<_>>(),
            "the full layer kept its rows"
        );
        let mut plain = fill(&tiny(), HeadCache::plain(&tiny(), 8), 6);
        plain.truncate(2).unwrap();
        assert_eq!(plain.len(), 2);
        assert_eq!(plain.layer(0).0[0].readable_positions(2, false), vec![0, 1]);
    }

    #[test]
    fn a_copied_cache_made_ready_for_more_positions_holds_what_a_new_one_would() {
        let cfg = tiny();
        let n = cfg.n_layers * cfg.n_kv_heads;
        let kinds = [
            Retention::Full,
            Retention::Stream { sink: 2, window: 9 },
            Retention::Tiered {
                sink: 1,
                window: 3,
                cold: RowFormat::F16,
            },
        ];
        let retention: Vec<Retention> = (0..n).map(|i| kinds[i % 3]).collect();
        for format in [RowFormat::F32, RowFormat::Q8_0] {
            let copy = filled(&cfg, &retention, format, 6, 6).clone();
            let ready = copy.with_capacity(40).unwrap();
            let fresh = filled(&cfg, &retention, format, 40, 6);
            assert_eq!(ready.bytes(), fresh.bytes(), "{format:?}");
            assert_eq!(ready.peak_bytes(), ready.bytes());
            assert_eq!(ready.len(), 6);
        }
        let mut pressed = filled(&cfg, &vec![Retention::Full; n], RowFormat::F32, 8, 8);
        pressed.keep(0, 0, &[0, 3]).unwrap();
        assert!(pressed.with_capacity(20).is_err());
    }
}
