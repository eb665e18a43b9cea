//! `headwise serve` as a user meets it: the real binary on loopback with the real model,
//! talked to by the official `openai` Python client, by reqwest, by 32 concurrent
//! streams, by bad input, by a client that goes away and by SIGTERM.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use reqwest::blocking::{Client, Response};
use serde_json::{json, Value};

const KEY: &str = "sk-test-key";

/// A `headwise serve` child process, killed when dropped.
struct Server {
    spawned: common::server::Spawned,
    _dir: TempDir,
}

/// A scratch folder, removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl std::ops::Deref for Server {
    type Target = common::server::Spawned;
    fn deref(&self) -> &Self::Target {
        &self.spawned
    }
}

impl std::ops::DerefMut for Server {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.spawned
    }
}

impl Server {
    /// Start the binary with `config` (TOML) on a free port; wait until it listens.
    fn start(name: &str, config: &str) -> Server {
        let dir =
            std::env::temp_dir().join(format!("headwise-serve-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("serve.toml");
        std::fs::write(&cfg, config).unwrap();
        Server {
            spawned: common::server::Spawned::start(common::server::serve_command(&cfg)),
            _dir: TempDir(dir),
        }
    }

    /// `GET /metrics` as (name with labels, value) pairs.
    fn metrics(&self) -> Vec<(String, f64)> {
        let text = client()
            .get(self.url("/metrics"))
            .bearer_auth(KEY)
            .send()
            .unwrap()
            .text()
            .unwrap();
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }

    fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .into_iter()
            .filter(|(k, _)| k == name || k.starts_with(&format!("{name}{{")))
            .map(|(_, v)| v)
            .sum()
    }

    /// Wait up to `secs` for `cond` over the metrics.
    fn wait_metrics(&self, secs: u64, cond: impl Fn(&Server) -> bool) -> bool {
        let end = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < end {
            if cond(self) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

fn client() -> Client {
    Client::builder()
        // A hang guard for each request, several times the slowest measured (the 32
        // concurrent streams), not a speed test.
        .timeout(Duration::from_secs(600))
        .build()
        .unwrap()
}

fn config(extra: &str) -> String {
    format!("api_keys = [\"{KEY}\"]\n{extra}\n[policies]\nstatic-locos = \"policies/static-locos.toml\"\n")
}

fn chat_body(content: &str, max_tokens: usize, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": true},
        "headwise": {"ignore_eos": true},
    })
}

fn post(server: &Server, path: &str, body: &Value) -> Response {
    client()
        .post(server.url(path))
        .bearer_auth(KEY)
        .json(body)
        .send()
        .unwrap()
}

/// The JSON payloads of an SSE response, up to `[DONE]` (true when it came).
fn sse_events(resp: Response) -> (Vec<Value>, bool) {
    sse_events_from(BufReader::new(resp))
}

/// [`sse_events`] from what is left of a reader.
fn sse_events_from(reader: impl BufRead) -> (Vec<Value>, bool) {
    let mut events = Vec::new();
    for line in reader.lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return (events, true);
        }
        events.push(serde_json::from_str(data).unwrap());
    }
    (events, false)
}

/// Text, finish reason and usage of a streamed chat.
fn streamed(events: &[Value]) -> (String, Option<String>, Option<Value>) {
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    for e in events {
        if let Some(c) = e["choices"].get(0) {
            text.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
        if !e["usage"].is_null() {
            usage = Some(e["usage"].clone());
        }
    }
    (text, finish, usage)
}

/// The `openai` client version `.ci/run` installs.
const OPENAI: &str = "openai==3.57.0";

/// A Python that can import `openai`: `$HEADWISE_PYTHON`, else the virtual environment
/// `$HEADWISE_VENV` (default `~/.cache/headwise-venv`, where `.ci/run` puts it), created
/// with pip when missing, as the models are fetched.
fn python() -> String {
    let imports = |py: &str| {
        Command::new(py)
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if let Ok(py) = std::env::var("HEADWISE_PYTHON") {
        assert!(imports(&py), "HEADWISE_PYTHON={py} cannot import `openai`");
        return py;
    }
    let venv = std::env::var("HEADWISE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache/headwise-venv")
        });
    let py = venv.join("bin/python").to_string_lossy().into_owned();
    if !imports(&py) {
        let ok = Command::new("python3")
            .arg("-m")
            .arg("venv")
            .arg(&venv)
            .status()
            .is_ok_and(|s| s.success())
            && Command::new(venv.join("bin/pip"))
                .args(["install", "--quiet", OPENAI])
                .status()
                .is_ok_and(|s| s.success());
        assert!(
            ok && imports(&py),
            "could not install {OPENAI} into {}",
            venv.display()
        );
    }
    py
}

