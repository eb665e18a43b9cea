//! The HTTP routes: request parsing and checks, bearer auth, whole and SSE responses,
//! metrics and health.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::http::BodyError;
use crate::model::text::chat::ChatMessage;
use crate::model::Sampling;
use crate::policy::{ExplainConfig, GenerateRequest, Prompt, TokenExplain};
use crate::serve::api::*;
use crate::serve::engine::{Engine, Event, Job, MAX_TOP_LOGPROBS};

/// Most stop strings a request may give.
const MAX_STOPS: usize = 4;

/// Shared by every handler.
#[derive(Debug, Clone)]
struct AppState {
    engine: Arc<Engine>,
    /// SHA-256 of each accepted API key; empty: no authentication.
    keys: Arc<Vec<[u8; 32]>>,
}

/// The router: `/v1/*` and `/metrics` behind the API keys (when there are any),
/// `/health` open, every response counted in the metrics.
///
/// Bodies are read in full before the handlers run: at most `max_body_bytes` (413
/// beyond), within `body_timeout` (408 after).
pub fn router(
    engine: Arc<Engine>,
    api_keys: &[String],
    max_body_bytes: usize,
    body_timeout: Duration,
) -> Router {
    let state = AppState {
        engine,
        keys: Arc::new(api_keys.iter().map(|k| digest(k.as_bytes())).collect()),
    };
    let protected = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(protected)
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies reach the handlers already read within `max_body_bytes` (by
        // `body_deadline`); this lifts axum's own 2 MB default to the same limit.
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(middleware::from_fn_with_state(
            (max_body_bytes, body_timeout),
            body_deadline,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// Read the body within its limits before anything else looks at the request.
async fn body_deadline(
    State((limit, timeout)): State<(usize, Duration)>,
    req: Request,
    next: Next,
) -> Response {
    match crate::http::buffer_body(req, limit, timeout).await {
        Ok(req) => next.run(req).await,
        Err(e) => {
            let code = match e {
                BodyError::TooLarge(_) => "body_too_large",
                BodyError::TimedOut(_) => "body_timeout",
                BodyError::Failed(_) => "invalid_body",
            };
            ApiError::new(e.status(), "invalid_request_error", e.to_string())
                .with_code(code)
                .into_response()
        }
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Reject requests without an accepted `Authorization: Bearer` key. Keys are compared
/// as SHA-256 digests in constant time, so neither their bytes nor their length leak.
async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if st.keys.is_empty() {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|k| digest(k.trim().as_bytes()));
    let ok = given.is_some_and(|g| {
        st.keys
            .iter()
            .fold(subtle::Choice::from(0), |acc, k| acc | k.ct_eq(&g))
            .into()
    });
    if ok {
        return next.run(req).await;
    }
    let mut e = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        "missing or incorrect API key (send `Authorization: Bearer <key>`)",
    );
    e.code = Some("invalid_api_key");
    e.into_response()
}

/// Count every response by route and status.
async fn count(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "other".into());
    let resp = next.run(req).await;
    st.engine
        .metrics()
        .request(&endpoint, resp.status().as_u16());
    resp
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such route",
    )
    .with_code("not_found")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method not allowed on this route",
    )
}

async fn health(State(st): State<AppState>) -> Response {
    let e = &st.engine;
    let status = if e.draining() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let body = serde_json::json!({
        "status": if e.draining() { "draining" } else { "ok" },
        "model": e.model_name(),
        "policies": e.policies().collect::<Vec<_>>(),
        "in_flight": e.in_flight(),
    });
    (status, Json(body)).into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.engine.metrics().render(),
    )
        .into_response()
}

async fn models(State(st): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: st.engine.model_name().to_string(),
            object: "model",
            created: now(),
            owned_by: "headwise",
        }],
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The body as `T`, or a 400. (Size and time were checked by [`body_deadline`].)
fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| {
        let mut e = ApiError::invalid(
            None,
            format!("could not read the request body: {}", r.body_text()),
        );
        e.status = r.status();
        e
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::invalid(None, format!("invalid JSON body: {e}")).with_code("invalid_json")
    })
}

