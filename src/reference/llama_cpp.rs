//! llama.cpp as a reference engine, through its own binaries: a `llama-server` child
//! process on loopback (tokenization, greedy completions with the top-2 log-probabilities
//! of every step) and `llama-perplexity`.
//!
//! The binaries come from `../shared/tools/build-llama-bench.sh` (which builds them under
//! `$HOME/.cache/llama-bench`); [`LlamaCppBins::find`] looks there, in a portable build
//! next to it, or in a given folder, and keeps the first whose binaries actually compute
//! (a `GGML_NATIVE` build can start fine and die with SIGILL in its first matmul on a
//! virtual CPU that reports more than it runs).

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::model::numerics::ggml::Simd;
use crate::reference::GreedyTrace;
use crate::wait;
use crate::{Error, Result};

/// Where the workplace's build script puts the binaries, under `$HOME`.
const CACHE_BUILDS: &[&str] = &[
    ".cache/llama-bench/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin",
    ".cache/llama-bench/llama_cpp_python-0.3.36/vendor/llama.cpp/build-portable/bin",
];

/// How llama.cpp runs attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// Plain (not flash) attention over an f32 KV cache, a full-size sliding-window cache
    /// (so that cache cells are positions, as the instrumented model's lanes assume),
    /// weights not repacked and no tiled K-quant matmul (`GGML_CPU_TILED_MM=0`): every
    /// operation in the kernels that the instrumented model's `ggml` numerics reproduce
    /// bit for bit.
    F32,
    /// llama.cpp's defaults: an f16 KV cache and flash attention where available.
    Default,
}

impl Attention {
    fn flags(self) -> &'static [&'static str] {
        match self {
            Attention::F32 => &[
                "-fa",
                "off",
                "-ctk",
                "f32",
                "-ctv",
                "f32",
                "--swa-full",
                "--no-repack",
            ],
            Attention::Default => &[],
        }
    }

    /// Environment of the child: whether ggml may take its tiled K-quant matmul.
    fn env(self) -> [(&'static str, &'static str); 1] {
        let tiled = match self {
            Attention::F32 => "0",
            Attention::Default => "1",
        };
        [("GGML_CPU_TILED_MM", tiled)]
    }
}

fn err(msg: impl Into<String>) -> Error {
    Error::LlamaCpp(msg.into())
}

/// A folder holding working `llama-server` and `llama-perplexity` binaries, and the x86
/// path their ggml was compiled for (`None`: neither AVX2 + FMA nor AVX-512).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlamaCppBins {
    dir: PathBuf,
    simd: Option<Simd>,
}

