//! The `headwise` command line: dispatch only; each subcommand lives in `cli/`.

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
        let mut msg = err.to_string();
        for cause in err.chain().skip(1) {
            let c = cause.to_string();
            if !msg.contains(&c) {
                msg.push_str(": ");
                msg.push_str(&c);
            }
        }
        eprintln!("error: {}", msg.replace('\n', " "));
        std::process::exit(1);
    }
}
