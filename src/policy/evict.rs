//! Token eviction, the split of kvpress's `ScorerPress`: a press's scorer gives every
//! position a KV head stores a score ([`TokenScorer`]), and one selector keeps the
//! highest-scoring rows within a [`Budget`] ([`Eviction::press`]). Each KV head keeps
//! its own positions, in its own store, so the memory given back is real. It runs after
//! a full prefill of what is pressed: the context, when the request says where its
//! question starts (then the question runs over what was kept), else the whole prompt
//! but its last token.
//!
//! A scorer that reads attention says which queries it needs ([`Observe`]); the prefill
//! then runs those positions with the model's own attention probabilities observed and
//! summed per (layer, query head, key) ([`Observed`]), so the scores see exactly the
//! softmax the model computed (its scaling, its masks), not a recomputation. A scorer
//! that reads the queries' statistics instead (expected attention) gets each query
//! head's mean and covariance over the pressed positions ([`QueryMoments`]).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use candle_core::Tensor;

use crate::model::{Config, HeadCache, LayerSpec, Observer, Wants};
use crate::{Error, Result};

/// Which queries' attention a scorer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observe {
    /// None: the keys are enough.
    Keys,
    /// The last `n` positions of what is pressed (SnapKV's observation window).
    Last(usize),
    /// Every position of what is pressed (H2O's accumulated attention).
    All,
    /// No attention: the mean and covariance of each query head's queries before RoPE
    /// over the pressed positions but the first `skip` (expected attention).
    QueryMoments { skip: usize },
    /// The most attention each pressed position gets while the model re-reads what is
    /// pressed after a repeat instruction, `chunk` positions per pass (KVzip).
    Reconstruct { chunk: usize },
}

/// What a scorer sees of one KV head: its keys and values and, when it observes them,
/// the attention its layer's query heads gave each row or their queries' moments.
#[derive(Debug, Clone)]
pub struct Rows<'a> {
    /// `(n, d_head)` row-major, after RoPE; row `j` is position `j`.
    pub keys: &'a [f32],
    /// `(n, d_head)` row-major.
    pub values: &'a [f32],
    pub d_head: usize,
    /// The KV head's query heads (indices into `attention`'s first axis).
    pub group: Range<usize>,
    /// `(n_heads, n)`: attention each query head of the layer gave row `j`, summed over
    /// the observed queries ([`Observe::Reconstruct`]: the most any reconstruction query
    /// gave it); `None` when the scorer observes no attention.
    pub attention: Option<&'a [f32]>,
    /// Positions of the observed queries (the last of them is `n - 1`).
    pub queries: Range<usize>,
    /// The layer's query moments, when the scorer observes [`Observe::QueryMoments`].
    pub moments: Option<&'a QueryMoments>,
}

impl Rows<'_> {
    /// Rows stored.
    pub fn len(&self) -> usize {
        self.keys.len() / self.d_head
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Query head `head`'s summed attention `(n,)`.
    pub fn attention_of(&self, head: usize) -> Result<&[f32]> {
        let n = self.len();
        let all = self
            .attention
            .ok_or(Error::Internal("this scorer observes no attention"))?;
        all.get(head * n..(head + 1) * n)
            .ok_or(Error::Internal("query head outside the observed layer"))
    }
}

/// Scores the rows of one KV head; the highest are kept.
pub trait TokenScorer: fmt::Debug + Send + Sync {
    /// Which queries' attention [`TokenScorer::score`] reads.
    fn observes(&self) -> Observe {
        Observe::Keys
    }

    /// One score per row.
    fn score(&self, rows: &Rows<'_>) -> Result<Vec<f32>>;

    /// Checks that `n` pressed positions (0: nothing is pressed) are enough for this
    /// scorer, so that a prompt too short fails before its prefill (SnapKV's window must
    /// be shorter).
    fn check_rows(&self, _n: usize) -> Result<()> {
        Ok(())
    }
}

/// How many rows each KV head keeps, for a compression ratio `r` and `n` rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// Every KV head keeps `floor(n (1 - r))` (kvpress's `ScorerPress`).
    PerHead,
    /// PyramidKV: the pressed layers' budgets fall linearly with depth, from about
    /// `2 n (1 - r)` to `n (1 - r) / beta`, averaging `n (1 - r)`, none below the
    /// observation `window`; equal budgets where that shape does not fit.
    Pyramid { window: usize, beta: f64 },
    /// AdaKV: a layer keeps `n_kv_heads * floor(n (1 - r))` rows chosen across its heads
    /// by score, each head at least `alpha` of its equal share.
    Shared { alpha: f64 },
    /// One threshold across every pressed layer and head: `floor(heads * n (1 - r))`
    /// rows kept in all, the highest scores wherever they are (KVzip's default).
    Global,
}