impl LlamaCppBins {
    /// `dir` if given, else the first known build location whose binaries run and
    /// compute with `model` (a two-chunk perplexity over a few tokens).
    pub fn find(dir: Option<&Path>, model: &Path) -> Result<Self> {
        let candidates: Vec<PathBuf> = match dir {
            Some(d) => vec![d.to_path_buf()],
            None => {
                let home = std::env::var_os("HOME")
                    .map(PathBuf::from)
                    .unwrap_or_default();
                CACHE_BUILDS.iter().map(|p| home.join(p)).collect()
            }
        };
        let mut tried = Vec::new();
        for dir in candidates {
            match Self::check(&dir, model) {
                Ok(simd) => return Ok(Self { dir, simd }),
                Err(e) => tried.push(e.to_string()),
            }
        }
        Err(err(format!(
            "no working llama-server/llama-perplexity ({}); build them with \
             ../shared/tools/build-llama-bench.sh or pass --llama-bin DIR",
            tried.join("; ")
        )))
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The x86 path of the build's f32 kernels (from its `system_info` line): what
    /// `ggml` numerics must follow to compute as it does; `None` for a build with
    /// neither (which `ggml` numerics cannot follow).
    pub fn simd(&self) -> Option<Simd> {
        self.simd
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Both binaries in `dir` exist and `--version` exits cleanly, and `llama-perplexity`
    /// evaluates two chunks of 16 tokens of `model`; returns the build's x86 path.
    fn check(dir: &Path, model: &Path) -> Result<Option<Simd>> {
        let probe_bins = Self {
            dir: dir.to_path_buf(),
            simd: None,
        };
        for name in ["llama-server", "llama-perplexity"] {
            let path = probe_bins.bin(name);
            if !path.is_file() {
                return Err(err(format!("{} missing", path.display())));
            }
            let status = wait::output_within(
                Command::new(&path).arg("--version"),
                wait::setting(wait::LLAMA_STARTUP)?,
                &format!("{name} --version"),
                wait::LLAMA_STARTUP.0,
            )
            .map_err(|e| err(format!("{}: {e}", path.display())))?
            .status;
            if !status.success() {
                return Err(err(format!("{} does not run ({status})", path.display())));
            }
        }
        let text =
            std::env::temp_dir().join(format!("headwise-llama-probe-{}.txt", std::process::id()));
        std::fs::write(
            &text,
            "one two three four five six seven eight nine ten. ".repeat(8),
        )
        .map_err(|e| Error::io(&text, e))?;
        let probe = probe_bins.perplexity(model, &text, 16, 2, 1);
        let _ = std::fs::remove_file(&text);
        let (_, log) = probe.map_err(|e| err(format!("{}: {e}", dir.display())))?;
        Ok(build_simd(&log))
    }

    /// `llama-perplexity` on `text_file` in chunks of `n_ctx`, `chunks` of them, with
    /// [`Attention::F32`]; returns its final estimate and everything it printed.
    pub fn perplexity(
        &self,
        model: &Path,
        text_file: &Path,
        n_ctx: usize,
        chunks: usize,
        threads: usize,
    ) -> Result<(f64, String)> {
        let settings = (Attention::F32.flags(), Attention::F32.env());
        self.perplexity_under(model, text_file, n_ctx, chunks, threads, settings)
    }

    /// [`LlamaCppBins::perplexity`] with the KV cache in `cache` (`f16`, `q8_0`: `-fa on
    /// -ctk <cache> -ctv <cache>`, as a quantized V cache needs flash attention; `f32`:
    /// `-fa off`, since the CPU's flash attention computes in f16 whatever the cache
    /// holds), llama.cpp's kernels otherwise as it chooses them.
    pub fn perplexity_with_cache(
        &self,
        model: &Path,
        text_file: &Path,
        n_ctx: usize,
        chunks: usize,
        threads: usize,
        cache: &str,
    ) -> Result<(f64, String)> {
        let flash = if cache == "f32" { "off" } else { "on" };
        let flags = ["-fa", flash, "-ctk", cache, "-ctv", cache];
        let settings = (&flags[..], Attention::Default.env());
        self.perplexity_under(model, text_file, n_ctx, chunks, threads, settings)
    }

    fn perplexity_under(
        &self,
        model: &Path,
        text_file: &Path,
        n_ctx: usize,
        chunks: usize,
        threads: usize,
        (flags, env): (&[&str], [(&str, &str); 1]),
    ) -> Result<(f64, String)> {
        let out = wait::output_within(
            Command::new(self.bin("llama-perplexity"))
                .arg("-m")
                .arg(model)
                .arg("-f")
                .arg(text_file)
                .args(["-c", &n_ctx.to_string(), "-b", &n_ctx.to_string()])
                .args(["--chunks", &chunks.to_string(), "-t", &threads.to_string()])
                .args(flags)
                .envs(env),
            wait::setting(wait::LLAMA_TIMEOUT)?,
            "llama-perplexity",
            wait::LLAMA_TIMEOUT.0,
        )
        .map_err(|e| err(format!("llama-perplexity: {e}")))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        match parse_final_estimate(&text) {
            Some(ppl) => Ok((ppl, text)),
            None => {
                let tail: Vec<&str> = text.lines().rev().take(3).collect();
                Err(err(format!(
                    "llama-perplexity ({}) printed no final estimate: {}",
                    out.status,
                    tail.join(" | ")
                )))
            }
        }
    }
}

/// The x86 path a llama.cpp build compiled its f32 kernels for, from the features its
/// `system_info` line lists (`... | AVX2 = 1 | ... | AVX512 = 1 | ...`).
fn build_simd(log: &str) -> Option<Simd> {
    let info = log.lines().find(|l| l.contains("system_info"))?;
    let on = |name: &str| {
        info.split('|').any(|f| {
            f.trim()
                .strip_prefix(name)
                .is_some_and(|r| r.trim() == "= 1")
        })
    };
    // ggml's AVX2 softmax, `exp` and fused products need FMA too; its AVX-512 softmax
    // needs DQ, which `system_info` does not list (every AVX-512 CPU measured has it).
    if on("AVX512") {
        Some(Simd::Avx512)
    } else if on("AVX2") && on("FMA") {
        Some(Simd::Avx2)
    } else {
        None
    }
}

/// The number in `Final estimate: PPL = 12.3456 +/- 0.1`.
fn parse_final_estimate(text: &str) -> Option<f64> {
    let rest = text.split("Final estimate: PPL =").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

/// A `llama-server` child process on a free loopback port; stopped when dropped.
pub struct LlamaServer {
    child: Child,
    base: String,
    client: reqwest::blocking::Client,
    log: PathBuf,
}

impl LlamaServer {
    /// Start `llama-server` on `model` with a context of `ctx` tokens and wait until it
    /// reports healthy.
    pub fn start(
        bins: &LlamaCppBins,
        model: &Path,
        ctx: usize,
        threads: usize,
        attention: Attention,
    ) -> Result<Self> {
        Self::start_parallel(bins, model, ctx, threads, attention, 1)
    }

    /// [`LlamaServer::start`] with `parallel` slots sharing the context of `ctx` tokens,
    /// continuously batched (`-np parallel -cb`): the serving anchor of `bench serve`.
    pub fn start_parallel(
        bins: &LlamaCppBins,
        model: &Path,
        ctx: usize,
        threads: usize,
        attention: Attention,
        parallel: usize,
    ) -> Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| err(format!("no free loopback port: {e}")))?
            .port();
        let log = std::env::temp_dir().join(format!("headwise-llama-server-{port}.log"));
        let log_file = std::fs::File::create(&log).map_err(|e| Error::io(&log, e))?;
        let child = Command::new(bins.bin("llama-server"))
            .arg("-m")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "-c",
                &ctx.to_string(),
                "-t",
                &threads.to_string(),
                "-np",
                &parallel.max(1).to_string(),
            ])
            .args(if parallel > 1 { &["-cb"][..] } else { &[] })
            .args(attention.flags())
            .envs(attention.env())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(|e| err(format!("llama-server: {e}")))?;
        let startup = wait::setting(wait::LLAMA_STARTUP)?;
        let client = reqwest::blocking::Client::builder()
            .timeout(wait::setting(wait::LLAMA_TIMEOUT)?)
            .build()
            .map_err(|e| err(format!("HTTP client: {e}")))?;
        let mut server = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            client,
            log,
        };
        server.wait_healthy(startup)?;
        Ok(server)
    }

    /// The server's address, `http://127.0.0.1:PORT`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Poll `/health` until the model is loaded, at most `startup`.
    fn wait_healthy(&mut self, startup: Duration) -> Result<()> {
        let started = Instant::now();
        while started.elapsed() < startup {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(err(format!(
                    "llama-server exited ({status}) while loading: {}",
                    self.log_tail()
                )));
            }
            let ok = self
                .client
                .get(format!("{}/health", self.base))
                .timeout(Duration::from_secs(2))
                .send()
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(err(format!(
            "llama-server not healthy after {} s (raise {} to wait longer): {}",
            startup.as_secs(),
            wait::LLAMA_STARTUP.0,
            self.log_tail()
        )))
    }

    fn log_tail(&self) -> String {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut text);
        }
        let tail: Vec<&str> = text.lines().rev().take(3).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    fn post(&self, path: &str, body: Value) -> Result<Value> {
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .map_err(|e| err(format!("POST {path}: {e}")))?;
        let status = response.status();
        let value: Value = response
            .json()
            .map_err(|e| err(format!("POST {path}: bad JSON ({e})")))?;
        if !status.is_success() {
            return Err(err(format!("POST {path}: {status} {value}")));
        }
        Ok(value)
    }

    /// Token ids of `text` by llama.cpp's tokenizer (`add_special`: BOS as the model
    /// wants it).
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let v = self.post(
            "/tokenize",
            json!({"content": text, "add_special": add_special}),
        )?;
        ids(&v["tokens"]).ok_or_else(|| err(format!("/tokenize: no token ids in {v}")))
    }

    /// `n` greedy tokens after `prompt` (EOS ignored), with the gap between the top two
    /// log-probabilities of every step (equal to the logit gap).
    pub fn greedy(&self, prompt: &[u32], n: usize) -> Result<GreedyTrace> {
        let v = self.post(
            "/completion",
            json!({
                "prompt": prompt,
                "n_predict": n,
                "temperature": 0.0,
                "top_k": 1,
                "n_probs": 2,
                "ignore_eos": true,
                "cache_prompt": false,
                "return_tokens": true,
            }),
        )?;
        let tokens = ids(&v["tokens"]).ok_or_else(|| err("/completion: no tokens"))?;
        let steps = v["completion_probabilities"]
            .as_array()
            .ok_or_else(|| err("/completion: no completion_probabilities"))?;
        let top2_gaps = steps
            .iter()
            .map(|s| {
                let top = s["top_logprobs"].as_array()?;
                let lp = |i: usize| top.get(i)?.get("logprob")?.as_f64();
                Some((lp(0)? - lp(1)?) as f32)
            })
            .collect::<Option<Vec<f32>>>()
            .ok_or_else(|| err("/completion: steps without two top log-probabilities"))?;
        if tokens.len() != n || top2_gaps.len() != n {
            return Err(err(format!(
                "/completion returned {} tokens and {} steps, asked for {n}",
                tokens.len(),
                top2_gaps.len()
            )));
        }
        Ok(GreedyTrace { tokens, top2_gaps })
    }
}

