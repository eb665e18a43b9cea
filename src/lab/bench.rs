//! Pieces of `headwise bench`: deterministic prompt text, peak-memory readings, the
//! record one measurement produces, and the result folders the benches write
//! (`eval/results/<model>/bench*/`: `summary.json` and a README with the table, the
//! machine and the command). Each engine measurement runs in a fresh process so that the
//! peak resident memory belongs to one engine alone.
//!
//! A virtual machine's speed drifts by tens of percent within minutes (the records
//! `bench-kernels-avx512` and `bench-kernels-avx512-repeat` of SmolLM2, a minute apart:
//! one AVX2 pass 37.2 ms, then 14.0 ms), so the engine bench runs in rounds:
//! every engine at every length once per round, the engines' order rotated from round to
//! round. A table row is the median over rounds, and a ratio between two engines is the
//! median of the ratios within each round (the two measured minutes apart, not an hour),
//! with the smallest and largest round beside it.

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
    /// The round of the bench it was measured in, from 0 (set by the bench, not the
    /// worker).
    #[serde(default)]
    pub round: usize,
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

/// The median of `values` (the mean of the middle two for an even count); NaN if empty.
fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.into_iter().collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// One engine at one prompt length over every round it ran in.
#[derive(Debug, Clone)]
struct Summary {
    /// The median speeds, the largest peak RSS and each decode part's median; the other
    /// fields from the first round.
    median: BenchRecord,
    /// Rounds it ran in.
    rounds: usize,
    /// Smallest and largest prefill tokens/s.
    prefill: (f64, f64),
    /// Smallest and largest decode tokens/s.
    decode: (f64, f64),
}

/// Per (engine, prompt length), in the order first measured: its [`Summary`].
fn summaries(measured: &[BenchRecord]) -> Vec<Summary> {
    let mut keys: Vec<(&str, usize)> = Vec::new();
    for r in measured {
        if !keys.contains(&(r.engine.as_str(), r.prompt_tokens)) {
            keys.push((r.engine.as_str(), r.prompt_tokens));
        }
    }
    keys.into_iter()
        .map(|(engine, n)| {
            let rs: Vec<&BenchRecord> = measured
                .iter()
                .filter(|r| r.engine == engine && r.prompt_tokens == n)
                .collect();
            let prefill: Vec<f64> = rs.iter().map(|r| r.prefill_tok_s).collect();
            let decode: Vec<f64> = rs.iter().map(|r| r.decode_tok_s).collect();
            let parts: Vec<DecodeParts> = rs.iter().filter_map(|r| r.decode_parts).collect();
            Summary {
                median: BenchRecord {
                    prefill_tok_s: median(prefill.iter().copied()),
                    decode_tok_s: median(decode.iter().copied()),
                    peak_rss_bytes: rs.iter().filter_map(|r| r.peak_rss_bytes).max(),
                    decode_parts: (!parts.is_empty()).then(|| DecodeParts {
                        weights_s: median(parts.iter().map(|p| p.weights_s)),
                        lm_head_s: median(parts.iter().map(|p| p.lm_head_s)),
                        attention_s: median(parts.iter().map(|p| p.attention_s)),
                    }),
                    ..rs[0].clone()
                },
                rounds: rs.len(),
                prefill: span(&prefill),
                decode: span(&decode),
            }
        })
        .collect()
}

/// The instrumented engine over another engine at one prompt length: one ratio per round
/// in which both ran (each of the same round's two measurements).
#[derive(Debug, Clone)]
struct Ratios {
    /// Prompt tokens.
    prompt_tokens: usize,
    /// The other engine.
    engine: String,
    /// Prefill tokens/s over the other's, per round.
    prefill: Vec<f64>,
    /// Decode tokens/s over the other's, per round.
    decode: Vec<f64>,
    /// Peak RSS over the other's, per round where both are known.
    peak_rss: Vec<f64>,
}

