//! Five implementations of `softmax(q k^T / sqrt(d) + mask) v` with GQA; a model's
//! [`Path`], fixed from its [`Numerics`] when it is loaded, picks among them per call:
//!
//! * [`batched`]: candle matrix products and a softmax over the whole score matrix:
//!   fast for prefill, and it yields the attention probabilities as a by-product;
//! * [`blocked`]: the same products per block of queries over just the keys the block
//!   sees, for a prefill whose probabilities nobody reads;
//! * [`single_query`]: one decode step in plain loops over the KV cache, parallel over
//!   KV heads and parts of the keys, 16-lane dot products and a vectorised `exp`: a
//!   matrix product with one row spends most of its time packing operands. Its loops
//!   are compiled for AVX2 and AVX-512 besides the build's own target and chosen at run
//!   time ([`Isa`](crate::model::numerics::kernels::Isa)), with the same floats on each; the prefill softmax of [`blocked`]
//!   is compiled for the build's target only;
//! * [`streaming`]: a one-pass online softmax (Milakov and Gimelshein 2018, as in
//!   FlashAttention) that visits key positions in order, one query row at a time, and
//!   for a single query splits the keys into tiles of 16 merged left to right. This is the
//!   arithmetic order of mistral.rs's CPU attention, so with the same quantized matmuls
//!   the two engines compute the same floats. With activations quantized to 8 bits before
//!   every matmul, any last-bit difference in attention would otherwise cascade through
//!   rounding flips into logit differences of ~0.1 (measured), which is why parity needs
//!   the same order and not merely the same function.
//! * [`ggml_plain`]: llama.cpp's plain attention over an f32 cache in ggml's arithmetic
//!   order (scores, softmax and value sums of [`crate::model::numerics::ggml`]), for parity with
//!   llama.cpp.
//!
//! Shapes: queries `(n_heads, q, d_head)` contiguous; keys and values
//! `(n_kv_heads, kv_len, d_head)` ([`Kv`]: each head's rows read in place from the
//! cache's stores, or tensors with the last dim contiguous); mask
//! `(n_heads, q, kv_len)` or, when `None`, causal for queries at `start..start + q`.
//! Output `(n_heads, q, d_head)`.

mod batched;
mod blocked;
mod ggml_plain;
mod per_head;
mod rows;
mod single_query;
mod streaming;

pub(crate) use batched::batched;
pub(crate) use blocked::blocked;
pub(crate) use ggml_plain::ggml_plain;
pub(crate) use per_head::{per_head, store};
pub(crate) use rows::{Kv, KvRows, StoredRows};
pub(crate) use single_query::{decode_rows, single_query};
pub(crate) use streaming::streaming;

use candle_core::Tensor;

use crate::model::numerics::ggml;
use crate::model::Numerics;
use crate::Result;

/// Which implementations a layer read in order (the plain cache's, a policy's full
/// layers) attends with, fixed from the model's numerics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// [`Numerics::Fast`]: [`single_query`] for a decode step, [`blocked`] for a prefill
    /// whose probabilities nobody reads, [`batched`] otherwise.
    Fast,
    /// [`Numerics::Reference`]: [`streaming`], mistral.rs's order.
    Streaming,
    /// [`Numerics::Ggml`]: [`ggml_plain`] in the arithmetic of ggml's `simd` path.
    Ggml(ggml::Simd),
}

/// One sequence's attention inputs: queries `(n_heads, q, d_head)` at positions
/// `key_start + offset ..`, keys and values `(n_kv_heads, kv_len, d_head)` from position
/// `key_start`, an additive `mask` `(n_heads, q, kv_len)`, or `causal` (for [`batched`]).
pub(crate) struct Inputs<'a> {
    pub q: &'a Tensor,
    pub kv: Kv<'a>,
    pub offset: usize,
    pub key_start: usize,
    pub mask: Option<&'a Tensor>,
    pub causal: Option<&'a Tensor>,
    /// The layer's sliding window (read by [`blocked`], which builds its own masks).
    pub window: Option<usize>,
}

impl Path {
    /// The path of `numerics`; `simd` is the ggml path [`Numerics::Ggml`] follows.
    pub(crate) fn new(numerics: Numerics, simd: ggml::Simd) -> Self {
        match numerics {
            Numerics::Fast => Path::Fast,
            Numerics::Reference => Path::Streaming,
            Numerics::Ggml => Path::Ggml(simd),
        }
    }