/// A token-eviction step of a plan.
#[derive(Debug, Clone)]
pub struct Eviction {
    /// Share of the pressed positions dropped, in `(0, 1)`.
    pub compression_ratio: f64,
    pub scorer: Arc<dyn TokenScorer>,
    pub budget: Budget,
    /// Per `layer * n_kv_heads + kv_head`: heads the press leaves whole (the retrieval
    /// heads of `static_heads` with `others`); empty for none.
    pub exempt: Vec<bool>,
}

impl Eviction {
    /// Drop `compression_ratio` of every KV head's rows by `scorer`, an equal budget per
    /// head, no head exempt.
    pub fn new(compression_ratio: f64, scorer: impl TokenScorer + 'static) -> Self {
        Self {
            compression_ratio,
            scorer: Arc::new(scorer),
            budget: Budget::PerHead,
            exempt: Vec::new(),
        }
    }

    /// Evict from every store of `cache` that keeps every position (the KV heads of
    /// layers without a window of their own), but the exempt ones. `observed` holds the
    /// attention or moments the scorer asked for ([`TokenScorer::observes`]).
    pub fn press(
        &self,
        cache: &mut HeadCache,
        cfg: &Config,
        observed: Option<&Observed>,
    ) -> Result<()> {
        let pressed: Vec<usize> = (0..cfg.n_layers)
            .filter(|&l| cfg.layer(l).window.is_none())
            .collect();
        let group = cfg.n_heads / cfg.n_kv_heads;
        if cache.is_empty() {
            // A prompt of one token: nothing before it to press.
            return Ok(());
        }
        // Per pressed layer: its pressed KV heads and their scores.
        let mut layers = Vec::with_capacity(pressed.len());
        for &layer in &pressed {
            let heads: Vec<usize> = (0..cfg.n_kv_heads)
                .filter(|&h| {
                    !self
                        .exempt
                        .get(layer * cfg.n_kv_heads + h)
                        .is_some_and(|&e| e)
                })
                .collect();
            let mut scores = Vec::with_capacity(heads.len());
            for &kv_head in &heads {
                let (keys, values) = cache
                    .full_store_rows(layer, kv_head)
                    .ok_or(Error::Internal("a pressed layer keeps every position"))?;
                let n = keys.len() / cfg.d_head;
                let observe = self.scorer.observes();
                let (attention, queries) = match (observe, observe.from(n), observed) {
                    (Observe::Reconstruct { chunk }, _, Some(o)) => {
                        (Some(o.maxima_of(chunk, layer, n)?), n..n)
                    }
                    (Observe::Reconstruct { .. }, _, None) => {
                        return Err(Error::Internal("the prefill reconstructed nothing"))
                    }
                    (_, None, _) => (None, n..n),
                    (_, Some(from), Some(o)) => (Some(o.get(from, layer, n)?), from..n),
                    (_, Some(_), None) => {
                        return Err(Error::Internal("the prefill observed no attention"))
                    }
                };
                let moments = match (observe, observed) {
                    (Observe::QueryMoments { skip }, Some(o)) => {
                        Some(o.moments_of(skip, layer, n)?)
                    }
                    (Observe::QueryMoments { .. }, None) => {
                        return Err(Error::Internal("the prefill observed no queries"))
                    }
                    _ => None,
                };
                let rows = Rows {
                    keys: &keys,
                    values: &values,
                    d_head: cfg.d_head,
                    group: kv_head * group..(kv_head + 1) * group,
                    attention,
                    queries,
                    moments,
                };
                let s = self.scorer.score(&rows)?;
                if s.len() != n {
                    return Err(Error::Internal("one score per row"));
                }
                scores.push(s);
            }
            layers.push((layer, heads, scores));
        }
        let ratio = self.compression_ratio;
        let scores = layers.iter().map(|l| l.2.as_slice());
        let kept: Vec<Vec<Vec<usize>>> = match self.budget {
            Budget::PerHead => scores
                .map(|l| {
                    l.iter()
                        .map(|s| best_rows(s, kept_rows(s.len(), ratio)))
                        .collect()
                })
                .collect(),
            Budget::Pyramid { window, beta } => scores
                .enumerate()
                .map(|(depth, l)| {
                    let n = l.first().map_or(0, Vec::len);
                    let keep = pyramid_budget(n, ratio, window, beta, depth, pressed.len());
                    l.iter().map(|s| best_rows(s, keep)).collect()
                })
                .collect(),
            Budget::Shared { alpha } => scores.map(|l| shared_rows(l, ratio, alpha)).collect(),
            Budget::Global => global_rows(&scores.collect::<Vec<_>>(), ratio),
        };
        for ((layer, heads, _), kept) in layers.iter().zip(&kept) {
            for (&kv_head, rows) in heads.iter().zip(kept) {
                cache.keep(*layer, kv_head, rows)?;
            }
        }
        Ok(())
    }
}

