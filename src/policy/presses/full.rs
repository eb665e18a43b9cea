//! `full`: no compression; every head keeps every position. The reference every
//! compression ratio is measured against.

use serde::{Deserialize, Serialize};

use crate::policy::plan::Plan;
use crate::policy::presses::{Press, Target};
use crate::Result;

/// The `full` policy (no keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Full {}

impl Press for Full {
    fn check(&self) -> Result<()> {
        Ok(())
    }

    /// A new plan is already full.
    fn apply(&self, _plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        Ok(())
    }
}
