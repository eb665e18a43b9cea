//! Continuous batching on the real model (SmolLM2): requests under different policies
//! that join a running batch at different times give the same tokens and text as each
//! run alone through `Runtime::generate`; a cancelled sequence leaves at once; admission
//! keeps the reserved KV under the budget (requests that continue a shared prefix
//! reserve only what they add); a request that can never fit is refused with its
//! numbers.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Duration;

use headwise::policy::{
    GenerateOutput, GenerateRequest, Policy, Prompt, Runtime, Scheduler, SchedulerConfig, Sink,
    Step,
};

/// Generous bound on any one wait (the real model on two cores).
const WAIT: Duration = Duration::from_secs(600);

enum Msg {
    Admitted(usize),
    Token(usize),
    Done(usize, Box<Result<GenerateOutput, String>>),
}

/// Sends what happens to request `id` to the test; stops after `stop_after` tokens.
struct Probe {
    id: usize,
    tx: Sender<Msg>,
    tokens: usize,
    stop_after: Option<usize>,
}

impl Probe {
    /// A probe for request `id` that never stops it.
    fn new(id: usize, tx: &Sender<Msg>) -> Box<Self> {
        Box::new(Probe {
            id,
            tx: tx.clone(),
            tokens: 0,
            stop_after: None,
        })
    }
}

impl Sink for Probe {
    fn admitted(&mut self) {
        let _ = self.tx.send(Msg::Admitted(self.id));
    }

    fn token(&mut self, _step: &Step) -> bool {
        self.tokens += 1;
        let _ = self.tx.send(Msg::Token(self.id));
        self.stop_after != Some(self.tokens)
    }

    fn done(self: Box<Self>, result: headwise::Result<GenerateOutput>) {
        let _ = self.tx.send(Msg::Done(
            self.id,
            Box::new(result.map_err(|e| e.to_string())),
        ));
    }
}

fn runtimes() -> BTreeMap<String, Runtime> {
    runtimes_with_chunk(headwise::model::DEFAULT_CHUNK)
}

/// The four policies over one model that prefills `chunk` positions per forward pass.
fn runtimes_with_chunk(chunk: usize) -> BTreeMap<String, Runtime> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let full = Runtime::builder()
        .model(common::real_model())
        .base_dir(root)
        .prefill_chunk(chunk)
        .build()
        .unwrap();
    let mut all = BTreeMap::new();
    for name in ["static-locos", "streaming", "retrieval-snapkv-q8"] {
        let path = root.join("policies").join(format!("{name}.toml"));
        let policy = Policy::load(&path, &[]).unwrap();
        all.insert(name.to_string(), full.with_policy(&policy, root).unwrap());
    }
    all.insert("full".into(), full);
    all
}

fn request(i: usize) -> GenerateRequest {
    let topics = [
        "the history of the printing press",
        "how bees make honey",
        "why the sky is blue",
        "the rules of chess",
        "a recipe for bread",
        "the water cycle",
        "the planets of the solar system",
        "how a bicycle works",
    ];
    // One long prompt (about 650 tokens), so that its prefill spans several iterations.
    let text = if i == 5 {
        format!("{}\nSummarise the notes above.", "Notes on the water cycle: evaporation, condensation, precipitation and collection repeat. ".repeat(40))
    } else {
        // Long enough (about 100 tokens) for SnapKV's observation window.
        format!(
            "{}Write two sentences about {}.",
            "You are a careful writer who answers plainly. ".repeat(10),
            topics[i]
        )
    };
    let mut r = GenerateRequest::new(Prompt::Text(text), [12, 20, 7, 16, 24, 9, 14, 18][i]);
    r.ignore_eos = i.is_multiple_of(2);
    r
}

fn policy(i: usize) -> &'static str {
    ["full", "static-locos", "streaming", "retrieval-snapkv-q8"][i % 4]
}