    /// Whether `q_len` queries go by [`blocked`] query blocks, which build their own causal
    /// and window masks (a prefill whose probabilities nobody reads, fast numerics).
    pub(crate) fn blocks(self, q_len: usize, want_probs: bool) -> bool {
        self == Path::Fast && q_len > 1 && !want_probs
    }

    /// The head outputs `(n_heads, q, d_head)` and, when `want_probs`, the attention
    /// probabilities `(n_heads, q, kv_len)`.
    pub(crate) fn attend(self, x: &Inputs, want_probs: bool) -> Result<(Tensor, Option<Tensor>)> {
        let (q_len, dh) = (x.q.dim(1)?, x.q.dim(2)?);
        let batched = || -> Result<(Tensor, Tensor)> {
            let (keys, values) = x.kv.tensors(dh)?;
            batched(x.q, &keys, &values, x.mask, x.causal)
        };
        let probs = |path_probs: Option<Tensor>| -> Result<Option<Tensor>> {
            Ok(match (want_probs, path_probs) {
                (false, _) => None,
                (true, Some(p)) => Some(p),
                (true, None) => Some(batched()?.1),
            })
        };
        match self {
            Path::Fast if q_len == 1 => single_query(x.q, &x.kv, x.mask, want_probs),
            Path::Fast if self.blocks(q_len, want_probs) => {
                let (keys, values) = x.kv.tensors(dh)?;
                let out = blocked(x.q, &keys, &values, x.offset, x.mask, x.window)?;
                Ok((out, None))
            }
            Path::Fast => {
                let (out, p) = batched()?;
                Ok((out, probs(Some(p))?))
            }
            Path::Streaming => {
                let p = probs(None)?;
                Ok((streaming(x.q, &x.kv, x.offset, x.mask)?, p))
            }
            Path::Ggml(simd) => {
                let p = probs(None)?;
                let out = ggml_plain(x.q, &x.kv, x.offset, x.key_start, x.mask, simd)?;
                Ok((out, p))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::single_query::{decode_rows_on, dot_lanes};
    use super::*;
    use crate::model::numerics::ggml;
    use crate::model::numerics::kernels::Isa;

    #[test]
    fn dot_kernels_agree_with_a_plain_sum() {
        for n in [8, 16, 64, 80] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot_lanes(&a, &b) as f64 - want).abs() < 1e-4, "n {n}");
        }
    }

    #[test]
    fn decode_attention_is_the_same_on_every_instruction_set() {
        // Head widths of the vector loops' whole runs (64, 256), of a dot product's
        // remainder and the portable value sums (72), and of the two models (64, 256).
        for dh in [64, 72, 256] {
            decode_attention_is_the_same_on_every_instruction_set_at(dh);
        }
    }

