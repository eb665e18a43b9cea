//! The key/value cache: one growable buffer per layer for keys and one for values.
//!
//! Each buffer has shape `(n_kv_heads, capacity, d_head)`; appending writes in place and
//! doubles the capacity when full, so a decode step copies only the new token. Views
//! handed to attention are `(n_kv_heads, len, d_head)` narrowings of the buffers: no copy.

use candle_core::{DType, Device, Tensor};

use crate::model::Config;
use crate::{Error, Result};

#[derive(Debug, Clone)]
struct LayerKv {
    k: Tensor,
    v: Tensor,
    /// Absolute position of slot 0 (above 0 once a sliding-window layer dropped keys).
    offset: usize,
}

impl LayerKv {
    fn zeros(n_kv_heads: usize, cap: usize, d_head: usize) -> Result<Self> {
        let shape = (n_kv_heads, cap, d_head);
        Ok(Self {
            k: Tensor::zeros(shape, DType::F32, &Device::Cpu)?,
            v: Tensor::zeros(shape, DType::F32, &Device::Cpu)?,
            offset: 0,
        })
    }

    fn capacity(&self) -> Result<usize> {
        Ok(self.k.dim(1)?)
    }
}

/// Extra slots a sliding-window layer allocates beyond its window, so that it moves its
/// kept keys to the front once every this many decode steps rather than every step.
const WINDOW_SLACK: usize = 256;

/// Keys and values of every layer for the tokens processed so far.
///
/// A layer with a sliding window of `w` keeps only what later queries can still see:
/// before `seq` new positions are written, it keeps the `w - 1` most recent ones, so its
/// buffer never needs more than `w - 1 + seq` slots (`w + 255` in decode).
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    /// Per layer: `Some(w)` for a sliding-window layer.
    windows: Vec<Option<usize>>,
    len: usize,
    capacity: usize,
    max_len: usize,
    n_kv_heads: usize,
    d_head: usize,
}

/// What [`KvCache::append`] hands to attention: the stored keys and values of one layer,
/// `(n_kv_heads, kv_len, d_head)` views, whose first row is absolute position `start`.
pub(crate) struct Stored {
    pub keys: Tensor,
    pub values: Tensor,
    pub start: usize,
}

impl KvCache {
    /// An empty cache for `cfg`; buffers are allocated on first use with room for
    /// `capacity` tokens (grown on demand up to the context length; sliding-window
    /// layers stay at their window plus a small slack).
    pub fn new(cfg: &Config, capacity: usize) -> Self {
        Self {
            layers: vec![None; cfg.n_layers],
            windows: (0..cfg.n_layers).map(|l| cfg.layer(l).window).collect(),
            len: 0,
            capacity: capacity.clamp(1, cfg.context_length),
            max_len: cfg.context_length,
            n_kv_heads: cfg.n_kv_heads,
            d_head: cfg.d_head,
        }
    }

