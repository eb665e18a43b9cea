//! Structured fuzzing on stable Rust, bounded in time: every input a target generates
//! must end in `Ok` or a typed error, never a panic, an abort, an allocation beyond
//! [`LARGEST_ALLOCATION`], or more than [`CASE_BOUND`] of work.
//!
//! Targets (proptest strategies; `HEADWISE_FUZZ_SCALE` multiplies every case count):
//!
//! | target | input |
//! | --- | --- |
//! | `gguf_header` | the real SmolLM2 header with 64-bit words and bytes overwritten, and cut at every offset of its first 4 KB |
//! | `gguf_metadata` | the parsed header with values replaced, dropped or retyped, through the config, tokenizer and chat template readers |
//! | `policy_toml` | policy files from a grammar of their keys and any TOML values, and byte flips of them; `--set` pairs |
//! | `ranking_json` | the committed ranking with fields replaced, removed, reordered or cut |
//! | `probe_card` | the committed probe card with fields replaced, and its weights file with bytes flipped (under a matching checksum) |
//! | `eval_spec` | the committed ablation spec with keys replaced and bytes flipped |
//! | `openai_bodies` | request bodies for the real server (types, sizes, nesting, unicode) |
//! | `search_bodies` | `_search` bodies for the real BM25 search server |
//!
//! Each target first replays its corpus of past crashers under `tests/fuzz-corpus/`,
//! then the generated cases, and prints `fuzz TARGET: N inputs, 0 panics, ...`.
//! `cargo test --release --test fuzz -- --ignored` runs every target 20 times longer;
//! `HEADWISE_FUZZ_SHOW=1` prints each server answer.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::{Content, Value as GgufValue};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestRunner};
use serde_json::{json, Value};

use headwise::model::file::gguf::read_header;
use headwise::policy::ranking::Ranking;
use headwise::policy::Policy;

/// No single allocation an input causes may be larger than this.
const LARGEST_ALLOCATION: usize = 1 << 30;
/// Allocations this large are refused outright (the process then aborts, failing the
/// run loudly) instead of being tried.
const REFUSED_ALLOCATION: usize = 8 << 30;
/// A hang guard per in-process input, far above the slowest case seen (130 ms).
const CASE_BOUND: Duration = Duration::from_secs(20);
/// A hang guard per server request (a generation of a few tokens after a prompt of up
/// to ~600 tokens, on a loaded CI machine), as the HTTP client's timeout.
const REQUEST_BOUND: Duration = Duration::from_secs(120);