/// `floor(n (1 - ratio))`: the rows a head keeps under an equal budget.
fn kept_rows(n: usize, ratio: f64) -> usize {
    (n as f64 * (1.0 - ratio)).floor() as usize
}

/// PyramidKV's budget for the pressed layer `depth` of `layers`: linear in depth from
/// `max` to `min`, where `min = n (1 - r) / beta` and `max = 2 n (1 - r) - min` (capped
/// at `n - window`, `min` raised to keep the mean); an equal budget, `round(n (1 - r))`
/// as kvpress rounds it, where that shape does not fit (`min` below the window, a single
/// layer).
pub(crate) fn pyramid_budget(
    n: usize,
    ratio: f64,
    window: usize,
    beta: f64,
    depth: usize,
    layers: usize,
) -> usize {
    let mean = n as f64 * (1.0 - ratio);
    let mut min = mean / beta;
    let mut max = 2.0 * mean - min;
    let cap = n.saturating_sub(window) as f64;
    if max >= cap {
        max = cap;
        min = 2.0 * mean - max;
    }
    let fits = n as f64 >= max && max >= min && min >= window as f64;
    if !fits || layers < 2 {
        return mean.round() as usize;
    }
    let step = (max - min) / (layers - 1) as f64;
    ((max - depth as f64 * step).round() as usize).min(n)
}

/// AdaKV's choice across the heads of one layer: each head's best
/// `floor(alpha * keep)` first, then the best of all remaining rows until the layer holds
/// `heads * keep` (`keep = floor(n (1 - ratio))`). Per head, ascending.
pub(crate) fn shared_rows(scores: &[Vec<f32>], ratio: f64, alpha: f64) -> Vec<Vec<usize>> {
    let n = scores.first().map_or(0, Vec::len);
    let keep = kept_rows(n, ratio);
    let safe = (keep as f64 * alpha).floor() as usize;
    let mut kept: Vec<Vec<bool>> = scores.iter().map(|s| vec![false; s.len()]).collect();
    for (head, s) in scores.iter().enumerate() {
        for row in best_rows(s, safe) {
            kept[head][row] = true;
        }
    }
    let mut rest: Vec<(f32, usize, usize)> = scores
        .iter()
        .enumerate()
        .flat_map(|(h, s)| s.iter().enumerate().map(move |(j, &v)| (v, h, j)))
        .filter(|&(_, h, j)| !kept[h][j])
        .collect();
    rest.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
    let room = (scores.len() * keep).saturating_sub(scores.len() * safe.min(n));
    for &(_, h, j) in rest.iter().take(room) {
        kept[h][j] = true;
    }
    kept.iter()
        .map(|k| (0..k.len()).filter(|&j| k[j]).collect())
        .collect()
}

