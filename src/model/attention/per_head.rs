//! Attention over a layer of the [`HeadCache`] whose heads keep different positions (a
//! policy's rings, tiered or pressed stores, top-k restrictions; a layer whose stores all
//! hold their positions in order is attended in the model's numerics instead, by the
//! forward pass): each KV head's query heads read the rows its store holds, seen through
//! the positions those rows hold. A decode step reads every stored row (exactly what the
//! retention keeps; a tiered head that is active also its cold middle), restricted by a
//! top-k bias where a query head has one, with [`decode_rows`]; a prefill chunk reads the
//! rows stored before it plus its own, a full head causally by query blocks
//! ([`blocked`]), a ring or tiered head under a mask built from its rows' positions
//! ([`batched`]).

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::model::attention::{batched, blocked, decode_rows, KvRows, StoredRows};
use crate::model::cache::store::{Parts, Retention};
use crate::model::{HeadCache, TopK};
use crate::Result;

/// Attention of one layer for queries at positions `start..start + q`: stores the new
/// keys and values `(n_kv_heads, q, d_head)` (after RoPE) in `cache` and attends with
/// `queries` `(n_heads, q, d_head)` (after RoPE) over what each head keeps. Returns
/// `(n_heads, q, d_head)` and, for a decode step (`q = 1`) when `want_probs`, each
/// head's probabilities `(n_heads, 1, start + 1)` over positions (zero at positions its
/// store does not hold or its top-k hides). The caller commits the `q` positions once
/// every layer ran.
pub(crate) fn per_head(
    cache: &mut HeadCache,
    layer: usize,
    queries: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start: usize,
    want_probs: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (nh, q_len, dh) = queries.dims3()?;
    cache.check_chunk(start, q_len)?;
    let nkv = keys.dim(0)?;
    let group = nh / nkv;
    let new_k = keys.to_vec3::<f32>()?;
    let new_v = values.to_vec3::<f32>()?;
    if q_len == 1 {
        store(cache, layer, start, &new_k, &new_v);
        let len = start + 1;
        let (stores, active) = cache.layer(layer);
        // Read in place unless a top-k bias scores the keys first or a tiered head
        // reads its cold tier (rows of two encodings): then decoded to f32.
        let in_place: Option<Vec<_>> = (0..nh)
            .all(|h| cache.topk(layer, h).is_none())
            .then(|| {
                stores
                    .iter()
                    .zip(active)
                    .map(|(s, &a)| s.runs(len, a))
                    .collect()
            })
            .flatten();
        let reads: Vec<(Parts, Parts)> = match in_place {
            Some(_) => Vec::new(),
            None => stores
                .par_iter()
                .zip(active)
                .map(|(s, &a)| s.parts(len, a))
                .collect(),
        };
        let rows: Vec<KvRows> = reads
            .iter()
            .map(|([k0, k1], [v0, v1])| KvRows::parts([k0, k1], [v0, v1], dh))
            .collect();
        let stored: Vec<StoredRows> = match &in_place {
            Some(runs) => runs
                .iter()
                .map(|&(k, v)| StoredRows::parts(k, v, dh))
                .collect(),
            None => rows.iter().map(StoredRows::from).collect(),
        };
        let q: Vec<f32> = queries.flatten_all()?.to_vec1()?;
        let masks: Vec<Option<Vec<f32>>> = (0..nh)
            .map(|h| {
                cache.topk(layer, h).map(|tk| {
                    let kv = h / group;
                    let pos = stores[kv].readable_positions(len, active[kv]);
                    topk_bias(&q[h * dh..(h + 1) * dh], &rows[kv], &pos, len - 1, tk)
                })
            })
            .collect();
        let masks: Vec<Option<&[f32]>> = masks.iter().map(|m| m.as_deref()).collect();
        let (out, probs) = decode_rows(&q, dh, &stored, &masks, want_probs);
        let probs = match probs {
            // Each head's weights over its rows, placed at the rows' positions.
            Some(per_row) => {
                let mut dense = vec![0f32; nh * len];
                for (kv, (store, &a)) in stores.iter().zip(active).enumerate() {
                    let positions = store.readable_positions(len, a);
                    for h in kv * group..(kv + 1) * group {
                        for (&p, &w) in positions.iter().zip(&per_row[h]) {
                            dense[h * len + p] = w;
                        }
                    }
                }
                Some(Tensor::from_vec(dense, (nh, 1, len), &Device::Cpu)?)
            }
            None => None,
        };
        return Ok((Tensor::from_vec(out, (nh, 1, dh), &Device::Cpu)?, probs));
    }
    // A prefill chunk: per KV head, the rows stored before it plus the chunk's own.
    let mut outs = Vec::with_capacity(nkv);
    let (stores, _) = cache.layer(layer);
    for (h, store) in stores.iter().enumerate() {
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
        // A full head's rows are positions `0..start + q` in order (unless a press
        // evicted from it): plain causal attention, by query blocks. A ring (and a tiered head, whose cold rows
        // follow its ring's) is masked by its rows' positions, one `(q, n)` mask for
        // every query head of the group.
        let out = match store.retention {
            Retention::Full if !store.is_pressed() => blocked(&qg, &kt, &vt, start, None, None)?,
            Retention::Stream { sink, window } => {
                let mask = ring_mask(&pos, start, q_len, Some((sink, window)))?;
                batched(&qg, &kt, &vt, None, Some(&mask))?.0
            }
            // A pressed store's rows, like a tiered head's, are masked by position only.
            Retention::Full | Retention::Tiered { .. } => {
                let mask = ring_mask(&pos, start, q_len, None)?;
                batched(&qg, &kt, &vt, None, Some(&mask))?.0
            }
        };
        outs.push(out);
    }
    store(cache, layer, start, &new_k, &new_v);
    Ok((Tensor::cat(&outs, 0)?, None))
}

