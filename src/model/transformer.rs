//! The instrumented decoder: explicit attention `softmax(q k^T / sqrt(d) + mask) v`, GQA
//! (query head `h` reads KV head `h / (n_heads / n_kv_heads)`), interleaved RoPE,
//! RMSNorm, SwiGLU, chunked prefill into a [`HeadCache`], with an [`Observer`] and
//! [`Interventions`] at every attention head.

use std::path::Path;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor, D};
use rayon::prelude::*;

use crate::model::attention;
use crate::model::cache::store::Parts;
use crate::model::config::{Architecture, LayerSpec};
use crate::model::file::gguf::{GgufFile, TensorSource};
use crate::model::intervene::MaskSpan;
use crate::model::numerics::activation::Gate;
use crate::model::numerics::embedding::Embedding;
use crate::model::numerics::ggml;
use crate::model::numerics::linear::Projections;
use crate::model::numerics::Ops;
use crate::model::{Config, HeadCache, Interventions, Linear, Numerics, Observer, Rope};
use crate::{Error, Result};

/// Which positions' logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position: `(1, vocab)`.
    Last,
    /// Every position: `(q, vocab)`.
    All,
}

/// Default prefill chunk: bounds the attention scores to `n_heads x 256 x kv_len`.
pub const DEFAULT_CHUNK: usize = 256;

/// llama.cpp's default micro-batch. [`Numerics::Ggml`] prefills in chunks of this size,
/// because ggml picks some kernels by the number of rows in a batch (one row: a decode
/// step's kernels).
const LLAMA_CPP_UBATCH: usize = 512;

#[derive(Debug, Clone)]
struct Block {
    /// `(d_model,)`.
    attn_norm: Tensor,
    /// Gemma 3: RMSNorm weights `(d_head,)` applied to every query and key head.
    qk_norm: Option<(Tensor, Tensor)>,
    /// Q, K and V.
    qkv: Projections,
    wo: Linear,
    /// Gemma 3: RMSNorm `(d_model,)` of the attention output before the residual add.
    post_attn_norm: Option<Tensor>,
    /// `(d_model,)`.
    ffn_norm: Tensor,
    /// Gate and up.
    gate_up: Projections,
    down: Linear,
    /// Gemma 3: RMSNorm `(d_model,)` of the FFN output before the residual add.
    post_ffn_norm: Option<Tensor>,
}

/// A decoder-only transformer whose every attention head can be observed and edited.
#[derive(Debug, Clone)]
pub struct Model {
    cfg: Config,
    numerics: Numerics,
    /// Normalisation and feed-forward gate in `numerics`.
    ops: Ops,
    /// The attention of layers read in order, in `numerics`.
    attention: attention::Path,
    /// Per layer: RoPE, window.
    specs: Vec<LayerSpec>,
    /// `(vocab, d_model)`.
    embed: Embedding,
    /// Multiplies the looked-up embeddings (`sqrt(d_model)` for Gemma, else 1).
    embed_scale: f64,
    blocks: Vec<Block>,
    /// `(d_model,)`.
    final_norm: Tensor,
    lm_head: Linear,
    /// One table per layer (shared `Arc`s when layers share a base).
    ropes: Vec<Rope>,
    chunk: usize,
}

/// Seconds of one decode step's parts, each timed alone ([`Model::time_decode_parts`]).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DecodeParts {
    /// Every block's matrices (QKV, output, gate and up, down).
    pub weights_s: f64,
    /// The LM head.
    pub lm_head_s: f64,
    /// Attention of one query position over every layer's rows in view.
    pub attention_s: f64,
}

fn norm_weight(src: &mut dyn TensorSource, name: &str, width: usize) -> Result<Tensor> {
    let t = src.tensor(name)?.dequantize(&Device::Cpu)?;
    if t.dims() != [width] {
        return Err(Error::Tensor {
            name: name.into(),
            reason: format!("shape {:?}, expected [{width}]", t.dims()),
        });
    }
    Ok(t)
}

/// A 2-D weight `(out, in)`, shape-checked.
fn qtensor(src: &mut dyn TensorSource, name: &str, out: usize, inp: usize) -> Result<QTensor> {
    let t = src.tensor(name)?;
    if t.shape().dims() != [out, inp] {
        return Err(Error::Tensor {
            name: name.into(),
            reason: format!("shape {:?}, expected [{out}, {inp}]", t.shape().dims()),
        });
    }
    Ok(t)
}

