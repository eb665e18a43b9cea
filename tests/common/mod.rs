//! Shared test helpers: the real models (fetched once per test binary), the evaluation
//! data (missing data is a skip, or a failure under `HEADWISE_REQUIRE_ALL=1`), and a tiny
//! random-weight llama together with an independent brute-force forward pass over plain
//! `Vec<f32>` loops, written without candle, to check the instrumented model against.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use headwise::model::file::gguf::MemorySource;
use headwise::model::{Architecture, Config, Model, Numerics, SlidingWindow};

#[path = "../../src/test_support/require.rs"]
mod require;
pub mod server;
#[allow(unused_imports)]
pub use require::{data, data_dir, models_dir, unavailable};

/// A path `name` inside a fresh temporary folder of its own, removed with everything in
/// it when this value is dropped; kept when the test is panicking, so that a failure's
/// files can be read (the panic message shows the path).
pub struct Scratch {
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
}

impl Scratch {
    /// A folder prefixed `headwise-{tag}-`, and `name` inside it (not created).
    pub fn new(tag: &str, name: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("headwise-{tag}-"))
            .tempdir()
            .unwrap();
        let path = dir.path().join(name);
        Self {
            dir: Some(dir),
            path,
        }
    }

    /// A fresh empty folder prefixed `headwise-{tag}-`.
    pub fn dir(tag: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("headwise-{tag}-"))
            .tempdir()
            .unwrap();
        let path = dir.path().to_path_buf();
        Self {
            dir: Some(dir),
            path,
        }
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.path.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(dir) = self.dir.take() {
                let _ = dir.keep();
            }
        }
    }
}

/// The SmolLM2 GGUF, fetched into `models/` (or `$HEADWISE_MODELS_DIR`) if missing.
pub fn real_model() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(p) = std::env::var("HEADWISE_MODEL") {
            return PathBuf::from(p);
        }
        fetched(&headwise::model::file::fetch::SMOLLM2)
    })
    .clone()
}

/// The Gemma-3-270M GGUF, fetched like [`real_model`].
pub fn real_gemma() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| fetched(&headwise::model::file::fetch::GEMMA3_270M))
        .clone()
}

fn fetched(model: &headwise::model::file::fetch::KnownModel) -> PathBuf {
    headwise::model::file::fetch::ensure(&models_dir(), model)
        .unwrap_or_else(|e| panic!("fetch {}: {e}", model.name))
        .path()
        .to_path_buf()
}

/// Shape of the tiny test model: 2 layers, 6 query heads over 2 KV heads (groups of 3).
pub fn tiny_config() -> Config {
    Config {
        architecture: Architecture::Llama,
        n_layers: 2,
        n_heads: 6,
        n_kv_heads: 2,
        d_model: 48,
        d_head: 8,
        d_ff: 64,
        vocab_size: 97,
        context_length: 128,
        rms_eps: 1e-5,
        rope_base: 10_000.0,
        sliding_window: None,
    }
}

/// A tiny Gemma 3: 4 layers (layer 1 and 3 global), 4 query heads over 1 KV head,
/// a sliding window of 5 positions, so that windows matter in short tests.
pub fn tiny_gemma_config() -> Config {
    Config {
        architecture: Architecture::Gemma3,
        n_layers: 4,
        n_heads: 4,
        n_kv_heads: 1,
        d_model: 32,
        d_head: 16,
        d_ff: 48,
        vocab_size: 61,
        context_length: 128,
        rms_eps: 1e-6,
        rope_base: 1_000_000.0,
        sliding_window: Some(SlidingWindow {
            size: 5,
            global_every: 2,
            local_rope_base: 10_000.0,
        }),
    }
}

/// Gemma 3's extra norms of one layer.
#[derive(Clone)]
pub struct GemmaNorms {
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub post_attn: Vec<f32>,
    pub post_ffn: Vec<f32>,
}

/// Row-major weights of one layer, `(out, in)` like GGUF.
#[derive(Clone)]
pub struct LayerW {
    pub attn_norm: Vec<f32>,
    pub wq: Vec<f32>,
    pub wk: Vec<f32>,
    pub wv: Vec<f32>,
    pub wo: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
    /// Present for Gemma 3.
    pub gemma: Option<GemmaNorms>,
}

/// All weights of a tiny model.
#[derive(Clone)]
pub struct Weights {
    pub cfg: Config,
    pub embed: Vec<f32>,
    pub layers: Vec<LayerW>,
    pub final_norm: Vec<f32>,
}

/// A small deterministic generator (xorshift), independent of the library's RNG use.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32, offset: f32) -> Vec<f32> {
        (0..n).map(|_| offset + scale * self.next()).collect()
    }
}

