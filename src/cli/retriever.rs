//! `headwise retriever`: build a BM25 index from a corpus, serve it over the
//! Elasticsearch `_search` subset, and search it (embedded or over HTTP).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand};
use headwise::http::Timeouts;
use headwise::rag::corpus::{self, CorpusFormat};
use headwise::rag::retriever::MAX_K;
use headwise::rag::search_server::{self, SearchLimits};
use headwise::rag::{Bm25Index, HttpRetriever, Retriever};
use headwise::wait;

#[derive(Subcommand, Debug)]
pub enum RetrieverCommand {
    /// Index a corpus (JSONL `{"id", "title", "text"}`, or the paragraph pool of a
    /// HotpotQA or MuSiQue file) into a new folder.
    Index(IndexArgs),
    /// Serve an index over HTTP (`POST /{name}/_search`, Elasticsearch's match query).
    Serve(ServeArgs),
    /// Print the best passages for a query.
    Search(SearchArgs),
}

#[derive(Args, Debug)]
pub struct IndexArgs {
    /// The corpus file.
    corpus: PathBuf,
    /// What the file is.
    #[arg(long, default_value = "jsonl",
          value_parser = super::named(&CorpusFormat::ALL, CorpusFormat::name))]
    format: CorpusFormat,
    /// The index folder to create (must not exist or be empty).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The index folder.
    #[arg(long)]
    index: PathBuf,
    /// The index name in the URL.
    #[arg(long, default_value = "wiki")]
    name: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port, 0 for any free one (printed at start).
    #[arg(long, default_value_t = 9200)]
    port: u16,
    /// Seconds a search may run before it is answered 504.
    #[arg(long, default_value_t = SearchLimits::default().request_timeout.as_secs_f64(),
          value_parser = wait::parse_secs)]
    request_timeout: f64,
    /// Seconds a client has to send a request's headers.
    #[arg(long, default_value_t = Timeouts::default().header_read.as_secs_f64(),
          value_parser = wait::parse_secs)]
    header_read_timeout: f64,
    /// Seconds an idle keep-alive connection stays open.
    #[arg(long, default_value_t = Timeouts::default().idle.as_secs_f64(),
          value_parser = wait::parse_secs)]
    idle_timeout: f64,
    /// Seconds a client has to send a request's body.
    #[arg(long, default_value_t = Timeouts::default().body.as_secs_f64(),
          value_parser = wait::parse_secs)]
    body_timeout: f64,
}

#[derive(Args, Debug)]
pub struct SearchArgs {
    /// The query text.
    query: String,
    /// Search this index folder...
    #[arg(long, conflicts_with = "url", required_unless_present = "url")]
    index: Option<PathBuf>,
    /// ...or this service (e.g. http://127.0.0.1:9200).
    #[arg(long)]
    url: Option<String>,
    /// The index name at --url.
    #[arg(long, default_value = "wiki")]
    name: String,
    /// Passages to return (1 to 1000).
    #[arg(long, default_value_t = 3,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_K as u64))]
    k: usize,
    /// Seconds per HTTP request.
    #[arg(long, default_value_t = 10.0, value_parser = wait::parse_secs)]
    timeout: f64,
}

pub fn run(cmd: RetrieverCommand) -> anyhow::Result<()> {
    match cmd {
        RetrieverCommand::Index(a) => {
            let passages = corpus::read(&a.corpus, a.format)?;
            let index = Bm25Index::build(&a.out, &passages)?;
            eprintln!(
                "indexed {} passages into {} (corpus sha256 {})",
                index.meta().passages,
                a.out.display(),
                index.meta().corpus_sha256
            );
            Ok(())
        }
        RetrieverCommand::Serve(a) => {
            let index = Arc::new(Bm25Index::open(&a.index)?);
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let listener = super::serve::bind(&a.host, a.port).await?;
                eprintln!(
                    "serving index `{}` ({} passages) on http://{}",
                    a.name,
                    index.meta().passages,
                    listener.local_addr()?
                );
                let limits = SearchLimits {
                    request_timeout: Duration::from_secs_f64(a.request_timeout),
                    http: Timeouts {
                        header_read: Duration::from_secs_f64(a.header_read_timeout),
                        idle: Duration::from_secs_f64(a.idle_timeout),
                        body: Duration::from_secs_f64(a.body_timeout),
                    },
                    ..SearchLimits::default()
                };
                let app = search_server::router(index, &a.name, limits);
                headwise::http::serve(listener, app, limits.http, super::serve::shutdown_signal())
                    .await?;
                anyhow::Ok(())
            })?;
            // A search past its deadline may still run on a blocking thread: it is not
            // waited for.
            rt.shutdown_timeout(Duration::from_secs(1));
            Ok(())
        }
        RetrieverCommand::Search(a) => {
            let retriever: Box<dyn Retriever> = match (&a.index, &a.url) {
                (Some(dir), _) => Box::new(Bm25Index::open(dir)?),
                (None, Some(url)) => Box::new(HttpRetriever::new(
                    url,
                    &a.name,
                    Duration::from_secs_f64(a.timeout),
                )?),
                (None, None) => anyhow::bail!("give --index DIR or --url URL"),
            };
            for (i, hit) in retriever.search(&a.query, a.k)?.iter().enumerate() {
                println!(
                    "{}. [{}] {} ({:.2}): {}",
                    i + 1,
                    hit.id,
                    hit.title,
                    hit.score,
                    hit.text
                );
            }
            Ok(())
        }
    }
}