/// Collect until every id in `ids` is done; returns outputs and the largest number of
/// requests admitted and not yet done at any time.
fn collect(
    rx: &Receiver<Msg>,
    n: usize,
) -> (BTreeMap<usize, Result<GenerateOutput, String>>, usize) {
    let (mut done, mut live, mut most) = (BTreeMap::new(), 0usize, 0usize);
    while done.len() < n {
        match rx.recv_timeout(WAIT).expect("the scheduler stalled") {
            Msg::Admitted(_) => {
                live += 1;
                most = most.max(live);
            }
            Msg::Token(_) => {}
            Msg::Done(id, out) => {
                live = live.saturating_sub(1);
                done.insert(id, *out);
            }
        }
    }
    (done, most)
}

/// Requests `0..n`, each under [`policy`]`(i)`, run alone through `Runtime::generate`.
fn each_alone(runtimes: &BTreeMap<String, Runtime>, n: usize) -> Vec<GenerateOutput> {
    (0..n)
        .map(|i| {
            runtimes[policy(i)]
                .generate(&request(i), &mut |_| true)
                .unwrap()
        })
        .collect()
}

/// A scheduler of up to 16 sequences under `kv_budget` bytes, with a prefix cache of
/// `prefix_cache_bytes`.
fn budgeted(
    runtimes: BTreeMap<String, Runtime>,
    kv_budget: usize,
    prefix_cache_bytes: usize,
) -> Scheduler {
    let cfg = SchedulerConfig {
        max_batch: 16,
        kv_budget: Some(kv_budget),
        prefill_tokens: 256,
        prefix_cache_bytes,
    };
    Scheduler::new(runtimes, cfg).unwrap()
}

/// Whether `load` comes to nothing running and nothing reserved within [`WAIT`].
fn settles(load: &headwise::policy::Load) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let settled = || load.running.load(Relaxed) == 0 && load.reserved_bytes.load(Relaxed) == 0;
    let t0 = std::time::Instant::now();
    while !settled() && t0.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(10));
    }
    settled()
}

#[test]
fn batched_generations_equal_each_alone_and_leave_when_cancelled() {
    let runtimes = runtimes();
    let alone = each_alone(&runtimes, 8);
    let scheduler = Scheduler::new(
        runtimes.clone(),
        SchedulerConfig {
            max_batch: 8,
            kv_budget: None,
            prefill_tokens: 256,
            prefix_cache_bytes: 0,
        },
    )
    .unwrap();
    let (tx, rx) = channel();
    let sink = |id: usize, stop_after: Option<usize>| -> Box<dyn Sink> {
        Box::new(Probe {
            id,
            tx: tx.clone(),
            tokens: 0,
            stop_after,
        })
    };
    // Four now; the other four once the first tokens are out, so that they join a
    // running batch; request 8 (a copy of 0) is cancelled after three tokens.
    for i in 0..4 {
        scheduler
            .submit(policy(i), &request(i), sink(i, None))
            .unwrap();
    }
    let mut early = Vec::new();
    loop {
        let msg = rx.recv_timeout(WAIT).expect("no first token");
        let first = matches!(msg, Msg::Token(_));
        early.push(msg);
        if first {
            break;
        }
    }
    for i in 4..8 {
        scheduler
            .submit(policy(i), &request(i), sink(i, None))
            .unwrap();
    }
    scheduler
        .submit(policy(0), &request(0), sink(8, Some(3)))
        .unwrap();
    let (tx2, rx2) = channel();
    for m in early {
        tx2.send(m).unwrap();
    }
    std::thread::spawn(move || {
        while let Ok(m) = rx.recv() {
            if tx2.send(m).is_err() {
                break;
            }
        }
    });
    let (done, most) = collect(&rx2, 9);
    assert!(most >= 5, "at most {most} requests ran together");
    for (i, want) in alone.iter().enumerate() {
        let got = done[&i].as_ref().unwrap();
        assert_eq!(got.tokens, want.tokens, "request {i} ({})", policy(i));
        assert_eq!(got.text, want.text, "request {i}");
        assert_eq!(got.stats.finish, want.stats.finish, "request {i}");
        assert_eq!(got.stats.kv.end, want.stats.kv.end, "request {i}");
    }
    let cancelled = done[&8].as_ref().unwrap();
    assert_eq!(
        cancelled.stats.finish, "cancelled",
        "{:?}",
        cancelled.tokens
    );
    assert_eq!(cancelled.tokens, alone[0].tokens[..3]);
    let load = scheduler.load();
    assert!(
        settles(load),
        "the finished sequences still hold their reservation"
    );
    let steps = load.steps.load(std::sync::atomic::Ordering::Relaxed);
    let rows = load.rows.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        rows as f64 / steps as f64 > 1.5,
        "mean batch {rows} / {steps}"
    );
}

