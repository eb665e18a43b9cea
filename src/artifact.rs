//! Reading the versioned JSON files headwise writes (rankings, calibration means, trace
//! and probe cards, index metadata): one loader that checks the schema version before
//! the rest is parsed, so a file from another version says so instead of failing on a
//! field it lacks, and names the file in every error.

use std::path::Path;

use serde::de::DeserializeOwned;

use crate::{Error, Result};

/// A JSON file with a top-level `schema_version`.
pub trait Versioned: DeserializeOwned {
    /// What the file is, for errors (`ranking`, `calibration`, ...).
    const KIND: &'static str;
    /// The version this build reads and writes.
    const SCHEMA_VERSION: u32;
    /// What to do with a file of another version, appended to the error.
    const ON_OTHER_VERSION: &'static str = "";
}

/// Read `path` as a `T`, checking its schema version first.
pub fn read_versioned<T: Versioned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_versioned(&text, path)
}

/// [`read_versioned`] of text already read from `path`.
fn parse_versioned<T: Versioned>(text: &str, path: &Path) -> Result<T> {
    let bad = |reason: String| Error::invalid(T::KIND, format!("{}: {reason}", path.display()));
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not a {} file ({e})", T::KIND)))?;
    let version = value.get("schema_version").and_then(|v| v.as_u64());
    if version != Some(u64::from(T::SCHEMA_VERSION)) {
        let found = version.map_or_else(|| "missing".to_string(), |v| v.to_string());
        return Err(bad(format!(
            "schema version {found}, this build reads {}{}",
            T::SCHEMA_VERSION,
            T::ON_OTHER_VERSION
        )));
    }
    serde_json::from_value(value).map_err(|e| bad(format!("not a {} file ({e})", T::KIND)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Thing {
        schema_version: u32,
        name: String,
    }

    impl Versioned for Thing {
        const KIND: &'static str = "thing";
        const SCHEMA_VERSION: u32 = 3;
        const ON_OTHER_VERSION: &'static str = " (make it again)";
    }

    fn parse(text: &str) -> std::result::Result<Thing, String> {
        parse_versioned::<Thing>(text, Path::new("t.json")).map_err(|e| e.to_string())
    }

    #[test]
    fn the_version_is_checked_before_the_fields() {
        let t = parse(r#"{"schema_version": 3, "name": "a"}"#).unwrap();
        assert_eq!((t.schema_version, t.name.as_str()), (3, "a"));
        // Another version is reported as such, though its fields do not fit either.
        let e = parse(r#"{"schema_version": 4, "title": "a"}"#).unwrap_err();
        assert!(
            e.contains("t.json: schema version 4, this build reads 3 (make it again)"),
            "{e}"
        );
        let e = parse(r#"{"name": "a"}"#).unwrap_err();
        assert!(e.contains("schema version missing"), "{e}");
        let e = parse(r#"{"schema_version": 3}"#).unwrap_err();
        assert!(
            e.contains("t.json: not a thing file (missing field `name`"),
            "{e}"
        );
        let e = parse("[1, 2").unwrap_err();
        assert!(e.contains("t.json: not a thing file"), "{e}");
    }
}