    fn decode_attention_is_the_same_on_every_instruction_set_at(dh: usize) {
        let (nh, nkv, len) = (6, 2, 300);
        let q = Tensor::randn(0f32, 1.0, (nh * dh,), &Device::Cpu).unwrap();
        let q: Vec<f32> = q.to_vec1().unwrap();
        let kv = Tensor::randn(0f32, 1.0, (2 * nkv * len * dh,), &Device::Cpu).unwrap();
        let kv: Vec<f32> = kv.to_vec1().unwrap();
        let keys = |h: usize| &kv[h * len * dh..][..len * dh];
        let values = |h: usize| &kv[(nkv + h) * len * dh..][..len * dh];
        let heads: Vec<StoredRows> = (0..nkv)
            .map(|h| StoredRows::from(&KvRows::contiguous(keys(h), values(h), dh)))
            .collect();
        let bias: Vec<f32> = (0..len)
            .map(|j| if j % 7 == 0 { f32::NEG_INFINITY } else { 0.1 })
            .collect();
        let masks: Vec<Option<&[f32]>> =
            (0..nh).map(|h| (h % 2 == 0).then_some(&bias[..])).collect();
        let (out, probs) = decode_rows_on(Isa::Portable, &q, dh, &heads, &masks, true);
        for isa in Isa::available() {
            let (o, p) = decode_rows_on(isa, &q, dh, &heads, &masks, true);
            assert!(
                o.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa}, d_head {dh}"
            );
            assert_eq!(p, probs, "{isa}, d_head {dh}");
        }
        // Rows in two parts (a shared prefix, then a head's own) give the same bits
        // wherever the split falls: inside a task's part of the keys or at its edge.
        for split in [0, 1, 64, 150, 299, 300] {
            let heads: Vec<StoredRows> = (0..nkv)
                .map(|h| {
                    let (k0, k1) = keys(h).split_at(split * dh);
                    let (v0, v1) = values(h).split_at(split * dh);
                    StoredRows::from(&KvRows::parts([k0, k1], [v0, v1], dh))
                })
                .collect();
            let (o, p) = decode_rows(&q, dh, &heads, &masks, true);
            assert!(
                o.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                "split {split}, d_head {dh}"
            );
            assert_eq!(p, probs, "split {split}, d_head {dh}");
        }
    }

    #[test]
    fn f16_and_8_bit_rows_read_in_place_give_the_bits_of_the_rows_decoded_first() {
        // A decode step over a store's f16 or q8_0 rows, decoded a chunk at a time as it
        // reads them, against the same rows decoded to f32 whole beforehand (as the
        // other attention paths read them), on every instruction set; the rows in two
        // parts (a shared prefix of 37 rows, then the head's own), so that a chunk
        // straddles the parts.
        use crate::model::cache::rows::Rows;
        use crate::model::RowFormat;
        let (nh, nkv, len) = (6, 2, 300);
        // 72: a dot product's remainder and the portable value sums.
        for dh in [64, 72, 256] {
            let randn = |n: usize| -> Vec<f32> {
                let t = Tensor::randn(0f32, 1.0, (n,), &Device::Cpu).unwrap();
                t.to_vec1().unwrap()
            };
            let (q, kv) = (randn(nh * dh), randn(2 * nkv * len * dh));
            let bias: Vec<f32> = (0..len).map(|j| (j % 5) as f32 * -0.5).collect();
            let masks: Vec<Option<&[f32]>> =
                (0..nh).map(|h| (h == 1).then_some(&bias[..])).collect();
            for format in [RowFormat::F16, RowFormat::Q8_0] {
                let stores: Vec<(Rows, Rows)> = (0..nkv)
                    .map(|h| {
                        let mut k = Rows::new(format, dh, len);
                        let mut v = Rows::new(format, dh, len);
                        for j in 0..len {
                            if j == 37 {
                                k.share();
                                v.share();
                            }
                            k.push(&kv[(h * len + j) * dh..][..dh]);
                            v.push(&kv[((nkv + h) * len + j) * dh..][..dh]);
                        }
                        (k, v)
                    })
                    .collect();
                let in_place: Vec<StoredRows> = stores
                    .iter()
                    .map(|(k, v)| StoredRows::parts(k.runs(), v.runs(), dh))
                    .collect();
                let decoded: Vec<(Vec<f32>, Vec<f32>)> = stores
                    .iter()
                    .map(|(k, v)| (k.as_f32().concat(), v.as_f32().concat()))
                    .collect();
                let f32_rows: Vec<KvRows> = decoded
                    .iter()
                    .map(|(k, v)| KvRows::contiguous(k, v, dh))
                    .collect();
                let f32_rows: Vec<StoredRows> = f32_rows.iter().map(StoredRows::from).collect();
                for isa in Isa::available() {
                    let (want, want_p) = decode_rows_on(isa, &q, dh, &f32_rows, &masks, true);
                    let (got, got_p) = decode_rows_on(isa, &q, dh, &in_place, &masks, true);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa}, {format:?}, d_head {dh}"
                    );
                    assert_eq!(got_p, want_p, "{isa}, {format:?}, d_head {dh}");
                }
                // The other paths read the same rows decoded whole.
                let (kt, vt) = Kv::Stored(&in_place).tensors(dh).unwrap();
                let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let (kw, vw): (Vec<f32>, Vec<f32>) = (
                    decoded.iter().flat_map(|(k, _)| k.clone()).collect(),
                    decoded.iter().flat_map(|(_, v)| v.clone()).collect(),
                );
                assert_eq!((flat(&kt), flat(&vt)), (kw, vw), "{format:?}, d_head {dh}");
            }
        }
    }

    fn tensors<'a>(keys: &'a Tensor, values: &'a Tensor) -> Kv<'a> {
        Kv::Tensors { keys, values }
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn single_query_matches_batched_attention() {
        // 37 keys: one part; 300 keys: several parts per KV head; MQA (4 heads, 1 KV head).
        for (nh, nkv, kv_len) in [(6, 2, 37), (9, 3, 300), (4, 1, 1000)] {
            let q = Tensor::randn(0f32, 1.0, (nh, 1, 64), &Device::Cpu).unwrap();
            let k = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let v = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let (o1, p1) = single_query(&q, &tensors(&k, &v), None, true).unwrap();
            let (o2, p2) = batched(&q, &k, &v, None, None).unwrap();
            assert!(max_diff(&o1, &o2) < 1e-5, "{nh}/{nkv}/{kv_len}");
            assert!(max_diff(&p1.unwrap(), &p2) < 1e-6, "{nh}/{nkv}/{kv_len}");
            let (o3, none) = single_query(&q, &tensors(&k, &v), None, false).unwrap();
            assert!(none.is_none() && max_diff(&o1, &o3) == 0.0);
        }
    }

    /// `(nh, q, kv_len)` mask: causal for queries at `start..`, within `window`, plus
    /// `bias * (j % 7)` on visible key `j`.
    fn full_mask(
        (nh, q, kv_len): (usize, usize, usize),
        start: usize,
        w: Option<usize>,
        bias: f32,
    ) -> Tensor {
        let m: Vec<f32> = (0..nh * q * kv_len)
            .map(|i| {
                let (t, j) = ((i / kv_len) % q, i % kv_len);
                let query = start + t;
                if j <= query && w.is_none_or(|w| j + w > query) {
                    bias * (j % 7) as f32
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        Tensor::from_vec(m, (nh, q, kv_len), &Device::Cpu).unwrap()
    }

    #[test]
    fn blocked_prefill_matches_loops_over_the_whole_mask() {
        // Several blocks, a partial last block, earlier keys before the queries, MQA and a
        // sliding window shorter than a block; with and without a given mask.
        for (nh, nkv, q_len, start, window) in [
            (9, 3, 600, 0, None),
            (6, 2, 300, 45, None),
            (4, 1, 700, 20, Some(100)),
        ] {
            let kv_len = start + q_len;
            let q = Tensor::randn(0f32, 1.0, (nh, q_len, 64), &Device::Cpu).unwrap();
            let k = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let v = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let shape = (nh, q_len, kv_len);
            let mask = full_mask(shape, start, window, 0.0);
            let want = streaming(&q, &tensors(&k, &v), start, Some(&mask)).unwrap();
            let got = blocked(&q, &k, &v, start, None, window).unwrap();
            let case = format!("{nh}/{nkv}/{q_len}/{start}/{window:?}");
            assert!(max_diff(&got, &want) < 1e-5, "{case}");
            let biased = full_mask(shape, start, window, 0.3);
            let want = streaming(&q, &tensors(&k, &v), start, Some(&biased)).unwrap();
            let given = blocked(&q, &k, &v, start, Some(&biased), window).unwrap();
            assert!(max_diff(&given, &want) < 1e-5, "{case}");
            assert!(max_diff(&given, &got) > 1e-3, "{case}: the bias is used");
        }
    }

    #[test]
    fn ggml_plain_matches_batched_attention() {
        // Prefill with a window and a bias, a causal prefill after earlier keys, and one
        // decode step; lanes aligned to absolute positions other than 0 change only the
        // last bits.
        for (nh, nkv, q_len, start, window, bias) in [
            (4, 1, 70, 0, Some(20), 0.3),
            (6, 2, 33, 40, None, 0.0),
            (9, 3, 1, 99, None, 0.0),
        ] {
            let kv_len = start + q_len;
            let q = Tensor::randn(0f32, 1.0, (nh, q_len, 64), &Device::Cpu).unwrap();
            let k = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let v = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
            let mask = full_mask((nh, q_len, kv_len), start, window, bias);
            let (want, _) = batched(&q, &k, &v, Some(&mask), None).unwrap();
            for simd in [ggml::Simd::Avx2, ggml::Simd::Avx512] {
                let case = format!("{simd:?} {nh}/{nkv}/{q_len}/{start}/{window:?}");
                let got = ggml_plain(&q, &tensors(&k, &v), start, 0, Some(&mask), simd).unwrap();
                assert!(max_diff(&got, &want) < 1e-5, "{case}");
                if window.is_none() && bias == 0.0 {
                    let causal = ggml_plain(&q, &tensors(&k, &v), start, 0, None, simd).unwrap();
                    assert_eq!(max_diff(&causal, &got), 0.0, "{case}: None is causal");
                }
                let shifted =
                    ggml_plain(&q, &tensors(&k, &v), start, 7, Some(&mask), simd).unwrap();
                assert!(max_diff(&shifted, &got) < 1e-6, "{case}");
            }
        }
    }

    #[test]
    fn rows_read_in_place_give_the_bits_of_tensors() {
        // Every path over each KV head's rows in two parts (a ring read oldest first, a
        // shared prefix) against the same keys as tensors: a decode step and a prefill.
        let (nh, nkv, kv_len, dh) = (6, 2, 70, 16);
        let k = Tensor::randn(0f32, 1.0, (nkv, kv_len, dh), &Device::Cpu).unwrap();
        let v = Tensor::randn(0f32, 1.0, (nkv, kv_len, dh), &Device::Cpu).unwrap();
        let (kd, vd) = (k.to_vec3::<f32>().unwrap(), v.to_vec3::<f32>().unwrap());
        let flat = |t: &[Vec<f32>]| t.concat();
        let (kf, vf): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (
            kd.iter().map(|h| flat(h)).collect(),
            vd.iter().map(|h| flat(h)).collect(),
        );
        let split = 29 * dh;
        let heads: Vec<KvRows> = (0..nkv)
            .map(|h| {
                let (k0, k1) = kf[h].split_at(split);
                let (v0, v1) = vf[h].split_at(split);
                KvRows::parts([k0, k1], [v0, v1], dh)
            })
            .collect();
        let stored: Vec<StoredRows> = heads.iter().map(StoredRows::from).collect();
        let rows = Kv::Stored(&stored);
        let (kt, vt) = rows.tensors(dh).unwrap();
        assert_eq!(max_diff(&kt, &k) + max_diff(&vt, &v), 0.0);
        let paths = [
            Path::Fast,
            Path::Streaming,
            Path::Ggml(ggml::Simd::Avx2),
            Path::Ggml(ggml::Simd::Avx512),
        ];
        for q_len in [1, 9] {
            let q = Tensor::randn(0f32, 1.0, (nh, q_len, dh), &Device::Cpu).unwrap();
            let start = kv_len - q_len;
            let causal = (q_len > 1).then(|| {
                let m = full_mask((1, q_len, kv_len), start, None, 0.0);
                m.squeeze(0).unwrap()
            });
            for path in paths {
                for want_probs in [false, true] {
                    let run = |kv: Kv| {
                        let x = Inputs {
                            q: &q,
                            kv,
                            offset: start,
                            key_start: 0,
                            mask: None,
                            causal: causal.as_ref(),
                            window: None,
                        };
                        path.attend(&x, want_probs).unwrap()
                    };
                    let (a, pa) = run(rows);
                    let (b, pb) = run(tensors(&k, &v));
                    let case = format!("{path:?} q {q_len} probs {want_probs}");
                    assert_eq!(max_diff(&a, &b), 0.0, "{case}");
                    assert_eq!(pa.is_some(), want_probs, "{case}");
                    if let (Some(pa), Some(pb)) = (pa, pb) {
                        assert_eq!(max_diff(&pa, &pb), 0.0, "{case}");
                    }
                }
            }
        }
    }

    #[test]
    fn single_query_honours_masks_that_blank_whole_parts() {
        let (nh, nkv, kv_len) = (9, 3, 400);
        let q = Tensor::randn(0f32, 1.0, (nh, 1, 64), &Device::Cpu).unwrap();
        let k = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
        let v = Tensor::randn(0f32, 1.0, (nkv, kv_len, 64), &Device::Cpu).unwrap();
        // keep 4 sink keys and the last 8: everything between is masked
        let mask: Vec<f32> = (0..nh * kv_len)
            .map(|i| {
                let j = i % kv_len;
                if j < 4 || j >= kv_len - 8 {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (nh, 1, kv_len), &Device::Cpu).unwrap();
        let (o1, p1) = single_query(&q, &tensors(&k, &v), Some(&mask), true).unwrap();
        let (o2, p2) = batched(&q, &k, &v, Some(&mask), None).unwrap();
        let p1 = p1.unwrap();
        assert!(max_diff(&o1, &o2) < 1e-5 && max_diff(&p1, &p2) < 1e-6);
        let kept: f32 = p1.sum_all().unwrap().to_scalar().unwrap();
        assert!((kept - nh as f32).abs() < 1e-4);
        let masked = p1.narrow(2, 4, kv_len - 12).unwrap();
        assert_eq!(
            masked
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
    }
}