#[test]
fn official_openai_client_chats_streams_and_lists_models() {
    let py = python();
    let server = Server::start("openai", &config(""));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_client.py");
    let out = Command::new(py)
        .arg(script)
        .arg(server.url("/v1"))
        .arg(KEY)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(seen["models"], json!(["SmolLM2-135M-Instruct.Q4_1"]));
    assert!(!seen["chat_text"].as_str().unwrap().is_empty(), "{seen}");
    let n = seen["chat_completion_tokens"].as_u64().unwrap();
    assert!((1..=8).contains(&n), "{seen}");
    assert_eq!(seen["chat_finish"], if n == 8 { "length" } else { "stop" });
    assert!(seen["chat_kv_bytes"].as_u64().unwrap() > 0, "{seen}");
    assert!(!seen["stream_text"].as_str().unwrap().is_empty(), "{seen}");
    assert!(
        seen["stream_completion_tokens"].as_u64().unwrap() >= 1,
        "{seen}"
    );
    assert_eq!(seen["stream_policy"], "static-locos");
    assert_eq!(seen["bad_policy"]["status"], 400);
    assert!(seen["bad_policy"]["message"]
        .as_str()
        .unwrap()
        .contains("static-locos"));
}

#[test]
fn reqwest_client_chats_streams_and_lists_models() {
    let server = Server::start("reqwest", &config(""));
    let models: Value = client()
        .get(server.url("/v1/models"))
        .bearer_auth(KEY)
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");

    // Greedy, whole and streamed: the same text and the same token count.
    let body = chat_body("Name three colours.", 12, false);
    let whole: Value = post(&server, "/v1/chat/completions", &body).json().unwrap();
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["usage"]["completion_tokens"], 12);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    let resp = post(
        &server,
        "/v1/chat/completions",
        &chat_body("Name three colours.", 12, true),
    );
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let (events, done) = sse_events(resp);
    assert!(done);
    let (text, finish, usage) = streamed(&events);
    assert_eq!(
        text,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(finish.as_deref(), Some("length"));
    assert_eq!(usage.unwrap()["completion_tokens"], 12);

    // A stop string cuts the text before it.
    let cut = &text[text.len() / 2..];
    let stop = cut.chars().take(3).collect::<String>();
    let mut body = chat_body("Name three colours.", 12, false);
    body["stop"] = json!([stop]);
    let stopped: Value = post(&server, "/v1/chat/completions", &body).json().unwrap();
    let got = stopped["choices"][0]["message"]["content"]
        .as_str()
        .unwrap();
    assert_eq!(got, &text[..text.find(&stop).unwrap()]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    // Log-probabilities: the greedy token is the likeliest alternative.
    let mut body = chat_body("Name three colours.", 4, false);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let lp: Value = post(&server, "/v1/chat/completions", &body).json().unwrap();
    let content = lp["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for t in content {
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], t["token"]);
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
    }

    // The legacy completion endpoint, with a policy chosen per request.
    let body = json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                      "headwise": {"policy": "static-locos", "ignore_eos": true}});
    let c: Value = post(&server, "/v1/completions", &body).json().unwrap();
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["usage"]["completion_tokens"], 3);
    assert_eq!(c["usage"]["headwise"]["policy"], "static-locos");
}

