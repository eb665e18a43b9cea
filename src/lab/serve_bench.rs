//! `headwise bench serve`: requests/s, tokens/s, latency, time to first token and the
//! gaps between streamed chunks of the real server on loopback, at several client
//! concurrencies, per policy, with the mean batch the server ran. Each client sends
//! streamed chat requests one after another; a level's rates are its totals over its wall
//! time. Requests either share one document and differ in their question (the prefix
//! cache's case) or each start with their own line (no shared prefix).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use plotters::style::{Color, Palette, Palette99};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::lab::plot::{line_chart, Chart, Mark, Series};
use crate::provenance::{machine, Made};
use crate::results::{write_atomic, write_experiment, ResultRecord, SCHEMA_VERSION};
use crate::serve::{serve, Engine, ServeConfig};
use crate::{Error, Result};

/// The anchor's rows' policy.
const ANCHOR: &str = "llama-server";

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    /// Client concurrencies, one level each.
    pub concurrency: Vec<usize>,
    /// Presets to measure (each must be allowed by the engine).
    pub policies: Vec<String>,
    /// Requests per level: at least this many, and at least two per client.
    pub requests: usize,
    /// The user message of every request.
    pub prompt: String,
    /// Tokens generated per request (end-of-turn ignored).
    pub max_tokens: usize,
    /// Every request is `prompt` followed by its own question (a shared prefix), instead
    /// of its own first line followed by `prompt`.
    pub shared: bool,
    /// Measure every headwise level a second time with `"explain": true`.
    pub explain: bool,
}

/// One level's totals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRow {
    pub policy: String,
    /// The server's batch size limit (`max_concurrency`).
    #[serde(default)]
    pub max_batch: usize,
    /// The server's prefix cache, MiB (0: off).
    #[serde(default)]
    pub prefix_cache_mib: f64,
    /// The server's KV budget, MiB (0: none).
    #[serde(default)]
    pub kv_budget_mib: f64,
    /// The server's prefill chunk (positions per forward pass of a prompt) and prompt
    /// positions prefilled per scheduler iteration (0: not recorded, or llama-server).
    #[serde(default)]
    pub prefill_chunk: usize,
    #[serde(default)]
    pub prefill_tokens: usize,
    /// Every request asked for per-token introspection (`"explain": true`).
    #[serde(default)]
    pub explain: bool,
    pub concurrency: usize,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub wall_secs: f64,
    pub requests_per_s: f64,
    /// Generated tokens per second over the level.
    pub tokens_per_s: f64,
    pub mean_latency_s: f64,
    pub mean_ttft_s: f64,
    /// Mean of the requests' peak KV bytes.
    pub mean_kv_peak_bytes: f64,
    /// Median and 95th percentile of the time to first token, and of the gaps between a
    /// stream's chunks after its first.
    #[serde(default)]
    pub p50_ttft_s: f64,
    #[serde(default)]
    pub p95_ttft_s: f64,
    #[serde(default)]
    pub p50_itl_s: f64,
    #[serde(default)]
    pub p95_itl_s: f64,
    /// Mean sequences per batched decode step over the level.
    #[serde(default)]
    pub mean_batch: f64,
    /// The most sequences in the batch at once, and the most KV bytes reserved for them,
    /// as sampled every 20 ms during the level (0 for llama-server: not known).
    #[serde(default)]
    pub peak_batch: f64,
    #[serde(default)]
    pub peak_reserved_bytes: f64,
}

impl BenchRow {
    /// The policy, and whether its requests were explained.
    pub fn name(&self) -> String {
        match self.explain {
            true => format!("{} + explain", self.policy),
            false => self.policy.clone(),
        }
    }
}

/// One request's numbers.
struct Sample {
    latency: f64,
    ttft: f64,
    /// Seconds between consecutive content chunks after the first.
    gaps: Vec<f64>,
    tokens: usize,
    prompt_tokens: usize,
    kv_peak: f64,
}

