//! Experiment specs: one TOML file names the model, the tasks and their sizes, the head
//! selections, the k values, the ablation mode, the calibration set and the metrics.
//!
//! ```toml
//! name = "ablation"                 # results go to eval/results/<model>/<name>/
//! model = "smollm2-135m"            # a known model name or a GGUF path
//! mode = "mean-output"              # zero-output | mean-output | mean-query | uniform-attention
//! k = [0, 5, 10, 20, 30, 50]
//! metrics = ["rouge_l", "rouge1_recall"]
//! max_new = 12
//!
//! [calibration]                     # prompts for the mean modes; disjoint from the tasks
//! task = "niah"
//! lengths = [256]
//! seeds = [1000, 1001, 1002, 1003]
//!
//! [[task]]
//! name = "nolima"
//! lengths = [0, 128]
//! seeds = 10                        # seeds 0..10
//!
//! [[selection]]
//! name = "locos-nolima"
//! ranking = "policies/rankings/SmolLM2-135M-Instruct.Q4_1/locos-nolima.json"
//!
//! [[selection]]
//! name = "random"
//! random_seeds = [0, 1, 2]
//! ```
//!
//! Relative paths (rankings, the data directory) are read from the folder the command
//! runs in. `k = 0` is the unablated baseline, run once per example and shared by every
//! selection.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use figment::providers::{Format, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::lab::eval::controls::ControlKind;
use crate::lab::eval::datasets::ruler::RulerTask;
use crate::metrics::Metric;
use crate::policy::ablation::AblationMode;
use crate::{Error, Result};

/// A whole experiment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// Experiment name: the results folder and the `experiment` field of every record.
    pub name: String,
    /// A known model name (`smollm2-135m`, `gemma3-270m`) or a GGUF path.
    pub model: String,
    /// Where the datasets live [default: `../shared/data`].
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// How ablated heads are silenced.
    pub mode: AblationMode,
    /// Numbers of heads to ablate (0 = the unablated baseline).
    pub k: Vec<usize>,
    /// Metrics to compute for every prediction (each gets its tables and plots).
    pub metrics: Vec<Metric>,
    /// Tokens generated at most per answer (generation also stops at a newline).
    #[serde(default = "default_max_new")]
    pub max_new: usize,
    /// Calibration prompts for the mean modes.
    #[serde(default)]
    pub calibration: Option<TaskEntry>,
    /// The tasks.
    #[serde(rename = "task")]
    pub tasks: Vec<TaskEntry>,
    /// How heads are chosen (none needed when every k is 0).
    #[serde(rename = "selection", default)]
    pub selections: Vec<Selection>,
}

fn default_max_new() -> usize {
    12
}

/// One task and its size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskEntry {
    /// `niah`, `nolima`, `nolima_control`, `hotpotqa`, `musique`, `babilong_qa1` ...
    /// `babilong_qa5`, `control_capital`, `control_city`, `control_arithmetic`.
    pub name: String,
    /// Haystack / filler lengths in tokens (generated tasks and BABILong).
    #[serde(default)]
    pub lengths: Vec<usize>,
    /// Needle depths (NIAH / NoLiMa) [default: 0.5].
    #[serde(default)]
    pub depths: Vec<f64>,
    /// Seeds: a count (`10` = seeds 0..10) or a list.
    #[serde(default)]
    pub seeds: Option<Seeds>,
    /// At most this many examples: needle tasks and HotpotQA / MuSiQue the first ones,
    /// BABILong the first samples (each at every length), controls the pool size.
    #[serde(default)]
    pub limit: Option<usize>,
    /// Override the spec's k values for this task.
    #[serde(default)]
    pub k: Option<Vec<usize>>,
    /// Only these selections (by name) for this task [default: all].
    #[serde(default)]
    pub selections: Option<Vec<String>>,
}

/// Seeds as a count or an explicit list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Seeds {
    /// Seeds `0..n`.
    Count(u64),
    /// These seeds.
    List(Vec<u64>),
}

/// Most seeds a task may give (a count beyond it would be a list too large to build).
pub const MAX_SEEDS: u64 = 1_000_000;

impl Seeds {
    /// How many seeds, without listing them.
    pub fn count(&self) -> u64 {
        match self {
            Seeds::Count(n) => *n,
            Seeds::List(v) => v.len() as u64,
        }
    }

    /// The seeds.
    pub fn list(&self) -> Vec<u64> {
        match self {
            Seeds::Count(n) => (0..*n).collect(),
            Seeds::List(v) => v.clone(),
        }
    }
}

/// A way to choose heads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Selection {
    /// Name in the results (`locos-nolima`, `wu-niah`, `random`).
    pub name: String,
    /// A ranking file: the top-k heads.
    #[serde(default)]
    pub ranking: Option<PathBuf>,
    /// Random heads, one set per seed.
    #[serde(default)]
    pub random_seeds: Option<Vec<u64>>,
}