#[test]
fn thirty_two_streams_over_four_slots_finish_or_get_429() {
    let server = Server::start("load", &config("max_concurrency = 4\nmax_queue = 4"));
    let idle_kv = server.metric("headwise_kv_resident_bytes");
    let n = 32;
    let tokens = 8;
    let barrier = Arc::new(Barrier::new(n));
    let url = server.url("/v1/chat/completions");
    let started = Instant::now();
    let outcomes: Vec<(u16, Option<u64>, bool)> = (0..n)
        .map(|i| {
            let (barrier, url) = (Arc::clone(&barrier), url.clone());
            std::thread::spawn(move || {
                let http = client();
                let body = chat_body(
                    &format!("Request {i}: write a short poem about the sea."),
                    tokens,
                    true,
                );
                barrier.wait();
                let resp = http.post(url).bearer_auth(KEY).json(&body).send().unwrap();
                let status = resp.status().as_u16();
                if status != 200 {
                    let retry = resp.headers().contains_key("retry-after");
                    return (status, None, retry);
                }
                let (events, done) = sse_events(resp);
                let (_, _, usage) = streamed(&events);
                let count = usage.and_then(|u| u["completion_tokens"].as_u64());
                (status, count, done)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    eprintln!("{n} streams answered in {:.1?}", started.elapsed());
    let ok = outcomes.iter().filter(|o| o.0 == 200).count();
    let limited = outcomes.iter().filter(|o| o.0 == 429).count();
    assert_eq!(ok + limited, n, "{outcomes:?}");
    assert!(ok >= 4 && limited >= 1, "{ok} finished, {limited} refused");
    eprintln!(
        "load: {ok} of {n} streams finished, {limited} got 429; server peak RSS {:.0} MiB",
        server.peak_rss() as f64 / (1u64 << 20) as f64
    );
    for o in &outcomes {
        match o.0 {
            200 => assert_eq!((o.1, o.2), (Some(tokens as u64), true), "{o:?}"),
            _ => assert!(o.2, "429 without Retry-After"),
        }
    }
    assert!(server.wait_metrics(10, |s| s.metric("headwise_active_sequences") == 0.0));
    assert_eq!(server.metric("headwise_kv_resident_bytes"), idle_kv);
    assert_eq!(server.metric("headwise_queue_depth"), 0.0);
    assert_eq!(
        server.metric("headwise_requests_total{endpoint=\"/v1/chat/completions\",status=\"429\"}"),
        limited as f64
    );
}

/// Status and error object of a raw request.
fn error_of(resp: Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let body: Value = resp.json().unwrap();
    let e = body["error"].clone();
    assert!(e["message"].is_string() && e["type"].is_string(), "{body}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{body}"
    );
    (status, e)
}

#[test]
fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let server = Server::start(
        "bad",
        &config("max_tokens_limit = 64\nmax_body_bytes = 100000"),
    );
    let http = client();
    let url = server.url("/v1/chat/completions");
    let raw = |body: &str| {
        http.post(&url)
            .bearer_auth(KEY)
            .body(body.to_string())
            .send()
            .unwrap()
    };
    let (s, e) = error_of(raw("{\"messages\": [1,"));
    assert_eq!((s, e["code"].as_str()), (400, Some("invalid_json")));
    let (s, e) = error_of(raw(
        r#"{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}"#,
    ));
    assert_eq!((s, e["code"].as_str()), (404, Some("model_not_found")));
    let (s, e) = error_of(raw(r#"{"max_tokens": 4}"#));
    assert_eq!((s, e["param"].as_str()), (400, Some("messages")));
    let long = "lorem ipsum ".repeat(5000);
    let (s, e) = error_of(post(
        &server,
        "/v1/chat/completions",
        &chat_body(&long, 8, false),
    ));
    assert_eq!(
        (s, e["code"].as_str()),
        (400, Some("context_length_exceeded"))
    );
    let (s, e) = error_of(post(
        &server,
        "/v1/chat/completions",
        &chat_body("hi", 65, false),
    ));
    assert_eq!((s, e["param"].as_str()), (400, Some("max_tokens")));
    let mut body = chat_body("hi", 4, false);
    body["headwise"] = json!({"policy": "everything"});
    let (s, e) = error_of(post(&server, "/v1/chat/completions", &body));
    assert_eq!((s, e["param"].as_str()), (400, Some("headwise.policy")));
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("full, static-locos"),
        "{e}"
    );

    // A body of 10 MB, and a body cut short.
    // The server answers 413 as soon as the limit is passed and closes the connection,
    // so the client may see the answer or a broken pipe while still sending; either
    // way the metrics record the 413.
    let big = http
        .post(&url)
        .bearer_auth(KEY)
        .body("x".repeat(10 << 20))
        .send();
    if let Ok(resp) = big {
        let (s, e) = error_of(resp);
        assert_eq!((s, e["code"].as_str()), (413, Some("body_too_large")));
    }
    let refused = "headwise_requests_total{endpoint=\"/v1/chat/completions\",status=\"413\"}";
    assert_eq!(server.metric(refused), 1.0);
    let mut tcp = TcpStream::connect(server.addr()).unwrap();
    write!(
        tcp,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Length: 500\r\n\r\n{{\"messages\": ["
    )
    .unwrap();
    tcp.shutdown(std::net::Shutdown::Write).unwrap();
    let mut reply = String::new();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = tcp.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");

    // Keys: missing, wrong, right.
    let resp = http.get(server.url("/v1/models")).send().unwrap();
    let (s, e) = error_of(resp);
    assert_eq!((s, e["code"].as_str()), (401, Some("invalid_api_key")));
    let resp = http
        .get(server.url("/v1/models"))
        .bearer_auth("sk-test-kez")
        .send()
        .unwrap();
    assert_eq!(resp.status(), 401);
    let resp = http.get(server.url("/metrics")).send().unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(
        http.get(server.url("/health")).send().unwrap().status(),
        200
    );

    let ok: Value = post(&server, "/v1/chat/completions", &chat_body("hi", 2, false))
        .json()
        .unwrap();
    assert_eq!(ok["usage"]["completion_tokens"], 2);
}

#[test]
fn a_dropped_stream_frees_its_sequence_and_a_slow_request_times_out() {
    let server = Server::start("drop", &config("request_timeout_secs = 3"));
    let idle_kv = server.metric("headwise_kv_resident_bytes");
    let resp = post(
        &server,
        "/v1/chat/completions",
        &chat_body("Tell me a long story.", 2000, true),
    );
    let mut lines = BufReader::new(resp).lines();
    let mut chunks = 0;
    while chunks < 4 {
        if lines.next().unwrap().unwrap().starts_with("data: ") {
            chunks += 1;
        }
    }
    assert_eq!(server.metric("headwise_active_sequences"), 1.0);
    assert!(server.metric("headwise_kv_resident_bytes") > idle_kv);
    drop(lines);
    let freed = server.wait_metrics(30, |s| {
        s.metric("headwise_active_sequences") == 0.0
            && s.metric("headwise_cancelled_total{reason=\"disconnect\"}") == 1.0
    });
    assert!(freed, "{:?}", server.metrics());
    assert_eq!(server.metric("headwise_kv_resident_bytes"), idle_kv);

    // Without the 3 s timeout this would run to 2,000 tokens and answer 200.
    let (s, e) = error_of(post(
        &server,
        "/v1/chat/completions",
        &chat_body("Tell me a long story.", 2000, false),
    ));
    assert_eq!((s, e["code"].as_str()), (504, Some("timeout")));
    assert_eq!(
        server.metric("headwise_cancelled_total{reason=\"timeout\"}"),
        1.0
    );
}

#[test]
fn sigterm_lets_short_requests_finish_and_cancels_long_ones() {
    // A grace long enough for 40 tokens on a loaded machine (4 tokens/s), far too short
    // for 2,000.
    let mut server = Server::start("term", &config("shutdown_grace_secs = 10"));
    // Response headers come before the first token, so both requests are admitted here.
    let long = post(
        &server,
        "/v1/chat/completions",
        &chat_body("Tell me a long story.", 2000, true),
    );
    let long = std::thread::spawn(move || sse_events(long));
    assert!(server.wait_metrics(30, |s| s.metric("headwise_active_sequences") == 1.0));
    // The short request is mid-stream when the signal comes.
    let short = post(
        &server,
        "/v1/chat/completions",
        &chat_body("Say hi.", 40, true),
    );
    let mut reader = BufReader::new(short);
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    assert!(first.starts_with("data: "), "{first}");
    let short = std::thread::spawn(move || sse_events_from(reader));
    server.terminate();
    let (events, done) = short.join().unwrap();
    assert!(done, "{events:?}");
    assert_eq!(streamed(&events).2.unwrap()["completion_tokens"], 40);
    let (events, done) = long.join().unwrap();
    assert!(!done);
    assert_eq!(events.last().unwrap()["error"]["code"], "shutting_down");
    // A hang guard, not a speed test: 12x the 10 s grace.
    let status = server.exit_within(Duration::from_secs(120));
    assert!(
        status.success(),
        "{status:?}: {:?}",
        server.log.lock().unwrap()
    );
    assert!(TcpStream::connect(server.addr()).is_err());
}

#[test]
fn rag_requests_retrieve_and_are_counted() {
    let dir = std::env::temp_dir().join(format!("headwise-rag-corpus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let index = common::server::build_index(
        &dir,
        "{\"title\": \"Lisbon\", \"text\": \"Lisbon, the capital of Portugal, lies on the Tagus river.\"}\n\
         {\"title\": \"Oslo\", \"text\": \"Oslo is the capital of Norway.\"}\n",
    );
    let stopwords = dir.join("stop.txt");
    std::fs::write(&stopwords, "the\nof\nwhich\n").unwrap();
    let server = Server::start(
        "rag",
        &config(&format!(
            "rag_index = \"{}\"\nrag_stopwords = \"{}\"",
            index.display(),
            stopwords.display()
        )),
    );
    let mut body = chat_body(
        "Which river flows through the capital of Portugal?",
        12,
        false,
    );
    body["headwise"] = json!({"rag": "once"});
    let a: Value = post(&server, "/v1/chat/completions", &body).json().unwrap();
    assert_eq!(a["usage"]["headwise"]["retrievals"], 1, "{a}");
    // The prompt held the question and the three passages retrieved for it.
    let prompt = a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 30, "{a}");
    assert_eq!(
        a["usage"]["total_tokens"].as_u64(),
        Some(prompt + a["usage"]["completion_tokens"].as_u64().unwrap())
    );
    assert!(
        !a["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty(),
        "{a}"
    );
    assert_eq!(server.metric("headwise_retrievals_total"), 1.0);
    // Streamed, the whole answer comes as one chunk before the finish.
    body["stream"] = json!(true);
    let (events, done) = sse_events(post(&server, "/v1/chat/completions", &body));
    assert!(done);
    assert!(!streamed(&events).0.is_empty());
    body["stream"] = json!(false);
    body["headwise"] = json!({"rag": "sometimes"});
    let (s, e) = error_of(post(&server, "/v1/chat/completions", &body));
    assert_eq!((s, e["param"].as_str()), (400, Some("headwise.rag")));
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("every_n, once, rind"),
        "{e}"
    );
    body["headwise"] = json!({"rag": "once", "policy": "static-locos"});
    let (s, _) = error_of(post(&server, "/v1/chat/completions", &body));
    assert_eq!(s, 400);
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_shared_document_is_prefilled_once_and_a_request_beyond_the_kv_budget_is_a_400() {
    // A budget of 64 MiB: room for a few full requests of a few hundred tokens, not for
    // one of the whole context.
    let server = Server::start(
        "prefix",
        &config("kv_budget_mib = 64\nprefix_cache_mib = 128"),
    );
    assert_eq!(
        server.metric("headwise_kv_budget_bytes"),
        64.0 * 1024.0 * 1024.0
    );
    let doc = "Field notes: the heron waits at the river bank at dawn. ".repeat(30);
    let ask = |q: &str| -> Value {
        let body = chat_body(&format!("{doc}\nQuestion: {q}"), 6, false);
        post(&server, "/v1/chat/completions", &body).json().unwrap()
    };
    let first = ask("Where does the heron wait?");
    let second = ask("When does the heron wait?");
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached(&first), Some(0), "{first}");
    let hit = cached(&second).unwrap();
    assert!(hit >= 256 && hit % 256 == 0, "{second}");
    assert_eq!(
        second["usage"]["headwise"]["cached_prompt_tokens"].as_u64(),
        Some(hit)
    );
    assert_eq!(server.metric("headwise_prefix_hits"), 1.0);
    assert!(server.metric("headwise_prefix_bytes") > 0.0);
    // The hit read the document's rows in place: part of what it held was shared.
    let usage = &second["usage"]["headwise"];
    let shared = usage["kv_shared_bytes"].as_u64().unwrap();
    let held = usage["kv_bytes"].as_u64().unwrap() + usage["kv_cold_bytes"].as_u64().unwrap();
    assert!(shared > 0 && shared < held, "{second}");
    // Alone beyond the budget: a 400 that names both numbers.
    let (s, e) = error_of(post(
        &server,
        "/v1/chat/completions",
        &chat_body(&"word ".repeat(3000), 2000, false),
    ));
    assert_eq!(s, 400, "{e}");
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("kv_budget") && msg.contains("67108864"),
        "{msg}"
    );
    assert_eq!(server.metric("headwise_kv_reserved_bytes"), 0.0);
}

#[test]
fn explain_points_each_token_back_into_the_prompt() {
    let server = Server::start("explain", &config(""));
    let notes: String = (1..=40)
        .map(|i| format!("Note {i}: a traveller found an old clock in Oslo on day {i}.\n"))
        .collect();
    let content = format!("{notes}\nWhich city is named in note 7? Answer with the city.");
    let mut body = chat_body(&content, 6, true);
    body["headwise"]["explain"] = json!({"heads": 2, "positions": 3, "context": 2});
    let (events, done) = sse_events(post(&server, "/v1/chat/completions", &body));
    assert!(done, "{events:?}");
    let (_, _, usage) = streamed(&events);
    let usage = usage.unwrap();
    let explained: Vec<Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["headwise"]["explain"].as_array().cloned())
        .flatten()
        .collect();
    // One explanation per generated token, streamed with the tokens.
    assert_eq!(
        explained.len() as u64,
        usage["completion_tokens"].as_u64().unwrap()
    );
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    for e in &explained {
        let entropy = e["entropy"].as_f64().unwrap();
        assert!(entropy.is_finite() && entropy >= 0.0, "{e}");
        let heads = e["heads"].as_array().unwrap();
        assert_eq!(heads.len(), 2, "{e}");
        for h in heads {
            let reads = h["reads"].as_array().unwrap();
            assert_eq!(reads.len(), 3, "{e}");
            let weights: Vec<f64> = reads
                .iter()
                .map(|r| r["weight"].as_f64().unwrap())
                .collect();
            assert!(weights.windows(2).all(|w| w[0] >= w[1]), "{e}");
            for r in reads {
                assert!(r["position"].as_u64().unwrap() < prompt_tokens, "{e}");
                assert!((0.0..=1.0).contains(&r["weight"].as_f64().unwrap()), "{e}");
                assert!(!r["text"].as_str().unwrap().is_empty(), "{e}");
            }
        }
        // `full` runs no probe.
        assert!(e.get("probe").is_none(), "{e}");
    }
    // A whole response carries them on its choice; a policy's tokens are the same with
    // and without explain.
    let whole = |explain: bool| -> Value {
        let mut body = chat_body(&content, 6, false);
        body["headwise"]["policy"] = json!("static-locos");
        if explain {
            body["headwise"]["explain"] = json!(true);
        }
        post(&server, "/v1/chat/completions", &body).json().unwrap()
    };
    let (with, without) = (whole(true), whole(false));
    let choice = &with["choices"][0];
    assert_eq!(
        choice["message"]["content"],
        without["choices"][0]["message"]["content"]
    );
    assert_eq!(choice["headwise"]["explain"].as_array().unwrap().len(), 6);
    assert_eq!(
        choice["headwise"]["explain"][0]["heads"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
    assert!(without["choices"][0].get("headwise").is_none(), "{without}");
    // Bad requests name the field.
    for (explain, param) in [
        (json!({"heads": 0}), "headwise.explain.heads"),
        (json!({"positions": 100}), "headwise.explain.positions"),
        (
            json!({"heads": 2, "depth": 1}),
            "explain: unknown field `depth`",
        ),
        (json!("yes"), "explain must be"),
    ] {
        let mut body = chat_body("hi", 2, false);
        body["headwise"]["explain"] = explain;
        let (s, e) = error_of(post(&server, "/v1/chat/completions", &body));
        assert_eq!(s, 400, "{e}");
        let named =
            e["param"].as_str() == Some(param) || e["message"].as_str().unwrap().contains(param);
        assert!(named, "{e}");
    }
}

#[test]
fn prompt_positions_run_as_rows_of_the_batched_steps_are_counted() {
    // Chunks of one position: two prompts run as rows of the batched steps, at most 32
    // positions per iteration, and `/metrics` counts every position but each prompt's
    // last (its first decode step runs it).
    let server = Server::start("rows", &config("prefill_chunk = 1\nprefill_tokens = 32"));
    let answers: Vec<Value> = std::thread::scope(|s| {
        let asks: Vec<_> = ["Name three rivers.", "Name three mountains."]
            .into_iter()
            .map(|q| {
                let server = &server;
                s.spawn(move || {
                    let content = format!("{}{q}", "Answer in a few words. ".repeat(8));
                    let body = chat_body(&content, 8, false);
                    post(server, "/v1/chat/completions", &body)
                        .json::<Value>()
                        .unwrap()
                })
            })
            .collect();
        asks.into_iter().map(|a| a.join().unwrap()).collect()
    });
    let mut rows = 0;
    for a in &answers {
        assert_eq!(a["usage"]["completion_tokens"], 8, "{a}");
        rows += a["usage"]["prompt_tokens"].as_u64().unwrap() - 1;
    }
    assert_eq!(server.metric("headwise_batch_prompt_rows"), rows as f64);
}