fn linear(
    src: &mut dyn TensorSource,
    name: &str,
    out: usize,
    inp: usize,
    numerics: Numerics,
) -> Result<Linear> {
    Linear::new(qtensor(src, name, out, inp)?, numerics)
}

impl Model {
    /// Load a GGUF model file.
    pub fn load(path: &Path, numerics: Numerics) -> Result<Self> {
        let mut file = GgufFile::open(path)?;
        let cfg = Config::from_gguf(file.content())?;
        file.release_tokenizer_metadata();
        Self::from_source(cfg, &mut file, numerics)
    }

    /// Build from named tensors (GGUF names: `token_embd.weight`, `blk.N.attn_q.weight`, ...).
    pub fn from_source(
        cfg: Config,
        src: &mut dyn TensorSource,
        numerics: Numerics,
    ) -> Result<Self> {
        cfg.validate()?;
        // A bad `HEADWISE_ISA` is an error here, before any kernel runs.
        crate::model::numerics::kernels::Isa::from_env()?;
        let (d, dh) = (cfg.d_model, cfg.d_head);
        let (embed, embed_q) =
            Embedding::load(src, "token_embd.weight", (cfg.vocab_size, d), numerics)?;
        let lm_head = match (src.has("output.weight"), embed_q) {
            (true, _) => linear(src, "output.weight", cfg.vocab_size, d, numerics)?,
            (false, Some(q)) => Linear::with_dense(q, &embed.table()?, numerics)?,
            (false, None) => match embed.blocks() {
                Some(blocks) => Linear::shared(blocks.clone()),
                None => return Err(Error::Internal("a block embedding without its blocks")),
            },
        };
        let gemma = cfg.architecture == Architecture::Gemma3;
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let mut gemma_norm = |s: &str, width: usize| -> Result<Option<Tensor>> {
                gemma.then(|| norm_weight(src, &n(s), width)).transpose()
            };
            let qk_norm = match (
                gemma_norm("attn_q_norm", dh)?,
                gemma_norm("attn_k_norm", dh)?,
            ) {
                (Some(q), Some(k)) => Some((q, k)),
                _ => None,
            };
            let post_attn_norm = gemma_norm("post_attention_norm", d)?;
            let post_ffn_norm = gemma_norm("post_ffw_norm", d)?;
            blocks.push(Block {
                attn_norm: norm_weight(src, &n("attn_norm"), d)?,
                qk_norm,
                qkv: Projections::new(
                    vec![
                        qtensor(src, &n("attn_q"), cfg.n_heads * dh, d)?,
                        qtensor(src, &n("attn_k"), cfg.n_kv_heads * dh, d)?,
                        qtensor(src, &n("attn_v"), cfg.n_kv_heads * dh, d)?,
                    ],
                    numerics,
                )?,
                wo: linear(src, &n("attn_output"), d, cfg.n_heads * dh, numerics)?,
                post_attn_norm,
                ffn_norm: norm_weight(src, &n("ffn_norm"), d)?,
                gate_up: Projections::new(
                    vec![
                        qtensor(src, &n("ffn_gate"), cfg.d_ff, d)?,
                        qtensor(src, &n("ffn_up"), cfg.d_ff, d)?,
                    ],
                    numerics,
                )?,
                down: linear(src, &n("ffn_down"), d, cfg.d_ff, numerics)?,
                post_ffn_norm,
            });
        }
        let final_norm = norm_weight(src, "output_norm.weight", d)?;
        let specs: Vec<LayerSpec> = (0..cfg.n_layers).map(|l| cfg.layer(l)).collect();
        let mut ropes: Vec<Rope> = Vec::with_capacity(cfg.n_layers);
        for (l, spec) in specs.iter().enumerate() {
            let same = specs[..l]
                .iter()
                .position(|o| (o.rope_base, o.rope_style) == (spec.rope_base, spec.rope_style));
            match same {
                Some(i) => ropes.push(ropes[i].clone()),
                None => {
                    let new = match numerics {
                        Numerics::Ggml => Rope::ggml,
                        Numerics::Reference | Numerics::Fast => Rope::new,
                    };
                    ropes.push(new(spec.rope_base, dh, cfg.context_length, spec.rope_style))
                }
            }
        }
        // SwiGLU (Llama) or GeGLU with GELU's tanh form (Gemma).
        let (embed_scale, activation) = match cfg.architecture {
            Architecture::Llama => (1.0, Gate::Silu),
            Architecture::Gemma3 => ((d as f64).sqrt(), Gate::GeluTanh),
        };
        let simd = match numerics {
            // A bad `HEADWISE_GGML_SIMD` is an error here, before any work.
            Numerics::Ggml => ggml::Simd::from_env()?,
            Numerics::Reference | Numerics::Fast => ggml::Simd::detect(),
        };
        Ok(Self {
            cfg,
            numerics,
            ops: Ops::new(numerics, activation),
            attention: attention::Path::new(numerics, simd),
            specs,
            embed,
            embed_scale,
            blocks,
            final_norm,
            lm_head,
            ropes,
            chunk: match numerics {
                Numerics::Ggml => LLAMA_CPP_UBATCH,
                Numerics::Reference | Numerics::Fast => DEFAULT_CHUNK,
            },
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The arithmetic the model computes with.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// The x86 path of ggml whose attention arithmetic `ggml` numerics follow.
    pub fn ggml_simd(&self) -> ggml::Simd {
        match self.attention {
            attention::Path::Ggml(simd) => simd,
            attention::Path::Fast | attention::Path::Streaming => ggml::Simd::detect(),
        }
    }

    /// Follow `simd`'s attention arithmetic in `ggml` numerics (e.g. the path of the
    /// llama.cpp build being compared against); no effect in other numerics.
    pub fn set_ggml_simd(&mut self, simd: ggml::Simd) {
        if let attention::Path::Ggml(s) = &mut self.attention {
            *s = simd;
        }
    }

    /// The prefill chunk size: a prompt runs in forward steps of this many tokens.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Set the prefill chunk size (tokens per forward step; at least 1).
    pub fn set_chunk(&mut self, chunk: usize) {
        self.chunk = chunk.max(1);
    }

    /// The output projection of (layer, head): `W_O[:, head*d_head .. (head+1)*d_head]`,
    /// shape `(d_model, d_head)`, dequantized.
    pub fn head_output_projection(&self, layer: usize, head: usize) -> Result<Tensor> {
        self.check_head(layer, head)?;
        let w = self.output_projection(layer)?;
        Ok(w.narrow(1, head * self.cfg.d_head, self.cfg.d_head)?)
    }

    /// The whole output projection `W_O` of `layer`, `(d_model, n_heads * d_head)`,
    /// dequantized.
    pub fn output_projection(&self, layer: usize) -> Result<Tensor> {
        self.check_head(layer, 0)?;
        self.blocks[layer].wo.dequantized()
    }

    /// The unembedding (the LM head's weight), `(vocab, d_model)`, dequantized.
    pub fn unembedding(&self) -> Result<Tensor> {
        self.lm_head.dequantized()
    }

    /// Every matrix one decode step multiplies with, in order: each block's (QKV, output,
    /// gate and up, down), then the LM head.
    pub fn matrices(&self) -> Vec<&Linear> {
        let mut all = Vec::new();
        for b in &self.blocks {
            all.extend(b.qkv.layers());
            all.push(&b.wo);
            all.extend(b.gate_up.layers());
            all.push(&b.down);
        }
        all.push(&self.lm_head);
        all
    }

    /// Bytes of weight data one decode step streams: [`Model::matrices`]' weights.
    pub fn decode_weight_bytes(&self) -> usize {
        self.matrices().iter().map(|m| m.weight_bytes()).sum()
    }

    /// Seconds one decode step at `context` positions spends in each part, each part
    /// timed alone on the model's real weights (median of `reps` rounds): every block's
    /// matrices, the LM head, and attention over key and value rows of that many
    /// positions (a sliding-window layer's window at most; random values, freshly
    /// allocated so they stream from memory as a cache's would).
    pub fn time_decode_parts(&self, context: usize, reps: usize) -> Result<DecodeParts> {
        let cfg = &self.cfg;
        let (d, dh, nh, nkv) = (cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads);
        let ramp = |n: usize| -> Result<Tensor> {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 61) as f32 / 30.0 - 1.0)
                .collect();
            Ok(Tensor::from_vec(v, (1, n), &Device::Cpu)?)
        };
        let (x, x_attn, x_ff) = (ramp(d)?, ramp(nh * dh)?, ramp(cfg.d_ff)?);
        let kv: Vec<Vec<f32>> = (0..cfg.n_layers)
            .map(|l| {
                let seen = self.specs[l]
                    .window
                    .map_or(context, |w| w.min(context))
                    .max(1);
                (0..2 * nkv * seen * dh)
                    .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
                    .collect()
            })
            .collect();
        let q: Vec<f32> = (0..nh * dh)
            .map(|i| ((i % 13) as f32 - 6.0) / 13.0)
            .collect();
        let masks = vec![None; nh];
        let median = |mut t: Vec<f64>| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        };
        let (mut weights, mut lm_head, mut attention_s) = (Vec::new(), Vec::new(), Vec::new());
        // On a worker of rayon's pool, as the forward pass runs (see `forward`).
        rayon::scope(|_| -> Result<()> {
            for _ in 0..reps.max(1) {
                let start = std::time::Instant::now();
                for b in &self.blocks {
                    b.qkv.forward(&x)?;
                    b.wo.forward(&x_attn)?;
                    b.gate_up.forward(&x)?;
                    b.down.forward(&x_ff)?;
                }
                weights.push(start.elapsed().as_secs_f64());
                let start = std::time::Instant::now();
                self.lm_head.forward(&x)?;
                lm_head.push(start.elapsed().as_secs_f64());
                let start = std::time::Instant::now();
                for rows in &kv {
                    let len = rows.len() / (2 * nkv * dh);
                    let (keys, values) = rows.split_at(rows.len() / 2);
                    let heads: Vec<attention::StoredRows> = (0..nkv)
                        .map(|h| {
                            let rows = attention::KvRows::contiguous(
                                &keys[h * len * dh..][..len * dh],
                                &values[h * len * dh..][..len * dh],
                                dh,
                            );
                            attention::StoredRows::from(&rows)
                        })
                        .collect();
                    attention::decode_rows(&q, dh, &heads, &masks, false);
                }
                attention_s.push(start.elapsed().as_secs_f64());
            }
            Ok(())
        })?;
        Ok(DecodeParts {
            weights_s: median(weights),
            lm_head_s: median(lm_head),
            attention_s: median(attention_s),
        })
    }

    /// The final RMSNorm's weight, `(d_model,)`.
    pub fn final_norm_weight(&self) -> &Tensor {
        &self.final_norm
    }

    /// The token embedding rows, `(vocab, d_model)`, dequantized.
    pub fn embeddings(&self) -> Result<Tensor> {
        self.embed.table()
    }

    fn check_head(&self, layer: usize, head: usize) -> Result<()> {
        Error::check_head(layer, head, self.cfg.n_layers, self.cfg.n_heads)
    }

    /// Run `tokens` (placed after the `cache.len()` tokens already cached) through the
    /// model in chunks, appending their keys and values to `cache`.
    ///
    /// Returns logits `(1, vocab)` for [`Logits::Last`] or `(tokens.len(), vocab)` for
    /// [`Logits::All`]. The observer is called once per chunk ([`Observer::begin`]); with
    /// chunks of one position, an observer that wants at most the final hidden state is
    /// called once for the whole pass (the positions then run as one row of
    /// [`Model::decode_batch`], the same bits as one pass each).
    ///
    /// A layer whose stores all hold their positions in order (the plain cache,
    /// [`HeadCache::plain`], and a policy's full layers) attends in the model's numerics
    /// over one run of keys per head. Other layers read what each head's
    /// [`Retention`](crate::model::Retention) keeps, and top-k restrictions apply at
    /// decode steps; there, observers may not ask for values, nor for attention
    /// probabilities in a pass of more than one token (a decode step gives them, zero at
    /// the positions a head does not hold), and `edits` may not restrict keys or bias
    /// scores (a policy decides what heads see). Output and query edits apply as usual.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut HeadCache,
        logits: Logits,
        observer: &mut dyn Observer,
        edits: &Interventions,
    ) -> Result<Tensor> {
        self.check_step(tokens, cache, &*observer, edits)?;
        // Chunks of one token are decode steps: they run as one row of a batched step
        // (the same bits, the weights read once for all of them).
        if self.chunk == 1
            && tokens.len() > 1
            && logits == Logits::Last
            && observer.wants().at_most_final_hidden()
        {
            let mut row = [DecodeRow {
                cache,
                tokens,
                logits: true,
                observer,
                edits,
            }];
            return self
                .decode_batch(&mut row)?
                .pop()
                .flatten()
                .ok_or(Error::Internal("a row's logits"));
        }
        let mut outs = Vec::new();
        let n_chunks = tokens.len().div_ceil(self.chunk);
        // Run the pass on a worker of rayon's pool: its parallel matmuls and attention
        // then fork from inside the pool instead of handing each of the ~150 parallel
        // regions of a decode step over from an outside thread and sleeping until it is
        // done (measured: decode 48 -> 58 tokens/s at 512 tokens).
        rayon::scope(|_| -> Result<()> {
            for (i, chunk) in tokens.chunks(self.chunk).enumerate() {
                let last = i + 1 == n_chunks;
                let want = match logits {
                    Logits::All => Some(Logits::All),
                    Logits::Last if last => Some(Logits::Last),
                    Logits::Last => None,
                };
                if let Some(l) = self.forward_chunk(chunk, cache, want, observer, edits)? {
                    outs.push(l);
                }
            }
            Ok(())
        })?;
        Ok(if outs.len() == 1 {
            outs.pop()
                .ok_or(Error::Internal("one output per sequence"))?
        } else {
            Tensor::cat(&outs, 0)?
        })
    }

    /// Check a pass of `tokens` after what `cache` holds, before any work: tokens in the
    /// vocabulary and within the context, edits that fit the model, and nothing a cache
    /// that is not plain cannot give (values or a prefill's attention probabilities to
    /// observe, key restrictions or score biases).
    fn check_step(
        &self,
        tokens: &[u32],
        cache: &HeadCache,
        observer: &dyn Observer,
        edits: &Interventions,
    ) -> Result<()> {
        // What only a cache whose every head holds its positions in order can give.
        let wants = observer.wants();
        let needs_plain = wants.values || wants.attention && tokens.len() > 1;
        if (needs_plain || edits.restricts_keys()) && !cache.is_plain() {
            return Err(match needs_plain {
                true => Error::invalid(
                    "observer",
                    "through a cache whose heads keep different positions, values are not \
                     observable, and attention probabilities only at decode steps (one token)",
                ),
                false => Error::invalid(
                    "interventions",
                    "key restrictions and score biases do not apply to a cache whose heads \
                     keep different positions (use a top-k policy)",
                ),
            });
        }
        if tokens.is_empty() {
            return Err(Error::invalid("tokens", "empty input"));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::invalid(
                "tokens",
                format!("id {bad} outside the vocabulary of {}", self.cfg.vocab_size),
            ));
        }
        if cache.len() + tokens.len() > self.cfg.context_length {
            return Err(Error::ContextOverflow {
                prompt: cache.len() + tokens.len(),
                max_new: 0,
                context: self.cfg.context_length,
            });
        }
        edits.validate(&self.cfg)
    }

    fn forward_chunk(
        &self,
        tokens: &[u32],
        cache: &mut HeadCache,
        logits: Option<Logits>,
        observer: &mut dyn Observer,
        edits: &Interventions,
    ) -> Result<Option<Tensor>> {
        let wants = observer.wants();
        let start = cache.len();
        let q = tokens.len();
        observer.begin(start, q);
        let mut x = self.embed.lookup(tokens)?;
        if self.embed_scale != 1.0 {
            x = (x * self.embed_scale)?;
        }
        let causal = (q > 1).then(|| causal_mask(start, q)).transpose()?;
        for (l, block) in self.blocks.iter().enumerate() {
            let h = self.norm(&x, &block.attn_norm)?;
            let qkv = block.qkv.forward(&h)?;
            let heads = self.attend(
                l,
                block,
                &qkv,
                start,
                causal.as_ref(),
                cache,
                observer,
                edits,
            )?;
            let attn = block.wo.forward(&heads)?;
            x = self.post_attention(block, x, attn, Rows::Chunk)?;
            if wants.residual {
                observer.residual(l, &x);
            }
        }
        cache.commit(q);
        let h = self.norm(&x, &self.final_norm)?;
        if wants.final_hidden {
            observer.final_hidden(&h);
        }
        Ok(match logits {
            None => None,
            Some(Logits::All) => Some(self.lm_head.forward(&h)?),
            Some(Logits::Last) => Some(self.lm_head.forward(&h.narrow(0, q - 1, 1)?)?),
        })
    }

    /// One decode step of several sequences: each row's tokens at the positions after its
    /// own cache, appended to that cache, each token run as a decode step of its own (a
    /// row of several tokens is a part of a prompt prefilled one position at a time). The
    /// matrices run once over all tokens of all rows (every weight read once per step),
    /// each token's arithmetic as if it ran alone ([`Linear::forward_each`]); attention
    /// runs per row over its own cache, its tokens in order. So a token's result is
    /// bit-identical whatever else is in the batch, and equal to a single-sequence step
    /// ([`Model::forward`] with one token). Returns, per row,
    /// the logits `(1, vocab)` of its last token where the row asks for them.
    ///
    /// A row of several tokens needs an observer that wants at most the final hidden
    /// state (given for its last token).
    pub fn decode_batch(&self, rows: &mut [DecodeRow<'_>]) -> Result<Vec<Option<Tensor>>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        for row in rows.iter() {
            self.check_step(row.tokens, row.cache, &*row.observer, row.edits)?;
            if row.tokens.len() > 1 && !row.observer.wants().at_most_final_hidden() {
                return Err(Error::invalid(
                    "batch",
                    "a row of several tokens needs an observer that wants at most the \
                     final hidden state",
                ));
            }
        }
        // The pass's tokens, row after row; `firsts[i]` is where row `i`'s begin.
        let tokens: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let firsts: Vec<usize> = rows
            .iter()
            .scan(0, |at, r| {
                let first = *at;
                *at += r.tokens.len();
                Some(first)
            })
            .collect();
        rayon::scope(|_| -> Result<Vec<Option<Tensor>>> {
            for row in rows.iter_mut() {
                row.observer.begin(row.cache.len(), row.tokens.len());
            }
            let mut x = self.embed.lookup(&tokens)?;
            if self.embed_scale != 1.0 {
                x = (x * self.embed_scale)?;
            }
            for (l, block) in self.blocks.iter().enumerate() {
                let h = self.norm(&x, &block.attn_norm)?;
                let qkv = block.qkv.forward_each(&h)?;
                // Rows attend in parallel, each over its own cache as alone; a row's
                // tokens one after another, each seeing the ones before it.
                let heads = rows
                    .par_iter_mut()
                    .zip(&firsts)
                    .map(|(row, &first)| {
                        let start = row.cache.len();
                        let (observer, edits) = (&mut *row.observer, row.edits);
                        (0..row.tokens.len())
                            .map(|j| {
                                let own: Vec<Tensor> = qkv
                                    .iter()
                                    .map(|t| t.narrow(0, first + j, 1))
                                    .collect::<candle_core::Result<_>>()?;
                                self.attend(
                                    l,
                                    block,
                                    &own,
                                    start + j,
                                    None,
                                    row.cache,
                                    observer,
                                    edits,
                                )
                            })
                            .collect::<Result<Vec<_>>>()
                    })
                    .collect::<Result<Vec<_>>>()?;
                let heads: Vec<Tensor> = heads.into_iter().flatten().collect();
                let attn = block.wo.forward_each(&Tensor::cat(&heads, 0)?)?;
                x = self.post_attention(block, x, attn, Rows::Each)?;
                for (row, &first) in rows.iter_mut().zip(&firsts) {
                    if row.observer.wants().residual {
                        row.observer.residual(l, &x.narrow(0, first, 1)?);
                    }
                }
            }
            let h = self.norm(&x, &self.final_norm)?;
            // The last token of each row: its hidden state, and logits where asked.
            let lasts: Vec<usize> = rows
                .iter()
                .zip(&firsts)
                .map(|(r, &first)| first + r.tokens.len() - 1)
                .collect();
            for (row, &last) in rows.iter_mut().zip(&lasts) {
                row.cache.commit(row.tokens.len());
                if row.observer.wants().final_hidden {
                    row.observer.final_hidden(&h.narrow(0, last, 1)?);
                }
            }
            let asked: Vec<usize> = rows
                .iter()
                .zip(&lasts)
                .filter(|(r, _)| r.logits)
                .map(|(_, &last)| last)
                .collect();
            let logits = match asked.len() {
                0 => None,
                n => {
                    let index = Tensor::new(
                        asked.iter().map(|&t| t as u32).collect::<Vec<_>>(),
                        h.device(),
                    )?;
                    let picked = match n == tokens.len() {
                        true => h,
                        false => h.index_select(&index, 0)?,
                    };
                    Some(self.lm_head.forward_each(&picked)?)
                }
            };
            let mut next = 0;
            rows.iter()
                .map(|r| {
                    if !r.logits {
                        return Ok(None);
                    }
                    let l = logits
                        .as_ref()
                        .ok_or(Error::Internal("logits for every row that asks"))?
                        .narrow(0, next, 1)?;
                    next += 1;
                    Ok(Some(l))
                })
                .collect()
        })
    }

    /// The residual stream after a block's attention output `attn` `(q, d_model)`: the
    /// add, then the feed-forward block and its add. `rows` says how the matrices treat
    /// the rows (one sequence's chunk, or independent rows of a batch).
    fn post_attention(&self, block: &Block, x: Tensor, attn: Tensor, rows: Rows) -> Result<Tensor> {
        let post_norm = |t: Tensor, w: &Option<Tensor>| -> Result<Tensor> {
            match w {
                Some(w) => self.norm(&t, w),
                None => Ok(t),
            }
        };
        let x = (x + post_norm(attn, &block.post_attn_norm)?)?;
        let h = self.norm(&x, &block.ffn_norm)?;
        let gu = match rows {
            Rows::Chunk => block.gate_up.forward(&h)?,
            Rows::Each => block.gate_up.forward_each(&h)?,
        };
        let inner = self.ops.gated(&gu[0], &gu[1])?;
        let ffn = match rows {
            Rows::Chunk => block.down.forward(&inner)?,
            Rows::Each => block.down.forward_each(&inner)?,
        };
        Ok((x + post_norm(ffn, &block.post_ffn_norm)?)?)
    }

    /// `x` `(..., d_model)` RMS-normalised and scaled by `w` in this model's numerics.
    fn norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        self.ops.rms_norm(x, w, self.cfg.rms_eps as f32)
    }

    /// One sequence's attention from its projected queries, keys and values `qkv`
    /// (`(q, n_heads * d_head)`, `(q, n_kv_heads * d_head)` twice): the new keys and
    /// values appended to `cache`, and the head outputs, observed and edited,
    /// `(q, n_heads * d_head)` (before `W_O`).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        layer: usize,
        block: &Block,
        qkv: &[Tensor],
        start: usize,
        causal: Option<&Tensor>,
        cache: &mut HeadCache,
        observer: &mut dyn Observer,
        edits: &Interventions,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (q_len, nh, nkv, dh) = (qkv[0].dim(0)?, cfg.n_heads, cfg.n_kv_heads, cfg.d_head);
        let rope = &self.ropes[layer];
        // (q_len, n * d_head) -> (1, n, q_len, d_head)
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            Ok(t.reshape((1, q_len, n, dh))?.transpose(1, 2)?)
        };
        let (mut qh, mut kh) = (heads(qkv[0].clone(), nh)?, heads(qkv[1].clone(), nkv)?);
        if let Some((qn, kn)) = &block.qk_norm {
            qh = self.norm(&qh.contiguous()?, qn)?;
            kh = self.norm(&kh.contiguous()?, kn)?;
        }
        let qh = edits.replace_queries(layer, qh)?;
        let wants = observer.wants();
        if wants.queries {
            observer.queries(layer, &qh.squeeze(0)?.transpose(0, 1)?.contiguous()?);
        }
        let qh = edits.uniform_queries(layer, rope.apply(&qh, start)?.squeeze(0)?)?;
        let kh = rope.apply(&kh, start)?;
        let vh = heads(qkv[2].clone(), nkv)?;
        let (kh, vh) = (kh.squeeze(0)?, vh.squeeze(0)?);
        if !cache.reads_in_order(layer) {
            let (out, probs) =
                attention::per_head(cache, layer, &qh, &kh, &vh, start, wants.attention)?;
            if let Some(probs) = probs {
                observer.attention(layer, &probs);
            }
            return self.head_outputs(layer, out, observer, edits);
        }
        // Every head holds its positions in order: attention in the model's numerics over
        // one run of keys per head, read in place at a decode step; a prefill chunk reads
        // the rows stored before it followed by its own, and stores its own after.
        cache.check_chunk(start, q_len)?;
        let (new_k, new_v) = (kh.to_vec3::<f32>()?, vh.to_vec3::<f32>()?);
        let window = self.specs[layer].window;
        let held: (Tensor, Tensor);
        let rows: Vec<attention::StoredRows>;
        let stored;
        let (kv, key_start) = if q_len == 1 {
            attention::store(cache, layer, start, &new_k, &new_v);
            stored = cache
                .in_order_runs(layer, start + 1)
                .ok_or(Error::Internal("a layer read in order"))?;
            rows = stored
                .iter()
                .map(|&(keys, values)| attention::StoredRows::parts(keys, values, dh))
                .collect();
            let kv = attention::Kv::Stored(&rows);
            let key_start = (start + 1)
                .checked_sub(kv.dims()?.1)
                .ok_or(Error::Internal("a layer holds positions past its length"))?;
            (kv, key_start)
        } else {
            let before = cache
                .in_order(layer, start)
                .ok_or(Error::Internal("a layer read in order"))?;
            let n_before = before
                .first()
                .map_or(0, |(k, _)| (k[0].len() + k[1].len()) / dh);
            let n = n_before + q_len;
            let gather = |keys: bool| {
                let mut all: Vec<f32> = Vec::with_capacity(nkv * n * dh);
                for (b, (k, v)) in before.iter().zip(new_k.iter().zip(&new_v)) {
                    let (stored, new): (&Parts, _) = if keys { (&b.0, k) } else { (&b.1, v) };
                    all.extend(stored.iter().flat_map(|p| p.iter()));
                    all.extend(new.iter().flatten());
                }
                Tensor::from_vec(all, (nkv, n, dh), &Device::Cpu)
            };
            held = (gather(true)?, gather(false)?);
            let (keys, values) = (&held.0, &held.1);
            let key_start = start
                .checked_sub(n_before)
                .ok_or(Error::Internal("a layer holds positions past its length"))?;
            (attention::Kv::Tensors { keys, values }, key_start)
        };
        let kv_len = kv.dims()?.1;
        let span = MaskSpan {
            queries: start..start + q_len,
            keys: key_start..key_start + kv_len,
            window,
        };
        // A fast prefill whose probabilities nobody reads goes by query blocks, which
        // build their own causal and window masks.
        let blocks = self.attention.blocks(q_len, wants.attention);
        let mask = match blocks && !edits.masks_scores(layer) {
            true => None,
            false => edits.score_mask(layer, nh, &span)?,
        };
        // Otherwise, without a mask, the chunk's causal mask covers keys from position 0
        // (the window always cuts, and so builds a mask, once keys were dropped).
        debug_assert!(blocks || mask.is_some() || q_len == 1 || key_start == 0);
        if wants.values {
            let (_, values) = kv.tensors(dh)?;
            observer.values(layer, &pad_keys(&values, key_start, 1)?);
        }
        let inputs = attention::Inputs {
            q: &qh,
            kv,
            offset: start - key_start,
            key_start,
            mask: mask.as_ref(),
            causal,
            window,
        };
        let (out, probs) = self.attention.attend(&inputs, wants.attention)?;
        if let Some(probs) = probs {
            observer.attention(layer, &pad_keys(&probs, key_start, 2)?);
        }
        if q_len > 1 {
            attention::store(cache, layer, start, &new_k, &new_v);
        }
        self.head_outputs(layer, out, observer, edits)
    }

    /// Head outputs `(n_heads, q, d_head)` -> observed, edited: `(q, n_heads * d_head)`.
    fn head_outputs(
        &self,
        layer: usize,
        out: Tensor,
        observer: &mut dyn Observer,
        edits: &Interventions,
    ) -> Result<Tensor> {
        let (nh, q_len, dh) = out.dims3()?;
        let out = out.transpose(0, 1)?.contiguous()?;
        if observer.wants().head_outputs {
            observer.head_outputs(layer, &out);
        }
        let out = edits.edit_outputs(layer, out)?;
        Ok(out.reshape((q_len, nh * dh))?)
    }
}

