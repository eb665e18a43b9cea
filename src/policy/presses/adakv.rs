//! `adakv`: another press's scores, with the budget shared across the KV heads of a
//! layer instead of split equally (Feng et al. 2024, "Ada-KV: Optimizing KV Cache
//! Eviction by Adaptive Budget Allocation for Efficient LLM Inference"; kvpress's
//! `AdaKVPress`). A layer keeps as many rows as the equal split would, chosen by score
//! across its heads, each head at least `alpha_safeguard` of its equal share. kvpress
//! masks the dropped rows; here each head's store holds only its own, so heads end with
//! different lengths and the bytes are counted from what they hold.
//!
//! ```toml
//! type = "adakv"
//! alpha_safeguard = 0.2   # default
//! press = { type = "snapkv", compression_ratio = 0.5 }
//! ```

use serde::{Deserialize, Serialize};

use crate::policy::evict::Budget;
use crate::policy::plan::Plan;
use crate::policy::presses::{PolicyConfig, Press, Target};
use crate::{Error, Result};

/// The `adakv` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adakv {
    /// Share of its equal budget each head keeps whatever the others score, in `[0, 1]`.
    #[serde(default = "default_alpha")]
    pub alpha_safeguard: f64,
    /// The press whose scores are shared: `knorm`, `snapkv`, `tova`,
    /// `observed_attention` or `expected_attention`; its `compression_ratio` is the
    /// layer's.
    pub press: Box<PolicyConfig>,
}

fn default_alpha() -> f64 {
    0.2
}

impl Press for Adakv {
    fn check(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.alpha_safeguard) {
            return Err(Error::invalid(
                "alpha_safeguard",
                format!("{} (must be in [0, 1])", self.alpha_safeguard),
            ));
        }
        match *self.press {
            PolicyConfig::Knorm(_)
            | PolicyConfig::Snapkv(_)
            | PolicyConfig::Tova(_)
            | PolicyConfig::ObservedAttention(_)
            | PolicyConfig::ExpectedAttention(_) => self.press.press().check(),
            ref other => Err(Error::invalid(
                "press",
                format!(
                    "{} (adakv shares the budget of knorm, snapkv, tova, observed_attention or \
                     expected_attention)",
                    other.kind()
                ),
            )),
        }
    }

    fn apply(&self, plan: &mut Plan, target: &Target<'_>) -> Result<()> {
        self.press.press().apply(plan, target)?;
        let evict = plan
            .evict
            .as_mut()
            .ok_or(Error::Internal("adakv's press is checked to evict"))?;
        evict.budget = Budget::Shared {
            alpha: self.alpha_safeguard,
        };
        Ok(())
    }

    fn presses_tokens(&self) -> bool {
        true
    }

    fn label(&self) -> Option<String> {
        Some(format!("adakv-{}", self.press.name()))
    }
}
