//! The operands of one attention call borrowed as rows, shared by the loop kernels:
//! each KV head's keys and values as [`KvRows`], read in place from a cache's stores or
//! from `(n_kv_heads, kv_len, d_head)` tensors ([`Kv`]), or as [`StoredRows`] in the
//! store's own encoding (a decode step decodes a few rows at a time).

use std::ops::Range;

use candle_core::{Device, Storage, Tensor};
use half::f16;

use crate::model::cache::rows::{widen, Run};
use crate::{Error, Result};

/// One KV head's stored rows: `len` key rows and `len` value rows of
/// `d_head` floats each, row-major, in two parts one after the other (rows shared with
/// other caches then the head's own, or a ring's two halves oldest first; the first part
/// may be empty).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvRows<'a> {
    keys: [&'a [f32]; 2],
    values: [&'a [f32]; 2],
    /// Rows in the first part.
    split: usize,
    len: usize,
}

impl<'a> KvRows<'a> {
    /// `len` rows of `d_head` floats in one run each.
    pub(crate) fn contiguous(keys: &'a [f32], values: &'a [f32], d_head: usize) -> Self {
        Self::parts([&[], keys], [&[], values], d_head)
    }

    /// Rows in two parts each, keys and values split alike.
    ///
    /// Panics if the parts are not whole rows or keys and values split differently.
    pub(crate) fn parts(keys: [&'a [f32]; 2], values: [&'a [f32]; 2], d_head: usize) -> Self {
        assert!(
            keys.iter().chain(&values).all(|p| p.len() % d_head == 0)
                && keys[0].len() == values[0].len()
                && keys[1].len() == values[1].len(),
            "key and value parts of whole rows, split alike"
        );
        Self {
            keys,
            values,
            split: keys[0].len() / d_head,
            len: (keys[0].len() + keys[1].len()) / d_head,
        }
    }

    /// Key row `j` (`dh` floats).
    #[inline(always)]
    pub(crate) fn key(&self, j: usize, dh: usize) -> &'a [f32] {
        Self::row(self.keys, self.split, j, dh)
    }

    /// Value row `j` (`dh` floats).
    #[inline(always)]
    pub(crate) fn value(&self, j: usize, dh: usize) -> &'a [f32] {
        Self::row(self.values, self.split, j, dh)
    }

    #[inline(always)]
    fn row(parts: [&'a [f32]; 2], split: usize, j: usize, dh: usize) -> &'a [f32] {
        if j < split {
            &parts[0][j * dh..][..dh]
        } else {
            &parts[1][(j - split) * dh..][..dh]
        }
    }
}

/// One KV head's rows as its store holds them (f32, f16 or 8-bit [`Run`]s), in two
/// parts like [`KvRows`]: what a decode step reads in place, a few rows at a time
/// ([`StoredRows::keys`], [`StoredRows::values`]), decoding only 8-bit rows and chunks
/// that straddle the parts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoredRows<'a> {
    keys: [Run<'a>; 2],
    values: [Run<'a>; 2],
    /// Rows in the first part.
    split: usize,
    len: usize,
}

impl<'a> StoredRows<'a> {
    /// Rows in two parts each, keys and values split alike.
    ///
    /// Panics if keys and values split differently.
    pub(crate) fn parts(keys: [Run<'a>; 2], values: [Run<'a>; 2], d_head: usize) -> Self {
        let rows = |p: &[Run; 2]| [p[0].rows(d_head), p[1].rows(d_head)];
        assert_eq!(rows(&keys), rows(&values), "keys and values split alike");
        let [split, rest] = rows(&keys);
        Self {
            keys,
            values,
            split,
            len: split + rest,
        }
    }

    /// Rows held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Key rows `range` (`range.len() * dh` values): borrowed where they lie in one part
    /// stored as f32 or f16, else decoded (or copied) into `scratch`.
    #[inline]
    pub(crate) fn keys<'s>(
        &'s self,
        range: Range<usize>,
        dh: usize,
        scratch: &'s mut Vec<f32>,
    ) -> Chunk<'s> {
        Self::rows(&self.keys, self.split, range, dh, scratch)
    }

    /// Value rows `range`, as [`StoredRows::keys`].
    #[inline]
    pub(crate) fn values<'s>(
        &'s self,
        range: Range<usize>,
        dh: usize,
        scratch: &'s mut Vec<f32>,
    ) -> Chunk<'s> {
        Self::rows(&self.values, self.split, range, dh, scratch)
    }

    fn rows<'s>(
        parts: &'s [Run<'a>; 2],
        split: usize,
        range: Range<usize>,
        dh: usize,
        scratch: &'s mut Vec<f32>,
    ) -> Chunk<'s> {
        let first = range.start.min(split)..range.end.min(split);
        let second = range.start.max(split) - split..range.end.max(split) - split;
        let whole = match (first.is_empty(), second.is_empty()) {
            (false, true) => Some((parts[0], first.clone())),
            (true, _) => Some((parts[1], second.clone())),
            (false, false) => None,
        };
        match whole {
            Some((Run::F32(v), r)) => return Chunk::F32(&v[r.start * dh..r.end * dh]),
            Some((Run::F16(v), r)) => return Chunk::F16(&v[r.start * dh..r.end * dh]),
            _ => {}
        }
        scratch.clear();
        scratch.resize(range.len() * dh, 0.0);
        let at = first.len() * dh;
        parts[0].read(dh, first, &mut scratch[..at]);
        parts[1].read(dh, second, &mut scratch[at..]);
        Chunk::F32(scratch)
    }
}

