//! `dynamic_heads`: every decode step, the heads a probe picks from the previous
//! step's final hidden state (or, with `oracle`, the true labels of the same step under
//! the full cache) read the whole history from a cold tier; the others see `sink` +
//! `window` ("Retrieval Heads are Dynamic", 2026: per-step retrieval heads predicted
//! from hidden states). The prompt is prefilled in full, then evicted.
//!
//! ```toml
//! type = "dynamic_heads"
//! probe = "probes/{model}/niah.json"
//! cold = "f16"
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::model::{Retention, RowFormat};
use crate::policy::plan::{Dynamic, DynamicSource, Plan, Prefill};
use crate::policy::presses::window::check_window;
use crate::policy::presses::{default_sink, default_window, Press, Target};
use crate::policy::select::Gqa;
use crate::probe::Probe;
use crate::{Error, Result};

/// The `dynamic_heads` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamicHeads {
    /// The probe's card (`probes/<model>/<name>.json`); not needed for the oracle.
    #[serde(default)]
    pub probe: Option<PathBuf>,
    /// Use the true per-step labels (needs the request's support spans).
    #[serde(default)]
    pub oracle: bool,
    /// Decision threshold on the probe's output [default: the card's].
    #[serde(default)]
    pub threshold: Option<f32>,
    #[serde(default)]
    pub gqa: Gqa,
    #[serde(default = "default_sink")]
    pub sink: usize,
    #[serde(default = "default_window")]
    pub window: usize,
    /// How the cold tier stores its rows [default: f16].
    #[serde(default = "default_cold")]
    pub cold: RowFormat,
}

fn default_cold() -> RowFormat {
    RowFormat::F16
}

impl Press for DynamicHeads {
    fn check(&self) -> Result<()> {
        check_window(self.window)?;
        if let Some(t) = self.threshold {
            if !t.is_finite() {
                return Err(Error::invalid("threshold", format!("{t} (must be finite)")));
            }
        }
        if self.probe.is_none() && !self.oracle {
            return Err(Error::invalid(
                "dynamic_heads",
                "needs `probe = \"probes/<model>/<name>.json\"` (or `oracle = true`)",
            ));
        }
        if self.gqa == Gqa::Sum {
            return Err(Error::invalid(
                "gqa",
                "sum ranks static scores; dynamic heads take any or majority",
            ));
        }
        Ok(())
    }

    fn apply(&self, plan: &mut Plan, target: &Target<'_>) -> Result<()> {
        let source = match (&self.probe, self.oracle) {
            (_, true) => DynamicSource::Oracle,
            (Some(path), false) => {
                let path = target.path(path);
                let probe = Probe::load(&path)?;
                let cfg = target.cfg;
                probe.check_model(
                    cfg.d_model,
                    cfg.n_layers * cfg.n_heads,
                    Some(&target.id.sha256),
                )?;
                let threshold = self.threshold.or(probe.threshold()).unwrap_or(0.5);
                DynamicSource::Probe {
                    probe: Box::new(probe),
                    threshold,
                }
            }
            (None, false) => return Err(Error::Internal("checked: a probe")),
        };
        plan.retention.fill(Retention::Tiered {
            sink: self.sink,
            window: self.window,
            cold: self.cold,
        });
        plan.dynamic = Some(Dynamic {
            source,
            gqa: self.gqa,
        });
        plan.prefill = Prefill::FullThenEvict;
        Ok(())
    }

    fn sets_retention(&self) -> bool {
        true
    }

    fn label(&self) -> Option<String> {
        self.oracle.then(|| "dynamic_oracle".into())
    }
}
