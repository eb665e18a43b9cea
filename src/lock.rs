//! One writer per output: a lock file beside the files a long run writes.
//!
//! Two runs writing the same ranking or report at once would interleave their partial
//! records and remove each other's temporary files. [`OutputLock::acquire`] creates
//! `<dir>/.<name>.lock` exclusively, holding the PID of its owner and its command line;
//! a second run is refused with one line naming that PID. A lock whose owner is no
//! longer alive (killed with `kill -9`) is taken over, so an interrupted run can always
//! be resumed.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Held while a run writes its output; removes its lock file when dropped.
#[derive(Debug)]
pub struct OutputLock {
    path: PathBuf,
}

impl OutputLock {
    /// Take the lock `name` in folder `dir` (created if missing).
    ///
    /// Errors: [`Error::InvalidArgument`] naming the holder's PID if a live process
    /// holds it, [`Error::Io`] if the folder cannot be written.
    pub fn acquire(dir: &Path, name: &str) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let path = dir.join(format!(".{name}.lock"));
        // Twice at most: a stale lock is removed once, then created anew.
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    let owner = format!(
                        "{}\n{}\n",
                        std::process::id(),
                        crate::provenance::command_line()
                    );
                    f.write_all(owner.as_bytes())
                        .map_err(|e| Error::io(&path, e))?;
                    return Ok(Self { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    let holder = text
                        .lines()
                        .next()
                        .and_then(|l| l.trim().parse::<u32>().ok());
                    match holder {
                        Some(pid) if alive(pid) => {
                            return Err(Error::invalid(
                                "output",
                                format!(
                                    "{} is being written by another run (PID {pid}, lock {}); \
                                     wait for it or stop it",
                                    dir.display(),
                                    path.display()
                                ),
                            ))
                        }
                        // A dead owner, or a lock cut short before its PID was written.
                        _ => {
                            let _ = std::fs::remove_file(&path);
                        }
                    }
                }
                Err(e) => return Err(Error::io(&path, e)),
            }
        }
        Err(Error::invalid(
            "output",
            format!("{}: could not take the lock", path.display()),
        ))
    }
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether a process with this PID exists (on Linux: its `/proc` entry).
fn alive(pid: u32) -> bool {
    pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("headwise-lock-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_second_writer_is_refused_with_the_holders_pid_and_may_go_after_the_first() {
        let d = dir("held");
        let first = OutputLock::acquire(&d, "wu").unwrap();
        let err = OutputLock::acquire(&d, "wu").unwrap_err().to_string();
        assert!(
            err.contains(&format!("PID {}", std::process::id())),
            "{err}"
        );
        // Another output in the same folder is not blocked.
        let other = OutputLock::acquire(&d, "locos").unwrap();
        drop((first, other));
        assert!(OutputLock::acquire(&d, "wu").is_ok());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_lock_left_by_a_dead_process_is_taken_over() {
        let d = dir("stale");
        std::fs::create_dir_all(&d).unwrap();
        // PIDs above the kernel's pid_max (at most 2^22) never exist.
        std::fs::write(d.join(".wu.lock"), "4294967295\nheadwise heads score\n").unwrap();
        let lock = OutputLock::acquire(&d, "wu").unwrap();
        let text = std::fs::read_to_string(d.join(".wu.lock")).unwrap();
        assert!(text.starts_with(&std::process::id().to_string()), "{text}");
        drop(lock);
        assert!(!d.join(".wu.lock").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