/// Rows of one [`StoredRows`] read: f32 (borrowed or decoded), or f16 borrowed as stored,
/// which a decode task widens as it loads them (an exact conversion).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Chunk<'s> {
    F32(&'s [f32]),
    F16(&'s [f16]),
}

impl Chunk<'_> {
    /// The rows as f32 (copied; f16 widened as the stores widen them).
    fn to_f32(self) -> Vec<f32> {
        match self {
            Chunk::F32(v) => v.to_vec(),
            Chunk::F16(v) => {
                let mut out = vec![0f32; v.len()];
                widen(v, &mut out);
                out
            }
        }
    }
}

impl<'a> From<&KvRows<'a>> for StoredRows<'a> {
    fn from(rows: &KvRows<'a>) -> Self {
        Self {
            keys: rows.keys.map(Run::F32),
            values: rows.values.map(Run::F32),
            split: rows.split,
            len: rows.len,
        }
    }
}

/// The keys and values of one attention call, as the caller holds them: tensors
/// `(n_kv_heads, kv_len, d_head)` (last dim contiguous), or each KV head's rows in place
/// (a cache's stores, every head the same number of rows). The loop kernels read rows,
/// the matrix-product kernels tensors; each form gives the other without a change in
/// the floats.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kv<'a> {
    Tensors {
        keys: &'a Tensor,
        values: &'a Tensor,
    },
    /// Each KV head's rows as its store holds them (every head the same number): the
    /// decode step reads them in place, every other path as f32 (decoded where stored
    /// otherwise).
    Stored(&'a [StoredRows<'a>]),
}

impl Kv<'_> {
    /// `(n_kv_heads, kv_len)`.
    pub(crate) fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Kv::Tensors { keys, .. } => {
                let (nkv, kv_len, _) = keys.dims3()?;
                Ok((nkv, kv_len))
            }
            Kv::Stored(heads) => {
                let kv_len = heads.first().map_or(0, StoredRows::len);
                if heads.iter().any(|h| h.len() != kv_len) {
                    return Err(Error::invalid(
                        "attention",
                        "every KV head must hold the same rows",
                    ));
                }
                Ok((heads.len(), kv_len))
            }
        }
    }

    /// Run `f` over each KV head's rows of `dh` floats (borrowed, not copied).
    pub(crate) fn with_rows<R>(
        &self,
        dh: usize,
        f: impl FnOnce(&[KvRows]) -> Result<R>,
    ) -> Result<R> {
        let (keys, values) = match self {
            Kv::Stored(heads) => return Self::with_stored_rows(heads, dh, f),
            Kv::Tensors { keys, values } => (keys, values),
        };
        let (nkv, kv_len) = self.dims()?;
        with_data(keys, |kd, ks| {
            with_data(values, |vd, vs| {
                if ks[1..] != [dh, 1] || vs[1..] != [dh, 1] {
                    return Err(Error::invalid("attention", "key rows must be contiguous"));
                }
                let heads: Vec<KvRows> = (0..nkv)
                    .map(|h| {
                        KvRows::contiguous(
                            &kd[h * ks[0]..][..kv_len * dh],
                            &vd[h * vs[0]..][..kv_len * dh],
                            dh,
                        )
                    })
                    .collect();
                f(&heads)
            })
        })
    }

    /// Stored rows as f32 [`KvRows`]: borrowed where every part is f32, else decoded.
    fn with_stored_rows<R>(
        heads: &[StoredRows],
        dh: usize,
        f: impl FnOnce(&[KvRows]) -> Result<R>,
    ) -> Result<R> {
        let in_place: Option<Vec<KvRows>> = heads
            .iter()
            .map(|h| {
                fn f32s<'b>(p: &[Run<'b>; 2]) -> Option<[&'b [f32]; 2]> {
                    Some([p[0].as_f32()?, p[1].as_f32()?])
                }
                Some(KvRows::parts(f32s(&h.keys)?, f32s(&h.values)?, dh))
            })
            .collect();
        if let Some(rows) = in_place {
            return f(&rows);
        }
        let decoded: Vec<(Vec<f32>, Vec<f32>)> = heads
            .iter()
            .map(|h| {
                let mut scratch = Vec::new();
                let k = h.keys(0..h.len, dh, &mut scratch).to_f32();
                let v = h.values(0..h.len, dh, &mut scratch).to_f32();
                (k, v)
            })
            .collect();
        let rows: Vec<KvRows> = decoded
            .iter()
            .map(|(k, v)| KvRows::contiguous(k, v, dh))
            .collect();
        f(&rows)
    }

    /// Keys and values as tensors `(n_kv_heads, kv_len, d_head)` (rows copied).
    pub(crate) fn tensors(&self, dh: usize) -> Result<(Tensor, Tensor)> {
        if let Kv::Tensors { keys, values } = self {
            return Ok(((*keys).clone(), (*values).clone()));
        }
        let (nkv, kv_len) = self.dims()?;
        self.with_rows(dh, |heads| {
            let gather = |keys: bool| -> Result<Tensor> {
                let mut all = Vec::with_capacity(nkv * kv_len * dh);
                for h in heads.iter() {
                    for j in 0..kv_len {
                        all.extend_from_slice(if keys { h.key(j, dh) } else { h.value(j, dh) });
                    }
                }
                Ok(Tensor::from_vec(all, (nkv, kv_len, dh), &Device::Cpu)?)
            };
            Ok((gather(true)?, gather(false)?))
        })
    }
}