/// What a task name means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskSource {
    /// A generated needle task.
    Needle(crate::lab::tasks::TaskKind),
    /// HotpotQA distractor dev.
    HotpotQa,
    /// MuSiQue-Ans dev.
    Musique,
    /// BABILong built from bAbI task `1..=5`.
    Babilong(u8),
    /// A specificity control.
    Control(ControlKind),
    /// A RULER-style task generated from its seeds.
    Ruler(RulerTask),
}

impl TaskSource {
    /// Parse a task name; errors list the known names.
    pub fn parse(name: &str) -> Result<Self> {
        use crate::lab::tasks::TaskKind;
        if let Some(task) = RulerTask::parse(name) {
            return Ok(TaskSource::Ruler(task));
        }
        Ok(match name {
            "niah" => TaskSource::Needle(TaskKind::Niah),
            "nolima" => TaskSource::Needle(TaskKind::Nolima),
            "nolima_control" => TaskSource::Needle(TaskKind::NolimaControl),
            "hotpotqa" => TaskSource::HotpotQa,
            "musique" => TaskSource::Musique,
            "control_capital" => TaskSource::Control(ControlKind::Capital),
            "control_city" => TaskSource::Control(ControlKind::City),
            "control_arithmetic" => TaskSource::Control(ControlKind::Arithmetic),
            _ => match name
                .strip_prefix("babilong_qa")
                .and_then(|n| n.parse::<u8>().ok())
            {
                Some(n @ 1..=5) => TaskSource::Babilong(n),
                _ => {
                    return Err(Error::invalid(
                        "task",
                        format!(
                            "unknown task `{name}` (known: niah, nolima, nolima_control, \
                             hotpotqa, musique, babilong_qa1..babilong_qa5, control_capital, \
                             control_city, control_arithmetic, ruler_niah_single, \
                             ruler_niah_multikey, ruler_niah_multivalue, ruler_niah_multiquery, \
                             ruler_vt, ruler_cwe, ruler_fwe, ruler_qa)"
                        ),
                    ))
                }
            },
        })
    }
}