/// Run the server for `engine` on a free loopback port and measure every (policy,
/// concurrency) level; `progress` hears of each finished level.
pub async fn run(
    engine: Arc<Engine>,
    cfg: &ServeConfig,
    opts: &BenchOptions,
    progress: &mut dyn FnMut(&BenchRow),
) -> Result<Vec<BenchRow>> {
    for p in &opts.policies {
        engine
            .runtime(Some(p))
            .map_err(|e| Error::invalid("policies", e.message))?;
    }
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(|e| Error::io("127.0.0.1", e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("127.0.0.1", e))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn({
        let (engine, cfg) = (Arc::clone(&engine), cfg.clone());
        async move {
            serve(engine, &cfg, listener, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    let url = format!("http://{addr}/v1/chat/completions");
    let mut rows = Vec::new();
    let explain = match opts.explain {
        true => vec![false, true],
        false => vec![false],
    };
    for policy in &opts.policies {
        for &explain in &explain {
            let target = Target {
                url: url.clone(),
                key: cfg.api_keys.first().cloned(),
                policy: Some(policy.clone()),
                engine: Some(&engine),
                max_batch: cfg.max_concurrency,
                prefix_cache_mib: cfg.prefix_cache_mib,
                kv_budget_mib: cfg.kv_budget_mib.unwrap_or(0.0),
                prefill: (cfg.prefill_chunk, cfg.prefill_tokens),
                explain,
            };
            rows.extend(levels(&target, opts, progress).await?);
        }
    }
    let _ = stop.send(());
    server
        .await
        .map_err(|e| Error::invalid("server", e.to_string()))??;
    Ok(rows)
}

/// Measure `llama-server` at `base` (`http://host:port`, started with `parallel` slots)
/// with the same requests and levels: the serving anchor. Its rows are labelled
/// `llama-server`; the mean batch and KV peak are not known (0).
pub async fn run_anchor(
    base: &str,
    parallel: usize,
    opts: &BenchOptions,
    progress: &mut dyn FnMut(&BenchRow),
) -> Result<Vec<BenchRow>> {
    let target = Target {
        url: format!("{base}/v1/chat/completions"),
        key: None,
        policy: None,
        engine: None,
        max_batch: parallel,
        prefix_cache_mib: 0.0,
        kv_budget_mib: 0.0,
        prefill: (0, 0),
        explain: false,
    };
    levels(&target, opts, progress).await
}

/// Where a level's requests go.
struct Target<'a> {
    url: String,
    key: Option<String>,
    /// The headwise preset; `None`: llama-server (its own request fields).
    policy: Option<String>,
    /// The headwise engine behind `url`, for its batch counters.
    engine: Option<&'a Engine>,
    max_batch: usize,
    prefix_cache_mib: f64,
    kv_budget_mib: f64,
    /// The prefill chunk and tokens per iteration ((0, 0): llama-server).
    prefill: (usize, usize),
    explain: bool,
}

/// Every concurrency level of `opts` against `target`.
async fn levels(
    target: &Target<'_>,
    opts: &BenchOptions,
    progress: &mut dyn FnMut(&BenchRow),
) -> Result<Vec<BenchRow>> {
    // A new connection per request: a pooled keep-alive connection that the server has
    // closed while it sat idle fails as "error sending request" (llama-server closes
    // idle ones after a few seconds, and a level's requests can wait longer than that).
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|e| Error::invalid("HTTP client", e.to_string()))?;
    let mut rows = Vec::new();
    let batched = |e: Option<&Engine>| {
        e.map_or((0.0, 0.0), |e| {
            let m = e.metrics();
            (m.batch_steps.get() as f64, m.batch_rows.get() as f64)
        })
    };
    for &c in &opts.concurrency {
        let n = opts.requests.max(2 * c);
        let (steps0, rows0) = batched(target.engine);
        let t0 = Instant::now();
        let peak = std::cell::Cell::new((0.0f64, 0.0f64));
        let watch = async {
            let Some(e) = target.engine else {
                return std::future::pending().await;
            };
            loop {
                let m = e.metrics();
                let (b, r) = peak.get();
                peak.set((
                    b.max(m.batch_size.get() as f64),
                    r.max(m.kv_reserved_bytes.get() as f64),
                ));
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        };
        let samples = tokio::select! {
            s = level(&http, target, c, n, opts) => s?,
            never = watch => never,
        };
        let wall = t0.elapsed().as_secs_f64();
        let (peak_batch, peak_reserved_bytes) = peak.get();
        let (steps1, rows1) = batched(target.engine);
        let ttfts: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
        let gaps: Vec<f64> = samples.iter().flat_map(|s| s.gaps.clone()).collect();
        let mean = |f: fn(&Sample) -> f64| samples.iter().map(f).sum::<f64>() / n as f64;
        let row = BenchRow {
            policy: target.policy.clone().unwrap_or_else(|| ANCHOR.into()),
            max_batch: target.max_batch,
            prefix_cache_mib: target.prefix_cache_mib,
            kv_budget_mib: target.kv_budget_mib,
            prefill_chunk: target.prefill.0,
            prefill_tokens: target.prefill.1,
            explain: target.explain,
            concurrency: c,
            requests: n,
            prompt_tokens: samples.first().map_or(0, |s| s.prompt_tokens),
            wall_secs: wall,
            requests_per_s: n as f64 / wall,
            tokens_per_s: samples.iter().map(|s| s.tokens).sum::<usize>() as f64 / wall,
            mean_latency_s: mean(|s| s.latency),
            mean_ttft_s: mean(|s| s.ttft),
            mean_kv_peak_bytes: mean(|s| s.kv_peak),
            p50_ttft_s: percentile(&ttfts, 0.5),
            p95_ttft_s: percentile(&ttfts, 0.95),
            p50_itl_s: percentile(&gaps, 0.5),
            p95_itl_s: percentile(&gaps, 0.95),
            mean_batch: (rows1 - rows0) / (steps1 - steps0).max(1.0),
            peak_batch,
            peak_reserved_bytes,
        };
        progress(&row);
        rows.push(row);
    }
    Ok(rows)
}

/// A row's server settings, as its records' `mode`.
fn mode(r: &BenchRow) -> String {
    let mut m = format!(
        "max_batch-{}-prefix_cache-{}",
        r.max_batch, r.prefix_cache_mib
    );
    if r.kv_budget_mib > 0.0 {
        m.push_str(&format!("-kv_budget-{}", r.kv_budget_mib));
    }
    if r.prefill_chunk > 0 && r.prefill_chunk != crate::model::DEFAULT_CHUNK {
        m.push_str(&format!(
            "-prefill_chunk-{}-prefill_tokens-{}",
            r.prefill_chunk, r.prefill_tokens
        ));
    }
    if r.explain {
        m.push_str("-explain");
    }
    m
}

/// The `q`-quantile of `xs` (nearest rank); 0 for none.
fn percentile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// `n` requests from `c` clients, each sending its share one after another.
async fn level(
    http: &reqwest::Client,
    target: &Target<'_>,
    c: usize,
    n: usize,
    opts: &BenchOptions,
) -> Result<Vec<Sample>> {
    // Request `k` of the level.
    let body = |k: usize| {
        let content = match opts.shared {
            true => format!("{}\n\nQuestion {k}: what does note {k} say?", opts.prompt),
            false => format!("Request {k}.\n{}", opts.prompt),
        };
        let mut body = json!({
            "messages": [{"role": "user", "content": content}],
            "max_tokens": opts.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        body[match &target.policy {
            Some(_) => "headwise",
            None => "ignore_eos",
        }] = match &target.policy {
            Some(p) => json!({"policy": p, "ignore_eos": true, "explain": target.explain}),
            None => json!(true),
        };
        body
    };
    let clients = (0..c).map(|i| {
        let share = n / c + usize::from(i < n % c);
        let bodies: Vec<Value> = (0..share).map(|j| body(j * c + i)).collect();
        let http = http.clone();
        let key = target.key.clone();
        let url = target.url.clone();
        async move {
            let mut out = Vec::with_capacity(share);
            for b in &bodies {
                out.push(one(&http, &url, key.as_deref(), b).await?);
            }
            Ok::<_, Error>(out)
        }
    });
    let all = futures_util::future::join_all(clients).await;
    let mut samples = Vec::with_capacity(n);
    for r in all {
        samples.extend(r?);
    }
    Ok(samples)
}

/// One streamed request, timed.
async fn one(http: &reqwest::Client, url: &str, key: Option<&str>, body: &Value) -> Result<Sample> {
    let failed = |e: String| Error::invalid("request", e);
    let t0 = Instant::now();
    let mut req = http.post(url).json(body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.map_err(|e| failed(e.to_string()))?;
    if !resp.status().is_success() {
        let status = resp.status();
        return Err(failed(format!(
            "{status}: {}",
            resp.text().await.unwrap_or_default()
        )));
    }
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let mut ttft = None;
    let mut last = None;
    let mut gaps = Vec::new();
    let mut usage = None;
    while let Some(bytes) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(
            &bytes.map_err(|e| failed(e.to_string()))?,
        ));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).map_err(|e| failed(e.to_string()))?;
            if v.get("error").is_some() {
                return Err(failed(v["error"].to_string()));
            }
            let text = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
            if !text.is_empty() {
                let now = t0.elapsed().as_secs_f64();
                ttft.get_or_insert(now);
                if let Some(before) = last.replace(now) {
                    gaps.push(now - before);
                }
            }
            if !v["usage"].is_null() {
                usage = Some(v["usage"].clone());
            }
        }
    }
    let usage = usage.ok_or_else(|| failed("the stream ended without usage".into()))?;
    let latency = t0.elapsed().as_secs_f64();
    Ok(Sample {
        latency,
        ttft: ttft.unwrap_or(latency),
        gaps,
        tokens: usage["completion_tokens"].as_u64().unwrap_or(0) as usize,
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0) as usize,
        kv_peak: usage["headwise"]["kv_peak_bytes"].as_f64().unwrap_or(0.0),
    })
}

/// Write `summary.json`, `README.md` and `throughput.svg` to `dir`.
pub fn write_report(
    dir: &Path,
    model: &crate::model::ModelId,
    rows: &[BenchRow],
    made: &Made,
) -> Result<()> {
    let mut records = Vec::new();
    for r in rows {
        for (metric, value) in [
            ("requests_per_s", r.requests_per_s),
            ("tokens_per_s", r.tokens_per_s),
            ("mean_latency_s", r.mean_latency_s),
            ("mean_ttft_s", r.mean_ttft_s),
            ("kv_peak_bytes", r.mean_kv_peak_bytes),
            ("p50_ttft_s", r.p50_ttft_s),
            ("p95_ttft_s", r.p95_ttft_s),
            ("p50_itl_s", r.p50_itl_s),
            ("p95_itl_s", r.p95_itl_s),
            ("mean_batch", r.mean_batch),
            ("peak_batch", r.peak_batch),
            ("peak_reserved_bytes", r.peak_reserved_bytes),
        ] {
            // llama-server's batch and KV are not known.
            let unknown =
                metric.contains("batch") || metric.contains("kv") || metric.contains("reserved");
            if r.policy == ANCHOR && unknown {
                continue;
            }
            records.push(ResultRecord {
                schema_version: SCHEMA_VERSION,
                experiment: "serve-bench".into(),
                model: model.name.clone(),
                model_sha256: model.sha256.clone(),
                task: Some(format!("chat-concurrency-{}", r.concurrency)),
                context_tokens: Some(r.prompt_tokens),
                selection: None,
                k: None,
                seed: None,
                mode: Some(mode(r)),
                policy: Some(r.policy.clone()),
                metric: metric.into(),
                value,
                n: r.requests,
                ci95: None,
                p_value: None,
                made: made.clone(),
            });
        }
    }
    let mut md = format!(
        "# Serving throughput: {}\n\nStreamed chat requests against `headwise serve` on loopback; \
         each client sends its requests one after another, rates are totals over the level's wall time.\n\n\
         Command: `{}`\n\nMachine: {}; wall time {wall:.0} s over all levels.\n\n\
         Mean and peak batch and the peak KV reserved are the server's own counters (peaks \
         sampled every 20 ms); llama-server's are not known (-). KV budget 0: none.\n\n\
         Prefill: positions per forward pass of a prompt / prompt positions prefilled \
         between two decode steps.\n\n\
         | policy | max batch | prefix cache (MiB) | KV budget (MiB) | prefill | clients | requests | prompt tokens | requests/s | tokens/s | mean / peak batch | peak KV reserved (MiB) | TTFT p50 / p95 (s) | chunk gap p50 / p95 (ms) | mean KV peak per request (MiB) |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        model.name,
        made.command,
        machine(),
        wall = rows.iter().map(|r| r.wall_secs).sum::<f64>(),
    );
    let mib = |b: f64| b / (1024.0 * 1024.0);
    for r in rows {
        let known = r.policy != ANCHOR;
        let shown = |s: String| if known { s } else { "-".into() };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.1} | {} | {} | {:.2} / {:.2} | {:.0} / {:.0} | {} |\n",
            r.name(),
            r.max_batch,
            r.prefix_cache_mib,
            r.kv_budget_mib,
            shown(format!("{} / {}", r.prefill_chunk, r.prefill_tokens)),
            r.concurrency,
            r.requests,
            r.prompt_tokens,
            r.requests_per_s,
            r.tokens_per_s,
            shown(format!("{:.1} / {:.0}", r.mean_batch, r.peak_batch)),
            shown(format!("{:.1}", mib(r.peak_reserved_bytes))),
            r.p50_ttft_s,
            r.p95_ttft_s,
            r.p50_itl_s * 1e3,
            r.p95_itl_s * 1e3,
            shown(format!("{:.2}", mib(r.mean_kv_peak_bytes))),
        ));
    }
    md.push_str("\n![tokens per second against clients](throughput.svg)\n");
    write_experiment(dir, &md, &records, made)?;
    let label = |r: &BenchRow| {
        let budget = match r.kv_budget_mib > 0.0 {
            true => format!(", KV budget {} MiB", r.kv_budget_mib),
            false => String::new(),
        };
        let prefill = match r.prefill_chunk {
            0 => String::new(),
            c if c == crate::model::DEFAULT_CHUNK => String::new(),
            c => format!(", prefill chunk {c}"),
        };
        format!(
            "{}, max batch {}, prefix cache {} MiB{budget}{prefill}",
            r.name(),
            r.max_batch,
            r.prefix_cache_mib
        )
    };
    let mut lines: Vec<String> = rows.iter().map(label).collect();
    lines.dedup();
    let series: Vec<Series<f64>> = lines
        .iter()
        .enumerate()
        .map(|(i, l)| Series {
            name: l.clone(),
            points: rows
                .iter()
                .filter(|r| label(r) == *l)
                .map(|r| (r.concurrency as f64, r.tokens_per_s))
                .collect(),
            color: Palette99::pick(i).to_rgba(),
            mark: Mark::Line { width: 2, dot: 4 },
            bars: Vec::new(),
        })
        .collect();
    let x_max = rows
        .iter()
        .map(|r| r.concurrency as f64)
        .fold(1.0, f64::max);
    let y_max = rows.iter().map(|r| r.tokens_per_s).fold(1.0, f64::max);
    let chart = Chart {
        title: "generated tokens/s against concurrent clients",
        title_size: 16,
        x_label: "concurrent clients",
        y_label: "tokens/s",
        x_range: 0.0..x_max * 1.05,
        y_range: 0.0..y_max * 1.15,
        log_y: false,
        x_ticks: None,
        legend: plotters::chart::SeriesLabelPosition::LowerRight,
        size: (640, 400),
    };
    write_atomic(
        &dir.join("throughput.svg"),
        line_chart(&chart, &series)?.as_bytes(),
    )
}