/// The system allocator, noting the largest request made while a target runs.
struct Watched;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged, except that requests beyond
// `REFUSED_ALLOCATION` return null, which `GlobalAlloc` allows.
unsafe impl GlobalAlloc for Watched {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        if layout.size() > REFUSED_ALLOCATION {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        if layout.size() > REFUSED_ALLOCATION {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        if new_size > REFUSED_ALLOCATION {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Watched = Watched;

/// In-process targets run one at a time, so that the allocation figures are theirs.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Cases for a target: `base` times `HEADWISE_FUZZ_SCALE` (default 1) times `long`.
fn cases(base: u32, long: u32) -> u32 {
    let scale: f64 = std::env::var("HEADWISE_FUZZ_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    ((f64::from(base) * scale).round() as u32).max(1) * long
}

/// The tally, also after a case panicked while holding it (proptest then shrinks the
/// input, and the failure to report is that panic, not a poisoned lock).
fn lock(tally: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
    tally.lock().unwrap_or_else(|e| e.into_inner())
}

/// What one target did, printed at its end.
#[derive(Default)]
struct Tally {
    inputs: usize,
    ok: usize,
    slowest: Duration,
}

impl Tally {
    /// Run `case` on one input under the time bound; `Ok(true)`: the input was
    /// accepted, `Ok(false)`: refused with a typed error.
    fn run(&mut self, what: &str, case: impl FnOnce() -> bool) -> Result<(), TestCaseError> {
        let t0 = Instant::now();
        let ok = case();
        self.note(what, t0.elapsed(), ok)
    }

    /// Count one input that took `took` and was accepted (`ok`) or refused.
    fn note(&mut self, what: &str, took: Duration, ok: bool) -> Result<(), TestCaseError> {
        self.inputs += 1;
        self.ok += usize::from(ok);
        self.slowest = self.slowest.max(took);
        if took > CASE_BOUND {
            return Err(TestCaseError::fail(format!("{what}: {took:?}")));
        }
        Ok(())
    }

    fn report(&self, target: &str) {
        let largest = LARGEST.load(Ordering::Relaxed);
        println!(
            "fuzz {target}: {} inputs ({} accepted, {} refused), 0 panics, slowest {:.0} ms, \
             largest allocation {:.1} MiB",
            self.inputs,
            self.ok,
            self.inputs - self.ok,
            self.slowest.as_secs_f64() * 1e3,
            largest as f64 / (1 << 20) as f64
        );
        assert!(
            largest <= LARGEST_ALLOCATION,
            "{target}: an input allocated {largest} bytes at once"
        );
    }
}

/// A runner with `n` cases, a fixed seed (the CI run is reproducible; the long run
/// draws anew) and no failure files written into the source tree.
fn runner(n: u32, long: bool) -> TestRunner {
    let config = RunnerConfig {
        cases: n,
        failure_persistence: None,
        max_shrink_iters: 256,
        ..RunnerConfig::default()
    };
    match long {
        false => TestRunner::new_with_rng(
            config,
            proptest::test_runner::TestRng::deterministic_rng(
                proptest::test_runner::RngAlgorithm::ChaCha,
            ),
        ),
        true => TestRunner::new(config),
    }
}

/// The files of `tests/fuzz-corpus/<target>/`, sorted.
fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: no corpus", dir.display());
    files
}

/// A scratch folder for one target.
fn scratch(target: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("headwise-fuzz-{target}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Values that break arithmetic: zero, one, the edges of each width, and big powers.
fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(0xff),
        Just(0xffff),
        Just(u64::from(u32::MAX)),
        Just(1 << 32),
        Just(1 << 40),
        Just(1 << 45),
        Just(1 << 62),
        Just(i64::MAX as u64),
        Just(u64::MAX),
        any::<u64>(),
    ]
}

// ---------------------------------------------------------------------------------
// GGUF

/// The real SmolLM2 header (everything before the tensor data) and the file's length.
fn real_header() -> (Vec<u8>, u64) {
    let path = common::real_model();
    let len = std::fs::metadata(&path).unwrap().len();
    let mut f = std::fs::File::open(&path).unwrap();
    let content = Content::read(&mut f).unwrap();
    let mut header = vec![0u8; content.tensor_data_offset as usize];
    use std::io::{Read, Seek};
    f.rewind().unwrap();
    f.read_exact(&mut header).unwrap();
    (header, len)
}

/// One edit of a GGUF header.
#[derive(Debug, Clone)]
enum GgufEdit {
    /// A little-endian 64-bit word at a byte offset (counts and lengths are u64).
    Word(usize, u64),
    /// A 32-bit word (types, ranks).
    Half(usize, u32),
    /// One byte.
    Byte(usize, u8),
}

fn gguf_edit(header_len: usize) -> impl Strategy<Value = GgufEdit> {
    let near = 4096usize.min(header_len);
    prop_oneof![
        4 => (0..near, edge_u64()).prop_map(|(at, v)| GgufEdit::Word(at, v)),
        2 => (0..near, prop_oneof![Just(0u32), Just(4), Just(9), Just(13), Just(99), Just(u32::MAX), any::<u32>()])
            .prop_map(|(at, v)| GgufEdit::Half(at, v)),
        2 => (0..near, any::<u8>()).prop_map(|(at, v)| GgufEdit::Byte(at, v)),
        1 => (0..header_len, edge_u64()).prop_map(|(at, v)| GgufEdit::Word(at, v)),
        1 => (0..header_len, any::<u8>()).prop_map(|(at, v)| GgufEdit::Byte(at, v)),
    ]
}

fn apply(header: &mut [u8], edit: &GgufEdit) {
    let put = |h: &mut [u8], at: usize, b: &[u8]| {
        let end = (at + b.len()).min(h.len());
        h[at..end].copy_from_slice(&b[..end - at]);
    };
    match *edit {
        GgufEdit::Word(at, v) => put(header, at, &v.to_le_bytes()),
        GgufEdit::Half(at, v) => put(header, at, &v.to_le_bytes()),
        GgufEdit::Byte(at, v) => put(header, at, &[v]),
    }
}

/// Parse `bytes` as the header of a file of `len` bytes; when it parses, read the
/// model config from it too. `true` when both are accepted.
fn parse_gguf(bytes: &[u8], len: u64) -> bool {
    match read_header(&mut std::io::Cursor::new(bytes), len) {
        Ok(content) => headwise::model::Config::from_gguf(&content).is_ok(),
        Err(_) => false,
    }
}

/// A corpus entry of the GGUF target: edits as `[["word", offset, value], ...]`, or
/// `{"truncate": n}`.
fn replay_gguf(path: &Path, header: &[u8], len: u64) -> bool {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    if let Some(n) = v.get("truncate").and_then(Value::as_u64) {
        return parse_gguf(&header[..n as usize], n);
    }
    let mut h = header.to_vec();
    for e in v.as_array().expect("a list of edits") {
        let at = e[1].as_u64().unwrap() as usize;
        let edit = match e[0].as_str().unwrap() {
            "word" => GgufEdit::Word(at, e[2].as_u64().unwrap()),
            "half" => GgufEdit::Half(at, e[2].as_u64().unwrap() as u32),
            _ => GgufEdit::Byte(at, e[2].as_u64().unwrap() as u8),
        };
        apply(&mut h, &edit);
    }
    parse_gguf(&h, len)
}

fn fuzz_gguf_header(long: u32) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    LARGEST.store(0, Ordering::Relaxed);
    let (header, len) = real_header();
    let mut tally = Tally::default();
    for path in corpus("gguf_header") {
        tally
            .run(&path.display().to_string(), || {
                replay_gguf(&path, &header, len)
            })
            .unwrap();
    }
    // The file cut at every offset of its first 4 KB (as a download cut short).
    for n in 0..4096.min(header.len()) {
        tally
            .run(&format!("cut at {n}"), || {
                parse_gguf(&header[..n], n as u64)
            })
            .unwrap();
    }
    let strategy = proptest::collection::vec(gguf_edit(header.len()), 1..4);
    let tally = Mutex::new(tally);
    runner(cases(2000, long), long > 1)
        .run(&strategy, |edits| {
            let mut h = header.clone();
            for e in &edits {
                apply(&mut h, e);
            }
            lock(&tally).run(&format!("{edits:?}"), || parse_gguf(&h, len))
        })
        .unwrap();
    tally
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .report("gguf_header");
}

/// A GGUF metadata value of any type, small.
fn gguf_value() -> impl Strategy<Value = GgufValue> {
    let leaf = prop_oneof![
        any::<u8>().prop_map(GgufValue::U8),
        any::<i8>().prop_map(GgufValue::I8),
        any::<u32>().prop_map(GgufValue::U32),
        any::<i32>().prop_map(GgufValue::I32),
        edge_u64().prop_map(GgufValue::U64),
        any::<i64>().prop_map(GgufValue::I64),
        any::<f32>().prop_map(GgufValue::F32),
        any::<f64>().prop_map(GgufValue::F64),
        any::<bool>().prop_map(GgufValue::Bool),
        ".{0,40}".prop_map(GgufValue::String),
    ];
    leaf.prop_recursive(2, 64, 16, |inner| {
        proptest::collection::vec(inner, 0..16).prop_map(GgufValue::Array)
    })
}

/// The metadata keys the readers look at.
const GGUF_KEYS: &[&str] = &[
    "general.architecture",
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.vocab_size",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.pre",
    "tokenizer.chat_template",
];

#[derive(Debug, Clone)]
enum MetaEdit {
    Set(usize, GgufValue),
    Drop(usize),
    /// Keep the first `n` entries of an array value.
    Cut(usize, usize),
}

fn meta_edit() -> impl Strategy<Value = MetaEdit> {
    let key = 0..GGUF_KEYS.len();
    prop_oneof![
        3 => (key.clone(), gguf_value()).prop_map(|(k, v)| MetaEdit::Set(k, v)),
        1 => key.clone().prop_map(MetaEdit::Drop),
        1 => (key, prop_oneof![Just(0usize), Just(1), Just(2), Just(300), 0..60_000usize])
            .prop_map(|(k, n)| MetaEdit::Cut(k, n)),
    ]
}

/// Config, tokenizer and chat template from `content`; `true` when all are accepted.
fn read_metadata(content: &Content) -> bool {
    use headwise::model::text::chat::{ChatMessage, ChatTemplate};
    let config = headwise::model::Config::from_gguf(content).is_ok();
    let tokenizer = match headwise::model::text::tokenizer::tokenizer_from_gguf(content) {
        Ok((tok, _)) => tok.encode("hello world, héllo 世界", true).is_ok(),
        Err(_) => false,
    };
    let template = match ChatTemplate::from_gguf(content) {
        Ok(Some(t)) => t
            .render(
                &[ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                }],
                true,
            )
            .is_ok(),
        Ok(None) => true,
        Err(_) => false,
    };
    config && tokenizer && template
}

fn fuzz_gguf_metadata(long: u32) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    LARGEST.store(0, Ordering::Relaxed);
    let (header, len) = real_header();
    let base = read_header(&mut std::io::Cursor::new(&header), len).unwrap();
    let tally = Mutex::new(Tally::default());
    let strategy = proptest::collection::vec(meta_edit(), 1..4);
    runner(cases(200, long), long > 1)
        .run(&strategy, |edits| {
            let mut content = Content {
                magic: base.magic,
                metadata: base.metadata.clone(),
                tensor_infos: Default::default(),
                tensor_data_offset: base.tensor_data_offset,
            };
            for e in &edits {
                match e {
                    MetaEdit::Set(k, v) => {
                        content
                            .metadata
                            .insert(GGUF_KEYS[*k].to_string(), v.clone());
                    }
                    MetaEdit::Drop(k) => {
                        content.metadata.remove(GGUF_KEYS[*k]);
                    }
                    MetaEdit::Cut(k, n) => {
                        if let Some(GgufValue::Array(a)) = content.metadata.get_mut(GGUF_KEYS[*k]) {
                            a.truncate(*n);
                        }
                    }
                }
            }
            lock(&tally).run(&format!("{edits:?}"), || read_metadata(&content))
        })
        .unwrap();
    tally
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .report("gguf_metadata");
}

// ---------------------------------------------------------------------------------
// Files: policies, rankings, probes, specs

/// Any JSON value, with the edges numbers and strings have.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        edge_u64().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop_oneof![
            Just(0.0f64),
            Just(-1.0),
            Just(1e308),
            Just(-1e308),
            Just(5e-324),
            any::<f64>()
        ]
        .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        ".{0,24}".prop_map(Value::String),
        "[a-z_]{1,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map("[a-z_]{1,10}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// One edit of a JSON document: a value set at a path of keys and indices, a key
