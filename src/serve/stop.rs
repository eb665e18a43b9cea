//! Stop strings over streamed text: text is released as soon as it cannot be the start
//! of a stop string, and generation ends at the first stop string, which is left out.

/// Holds back the tail of the text that might still become a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text seen but not yet released.
    pending: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Self::default()
        }
    }

    /// Add `piece`; returns the text that is now safe to release. After a stop string,
    /// [`StopMatcher::stopped`] is true and nothing more is released.
    pub fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.pending.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.stopped = true;
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return out;
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| held_tail(&self.pending, s))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        out
    }

    /// Whether a stop string has been seen.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The held-back text, at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`, on
/// character boundaries.
fn held_tail(text: &str, stop: &str) -> usize {
    let longest = text.len().min(stop.len().saturating_sub(1));
    (1..=longest)
        .rev()
        .find(|&n| {
            let start = text.len() - n;
            text.is_char_boundary(start) && stop.starts_with(&text[start..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `pieces`; return the released text and whether it stopped.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            out.push_str(&m.push(p));
        }
        if !m.stopped() {
            out.push_str(&m.finish());
        }
        (out, m.stopped())
    }

    #[test]
    fn stop_split_across_pieces_is_cut() {
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(run(&["END"], &["xE", "N", "Dy"]), ("x".into(), true));
        assert_eq!(run(&["b", "abc"], &["zab"]), ("za".into(), true));
    }

    #[test]
    fn near_misses_are_released() {
        assert_eq!(run(&["END"], &["EN", "d"]), ("ENd".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
    }

    #[test]
    fn held_text_is_released_as_soon_as_it_cannot_match() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("go ST"), "go ");
        assert_eq!(m.push("x"), "STx");
        assert_eq!(m.push("ST"), "");
        assert_eq!(m.push("OP and more"), "");
        assert!(m.stopped());
        assert_eq!(m.push("later"), "");
    }
}