#[test]
fn admission_keeps_the_reserved_kv_under_the_budget() {
    let runtimes = runtimes();
    // A prompt longer than static-locos's rings, so that its reservation is smaller.
    let text = format!(
        "{}Count from one to ten.",
        "Numbers are words too. ".repeat(80)
    );
    let req = GenerateRequest::new(Prompt::Text(text), 8);
    let probe = Scheduler::new(runtimes.clone(), SchedulerConfig::default()).unwrap();
    let prompt = runtimes["full"].encode(&req.prompt).unwrap().len();
    let full = probe.reservation("full", prompt, 8).unwrap();
    let locos = probe.reservation("static-locos", prompt, 8).unwrap();
    assert!(locos < full, "static-locos reserves {locos}, full {full}");
    drop(probe);
    // Room for two full sequences: never more than two run at once, all finish.
    let budget = 2 * full + 1;
    let scheduler = budgeted(runtimes, budget, 0);
    let (tx, rx) = channel();
    for id in 0..5 {
        let sink = Probe::new(id, &tx);
        scheduler.submit("full", &req, sink).unwrap();
    }
    let (done, most) = collect(&rx, 5);
    assert_eq!(most, 2, "{most} full sequences ran in a budget for two");
    assert!(done.values().all(|d| d.as_ref().unwrap().tokens.len() == 8));
    // A request that alone needs more than the whole budget is refused with its numbers.
    let long = GenerateRequest::new(Prompt::Text("word ".repeat(1500)), 64);
    let sink = Probe::new(9, &tx);
    let err = scheduler
        .submit("full", &long, sink)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("kv_budget") && err.contains(&budget.to_string()),
        "{err}"
    );
}