fn ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_path_is_read_from_system_info() {
        let avx512 = "load\nsystem_info: n_threads = 2 | CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | \
                      F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 | LLAMAFILE = 1 |\n";
        assert_eq!(build_simd(avx512), Some(Simd::Avx512));
        let avx2 =
            "system_info: n_threads = 2 | CPU : AVX = 1 | AVX2 = 1 | FMA = 1 | AVX512_VNNI = 1 |";
        assert_eq!(build_simd(avx2), Some(Simd::Avx2));
        // Without FMA ggml's AVX2 build takes other (unfused, 4-lane) kernels.
        let no_fma = "system_info: CPU : AVX = 1 | AVX2 = 1 | F16C = 1 |";
        assert_eq!(build_simd(no_fma), None);
        assert_eq!(build_simd("system_info: CPU : SSE3 = 1 | AVX = 1 |"), None);
        assert_eq!(build_simd("no such line"), None);
    }

    #[test]
    fn the_final_estimate_is_read_from_llama_perplexity_output() {
        let text = "[1]14.2,[2]15.0,\nFinal estimate: PPL = 15.0123 +/- 0.41234\n";
        assert_eq!(parse_final_estimate(text), Some(15.0123));
        assert_eq!(parse_final_estimate("failed to load model"), None);
    }

    #[test]
    fn a_folder_without_the_binaries_is_a_clear_error() {
        let e = LlamaCppBins::find(Some(Path::new("/nonexistent/bin")), Path::new("m.gguf"));
        let e = e.unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("llama-server missing") && e.contains("--llama-bin"),
            "{e}"
        );
    }
}
