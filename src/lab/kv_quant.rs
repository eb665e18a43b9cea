//! `headwise eval kv-quant`: what holding the KV cache in fewer bits costs in perplexity,
//! headwise's stores beside llama.cpp's own cache types on the same text and model.
//!
//! headwise runs [`perplexity_in`] with every store's rows in f32, f16 and q8_0;
//! llama.cpp runs `llama-perplexity -ctk T -ctv T` for the same three types, with flash
//! attention for f16 and q8_0 (a quantized V cache needs it) and without it for f32 (its
//! CPU flash attention computes in f16: under `-fa on` its f32 and f16 caches give the
//! same perplexity).
//! Each engine's rows are compared with its own f32 cache, so the two columns of
//! relative change are the comparison (the engines' absolute perplexities differ a
//! little: their kernels and, in headwise, the decode-step scoring differ).

use std::path::Path;

use crate::model::{LoadedModel, ModelId, RowFormat};
use crate::provenance::{machine, Made};
use crate::reference::llama_cpp::LlamaCppBins;
use crate::reference::parity::llama_cpp::{perplexity_text, PPL_CHUNKS, PPL_CTX};
use crate::reference::perplexity::perplexity_in;
use crate::results::{write_experiment, ResultRecord, SCHEMA_VERSION};
use crate::{Error, Result};

/// The cache types compared, as llama.cpp names them, with headwise's row format.
pub const FORMATS: [(&str, RowFormat); 3] = [
    ("f32", RowFormat::F32),
    ("f16", RowFormat::F16),
    ("q8_0", RowFormat::Q8_0),
];

/// One engine's perplexity with one cache type.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// `headwise` or `llama.cpp`.
    pub engine: &'static str,
    /// `f32`, `f16` or `q8_0`.
    pub cache: &'static str,
    pub ppl: f64,
    /// Bytes a cached value takes (4, 2, 34/32).
    pub bytes_per_value: f64,
}

/// Run both engines with every cache type of [`FORMATS`] on the parity text of
/// `data_dir` (the first `PPL_CHUNKS * PPL_CTX` tokens of the Paul Graham essays);
/// `progress` hears of each row.
pub fn run(
    lm: &LoadedModel,
    bins: &LlamaCppBins,
    model_path: &Path,
    data_dir: &Path,
    progress: &mut dyn FnMut(&Row),
) -> Result<Vec<Row>> {
    let text = perplexity_text(data_dir)?;
    let ids = lm.encode(&text, true)?;
    let bos = lm.special.bos.ok_or_else(|| {
        Error::invalid(
            "model",
            "no BOS token: the perplexity chunks start with one",
        )
    })?;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let text_file = std::env::temp_dir().join(format!("headwise-kvq-{}.txt", std::process::id()));
    std::fs::write(&text_file, &text).map_err(|e| Error::io(&text_file, e))?;
    let mut rows = Vec::new();
    let result = (|| -> Result<()> {
        for (cache, format) in FORMATS {
            let bytes_per_value = format.bytes(32, 1) as f64 / 32.0;
            let ours = perplexity_in(&lm.model, &ids, PPL_CTX, PPL_CHUNKS, bos, format)?;
            let (theirs, _) = bins.perplexity_with_cache(
                model_path, &text_file, PPL_CTX, PPL_CHUNKS, threads, cache,
            )?;
            for (engine, ppl) in [("headwise", ours), ("llama.cpp", theirs)] {
                let row = Row {
                    engine,
                    cache,
                    ppl,
                    bytes_per_value,
                };
                progress(&row);
                rows.push(row);
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&text_file);
    result.map(|()| rows)
}

/// An engine's perplexity with `cache` relative to its own f32 cache, minus 1.
fn change(rows: &[Row], row: &Row) -> Option<f64> {
    let base = rows
        .iter()
        .find(|r| r.engine == row.engine && r.cache == "f32")?;
    Some(row.ppl / base.ppl - 1.0)
}

/// Write the report (README.md, records) of `rows` into `dir`; `llama` is the folder of
/// the llama.cpp binaries that ran.
pub fn write_report(
    dir: &Path,
    model: &ModelId,
    llama: &Path,
    rows: &[Row],
    made: &Made,
) -> Result<()> {
    let scored = PPL_CHUNKS * (PPL_CTX - PPL_CTX / 2 - 1);
    let mut records = Vec::new();
    let mut table = String::from(
        "| cache | bytes a value | compression ratio | headwise ppl | change vs its f32 | llama.cpp ppl | change vs its f32 |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for (cache, _) in FORMATS {
        let of = |engine: &str| rows.iter().find(|r| r.engine == engine && r.cache == cache);
        let (Some(h), Some(l)) = (of("headwise"), of("llama.cpp")) else {
            continue;
        };
        let pct = |r: &Row| change(rows, r).map_or("-".into(), |c| format!("{:+.3}%", 100.0 * c));
        table.push_str(&format!(
            "| {cache} | {:.4} | {:.3} | {:.4} | {} | {:.4} | {} |\n",
            h.bytes_per_value,
            1.0 - h.bytes_per_value / 4.0,
            h.ppl,
            pct(h),
            l.ppl,
            pct(l),
        ));
    }
    for r in rows {
        let mut metrics = vec![("ppl", r.ppl)];
        if let Some(c) = change(rows, r) {
            metrics.push(("ppl_rel_change_vs_f32", c));
        }
        for (metric, value) in metrics {
            records.push(ResultRecord {
                schema_version: SCHEMA_VERSION,
                experiment: "kv-quant".into(),
                model: model.name.clone(),
                model_sha256: model.sha256.clone(),
                task: Some("perplexity-pg-essays".into()),
                context_tokens: Some(PPL_CTX),
                selection: None,
                k: None,
                seed: None,
                mode: Some(r.engine.into()),
                policy: Some(r.cache.into()),
                metric: metric.into(),
                value,
                n: scored,
                ci95: None,
                p_value: None,
                made: made.clone(),
            });
        }
    }
    let readme = format!(
        "# KV cache in fewer bits: perplexity, headwise beside llama.cpp\n\n\
         Model `{}` (sha256 `{}`). Text: the first {} tokens of the Paul Graham essays \
         (../shared/data/haystack/paul_graham, files in name order, the first 12,000 \
         characters), {PPL_CHUNKS} chunks of {PPL_CTX}, the second half of each scored \
         ({scored} predictions), as `llama-perplexity -c {PPL_CTX} --chunks {PPL_CHUNKS}` \
         does.\n\n\
         headwise: every KV head keeps every row in the format (a `quantize` policy's \
         stores), the scored half of each chunk run one decode step at a time so that each \
         scored position reads every row as stored. llama.cpp: `llama-perplexity -ctk \
         <cache> -ctv <cache>`, with `-fa on` for f16 and q8_0 (a quantized V cache needs \
         it) and `-fa off` for f32 (its CPU flash attention computes in f16: under `-fa \
         on` its f32 and f16 caches give the same perplexity), binaries of `{}`. Compare \
         the two columns of change: each engine against its own f32 cache (the absolute \
         perplexities differ a little between the engines).\n\n{table}\n\
         Command: `{}` ({}).\n",
        model.name,
        model.sha256,
        PPL_CHUNKS * PPL_CTX,
        llama.display(),
        made.command,
        machine(),
    );
    write_experiment(dir, &readme, &records, made)
}
