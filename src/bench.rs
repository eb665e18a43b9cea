//! Pieces of `headwise bench`: deterministic prompt text, peak-memory readings and the
//! record one measurement produces. Each measurement runs in a fresh process so that the
//! peak resident memory belongs to one engine alone.

use serde::{Deserialize, Serialize};

/// One engine at one prompt length, measured in its own process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchRecord {
    /// `instrumented` or `mistralrs`.
    pub engine: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub decode_tokens: usize,
    /// Prompt tokens per second.
    pub prefill_tok_s: f64,
    /// Generated tokens per second after the first.
    pub decode_tok_s: f64,
    /// Peak resident set of the process (bytes), from `VmHWM`.
    pub peak_rss_bytes: Option<u64>,
}

/// Deterministic filler: `n` numbered notes of ~17 tokens each, with an optional needle
/// sentence after note `needle_after`.
pub fn synthetic_notes(n: usize, needle_after: Option<usize>) -> String {
    const CITIES: &[&str] = &[
        "Lisbon", "Oslo", "Kyoto", "Lima", "Cairo", "Dublin", "Quito", "Perth", "Turin", "Hanoi",
    ];
    const THINGS: &[&str] = &[
        "a red bicycle",
        "an old clock",
        "a blue kite",
        "a wooden boat",
        "a silver key",
        "a paper lamp",
        "a glass bird",
        "a green hat",
    ];
    let mut text = String::new();
    for i in 0..n {
        let city = CITIES[(i * 7) % CITIES.len()];
        let thing = THINGS[(i * 3) % THINGS.len()];
        text.push_str(&format!(
            "Note {}: In {city}, a traveller found {thing} near the market on day {}.\n",
            i + 1,
            (i * 13) % 31 + 1
        ));
        if Some(i) == needle_after {
            text.push_str("Note 51b: The secret number of the archive is 4817.\n");
        }
    }
    text
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if readable.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_deterministic_and_hold_the_needle_once() {
        let a = synthetic_notes(60, Some(50));
        assert_eq!(a, synthetic_notes(60, Some(50)));
        assert_eq!(a.matches("4817").count(), 1);
        assert_eq!(a.lines().count(), 61);
    }

    #[test]
    fn peak_rss_is_read_on_linux() {
        let rss = peak_rss_bytes().expect("VmHWM");
        assert!(rss > 1 << 20);
    }
}
