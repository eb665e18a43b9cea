//! Progress bars: indicatif's on a terminal; in a log (stderr redirected, as for a long
//! run under `nohup`) the same line as plain text at most once a minute (when the bar
//! moves), so that a log says how far a run of hours has come.

use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};

/// How often a log gets the bar's line; the first comes this long after the start, so a
/// short command's output stays as it is.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// A progress bar of `len` steps drawn with `template` (indicatif's syntax; a template
/// it cannot read falls back to its plain bar).
pub fn progress(len: u64, template: &str) -> ProgressBar {
    let style =
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
    let bar = ProgressBar::new(len).with_style(style);
    if !io::IsTerminal::is_terminal(&io::stderr()) {
        let log = LogLines::new(LOG_EVERY, Arc::new(Mutex::new(io::stderr())));
        bar.set_draw_target(ProgressDrawTarget::term_like(Box::new(log)));
    }
    bar
}

/// Where a log's lines go (stderr; a buffer in tests).
type Sink = Arc<Mutex<dyn Write + Send>>;

/// A draw target that prints the bar's line at most once per `every`, and ignores the
/// cursor movements a terminal redraw uses.
struct LogLines {
    every: Duration,
    /// When the last line was printed (at first: when the bar was made).
    last: Mutex<Instant>,
    out: Sink,
}

impl std::fmt::Debug for LogLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogLines")
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}

impl LogLines {
    fn new(every: Duration, out: Sink) -> Self {
        Self {
            every,
            last: Mutex::new(Instant::now()),
            out,
        }
    }

    /// Whether a line drawn now is printed (and if so, the clock restarts).
    fn due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let due = last.elapsed() >= self.every;
        if due {
            *last = Instant::now();
        }
        due
    }

    fn emit(&self, line: &str) -> io::Result<()> {
        let line = line.trim_end();
        if line.trim().is_empty() || !self.due() {
            return Ok(());
        }
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        writeln!(out, "{line}")
    }
}

impl TermLike for LogLines {
    fn width(&self) -> u16 {
        120
    }

    fn move_cursor_up(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn move_cursor_down(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn move_cursor_right(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn move_cursor_left(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn write_line(&self, s: &str) -> io::Result<()> {
        self.emit(s)
    }

    fn write_str(&self, s: &str) -> io::Result<()> {
        self.emit(s)
    }

    fn clear_line(&self) -> io::Result<()> {
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bar(every: Duration, buffer: &Arc<Mutex<Vec<u8>>>) -> ProgressBar {
        let log = LogLines::new(every, buffer.clone());
        ProgressBar::with_draw_target(Some(10), ProgressDrawTarget::term_like(Box::new(log)))
            .with_style(ProgressStyle::with_template("{pos}/{len} prompts").unwrap())
    }

    fn text(buffer: &Arc<Mutex<Vec<u8>>>) -> String {
        String::from_utf8(buffer.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn a_log_gets_nothing_before_the_interval() {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let b = bar(Duration::from_secs(3600), &buffer);
        b.inc(1);
        b.inc(2);
        assert_eq!(text(&buffer), "");
    }

    #[test]
    fn a_log_gets_the_bar_line_as_plain_text_once_due() {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let b = bar(Duration::ZERO, &buffer);
        b.inc(1);
        b.inc(2);
        assert_eq!(text(&buffer), "1/10 prompts\n3/10 prompts\n");
    }

    #[test]
    fn the_clock_restarts_after_each_line() {
        let log = LogLines::new(Duration::from_secs(10), Arc::new(Mutex::new(io::sink())));
        assert!(!log.due());
        *log.last.lock().unwrap() -= Duration::from_secs(11);
        assert!(log.due());
        assert!(!log.due());
    }
}
