//! The operands of one attention call borrowed as rows, shared by the loop kernels.

use candle_core::{Device, Storage, Tensor};

use crate::{Error, Result};

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
    pub(super) fn of(q: &Tensor, keys: &Tensor) -> Result<Self> {
        let (nh, q_len, dh) = q.dims3()?;
        let (nkv, kv_len, _) = keys.dims3()?;
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
    pub(super) k: (&'a [f32], &'a [usize]),
    pub(super) v: (&'a [f32], &'a [usize]),
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

    fn at<'b>(&self, (data, st): (&'b [f32], &[usize]), kvh: usize, j: usize) -> &'b [f32] {
        let b = kvh * st[0] + j * st[1];
        &data[b..b + self.shapes.dh]
    }

    /// The KV head that query row `i = head * q_len + t` reads.
    pub(super) fn kv_head(&self, i: usize) -> usize {
        i / self.shapes.q_len / self.shapes.group
    }

    /// Key `j` of KV head `kvh`.
    pub(super) fn key(&self, kvh: usize, j: usize) -> &[f32] {
        self.at(self.k, kvh, j)
    }

    /// Value `j` of KV head `kvh`.
    pub(super) fn value(&self, kvh: usize, j: usize) -> &[f32] {
        self.at(self.v, kvh, j)
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

/// Run `kernel(rows, out)` over `q`, `keys`, `values` and `mask` borrowed as [`Rows`],
/// with `out` `(n_heads * q * d_head)` zeroed; returns `out` as `(n_heads, q, d_head)`.
pub(super) fn per_row(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start: usize,
    mask: Option<&Tensor>,
    kernel: impl FnOnce(&Rows, &mut [f32]),
) -> Result<Tensor> {
    let shapes = Shapes::of(q, keys)?;
    let (nh, q_len, dh) = (shapes.nh, shapes.q_len, shapes.dh);
    let q = q.contiguous()?;
    let mask = mask_values(mask)?;
    let mut out = vec![0f32; nh * q_len * dh];
    with_data(&q, |qd, _| {
        with_data(keys, |kd, ks| {
            with_data(values, |vd, vs| {
                let rows = Rows {
                    shapes: &shapes,
                    q: qd,
                    k: (kd, ks),
                    v: (vd, vs),
                    mask: mask.as_deref(),
                    start,
                };
                kernel(&rows, &mut out);
                Ok(())
            })
        })
    })?;
    Ok(Tensor::from_vec(out, (nh, q_len, dh), &Device::Cpu)?)
}