/// removed, an array cut, or the text's bytes flipped afterwards.
#[derive(Debug, Clone)]
enum JsonEdit {
    Set(Vec<usize>, Value),
    Remove(Vec<usize>),
    Cut(Vec<usize>, usize),
}

fn json_edit() -> impl Strategy<Value = JsonEdit> {
    let path = proptest::collection::vec(any::<usize>(), 1..4);
    prop_oneof![
        4 => (path.clone(), json_value()).prop_map(|(p, v)| JsonEdit::Set(p, v)),
        2 => path.clone().prop_map(JsonEdit::Remove),
        1 => (path, 0..4usize).prop_map(|(p, n)| JsonEdit::Cut(p, n)),
    ]
}

/// The node a path of choices leads to (each step picks a key or an index modulo the
/// node's size), with the last step's container and key.
fn edit_json(doc: &mut Value, edit: &JsonEdit) {
    let (path, last) = match edit {
        JsonEdit::Set(p, _) | JsonEdit::Remove(p) | JsonEdit::Cut(p, _) => (p, p.len() - 1),
    };
    let mut node = doc;
    for (i, &step) in path.iter().enumerate() {
        let at_end = i == last;
        let next = match node {
            Value::Object(map) if !map.is_empty() => {
                let key = map.keys().nth(step % map.len()).unwrap().clone();
                if at_end {
                    match edit {
                        JsonEdit::Set(_, v) => {
                            map.insert(key, v.clone());
                        }
                        JsonEdit::Remove(_) => {
                            map.remove(&key);
                        }
                        JsonEdit::Cut(_, n) => {
                            if let Some(Value::Array(a)) = map.get_mut(&key) {
                                a.truncate(*n);
                            }
                        }
                    }
                    return;
                }
                map.get_mut(&key).unwrap()
            }
            Value::Array(a) if !a.is_empty() => {
                let idx = step % a.len();
                if at_end {
                    match edit {
                        JsonEdit::Set(_, v) => a[idx] = v.clone(),
                        JsonEdit::Remove(_) => {
                            a.remove(idx);
                        }
                        JsonEdit::Cut(_, n) => a.truncate(*n),
                    }
                    return;
                }
                &mut a[idx]
            }
            _ => return,
        };
        node = next;
    }
}

