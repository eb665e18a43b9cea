//! A generation in the [`Scheduler`]'s batch as an async stream of events: what a
//! serving stack built on tokio consumes. Dropping the stream cancels the generation;
//! it leaves the batch at its next step and its KV reservation returns.
//!
//! ```no_run
//! # async fn run(scheduler: &headwise::policy::Scheduler) -> headwise::Result<()> {
//! use futures_util::StreamExt;
//! use headwise::policy::{GenerateRequest, Prompt, StreamEvent};
//!
//! let request = GenerateRequest::new(Prompt::Text("The capital of France is".into()), 16);
//! let mut events = scheduler.stream("full", &request)?;
//! while let Some(event) = events.next().await {
//!     match event {
//!         StreamEvent::Token { text, .. } => print!("{text}"),
//!         StreamEvent::Done(out) => eprintln!("{}", out?.stats),
//!         StreamEvent::Admitted => {}
//!     }
//! }
//! # Ok(()) }
//! ```

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::model::KvBytes;
use crate::policy::explain::TokenExplain;
use crate::policy::runtime::{GenerateOutput, GenerateRequest, Step};
use crate::policy::scheduler::{Scheduler, Sink};
use crate::Result;

/// What a streamed generation reports, in order: `Admitted`, a `Token` per generated
/// token, then `Done`.
#[derive(Debug)]
pub enum StreamEvent {
    /// It left the queue; its prefill starts.
    Admitted,
    /// A generated token, the text it completes (empty for an end-of-turn token or an
    /// incomplete character), the resident KV bytes after its step, and the token
    /// explained when the request asked ([`GenerateRequest::explain`]).
    Token {
        token: u32,
        text: String,
        kv: KvBytes,
        explain: Option<TokenExplain>,
    },
    /// The end: the output, or why it failed.
    Done(Result<GenerateOutput>),
}

/// The events of one generation ([`Scheduler::stream`]); a
/// [`futures_util::Stream`] that ends after [`StreamEvent::Done`]. Dropping it cancels
/// the generation.
#[derive(Debug)]
pub struct GenerationStream {
    rx: UnboundedReceiver<StreamEvent>,
}

impl futures_util::Stream for GenerationStream {
    type Item = StreamEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<StreamEvent>> {
        self.rx.poll_recv(cx)
    }
}

/// The scheduler's side of a [`GenerationStream`].
struct Channel {
    tx: UnboundedSender<StreamEvent>,
}

impl Sink for Channel {
    fn admitted(&mut self) {
        let _ = self.tx.send(StreamEvent::Admitted);
    }

    fn token(&mut self, step: &Step) -> bool {
        let event = StreamEvent::Token {
            token: step.token,
            text: step.text.to_string(),
            kv: step.kv,
            explain: step.explain.cloned(),
        };
        self.tx.send(event).is_ok()
    }

    fn done(self: Box<Self>, result: Result<GenerateOutput>) {
        let _ = self.tx.send(StreamEvent::Done(result));
    }

    fn cancelled(&self) -> bool {
        self.tx.is_closed()
    }
}

impl Scheduler {
    /// Queue `request` under `policy` and return its events as a stream; refused at once
    /// as [`Scheduler::submit`] refuses.
    pub fn stream(&self, policy: &str, request: &GenerateRequest) -> Result<GenerationStream> {
        let (tx, rx) = unbounded_channel();
        self.submit(policy, request, Box::new(Channel { tx }))?;
        Ok(GenerationStream { rx })
    }
}