/// KVzip's choice across every pressed layer and head: the `floor(heads * n (1 -
/// ratio))` highest scores of all (`scores`: per layer, per head, per row; of equal
/// scores the earlier layer, head, row). Per layer, per head, ascending.
pub(crate) fn global_rows(scores: &[&[Vec<f32>]], ratio: f64) -> Vec<Vec<Vec<usize>>> {
    let heads: usize = scores.iter().map(|l| l.len()).sum();
    let n = scores
        .iter()
        .flat_map(|l| l.first())
        .next()
        .map_or(0, Vec::len);
    let keep = (heads as f64 * n as f64 * (1.0 - ratio)).floor() as usize;
    let mut all: Vec<(f32, usize, usize, usize)> = scores
        .iter()
        .enumerate()
        .flat_map(|(l, layer)| {
            layer
                .iter()
                .enumerate()
                .flat_map(move |(h, s)| s.iter().enumerate().map(move |(j, &v)| (v, l, h, j)))
        })
        .collect();
    all.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3)))
    });
    let mut kept: Vec<Vec<Vec<usize>>> = scores.iter().map(|l| vec![Vec::new(); l.len()]).collect();
    for &(_, l, h, j) in all.iter().take(keep) {
        kept[l][h].push(j);
    }
    for rows in kept.iter_mut().flatten() {
        rows.sort_unstable();
    }
    kept
}

/// Indices of the `keep` highest scores, ascending; of equal scores the earlier row.
pub(crate) fn best_rows(scores: &[f32], keep: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut rows = order[..keep.min(order.len())].to_vec();
    rows.sort_unstable();
    rows
}

/// What a prefill observed for the presses, for each layer without a window of its own:
/// the attention its queries gave every key, summed over the queries, for one or more
/// sets of observed queries (each from some position to the end, so that one prefill
/// serves SnapKV's window, TOVA's last query and H2O's whole prefill at once), the
/// moments of its queries ([`QueryMoments`]), and the most attention each key got while
/// the model re-read the prompt ([`Observe::Reconstruct`]). An [`Observer`] of the
/// observed part of the prefill and of the reconstruction passes.
#[derive(Debug, Clone)]
pub struct Observed {
    /// Positions the sums cover (what is pressed).
    n: usize,
    n_heads: usize,
    /// First position of the chunk being observed.
    start: usize,
    /// Per first observed query position: per layer `(n_heads, n)`, empty for windowed
    /// layers.
    sums: Vec<(usize, Vec<Vec<f32>>)>,
    /// Per number of first positions skipped: per layer, `None` for windowed layers.
    moments: Vec<(usize, Vec<Option<QueryMoments>>)>,
    /// Per layer `(n_heads, n)`: the most attention a reconstruction query gave each
    /// key (empty for windowed layers; no layers unless a press reconstructs).
    maxima: Vec<Vec<f32>>,
    /// The keys the running reconstruction pass covers, while one runs.
    reconstructing: Option<Range<usize>>,
    /// The piece size of the reconstruction, once it ran.
    reconstructed: Option<usize>,
    /// A tensor that could not be read (reported by [`Self::get`]).
    unreadable: bool,
}

/// The first and second moments of one layer's queries before RoPE, per query head,
/// over the observed positions; with the layer's RoPE, so that a scorer can rotate them
/// to the positions still to come.
#[derive(Debug, Clone)]
pub struct QueryMoments {
    pub d_head: usize,
    /// The layer's RoPE base and pairing.
    pub layer: LayerSpec,
    /// Positions summed.
    pub count: usize,
    /// `(n_heads, d_head)`: sums of the queries.
    sum: Vec<f64>,
    /// `(n_heads, d_head, d_head)`: sums of their outer products.
    outer: Vec<f64>,
}

impl QueryMoments {
    fn new(cfg: &Config, layer: LayerSpec) -> Self {
        let d = cfg.d_head;
        Self {
            d_head: d,
            layer,
            count: 0,
            sum: vec![0.0; cfg.n_heads * d],
            outer: vec![0.0; cfg.n_heads * d * d],
        }
    }

    /// Query head `head`'s mean `(d_head,)`.
    pub fn mean(&self, head: usize) -> Vec<f64> {
        let d = self.d_head;
        let n = self.count.max(1) as f64;
        self.sum[head * d..(head + 1) * d]
            .iter()
            .map(|s| s / n)
            .collect()
    }

