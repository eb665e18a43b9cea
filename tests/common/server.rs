//! A server child process for the tests that talk HTTP to the real binary.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running `headwise serve` / `headwise retriever serve`, killed when dropped.
pub struct Spawned {
    pub child: Child,
    /// `http://host:port`.
    pub base: String,
    /// Every stderr line so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Spawned {
    /// Start `cmd` (a `headwise` command that binds port 0) and wait, at most 120 s,
    /// for the address it prints on stderr (`... on http://ADDR`).
    pub fn start(mut cmd: Command) -> Spawned {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the headwise binary");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("on http://").nth(1) {
                    let _ = tx.send(addr.trim().to_string());
                }
                sink.lock().unwrap().push(line);
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("server did not start: {:?}", log.lock().unwrap()));
        Spawned {
            child,
            base: format!("http://{addr}"),
            log,
        }
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `host:port`.
    pub fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The process's peak resident memory so far, in bytes (Linux `VmHWM`; 0 if
    /// unreadable).
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    /// Send SIGTERM to the process.
    pub fn terminate(&self) {
        let pid = self.child.id() as i32;
        // SAFETY: signalling a child this test started and still owns.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }

    /// The exit status, waiting at most `bound` (a hang guard: the test fails when the
    /// process is still running then).
    pub fn exit_within(&mut self, bound: Duration) -> std::process::ExitStatus {
        let end = Instant::now() + bound;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < end,
                "the server did not exit within {bound:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `headwise serve` on a free port with the settings file `config` and the real SmolLM2,
/// run from the repository root (where the preset files are), no API key from the
/// environment.
pub fn serve_command(config: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_headwise"));
    cmd.args(["serve", "--port", "0", "--config"])
        .arg(config)
        .arg("--model")
        .arg(super::real_model())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("HEADWISE_API_KEY");
    cmd
}

/// A BM25 index of `passages` (JSON lines) built by the binary in `dir/index` (replaced
/// if it exists), for the tests that serve or search one.
pub fn build_index(dir: &Path, passages: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let corpus = dir.join("corpus.jsonl");
    std::fs::write(&corpus, passages).unwrap();
    let index = dir.join("index");
    let _ = std::fs::remove_dir_all(&index);
    let out = Command::new(env!("CARGO_BIN_EXE_headwise"))
        .args(["retriever", "index"])
        .arg(&corpus)
        .arg("--out")
        .arg(&index)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    index
}
