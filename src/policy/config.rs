//! Policies as data: a tagged enum read from TOML with figment, layered
//! `defaults < file < HEADWISE_POLICY_* environment < command line`, and checked once
//! ([`PolicyConfig::validate`]) before anything runs.
//!
//! ```toml
//! type = "static_heads"
//! gqa = "any"               # a KV head is kept when any of its query heads is selected
//! sink = 16
//! window = 256
//! prefill = "stream"        # or "full_then_evict"
//!
//! [heads]
//! ranking = "policies/rankings/SmolLM2-135M-Instruct.Q4_1/locos-niah.json"
//! select = { top_k = 27 }   # or { fraction = 0.3 }, { threshold = 0.05 }, { random = { count = 27, seed = 0 } }
//! ```
//!
//! Environment variables override keys: `HEADWISE_POLICY_WINDOW=128`, nested keys with a
//! double underscore (`HEADWISE_POLICY_HEADS__SELECT__TOP_K=9`). Command-line overrides are
//! `key=value` pairs with TOML values (`window=128`, `heads.select.top_k=9`).

use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::model::ColdFormat;
use crate::policy::ablation::AblationMode;
use crate::{Error, Result};

/// Default attention-sink positions a streaming head keeps.
pub const DEFAULT_SINK: usize = 16;
/// Default recent window a streaming head keeps.
pub const DEFAULT_WINDOW: usize = 256;

fn default_sink() -> usize {
    DEFAULT_SINK
}

fn default_window() -> usize {
    DEFAULT_WINDOW
}

/// One policy, or a composition of several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyConfig {
    /// No compression: every head keeps every position.
    Full {},
    /// Every head keeps `sink` + `window` positions (StreamingLLM).
    Window {
        #[serde(default = "default_sink")]
        sink: usize,
        #[serde(default = "default_window")]
        window: usize,
        #[serde(default)]
        prefill: Prefill,
    },
    /// Heads selected from a ranking keep everything; the others stream.
    StaticHeads {
        heads: HeadChoice,
        #[serde(default)]
        gqa: Gqa,
        #[serde(default = "default_sink")]
        sink: usize,
        #[serde(default = "default_window")]
        window: usize,
        #[serde(default)]
        prefill: Prefill,
    },
    /// Every step, heads picked by a probe (or, with `oracle`, by the true labels of the
    /// same step under the full cache) read the whole history from a cold tier; the
    /// others see sink + window. The prompt is prefilled in full, then evicted.
    DynamicHeads {
        /// The probe's card (`probes/<model>/<name>.json`); not needed for the oracle.
        #[serde(default)]
        probe: Option<PathBuf>,
        /// Use the true per-step labels (needs the request's support spans).
        #[serde(default)]
        oracle: bool,
        /// Decision threshold on the probe's output [default: the card's].
        #[serde(default)]
        threshold: Option<f32>,
        #[serde(default)]
        gqa: Gqa,
        #[serde(default = "default_sink")]
        sink: usize,
        #[serde(default = "default_window")]
        window: usize,
        #[serde(default)]
        cold: ColdFormat,
    },
    /// At decode steps, the chosen heads attend only to their `k` best-scoring keys plus
    /// `sink` + `window` (no memory saved: a retrieval mask).
    TopkMask {
        heads: HeadChoice,
        k: usize,
        #[serde(default = "default_sink")]
        sink: usize,
        #[serde(default = "default_window")]
        window: usize,
    },
    /// The chosen heads are silenced in `mode` (see the eval harness).
    Ablate {
        heads: HeadChoice,
        mode: AblationMode,
        /// Calibration means, needed by the mean modes (`calibration.json` of an eval run).
        #[serde(default)]
        calibration: Option<PathBuf>,
    },
    /// Several policies at once; at most one of them decides what heads keep
    /// (`window`, `static_heads` or `dynamic_heads`).
    Compose { policies: Vec<PolicyConfig> },
}

/// Which query heads a policy applies to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct HeadChoice {
    /// A ranking file (needed by `top_k`, `fraction` and `threshold`).
    #[serde(default)]
    pub ranking: Option<PathBuf>,
    /// How heads are picked from the ranking (or at random).
    #[serde(default)]
    pub select: Option<Selection>,
    /// Explicit `[layer, head]` pairs instead of a selection.
    #[serde(default)]
    pub list: Option<Vec<[usize; 2]>>,
}

/// How query heads are picked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Selection {
    /// The `k` best-ranked heads.
    TopK(usize),
    /// This share of the candidate heads, in `(0, 1]`, best-ranked first.
    Fraction(f64),
    /// Every head scoring at least this.
    Threshold(f64),
    /// `count` heads drawn at random (seeded): the control.
    Random { count: usize, seed: u64 },
}

/// How query-head choices become KV-head choices under grouped-query attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gqa {
    /// A KV head is kept when any of its query heads is chosen (RazorAttention).
    #[default]
    Any,
    /// When more than half of its query heads are chosen.
    Majority,
    /// KV heads ranked by the summed scores of their query heads; as many kept as the
    /// selection covers whole groups (`ceil(chosen / group)`).
    Sum,
}