    /// Query head `head`'s covariance `(d_head, d_head)` row-major (dividing by the
    /// count, as kvpress does).
    pub fn covariance(&self, head: usize) -> Vec<f64> {
        let d = self.d_head;
        let n = self.count.max(1) as f64;
        let mean = self.mean(head);
        let outer = &self.outer[head * d * d..(head + 1) * d * d];
        (0..d * d)
            .map(|ij| outer[ij] / n - mean[ij / d] * mean[ij % d])
            .collect()
    }

    /// Add `queries` `(q, n_heads, d_head)`, rows `skip..` of them.
    fn add(&mut self, queries: &Tensor, skip: usize) -> candle_core::Result<()> {
        let q = queries.dim(0)?;
        if skip >= q {
            return Ok(());
        }
        let d = self.d_head;
        // (rows, n_heads, d) -> (n_heads, rows, d)
        let x = queries
            .narrow(0, skip, q - skip)?
            .transpose(0, 1)?
            .contiguous()?
            .to_dtype(candle_core::DType::F64)?;
        let sums: Vec<f64> = x.sum(1)?.flatten_all()?.to_vec1()?;
        let outer: Vec<f64> = x.transpose(1, 2)?.matmul(&x)?.flatten_all()?.to_vec1()?;
        debug_assert_eq!(outer.len(), self.outer.len());
        debug_assert_eq!(sums.len() % d, 0);
        self.sum.iter_mut().zip(sums).for_each(|(a, b)| *a += b);
        self.outer.iter_mut().zip(outer).for_each(|(a, b)| *a += b);
        self.count += q - skip;
        Ok(())
    }
}

impl Observed {
    /// Sums over keys `0..n` for queries `from..n`, for each `from` of `observes`, and
    /// query moments for each [`Observe::QueryMoments`] (nothing for [`Observe::Keys`]).
    pub fn new(cfg: &Config, n: usize, observes: &[Observe]) -> Self {
        let mut froms: Vec<usize> = observes.iter().filter_map(|o| o.from(n)).collect();
        froms.sort_unstable();
        froms.dedup();
        let mut skips: Vec<usize> = observes
            .iter()
            .filter_map(|o| match o {
                Observe::QueryMoments { skip } => Some(*skip),
                _ => None,
            })
            .collect();
        skips.sort_unstable();
        skips.dedup();
        let layers = || {
            (0..cfg.n_layers)
                .map(|l| match cfg.layer(l).window {
                    Some(_) => Vec::new(),
                    None => vec![0.0; cfg.n_heads * n],
                })
                .collect()
        };
        let moments = || {
            (0..cfg.n_layers)
                .map(|l| {
                    let spec = cfg.layer(l);
                    spec.window.is_none().then(|| QueryMoments::new(cfg, spec))
                })
                .collect()
        };
        let reconstructs = observes
            .iter()
            .any(|o| matches!(o, Observe::Reconstruct { .. }));
        Self {
            n,
            n_heads: cfg.n_heads,
            start: 0,
            sums: froms.into_iter().map(|f| (f, layers())).collect(),
            moments: skips.into_iter().map(|s| (s, moments())).collect(),
            maxima: match reconstructs {
                true => layers(),
                false => Vec::new(),
            },
            reconstructing: None,
            reconstructed: None,
            unreadable: false,
        }
    }

    /// The first position any sum or moment observes (`n` when none does).
    pub fn first(&self) -> usize {
        match self.moments.is_empty() {
            true => self.sums.first().map_or(self.n, |s| s.0),
            false => 0,
        }
    }

    /// Whether the sums or moments for `observe` over `n` positions are here.
    pub fn covers(&self, observe: Observe, n: usize) -> bool {
        match (observe, observe.from(n)) {
            (Observe::QueryMoments { skip }, _) => {
                n == self.n && self.moments.iter().any(|m| m.0 == skip)
            }
            (Observe::Reconstruct { chunk }, _) => n == self.n && self.reconstructed == Some(chunk),
            (_, None) => true,
            (_, Some(from)) => n == self.n && self.sums.iter().any(|s| s.0 == from),
        }
    }