impl EvalSpec {
    /// Read and validate a spec file; errors name the file.
    pub fn load(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::invalid(
                "spec",
                format!("{}: no such file", path.display()),
            ));
        }
        let spec: EvalSpec = Figment::from(Toml::file(path))
            .extract()
            .map_err(|e| Error::invalid("spec", crate::error::figment_message(&e)))?;
        spec.validate()
            .map_err(|e| Error::invalid("spec", format!("{}: {e}", path.display())))?;
        Ok(spec)
    }

    /// The spec as TOML.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| Error::invalid("spec", e.to_string()))
    }

    /// Structural checks that need no model: names, k lists, selections, task sizes.
    /// (k against the model's head count and rankings against its identity are checked
    /// when the model is known.)
    pub fn validate(&self) -> Result<()> {
        if self.name.is_empty() || self.name.contains(['/', '\\']) || self.name.starts_with('.') {
            return Err(Error::invalid(
                "name",
                format!("`{}` is not a folder name", self.name),
            ));
        }
        if self.k.is_empty() {
            return Err(Error::invalid("k", "no k given"));
        }
        if self.metrics.is_empty() {
            return Err(Error::invalid("metrics", "no metric given"));
        }
        if self.max_new == 0 {
            return Err(Error::invalid("max_new", "0 (must be at least 1)"));
        }
        if self.tasks.is_empty() {
            return Err(Error::invalid("task", "no [[task]] given"));
        }
        let mut names = BTreeSet::new();
        for s in &self.selections {
            if !names.insert(s.name.as_str()) || s.name == "none" {
                return Err(Error::invalid(
                    "selection",
                    format!("`{}` is given twice or reserved", s.name),
                ));
            }
            match (&s.ranking, &s.random_seeds) {
                (Some(_), None) => {}
                (None, Some(seeds)) if !seeds.is_empty() => {}
                _ => {
                    return Err(Error::invalid(
                        "selection",
                        format!(
                            "`{}` needs exactly one of `ranking` or a non-empty `random_seeds`",
                            s.name
                        ),
                    ))
                }
            }
        }
        let mut task_names = BTreeSet::new();
        for t in self.tasks.iter().chain(&self.calibration) {
            let source = TaskSource::parse(&t.name)?;
            if let Some(sel) = &t.selections {
                if let Some(bad) = sel.iter().find(|s| !names.contains(s.as_str())) {
                    return Err(Error::invalid(
                        "task",
                        format!("{}: selection `{bad}` is not defined", t.name),
                    ));
                }
            }
            if matches!(source, TaskSource::Needle(_) | TaskSource::Babilong(_))
                && t.lengths.is_empty()
            {
                return Err(Error::invalid(
                    "task",
                    format!("{}: needs `lengths`", t.name),
                ));
            }
            match t.seeds.as_ref().map(Seeds::count) {
                Some(0) => {
                    return Err(Error::invalid("task", format!("{}: no seed given", t.name)))
                }
                Some(n) if n > MAX_SEEDS => {
                    return Err(Error::invalid(
                        "task",
                        format!("{}: {n} seeds (at most {MAX_SEEDS})", t.name),
                    ))
                }
                _ => {}
            }
        }
        for t in &self.tasks {
            if !task_names.insert(t.name.as_str()) {
                return Err(Error::invalid(
                    "task",
                    format!("`{}` is given twice", t.name),
                ));
            }
        }
        let k_lists =
            std::iter::once(&self.k).chain(self.tasks.iter().filter_map(|t| t.k.as_ref()));
        for ks in k_lists {
            let mut seen = BTreeSet::new();
            if let Some(k) = ks.iter().find(|&&k| !seen.insert(k)) {
                return Err(Error::invalid("k", format!("{k} is given twice")));
            }
            if ks.iter().any(|&k| k > 0) && self.selections.is_empty() {
                return Err(Error::invalid(
                    "selection",
                    "k above 0 needs at least one [[selection]]",
                ));
            }
        }
        Ok(())
    }

    /// The data directory, `../shared/data` unless set.
    pub fn data_dir(&self) -> PathBuf {
        self.data_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("../shared/data"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> EvalSpec {
        EvalSpec {
            name: "ablation".into(),
            model: "smollm2-135m".into(),
            data_dir: Some("data".into()),
            mode: AblationMode::MeanOutput,
            k: vec![0, 5, 50],
            metrics: vec![Metric::RougeL, Metric::Rouge1Recall],
            max_new: 8,
            calibration: Some(TaskEntry {
                name: "niah".into(),
                lengths: vec![256],
                depths: vec![],
                seeds: Some(Seeds::List(vec![1000, 1001])),
                limit: None,
                k: None,
                selections: None,
            }),
            tasks: vec![TaskEntry {
                name: "nolima".into(),
                lengths: vec![0, 128],
                depths: vec![0.5],
                seeds: Some(Seeds::Count(10)),
                limit: None,
                k: Some(vec![0, 50]),
                selections: Some(vec!["random".into()]),
            }],
            selections: vec![
                Selection {
                    name: "locos-nolima".into(),
                    ranking: Some("r.json".into()),
                    random_seeds: None,
                },
                Selection {
                    name: "random".into(),
                    ranking: None,
                    random_seeds: Some(vec![0, 1, 2]),
                },
            ],
        }
    }

    #[test]
    fn a_spec_round_trips_through_toml() {
        let spec = example();
        spec.validate().unwrap();
        let text = spec.to_toml().unwrap();
        let dir = std::env::temp_dir().join(format!("headwise-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("spec.toml");
        std::fs::write(&path, &text).unwrap();
        let back = EvalSpec::load(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(back, spec, "{text}");
    }

    #[test]
    fn bad_specs_are_clear_errors() {
        let check = |f: &dyn Fn(&mut EvalSpec), want: &str| {
            let mut s = example();
            f(&mut s);
            let err = s.validate().unwrap_err().to_string();
            assert!(err.contains(want), "{err} (wanted {want})");
        };
        check(
            &|s| s.tasks[0].name = "trivia".into(),
            "unknown task `trivia`",
        );
        check(&|s| s.k = vec![], "no k given");
        check(&|s| s.k = vec![5, 5], "given twice");
        check(
            &|s| s.selections[1].random_seeds = None,
            "needs exactly one of",
        );
        check(
            &|s| s.tasks[0].selections = Some(vec!["wu".into()]),
            "selection `wu` is not defined",
        );
        check(&|s| s.tasks[0].lengths.clear(), "needs `lengths`");
        // Found by the long fuzz run: a count of 2^63 seeds was listed before it was checked.
        check(
            &|s| s.tasks[0].seeds = Some(Seeds::Count(u64::MAX)),
            "18446744073709551615 seeds (at most 1000000)",
        );
        check(&|s| s.name = "../x".into(), "not a folder name");
        assert_eq!(
            TaskSource::parse("babilong_qa3").unwrap(),
            TaskSource::Babilong(3)
        );
        assert!(TaskSource::parse("babilong_qa6").is_err());
    }

    #[test]
    fn unknown_keys_and_bad_modes_name_the_file() {
        let dir = std::env::temp_dir().join(format!("headwise-spec-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.toml");
        let mut text = example().to_toml().unwrap();
        text = text.replace("mean-output", "half-output");
        std::fs::write(&path, &text).unwrap();
        let err = EvalSpec::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("bad.toml") && err.contains("half-output"),
            "{err}"
        );
        let missing = EvalSpec::load(&dir.join("none.toml"))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("no such file"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
