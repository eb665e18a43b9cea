//! Pieces of `headwise bench`: deterministic prompt text, peak-memory readings, the
//! record one measurement produces, and the result folders the benches write
//! (`eval/results/<model>/bench*/`: `summary.json` and a README with the table, the
//! machine and the command). Each engine measurement runs in a fresh process so that the
//! peak resident memory belongs to one engine alone.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::model::{DecodeParts, ModelId};
use crate::provenance::{machine, Made};
use crate::results::{recorder, write_experiment, ResultRecord};
use crate::Result;

/// One engine at one prompt length, measured in its own process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchRecord {
    /// `instrumented` or `mistralrs`.
    pub engine: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub decode_tokens: usize,
    /// Prompt tokens per second.
    pub prefill_tok_s: f64,
    /// Generated tokens per second after the first.
    pub decode_tok_s: f64,
    /// Peak resident set of the process (bytes): `VmHWM` of the worker, or for
    /// llama.cpp the largest `llama-bench` child's `ru_maxrss`.
    pub peak_rss_bytes: Option<u64>,
    /// The kernels' instruction set (instrumented engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isa: Option<String>,
    /// Bytes one decode step reads from memory: the weights of every matrix and the KV
    /// rows in view at the last step (instrumented engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_bytes: Option<StepBytes>,
    /// The decode step's parts, each timed alone (instrumented engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_parts: Option<DecodeParts>,
}

/// What one decode step streams from memory.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct StepBytes {
    /// Weight bytes of every matrix, LM head included.
    pub weights: u64,
    /// KV cache bytes in view (keys and values of every layer).
    pub kv: u64,
}

impl BenchRecord {
    /// Decode tokens/s as a share of the bandwidth ceiling `bandwidth / step bytes`
    /// (`bandwidth` in bytes/s), when the step's bytes are known.
    pub fn ceiling_share(&self, bandwidth: f64) -> Option<f64> {
        let b = self.step_bytes?;
        let ceiling = bandwidth / (b.weights + b.kv) as f64;
        Some(self.decode_tok_s / ceiling)
    }
}

/// Read bandwidth of this machine in bytes/s: one streaming pass over a 512 MiB buffer,
/// split over the threads of the rayon pool (the ones the kernels use), best of three.
pub fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    const BYTES: usize = 512 << 20;
    let buf: Vec<u64> = (0..(BYTES / 8) as u64).collect();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = std::time::Instant::now();
        let sum = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.min(start.elapsed().as_secs_f64());
    }
    BYTES as f64 / best
}

/// The Markdown table of engine measurements, then the instrumented engine's speed and
/// memory relative to each other engine at each prompt length; with `bandwidth`
/// (bytes/s) each instrumented row's decode speed as a share of the bandwidth ceiling.
pub fn table(records: &[BenchRecord], bandwidth: Option<f64>) -> String {
    let mib = |b: Option<u64>| {
        b.map_or("?".to_string(), |b| {
            format!("{:.0}", b as f64 / (1 << 20) as f64)
        })
    };
    let mut md = String::from(
        "| engine | kernels | prompt tokens | prefill tok/s | decode tok/s | peak RSS MiB | \
         MiB read per decode step (weights + KV) | decode / bandwidth ceiling |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in records {
        let step = r.step_bytes.map_or("-".to_string(), |b| {
            format!(
                "{:.1} + {:.1}",
                b.weights as f64 / (1 << 20) as f64,
                b.kv as f64 / (1 << 20) as f64
            )
        });
        let share = bandwidth
            .and_then(|bw| r.ceiling_share(bw))
            .map_or("-".to_string(), |s| format!("{:.0}%", 100.0 * s));
        md.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {} | {step} | {share} |\n",
            r.engine,
            r.isa.as_deref().unwrap_or("-"),
            r.prompt_tokens,
            r.prefill_tok_s,
            r.decode_tok_s,
            mib(r.peak_rss_bytes)
        ));
    }
    let parts: Vec<(&BenchRecord, DecodeParts)> = records
        .iter()
        .filter_map(|r| r.decode_parts.map(|p| (r, p)))
        .collect();
    if !parts.is_empty() {
        md.push_str(
            "\nOne decode step of the instrumented engine (ms): the measured step, and each \
             part timed alone on the real weights; the rest is norms, RoPE, residuals, \
             the cache append and scheduling.\n\n\
             | prompt tokens | step | matrices | LM head | attention | rest |\n\
             | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for (r, p) in parts {
            let step = 1e3 / r.decode_tok_s;
            let (w, l, a) = (1e3 * p.weights_s, 1e3 * p.lm_head_s, 1e3 * p.attention_s);
            md.push_str(&format!(
                "| {} | {step:.2} | {w:.2} | {l:.2} | {a:.2} | {:.2} |\n",
                r.prompt_tokens,
                step - w - l - a
            ));
        }
    }
    if let Some(bw) = bandwidth {
        md.push_str(&format!(
            "\nRead bandwidth (one streaming pass over 512 MiB, all kernel threads): {:.1} GB/s; \
             the ceiling is that bandwidth over the bytes one decode step reads.\n",
            bw / 1e9
        ));
    }
    for (n, a, b) in comparisons(records) {
        let memory = match (a.peak_rss_bytes, b.peak_rss_bytes) {
            (Some(x), Some(y)) => format!(", peak memory {:.2}x", x as f64 / y as f64),
            _ => String::new(),
        };
        md.push_str(&format!(
            "\nat {n} tokens, instrumented / {}: prefill {:.2}x, decode {:.2}x{memory}\n",
            b.engine,
            a.prefill_tok_s / b.prefill_tok_s,
            a.decode_tok_s / b.decode_tok_s,
        ));
    }
    md
}