/// Up to three byte flips of a text (none in three cases of four, so that most inputs
/// stay well-formed and reach the checks past the parser).
fn flips() -> impl Strategy<Value = Vec<(usize, u8)>> {
    prop_oneof![
        3 => Just(Vec::new()),
        1 => proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
    ]
}

fn flip(text: &str, flips: &[(usize, u8)]) -> Vec<u8> {
    let mut b = text.as_bytes().to_vec();
    if !b.is_empty() {
        for &(at, v) in flips {
            let i = at % b.len();
            b[i] = v;
        }
    }
    b
}

/// Replays `target`'s corpus through `load` (a file path to `true` when accepted).
fn replay_files(target: &str, tally: &mut Tally, load: &dyn Fn(&Path) -> bool) {
    for path in corpus(target) {
        tally
            .run(&path.display().to_string(), || load(&path))
            .unwrap();
    }
}

/// A policy document from a grammar of the keys policies have.
fn policy_doc() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("type"),
        Just("window"),
        Just("sink"),
        Just("heads"),
        Just("ranking"),
        Just("select"),
        Just("fraction"),
        Just("top_k"),
        Just("gqa"),
        Just("prefill"),
        Just("policies"),
        Just("probe"),
        Just("oracle"),
        Just("threshold"),
        Just("k"),
        Just("mode"),
        Just("layers"),
    ];
    let type_name = prop_oneof![
        Just("full"),
        Just("window"),
        Just("static_heads"),
        Just("dynamic_heads"),
        Just("topk_mask"),
        Just("ablate"),
        Just("compose"),
    ];
    // Mostly plausible values, so that many documents get past the types to the
    // range checks and the composition rules.
    let value = prop_oneof![
        3 => (0u64..300).prop_map(Value::from),
        1 => (0.0f64..1.0).prop_map(Value::from),
        1 => prop_oneof![
            Just("majority"),
            Just("any"),
            Just("full_then_evict"),
            Just("policies/rankings/SmolLM2-135M-Instruct.Q4_1/wu-niah.json"),
            Just("probes/SmolLM2-135M-Instruct.Q4_1/niah.json"),
        ]
        .prop_map(|t| Value::String(t.into())),
        1 => (0.0f64..1.0).prop_map(|f| json!({"fraction": f})),
        1 => (0u64..40).prop_map(|k| json!({"top_k": k})),
        1 => (0u64..40, 0.0f64..1.0).prop_map(|(k, f)| json!({
            "ranking": "policies/rankings/SmolLM2-135M-Instruct.Q4_1/wu-niah.json",
            "select": {"top_k": k, "fraction": f}
        })),
        2 => json_value(),
        1 => type_name.clone().prop_map(|t| Value::String(t.into())),
    ];
    (type_name, proptest::collection::btree_map(key, value, 0..6)).prop_map(|(t, rest)| {
        let mut m: serde_json::Map<String, Value> =
            rest.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        m.entry("type").or_insert(Value::String(t.into()));
        Value::Object(m)
    })
}

