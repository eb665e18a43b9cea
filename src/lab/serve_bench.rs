//! `headwise bench serve`: requests/s, tokens/s, latency and time to first token of the
//! real server on loopback, at several client concurrencies, per policy. Each client
//! sends streamed chat requests one after another; a level's rates are its totals over
//! its wall time.

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
}

/// One level's totals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRow {
    pub policy: String,
    /// The server's batch size limit (`max_concurrency`).
    #[serde(default)]
    pub max_batch: usize,
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
}

/// One request's numbers.
struct Sample {
    latency: f64,
    ttft: f64,
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
    let http = reqwest::Client::new();
    let mut rows = Vec::new();
    for policy in &opts.policies {
        for &c in &opts.concurrency {
            let n = opts.requests.max(2 * c);
            let t0 = Instant::now();
            let samples = level(&http, &url, cfg, policy, c, n, opts).await?;
            let wall = t0.elapsed().as_secs_f64();
            let mean = |f: fn(&Sample) -> f64| samples.iter().map(f).sum::<f64>() / n as f64;
            let row = BenchRow {
                policy: policy.clone(),
                max_batch: cfg.max_concurrency,
                concurrency: c,
                requests: n,
                prompt_tokens: samples.first().map_or(0, |s| s.prompt_tokens),
                wall_secs: wall,
                requests_per_s: n as f64 / wall,
                tokens_per_s: samples.iter().map(|s| s.tokens).sum::<usize>() as f64 / wall,
                mean_latency_s: mean(|s| s.latency),
                mean_ttft_s: mean(|s| s.ttft),
                mean_kv_peak_bytes: mean(|s| s.kv_peak),
            };
            progress(&row);
            rows.push(row);
        }
    }
    let _ = stop.send(());
    server
        .await
        .map_err(|e| Error::invalid("server", e.to_string()))??;
    Ok(rows)
}

/// `n` requests from `c` clients, each sending its share one after another.
async fn level(
    http: &reqwest::Client,
    url: &str,
    cfg: &ServeConfig,
    policy: &str,
    c: usize,
    n: usize,
    opts: &BenchOptions,
) -> Result<Vec<Sample>> {
    let body = json!({
        "messages": [{"role": "user", "content": opts.prompt}],
        "max_tokens": opts.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
        "headwise": {"policy": policy, "ignore_eos": true},
    });
    let clients = (0..c).map(|i| {
        let share = n / c + usize::from(i < n % c);
        let (http, body) = (http.clone(), body.clone());
        let key = cfg.api_keys.first().cloned();
        let url = url.to_string();
        async move {
            let mut out = Vec::with_capacity(share);
            for _ in 0..share {
                out.push(one(&http, &url, key.as_deref(), &body).await?);
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
            if ttft.is_none() && !text.is_empty() {
                ttft = Some(t0.elapsed().as_secs_f64());
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
        ] {
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
                mode: Some(format!("max_batch-{}", r.max_batch)),
                policy: Some(r.policy.clone()),
                metric: metric.into(),
                value,
                n: r.requests,
                made: made.clone(),
            });
        }
    }
    let mut md = format!(
        "# Serving throughput: {}\n\nStreamed chat requests against `headwise serve` on loopback; \
         each client sends its requests one after another, rates are totals over the level's wall time.\n\n\
         Command: `{}`\n\nMachine: {}; wall time {wall:.0} s over all levels.\n\n\
         | policy | max batch | clients | requests | prompt tokens | requests/s | tokens/s | mean latency (s) | mean TTFT (s) | mean KV peak (MiB) |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        model.name,
        made.command,
        machine(),
        wall = rows.iter().map(|r| r.wall_secs).sum::<f64>(),
    );
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} |\n",
            r.policy,
            r.max_batch,
            r.concurrency,
            r.requests,
            r.prompt_tokens,
            r.requests_per_s,
            r.tokens_per_s,
            r.mean_latency_s,
            r.mean_ttft_s,
            r.mean_kv_peak_bytes / (1024.0 * 1024.0)
        ));
    }
    md.push_str("\n![tokens per second against clients](throughput.svg)\n");
    write_experiment(dir, &md, &records, made)?;
    let mut lines: Vec<(&str, usize)> = rows
        .iter()
        .map(|r| (r.policy.as_str(), r.max_batch))
        .collect();
    lines.dedup();
    let series: Vec<Series<f64>> = lines
        .iter()
        .enumerate()
        .map(|(i, &(p, b))| Series {
            name: format!("{p}, max batch {b}"),
            points: rows
                .iter()
                .filter(|r| (r.policy.as_str(), r.max_batch) == (p, b))
                .map(|r| (r.concurrency as f64, r.tokens_per_s))
                .collect(),
            color: Palette99::pick(i).to_rgba(),
            mark: Mark::Line { width: 2, dot: 4 },
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
