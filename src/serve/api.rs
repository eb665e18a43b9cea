//! The OpenAI wire format: the request and response bodies of `/v1/chat/completions`,
//! `/v1/completions` and `/v1/models`, the `"headwise"` extension object, and errors as
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::Error;

/// An error in OpenAI's format, with its HTTP status.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `rate_limit_error`, ...
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// The same error with `code`.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// An error of another status and type.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// The body: `{"error": {...}}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl From<Error> for ApiError {
    /// Bad request values are the client's fault (400); anything else is the server's.
    fn from(e: Error) -> Self {
        match &e {
            Error::ContextOverflow { .. } => ApiError::invalid(Some("messages"), e.to_string())
                .with_code("context_length_exceeded"),
            Error::InvalidArgument { name, .. } => ApiError::invalid(Some(name), e.to_string()),
            Error::Tokenizer(_) | Error::ChatTemplate(_) => ApiError::invalid(None, e.to_string()),
            _ => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    /// The stop strings, empty ones dropped.
    pub fn strings(&self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s.clone()],
            StopField::Many(v) => v.clone(),
        }
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect()
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk carrying `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// The `"headwise"` extension object of a request.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeadwiseOptions {
    /// A policy preset the server allows.
    pub policy: Option<String>,
    /// A retrieval trigger the server allows (needs its `rag_index`).
    pub rag: Option<String>,
    /// Generate through end-of-turn tokens, always `max_tokens` tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Explain every generated token: `true`, or how much.
    pub explain: Option<ExplainField>,
}

/// `"headwise": {"explain": ...}`: `true` / `false`, or an object.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExplainField {
    On(bool),
    With(ExplainOptions),
}

impl<'de> Deserialize<'de> for ExplainField {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::Bool(b) => Ok(Self::On(b)),
            v @ serde_json::Value::Object(_) => serde_json::from_value(v)
                .map(Self::With)
                .map_err(|e| D::Error::custom(format!("explain: {e}"))),
            _ => Err(D::Error::custom(
                "explain must be true, false or an object {heads, positions, context}",
            )),
        }
    }
}

/// How much to explain per token (each field optional).
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplainOptions {
    /// Top retrieval heads reported [default 4].
    pub heads: Option<usize>,
    /// Prompt positions per head [default 3].
    pub positions: Option<usize>,
    /// Prompt tokens of text either side of a position [default 3].
    pub context: Option<usize>,
}

/// The `"headwise"` object of a response choice: each token of the choice's text,
/// explained, in order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChoiceExtension {
    pub explain: Vec<crate::policy::TokenExplain>,
}

/// Sampling and length fields shared by both completion endpoints.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    pub stop: Option<StopField>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<usize>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub headwise: Option<HeadwiseOptions>,
}

/// Content of a chat message: a string, or a list of text parts.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a message's content; only `text` parts are understood.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A chat message as a request sends it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    pub content: Option<MessageContent>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatRequest {
    pub messages: Option<Vec<RequestMessage>>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    #[serde(flatten)]
    pub common: CommonFields,
}

/// `prompt` of a completion: text, or token ids.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Option<PromptField>,
    /// Top alternatives per token to return (0..=20).
    pub logprobs: Option<usize>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<usize>,
    #[serde(flatten)]
    pub common: CommonFields,
}

/// One alternative token with its log-probability.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// A generated token with its log-probability and the best alternatives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// `logprobs` of a chat choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

/// `logprobs` of a legacy completion choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f32>>,
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// The legacy layout of `tokens`, whose text starts at byte `offset`.
    pub fn from_tokens(tokens: &[TokenLogprob], mut offset: usize) -> Self {
        let mut out = Self {
            tokens: Vec::new(),
            token_logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            text_offset: Vec::new(),
        };
        for t in tokens {
            out.tokens.push(t.token.clone());
            out.token_logprobs.push(t.logprob);
            out.top_logprobs.push(
                t.top_logprobs
                    .iter()
                    .map(|a| (a.token.clone(), a.logprob))
                    .collect(),
            );
            out.text_offset.push(offset);
            offset += t.token.len();
        }
        out
    }
}

/// What a request cost in headwise's terms: `usage.headwise`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadwiseUsage {
    /// The preset that served the request.
    pub policy: String,
    /// Resident KV bytes at the end (hot tier, cold tier) and at peak.
    pub kv_bytes: usize,
    pub kv_cold_bytes: usize,
    pub kv_peak_bytes: usize,
    /// The most the cache held during the prefill.
    pub kv_prefill_peak_bytes: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Seconds the request waited for a place in the batch.
    pub queue_secs: f64,
    /// Prompt tokens continued from a shared prefix instead of prefilled.
    #[serde(default)]
    pub cached_prompt_tokens: usize,
    /// Of `kv_bytes` and `kv_cold_bytes`, the shared prefix's rows this request read in
    /// place (the prefix cache holds them once for every request that continues it).
    #[serde(default)]
    pub kv_shared_bytes: usize,
    /// Retrievals of a RAG request.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub retrievals: Option<usize>,
}

/// `usage`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// OpenAI's `cached_tokens`: prompt tokens served from the prefix cache.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    pub headwise: HeadwiseUsage,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// The assistant's message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseMessage {
    pub role: &'static str,
    pub content: String,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ResponseMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headwise: Option<ChoiceExtension>,
}

/// A whole chat completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

/// The incremental message of a streamed chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a streamed chat chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headwise: Option<ChoiceExtension>,
}

/// `chat.completion.chunk`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    pub usage: Option<Usage>,
}

/// One choice of a legacy completion (whole or streamed).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headwise: Option<ChoiceExtension>,
}

/// `text_completion`, whole or one streamed chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Option<Usage>,
}

/// One entry of `/v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}