/// How the prompt is processed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prefill {
    /// Streaming heads stream already during the chunked prefill (DuoAttention): less
    /// work and a lower peak.
    #[default]
    Stream,
    /// The prompt runs with full attention, then streaming heads drop what they do not
    /// keep: the prompt's representations are exact, the peak is the full cache.
    FullThenEvict,
}

impl PolicyConfig {
    /// Read a policy file with environment and command-line overrides layered on top
    /// (`overrides`: `key=value` pairs, TOML values).
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::invalid(
                "policy",
                format!("{}: no such file", path.display()),
            ));
        }
        Self::figment(Figment::from(Toml::file(path)), overrides)
            .map_err(|e| Error::invalid("policy", format!("{}: {e}", path.display())))
    }

    /// A policy from command-line pairs alone (over the environment), e.g.
    /// `["type=\"window\"", "window=128"]`.
    pub fn from_overrides(overrides: &[String]) -> Result<Self> {
        Self::figment(Figment::new(), overrides).map_err(|e| Error::invalid("policy", e))
    }

    fn figment(base: Figment, overrides: &[String]) -> std::result::Result<Self, String> {
        let mut fig = base.merge(Env::prefixed("HEADWISE_POLICY_").split("__"));
        for pair in overrides {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("override `{pair}`: expected key=value"))?;
            let value: toml::Value = match toml::from_str::<toml::Table>(&format!("v = {value}")) {
                Ok(mut t) => t
                    .remove("v")
                    .unwrap_or_else(|| toml::Value::String(value.to_string())),
                // A bare word is a string (`type=window`).
                Err(_) => toml::Value::String(value.to_string()),
            };
            fig = fig.merge(Serialized::global(key.trim(), value));
        }
        let policy: PolicyConfig = fig
            .extract()
            .map_err(|e| crate::error::figment_message(&e))?;
        policy.validate().map_err(|e| e.to_string())?;
        Ok(policy)
    }

    /// The policy's short name (`full`, `window`, `static_heads`, ...; `compose` joins
    /// its parts with `+`).
    pub fn name(&self) -> String {
        match self {
            PolicyConfig::Full {} => "full".into(),
            PolicyConfig::Window { .. } => "window".into(),
            PolicyConfig::StaticHeads { .. } => "static_heads".into(),
            PolicyConfig::DynamicHeads { oracle: true, .. } => "dynamic_oracle".into(),
            PolicyConfig::DynamicHeads { .. } => "dynamic_heads".into(),
            PolicyConfig::TopkMask { .. } => "topk_mask".into(),
            PolicyConfig::Ablate { .. } => "ablate".into(),
            PolicyConfig::Compose { policies } => policies
                .iter()
                .map(|p| p.name())
                .collect::<Vec<_>>()
                .join("+"),
        }
    }

    /// Check every value that can be checked without the model: ranges, required
    /// fields, and that a composition has at most one retention policy.
    pub fn validate(&self) -> Result<()> {
        let window = |w: usize| -> Result<()> {
            if w == 0 {
                return Err(Error::invalid("window", "0 (must be at least 1)"));
            }
            Ok(())
        };
        match self {
            PolicyConfig::Full {} => Ok(()),
            PolicyConfig::Window { window: w, .. } => window(*w),
            PolicyConfig::StaticHeads {
                heads, window: w, ..
            } => {
                window(*w)?;
                heads.validate("static_heads")
            }
            PolicyConfig::DynamicHeads {
                probe,
                oracle,
                threshold,
                window: w,
                ..
            } => {
                window(*w)?;
                if let Some(t) = threshold {
                    if !t.is_finite() {
                        return Err(Error::invalid("threshold", format!("{t} (must be finite)")));
                    }
                }
                if probe.is_none() && !oracle {
                    return Err(Error::invalid(
                        "dynamic_heads",
                        "needs `probe = \"probes/<model>/<name>.json\"` (or `oracle = true`)",
                    ));
                }
                Ok(())
            }
            PolicyConfig::TopkMask {
                heads,
                k,
                window: w,
                ..
            } => {
                window(*w)?;
                if *k == 0 {
                    return Err(Error::invalid("k", "0 (must be at least 1)"));
                }
                heads.validate("topk_mask")
            }
            PolicyConfig::Ablate {
                heads,
                mode,
                calibration,
            } => {
                if mode.needs_calibration() && calibration.is_none() {
                    return Err(Error::invalid(
                        "ablate",
                        format!(
                            "mode {} needs `calibration = \"<run>/calibration.json\"`",
                            mode.name()
                        ),
                    ));
                }
                heads.validate("ablate")
            }
            PolicyConfig::Compose { policies } => {
                if policies.is_empty() {
                    return Err(Error::invalid("compose", "no policies"));
                }
                let retention = policies.iter().filter(|p| p.sets_retention()).count();
                if retention > 1 {
                    return Err(Error::invalid(
                        "compose",
                        "at most one of window, static_heads and dynamic_heads",
                    ));
                }
                policies.iter().try_for_each(|p| p.validate())
            }
        }
    }

    /// Whether this policy decides what KV heads keep.
    pub(crate) fn sets_retention(&self) -> bool {
        matches!(
            self,
            PolicyConfig::Window { .. }
                | PolicyConfig::StaticHeads { .. }
                | PolicyConfig::DynamicHeads { .. }
        )
    }
}

