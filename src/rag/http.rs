//! The HTTP retriever: a client of the Elasticsearch `_search` API, the subset DRAGIN
//! uses (a `match` query on one text field, `size`, `_source`), so a real Elasticsearch
//! or OpenSearch cluster can serve a large corpus; [`super::search_server`] serves a
//! tantivy index through the same API.
//!
//! Requests time out; connection failures, timeouts and 5xx answers are retried with
//! exponential backoff; a 4xx answer or a response without `hits.hits` fails at once.

use std::time::Duration;

use serde_json::{json, Value};

use crate::rag::retriever::{Hit, Retriever};
use crate::{Error, Result};

/// Where and how to search.
#[derive(Debug, Clone)]
pub struct HttpRetriever {
    client: reqwest::blocking::Client,
    /// `http://host:port` of the service.
    pub url: String,
    /// The index name in the path (`/{index}/_search`).
    pub index: String,
    /// The field holding passage text (DRAGIN's Wikipedia index: `txt`).
    pub text_field: String,
    /// Attempts after the first.
    pub retries: u32,
    /// Wait before the first retry, doubled for each next one.
    pub backoff: Duration,
}

impl HttpRetriever {
    /// A client of `url` (e.g. `http://127.0.0.1:9200`) for `index`, with a per-request
    /// `timeout`.
    pub fn new(url: &str, index: &str, timeout: Duration) -> Result<Self> {
        let client = reqwest::blocking::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| Error::invalid("retriever", e.to_string()))?;
        Ok(Self {
            client,
            url: url.trim_end_matches('/').to_string(),
            index: index.to_string(),
            text_field: "txt".into(),
            retries: 2,
            backoff: Duration::from_millis(200),
        })
    }

    fn failed(&self, why: impl std::fmt::Display) -> Error {
        Error::invalid(
            "retriever",
            format!("{}/{}/_search: {why}", self.url, self.index),
        )
    }

    /// One attempt: `Ok(Err)` for failures worth retrying.
    fn attempt(&self, body: &Value) -> Result<std::result::Result<Value, Error>> {
        let url = format!("{}/{}/_search", self.url, self.index);
        let resp = match self.client.post(&url).json(body).send() {
            Ok(r) => r,
            Err(e) if e.is_connect() => {
                return Ok(Err(self.failed(format!("cannot connect ({e})"))))
            }
            Err(e) if e.is_timeout() => return Ok(Err(self.failed("timed out"))),
            Err(e) => return Ok(Err(self.failed(e))),
        };
        let status = resp.status();
        let text = resp.text().unwrap_or_default();
        if status.is_server_error() {
            return Ok(Err(self.failed(format!("{status}: {text}"))));
        }
        if !status.is_success() {
            return Err(self.failed(format!("{status}: {text}")));
        }
        serde_json::from_str(&text)
            .map(Ok)
            .map_err(|e| self.failed(format!("malformed response ({e})")))
    }
}

impl Retriever for HttpRetriever {
    fn search(&self, query: &str, k: usize) -> Result<Vec<Hit>> {
        let body = json!({
            "query": {"match": {self.text_field.as_str(): query}},
            "size": k,
            "_source": ["title", self.text_field.as_str()],
        });
        let mut wait = self.backoff;
        let mut attempt = 0;
        let value = loop {
            match self.attempt(&body)? {
                Ok(v) => break v,
                Err(e) if attempt >= self.retries => return Err(e),
                Err(_) => {
                    std::thread::sleep(wait);
                    wait *= 2;
                    attempt += 1;
                }
            }
        };
        let hits = value["hits"]["hits"]
            .as_array()
            .ok_or_else(|| self.failed("malformed response (no hits.hits)"))?;
        hits.iter()
            .map(|h| {
                let source = &h["_source"];
                let text = source[self.text_field.as_str()].as_str().ok_or_else(|| {
                    self.failed(format!("a hit without _source.{}", self.text_field))
                })?;
                Ok(Hit {
                    id: match &h["_id"] {
                        Value::String(s) => s.clone(),
                        v => v.to_string(),
                    },
                    title: source["title"].as_str().unwrap_or_default().to_string(),
                    text: text.to_string(),
                    score: h["_score"].as_f64().unwrap_or(0.0) as f32,
                })
            })
            .collect()
    }
}