#[test]
fn a_shared_prefix_is_prefilled_once_and_continued_to_the_same_tokens() {
    let runtimes = runtimes();
    let doc = "Field notes: the heron waits at the river bank at dawn, the otter fishes \
               under the bridge, and the kingfisher nests in the clay wall. "
        .repeat(18);
    let ask = |q: &str, policy: &str| {
        let mut r =
            GenerateRequest::new(Prompt::Text(format!("{doc}\nQuestion: {q}\nAnswer:")), 10);
        r.ignore_eos = true;
        (policy.to_string(), r)
    };
    let requests = [
        ask("Where does the heron wait?", "full"),
        ask("What does the otter do?", "full"),
        ask("Where does the kingfisher nest?", "full"),
        ask("Where does the heron wait?", "static-locos"),
        ask("What does the otter do?", "static-locos"),
    ];
    let chunk = runtimes["full"].model().model.chunk();
    let prompt_len = runtimes["full"]
        .encode(&requests[0].1.prompt)
        .unwrap()
        .len();
    let shared = (prompt_len - 1) / chunk * chunk;
    assert!(
        shared >= chunk,
        "the document ({prompt_len} tokens) spans no whole chunk"
    );
    let alone: Vec<GenerateOutput> = requests
        .iter()
        .map(|(p, r)| runtimes[p.as_str()].generate(r, &mut |_| true).unwrap())
        .collect();
    let scheduler = Scheduler::new(
        runtimes,
        SchedulerConfig {
            max_batch: 4,
            kv_budget: None,
            prefill_tokens: 256,
            prefix_cache_bytes: 1 << 30,
        },
    )
    .unwrap();
    let (tx, rx) = channel();
    // One at a time, so that each later request finds the prefix of the ones before.
    let mut got = Vec::new();
    for (id, (policy, request)) in requests.iter().enumerate() {
        let sink = Probe::new(id, &tx);
        scheduler.submit(policy, request, sink).unwrap();
        let (done, _) = collect(&rx, 1);
        got.push(done.into_values().next().unwrap().unwrap());
    }
    for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
        assert_eq!(g.tokens, a.tokens, "request {i}");
        assert_eq!(g.text, a.text, "request {i}");
        assert_eq!(g.stats.kv.end, a.stats.kv.end, "request {i}");
    }
    let cached: Vec<usize> = got.iter().map(|g| g.stats.cached_prompt_tokens).collect();
    assert_eq!(cached, [0, shared, shared, 0, shared]);
    let load = scheduler.load();
    assert_eq!(
        load.prefix_hits.load(std::sync::atomic::Ordering::Relaxed),
        3
    );
    assert!(load.prefix_bytes.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

#[test]
fn requests_that_continue_a_shared_prefix_read_it_in_place_and_reserve_only_what_they_add() {
    let runtimes = runtimes();
    let doc = "Station log: the north gauge reads four metres, the east gauge two, the \
               south gauge is frozen and the west gauge was moved to the lock. "
        .repeat(20);
    let ask = |q: &str| {
        let mut r = GenerateRequest::new(Prompt::Text(format!("{doc}\nQuestion: {q}\nAnswer:")), 8);
        r.ignore_eos = true;
        r
    };
    let questions = [
        "What does the north gauge read?",
        "What does the east gauge read?",
        "Which gauge is frozen?",
        "Where was the west gauge moved?",
        "Which gauge reads two metres?",
    ];
    let requests: Vec<GenerateRequest> = questions.iter().map(|q| ask(q)).collect();
    let alone: Vec<GenerateOutput> = requests
        .iter()
        .map(|r| runtimes["full"].generate(r, &mut |_| true).unwrap())
        .collect();
    let probe = Scheduler::new(runtimes.clone(), SchedulerConfig::default()).unwrap();
    let prompt = runtimes["full"].encode(&requests[0].prompt).unwrap().len();
    let full = probe.reservation("full", prompt, 8).unwrap();
    drop(probe);
    // Room for two whole sequences of the document: the ones that continue it need far
    // less, so all four questions after the first run at once.
    let budget = 2 * full + 1;
    let scheduler = budgeted(runtimes, budget, 1 << 30);
    let (tx, rx) = channel();
    let submit = |id: usize| {
        let sink = Probe::new(id, &tx);
        scheduler.submit("full", &requests[id], sink).unwrap();
    };
    submit(0);
    let (mut done, _) = collect(&rx, 1);
    for id in 1..5 {
        submit(id);
    }
    let (rest, most) = collect(&rx, 4);
    assert_eq!(
        most, 4,
        "{most} of 4 prefix hits ran at once in a budget for two copies"
    );
    done.extend(rest);
    for (i, a) in alone.iter().enumerate() {
        let got = done[&i].as_ref().unwrap();
        assert_eq!(got.tokens, a.tokens, "request {i}");
        assert!(
            (i == 0) == (got.stats.cached_prompt_tokens == 0),
            "request {i}: {} prompt tokens from the prefix",
            got.stats.cached_prompt_tokens
        );
    }
    let load = scheduler.load();
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(load.prefix_hits.load(Relaxed), 4);
    assert!(settles(load));
    // Nothing runs: the prefix cache alone holds the document's rows (the bytes in use
    // are stored just after the reservations, so wait for them too).
    let t0 = std::time::Instant::now();
    while load.used_bytes.load(Relaxed) != 0 && t0.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(load.used_bytes.load(Relaxed), 0);
    assert!(load.prefix_bytes.load(Relaxed) > 0);
}

/// Keeps every token's explanation.
struct Explained {
    tx: Sender<(usize, Vec<headwise::policy::TokenExplain>, Vec<u32>)>,
    id: usize,
    explain: Vec<headwise::policy::TokenExplain>,
}

impl Sink for Explained {
    fn token(&mut self, step: &Step) -> bool {
        self.explain
            .push(step.explain.cloned().expect("an explained step"));
        true
    }

    fn done(self: Box<Self>, result: headwise::Result<GenerateOutput>) {
        let tokens = result.unwrap().tokens;
        let _ = self.tx.send((self.id, self.explain, tokens));
    }
}

#[test]
fn explained_tokens_are_the_same_in_a_batch_and_the_retrieval_heads_read_the_needle() {
    use headwise::policy::ranking::Ranking;
    use headwise::policy::ExplainConfig;
    let runtimes = runtimes();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let name = &runtimes["full"].model_id().name;
    let ranking =
        Ranking::load(&root.join(format!("policies/rankings/{name}/locos-niah.json"))).unwrap();
    let cfg = ExplainConfig {
        heads: ranking.ordered()[..4].to_vec(),
        positions: 2,
        context: 2,
        probe_heads: 4,
    };
    let notes = headwise::synthetic::synthetic_notes(60, Some(30));
    let question = "What is the secret number of the archive? Answer with the number.";
    let mut req = GenerateRequest::new(
        Prompt::Chat(vec![headwise::model::text::chat::ChatMessage {
            role: "user".into(),
            content: format!("{notes}\n{question}"),
        }]),
        16,
    );
    req.explain = Some(cfg);
    let plain = GenerateRequest {
        explain: None,
        ..req.clone()
    };
    let policies = ["full", "static-locos"];
    // Alone: explaining changes no token.
    let mut alone = Vec::new();
    for p in policies {
        let mut explain = Vec::new();
        let out = runtimes[p]
            .generate(&req, &mut |s| {
                explain.push(s.explain.cloned().unwrap());
                true
            })
            .unwrap();
        let unexplained = runtimes[p].generate(&plain, &mut |_| true).unwrap();
        assert_eq!(out.tokens, unexplained.tokens, "{p}");
        assert_eq!(explain.len(), out.tokens.len());
        alone.push((explain, out.tokens));
    }
    // Batched together with two unexplained requests: the same tokens and explanations.
    let scheduler = Scheduler::new(runtimes.clone(), SchedulerConfig::default()).unwrap();
    let (tx, rx) = channel();
    for (id, p) in policies.iter().enumerate() {
        let sink = Box::new(Explained {
            tx: tx.clone(),
            id,
            explain: Vec::new(),
        });
        scheduler.submit(p, &req, sink).unwrap();
        let (tx_other, _rx_other) = channel();
        let other = Probe::new(10 + id, &tx_other);
        scheduler.submit(p, &request(id), other).unwrap();
    }
    for _ in policies {
        let (id, explain, tokens) = rx.recv_timeout(WAIT).expect("no explained generation");
        assert_eq!(
            (&explain, &tokens),
            (&alone[id].0, &alone[id].1),
            "{}",
            policies[id]
        );
    }
    // The answer's first digit: some top retrieval head reads the needle most (its text,
    // two tokens either side; digits are tokens of their own, and "481" is nowhere else
    // in the notes).
    let (explain, tokens) = &alone[0];
    let lm = runtimes["full"].model();
    let text = lm.decode(tokens).unwrap();
    assert!(text.contains("4817"), "{text}");
    let first_digit = tokens
        .iter()
        .position(|&t| lm.decode(&[t]).unwrap().contains('4'))
        .unwrap();
    let reads: Vec<&str> = explain[first_digit]
        .heads
        .iter()
        .map(|h| h.reads[0].text.as_str())
        .collect();
    assert!(
        reads
            .iter()
            .any(|t| t.contains("481") || t.contains("secret") || t.contains("archive")),
        "{reads:?}"
    );
}

#[test]
fn a_stream_gives_the_tokens_of_a_run_alone_and_dropping_it_cancels() {
    use futures_util::StreamExt;
    use headwise::policy::StreamEvent;
    let runtimes = runtimes();
    let alone = runtimes["static-locos"]
        .generate(&request(1), &mut |_| true)
        .unwrap();
    let scheduler = Scheduler::new(runtimes, SchedulerConfig::default()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut kept = scheduler.stream("static-locos", &request(1)).unwrap();
        // 200 tokens unless cancelled.
        let mut long = request(2);
        long.max_tokens = 200;
        let mut dropped = scheduler.stream("full", &long).unwrap();
        // The dropped one: admitted, two tokens, then the stream goes away.
        let mut seen = 0;
        while seen < 2 {
            match tokio::time::timeout(WAIT, dropped.next()).await.unwrap() {
                Some(StreamEvent::Token { .. }) => seen += 1,
                Some(StreamEvent::Admitted) => {}
                other => panic!("{other:?} before two tokens"),
            }
        }
        drop(dropped);
        let (mut admitted, mut tokens, mut text, mut out) =
            (false, Vec::new(), String::new(), None);
        while let Some(event) = tokio::time::timeout(WAIT, kept.next()).await.unwrap() {
            match event {
                StreamEvent::Admitted => admitted = true,
                StreamEvent::Token { token, text: t, .. } => {
                    tokens.push(token);
                    text.push_str(&t);
                }
                StreamEvent::Done(o) => out = Some(o.unwrap()),
            }
        }
        let out = out.expect("a Done event");
        assert!(admitted);
        assert_eq!(tokens, alone.tokens);
        assert_eq!((&out.text, &text), (&alone.text, &alone.text));
    });
    // The dropped stream's sequence left the batch and returned its reservation.
    let load = scheduler.load();
    assert!(settles(load), "the dropped stream still holds its place");
    // It stopped long before its 200 tokens: the rows stepped are the kept stream's and
    // a few of the dropped one's.
    let rows = load.rows.load(std::sync::atomic::Ordering::Relaxed) as usize;
    assert!(rows < alone.tokens.len() + 100, "{rows} rows stepped");
}

