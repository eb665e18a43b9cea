//! `headwise serve`: the OpenAI-compatible server, until SIGTERM or Ctrl-C.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use headwise::serve::{self, ServeConfig};

use super::ModelArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Server settings (TOML); every setting has a default.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to bind [default: 127.0.0.1].
    #[arg(long)]
    host: Option<String>,
    /// Port to bind, 0 for any free one [default: 8080].
    #[arg(long)]
    port: Option<u16>,
    /// Sequences batched at once [default: 2].
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Requests waiting for a place in the batch before new ones get 429 [default: 16].
    #[arg(long)]
    max_queue: Option<usize>,
    /// KV memory the batch may reserve, in MiB [default: no limit].
    #[arg(long)]
    kv_budget_mib: Option<f64>,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut cfg = ServeConfig::load(args.config.as_deref())?;
    cfg.host = args.host.unwrap_or(cfg.host);
    cfg.port = args.port.unwrap_or(cfg.port);
    cfg.max_concurrency = args.max_concurrency.unwrap_or(cfg.max_concurrency);
    cfg.max_queue = args.max_queue.unwrap_or(cfg.max_queue);
    cfg.kv_budget_mib = args.kv_budget_mib.or(cfg.kv_budget_mib);
    cfg.validate()?;
    let model = match &cfg.model {
        Some(path) => args.model.or_model(&path.to_string_lossy()),
        None => args.model,
    };
    cfg.model = Some(model.resolve()?);
    let engine = Arc::new(serve::load_engine(&cfg)?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = bind(&cfg.host, cfg.port).await?;
        eprintln!(
            "serving {} (policies: {}) on http://{}",
            engine.model_name(),
            engine.policies().collect::<Vec<_>>().join(", "),
            listener.local_addr()?
        );
        serve::serve(engine, &cfg, listener, shutdown_signal()).await?;
        eprintln!("stopped");
        Ok(())
    })
}

/// A listener on `host:port`, or a one-line error naming the address.
pub async fn bind(host: &str, port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(|e| anyhow::anyhow!("cannot bind {host}:{port}: {e}"))
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}
