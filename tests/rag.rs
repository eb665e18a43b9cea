//! Retrieval for RAG: the BM25 index over HotpotQA's paragraph pool finds a paragraph
//! from a sentence copied out of it; `headwise retriever serve` on loopback, queried by
//! the HTTP retriever, answers what the embedded index answers; bad corpora, a service
//! that refuses connections, one that answers garbage and one that keeps failing give
//! clear errors.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use headwise::rag::corpus::{self, CorpusFormat};
use headwise::rag::{Bm25Index, HttpRetriever, Retriever};

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headwise-rag-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn headwise(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_headwise"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `headwise retriever serve` on a free port, killed when dropped.
struct SearchServer(Child, String);

impl SearchServer {
    fn start(index: &std::path::Path) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_headwise"))
            .args([
                "retriever",
                "serve",
                "--port",
                "0",
                "--name",
                "hotpot",
                "--index",
            ])
            .arg(index)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let line = lines.next().unwrap().unwrap();
        let addr = line
            .split("on http://")
            .nth(1)
            .expect(&line)
            .trim()
            .to_string();
        SearchServer(child, format!("http://{addr}"))
    }
}

impl Drop for SearchServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn bm25_finds_copied_sentences_and_http_serves_the_same_answers() {
    let Some(data) = common::data_dir() else {
        return;
    };
    let hotpot = data.join("hotpotqa/hotpot_dev_distractor_200.jsonl");
    let dir = scratch("index");
    let out = dir.join("index");
    let (code, err) = headwise(&[
        "retriever",
        "index",
        hotpot.to_str().unwrap(),
        "--format",
        "hotpotqa",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let passages = corpus::read(&hotpot, CorpusFormat::Hotpotqa).unwrap();
    assert!(passages.len() > 1500, "{}", passages.len());
    let index = Bm25Index::open(&out).unwrap();
    assert_eq!(index.meta().passages, passages.len());

    // A sentence-sized piece of a paragraph finds that paragraph first.
    let mut found = 0;
    let probes: Vec<_> = passages.iter().step_by(40).take(40).collect();
    for p in &probes {
        let words: Vec<&str> = p.text.split_whitespace().collect();
        let query = words[..words.len().min(20)].join(" ");
        let hits = index.search(&query, 3).unwrap();
        found += usize::from(hits[0].text == p.text);
    }
    assert!(
        found >= probes.len() - 1,
        "{found} of {} first",
        probes.len()
    );

    // Over HTTP, from the real server: the same passages in the same order.
    let server = SearchServer::start(&out);
    let http = HttpRetriever::new(&server.1, "hotpot", Duration::from_secs(10)).unwrap();
    for q in [
        "Which magazine was started first, Arthur's Magazine or First for Women?",
        "Scott Derrickson nationality director",
        "",
    ] {
        let a = index.search(q, 3).unwrap();
        let b = http.search(q, 3).unwrap();
        let ids = |h: &[headwise::rag::Hit]| h.iter().map(|x| x.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&a), ids(&b), "{q}");
        for (x, y) in a.iter().zip(&b) {
            assert_eq!((&x.title, &x.text), (&y.title, &y.text));
            assert!((x.score - y.score).abs() < 1e-4);
        }
    }
    let wrong = HttpRetriever::new(&server.1, "nope", Duration::from_secs(10)).unwrap();
    let err = wrong.search("x", 3).unwrap_err().to_string();
    assert!(
        err.contains("404") && err.contains("index_not_found"),
        "{err}"
    );
    let (code, err) = headwise(&[
        "retriever",
        "search",
        "Arthur's Magazine",
        "--url",
        &server.1,
        "--name",
        "hotpot",
    ]);
    assert_eq!(code, 0, "{err}");
    drop((server, index));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_corpora_fail_with_one_line_naming_the_problem() {
    let dir = scratch("bad");
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let no_text = dir.join("no-text.jsonl");
    std::fs::write(&no_text, "{\"text\": \"fine\"}\n{\"title\": \"T\"}\n").unwrap();
    for (file, says) in [(&empty, "empty corpus"), (&no_text, "no-text.jsonl:2")] {
        let out = dir.join(format!(
            "idx-{}",
            file.file_stem().unwrap().to_string_lossy()
        ));
        let (code, err) = headwise(&[
            "retriever",
            "index",
            file.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.starts_with("error: ") && err.contains(says) && err.lines().count() == 1,
            "{err}"
        );
    }
    let (code, err) = headwise(&["retriever", "search", "x", "--index", dir.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("headwise-index.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A loopback service that answers every request with `reply`, counting requests.
fn fake_service(reply: &'static str) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&count);
    std::thread::spawn(move || {
        for stream in listener.incoming().take(16) {
            let mut s = stream.unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            seen.fetch_add(1, Ordering::SeqCst);
            let _ = s.write_all(reply.as_bytes());
        }
    });
    (url, count)
}

#[test]
fn a_service_that_refuses_fails_or_answers_garbage_gives_a_clear_error() {
    // A port nobody listens on.
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let mut r = HttpRetriever::new(&closed, "wiki", Duration::from_secs(2)).unwrap();
    r.backoff = Duration::from_millis(10);
    let err = r.search("x", 3).unwrap_err().to_string();
    assert!(err.contains("cannot connect"), "{err}");

    let (url, _) =
        fake_service("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello");
    let err = HttpRetriever::new(&url, "wiki", Duration::from_secs(5))
        .unwrap()
        .search("x", 3)
        .unwrap_err()
        .to_string();
    assert!(err.contains("malformed response"), "{err}");

    // 503 every time: the first try and two retries, then the error.
    let (url, count) = fake_service(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy",
    );
    let mut r = HttpRetriever::new(&url, "wiki", Duration::from_secs(5)).unwrap();
    r.backoff = Duration::from_millis(10);
    let err = r.search("x", 3).unwrap_err().to_string();
    assert!(err.contains("503"), "{err}");
    assert_eq!(count.load(Ordering::SeqCst), 3);
}

mod dragin_loop {
    use super::*;
    use headwise::model::{LoadedModel, Numerics};
    use headwise::rag::dragin::{
        answer, prompt_text, AnswerOptions, Instrumented, OnRetrieverError, QueryConfig, RagConfig,
    };
    use headwise::rag::qa::QaItem;
    use headwise::rag::text::Stopwords;
    use headwise::rag::trigger::TriggerConfig;
    use headwise::rag::Passage;

    fn passage(id: &str, title: &str, text: &str) -> Passage {
        Passage {
            id: id.into(),
            title: title.into(),
            text: text.into(),
        }
    }

    fn item() -> QaItem {
        QaItem {
            id: "q1".into(),
            question: "Which river flows through the capital of Portugal?".into(),
            answers: vec!["Tagus".into()],
            paragraphs: vec![passage("g", "Lisbon", "Lisbon lies on the Tagus river.")],
        }
    }

    fn index() -> Bm25Index {
        Bm25Index::in_memory(&[
            passage(
                "a",
                "Lisbon",
                "Lisbon, the capital of Portugal, lies where the Tagus river meets the Atlantic.",
            ),
            passage("b", "Oslo", "Oslo is the capital of Norway."),
            passage(
                "c",
                "Porto",
                "Porto stands on the Douro river in northern Portugal.",
            ),
        ])
        .unwrap()
    }

    fn cfg(trigger: TriggerConfig, cap: usize) -> RagConfig {
        RagConfig {
            trigger,
            query: QueryConfig::Qfs { words: 8 },
            context: headwise::rag::dragin::ContextMode::Retrieved,
            passages: 2,
            max_retrievals: cap,
            on_retriever_error: OnRetrieverError::Continue,
            in_context: None,
        }
    }

    const OPTS: AnswerOptions<'static> = AnswerOptions {
        max_new: 16,
        chat: true,
        engine: &Instrumented,
    };

    #[test]
    fn a_trigger_at_token_three_retrieves_once_per_cap_and_rind_queries_are_words() {
        let lm = LoadedModel::load(&common::real_model(), Numerics::Fast).unwrap();
        let stop = Stopwords::from_words(["the", "of", "which", "through", "is", "a"]);
        let idx = index();
        for cap in [1, 2] {
            let a = answer(
                &lm,
                &item(),
                &cfg(TriggerConfig::EveryN { n: 3 }, cap),
                Some(&idx),
                &stop,
                None,
                OPTS,
            )
            .unwrap();
            assert_eq!(a.retrievals.len(), cap, "{a:?}");
            for r in &a.retrievals {
                assert_eq!(r.at_token, 3, "{a:?}");
                assert_eq!(r.ids.len(), 2);
                assert!(
                    !r.query.is_empty() && !r.query.contains("<|"),
                    "{:?}",
                    r.query
                );
            }
            // The segment before each retrieval is thrown away from the triggering
            // sentence on, and regenerated: more tokens than the answer kept.
            assert!(a.generated_tokens > 3 * cap, "{a:?}");
        }
        let never = answer(
            &lm,
            &item(),
            &cfg(TriggerConfig::Never, 3),
            Some(&idx),
            &stop,
            None,
            OPTS,
        )
        .unwrap();
        assert!(never.retrievals.is_empty());
        // A zero threshold fires at the first content word that later tokens attend to.
        let rind = answer(
            &lm,
            &item(),
            &cfg(TriggerConfig::Rind { threshold: 0.0 }, 1),
            Some(&idx),
            &stop,
            None,
            OPTS,
        )
        .unwrap();
        assert_eq!(rind.retrievals.len(), 1, "{rind:?}");
        let once = RagConfig {
            query: QueryConfig::Question,
            ..cfg(TriggerConfig::Once, 1)
        };
        let once = answer(&lm, &item(), &once, Some(&idx), &stop, None, OPTS).unwrap();
        assert_eq!(once.retrievals[0].query, item().question);
        assert_eq!(once.retrievals[0].ids[0], "a");
    }

    /// mistral.rs generates and streams, the instrumented model re-reads each token to
    /// judge the trigger: on the same prompt both loops stop at the same token, ask the
    /// same query and give the same answer.
    #[cfg(feature = "mistralrs")]
    #[test]
    fn the_mistralrs_and_instrumented_loops_trigger_at_the_same_token() {
        use headwise::reference::mistralrs::MistralRsEngine;
        let path = common::real_model();
        let lm = LoadedModel::load(&path, Numerics::Fast).unwrap();
        let engine = MistralRsEngine::load(&path).unwrap();
        let stop = Stopwords::from_words(["the", "of", "which", "through", "is", "a"]);
        let idx = index();
        let streamed = AnswerOptions {
            engine: &engine,
            ..OPTS
        };
        for trigger in [
            TriggerConfig::Rind { threshold: 0.0 },
            TriggerConfig::EveryN { n: 4 },
        ] {
            let c = cfg(trigger.clone(), 2);
            let a = answer(&lm, &item(), &c, Some(&idx), &stop, None, OPTS).unwrap();
            let b = answer(&lm, &item(), &c, Some(&idx), &stop, None, streamed).unwrap();
            assert!(!a.retrievals.is_empty(), "{trigger:?}: {a:?}");
            assert_eq!(a.retrievals, b.retrievals, "{trigger:?}");
            assert_eq!(a.answer, b.answer, "{trigger:?}");
            assert_eq!(a.generated_tokens, b.generated_tokens, "{trigger:?}");
        }
    }

    /// In-context retrieval: masks that keep every key are no-ops whichever heads carry
    /// them (static, probe-chosen per step, random), so all three give one answer, and
    /// it reads the paragraph; masking every head to one key hides the paragraph and
    /// changes it. Each records one in-context retrieval (no query, no passages).
    #[test]
    fn in_context_masks_that_keep_everything_change_nothing() {
        use headwise::probe::Probe;
        use headwise::rag::dragin::{ContextMode, HeadSignal, InContext, InContextHeads};
        let lm = LoadedModel::load(&common::real_model(), Numerics::Fast).unwrap();
        let stop = Stopwords::from_words(["the"]);
        let probe = Probe::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("probes/SmolLM2-135M-Instruct.Q4_1/hotpotqa.json"),
        )
        .unwrap();
        let n_heads = lm.model.config().n_heads;
        // The last layers' heads: those that shape the next token most directly.
        let heads: Vec<usize> = (27..30)
            .flat_map(|l| (0..3).map(move |h| l * n_heads + h))
            .collect();
        let signal = HeadSignal {
            probe: Some(&probe),
            heads: &heads,
        };
        let in_context = |kind, k| RagConfig {
            trigger: TriggerConfig::Once,
            context: ContextMode::AllParagraphs,
            in_context: Some(InContext {
                heads: kind,
                k,
                sink: 0,
                window: 1,
                seed: 0,
            }),
            ..cfg(TriggerConfig::Once, 1)
        };
        let ask = |c: &RagConfig, signal| answer(&lm, &item(), c, None, &stop, Some(signal), OPTS);
        let open = ask(&in_context(InContextHeads::Static, 100_000), signal).unwrap();
        assert!(open.answer.contains("Tagus"), "{open:?}");
        assert_eq!(open.retrievals.len(), 1);
        assert!(open.retrievals[0].ids.is_empty() && open.retrievals[0].query.is_empty());
        for kind in [InContextHeads::Probe, InContextHeads::Random] {
            let a = ask(&in_context(kind, 100_000), signal).unwrap();
            assert_eq!(
                (a.answer.as_str(), a.generated_tokens),
                (open.answer.as_str(), open.generated_tokens),
                "{kind:?}"
            );
        }
        // Every head restricted to one key besides its own position.
        let every: Vec<usize> = (0..lm.model.config().n_layers * n_heads).collect();
        let all_heads = HeadSignal {
            probe: None,
            heads: &every,
        };
        let blind = ask(&in_context(InContextHeads::Static, 1), all_heads).unwrap();
        assert_eq!(blind.retrievals.len(), 1);
        assert_ne!(blind.answer, open.answer, "{blind:?} vs {open:?}");
        // Masks need the open-book context.
        let closed = RagConfig {
            context: ContextMode::Retrieved,
            ..in_context(InContextHeads::Static, 8)
        };
        assert!(ask(&closed, signal).is_err());
    }

    #[test]
    fn prompts_hold_the_passages_question_and_kept_text() {
        let p = prompt_text(&item(), &[passage("a", "Lisbon", "On the Tagus.")], " The");
        assert!(p.starts_with("Answer the question using the paragraphs below."));
        assert!(p.contains("Lisbon: On the Tagus.\n\nQuestion: Which river"));
        assert!(p.ends_with("?\nAnswer: The"));
        assert!(prompt_text(&item(), &[], "").starts_with("Answer the question. Reply"));
    }

    #[test]
    fn a_dead_retriever_is_skipped_or_fails_by_configuration() {
        let lm = LoadedModel::load(&common::real_model(), Numerics::Fast).unwrap();
        let closed = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let mut http = HttpRetriever::new(&closed, "wiki", Duration::from_secs(2)).unwrap();
        http.retries = 0;
        let stop = Stopwords::from_words(["the"]);
        let c = cfg(TriggerConfig::EveryN { n: 2 }, 2);
        let a = answer(&lm, &item(), &c, Some(&http), &stop, None, OPTS).unwrap();
        assert!(a.retrievals.is_empty());
        assert_eq!(a.retriever_errors.len(), 1, "{a:?}");
        assert!(a.retriever_errors[0].contains("cannot connect"));
        let fail = RagConfig {
            on_retriever_error: OnRetrieverError::Fail,
            ..c
        };
        let err = answer(&lm, &item(), &fail, Some(&http), &stop, None, OPTS).unwrap_err();
        assert!(err.to_string().contains("cannot connect"), "{err}");
        let nan = cfg(
            TriggerConfig::Rind {
                threshold: f32::NAN,
            },
            1,
        );
        assert!(answer(&lm, &item(), &nan, Some(&http), &stop, None, OPTS).is_err());
    }
}

#[test]
fn a_spec_with_a_nan_threshold_is_refused_before_any_work() {
    let dir = scratch("spec");
    let spec = dir.join("rag.toml");
    std::fs::write(
        &spec,
        "name = \"x\"\nmodel = \"smollm2-135m\"\n[[task]]\nname = \"hotpotqa\"\n\
         file = \"hotpotqa/hotpot_dev_distractor_200.jsonl\"\nformat = \"hotpotqa\"\n\
         [[variant]]\nname = \"rind\"\nrag = { trigger = { type = \"rind\", threshold = nan } }\n",
    )
    .unwrap();
    let (code, err) = headwise(&[
        "eval",
        "rag",
        spec.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("`rind`") && err.contains("NaN"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two-fold cross-fitting end to end on the real model: traces of two row ranges of
/// HotpotQA, a probe trained on each, and a RAG run that answers each fold with the
/// probe of the other; the same run with the probes swapped (each fold answered by the
/// probe trained on it) is refused before any answer.
#[test]
fn cross_fitted_folds_use_the_other_folds_probe_and_refuse_their_own() {
    let dir = scratch("crossfit");
    let model = common::real_model();
    let model = model.to_str().unwrap();
    let Some(data) = common::data_dir() else {
        return;
    };
    let data = data.to_str().unwrap();
    let probe = |rows: &str| dir.join(format!("probe-{}.json", rows.replace("..", "-")));
    for rows in ["0..5", "5..10"] {
        let stem = dir.join(format!("trace-{}", rows.replace("..", "-")));
        let args = [
            "heads",
            "trace",
            "--task",
            "hotpotqa",
            "--rows",
            rows,
            "--max-new",
            "3",
            "--model",
            model,
            "--data-dir",
            data,
            "--out",
            stem.to_str().unwrap(),
        ];
        let (code, err) = headwise(&args);
        assert_eq!(code, 0, "{err}");
        let name = probe(rows);
        let name = name.file_stem().unwrap().to_str().unwrap();
        let trace = stem.with_extension("json");
        let args = [
            "policy",
            "train-probe",
            trace.to_str().unwrap(),
            "--epochs",
            "2",
            "--out",
            dir.to_str().unwrap(),
            "--name",
            name,
        ];
        let (code, err) = headwise(&args);
        assert_eq!(code, 0, "{err}");
        let card: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(probe(rows)).unwrap()).unwrap();
        assert_eq!(
            card["data"]["examples"].as_array().unwrap().len(),
            5,
            "{card}"
        );
        assert_eq!(
            card["data"]["task"]["rows"],
            serde_json::json!(rows
                .split("..")
                .map(|r| r.parse::<usize>().unwrap())
                .collect::<Vec<_>>())
        );
    }
    let spec = |first: &str, second: &str| {
        format!(
            "name = \"crossfit\"\nmodel = \"smollm2-135m\"\nmax_new = 4\n\
             ranking = \"policies/rankings/{{model}}/locos-niah.json\"\n\
             [[task]]\nname = \"hotpotqa\"\nfile = \"hotpotqa/hotpot_dev_distractor_200.jsonl\"\n\
             format = \"hotpotqa\"\n\
             fold = [{{ rows = [0, 5], probe = \"{}\" }}, {{ rows = [5, 10], probe = \"{}\" }}]\n\
             [[variant]]\nname = \"heads\"\n\
             rag = {{ trigger = {{ type = \"retrieval_heads\", threshold = 0.1 }} }}\n",
            probe(first).display(),
            probe(second).display()
        )
    };
    let run = |text: String, tag: &str| {
        let path = dir.join(format!("{tag}.toml"));
        std::fs::write(&path, text).unwrap();
        let out = dir.join(tag);
        let args = [
            "eval",
            "rag",
            path.to_str().unwrap(),
            "--model",
            model,
            "--data-dir",
            data,
            "--out",
            out.to_str().unwrap(),
        ];
        (
            headwise(&args),
            out.join("SmolLM2-135M-Instruct.Q4_1").join("crossfit"),
        )
    };
    let ((code, err), out) = run(spec("5..10", "0..5"), "crossed");
    assert_eq!(code, 0, "{err}");
    let records = std::fs::read_to_string(out.join("records.jsonl")).unwrap();
    assert_eq!(records.lines().count(), 10, "{records}");
    let readme = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(readme.contains("Cross-fitted `hotpotqa`"), "{readme}");
    // run.json names the CPU the answers were made on, and the report says it; a resumed
    // run on another CPU is refused when the folder has no arithmetic fingerprint to
    // compare (greedy answers differ between kernels)
    let run_json = out.join("run.json");
    let mut info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&run_json).unwrap()).unwrap();
    let cpu = info["cpu"].as_str().unwrap().to_string();
    assert!(
        !cpu.is_empty() && readme.contains(&format!("({cpu})")),
        "{info}"
    );
    // another CPU with the same fingerprint continues the folder, and run.json says where
    // its earlier answers were made
    let fingerprinted = info.clone();
    info["cpu"] = "Another CPU, avx2".into();
    std::fs::write(&run_json, serde_json::to_vec(&info).unwrap()).unwrap();
    let ((code, err), _) = run(spec("5..10", "0..5"), "crossed");
    assert_eq!(code, 0, "{err}");
    let moved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&run_json).unwrap()).unwrap();
    assert_eq!(moved["cpu"], cpu.as_str(), "{moved}");
    assert!(
        moved["note"].as_str().is_some_and(
            |n| n.ends_with("ran on Another CPU, avx2, with the same arithmetic fingerprint")
        ),
        "{moved}"
    );
    let mut info = fingerprinted;
    info["cpu"] = "Another CPU, avx2".into();
    info.as_object_mut().unwrap().remove("arithmetic");
    std::fs::write(&run_json, serde_json::to_vec(&info).unwrap()).unwrap();
    let ((code, err), _) = run(spec("5..10", "0..5"), "crossed");
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("holds answers made with CPU \"Another CPU, avx2\", not"),
        "{err}"
    );
    let ((code, err), out) = run(spec("0..5", "5..10"), "own");
    assert_eq!(code, 1, "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("was trained on 5 of the fold's questions"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        !out.join("records.jsonl").exists(),
        "no answer is written before the check"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