#[test]
fn under_a_probe_policy_each_explained_token_names_the_probe_s_most_active_heads() {
    use headwise::policy::ExplainConfig;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let all = runtimes();
    let full = &all["full"];
    let policy = Policy::load(&root.join("policies/dynamic-probe.toml"), &[]).unwrap();
    let probed = full.with_policy(&policy, root).unwrap();
    // Through end-of-turn tokens: 12 steps.
    let mut req = request(0);
    req.explain = Some(ExplainConfig {
        heads: vec![(0, 0)],
        positions: 1,
        context: 0,
        probe_heads: 3,
    });
    let (mut with_probe, mut without) = (Vec::new(), Vec::new());
    probed
        .generate(&req, &mut |s| {
            with_probe.push(s.explain.cloned().unwrap());
            true
        })
        .unwrap();
    full.generate(&req, &mut |s| {
        without.push(s.explain.cloned().unwrap());
        true
    })
    .unwrap();
    assert!(without.iter().all(|e| e.probe.is_none()));
    for e in &with_probe {
        let heads = e.probe.as_ref().expect("the probe's heads");
        assert_eq!(heads.len(), 3);
        let a: Vec<f32> = heads.iter().map(|h| h.activity).collect();
        assert!(a.windows(2).all(|w| w[0] >= w[1]), "{a:?}");
        assert!(
            heads.iter().all(|h| h.layer < 30 && h.head < 9),
            "{heads:?}"
        );
    }
    // The probe reads each step's hidden state: its choice moves during the answer.
    let first: Vec<_> = with_probe
        .iter()
        .map(|e| e.probe.as_ref().unwrap()[0].activity)
        .collect();
    assert!(first.windows(2).any(|w| w[0] != w[1]), "{first:?}");
}

