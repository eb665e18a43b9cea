//! What a test needs from outside the repository (evaluation data, downloaded models),
//! and what happens when it is missing. Shared by the library's unit tests and the
//! integration tests (`tests/common` includes this file), so both read the same
//! environment variables and both refuse to pass silently:
//!
//! - `HEADWISE_DATA_DIR`: the evaluation data, else `../shared/data` beside the crate;
//! - `HEADWISE_MODELS_DIR`: where models are fetched to, else `models/` in the crate;
//! - `HEADWISE_REQUIRE_ALL=1` (set by `.ci/run`): a test whose input is missing fails,
//!   naming it, instead of printing a `SKIPPED:` line and returning.

use std::path::PathBuf;

/// Whether `HEADWISE_REQUIRE_ALL=1` is set: then no test may skip.
pub fn require_all() -> bool {
    std::env::var("HEADWISE_REQUIRE_ALL").is_ok_and(|v| v == "1")
}

/// A test cannot run because `what` is missing. Under `HEADWISE_REQUIRE_ALL=1` this
/// panics, failing the test with `what` in its message; otherwise it prints one
/// `SKIPPED:` line and the caller returns.
pub fn unavailable(what: &str) {
    assert!(
        !require_all(),
        "HEADWISE_REQUIRE_ALL=1 and {what} (see CONTRIBUTING.md, \"Build and test\")"
    );
    eprintln!("SKIPPED: {what}");
}

/// The evaluation data folder, or `None` (after [`unavailable`]) when it does not exist.
pub fn data_dir() -> Option<PathBuf> {
    let dir = match std::env::var("HEADWISE_DATA_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data"),
    };
    if dir.is_dir() {
        Some(dir)
    } else {
        unavailable(&format!(
            "the evaluation data folder {} is missing (set HEADWISE_DATA_DIR)",
            dir.display()
        ));
        None
    }
}

/// `rel` inside the evaluation data folder, or `None` (after [`unavailable`]) when
/// either is missing.
pub fn data(rel: &str) -> Option<PathBuf> {
    let path = data_dir()?.join(rel);
    if path.exists() {
        Some(path)
    } else {
        unavailable(&format!(
            "{} is missing from the data folder",
            path.display()
        ));
        None
    }
}

/// Where models are fetched to: `$HEADWISE_MODELS_DIR`, else `models/` in the crate.
pub fn models_dir() -> PathBuf {
    std::env::var("HEADWISE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"))
}