    /// Layer `layer`'s query moments past the first `skip` positions, for a store of
    /// `n` rows.
    fn moments_of(&self, skip: usize, layer: usize, n: usize) -> Result<&QueryMoments> {
        if self.unreadable {
            return Err(Error::Internal("an observed query tensor was unreadable"));
        }
        let found = self.moments.iter().find(|m| m.0 == skip);
        match found.and_then(|m| m.1.get(layer)) {
            Some(Some(moments)) if n == self.n => Ok(moments),
            _ => Err(Error::Internal(
                "the observed queries do not cover the pressed rows",
            )),
        }
    }

    /// Layer `layer`'s maxima `(n_heads, n)` of a reconstruction in pieces of `chunk`, for
    /// a store of `n` rows.
    fn maxima_of(&self, chunk: usize, layer: usize, n: usize) -> Result<&[f32]> {
        if self.unreadable {
            return Err(Error::Internal(
                "an observed attention tensor was unreadable",
            ));
        }
        match self.maxima.get(layer) {
            Some(m) if n == self.n && !m.is_empty() && self.reconstructed == Some(chunk) => Ok(m),
            _ => Err(Error::Internal(
                "the reconstruction does not cover the pressed rows",
            )),
        }
    }

    /// The next attention observed is a reconstruction pass's, whose maxima are kept for
    /// the keys `keys`.
    pub(crate) fn reconstructing(&mut self, keys: Range<usize>) {
        self.reconstructing = Some(keys);
    }

    /// The reconstruction in pieces of `chunk` positions is over.
    pub(crate) fn reconstructed(&mut self, chunk: usize) {
        self.reconstructing = None;
        self.reconstructed = Some(chunk);
    }

    /// Raise layer `layer`'s maxima over `keys` to those of `probs` `(n_heads, q,
    /// kv_len)`.
    fn add_max(
        &mut self,
        layer: usize,
        probs: &Tensor,
        keys: Range<usize>,
    ) -> candle_core::Result<()> {
        let n = self.n;
        let Some(maxima) = self.maxima.get_mut(layer).filter(|m| !m.is_empty()) else {
            return Ok(());
        };
        // (n_heads, q, kv_len) -> (n_heads, keys)
        let best: Vec<Vec<f32>> = probs.narrow(2, keys.start, keys.len())?.max(1)?.to_vec2()?;
        for (h, row) in best.iter().enumerate() {
            for (m, &p) in maxima[h * n + keys.start..].iter_mut().zip(row) {
                *m = m.max(p);
            }
        }
        Ok(())
    }

    /// Layer `layer`'s sums `(n_heads, n)` for queries `from..n`, for a store of `n` rows.
    fn get(&self, from: usize, layer: usize, n: usize) -> Result<&[f32]> {
        if self.unreadable {
            return Err(Error::Internal(
                "an observed attention tensor was unreadable",
            ));
        }
        let found = self.sums.iter().find(|s| s.0 == from);
        match found.and_then(|s| s.1.get(layer)) {
            Some(sums) if n == self.n && !sums.is_empty() => Ok(sums),
            _ => Err(Error::Internal(
                "the observed attention does not cover the pressed rows",
            )),
        }
    }

    fn add(&mut self, layer: usize, probs: &Tensor) -> candle_core::Result<()> {
        let q = probs.dim(1)?;
        let (start, n, n_heads) = (self.start, self.n, self.n_heads);
        for (from, layers) in &mut self.sums {
            let Some(sums) = layers.get_mut(layer).filter(|s| !s.is_empty()) else {
                continue;
            };
            // Rows of this chunk at or after `from`.
            let skip = from.saturating_sub(start);
            if skip >= q {
                continue;
            }
            // (n_heads, rows, kv_len) -> (n_heads, kv_len)
            let per_key: Vec<Vec<f32>> = probs.narrow(1, skip, q - skip)?.sum(1)?.to_vec2()?;
            for (h, row) in per_key.iter().enumerate().take(n_heads) {
                for (j, &p) in row.iter().enumerate().take(n) {
                    sums[h * n + j] += p;
                }
            }
        }
        Ok(())
    }
}

impl Observe {
    /// The first query position whose attention is observed when `n` positions are
    /// pressed (`None`: no attention).
    fn from(self, n: usize) -> Option<usize> {
        match self {
            Observe::Keys | Observe::QueryMoments { .. } | Observe::Reconstruct { .. } => None,
            Observe::Last(w) => Some(n.saturating_sub(w)),
            Observe::All => Some(0),
        }
    }
}