/// A request made ready to queue, and how to answer it.
struct Prepared {
    job: Job,
    stream: bool,
    include_usage: bool,
    /// The model's name in the API.
    model: String,
}

/// Check the fields both endpoints share and build the job.
fn prepare(
    engine: &Engine,
    common: CommonFields,
    prompt: Prompt,
    prompt_param: &str,
    top_logprobs: Option<usize>,
) -> Result<Prepared, ApiError> {
    if let Some(model) = &common.model {
        if model != engine.model_name() {
            let mut e = ApiError::invalid(
                Some("model"),
                format!(
                    "the model `{model}` does not exist (served: {})",
                    engine.model_name()
                ),
            )
            .with_code("model_not_found");
            e.status = StatusCode::NOT_FOUND;
            return Err(e);
        }
    }
    if common.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(Some("n"), "only n = 1 is supported"));
    }
    for (name, v) in [
        ("presence_penalty", common.presence_penalty),
        ("frequency_penalty", common.frequency_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(ApiError::invalid(
                Some(name),
                format!("{name} is not supported"),
            ));
        }
    }
    let ext = common.headwise.unwrap_or_default();
    let (policy, rt) = engine.runtime(ext.policy.as_deref())?;
    let rag = match &ext.rag {
        None => None,
        Some(name) => Some((
            engine.trigger(name)?,
            rag_question(&prompt, policy, top_logprobs)?,
        )),
    };
    let explain = explain_config(engine, ext.explain)?;
    if explain.is_some() && rag.is_some() {
        return Err(ApiError::invalid(
            Some("headwise.explain"),
            "explain is not available with rag",
        ));
    }
    if top_logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(ApiError::invalid(
            Some("top_logprobs"),
            format!("at most {MAX_TOP_LOGPROBS} alternatives per token"),
        ));
    }
    let max_tokens = common
        .max_completion_tokens
        .or(common.max_tokens)
        .unwrap_or(engine.default_max_tokens);
    if max_tokens == 0 || max_tokens > engine.max_tokens_limit {
        return Err(ApiError::invalid(
            Some("max_tokens"),
            format!(
                "max_tokens is {max_tokens}; it must be in 1..={}",
                engine.max_tokens_limit
            ),
        ));
    }
    let sampling = Sampling {
        temperature: Some(common.temperature.unwrap_or(1.0)),
        top_p: common.top_p,
        seed: common.seed.unwrap_or_else(rand::random),
    };
    if common.temperature.is_some_and(|t| t > 2.0) {
        return Err(ApiError::invalid(
            Some("temperature"),
            "temperature must be in [0, 2]",
        ));
    }
    sampling.validate()?;
    let stops = common.stop.map(|s| s.strings()).unwrap_or_default();
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            Some("stop"),
            format!("at most {MAX_STOPS} stop strings"),
        ));
    }
    let cfg = rt.model().model.config();
    if let Prompt::Tokens(ids) = &prompt {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
            return Err(ApiError::invalid(
                Some(prompt_param),
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    cfg.vocab_size
                ),
            ));
        }
    }
    let ids = rt.encode(&prompt)?;
    if ids.is_empty() {
        return Err(ApiError::invalid(Some(prompt_param), "the prompt is empty"));
    }
    if ids.len() + max_tokens > cfg.context_length {
        return Err(ApiError::invalid(
            Some(prompt_param),
            format!(
                "the prompt has {} tokens and max_tokens is {max_tokens}: together above the model's context of {} tokens",
                ids.len(),
                cfg.context_length
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(Prepared {
        job: Job {
            policy: policy.to_string(),
            request: GenerateRequest {
                prompt: Prompt::Tokens(ids),
                max_tokens,
                sampling,
                ignore_eos: ext.ignore_eos,
                explain,
            },
            stops,
            top_logprobs,
            rag,
        },
        stream: common.stream,
        include_usage: common.stream_options.is_some_and(|o| o.include_usage),
        model: engine.model_name().to_string(),
    })
}

/// What `"headwise": {"explain": ...}` asks for: the engine's top `heads` retrieval
/// heads (default 4), `positions` per head (default 3), `context` tokens of text either
/// side (default 3), and the probe's 4 most active heads under a probe-driven policy.
fn explain_config(
    engine: &Engine,
    field: Option<ExplainField>,
) -> Result<Option<ExplainConfig>, ApiError> {
    let o = match field {
        None | Some(ExplainField::On(false)) => return Ok(None),
        Some(ExplainField::On(true)) => ExplainOptions::default(),
        Some(ExplainField::With(o)) => o,
    };
    let Some(ranked) = engine.explain_heads() else {
        return Err(ApiError::invalid(
            Some("headwise.explain"),
            "this server has no head ranking to explain with (set explain_ranking)",
        ));
    };
    let bounded = |name: &str, v: Option<usize>, default: usize, lo: usize, hi: usize| {
        let v = v.unwrap_or(default);
        match (lo..=hi).contains(&v) {
            true => Ok(v),
            false => Err(ApiError::invalid(
                Some(&format!("headwise.explain.{name}")),
                format!("{name} is {v}; it must be in {lo}..={hi}"),
            )),
        }
    };
    let heads = bounded("heads", o.heads, 4, 1, MAX_EXPLAIN.min(ranked.len()))?;
    Ok(Some(ExplainConfig {
        heads: ranked[..heads].to_vec(),
        positions: bounded("positions", o.positions, 3, 1, MAX_EXPLAIN)?,
        context: bounded("context", o.context, 3, 0, MAX_EXPLAIN)?,
        probe_heads: 4,
    }))
}

/// Most heads, positions per head, or tokens of context an explain request may ask for.
const MAX_EXPLAIN: usize = 32;

/// The question a RAG request asks: the last user message, or the prompt text. RAG
/// answers run on the full cache, without log-probabilities.
fn rag_question(
    prompt: &Prompt,
    policy: &str,
    top_logprobs: Option<usize>,
) -> Result<String, ApiError> {
    if policy != crate::serve::config::FULL {
        return Err(ApiError::invalid(
            Some("headwise.policy"),
            "rag answers run on the full cache: leave out the policy or choose `full`",
        ));
    }
    if top_logprobs.is_some() {
        return Err(ApiError::invalid(
            Some("logprobs"),
            "logprobs are not available with rag",
        ));
    }
    match prompt {
        Prompt::Chat(messages) => messages
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(|m| m.content.clone())
            .ok_or_else(|| ApiError::invalid(Some("messages"), "rag needs a user message")),
        Prompt::Text(t) => Ok(t.clone()),
        Prompt::Tokens(_) => Err(ApiError::invalid(Some("prompt"), "rag needs a text prompt")),
    }
}

/// Text, log-probabilities, finish reason and usage of a whole generation.
struct Collected {
    text: String,
    logprobs: Vec<TokenLogprob>,
    explain: Vec<TokenExplain>,
    finish: &'static str,
    usage: Usage,
}

async fn collect(mut rx: UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    let mut explained = Vec::new();
    while let Some(event) = rx.recv().await {
        match event {
            Event::Text {
                text: t,
                logprobs: l,
                explain: e,
            } => {
                text.push_str(&t);
                logprobs.extend(l);
                explained.extend(e);
            }
            Event::Done {
                finish,
                usage,
                text: whole,
            } => {
                text.push_str(&whole.unwrap_or_default());
                return Ok(Collected {
                    text,
                    logprobs,
                    explain: explained,
                    finish,
                    usage,
                });
            }
            Event::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the generation ended without a result",
    ))
}

/// The messages of a chat request, as the chat template takes them.
fn chat_messages(req: &ChatRequest) -> Result<Vec<ChatMessage>, ApiError> {
    let messages = req
        .messages
        .as_ref()
        .ok_or_else(|| ApiError::invalid(Some("messages"), "missing required field `messages`"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid(Some("messages"), "`messages` is empty"));
    }
    messages
        .iter()
        .map(|m| {
            let content = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => parts
                    .iter()
                    .map(|p| match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => Ok(t.as_str()),
                        _ => Err(ApiError::invalid(
                            Some("messages"),
                            format!(
                                "content parts of type `{}` are not supported (text only)",
                                p.kind
                            ),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join(""),
            };
            Ok(ChatMessage {
                role: m.role.clone(),
                content,
            })
        })
        .collect()
}

async fn chat(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse(body)?;
    let messages = chat_messages(&req)?;
    let top = match (req.logprobs, req.top_logprobs) {
        (Some(true), n) => Some(n.unwrap_or(0)),
        (_, Some(n)) if n > 0 => {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                "top_logprobs needs logprobs = true",
            ))
        }
        _ => None,
    };
    let p = prepare(
        &st.engine,
        req.common,
        Prompt::Chat(messages),
        "messages",
        top,
    )?;
    let wants_logprobs = top.is_some();
    let (stream, include_usage, model) = (p.stream, p.include_usage, p.model);
    let rx = st.engine.submit(p.job).await?;
    let id = st.engine.next_id("chatcmpl");
    let created = now();
    if stream {
        let chunk = move |delta: Delta,
                          logprobs: Option<ChatLogprobs>,
                          explain: Vec<TokenExplain>,
                          finish: Option<&'static str>,
                          usage: Option<Usage>| ChatChunk {
            id: id.clone(),
            object: "chat.completion.chunk",
            created,
            model: model.clone(),
            choices: if usage.is_some() {
                Vec::new()
            } else {
                vec![ChunkChoice {
                    index: 0,
                    delta,
                    logprobs,
                    finish_reason: finish,
                    headwise: extension(explain),
                }]
            },
            usage,
        };
        let first = chunk(
            Delta {
                role: Some("assistant"),
                content: Some(String::new()),
            },
            None,
            Vec::new(),
            None,
            None,
        );
        let events = sse(rx, first, include_usage, move |piece| match piece {
            Piece::Text(text, logprobs, explain) => chunk(
                Delta {
                    role: None,
                    content: Some(text),
                },
                wants_logprobs.then_some(ChatLogprobs { content: logprobs }),
                explain,
                None,
                None,
            ),
            Piece::Finish(finish) => chunk(Delta::default(), None, Vec::new(), Some(finish), None),
            Piece::Usage(usage) => chunk(Delta::default(), None, Vec::new(), None, Some(usage)),
        });
        return Ok(events.into_response());
    }
    let c = collect(rx).await?;
    Ok(Json(ChatCompletion {
        id,
        object: "chat.completion",
        created,
        model,
        choices: vec![ChatChoice {
            index: 0,
            message: ResponseMessage {
                role: "assistant",
                content: c.text,
            },
            logprobs: wants_logprobs.then_some(ChatLogprobs {
                content: c.logprobs,
            }),
            finish_reason: c.finish,
            headwise: extension(c.explain),
        }],
        usage: c.usage,
    })
    .into_response())
}

async fn completions(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(body)?;
    let prompt = match req.prompt {
        None => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "missing required field `prompt`",
            ))
        }
        Some(PromptField::Text(t)) => Prompt::Text(t),
        Some(PromptField::Texts(mut v)) if v.len() == 1 => Prompt::Text(v.remove(0)),
        Some(PromptField::Texts(_)) => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "only one prompt per request is supported",
            ))
        }
        Some(PromptField::Tokens(ids)) => Prompt::Tokens(ids),
    };
    if req.echo == Some(true) || req.suffix.is_some() || req.best_of.is_some_and(|b| b != 1) {
        let param = if req.echo == Some(true) {
            "echo"
        } else if req.suffix.is_some() {
            "suffix"
        } else {
            "best_of"
        };
        return Err(ApiError::invalid(
            Some(param),
            format!("{param} is not supported"),
        ));
    }
    let top = req.logprobs;
    let p = prepare(&st.engine, req.common, prompt, "prompt", top)?;
    let (stream, include_usage, model) = (p.stream, p.include_usage, p.model);
    let rx = st.engine.submit(p.job).await?;
    let id = st.engine.next_id("cmpl");
    let created = now();
    let make = move |text: String,
                     logprobs: Option<CompletionLogprobs>,
                     explain: Vec<TokenExplain>,
                     finish: Option<&'static str>,
                     usage: Option<Usage>| Completion {
        id: id.clone(),
        object: "text_completion",
        created,
        model: model.clone(),
        choices: if usage.is_some() && finish.is_none() && text.is_empty() && stream {
            Vec::new()
        } else {
            vec![CompletionChoice {
                index: 0,
                text,
                logprobs,
                finish_reason: finish,
                headwise: extension(explain),
            }]
        },
        usage,
    };
    if stream {
        let mut offset = 0;
        let first = make(String::new(), None, Vec::new(), None, None);
        let events = sse(rx, first, include_usage, move |piece| match piece {
            Piece::Text(text, logprobs, explain) => {
                let lp = top.map(|_| CompletionLogprobs::from_tokens(&logprobs, offset));
                offset += text.len();
                make(text, lp, explain, None, None)
            }
            Piece::Finish(finish) => make(String::new(), None, Vec::new(), Some(finish), None),
            Piece::Usage(usage) => make(String::new(), None, Vec::new(), None, Some(usage)),
        });
        return Ok(events.into_response());
    }
    let c = collect(rx).await?;
    let lp = top.map(|_| CompletionLogprobs::from_tokens(&c.logprobs, 0));
    Ok(Json(make(c.text, lp, c.explain, Some(c.finish), Some(c.usage))).into_response())
}