/// `doc` as TOML (JSON nulls have no TOML form and are dropped), or `None`.
fn to_toml(doc: &Value) -> Option<String> {
    fn strip(v: &Value) -> Value {
        match v {
            Value::Object(m) => Value::Object(
                m.iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(k, v)| (k.clone(), strip(v)))
                    .collect(),
            ),
            Value::Array(a) => Value::Array(a.iter().filter(|v| !v.is_null()).map(strip).collect()),
            v => v.clone(),
        }
    }
    let t: toml::Value = serde_json::from_value(strip(doc)).ok()?;
    toml::to_string(&t).ok()
}

fn fuzz_policy_toml(long: u32) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    LARGEST.store(0, Ordering::Relaxed);
    let dir = scratch("policy");
    let file = dir.join("p.toml");
    let load = |path: &Path| Policy::load(path, &[]).is_ok();
    let mut tally = Tally::default();
    replay_files("policy_toml", &mut tally, &load);
    let tally = Mutex::new(tally);
    let strategy = (
        policy_doc(),
        flips(),
        proptest::collection::vec(("[a-z_.]{1,12}", ".{0,12}"), 0..3),
    );
    runner(cases(1000, long), long > 1)
        .run(&strategy, |(doc, flips, sets)| {
            let Some(text) = to_toml(&doc) else {
                return Ok(());
            };
            std::fs::write(&file, flip(&text, &flips)).unwrap();
            let sets: Vec<String> = sets.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let mut t = lock(&tally);
            t.run(&text, || Policy::load(&file, &[]).is_ok())?;
            t.run(&format!("{sets:?}"), || {
                Policy::from_overrides(&sets).is_ok()
            })
        })
        .unwrap();
    tally
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .report("policy_toml");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A committed file of the repository.
fn committed(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Load and use a ranking: its table, its top heads and its heatmap.
fn use_ranking(path: &Path) -> bool {
    match Ranking::load(path) {
        Ok(r) => {
            let _ = r.top(20);
            let _ = headwise::policy::atlas::duo_tsv(&r);
            let _ = headwise::policy::atlas::heads_json(&r);
            let _ = r.heatmap_svg();
            headwise::policy::ranking::jaccard_top_k(&r, &r, 20).is_finite()
        }
        Err(_) => false,
    }
}

/// A JSON-document target: the committed `base` with up to three edits and byte
/// flips, written to `name` in a scratch folder and given to `load`.
fn fuzz_json_file(
    target: &str,
    base: &Path,
    name: &str,
    n: u32,
    long: u32,
    prepare: &dyn Fn(&Path),
    load: &dyn Fn(&Path) -> bool,
) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    LARGEST.store(0, Ordering::Relaxed);
    let dir = scratch(target);
    prepare(&dir);
    let file = dir.join(name);
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(base).unwrap()).unwrap();
    let mut tally = Tally::default();
    // Past crashers are copied to where the generated inputs go (beside the files
    // they name, such as a probe's weights).
    replay_files(target, &mut tally, &|path| {
        std::fs::copy(path, &file).unwrap();
        load(&file)
    });
    let tally = Mutex::new(tally);
    let strategy = (proptest::collection::vec(json_edit(), 1..4), flips());
    runner(cases(n, long), long > 1)
        .run(&strategy, |(edits, flips)| {
            let mut d = doc.clone();
            for e in &edits {
                edit_json(&mut d, e);
            }
            let text = serde_json::to_string_pretty(&d).unwrap();
            std::fs::write(&file, flip(&text, &flips)).unwrap();
            lock(&tally).run(&format!("{edits:?} {flips:?}"), || load(&file))
        })
        .unwrap();
    tally
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .report(target);
    let _ = std::fs::remove_dir_all(&dir);
}

