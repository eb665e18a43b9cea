//! Policies as data: [`PolicyConfig`] read from TOML with figment, layered
//! `defaults < file < HEADWISE_POLICY_* environment < command line`, and checked once
//! into a [`Policy`] (linfa's `ParamGuard` pattern: [`PolicyConfig::check`] returns the
//! checked type, and everything downstream takes only that type).
//!
//! ```toml
//! type = "static_heads"
//! window = 256
//!
//! [heads]
//! ranking = "policies/rankings/{model}/locos-niah.json"
//! select = { top_k = 27 }
//! ```
//!
//! Each `type` and its keys are documented in its own file under
//! [`crate::policy::presses`]. Environment variables override keys:
//! `HEADWISE_POLICY_WINDOW=128`, nested keys with a double underscore
//! (`HEADWISE_POLICY_HEADS__SELECT__TOP_K=9`). Command-line overrides are `key=value`
//! pairs with TOML values (`window=128`, `heads.select.top_k=9`).

use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::policy::presses::{Full, PolicyConfig};
use crate::{Error, Result};

/// A policy whose values have been checked: what plans are resolved from
/// ([`crate::policy::Plan::resolve`]). Deserializing one checks it, so a policy inside
/// any other configuration (an eval spec, a server's presets) is checked where it is read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "PolicyConfig", into = "PolicyConfig")]
pub struct Policy(PolicyConfig);

impl PolicyConfig {
    /// Check every value that can be checked without the model: ranges, required
    /// fields, and that a composition has at most one retention policy.
    pub fn check(self) -> Result<Policy> {
        self.press().check()?;
        Ok(Policy(self))
    }
}

impl TryFrom<PolicyConfig> for Policy {
    type Error = Error;

    fn try_from(config: PolicyConfig) -> Result<Self> {
        config.check()
    }
}

impl From<Policy> for PolicyConfig {
    fn from(policy: Policy) -> Self {
        policy.0
    }
}

impl Policy {
    /// No compression.
    pub fn full() -> Self {
        Policy(PolicyConfig::Full(Full {}))
    }

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
        let config: PolicyConfig = fig
            .extract()
            .map_err(|e| crate::error::figment_message(&e))?;
        config.check().map_err(|e| e.to_string())
    }

    /// The policy as written.
    pub fn config(&self) -> &PolicyConfig {
        &self.0
    }

    /// The policy's short name ([`PolicyConfig::name`]).
    pub fn name(&self) -> String {
        self.0.name()
    }

    /// The same policy with `probe` as the card of its `dynamic_heads` part (a checked
    /// policy stays checked: a probe only fills what `dynamic_heads` needs).
    pub fn with_probe(mut self, probe: PathBuf) -> Result<Self> {
        let dynamic = match &mut self.0 {
            PolicyConfig::DynamicHeads(d) => Some(d),
            PolicyConfig::Compose(c) => c.policies.iter_mut().find_map(|p| match p {
                PolicyConfig::DynamicHeads(d) => Some(d),
                _ => None,
            }),
            _ => None,
        };
        let dynamic = dynamic.ok_or_else(|| {
            Error::invalid(
                "probe",
                "a probe was given but the policy has no dynamic_heads part",
            )
        })?;
        dynamic.probe = Some(probe);
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::plan::Prefill;
    use crate::policy::presses::{StaticHeads, Window, DEFAULT_SINK};
    use crate::policy::select::{Gqa, Selection};

    fn parse(text: &str) -> Result<Policy> {
        let config: PolicyConfig = Figment::from(Toml::string(text))
            .extract()
            .map_err(|e| Error::invalid("policy", crate::error::figment_message(&e)))?;
        config.check()
    }

    #[test]
    fn policies_round_trip_through_toml() {
        let p = parse(
            "type = \"static_heads\"\ngqa = \"majority\"\nwindow = 64\nprefill = \"full_then_evict\"\n\
             heads = { ranking = \"r.json\", select = { fraction = 0.25 } }\n",
        )
        .unwrap();
        let PolicyConfig::StaticHeads(StaticHeads {
            heads,
            gqa,
            sink,
            window,
            prefill,
            others: None,
        }) = p.config()
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
        // Deserializing a `Policy` checks it.
        assert_eq!(toml::from_str::<Policy>(&back).unwrap(), p);
        let err = toml::from_str::<Policy>("type = \"window\"\nwindow = 0").unwrap_err();
        assert!(err.to_string().contains("must be at least 1"), "{err}");
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
            (
                "type = \"dynamic_heads\"\nprobe = \"p.json\"\ngqa = \"sum\"",
                "gqa",
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
            (
                "type = \"compose\"\npolicies = [{ type = \"compose\", policies = [{ type = \"full\" }] }]",
                "do not nest",
            ),
            ("type = \"compose\"\npolicies = []", "no policies"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn a_probe_fills_the_dynamic_part_only() {
        let dynamic = parse("type = \"compose\"\npolicies = [{ type = \"dynamic_heads\", oracle = true }, { type = \"full\" }]").unwrap();
        let with = dynamic.with_probe("p.json".into()).unwrap();
        let PolicyConfig::Compose(c) = with.config() else {
            panic!("{with:?}")
        };
        let PolicyConfig::DynamicHeads(d) = &c.policies[0] else {
            panic!("{c:?}")
        };
        assert_eq!(d.probe.as_deref(), Some(Path::new("p.json")));
        let err = Policy::full().with_probe("p.json".into()).unwrap_err();
        assert!(err.to_string().contains("no dynamic_heads"), "{err}");
    }

    #[test]
    fn overrides_beat_the_file() {
        let dir = std::env::temp_dir().join(format!("headwise-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.toml");
        std::fs::write(&path, "type = \"window\"\nwindow = 64\n").unwrap();
        let p = Policy::load(&path, &["window=32".into(), "sink=2".into()]).unwrap();
        assert_eq!(
            p.config(),
            &PolicyConfig::Window(Window {
                sink: 2,
                window: 32,
                prefill: Prefill::Stream
            })
        );
        let err = Policy::load(&path, &["window=0".into()]).unwrap_err();
        assert!(err.to_string().contains("p.toml"), "{err}");
        assert!(Policy::load(&dir.join("missing.toml"), &[]).is_err());
        let p = Policy::from_overrides(&["type=full".into()]).unwrap();
        assert_eq!(p, Policy::full());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