/// Sizes shared by the loop kernels.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shapes {
    pub(super) nh: usize,
    pub(super) q_len: usize,
    pub(super) dh: usize,
    pub(super) kv_len: usize,
    /// Query heads per KV head.
    pub(super) group: usize,
    /// `1 / sqrt(d_head)`.
    pub(super) scale: f32,
}

impl Shapes {
    /// Queries `q` `(n_heads, q, d_head)` over `kv`.
    pub(super) fn of(q: &Tensor, kv: &Kv) -> Result<Self> {
        let (nh, q_len, dh) = q.dims3()?;
        let (nkv, kv_len) = kv.dims()?;
        Ok(Self {
            nh,
            q_len,
            dh,
            kv_len,
            group: nh / nkv,
            scale: 1.0 / (dh as f32).sqrt(),
        })
    }
}

/// The additive mask `(n_heads, q, kv_len)` as a flat vector, if any.
pub(super) fn mask_values(mask: Option<&Tensor>) -> Result<Option<Vec<f32>>> {
    Ok(mask.map(|m| m.flatten_all()?.to_vec1()).transpose()?)
}

/// Borrow the f32 data of a CPU tensor with its strides and start offset.
pub(super) fn with_data<R>(t: &Tensor, f: impl FnOnce(&[f32], &[usize]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(Error::invalid(
            "device",
            "streaming attention runs on the CPU",
        ));
    };
    let data = cpu.as_slice::<f32>()?;
    f(&data[layout.start_offset()..], layout.stride())
}

/// One attention call's operands borrowed as rows, for the per-row kernels.
pub(super) struct Rows<'a> {
    pub(super) shapes: &'a Shapes,
    pub(super) q: &'a [f32],
    /// Per KV head.
    pub(super) heads: &'a [KvRows<'a>],
    pub(super) mask: Option<&'a [f32]>,
    /// The first query's offset from key 0 (for the causal rule without a mask).
    pub(super) start: usize,
}

impl Rows<'_> {
    /// Query row `i = head * q_len + t`.
    pub(super) fn query(&self, i: usize) -> &[f32] {
        let dh = self.shapes.dh;
        &self.q[i * dh..(i + 1) * dh]
    }

    /// The KV head that query row `i = head * q_len + t` reads.
    pub(super) fn kv_head(&self, i: usize) -> usize {
        i / self.shapes.q_len / self.shapes.group
    }

    /// Key `j` of KV head `kvh`.
    pub(super) fn key(&self, kvh: usize, j: usize) -> &[f32] {
        self.heads[kvh].key(j, self.shapes.dh)
    }

    /// Value `j` of KV head `kvh`.
    pub(super) fn value(&self, kvh: usize, j: usize) -> &[f32] {
        self.heads[kvh].value(j, self.shapes.dh)
    }

    /// Additive bias of key `j` for query row `i`: the mask's, or causal.
    pub(super) fn bias(&self, i: usize, j: usize) -> f32 {
        match self.mask {
            Some(m) => m[i * self.shapes.kv_len + j],
            None if j > self.start + i % self.shapes.q_len => f32::NEG_INFINITY,
            None => 0.0,
        }
    }
}

/// Run `kernel(rows, out)` over `q`, `kv` and `mask` borrowed as [`Rows`], with `out`
/// `(n_heads * q * d_head)` zeroed; returns `out` as `(n_heads, q, d_head)`.
pub(super) fn per_row(
    q: &Tensor,
    kv: &Kv,
    start: usize,
    mask: Option<&Tensor>,
    kernel: impl FnOnce(&Rows, &mut [f32]),
) -> Result<Tensor> {
    let shapes = Shapes::of(q, kv)?;
    let (nh, q_len, dh) = (shapes.nh, shapes.q_len, shapes.dh);
    let q = q.contiguous()?;
    let mask = mask_values(mask)?;
    let mut out = vec![0f32; nh * q_len * dh];
    with_data(&q, |qd, _| {
        kv.with_rows(dh, |heads| {
            let rows = Rows {
                shapes: &shapes,
                q: qd,
                heads,
                mask: mask.as_deref(),
                start,
            };
            kernel(&rows, &mut out);
            Ok(())
        })
    })?;
    Ok(Tensor::from_vec(out, (nh, q_len, dh), &Device::Cpu)?)
}