/// Per prompt length (ascending): the instrumented engine's record and each other
/// engine's at that length.
fn comparisons(records: &[BenchRecord]) -> Vec<(usize, &BenchRecord, &BenchRecord)> {
    let mut lengths: Vec<usize> = records.iter().map(|r| r.prompt_tokens).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let at = |n: usize| records.iter().filter(move |r| r.prompt_tokens == n);
    lengths
        .into_iter()
        .flat_map(|n| {
            let ours = at(n).find(|r| r.engine == "instrumented");
            ours.into_iter().flat_map(move |a| {
                at(n)
                    .filter(|b| b.engine != "instrumented")
                    .map(move |b| (n, a, b))
            })
        })
        .collect()
}

/// The records of engine measurements (experiment `bench`, task: the engine):
/// `prefill_tok_s`, `decode_tok_s` and `peak_rss_bytes` each, and per other engine (task
/// `instrumented-vs-<engine>`) `prefill_ratio`, `decode_ratio` and `peak_rss_ratio` of
/// the instrumented engine over it; with `bandwidth`, `read_bandwidth_bytes_s` (task
/// `machine`) and each instrumented row's `decode_ceiling_share`.
pub fn speed_records(
    model: &ModelId,
    records: &[BenchRecord],
    bandwidth: Option<f64>,
    made: &Made,
) -> Vec<ResultRecord> {
    let record = recorder("bench", model, None, made);
    let rec = |task: &str, tokens: usize, metric: &str, value: f64| {
        record(task, Some(tokens), metric, value, 1)
    };
    let mut out = Vec::new();
    for r in records {
        out.push(rec(
            &r.engine,
            r.prompt_tokens,
            "prefill_tok_s",
            r.prefill_tok_s,
        ));
        out.push(rec(
            &r.engine,
            r.prompt_tokens,
            "decode_tok_s",
            r.decode_tok_s,
        ));
        if let Some(b) = r.peak_rss_bytes {
            out.push(rec(&r.engine, r.prompt_tokens, "peak_rss_bytes", b as f64));
        }
        if let Some(share) = bandwidth.and_then(|bw| r.ceiling_share(bw)) {
            out.push(rec(
                &r.engine,
                r.prompt_tokens,
                "decode_ceiling_share",
                share,
            ));
        }
    }
    if let Some(bw) = bandwidth {
        out.push(record("machine", None, "read_bandwidth_bytes_s", bw, 1));
    }
    for (n, a, b) in comparisons(records) {
        let task = format!("instrumented-vs-{}", b.engine);
        out.push(rec(
            &task,
            n,
            "prefill_ratio",
            a.prefill_tok_s / b.prefill_tok_s,
        ));
        out.push(rec(
            &task,
            n,
            "decode_ratio",
            a.decode_tok_s / b.decode_tok_s,
        ));
        if let (Some(x), Some(y)) = (a.peak_rss_bytes, b.peak_rss_bytes) {
            out.push(rec(&task, n, "peak_rss_ratio", x as f64 / y as f64));
        }
    }
    out
}

/// Write a bench's result folder: `summary.json` (`records`) and a README with `title`,
/// `body` (its table or line), the command and the machine.
pub fn write_report(
    dir: &Path,
    title: &str,
    body: &str,
    records: &[ResultRecord],
    made: &Made,
) -> Result<()> {
    let readme = format!(
        "# {title}\n\n{}\n\nCommand: `{}`\n\nMachine: {}.\n",
        body.trim_end(),
        made.command,
        machine()
    );
    write_experiment(dir, &readme, records, made)
}

