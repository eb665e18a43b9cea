//! Records the git commit of the build in `HEADWISE_GIT_COMMIT` (with `-dirty` when
//! tracked files differ from it, as `git describe --dirty` counts), for the provenance of
//! every file headwise writes. Nothing is set outside a git checkout.
//!
//! Reruns when HEAD moves (checkout, commit) or `src/` changes (which rebuilds the crate
//! anyway), not on other edits: `-dirty` reflects the tree at the last of those.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src");
    let Some(commit) = git(&["rev-parse", "HEAD"]) else {
        return;
    };
    // HEAD, and the branch ref it points to (a loose ref file; a packed one moves with
    // packed-refs). Only existing paths: Cargo reruns every time for a missing one.
    let reference = git(&["symbolic-ref", "-q", "HEAD"]);
    for name in ["HEAD", "packed-refs"]
        .into_iter()
        .chain(reference.as_deref())
    {
        if let Some(path) = git(&["rev-parse", "--git-path", name]) {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let suffix = if dirty { "-dirty" } else { "" };
    println!("cargo:rustc-env=HEADWISE_GIT_COMMIT={commit}{suffix}");
}