impl Observer for Observed {
    fn wants(&self) -> Wants {
        match self.reconstructing {
            Some(_) => Wants {
                attention: true,
                ..Wants::default()
            },
            None => Wants {
                attention: !self.sums.is_empty(),
                queries: !self.moments.is_empty(),
                ..Wants::default()
            },
        }
    }

    fn begin(&mut self, start: usize, _q: usize) {
        self.start = start;
    }

    fn attention(&mut self, layer: usize, probs: &Tensor) {
        let added = match self.reconstructing.clone() {
            Some(keys) => self.add_max(layer, probs, keys),
            None => self.add(layer, probs),
        };
        if added.is_err() {
            self.unreadable = true;
        }
    }

    fn queries(&mut self, layer: usize, queries: &Tensor) {
        let start = self.start;
        let mut unreadable = false;
        for (skip, layers) in &mut self.moments {
            if let Some(Some(m)) = layers.get_mut(layer) {
                unreadable |= m.add(queries, skip.saturating_sub(start)).is_err();
            }
        }
        self.unreadable |= unreadable;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_cut_runs_across_layers_and_heads() {
        // Two layers, the first with two heads, the second with one; 4 rows each: 12
        // rows, ratio 0.5 keeps the 6 best wherever they are (of a tie, the earlier layer).
        let first = vec![vec![0.9, 0.1, 0.8, 0.0], vec![0.2, 0.7, 0.3, 0.0]];
        let second = vec![vec![0.5, 0.6, 0.3, 0.05]];
        let kept = global_rows(&[&first, &second], 0.5);
        // 0.9, 0.8, 0.7 (layer 0), 0.6, 0.5 (layer 1), then 0.3 twice: layer 0's.
        let want: Vec<Vec<Vec<usize>>> = vec![vec![vec![0, 2], vec![1, 2]], vec![vec![0, 1]]];
        assert_eq!(kept, want);
    }

    #[test]
    fn the_best_rows_come_back_in_order() {
        let scores = [0.5, 3.0, -1.0, 3.0, 2.0];
        assert_eq!(best_rows(&scores, 3), vec![1, 3, 4]);
        assert_eq!(best_rows(&scores, 2), vec![1, 3]);
        assert_eq!(best_rows(&scores, 0), Vec::<usize>::new());
        assert_eq!(best_rows(&scores, 9), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn pyramid_budgets_fall_with_depth_and_keep_the_mean() {
        // 1000 rows, ratio 0.5: mean 500, min 25, max 975 (capped at 1000 - 64 = 936,
        // so min = 64); four layers from 936 down to 64.
        let b: Vec<usize> = (0..4)
            .map(|d| pyramid_budget(1000, 0.5, 64, 20.0, d, 4))
            .collect();
        assert_eq!(b, vec![936, 645, 355, 64]);
        assert_eq!(b.iter().sum::<usize>(), 4 * 500);
        // A shape that does not fit (100 rows, ratio 0.5: max capped at 36 and min raised
        // to 64, above it) or one layer: equal budgets.
        assert_eq!(pyramid_budget(100, 0.5, 64, 20.0, 0, 4), 50);
        assert_eq!(pyramid_budget(1000, 0.5, 64, 20.0, 0, 1), 500);
    }

    #[test]
    fn shared_budgets_go_to_the_best_rows_across_heads_with_a_floor_each() {
        // Two heads of 10 rows, ratio 0.5: 10 rows for the layer, each head at least
        // floor(0.2 * 5) = 1 (its best), the other 8 the best of the rest overall.
        let hot: Vec<f32> = (0..10).map(|j| 10.0 + j as f32).collect();
        let cold: Vec<f32> = (0..10).map(|j| j as f32 * 0.1).collect();
        let kept = shared_rows(&[hot, cold], 0.5, 0.2);
        assert_eq!(kept[0], vec![1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(kept[1], vec![9]);
        // alpha = 1 is the equal budget.
        let a: Vec<f32> = (0..10).map(|j| j as f32).collect();
        let kept = shared_rows(&[a.clone(), a], 0.5, 1.0);
        assert_eq!(kept[0], vec![5, 6, 7, 8, 9]);
        assert_eq!(kept[1], vec![5, 6, 7, 8, 9]);
    }
}