/// One sequence's part of a batched decode step ([`Model::decode_batch`]): its cache,
/// the tokens to run (one for a decode step; several for a part of a prompt, each run
/// as a step of its own), whether to return the last one's logits, and its own observer
/// and edits.
pub struct DecodeRow<'a> {
    pub cache: &'a mut HeadCache,
    pub tokens: &'a [u32],
    pub logits: bool,
    pub observer: &'a mut dyn Observer,
    pub edits: &'a Interventions,
}

/// How a pass's matrices treat their rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// One sequence's chunk: the fastest product for that many rows.
    Chunk,
    /// Independent rows of a batch: each as if it ran alone.
    Each,
}

/// Attention probabilities `(n_heads, q, kv_len)` (key axis 2) or values `(n_kv_heads,
/// kv_len, d_head)` (key axis 1) over stored keys that start at absolute position
/// `key_start`, widened with zeros along the key axis to `key_start + kv_len`, so that
/// key index `j` is always position `j`.
fn pad_keys(t: &Tensor, key_start: usize, axis: usize) -> Result<Tensor> {
    if key_start == 0 {
        return Ok(t.clone());
    }
    let mut shape = t.dims().to_vec();
    shape[axis] = key_start;
    let zeros = Tensor::zeros(shape, t.dtype(), t.device())?;
    Ok(Tensor::cat(&[&zeros, t], axis)?)
}

/// `(q, start + q)` additive causal mask for queries at `start..start + q`.
fn causal_mask(start: usize, q: usize) -> Result<Tensor> {
    let kv = start + q;
    let mask: Vec<f32> = (0..q)
        .flat_map(|t| {
            (0..kv).map(move |j| {
                if j <= start + t {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (q, kv), &Device::Cpu)?)
}

/// Index of the largest value of a `(vocab,)` or `(1, vocab)` logits tensor.
pub fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits
        .flatten_all()?
        .argmax(D::Minus1)?
        .to_scalar::<u32>()?)
}