#[test]
fn small_prefill_chunks_let_running_streams_step_between_them_and_change_no_token() {
    // Prefill chunks of 32 and 32 prompt positions an iteration: while the long prompt
    // (about 650 tokens: some 20 chunks) is prefilled, the running stream gets a token
    // after every chunk, where chunks of 256 would give it about three. Both requests
    // give what each gives alone on the same runtime.
    let runtimes = runtimes_with_chunk(32);
    let (short, long) = (request(1), request(5));
    let mut short = short;
    short.max_tokens = 48;
    short.ignore_eos = true;
    let alone: Vec<Vec<u32>> = [(&short, "static-locos"), (&long, "full")]
        .iter()
        .map(|(r, p)| runtimes[*p].generate(r, &mut |_| true).unwrap().tokens)
        .collect();
    let scheduler = Scheduler::new(
        runtimes,
        SchedulerConfig {
            max_batch: 4,
            kv_budget: None,
            prefill_tokens: 32,
            prefix_cache_bytes: 0,
        },
    )
    .unwrap();
    let (tx, rx) = channel();
    let sink = |id: usize| -> Box<dyn Sink> { Probe::new(id, &tx) };
    scheduler.submit("static-locos", &short, sink(0)).unwrap();
    loop {
        let msg = rx.recv_timeout(WAIT).expect("no first token");
        if matches!(msg, Msg::Token(0)) {
            break;
        }
    }
    scheduler.submit("full", &long, sink(1)).unwrap();
    // Tokens of the running stream between the long prompt's admission and its first
    // token: decode steps run between its chunks.
    let (mut admitted, mut answering, mut between) = (false, false, 0);
    let mut done = BTreeMap::new();
    while done.len() < 2 {
        match rx.recv_timeout(WAIT).expect("the scheduler stalled") {
            Msg::Admitted(1) => admitted = true,
            Msg::Token(0) if admitted && !answering => between += 1,
            Msg::Token(1) => answering = true,
            Msg::Done(id, out) => {
                done.insert(id, (*out).unwrap().tokens);
            }
            _ => {}
        }
    }
    assert_eq!(done[&0], alone[0]);
    assert_eq!(done[&1], alone[1]);
    assert!(
        between >= 12,
        "{between} tokens of the running stream during the prefill"
    );
}