/// The smallest and largest of `values` (infinities if empty).
fn span(values: &[f64]) -> (f64, f64) {
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

/// `median (min-max)` of ratios, or the single value.
fn ratio_text(values: &[f64]) -> String {
    let (lo, hi) = span(values);
    match values.len() {
        0 => "?".into(),
        1 => format!("{:.2}x", values[0]),
        _ => format!("{:.2}x ({lo:.2}-{hi:.2})", median(values.iter().copied())),
    }
}

/// Per prompt length (ascending) and other engine: the instrumented engine's ratios over
/// it, paired within rounds.
fn ratios(measured: &[BenchRecord]) -> Vec<Ratios> {
    let mut out: Vec<Ratios> = Vec::new();
    let mut lengths: Vec<usize> = measured.iter().map(|r| r.prompt_tokens).collect();
    lengths.sort_unstable();
    lengths.dedup();
    for n in lengths {
        let at = |engine: &str, round: usize| {
            measured
                .iter()
                .find(|r| r.engine == engine && r.prompt_tokens == n && r.round == round)
        };
        let mut others: Vec<&str> = Vec::new();
        for r in measured.iter().filter(|r| r.prompt_tokens == n) {
            if r.engine != "instrumented" && !others.contains(&r.engine.as_str()) {
                others.push(&r.engine);
            }
        }
        for other in others {
            let pairs: Vec<(&BenchRecord, &BenchRecord)> = measured
                .iter()
                .filter(|b| b.engine == other && b.prompt_tokens == n)
                .filter_map(|b| at("instrumented", b.round).map(|a| (a, b)))
                .collect();
            if pairs.is_empty() {
                continue;
            }
            out.push(Ratios {
                prompt_tokens: n,
                engine: other.to_string(),
                prefill: pairs
                    .iter()
                    .map(|(a, b)| a.prefill_tok_s / b.prefill_tok_s)
                    .collect(),
                decode: pairs
                    .iter()
                    .map(|(a, b)| a.decode_tok_s / b.decode_tok_s)
                    .collect(),
                peak_rss: pairs
                    .iter()
                    .filter_map(|(a, b)| Some(a.peak_rss_bytes? as f64 / b.peak_rss_bytes? as f64))
                    .collect(),
            });
        }
    }
    out
}

/// The Markdown table of engine measurements (`measured`: every round's; a row is the
/// median over rounds, with the range when there were several), then the instrumented
/// engine's speed and memory relative to each other engine at each prompt length (paired
/// within rounds); with `bandwidth` (bytes/s) each instrumented row's decode speed as a
/// share of the bandwidth ceiling.
pub fn table(measured: &[BenchRecord], bandwidth: Option<f64>) -> String {
    let summaries = summaries(measured);
    let range = |value: f64, (lo, hi): (f64, f64), rounds: usize| {
        if rounds > 1 {
            format!("{value:.1} ({lo:.0}-{hi:.0})")
        } else {
            format!("{value:.1}")
        }
    };
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
    for sm in &summaries {
        let r = &sm.median;
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
            "| {} | {} | {} | {} | {} | {} | {step} | {share} |\n",
            r.engine,
            r.isa.as_deref().unwrap_or("-"),
            r.prompt_tokens,
            range(r.prefill_tok_s, sm.prefill, sm.rounds),
            range(r.decode_tok_s, sm.decode, sm.rounds),
            mib(r.peak_rss_bytes)
        ));
    }
    let parts: Vec<(&BenchRecord, DecodeParts)> = summaries
        .iter()
        .filter_map(|s| s.median.decode_parts.map(|p| (&s.median, p)))
        .collect();
    if !parts.is_empty() {
        md.push_str(
            "\nOne decode step of each headwise engine (ms): the measured step, and each \
             part timed alone on the real weights; the rest is norms, RoPE, residuals, \
             the cache append and scheduling.\n\n\
             | engine | prompt tokens | step | matrices | LM head | attention | rest |\n\
             | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for (r, p) in parts {
            let step = 1e3 / r.decode_tok_s;
            let (w, l, a) = (1e3 * p.weights_s, 1e3 * p.lm_head_s, 1e3 * p.attention_s);
            md.push_str(&format!(
                "| {} | {} | {step:.2} | {w:.2} | {l:.2} | {a:.2} | {:.2} |\n",
                r.engine,
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
    let rounds = summaries.iter().map(|s| s.rounds).max().unwrap_or(0);
    if rounds > 1 {
        md.push_str(&format!(
            "\nSpeeds are medians over {rounds} rounds (smallest and largest in brackets); \
             peak RSS is the largest; a ratio is the median of the ratios within each \
             round (range in brackets).\n"
        ));
    }
    for r in ratios(measured) {
        let memory = if r.peak_rss.is_empty() {
            String::new()
        } else {
            format!(", peak memory {}", ratio_text(&r.peak_rss))
        };
        md.push_str(&format!(
            "\nat {} tokens, instrumented / {}: prefill {}, decode {}{memory}\n",
            r.prompt_tokens,
            r.engine,
            ratio_text(&r.prefill),
            ratio_text(&r.decode),
        ));
    }
    md
}

/// The records of engine measurements (experiment `bench`, task: the engine; `n` the
/// rounds): the medians `prefill_tok_s`, `decode_tok_s` and the largest `peak_rss_bytes`
/// each, and per other engine (task `instrumented-vs-<engine>`) the medians of the
/// within-round ratios `prefill_ratio`, `decode_ratio` and `peak_rss_ratio` of the
/// instrumented engine over it, with their smallest and largest round (`_min`, `_max`);
/// with `bandwidth`, `read_bandwidth_bytes_s` (task `machine`) and each instrumented
/// row's `decode_ceiling_share`.
pub fn speed_records(
    model: &ModelId,
    measured: &[BenchRecord],
    bandwidth: Option<f64>,
    made: &Made,
) -> Vec<ResultRecord> {
    let record = recorder("bench", model, None, made);
    let mut out = Vec::new();
    for Summary {
        median: r, rounds, ..
    } in summaries(measured)
    {
        let rec = |task: &str, tokens: usize, metric: &str, value: f64| {
            record(task, Some(tokens), metric, value, rounds)
        };
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
    for r in ratios(measured) {
        let task = format!("instrumented-vs-{}", r.engine);
        for (metric, values) in [
            ("prefill_ratio", &r.prefill),
            ("decode_ratio", &r.decode),
            ("peak_rss_ratio", &r.peak_rss),
        ] {
            if values.is_empty() {
                continue;
            }
            let rec = |metric: &str, value: f64| {
                record(&task, Some(r.prompt_tokens), metric, value, values.len())
            };
            out.push(rec(metric, median(values.iter().copied())));
            if values.len() > 1 {
                let (lo, hi) = span(values);
                out.push(rec(&format!("{metric}_min"), lo));
                out.push(rec(&format!("{metric}_max"), hi));
            }
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

    fn measured_one(engine: &str, prompt_tokens: usize, speed: f64) -> BenchRecord {
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
            round: 0,
        }
    }

    #[test]
    fn rounds_give_medians_and_ratios_paired_within_a_round() {
        // The machine is twice as fast in round 1: each engine's speed doubles, and the
        // within-round ratio stays 2 while the ratio of medians would not.
        let mut measured = Vec::new();
        for (round, machine) in [(0, 1.0), (1, 2.0), (2, 1.5)] {
            for (engine, speed) in [("instrumented", 4.0), ("llama.cpp", 2.0)] {
                let mut r = measured_one(engine, 512, speed * machine);
                r.round = round;
                r.peak_rss_bytes = Some((1 << 20) * (round as u64 + 1));
                measured.push(r);
            }
        }
        // a fourth round in which llama.cpp alone ran pairs with nothing
        let mut lone = measured_one("llama.cpp", 512, 100.0);
        lone.round = 3;
        measured.push(lone);
        let m = summaries(&measured);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].median.decode_tok_s, m[0].rounds), (6.0, 3));
        assert_eq!(m[0].decode, (4.0, 8.0));
        assert_eq!(m[0].median.peak_rss_bytes, Some(3 << 20));
        // llama.cpp: median of 2, 3, 4, 100
        assert_eq!((m[1].median.decode_tok_s, m[1].rounds), (3.5, 4));
        let r = ratios(&measured);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].decode, vec![2.0, 2.0, 2.0]);
        assert_eq!(r[0].peak_rss, vec![1.0, 1.0, 1.0]);
        let md = table(&measured, None);
        assert!(
            md.contains("| llama.cpp | - | 512 | 35.0 (20-1000) | 3.5 (2-100) |"),
            "{md}"
        );
        assert!(md.contains("decode 2.00x (2.00-2.00)"), "{md}");
        let id = ModelId {
            name: "m".into(),
            sha256: "00".into(),
        };
        let records = speed_records(&id, &measured, None, &Made::now("fast"));
        let get = |metric: &str| {
            records
                .iter()
                .find(|x| {
                    x.metric == metric && x.task.as_deref() == Some("instrumented-vs-llama.cpp")
                })
                .map(|x| (x.value, x.n))
        };
        assert_eq!(get("decode_ratio"), Some((2.0, 3)));
        assert_eq!(get("decode_ratio_min"), Some((2.0, 3)));
        assert_eq!(get("prefill_ratio_max"), Some((2.0, 3)));
    }

    #[test]
    fn speed_records_hold_every_measurement_and_the_ratios_at_each_length() {
        let id = ModelId {
            name: "m".into(),
            sha256: "00".into(),
        };
        let measured = [
            measured_one("instrumented", 512, 4.0),
            measured_one("mistralrs", 512, 2.0),
            measured_one("instrumented", 64, 1.0),
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
        let mut r = measured_one("instrumented", 512, 50.0);
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