    /// Tokens processed (positions `0..len`), whether or not every layer still holds them.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget everything after the first `len` tokens (e.g. to re-generate from there).
    ///
    /// Fails if a sliding-window layer already dropped keys that position `len` would
    /// need again (rewinding further back than its window).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len {
            return Ok(());
        }
        for (l, (layer, window)) in self.layers.iter().zip(&self.windows).enumerate() {
            if let (Some(layer), Some(w)) = (layer, window) {
                if layer.offset > len.saturating_sub(w - 1) {
                    return Err(Error::invalid(
                        "truncate",
                        format!(
                            "layer {l} keeps only its last {w} positions and no longer holds \
                             position {}: cannot rewind to {len}",
                            layer.offset - 1
                        ),
                    ));
                }
            }
        }
        self.len = len;
        Ok(())
    }

    /// A copy that shares no buffer with this cache, so that either can run on (a clone
    /// shares them, and appending writes into them in place).
    pub fn fork(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|l| -> Result<LayerKv> {
                        Ok(LayerKv {
                            k: l.k.copy()?,
                            v: l.v.copy()?,
                            offset: l.offset,
                        })
                    })
                    .transpose()
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            windows: self.windows.clone(),
            len: self.len,
            capacity: self.capacity,
            max_len: self.max_len,
            n_kv_heads: self.n_kv_heads,
            d_head: self.d_head,
        })
    }

    /// Bytes allocated for keys and values (resident, not just used).
    pub fn allocated_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| 2 * l.k.elem_count() * std::mem::size_of::<f32>())
            .sum()
    }

    /// What layer `layer` stores: keys and values `(n_kv_heads, rows, d_head)` of the
    /// positions `start..len()`, with `start` (above 0 once a sliding window dropped
    /// keys); `None` before the layer stored anything.
    pub fn layer_rows(&self, layer: usize) -> Result<Option<(Tensor, Tensor, usize)>> {
        let Some(l) = self.layers.get(layer).and_then(|l| l.as_ref()) else {
            return Ok(None);
        };
        let rows = self.len - l.offset;
        Ok(Some((
            l.k.narrow(1, 0, rows)?,
            l.v.narrow(1, 0, rows)?,
            l.offset,
        )))
    }

    /// Write `k`, `v` (`(n_kv_heads, seq, d_head)`) of layer `layer` at positions
    /// `len..len + seq` and return views of every position the layer still stores.
    /// The cache's length advances only in [`KvCache::commit`], once every layer wrote.
    pub(crate) fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<Stored> {
        let seq = k.dim(1)?;
        let end = self.len + seq;
        if end > self.max_len {
            return Err(Error::ContextOverflow {
                prompt: end,
                max_new: 0,
                context: self.max_len,
            });
        }
        let window = self.windows[layer];
        let (n_kv, d) = (self.n_kv_heads, self.d_head);
        let slot = &mut self.layers[layer];
        let mut l = match slot.take() {
            Some(l) => l,
            None => {
                let cap = match window {
                    Some(w) => (w - 1 + seq).max(w + WINDOW_SLACK),
                    None => end.max(self.capacity).min(self.max_len),
                };
                LayerKv::zeros(n_kv, cap, d)?
            }
        };
        let mut stored = self.len - l.offset;
        if let Some(w) = window {
            let keep = stored.min(w - 1);
            if stored + seq > l.capacity()? && keep < stored {
                // Move the kept keys to the front; a copy first, as source and
                // destination share the buffer.
                let drop = stored - keep;
                for t in [&l.k, &l.v] {
                    t.slice_set(&t.narrow(1, drop, keep)?.copy()?, 1, 0)?;
                }
                l.offset += drop;
                stored = keep;
            }
        }
        if stored + seq > l.capacity()? {
            let cap = match window {
                Some(_) => stored + seq,
                None => (l.capacity()? * 2).max(end).min(self.max_len),
            };
            let mut fresh = LayerKv::zeros(n_kv, cap, d)?;
            fresh.offset = l.offset;
            if stored > 0 {
                fresh
                    .k
                    .slice_set(&l.k.narrow(1, 0, stored)?.contiguous()?, 1, 0)?;
                fresh
                    .v
                    .slice_set(&l.v.narrow(1, 0, stored)?.contiguous()?, 1, 0)?;
            }
            l = fresh;
        }
        l.k.slice_set(&k.contiguous()?, 1, stored)?;
        l.v.slice_set(&v.contiguous()?, 1, stored)?;
        let out = Stored {
            keys: l.k.narrow(1, 0, stored + seq)?,
            values: l.v.narrow(1, 0, stored + seq)?,
            start: l.offset,
        };
        *slot = Some(l);
        Ok(out)
    }

    /// Advance the length by `seq` tokens after all layers appended them.
    pub(crate) fn commit(&mut self, seq: usize) {
        self.len += seq;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Architecture, SlidingWindow};

    fn config(window: Option<usize>) -> Config {
        Config {
            architecture: Architecture::Gemma3,
            n_layers: 2,
            n_heads: 2,
            n_kv_heads: 1,
            d_model: 8,
            d_head: 2,
            d_ff: 8,
            vocab_size: 10,
            context_length: 4096,
            rms_eps: 1e-6,
            rope_base: 1e6,
            sliding_window: window.map(|size| SlidingWindow {
                size,
                global_every: 2,
                local_rope_base: 1e4,
            }),
        }
    }

    /// Append positions one chunk at a time, each key row holding its absolute position.
    fn feed(cache: &mut KvCache, chunks: &[usize]) -> Vec<Stored> {
        let mut last = Vec::new();
        for &seq in chunks {
            let pos: Vec<f32> = (cache.len()..cache.len() + seq)
                .flat_map(|p| [p as f32, -(p as f32)])
                .collect();
            let t = Tensor::from_vec(pos, (1, seq, 2), &Device::Cpu).unwrap();
            last = (0..2).map(|l| cache.append(l, &t, &t).unwrap()).collect();
            cache.commit(seq);
        }
        last
    }

    #[test]
    fn a_sliding_window_layer_keeps_what_its_queries_can_see_and_no_more() {
        let mut cache = KvCache::new(&config(Some(8)), 16);
        // 7 chunks of 3, then 300 single decode steps
        let mut chunks = vec![3; 7];
        chunks.extend(std::iter::repeat_n(1, 300));
        let mut seen_shift = false;
        for &seq in &chunks {
            let before = cache.len();
            let stored = feed(&mut cache, &[seq]);
            let (local, global) = (&stored[0], &stored[1]);
            let first = local
                .keys
                .get(0)
                .unwrap()
                .get(0)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()[0];
            // row 0 is absolute position `start`; the new positions are at the end
            assert_eq!(first as usize, local.start);
            assert_eq!(local.start + local.keys.dim(1).unwrap(), before + seq);
            // every query of the chunk still sees its 8 most recent positions
            assert!(local.start <= (before + 1).saturating_sub(8));
            assert!(local.keys.dim(1).unwrap() <= 8 - 1 + seq.max(WINDOW_SLACK + 1));
            seen_shift |= local.start > 0;
            assert_eq!(
                (global.start, global.keys.dim(1).unwrap()),
                (0, before + seq)
            );
        }
        assert!(seen_shift);
        // the windowed layer's buffer stays small; the global one holds everything
        let bytes = cache.allocated_bytes();
        let global_bytes = 2 * cache.len().next_power_of_two() * 2 * 4;
        assert!(
            bytes <= global_bytes + 2 * (8 + WINDOW_SLACK) * 2 * 4,
            "{bytes}"
        );
    }

    #[test]
    fn a_fork_runs_on_without_touching_the_original() {
        let mut cache = KvCache::new(&config(Some(8)), 16);
        feed(&mut cache, &[5; 4]);
        let rows = |c: &KvCache, l| {
            let (k, v, start) = c.layer_rows(l).unwrap().unwrap();
            (
                k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                start,
            )
        };
        let before: Vec<_> = (0..2).map(|l| rows(&cache, l)).collect();
        let mut fork = cache.fork().unwrap();
        // Long enough for the windowed layer to move its kept keys to the front of its
        // buffer, and for the global layer to write past the original's length.
        feed(&mut fork, &[1; 300]);
        assert_eq!(fork.len(), 320);
        let after: Vec<_> = (0..2).map(|l| rows(&cache, l)).collect();
        assert_eq!(before, after);
        assert_eq!(cache.len(), 20);
    }

    #[test]
    fn rewinding_past_dropped_keys_is_an_error() {
        let mut cache = KvCache::new(&config(Some(8)), 16);
        feed(&mut cache, &vec![1; 400]);
        assert!(cache.truncate(399).is_ok());
        let err = cache.truncate(10).unwrap_err().to_string();
        assert!(err.contains("cannot rewind"), "{err}");
        let mut full = KvCache::new(&config(None), 16);
        feed(&mut full, &vec![1; 400]);
        assert!(full.truncate(10).is_ok());
        assert_eq!(full.len(), 10);
    }
}
