//! Perplexity computed the way llama.cpp's `llama-perplexity` computes it, so the two
//! can be compared number for number.
//!
//! The tokens (BOS first, as the tokenizer adds it) are cut into chunks of `n_ctx`. Each
//! chunk is evaluated from an empty cache with its first token replaced by BOS, and only
//! its second half is scored: the logits at positions `n_ctx / 2 .. n_ctx - 1` predict
//! the token that follows, `n_ctx - n_ctx / 2 - 1` predictions a chunk. The perplexity is
//! `exp` of the mean negative log-likelihood over all scored predictions.
//!
//! [`perplexity_in`] does the same with every KV head's rows held in f16 or 8-bit blocks
//! (the stores of a `quantize` policy), beside `llama-perplexity -ctk/-ctv`. It scores
//! the second half of each chunk one decode step at a time, so that every scored
//! position reads every row as the store holds it, its own included (llama.cpp writes a
//! batch's rows to its cache before attending); a prefill reads its own rows exact.

use crate::model::{
    HeadCache, Interventions, Logits, Model, NoObserver, Retention, RowFormat, Session,
};
use crate::{Error, Result};

/// Perplexity of `model` on the first `chunks * n_ctx` of `tokens`.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    n_ctx: usize,
    chunks: usize,
    bos: u32,
) -> Result<f64> {
    let cfg = model.config();
    perplexity_with(model, tokens, n_ctx, chunks, bos, false, &|| {
        Ok(HeadCache::plain(cfg, n_ctx))
    })
}

/// [`perplexity`] with every KV head keeping every position, its rows held as `format`
/// (written rounded, read back decoded, as a `quantize` policy's stores hold them), the
/// scored half of each chunk run one decode step at a time (compare formats with each
/// other here, not with [`perplexity`]: a decode step's products take 8-bit activations
/// in the fast numerics).
pub fn perplexity_in(
    model: &Model,
    tokens: &[u32],
    n_ctx: usize,
    chunks: usize,
    bos: u32,
    format: RowFormat,
) -> Result<f64> {
    let cfg = model.config();
    let full = vec![Retention::Full; cfg.n_layers * cfg.n_kv_heads];
    perplexity_with(model, tokens, n_ctx, chunks, bos, true, &|| {
        HeadCache::new(cfg, &full, format, n_ctx)
    })
}

/// [`perplexity`] over a fresh cache from `cache` per chunk, the scored half in one
/// forward pass or, `stepwise`, one decode step a token.
fn perplexity_with(
    model: &Model,
    tokens: &[u32],
    n_ctx: usize,
    chunks: usize,
    bos: u32,
    stepwise: bool,
    cache: &dyn Fn() -> Result<HeadCache>,
) -> Result<f64> {
    if n_ctx < 4 || chunks == 0 || tokens.len() < chunks * n_ctx {
        return Err(Error::invalid(
            "perplexity",
            format!(
                "{chunks} chunks of {n_ctx} tokens need {} tokens; the text has {}",
                chunks * n_ctx,
                tokens.len()
            ),
        ));
    }
    let first = n_ctx / 2;
    let (mut nll, mut scored) = (0f64, 0usize);
    let none = Interventions::new();
    for c in 0..chunks {
        let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        chunk[0] = bos;
        let mut session = Session::with_cache(model, cache()?);
        session.prefill(&chunk[..first], &mut NoObserver, &none)?;
        let rows: Vec<Vec<f32>> = match stepwise {
            true => chunk[first..n_ctx - 1]
                .iter()
                .map(|&t| -> Result<Vec<f32>> {
                    let l = session.step(t, &mut NoObserver, &none)?;
                    Ok(l.flatten_all()?.to_vec1()?)
                })
                .collect::<Result<_>>()?,
            false => session
                .feed(&chunk[first..], Logits::All, &mut NoObserver, &none)?
                .to_vec2()?,
        };
        for (logits, &next) in rows.iter().zip(&chunk[first + 1..]) {
            nll -= log_softmax_at(logits, next as usize);
            scored += 1;
        }
    }
    Ok((nll / scored as f64).exp())
}

/// `log softmax(logits)[index]` in f64.
fn log_softmax_at(logits: &[f32], index: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits[index] as f64 - max - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_a_hand_computed_value() {
        // softmax([0, ln 3]) = [1/4, 3/4]
        let l = [0.0, 3f32.ln()];
        assert!((log_softmax_at(&l, 0) - 0.25f64.ln()).abs() < 1e-6);
        assert!((log_softmax_at(&l, 1) - 0.75f64.ln()).abs() < 1e-6);
    }
}