/// A choice's `"headwise"` object: its tokens explained, when there are any.
fn extension(explain: Vec<TokenExplain>) -> Option<ChoiceExtension> {
    (!explain.is_empty()).then_some(ChoiceExtension { explain })
}

/// What a streamed response turns into a chunk.
enum Piece {
    /// Text, and the log-probabilities and explanations of its tokens.
    Text(String, Vec<TokenLogprob>, Vec<TokenExplain>),
    Finish(&'static str),
    Usage(Usage),
}

/// An SSE response: `first`, one chunk per text event, the finish chunk, the usage
/// chunk (when asked), then `[DONE]`; a failure is sent as an `{"error": ...}` event
/// and ends the stream.
fn sse<T: serde::Serialize + Send + 'static>(
    rx: UnboundedReceiver<Event>,
    first: T,
    include_usage: bool,
    chunk: impl FnMut(Piece) -> T + Send + 'static,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let head = stream::once(std::future::ready(data(&first)));
    let body = stream::unfold(Some((rx, chunk)), move |state| async move {
        let (mut rx, mut chunk) = state?;
        let out = match rx.recv().await {
            Some(Event::Text {
                text,
                logprobs,
                explain,
            }) => {
                let event = data(&chunk(Piece::Text(text, logprobs, explain)));
                return Some((vec![event], Some((rx, chunk))));
            }
            Some(Event::Done {
                finish,
                usage,
                text,
            }) => {
                let mut v = Vec::new();
                if let Some(text) = text {
                    v.push(data(&chunk(Piece::Text(text, Vec::new(), Vec::new()))));
                }
                v.push(data(&chunk(Piece::Finish(finish))));
                if include_usage {
                    v.push(data(&chunk(Piece::Usage(usage))));
                }
                v.push(SseEvent::default().data("[DONE]"));
                v
            }
            Some(Event::Failed(e)) => vec![data(&e.body())],
            None => Vec::new(),
        };
        Some((out, None))
    })
    .flat_map(stream::iter);
    Sse::new(head.chain(body).map(Ok))
}

/// One SSE event carrying `v` as JSON.
fn data<T: serde::Serialize>(v: &T) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(v).unwrap_or_default())
}
