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
}

/// Keys and values of every layer for the tokens processed so far.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    len: usize,
    capacity: usize,
    max_len: usize,
    n_kv_heads: usize,
    d_head: usize,
}

impl KvCache {
    /// An empty cache for `cfg`; buffers are allocated on first use with room for
    /// `capacity` tokens (grown on demand up to the context length).
    pub fn new(cfg: &Config, capacity: usize) -> Self {
        Self {
            layers: vec![None; cfg.n_layers],
            len: 0,
            capacity: capacity.clamp(1, cfg.context_length),
            max_len: cfg.context_length,
            n_kv_heads: cfg.n_kv_heads,
            d_head: cfg.d_head,
        }
    }

    /// Tokens stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget everything after the first `len` tokens (e.g. to re-generate from there).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Bytes allocated for keys and values (resident, not just used).
    pub fn allocated_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| 2 * l.k.elem_count() * std::mem::size_of::<f32>())
            .sum()
    }

    /// Write `k`, `v` (`(n_kv_heads, seq, d_head)`) of layer `layer` at positions
    /// `len..len + seq` and return views of all positions `0..len + seq`.
    /// The cache's length advances only in [`KvCache::commit`], once every layer wrote.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let seq = k.dim(1)?;
        let end = self.len + seq;
        if end > self.max_len {
            return Err(Error::ContextOverflow {
                prompt: end,
                max_new: 0,
                context: self.max_len,
            });
        }
        let needed = end.max(self.capacity);
        let slot = &mut self.layers[layer];
        let grow = match slot {
            Some(l) => l.k.dim(1)? < end,
            None => true,
        };
        if grow {
            let cap = match slot {
                Some(l) => (l.k.dim(1)? * 2).max(end),
                None => needed,
            }
            .min(self.max_len);
            let shape = (self.n_kv_heads, cap, self.d_head);
            let fresh = LayerKv {
                k: Tensor::zeros(shape, DType::F32, &Device::Cpu)?,
                v: Tensor::zeros(shape, DType::F32, &Device::Cpu)?,
            };
            if let Some(old) = slot.as_ref() {
                if self.len > 0 {
                    fresh
                        .k
                        .slice_set(&old.k.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                    fresh
                        .v
                        .slice_set(&old.v.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                }
            }
            *slot = Some(fresh);
        }
        let l = slot.as_ref().expect("allocated above");
        l.k.slice_set(&k.contiguous()?, 1, self.len)?;
        l.v.slice_set(&v.contiguous()?, 1, self.len)?;
        Ok((l.k.narrow(1, 0, end)?, l.v.narrow(1, 0, end)?))
    }

    /// Advance the length by `seq` tokens after all layers appended them.
    pub(crate) fn commit(&mut self, seq: usize) {
        self.len += seq;
    }
}
