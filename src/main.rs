//! The `headwise` command line: dispatch only; each subcommand lives in `cli/`.

#![deny(clippy::unwrap_used, clippy::expect_used)]

mod cli;

use clap::Parser;

fn main() {
    // Output piped into `head` and cut short ends the process quietly, as it does for
    // other command line tools, instead of panicking on the failed write.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE at start-up, before any
    // thread exists, is what C programs get by default.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let args = cli::Cli::parse();
    if let Err(err) = cli::run(args) {
        // One line naming the problem, with its causes, and a non-zero exit.
        let mut msg = without_backtrace(&err.to_string());
        for cause in err.chain().skip(1) {
            let c = without_backtrace(&cause.to_string());
            if !msg.contains(&c) {
                msg.push_str(": ");
                msg.push_str(&c);
            }
        }
        eprintln!("error: {msg}");
        std::process::exit(1);
    }
}

/// `text` on one line, without the stack frames a library error carries when
/// `RUST_BACKTRACE` is set (candle appends them to its messages): indented lines that
/// are a frame number (`  12: name`) or a location (`  at src/x.rs:3`).
fn without_backtrace(text: &str) -> String {
    let frame = |line: &str| {
        let t = line.trim_start();
        line.starts_with(' ')
            && (t.starts_with("at ")
                || t.split_once(": ")
                    .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit())))
    };
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !frame(l) && !l.trim().is_empty())
        .collect();
    lines.join(" ")
}