/// Deterministic filler: `n` numbered notes of ~17 tokens each, with an optional needle
/// sentence after note `needle_after`.
pub fn synthetic_notes(n: usize, needle_after: Option<usize>) -> String {
    const CITIES: &[&str] = &[
        "Lisbon", "Oslo", "Kyoto", "Lima", "Cairo", "Dublin", "Quito", "Perth", "Turin", "Hanoi",
    ];
    const THINGS: &[&str] = &[
        "a red bicycle",
        "an old clock",
        "a blue kite",
        "a wooden boat",
        "a silver key",
        "a paper lamp",
        "a glass bird",
        "a green hat",
    ];
    let mut text = String::new();
    for i in 0..n {
        let city = CITIES[(i * 7) % CITIES.len()];
        let thing = THINGS[(i * 3) % THINGS.len()];
        text.push_str(&format!(
            "Note {}: In {city}, a traveller found {thing} near the market on day {}.\n",
            i + 1,
            (i * 13) % 31 + 1
        ));
        if Some(i) == needle_after {
            text.push_str("Note 51b: The secret number of the archive is 4817.\n");
        }
    }
    text
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if readable.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_deterministic_and_hold_the_needle_once() {
        let a = synthetic_notes(60, Some(50));
        assert_eq!(a, synthetic_notes(60, Some(50)));
        assert_eq!(a.matches("4817").count(), 1);
        assert_eq!(a.lines().count(), 61);
    }

    fn measured(engine: &str, prompt_tokens: usize, speed: f64) -> BenchRecord {
        BenchRecord {
            engine: engine.into(),
            prompt_tokens,
            decode_tokens: 8,
            prefill_tok_s: 10.0 * speed,
            decode_tok_s: speed,
            peak_rss_bytes: Some(1 << 20),
            isa: None,
            step_bytes: None,
            decode_parts: None,
        }
    }

    #[test]
    fn speed_records_hold_every_measurement_and_the_ratios_at_each_length() {
        let id = ModelId {
            name: "m".into(),
            sha256: "00".into(),
        };
        let measured = [
            measured("instrumented", 512, 4.0),
            measured("mistralrs", 512, 2.0),
            measured("instrumented", 64, 1.0),
        ];
        let out = speed_records(&id, &measured, None, &Made::now("fast"));
        // 3 measurements x 3 metrics, one comparison x 3 ratios
        assert_eq!(out.len(), 12);
        let ratio = out
            .iter()
            .find(|r| r.metric == "decode_ratio")
            .expect("a ratio");
        assert_eq!(ratio.task.as_deref(), Some("instrumented-vs-mistralrs"));
        assert_eq!((ratio.context_tokens, ratio.value), (Some(512), 2.0));
        assert!(out.iter().all(|r| r.made.numerics == "fast"));
        let md = table(&measured, None);
        assert!(
            md.contains("| mistralrs | - | 512 | 20.0 | 2.0 | 1 | - | - |"),
            "{md}"
        );
        assert!(
            md.contains("instrumented / mistralrs: prefill 2.00x, decode 2.00x, peak memory 1.00x"),
            "{md}"
        );
    }

    #[test]
    fn the_ceiling_share_is_decode_speed_over_bandwidth_per_step_bytes() {
        let mut r = measured("instrumented", 512, 50.0);
        assert_eq!(r.ceiling_share(1e9), None);
        r.step_bytes = Some(StepBytes {
            weights: 60_000_000,
            kv: 40_000_000,
        });
        // ceiling 1e9 B/s / 1e8 B = 10 tok/s, so 50 tok/s measured is 5 times it
        assert!((r.ceiling_share(1e9).unwrap() - 5.0).abs() < 1e-12);
        r.decode_parts = Some(DecodeParts {
            weights_s: 0.010,
            lm_head_s: 0.002,
            attention_s: 0.004,
        });
        let md = table(&[r.clone()], Some(1e10));
        assert!(md.contains("| 57.2 + 38.1 | 50% |"), "{md}");
        // a 20 ms step: 10 + 2 + 4 ms timed alone, 4 ms the rest
        assert!(
            md.contains("| 512 | 20.00 | 10.00 | 2.00 | 4.00 | 4.00 |"),
            "{md}"
        );
        let records = speed_records(
            &ModelId {
                name: "m".into(),
                sha256: "00".into(),
            },
            &[r],
            Some(1e10),
            &Made::now("fast"),
        );
        assert!(records
            .iter()
            .any(|x| x.metric == "decode_ceiling_share" && (x.value - 0.5).abs() < 1e-12));
        assert!(records.iter().any(|x| x.metric == "read_bandwidth_bytes_s"));
    }

    #[test]
    fn peak_rss_is_read_on_linux() {
        let rss = peak_rss_bytes().expect("VmHWM");
        assert!(rss > 1 << 20);
    }
}