impl HeadChoice {
    fn validate(&self, policy: &str) -> Result<()> {
        match (&self.list, &self.select) {
            (Some(_), Some(_)) => Err(Error::invalid(
                policy,
                "give either `heads.list` or `heads.select`, not both",
            )),
            (None, None) => Err(Error::invalid(
                policy,
                "needs `heads = { ranking = \"<file>.json\", select = { top_k = N } }` or `heads = { list = [[layer, head], ...] }`",
            )),
            (Some(_), None) => Ok(()),
            (None, Some(sel)) => {
                match sel {
                    Selection::Fraction(f) if !(*f > 0.0 && *f <= 1.0) => {
                        return Err(Error::invalid(
                            "select.fraction",
                            format!("{f} (must be in (0, 1])"),
                        ))
                    }
                    Selection::Threshold(t) if !t.is_finite() => {
                        return Err(Error::invalid(
                            "select.threshold",
                            format!("{t} (must be finite)"),
                        ))
                    }
                    _ => {}
                }
                if self.ranking.is_none() && !matches!(sel, Selection::Random { .. }) {
                    return Err(Error::invalid(
                        policy,
                        "this selection needs `heads.ranking = \"policies/rankings/<model>/<file>.json\"`",
                    ));
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<PolicyConfig> {
        let policy: PolicyConfig = Figment::from(Toml::string(text))
            .extract()
            .map_err(|e| Error::invalid("policy", crate::error::figment_message(&e)))?;
        policy.validate()?;
        Ok(policy)
    }

    #[test]
    fn policies_round_trip_through_toml() {
        let p = parse(
            "type = \"static_heads\"\ngqa = \"majority\"\nwindow = 64\nprefill = \"full_then_evict\"\n\
             heads = { ranking = \"r.json\", select = { fraction = 0.25 } }\n",
        )
        .unwrap();
        let PolicyConfig::StaticHeads {
            heads,
            gqa,
            sink,
            window,
            prefill,
        } = &p
        else {
            panic!("{p:?}")
        };
        assert_eq!(heads.select, Some(Selection::Fraction(0.25)));
        assert_eq!(
            (*gqa, *sink, *window, *prefill),
            (Gqa::Majority, DEFAULT_SINK, 64, Prefill::FullThenEvict)
        );
        let back = toml::to_string(&p).unwrap();
        assert_eq!(parse(&back).unwrap(), p);
    }

    #[test]
    fn bad_policies_are_refused_with_the_key_named() {
        for (text, want) in [
            ("type = \"sparse\"", "sparse"),
            ("type = \"window\"\nwindow = 0", "window"),
            ("type = \"window\"\nwindwo = 5", "windwo"),
            (
                "type = \"static_heads\"\nheads = { ranking = \"r.json\", select = { fraction = 1.5 } }",
                "fraction",
            ),
            (
                "type = \"static_heads\"\nheads = { select = { top_k = 3 } }",
                "ranking",
            ),
            ("type = \"dynamic_heads\"", "probe"),
            (
                "type = \"dynamic_heads\"\nprobe = \"p.json\"\nthreshold = nan",
                "threshold",
            ),
            ("type = \"topk_mask\"\nheads = { list = [[0, 1]] }\nk = 0", "k"),
            (
                "type = \"ablate\"\nheads = { list = [[0, 1]] }\nmode = \"mean-output\"",
                "calibration",
            ),
            (
                "type = \"compose\"\npolicies = [{ type = \"window\" }, { type = \"window\" }]",
                "at most one",
            ),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn overrides_beat_the_file() {
        let dir = std::env::temp_dir().join(format!("headwise-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.toml");
        std::fs::write(&path, "type = \"window\"\nwindow = 64\n").unwrap();
        let p = PolicyConfig::load(&path, &["window=32".into(), "sink=2".into()]).unwrap();
        assert_eq!(
            p,
            PolicyConfig::Window {
                sink: 2,
                window: 32,
                prefill: Prefill::Stream
            }
        );
        let err = PolicyConfig::load(&path, &["window=0".into()]).unwrap_err();
        assert!(err.to_string().contains("p.toml"), "{err}");
        assert!(PolicyConfig::load(&dir.join("missing.toml"), &[]).is_err());
        let p = PolicyConfig::from_overrides(&["type=full".into()]).unwrap();
        assert_eq!(p, PolicyConfig::Full {});
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