fn fuzz_ranking_json(long: u32) {
    fuzz_json_file(
        "ranking_json",
        &committed("policies/rankings/SmolLM2-135M-Instruct.Q4_1/wu-niah.json"),
        "r.json",
        1000,
        long,
        &|_| {},
        &use_ranking,
    );
}

/// Load a probe and run it on a hidden state of its width.
fn use_probe(path: &Path) -> bool {
    match headwise::probe::Probe::load(path) {
        Ok(p) => {
            let hidden: Vec<f32> = (0..p.input_dim()).map(|i| (i as f32).sin()).collect();
            p.predict(&hidden).is_ok()
        }
        Err(_) => false,
    }
}

const PROBE_DIR: &str = "probes/SmolLM2-135M-Instruct.Q4_1";

fn fuzz_probe_card(long: u32) {
    let weights = committed(&format!("{PROBE_DIR}/niah.safetensors"));
    fuzz_json_file(
        "probe_card",
        &committed(&format!("{PROBE_DIR}/niah.json")),
        "niah.json",
        500,
        long,
        &|dir| {
            std::fs::copy(&weights, dir.join("niah.safetensors")).unwrap();
        },
        &use_probe,
    );
}

/// The weights file of a probe with bytes flipped, its card's checksum updated so that
/// the bytes reach the safetensors reader.
fn fuzz_probe_weights(long: u32) {
    use sha2::Digest;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    LARGEST.store(0, Ordering::Relaxed);
    let dir = scratch("probe-weights");
    let weights = std::fs::read(committed(&format!("{PROBE_DIR}/niah.safetensors"))).unwrap();
    let card: Value = serde_json::from_str(
        &std::fs::read_to_string(committed(&format!("{PROBE_DIR}/niah.json"))).unwrap(),
    )
    .unwrap();
    let tally = Mutex::new(Tally::default());
    // The safetensors header (its length, then JSON) is where the structure is.
    let head =
        (u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize + 8).min(weights.len());
    let edit = prop_oneof![
        3 => (0..head, any::<u8>()),
        1 => (0..8usize, any::<u8>()),
        1 => (0..weights.len(), any::<u8>()),
    ];
    let strategy = (
        proptest::collection::vec(edit, 1..4),
        proptest::option::of(0..weights.len()),
    );
    runner(cases(300, long), long > 1)
        .run(&strategy, |(edits, cut)| {
            let mut w = weights.clone();
            for &(at, v) in &edits {
                w[at] = v;
            }
            if let Some(n) = cut {
                w.truncate(n);
            }
            let mut c = card.clone();
            c["weights"]["sha256"] = Value::String(format!("{:x}", sha2::Sha256::digest(&w)));
            std::fs::write(dir.join("niah.safetensors"), &w).unwrap();
            std::fs::write(dir.join("niah.json"), serde_json::to_string(&c).unwrap()).unwrap();
            lock(&tally).run(&format!("{edits:?} {cut:?}"), || {
                use_probe(&dir.join("niah.json"))
            })
        })
        .unwrap();
    tally
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .report("probe_weights");
    let _ = std::fs::remove_dir_all(&dir);
}

fn fuzz_eval_spec(long: u32) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    LARGEST.store(0, Ordering::Relaxed);
    let dir = scratch("spec");
    let file = dir.join("spec.toml");
    let text = std::fs::read_to_string(committed("eval/ablation-smollm2.toml")).unwrap();
    let doc: Value = serde_json::to_value(toml::from_str::<toml::Value>(&text).unwrap()).unwrap();
    let load = |p: &Path| headwise::lab::eval::spec::EvalSpec::load(p).is_ok();
    let mut tally = Tally::default();
    replay_files("eval_spec", &mut tally, &load);
    let tally = Mutex::new(tally);
    let strategy = (proptest::collection::vec(json_edit(), 1..4), flips());
    runner(cases(1000, long), long > 1)
        .run(&strategy, |(edits, flips)| {
            let mut d = doc.clone();
            for e in &edits {
                edit_json(&mut d, e);
            }
            let Some(text) = to_toml(&d) else {
                return Ok(());
            };
            std::fs::write(&file, flip(&text, &flips)).unwrap();
            lock(&tally).run(&text, || load(&file))
        })
        .unwrap();
    tally
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .report("eval_spec");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------
// Servers

/// A body: a JSON document (maybe nested deep, maybe huge), or its text with bytes
/// flipped.
fn body_bytes(doc: impl Strategy<Value = Value>) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        16 => (doc, flips()).prop_map(|(d, f)| flip(&d.to_string(), &f)),
        1 => (1usize..20_000).prop_map(|depth| {
            let mut s = "[".repeat(depth);
            s.push_str(&"]".repeat(depth));
            s.into_bytes()
        }),
        1 => proptest::collection::vec(any::<u8>(), 0..64),
    ]
}

