//! An OpenAI-compatible HTTP server over the policy runtime: `POST /v1/chat/completions`
//! and `/v1/completions` (whole or SSE), `GET /v1/models`, `/health` and `/metrics`.
//!
//! A request picks one of the allowed policy presets with `"headwise": {"policy": ...}`;
//! all presets share one copy of the weights. Requests wait in a bounded queue for one
//! of `max_concurrency` places in the continuously batched decode ([`engine`],
//! [`crate::policy::Scheduler`]); the response's `usage.headwise` says what the request
//! held in KV memory. `"headwise": {"explain": true}` adds, to each streamed chunk's
//! choice, every token's introspection ([`crate::policy::explain`]): its entropy, the
//! prompt positions (and text) the top retrieval heads read, and, under a probe, the
//! probe's most active heads.
//!
//! ```no_run
//! # async fn run() -> headwise::Result<()> {
//! use headwise::serve::{self, ServeConfig};
//! let mut cfg = ServeConfig::default();
//! cfg.model = Some("models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
//! let engine = std::sync::Arc::new(serve::load_engine(&cfg)?);
//! let listener = tokio::net::TcpListener::bind(("127.0.0.1", 8080)).await.map_err(|e| headwise::Error::io("127.0.0.1:8080", e))?;
//! serve::serve(engine, &cfg, listener, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```

pub mod api;
pub mod config;
pub mod engine;
pub mod metrics;
mod routes;
pub mod stop;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::ServeConfig;
pub use engine::Engine;
pub use routes::router;

use crate::policy::presses::Target;
use crate::policy::ranking::Ranking;
use crate::policy::{Policy, Runtime};
use crate::{Error, Result};

/// Seconds to wait for connections to close after in-flight generations were cancelled.
const AFTER_CANCEL_SECS: u64 = 5;

/// Load the model once and resolve every allowed preset over it.
pub fn load_engine(cfg: &ServeConfig) -> Result<Engine> {
    let model = cfg
        .model
        .as_ref()
        .ok_or_else(|| Error::invalid("model", "no model file given"))?;
    let base = &cfg.base_dir;
    let full = Runtime::builder()
        .model(model)
        .base_dir(base)
        .prefill_chunk(cfg.prefill_chunk)
        .build()?;
    let mut runtimes = BTreeMap::new();
    match &cfg.policies {
        Some(presets) => {
            for (name, path) in presets {
                let rt = load_preset(&full, &base.join(path), base)
                    .map_err(|e| Error::invalid("policies", format!("preset `{name}`: {e}")))?;
                runtimes.insert(name.clone(), rt);
            }
        }
        None => {
            for name in config::DEFAULT_PRESETS {
                let path = base.join("policies").join(format!("{name}.toml"));
                match load_preset(&full, &path, base) {
                    Ok(rt) => {
                        runtimes.insert(name.to_string(), rt);
                    }
                    Err(e) => eprintln!("preset `{name}` left out: {e}"),
                }
            }
        }
    }
    let name = cfg
        .served_model_name
        .clone()
        .unwrap_or_else(|| full.model_id().name.clone());
    let explain = explain_heads(cfg, &full)?;
    runtimes.entry(config::FULL.to_string()).or_insert(full);
    let mut engine = Engine::new(name, runtimes, cfg)?;
    if let Some(heads) = explain {
        engine = engine.with_explain_heads(heads);
    }
    let Some(dir) = &cfg.rag_index else {
        return Ok(engine);
    };
    let rag = engine::RagService {
        index: crate::rag::Bm25Index::open(&base.join(dir))?,
        stopwords: match &cfg.rag_stopwords {
            Some(file) => crate::rag::text::Stopwords::load(&base.join(file))?,
            None => crate::rag::text::Stopwords::english(),
        },
        triggers: cfg.triggers(),
    };
    Ok(engine.with_rag(rag))
}

/// The heads explain reports on, best first: those of `cfg.explain_ranking`, or of the
/// default LOCOS ranking when there is one for the model (none: explain is off).
fn explain_heads(cfg: &ServeConfig, full: &Runtime) -> Result<Option<Vec<(usize, usize)>>> {
    let (id, model) = (full.model_id(), full.model().model.config());
    let target = Target {
        cfg: model,
        id,
        base: &cfg.base_dir,
    };
    let path = match &cfg.explain_ranking {
        Some(p) => target.path(p),
        None => {
            let p = target.path(Path::new(config::EXPLAIN_RANKING));
            if !p.exists() {
                return Ok(None);
            }
            p
        }
    };
    let ranking = Ranking::load(&path)?;
    ranking.check_for(&path, id, model.n_layers, model.n_heads)?;
    Ok(Some(ranking.ordered()))
}

/// The preset file at `path` over the model of `full`; its paths are read from `base`.
fn load_preset(full: &Runtime, path: &Path, base: &Path) -> Result<Runtime> {
    full.with_policy(&Policy::load(path, &[])?, base)
}

/// Serve on `listener` until `shutdown` resolves; then refuse new requests, give the
/// in-flight ones `shutdown_grace_secs` to finish, cancel the rest and return.
pub async fn serve(
    engine: Arc<Engine>,
    cfg: &ServeConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let timeouts = cfg.timeouts();
    let app = router(
        Arc::clone(&engine),
        &cfg.api_keys,
        cfg.max_body_bytes,
        timeouts.body,
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let mut graceful = stop_rx.clone();
    let server = crate::http::serve(listener, app, timeouts, async move {
        let _ = graceful.wait_for(|&stop| stop).await;
    });
    let grace = Duration::from_secs_f64(cfg.shutdown_grace_secs);
    let mut watchdog = stop_rx;
    let deadline = async move {
        let _ = watchdog.wait_for(|&stop| stop).await;
        engine.drain();
        eprintln!(
            "shutting down: {} request(s) in flight, {:.0} s to finish",
            engine.in_flight(),
            grace.as_secs_f64()
        );
        tokio::time::sleep(grace).await;
        if engine.in_flight() > 0 {
            eprintln!("cancelling {} request(s)", engine.in_flight());
        }
        engine.abort_all();
        tokio::time::sleep(Duration::from_secs(AFTER_CANCEL_SECS)).await;
    };
    tokio::select! {
        r = server => r.map_err(|e| Error::io("server", e)),
        () = deadline => Ok(()),
    }
}
