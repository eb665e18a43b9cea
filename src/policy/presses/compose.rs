//! `compose`: several policies at once, applied in order; at most one of them decides
//! what KV heads keep (e.g. `static_heads` with a `topk_mask` on the retrieval heads,
//! or with an `ablate` for a control).
//!
//! ```toml
//! type = "compose"
//! policies = [
//!   { type = "window", window = 128 },
//!   { type = "ablate", mode = "zero-output", heads = { list = [[3, 1]] } },
//! ]
//! ```

use serde::{Deserialize, Serialize};

use crate::policy::plan::Plan;
use crate::policy::presses::{PolicyConfig, Press, Target};
use crate::{Error, Result};

/// The `compose` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compose {
    /// The parts, applied in order.
    pub policies: Vec<PolicyConfig>,
}

impl Press for Compose {
    fn check(&self) -> Result<()> {
        if self.policies.is_empty() {
            return Err(Error::invalid("compose", "no policies"));
        }
        if self
            .policies
            .iter()
            .any(|p| matches!(p, PolicyConfig::Compose(_)))
        {
            return Err(Error::invalid("compose", "compositions do not nest"));
        }
        let retention = self
            .policies
            .iter()
            .filter(|p| p.press().sets_retention())
            .count();
        if retention > 1 {
            return Err(Error::invalid(
                "compose",
                "at most one part that decides what heads keep (window, static_heads, dynamic_heads or a token press)",
            ));
        }
        self.policies.iter().try_for_each(|p| p.press().check())
    }

    fn apply(&self, plan: &mut Plan, target: &Target<'_>) -> Result<()> {
        self.policies
            .iter()
            .try_for_each(|p| p.press().apply(plan, target))
    }

    fn sets_retention(&self) -> bool {
        self.policies.iter().any(|p| p.press().sets_retention())
    }

    fn label(&self) -> Option<String> {
        let names: Vec<String> = self.policies.iter().map(PolicyConfig::name).collect();
        Some(names.join("+"))
    }
}
