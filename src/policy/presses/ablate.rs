//! `ablate`: the chosen query heads are silenced in one of the ablation modes of
//! [`crate::policy::ablation::AblationMode`] (zero or mean output, mean query,
//! uniform attention): the intervention of the papers' ablation studies, as a policy.
//!
//! ```toml
//! type = "ablate"
//! mode = "mean-output"
//! calibration = "eval/results/<model>/<run>/calibration.json"
//! heads = { ranking = "policies/rankings/{model}/locos-niah.json", select = { top_k = 9 } }
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::policy::ablation::{AblationMode, Calibration};
use crate::policy::plan::Plan;
use crate::policy::presses::{Press, Target};
use crate::policy::select::HeadChoice;
use crate::{Error, Result};

/// The `ablate` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ablate {
    /// The query heads silenced.
    pub heads: HeadChoice,
    pub mode: AblationMode,
    /// Calibration means, needed by the mean modes (`calibration.json` of an eval run).
    #[serde(default)]
    pub calibration: Option<PathBuf>,
}

impl Press for Ablate {
    fn check(&self) -> Result<()> {
        if self.mode.needs_calibration() && self.calibration.is_none() {
            return Err(Error::invalid(
                "ablate",
                format!(
                    "mode {} needs `calibration = \"<run>/calibration.json\"`",
                    self.mode.name()
                ),
            ));
        }
        self.heads.check("ablate")
    }

    fn apply(&self, plan: &mut Plan, target: &Target<'_>) -> Result<()> {
        let chosen = self.heads.choose(target, false)?;
        let calibration = self
            .calibration
            .as_ref()
            .map(|c| Calibration::load(&target.path(c), target.id))
            .transpose()?;
        let edits = chosen
            .heads
            .interventions(self.mode, calibration.as_ref())?;
        plan.edits.merge(&edits);
        Ok(())
    }
}