impl Weights {
    pub fn random(cfg: Config, seed: u64) -> Self {
        let mut r = Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
        let (d, dh, f) = (cfg.d_model, cfg.d_head, cfg.d_ff);
        let s = |n: usize| (3.0 / n as f32).sqrt();
        let layers = (0..cfg.n_layers)
            .map(|_| LayerW {
                attn_norm: r.vec(d, 0.1, 1.0),
                wq: r.vec(cfg.n_heads * dh * d, 2.0 * s(d), 0.0),
                wk: r.vec(cfg.n_kv_heads * dh * d, 2.0 * s(d), 0.0),
                wv: r.vec(cfg.n_kv_heads * dh * d, s(d), 0.0),
                wo: r.vec(d * cfg.n_heads * dh, s(cfg.n_heads * dh), 0.0),
                ffn_norm: r.vec(d, 0.1, 1.0),
                gate: r.vec(f * d, s(d), 0.0),
                up: r.vec(f * d, s(d), 0.0),
                down: r.vec(d * f, s(f), 0.0),
                gemma: (cfg.architecture == Architecture::Gemma3).then(|| GemmaNorms {
                    q_norm: r.vec(dh, 0.3, 1.0),
                    k_norm: r.vec(dh, 0.3, 1.0),
                    post_attn: r.vec(d, 0.1, 0.5),
                    post_ffn: r.vec(d, 0.1, 0.5),
                }),
            })
            .collect();
        Self {
            embed: r.vec(cfg.vocab_size * d, 1.0, 0.0),
            final_norm: r.vec(d, 0.1, 1.0),
            layers,
            cfg,
        }
    }

    /// Load these weights into the instrumented model (as f32 GGUF tensors).
    pub fn model(&self, numerics: Numerics) -> Model {
        self.model_as(numerics, GgmlDType::F32)
    }

    /// Load these weights with every matrix (embedding included) stored as `dtype` in the
    /// GGUF source, as a real model file stores them; norms stay f32. Every matrix width
    /// must be whole blocks of `dtype`.
    pub fn model_as(&self, numerics: Numerics, dtype: GgmlDType) -> Model {
        let cfg = &self.cfg;
        let mut src = MemorySource::default();
        let mut put = |name: String, data: &[f32], shape: &[usize]| {
            let t = Tensor::from_slice(data, shape, &Device::Cpu).unwrap();
            let dtype = if shape.len() == 2 {
                dtype
            } else {
                GgmlDType::F32
            };
            src.insert(name, QTensor::quantize(&t, dtype).unwrap());
        };
        let (d, dh, f) = (cfg.d_model, cfg.d_head, cfg.d_ff);
        put(
            "token_embd.weight".into(),
            &self.embed,
            &[cfg.vocab_size, d],
        );
        put("output_norm.weight".into(), &self.final_norm, &[d]);
        for (l, w) in self.layers.iter().enumerate() {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            put(n("attn_norm"), &w.attn_norm, &[d]);
            put(n("attn_q"), &w.wq, &[cfg.n_heads * dh, d]);
            put(n("attn_k"), &w.wk, &[cfg.n_kv_heads * dh, d]);
            put(n("attn_v"), &w.wv, &[cfg.n_kv_heads * dh, d]);
            put(n("attn_output"), &w.wo, &[d, cfg.n_heads * dh]);
            put(n("ffn_norm"), &w.ffn_norm, &[d]);
            put(n("ffn_gate"), &w.gate, &[f, d]);
            put(n("ffn_up"), &w.up, &[f, d]);
            put(n("ffn_down"), &w.down, &[d, f]);
            if let Some(g) = &w.gemma {
                put(n("attn_q_norm"), &g.q_norm, &[dh]);
                put(n("attn_k_norm"), &g.k_norm, &[dh]);
                put(n("post_attention_norm"), &g.post_attn, &[d]);
                put(n("post_ffw_norm"), &g.post_ffn, &[d]);
            }
        }
        Model::from_source(cfg.clone(), &mut src, numerics).unwrap()
    }
}

/// What the brute-force pass may change, mirroring the model's interventions.
pub struct BruteEdits<'a> {
    /// `visible(layer, head, query_pos, key_pos)`; causality is applied on top.
    pub visible: &'a dyn Fn(usize, usize, usize, usize) -> bool,
    /// `output(layer, head)`: a replacement head output.
    pub output: &'a dyn Fn(usize, usize) -> Option<Vec<f32>>,
    /// `stored(query_pos, key_pos, row)`: the key or value row (one KV head's `d_head`
    /// values) that the query reads for the key, as the cache holds it (a quantized
    /// cache's rounding).
    pub stored: &'a StoredRow<'a>,
}