/// A chat (`messages`) or completion (`prompt`) body from a grammar of the OpenAI
/// fields, values of any type.
fn openai_doc(chat: bool) -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        6 => Just(json!("user")),
        1 => Just(json!("system")),
        1 => Just(json!("assistant")),
        1 => json_value()
    ];
    let content = prop_oneof![
        8 => ".{1,40}".prop_map(Value::String),
        1 => json_value(),
        1 => (1usize..600).prop_map(|n| Value::String("é".repeat(n))),
    ];
    let message = (role, content).prop_map(|(r, c)| json!({"role": r, "content": c}));
    let messages = prop_oneof![
        8 => proptest::collection::vec(message, 1..4).prop_map(Value::Array),
        1 => Just(json!([])),
        1 => json_value(),
    ];
    // Each field: absent, a plausible value, or (one time in four) any JSON value.
    let field = |plausible: BoxedStrategy<Value>| {
        proptest::option::weighted(0.3, prop_oneof![3 => plausible, 1 => json_value()])
    };
    let fields = (
        field((1u64..5).prop_map(Value::from).boxed()),
        field((0.0f64..2.0).prop_map(Value::from).boxed()),
        field((0.01f64..1.0).prop_map(Value::from).boxed()),
        field(any::<bool>().prop_map(Value::from).boxed()),
        field(".{0,6}".prop_map(Value::String).boxed()),
        field(any::<bool>().prop_map(Value::from).boxed()),
        field((0u64..6).prop_map(Value::from).boxed()),
        field(any::<u64>().prop_map(Value::from).boxed()),
        field(
            any::<bool>()
                .prop_map(|b| json!({"include_usage": b}))
                .boxed(),
        ),
        field(
            prop_oneof![Just("full"), Just("static-locos"), Just("nope")]
                .prop_map(|p| json!({"policy": p}))
                .boxed(),
        ),
    );
    const NAMES: [&str; 10] = [
        "max_tokens",
        "temperature",
        "top_p",
        "stream",
        "stop",
        "logprobs",
        "top_logprobs",
        "seed",
        "stream_options",
        "headwise",
    ];
    (messages, fields).prop_map(move |(messages, f)| {
        let values = [f.0, f.1, f.2, f.3, f.4, f.5, f.6, f.7, f.8, f.9];
        let mut m: serde_json::Map<String, Value> = NAMES
            .iter()
            .zip(values)
            .filter_map(|(k, v)| Some((k.to_string(), v?)))
            .collect();
        match chat {
            true => m.insert("messages".into(), messages),
            // A completion's prompt: the first message's content, whatever its type.
            false => m.insert("prompt".into(), messages[0]["content"].clone()),
        };
        Value::Object(m)
    })
}

/// Status and body of one POST, or the transport error.
fn post(
    client: &reqwest::blocking::Client,
    url: &str,
    body: Vec<u8>,
) -> Result<(u16, String), String> {
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let text = resp.text().map_err(|e| e.to_string())?;
    Ok((status, text))
}

/// Drive a running server with `n` bodies from `strategy` at `paths` (picked per body),
/// every answer a 2xx or a 4xx with a JSON error, the server up at the end.
fn fuzz_server(
    target: &str,
    server: &mut common::server::Spawned,
    paths: &[&str],
    strategy: impl Strategy<Value = (usize, Vec<u8>)>,
    n: u32,
    long: u32,
    peak_bound: u64,
) {
    let client = reqwest::blocking::Client::builder()
        // A hang guard, not a speed test.
        .timeout(REQUEST_BOUND)
        .build()
        .unwrap();
    let mut tally = Tally::default();
    for path in corpus(target) {
        let body = std::fs::read(&path).unwrap();
        let (status, text) = post(&client, &server.url(paths[0]), body).unwrap();
        assert!(status < 500, "{}: {status} {text}", path.display());
        tally
            .run(&path.display().to_string(), || status < 300)
            .unwrap();
    }
    let tally = Mutex::new(tally);
    runner(cases(n, long), long > 1)
        .run(&strategy, |(p, body)| {
            let shown = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            let (status, text) = post(&client, &server.url(paths[p]), body)
                .map_err(|e| TestCaseError::fail(format!("{shown}: {e}")))?;
            if std::env::var_os("HEADWISE_FUZZ_SHOW").is_some() {
                eprintln!(
                    "{status} {shown} -> {}",
                    text.chars().take(200).collect::<String>()
                );
            }
            if status >= 500 {
                return Err(TestCaseError::fail(format!("{shown}: {status} {text}")));
            }
            if status >= 400 && serde_json::from_str::<Value>(&text).is_err() {
                return Err(TestCaseError::fail(format!(
                    "{shown}: {status} not JSON: {text}"
                )));
            }
            // Bounded by the client's timeout: a slower answer is an error above.
            lock(&tally).note(&shown, Duration::ZERO, status < 300)
        })
        .unwrap();
    assert!(
        server.running(),
        "{target}: the server died: {:?}",
        server.log.lock().unwrap()
    );
    let peak = server.peak_rss();
    let tally = tally.into_inner().unwrap_or_else(|e| e.into_inner());
    println!(
        "fuzz {target}: {} inputs ({} answered 2xx, {} 4xx), 0 5xx, server peak RSS {:.0} MiB",
        tally.inputs,
        tally.ok,
        tally.inputs - tally.ok,
        peak as f64 / (1 << 20) as f64
    );
    assert!(peak <= peak_bound, "{target}: server peak RSS {peak} bytes");
}

