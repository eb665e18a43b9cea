//! `topk_mask`: at decode steps the chosen query heads attend only to their `k`
//! best-scoring keys plus `sink` + `window`. A retrieval mask, not a memory saving:
//! every key stays resident.
//!
//! ```toml
//! type = "topk_mask"
//! k = 32
//! heads = { ranking = "policies/rankings/{model}/wu-niah.json", select = { top_k = 9 } }
//! ```

use serde::{Deserialize, Serialize};

use crate::model::TopK;
use crate::policy::plan::Plan;
use crate::policy::presses::window::check_window;
use crate::policy::presses::{default_sink, default_window, Press, Target};
use crate::policy::select::HeadChoice;
use crate::{Error, Result};

/// The `topk_mask` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopkMask {
    /// The query heads restricted.
    pub heads: HeadChoice,
    /// Keys each restricted head reads beside its sink and window.
    pub k: usize,
    #[serde(default = "default_sink")]
    pub sink: usize,
    #[serde(default = "default_window")]
    pub window: usize,
}

impl Press for TopkMask {
    fn check(&self) -> Result<()> {
        check_window(self.window)?;
        if self.k == 0 {
            return Err(Error::invalid("k", "0 (must be at least 1)"));
        }
        self.heads.check("topk_mask")
    }

    fn apply(&self, plan: &mut Plan, target: &Target<'_>) -> Result<()> {
        let restriction = TopK {
            k: self.k,
            sink: self.sink,
            window: self.window,
        };
        for (layer, head) in self.heads.choose(target, false)?.heads.0 {
            plan.topk.push((layer, head, restriction));
        }
        Ok(())
    }
}