/// `(query_pos, key_pos, row) -> row as read`: see [`BruteEdits::stored`].
pub type StoredRow<'a> = dyn Fn(usize, usize, &[f32]) -> Vec<f32> + 'a;

pub fn no_edits() -> BruteEdits<'static> {
    BruteEdits {
        visible: &|_, _, _, _| true,
        output: &|_, _| None,
        stored: &|_, _, row| row.to_vec(),
    }
}

fn matvec(w: &[f32], x: &[f32], out: usize) -> Vec<f32> {
    let inp = x.len();
    (0..out)
        .map(|o| {
            (0..inp)
                .map(|i| w[o * inp + i] as f64 * x[i] as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, g)| (*v as f64 * r) as f32 * g)
        .collect()
}

/// Rotate pairs `(2i, 2i+1)` (llama) or `(i, i + d/2)` (Gemma) by `pos * base^(-2i/d)`.
/// RoPE of one head vector at `pos`: pairs `(i, i + d / 2)` when `halves`, else
/// `(2i, 2i + 1)`, pair `i` rotated by `pos * base^(-2i / d)`.
pub fn rope(v: &mut [f32], pos: usize, base: f32, halves: bool) {
    let d = v.len();
    for i in 0..d / 2 {
        let theta = pos as f64 * (base as f64).powf(-2.0 * i as f64 / d as f64);
        let (s, c) = theta.sin_cos();
        let (x, y) = if halves {
            (i, i + d / 2)
        } else {
            (2 * i, 2 * i + 1)
        };
        let (a, b) = (v[x] as f64, v[y] as f64);
        v[x] = (a * c - b * s) as f32;
        v[y] = (a * s + b * c) as f32;
    }
}

/// GELU, tanh approximation.
fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

/// Logits `(tokens.len(), vocab)` computed by plain loops, one position at a time.
pub fn brute_force_logits(w: &Weights, tokens: &[u32], edits: &BruteEdits) -> Vec<Vec<f32>> {
    brute_force(w, tokens, edits).logits
}

/// Keys after RoPE of every layer and position, `[layer][position]` of
/// `n_kv_heads * d_head` values, from the plain-loop pass with full attention.
pub fn brute_force_keys(w: &Weights, tokens: &[u32]) -> Vec<Vec<Vec<f32>>> {
    brute_force(w, tokens, &no_edits()).keys
}

/// Attention probabilities `[layer][head][query][key]` (zero where a key is not
/// visible) from the plain-loop pass with full attention.
pub fn brute_force_attention(w: &Weights, tokens: &[u32]) -> Vec<Vec<Vec<Vec<f64>>>> {
    brute_force(w, tokens, &no_edits()).attention
}

/// Queries before RoPE (`n_heads * d_head` values) and values (`n_kv_heads * d_head`)
/// of every layer and position, `[layer][position]`, from the plain-loop pass with full
/// attention.
pub fn brute_force_queries_values(w: &Weights, tokens: &[u32]) -> (PerPosition, PerPosition) {
    let b = brute_force(w, tokens, &no_edits());
    (b.queries, b.values)
}

/// Rows of every layer and position, `[layer][position]`.
pub type PerPosition = Vec<Vec<Vec<f32>>>;

/// What the plain-loop pass computes.
struct Brute {
    logits: Vec<Vec<f32>>,
    keys: Vec<Vec<Vec<f32>>>,
    queries: Vec<Vec<Vec<f32>>>,
    values: Vec<Vec<Vec<f32>>>,
    attention: Vec<Vec<Vec<Vec<f64>>>>,
}

/// The plain-loop pass: logits, the keys and the attention of every layer.
fn brute_force(w: &Weights, tokens: &[u32], edits: &BruteEdits) -> Brute {
    let cfg = &w.cfg;
    let (d, dh, nh, nkv) = (cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads);
    let group = nh / nkv;
    let gemma = cfg.architecture == Architecture::Gemma3;
    let embed_scale = if gemma { (d as f64).sqrt() } else { 1.0 };
    let mut xs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| {
            w.embed[t as usize * d..(t as usize + 1) * d]
                .iter()
                .map(|v| (*v as f64 * embed_scale) as f32)
                .collect()
        })
        .collect();
    let mut all_keys = Vec::with_capacity(w.layers.len());
    let mut all_queries = Vec::with_capacity(w.layers.len());
    let mut all_values = Vec::with_capacity(w.layers.len());
    let mut all_probs = Vec::with_capacity(w.layers.len());
    for (l, lw) in w.layers.iter().enumerate() {
        // Gemma 3 here: every `global_every`-th layer global, the rest windowed.
        let (base, window) = match cfg.sliding_window {
            Some(sw) if l % sw.global_every != sw.global_every - 1 => (sw.local_rope_base, sw.size),
            _ => (cfg.rope_base, usize::MAX),
        };
        let hs: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| rmsnorm(x, &lw.attn_norm, cfg.rms_eps))
            .collect();
        let mut qs = Vec::new();
        let mut pre_rope = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (p, h) in hs.iter().enumerate() {
            let mut q = matvec(&lw.wq, h, nh * dh);
            let mut k = matvec(&lw.wk, h, nkv * dh);
            if let Some(g) = &lw.gemma {
                for head in q.chunks_mut(dh) {
                    head.copy_from_slice(&rmsnorm(head, &g.q_norm, cfg.rms_eps));
                }
                for head in k.chunks_mut(dh) {
                    head.copy_from_slice(&rmsnorm(head, &g.k_norm, cfg.rms_eps));
                }
            }
            pre_rope.push(q.clone());
            for head in q.chunks_mut(dh) {
                rope(head, p, base, gemma);
            }
            for head in k.chunks_mut(dh) {
                rope(head, p, base, gemma);
            }
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&lw.wv, h, nkv * dh));
        }
        all_keys.push(ks.clone());
        all_queries.push(pre_rope);
        all_values.push(vs.clone());
        let mut probs = vec![vec![vec![0f64; tokens.len()]; tokens.len()]; nh];
        for p in 0..tokens.len() {
            let mut concat = vec![0f32; nh * dh];
            for head in 0..nh {
                let kv = head / group;
                let out = match (edits.output)(l, head) {
                    Some(o) => o,
                    None => {
                        let q = &qs[p][head * dh..(head + 1) * dh];
                        let keys: Vec<usize> = (0..=p)
                            .filter(|&j| p - j < window)
                            .filter(|&j| j == p || (edits.visible)(l, head, p, j))
                            .collect();
                        let scores: Vec<f64> = keys
                            .iter()
                            .map(|&j| {
                                let k = (edits.stored)(p, j, &ks[j][kv * dh..(kv + 1) * dh]);
                                q.iter()
                                    .zip(&k)
                                    .map(|(a, b)| *a as f64 * *b as f64)
                                    .sum::<f64>()
                                    / (dh as f64).sqrt()
                            })
                            .collect();
                        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                        let z: f64 = e.iter().sum();
                        for (i, &j) in keys.iter().enumerate() {
                            probs[head][p][j] = e[i] / z;
                        }
                        let mut o = vec![0f64; dh];
                        for (i, &j) in keys.iter().enumerate() {
                            let v = (edits.stored)(p, j, &vs[j][kv * dh..(kv + 1) * dh]);
                            for (c, v) in v.iter().enumerate() {
                                o[c] += e[i] / z * *v as f64;
                            }
                        }
                        o.into_iter().map(|v| v as f32).collect()
                    }
                };
                concat[head * dh..(head + 1) * dh].copy_from_slice(&out);
            }
            let mut attn = matvec(&lw.wo, &concat, d);
            if let Some(g) = &lw.gemma {
                attn = rmsnorm(&attn, &g.post_attn, cfg.rms_eps);
            }
            for (x, a) in xs[p].iter_mut().zip(attn) {
                *x += a;
            }
        }
        all_probs.push(probs);
        for x in xs.iter_mut() {
            let h = rmsnorm(x, &lw.ffn_norm, cfg.rms_eps);
            let g = matvec(&lw.gate, &h, cfg.d_ff);
            let u = matvec(&lw.up, &h, cfg.d_ff);
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| {
                    let g = *g as f64;
                    let a = if gemma {
                        gelu(g)
                    } else {
                        g / (1.0 + (-g).exp())
                    };
                    a as f32 * u
                })
                .collect();
            let mut down = matvec(&lw.down, &act, d);
            if let Some(gn) = &lw.gemma {
                down = rmsnorm(&down, &gn.post_ffn, cfg.rms_eps);
            }
            for (x, dv) in x.iter_mut().zip(down) {
                *x += dv;
            }
        }
    }
    let logits = xs
        .iter()
        .map(|x| {
            let h = rmsnorm(x, &w.final_norm, cfg.rms_eps);
            matvec(&w.embed, &h, cfg.vocab_size)
        })
        .collect();
    Brute {
        logits,
        keys: all_keys,
        queries: all_queries,
        values: all_values,
        attention: all_probs,
    }
}

/// Largest absolute difference between a `(n, vocab)` tensor and rows of a table.
pub fn max_diff(t: &Tensor, rows: &[Vec<f32>]) -> f32 {
    let got: Vec<Vec<f32>> = t.to_vec2().unwrap();
    assert_eq!(got.len(), rows.len());
    got.iter()
        .zip(rows)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}