fn fuzz_openai_bodies(long: u32) {
    let dir = scratch("openai");
    let cfg = dir.join("serve.toml");
    // Short generations keep each accepted request quick; the answer shape is the point.
    std::fs::write(
        &cfg,
        "max_tokens_limit = 4\ndefault_max_tokens = 2\nmax_concurrency = 1\n\
         [policies]\nstatic-locos = \"policies/static-locos.toml\"\n",
    )
    .unwrap();
    let mut server = common::server::Spawned::start(common::server::serve_command(&cfg));
    fuzz_server(
        "openai_bodies",
        &mut server,
        &["/v1/chat/completions", "/v1/completions"],
        prop_oneof![
            3 => body_bytes(openai_doc(true)).prop_map(|b| (0, b)),
            1 => body_bytes(openai_doc(false)).prop_map(|b| (1, b)),
        ],
        400,
        long,
        4 << 30,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn search_doc() -> impl Strategy<Value = Value> {
    let text = prop_oneof![
        4 => ".{0,60}".prop_map(Value::String),
        1 => (1usize..2000).prop_map(|n| Value::String("capital Lisbon ".repeat(n))),
        1 => (1000usize..1100).prop_map(|n| {
            Value::String((0..n).map(|i| format!("t{i}")).collect::<Vec<_>>().join(" "))
        }),
        1 => json_value(),
    ];
    let matched = prop_oneof![
        3 => ("[a-z]{1,5}", text.clone()).prop_map(|(f, t)| json!({ f: t })),
        1 => ("[a-z]{1,5}", text).prop_map(|(f, t)| json!({ f: {"query": t} })),
        1 => json_value(),
    ];
    let size = prop_oneof![2 => (0u64..20).prop_map(Value::from), 1 => json_value()];
    let source = prop_oneof![
        Just(json!(true)),
        Just(json!(false)),
        Just(json!(["title", "txt"])),
        json_value()
    ];
    (
        matched,
        proptest::option::of(size),
        proptest::option::of(source),
    )
        .prop_map(|(m, size, source)| {
            let mut d = json!({"query": {"match": m}});
            if let Some(s) = size {
                d["size"] = s;
            }
            if let Some(s) = source {
                d["_source"] = s;
            }
            d
        })
}

fn fuzz_search_bodies(long: u32) {
    let dir = scratch("search");
    let index = common::server::build_index(
        &dir,
        "{\"id\": \"a\", \"title\": \"Lisbon\", \"text\": \"Lisbon is the capital of Portugal.\"}\n\
         {\"id\": \"b\", \"title\": \"Oslo\", \"text\": \"Oslo is the capital of Norway.\"}\n",
    );
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_headwise"));
    cmd.args(["retriever", "serve", "--port", "0", "--index"])
        .arg(&index);
    let mut server = common::server::Spawned::start(cmd);
    fuzz_server(
        "search_bodies",
        &mut server,
        &["/wiki/_search"],
        body_bytes(search_doc()).prop_map(|b| (0, b)),
        2000,
        long,
        2 << 30,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------
// The runs: one test per target in CI, all of them 20 times longer when asked.

#[test]
fn gguf_header() {
    fuzz_gguf_header(1);
}

#[test]
fn gguf_metadata() {
    fuzz_gguf_metadata(1);
}

#[test]
fn policy_toml() {
    fuzz_policy_toml(1);
}

#[test]
fn ranking_json() {
    fuzz_ranking_json(1);
}

#[test]
fn probe_card() {
    fuzz_probe_card(1);
}

#[test]
fn probe_weights() {
    fuzz_probe_weights(1);
}

#[test]
fn eval_spec() {
    fuzz_eval_spec(1);
}

#[test]
fn openai_bodies() {
    fuzz_openai_bodies(1);
}

#[test]
fn search_bodies() {
    fuzz_search_bodies(1);
}

#[test]
#[ignore = "the long run: minutes; `cargo test --release --test fuzz -- --ignored`"]
fn every_target_twenty_times_longer() {
    fuzz_gguf_header(20);
    fuzz_gguf_metadata(20);
    fuzz_policy_toml(20);
    fuzz_ranking_json(20);
    fuzz_probe_card(20);
    fuzz_probe_weights(20);
    fuzz_eval_spec(20);
    fuzz_search_bodies(20);
    fuzz_openai_bodies(20);
}
