//! Serving an axum router over HTTP/1.1 with a bound on every wait a client controls.
//!
//! `axum::serve` leaves a connection open for as long as its client likes: a request
//! whose headers never finish, a keep-alive connection that never sends another request,
//! a body that trickles in a byte a minute. [`serve`] runs each connection on hyper
//! directly and closes it when
//!
//! - its request headers take longer than [`Timeouts::header_read`] (hyper's own timer);
//! - it has sat idle (no request running, no byte in either direction) for
//!   [`Timeouts::idle`];
//!
//! and [`buffer_body`] bounds the time a handler waits for a body ([`Timeouts::body`]).
//! Both servers ([`crate::serve`] and the BM25 search server) use it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower_service::Service;

/// How long a server waits on its clients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeouts {
    /// From a connection's first byte of a request to the end of its headers.
    pub header_read: Duration,
    /// A connection with no request running and no traffic is closed after this long.
    pub idle: Duration,
    /// From a handler's first wait on the request body to its last byte.
    pub body: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            header_read: Duration::from_secs(10),
            idle: Duration::from_secs(60),
            body: Duration::from_secs(30),
        }
    }
}

/// Serve `app` on `listener` until `shutdown` resolves; then stop accepting, let every
/// connection finish the request it is on, and return when all are closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    timeouts: Timeouts,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let mut stopping = stop_rx.clone();
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(connection(stream, app.clone(), timeouts, stop_rx.clone()));
                }
                // Out of file descriptors and the like: pause instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = stopped(&mut stopping) => break,
        }
    }
    drop(listener);
    // Connections finish the request they are on; one that outlives an idle period more
    // (a client that stopped reading) is dropped.
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(timeouts.idle, drained).await.is_err() {
        connections.abort_all();
    }
    Ok(())
}

/// Resolves once the stop flag is set (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|&s| s).await;
}

/// One connection, to its end.
async fn connection(stream: TcpStream, app: Router, t: Timeouts, mut stop: watch::Receiver<bool>) {
    let started = Instant::now();
    let last_io = Arc::new(AtomicU64::new(0));
    let busy = Arc::new(AtomicUsize::new(0));
    let io = TokioIo::new(Tracked {
        inner: stream,
        started,
        last_io: Arc::clone(&last_io),
    });
    let service = {
        let busy = Arc::clone(&busy);
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let running = Running::enter(&busy);
            let mut app = app.clone();
            async move {
                let response = app.call(req.map(Body::new)).await?;
                // The request runs until its body is sent or dropped: a stream that waits
                // for its first token is not an idle connection.
                Ok::<_, std::convert::Infallible>(response.map(|body| {
                    Body::new(body.map_frame(move |frame| {
                        let _running = &running;
                        frame
                    }))
                }))
            }
        })
    };
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(t.header_read)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let tick = (t.idle / 4).max(Duration::from_millis(10));
    let mut closing: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            () = stopped(&mut stop), if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now());
            }
            () = tokio::time::sleep(tick) => {
                let idle_for = started.elapsed().saturating_sub(Duration::from_millis(
                    last_io.load(Ordering::Relaxed),
                ));
                let idle = busy.load(Ordering::Relaxed) == 0 && idle_for >= t.idle;
                match closing {
                    None if idle => {
                        conn.as_mut().graceful_shutdown();
                        closing = Some(Instant::now());
                    }
                    // Asked to close and still silent a period later: drop the socket.
                    Some(since) if idle && since.elapsed() >= t.idle => return,
                    _ => {}
                }
            }
        }
    }
}

/// Counts a running request on its connection for as long as it lives.
struct Running(Arc<AtomicUsize>);

impl Running {
    fn enter(busy: &Arc<AtomicUsize>) -> Self {
        busy.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(busy))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A socket that notes when bytes last moved (milliseconds after `started`).
struct Tracked {
    inner: TcpStream,
    started: Instant,
    last_io: Arc<AtomicU64>,
}

impl Tracked {
    fn touch(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_io.store(ms, Ordering::Relaxed);
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Why a request body could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// More than the limit of bytes.
    TooLarge(usize),
    /// Not complete within the body timeout (seconds).
    TimedOut(u64),
    /// The connection failed mid-body.
    Failed(String),
}

impl BodyError {
    /// The HTTP status that answers it: 413, 408 or 400.
    pub fn status(&self) -> axum::http::StatusCode {
        use axum::http::StatusCode;
        match self {
            BodyError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::TimedOut(_) => StatusCode::REQUEST_TIMEOUT,
            BodyError::Failed(_) => StatusCode::BAD_REQUEST,
        }
    }
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::TooLarge(limit) => write!(f, "request body larger than {limit} bytes"),
            BodyError::TimedOut(secs) => write!(f, "request body not received within {secs} s"),
            BodyError::Failed(e) => write!(f, "request body: {e}"),
        }
    }
}

/// `req` with its body read into memory first: at most `limit` bytes, within `timeout`.
/// A server's middleware calls this and answers a [`BodyError`] in its own error shape.
pub async fn buffer_body(
    req: Request,
    limit: usize,
    timeout: Duration,
) -> Result<Request, BodyError> {
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(BodyError::TimedOut(timeout.as_secs())),
        Ok(Ok(bytes)) => Ok(Request::from_parts(parts, Body::from(bytes))),
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            Err(if too_large {
                BodyError::TooLarge(limit)
            } else {
                BodyError::Failed(e.to_string())
            })
        }
    }
}
