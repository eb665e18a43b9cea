//! `headwise retriever serve`: a tantivy index behind the Elasticsearch `_search` subset
//! that [`super::http::HttpRetriever`] (and DRAGIN) speaks:
//!
//! ```text
//! POST /{index}/_search  {"query": {"match": {"txt": "..."}}, "size": 3, "_source": ["title", "txt"]}
//! -> {"took": 1, "timed_out": false,
//!     "hits": {"total": {"value": 3, "relation": "eq"}, "max_score": 7.1,
//!              "hits": [{"_index": "wiki", "_id": "p4", "_score": 7.1, "_source": {"title": "...", "txt": "..."}}]}}
//! ```
//!
//! The match query may be a string or `{"query": "..."}`; whatever field it names, both
//! the title and the text are searched. `_source` is `true` (default), `false` or a list
//! of `id`, `title`, `txt`/`text`. Errors use Elasticsearch's shape
//! `{"error": {"type", "reason"}, "status"}`.
//!
//! Every wait is bounded ([`SearchLimits`]): bodies beyond `max_body_bytes` get 413, a
//! body not sent within the body timeout 408, and a search still running at
//! `request_timeout` is answered 504 (queries are capped in terms, so a search ends soon
//! after, on its blocking thread).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};

use crate::http::{buffer_body, Timeouts};
use crate::rag::bm25::Bm25Index;
use crate::rag::retriever::{Hit, Retriever, MAX_K as MAX_SIZE};

/// How much a search request may ask of the server.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SearchLimits {
    /// A search still running after this long is answered 504.
    pub request_timeout: Duration,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Waits on the client (headers, idle connections, bodies).
    pub http: Timeouts,
}

impl Default for SearchLimits {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(10),
            max_body_bytes: 1 << 20,
            http: Timeouts::default(),
        }
    }
}

#[derive(Debug, Clone)]
struct Served {
    index: Arc<Bm25Index>,
    name: String,
    request_timeout: Duration,
}

/// The router serving `index` as `name`.
pub fn router(index: Arc<Bm25Index>, name: &str, limits: SearchLimits) -> Router {
    Router::new()
        .route("/", get(info))
        .route("/{index}/_search", post(search).get(search))
        .layer(middleware::from_fn_with_state(
            (limits.max_body_bytes, limits.http.body),
            body_deadline,
        ))
        .with_state(Served {
            index,
            name: name.to_string(),
            request_timeout: limits.request_timeout,
        })
}

/// Read the body within its limits before the handler runs.
async fn body_deadline(
    State((limit, timeout)): State<(usize, Duration)>,
    req: Request,
    next: Next,
) -> Response {
    match buffer_body(req, limit, timeout).await {
        Ok(req) => next.run(req).await,
        Err(e) => es_error(e.status(), "parse_exception", e.to_string()),
    }
}

fn es_error(status: StatusCode, kind: &str, reason: impl Into<String>) -> Response {
    let body = json!({"error": {"type": kind, "reason": reason.into()}, "status": status.as_u16()});
    (status, Json(body)).into_response()
}

async fn info(State(s): State<Served>) -> Json<Value> {
    Json(json!({
        "name": "headwise",
        "tagline": "BM25 over a tantivy index, Elasticsearch _search subset",
        "index": s.name,
        "passages": s.index.meta().passages,
    }))
}

/// The query text, size and source filter of a search body.
fn parse(body: &[u8]) -> Result<(String, usize, Option<Vec<String>>), String> {
    let v: Value = if body.is_empty() {
        return Err("a search needs a body with a match query".into());
    } else {
        serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?
    };
    let q = v["query"]["match"]
        .as_object()
        .filter(|m| m.len() == 1)
        .and_then(|m| m.values().next())
        .ok_or("only {\"query\": {\"match\": {FIELD: TEXT}}} is supported")?;
    let text = match q {
        Value::String(s) => s.clone(),
        Value::Object(o) => o
            .get("query")
            .and_then(Value::as_str)
            .ok_or("match: {FIELD: {\"query\": TEXT}} needs a string")?
            .to_string(),
        _ => return Err("match: the query must be a string".into()),
    };
    let size = match &v["size"] {
        Value::Null => 10,
        s => s
            .as_u64()
            .filter(|&n| n as usize <= MAX_SIZE)
            .ok_or(format!("size must be an integer in 0..={MAX_SIZE}"))? as usize,
    };
    let source = match &v["_source"] {
        Value::Null | Value::Bool(true) => None,
        Value::Bool(false) => Some(Vec::new()),
        Value::Array(fields) => Some(
            fields
                .iter()
                .map(|f| {
                    f.as_str()
                        .map(str::to_string)
                        .ok_or("_source: a list of field names")
                })
                .collect::<Result<_, _>>()?,
        ),
        _ => return Err("_source must be a boolean or a list of fields".into()),
    };
    Ok((text, size, source))
}

