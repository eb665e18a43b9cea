//! Result files in the project's shared format (one flat JSON record per measured
//! number, `summary.json`, next to a human-readable `README.md`), written atomically.
//! Each record carries its provenance ([`Made`]) beside the model's identity.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::model::ModelId;
use crate::provenance::Made;
use crate::{Error, Result};

/// Version of the record layout below.
pub const SCHEMA_VERSION: u32 = 1;

/// One measured number. Fields that do not apply are `None` (written as `null`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRecord {
    pub schema_version: u32,
    pub experiment: String,
    pub model: String,
    pub model_sha256: String,
    pub task: Option<String>,
    pub context_tokens: Option<usize>,
    pub selection: Option<String>,
    pub k: Option<usize>,
    pub seed: Option<u64>,
    pub mode: Option<String>,
    pub policy: Option<String>,
    pub metric: String,
    pub value: f64,
    pub n: usize,
    /// 95% interval of `value` where the report computed one (its method is in the
    /// experiment's README), else null.
    #[serde(default)]
    pub ci95: Option<[f64; 2]>,
    /// Two-sided p-value where `value` is a tested difference, else null.
    #[serde(default)]
    pub p_value: Option<f64>,
    /// Numerics, build, command line and date of the run that measured it.
    #[serde(flatten)]
    pub made: Made,
}

/// Makes the records of `experiment` on `model` that share `selection`, policy `full`
/// and `made`: from task, context tokens, metric, value and `n`.
pub fn recorder<'a>(
    experiment: &'a str,
    model: &'a ModelId,
    selection: Option<&'a str>,
    made: &'a Made,
) -> impl Fn(&str, Option<usize>, &str, f64, usize) -> ResultRecord + 'a {
    move |task, context_tokens, metric, value, n| ResultRecord {
        schema_version: SCHEMA_VERSION,
        experiment: experiment.to_string(),
        model: model.name.clone(),
        model_sha256: model.sha256.clone(),
        task: Some(task.to_string()),
        context_tokens,
        selection: selection.map(str::to_string),
        k: None,
        seed: None,
        mode: None,
        policy: Some("full".into()),
        metric: metric.to_string(),
        value,
        n,
        ci95: None,
        p_value: None,
        made: made.clone(),
    }
}

/// Write `bytes` to `path` through a temporary file in the same folder and a rename, so
/// a reader never sees half a file and an interrupted run leaves the old one intact.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// Write an experiment folder: `summary.json` and `README.md`, the README closed by a
/// line naming `made` (the provenance of the run behind the records).
pub fn write_experiment(
    dir: &Path,
    readme: &str,
    records: &[ResultRecord],
    made: &Made,
) -> Result<()> {
    let json = serde_json::to_string_pretty(records)
        .map_err(|e| Error::invalid("results", e.to_string()))?;
    write_atomic(&dir.join("summary.json"), json.as_bytes())?;
    let readme = format!("{}\n\n{}\n", readme.trim_end(), made.markdown());
    write_atomic(&dir.join("README.md"), readme.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("headwise-results-{}", std::process::id()));
        let path = dir.join("summary.json");
        write_atomic(&path, b"old").unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names, vec!["summary.json".to_string()]);
    }

    #[test]
    fn a_recorder_fills_the_shared_fields_of_its_experiment() {
        let (id, made) = (
            ModelId {
                name: "m".into(),
                sha256: "00".into(),
            },
            Made::now("ggml"),
        );
        let record = recorder("parity", &id, Some("none"), &made);
        let r = record("parity-all", None, "greedy_identical", 8.0, 8);
        assert_eq!(
            (
                r.experiment.as_str(),
                r.selection.as_deref(),
                r.policy.as_deref()
            ),
            ("parity", Some("none"), Some("full"))
        );
        assert_eq!(
            (r.task.as_deref(), r.context_tokens, r.n),
            (Some("parity-all"), None, 8)
        );
        assert_eq!((r.model_sha256.as_str(), &r.made), ("00", &made));
    }

    #[test]
    fn records_write_null_for_fields_that_do_not_apply() {
        let r = ResultRecord {
            schema_version: SCHEMA_VERSION,
            experiment: "parity".into(),
            model: "m".into(),
            model_sha256: "00".into(),
            task: None,
            context_tokens: Some(5),
            selection: None,
            k: None,
            seed: None,
            mode: None,
            policy: Some("full".into()),
            metric: "top1_agreement".into(),
            value: 1.0,
            n: 5,
            ci95: None,
            p_value: None,
            made: Made::now("reference"),
        };
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["k"].is_null() && json["mode"].is_null());
        assert_eq!(json["numerics"], "reference");
        assert!(json["command"].as_str().unwrap().starts_with("headwise"));
        assert_eq!(serde_json::from_value::<ResultRecord>(json).unwrap(), r);
    }
}