#[test]
fn prompts_run_as_rows_of_the_batched_step_give_each_request_its_tokens_alone() {
    // Chunks of one position: prompt positions are decode steps, so the scheduler runs
    // them as rows of its batched step, at most 48 per iteration across the prompts
    // waiting, beside the running streams. Each request, under each policy (SnapKV's
    // full prefill and press at admission too), gives what it gives alone.
    let runtimes = runtimes_with_chunk(1);
    let alone = each_alone(&runtimes, 6);
    let scheduler = Scheduler::new(
        runtimes,
        SchedulerConfig {
            max_batch: 8,
            kv_budget: None,
            prefill_tokens: 48,
            prefix_cache_bytes: 0,
        },
    )
    .unwrap();
    let (tx, rx) = channel();
    for i in 0..6 {
        let sink = Probe::new(i, &tx);
        scheduler.submit(policy(i), &request(i), sink).unwrap();
    }
    let (done, most) = collect(&rx, 6);
    assert!(most >= 4, "at most {most} requests ran together");
    for (i, want) in alone.iter().enumerate() {
        let got = done[&i].as_ref().unwrap();
        assert_eq!(got.tokens, want.tokens, "request {i} ({})", policy(i));
        assert_eq!(got.stats.kv.end, want.stats.kv.end, "request {i}");
    }
    let load = scheduler.load();
    assert!(settles(load));
    use std::sync::atomic::Ordering::Relaxed;
    let (prompt_rows, mixed) = (
        load.prompt_rows.load(Relaxed),
        load.mixed_steps.load(Relaxed),
    );
    // The streamed prompts' positions, but each one's last (its first step runs it).
    let streamed: usize = (0..6)
        .filter(|&i| policy(i) != "retrieval-snapkv-q8")
        .map(|i| alone[i].stats.prompt_tokens - 1)
        .sum();
    assert_eq!(prompt_rows as usize, streamed);
    assert!(
        mixed > 0,
        "no step ran prompt positions beside decode steps"
    );
}