/// `_source` of one hit, filtered.
fn source(hit: &Hit, fields: &Option<Vec<String>>) -> Value {
    let all = [
        ("id", &hit.id),
        ("title", &hit.title),
        ("txt", &hit.text),
        ("text", &hit.text),
    ];
    let mut out = Map::new();
    for (name, value) in all {
        let wanted = match fields {
            None => name != "text",
            Some(f) => f.iter().any(|f| f == name),
        };
        if wanted {
            out.insert(name.to_string(), Value::String(value.clone()));
        }
    }
    Value::Object(out)
}

async fn search(
    State(s): State<Served>,
    Path(index): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if index != s.name {
        return es_error(
            StatusCode::NOT_FOUND,
            "index_not_found_exception",
            format!("no such index [{index}] (served: {})", s.name),
        );
    }
    let body = match body {
        Ok(b) => b,
        Err(e) => return es_error(e.status(), "parse_exception", e.body_text()),
    };
    let (text, size, fields) = match parse(&body) {
        Ok(p) => p,
        Err(reason) => return es_error(StatusCode::BAD_REQUEST, "parsing_exception", reason),
    };
    let t0 = Instant::now();
    let idx = Arc::clone(&s.index);
    let searching = tokio::task::spawn_blocking(move || idx.search(&text, size));
    let hits = match tokio::time::timeout(s.request_timeout, searching).await {
        Ok(Ok(Ok(h))) => h,
        Ok(Ok(Err(crate::Error::InvalidArgument { reason, .. }))) => {
            return es_error(StatusCode::BAD_REQUEST, "parsing_exception", reason)
        }
        Ok(Ok(Err(e))) => {
            return es_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "search_exception",
                e.to_string(),
            )
        }
        Ok(Err(e)) => {
            return es_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "search_exception",
                e.to_string(),
            )
        }
        Err(_) => {
            return es_error(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout_exception",
                format!(
                    "search not done within {:.1} s",
                    s.request_timeout.as_secs_f64()
                ),
            )
        }
    };
    let max = hits.first().map(|h| h.score);
    let body = json!({
        "took": t0.elapsed().as_millis() as u64,
        "timed_out": false,
        "hits": {
            "total": {"value": hits.len(), "relation": "eq"},
            "max_score": max,
            "hits": hits.iter().map(|h| json!({
                "_index": s.name,
                "_id": h.id,
                "_score": h.score,
                "_source": source(h, &fields),
            })).collect::<Vec<_>>(),
        }
    });
    Json(body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_bodies_parse_in_both_match_forms_and_bad_ones_say_why() {
        let (q, n, f) =
            parse(br#"{"query": {"match": {"txt": "capital of Japan"}}, "size": 3}"#).unwrap();
        assert_eq!((q.as_str(), n, f), ("capital of Japan", 3, None));
        let (q, n, f) =
            parse(br#"{"query": {"match": {"txt": {"query": "x"}}}, "_source": ["title"]}"#)
                .unwrap();
        assert_eq!(
            (q.as_str(), n, f),
            ("x", 10, Some(vec!["title".to_string()]))
        );
        for bad in [
            &b""[..],
            b"{",
            br#"{"query": {"term": {}}}"#,
            br#"{"query": {"match": {"txt": 1}}}"#,
            br#"{"query": {"match": {"txt": "a"}}, "size": -1}"#,
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