/// Store the keys and values `[kv_head][t][d_head]` of positions `start..` in `layer`'s
/// stores of `cache`.
pub(crate) fn store(
    cache: &mut HeadCache,
    layer: usize,
    start: usize,
    keys: &[Vec<Vec<f32>>],
    values: &[Vec<Vec<f32>>],
) {
    for (h, (k, v)) in keys.iter().zip(values).enumerate() {
        let store = cache.store_mut(layer, h);
        for (t, (k, v)) in k.iter().zip(v).enumerate() {
            store.push(start + t, k, v);
        }
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
fn topk_bias(q: &[f32], rows: &KvRows, positions: &[usize], query: usize, tk: TopK) -> Vec<f32> {
    let d = q.len();
    let protected = |p: usize| p < tk.sink || p + tk.window > query;
    let mut scores: Vec<(f32, usize)> = positions
        .iter()
        .enumerate()
        .filter(|(_, &p)| !protected(p))
        .map(|(i, _)| {
            let k = rows.key(i, d);
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
    use crate::model::{Architecture, Config, RowFormat};
    use half::f16;
    use rand::{Rng, SeedableRng};

    /// `row` rounded by hand as a store of `format` holds it: f16; or q8_0 (blocks of
    /// 32, scale `absmax / 127` kept as f16, values `x / scale` rounded).
    fn rounded(format: RowFormat, row: &[f32]) -> Vec<f32> {
        match format {
            RowFormat::F32 => row.to_vec(),
            RowFormat::F16 => row.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
            RowFormat::Q8_0 => row
                .chunks(32)
                .flat_map(|block| {
                    let scale = block.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    let kept = f16::from_f32(scale).to_f32();
                    block.iter().map(move |&x| (x * inv).round() * kept)
                })
                .collect(),
        }
    }

    /// A one-layer llama config of `nh` query heads over `nkv` KV heads of `dh` values.
    fn one_layer(nh: usize, nkv: usize, dh: usize) -> Config {
        Config {
            architecture: Architecture::Llama,
            n_layers: 1,
            n_heads: nh,
            n_kv_heads: nkv,
            d_model: nh * dh,
            d_head: dh,
            d_ff: 8,
            vocab_size: 8,
            context_length: 64,
            rms_eps: 1e-5,
            rope_base: 10_000.0,
            sliding_window: None,
        }
    }

    #[test]
    fn quantized_stores_are_read_as_their_rounded_rows() {
        // 4 query heads over 2 KV heads of 40 values (a q8_0 block of 32 and one of 8);
        // a prefill chunk of 6, one of 3, then 3 decode steps.
        let (nh, nkv, dh, total) = (4, 2, 40, 12);
        let cfg = one_layer(nh, nkv, dh);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut draw =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
        // [position][head][d]
        let qs: Vec<Vec<Vec<f32>>> = (0..total)
            .map(|_| (0..nh).map(|_| draw(dh)).collect())
            .collect();
        let ks: Vec<Vec<Vec<f32>>> = (0..total)
            .map(|_| (0..nkv).map(|_| draw(dh)).collect())
            .collect();
        let vs: Vec<Vec<Vec<f32>>> = (0..total)
            .map(|_| (0..nkv).map(|_| draw(dh)).collect())
            .collect();
        let tensor = |rows: &[Vec<Vec<f32>>], heads: usize, span: std::ops::Range<usize>| {
            let q = span.len();
            let data: Vec<f32> = (0..heads)
                .flat_map(|h| span.clone().flat_map(move |p| rows[p][h].clone()))
                .collect();
            Tensor::from_vec(data, (heads, q, dh), &Device::Cpu).unwrap()
        };
        for format in [RowFormat::F16, RowFormat::Q8_0] {
            let mut cache = HeadCache::new(&cfg, &[Retention::Full; 2], format, total).unwrap();
            let mut worst = 0f64;
            for span in [0..6, 6..9, 9..10, 10..11, 11..12] {
                let (start, q) = (span.start, span.len());
                let (out, probs) = per_head(
                    &mut cache,
                    0,
                    &tensor(&qs, nh, span.clone()),
                    &tensor(&ks, nkv, span.clone()),
                    &tensor(&vs, nkv, span.clone()),
                    start,
                    true,
                )
                .unwrap();
                let out = out.to_vec3::<f32>().unwrap();
                // probabilities come with decode steps only
                assert_eq!(probs.is_some(), q == 1);
                let probs = probs.map(|p| p.to_vec3::<f32>().unwrap());
                cache.commit(q);
                for (t, p) in span.enumerate() {
                    for h in 0..nh {
                        let kv = h / (nh / nkv);
                        // a chunk reads its own rows exact, the stored ones rounded; a
                        // decode step reads every row as stored
                        let read = |rows: &Vec<Vec<Vec<f32>>>, j: usize| {
                            if q > 1 && j >= start {
                                rows[j][kv].clone()
                            } else {
                                rounded(format, &rows[j][kv])
                            }
                        };
                        let scores: Vec<f64> = (0..=p)
                            .map(|j| {
                                let k = read(&ks, j);
                                let dot: f64 = qs[p][h]
                                    .iter()
                                    .zip(&k)
                                    .map(|(a, b)| *a as f64 * *b as f64)
                                    .sum();
                                dot / (dh as f64).sqrt()
                            })
                            .collect();
                        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                        if let Some(probs) = &probs {
                            for (j, got) in probs[h][0].iter().enumerate() {
                                let want = (scores[j] - m).exp() / z;
                                worst = worst.max((want - *got as f64).abs());
                            }
                        }
                        let values: Vec<Vec<f32>> = (0..=p).map(|j| read(&vs, j)).collect();
                        for (c, got) in out[h][t].iter().enumerate() {
                            let want: f64 = (0..=p)
                                .map(|j| (scores[j] - m).exp() / z * values[j][c] as f64)
                                .sum();
                            worst = worst.max((want - *got as f64).abs());
                        }
                    }
                }
            }
            assert!(worst < 1e-5, "{format:?}: {worst}");
        }
    }

    #[test]
    fn a_ring_s_decode_probabilities_sit_at_the_positions_it_holds() {
        // 2 query heads over one KV head of 4 values, kept as 1 sink + 2 recent
        // positions: after a 6-token chunk, the step at position 6 reads positions 0, 5
        // and 6, and nothing else.
        let (nh, dh) = (2, 4);
        let cfg = one_layer(nh, 1, dh);
        let ring = Retention::Stream { sink: 1, window: 2 };
        let mut cache = HeadCache::new(&cfg, &[ring], RowFormat::F32, 8).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut draw = |shape: (usize, usize, usize)| {
            let n = shape.0 * shape.1 * shape.2;
            let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
        };
        let (q, k, v) = (draw((nh, 6, dh)), draw((1, 6, dh)), draw((1, 6, dh)));
        let (_, none) = per_head(&mut cache, 0, &q, &k, &v, 0, true).unwrap();
        assert!(none.is_none());
        cache.commit(6);
        let (q, k, v) = (draw((nh, 1, dh)), draw((1, 1, dh)), draw((1, 1, dh)));
        let (_, probs) = per_head(&mut cache, 0, &q, &k, &v, 6, true).unwrap();
        let probs = probs.unwrap().to_vec3::<f32>().unwrap();
        for head in &probs {
            let row = &head[0];
            assert_eq!(row.len(), 7);
            let held: Vec<usize> = (0..7).filter(|&j| row[j] > 0.0).collect();
            assert_eq!(held, [0, 5, 6], "{row:?}");
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
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
        // The same keys in one run, and in two parts (a shared prefix, then own rows).
        for split in [0, 3] {
            let (k0, k1) = keys.split_at(2 * split);
            let rows = KvRows::parts([k0, k1], [k0, k1], 2);
            let bias = topk_bias(&[1.0, 0.0], &rows, &positions, 7, tk);
            let kept: Vec<usize> = (0..8).filter(|&i| bias[i] == 0.0).collect();
            assert_eq!(kept, vec![0, 2, 4, 6, 7], "split {split}");
        }
    }
}
