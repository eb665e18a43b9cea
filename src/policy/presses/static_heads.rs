//! `static_heads`: query heads chosen once from a ranking (Wu et al. 2024's retrieval
//! score or LOCOS's logit contribution, `policies/rankings/`) make their KV heads keep
//! everything; the other KV heads stream `sink` + `window` (the DuoAttention /
//! RazorAttention split into retrieval and streaming heads, with real per-head stores),
//! or, with `others`, keep what a token press keeps of the prompt (DuoAttention x
//! SnapKV: the retrieval heads hold every position, the rest what the press chose).
//!
//! ```toml
//! type = "static_heads"
//! gqa = "any"               # a KV head is kept when any of its query heads is selected
//! sink = 16
//! window = 256
//! prefill = "stream"        # or "full_then_evict"
//!
//! [heads]
//! ranking = "policies/rankings/{model}/locos-niah.json"
//! select = { top_k = 27 }   # or { fraction = 0.3 }, { threshold = 0.05 }, { random = { count = 27, seed = 0 } }
//! ```
//!
//! ```toml
//! type = "static_heads"
//! heads = { ranking = "policies/rankings/{model}/locos-niah.json", select = { top_k = 27 } }
//! others = { type = "snapkv", compression_ratio = 0.75 }   # sink, window, prefill unused
//! ```

use serde::{Deserialize, Serialize};

use crate::model::Retention;
use crate::policy::plan::{Plan, Prefill};
use crate::policy::presses::window::check_window;
use crate::policy::presses::{default_sink, default_window, PolicyConfig, Press, Target};
use crate::policy::select::{Gqa, HeadChoice};
use crate::{Error, Result};

/// The `static_heads` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticHeads {
    /// The heads that keep everything (only layers without a window of their own).
    pub heads: HeadChoice,
    #[serde(default)]
    pub gqa: Gqa,
    #[serde(default = "default_sink")]
    pub sink: usize,
    #[serde(default = "default_window")]
    pub window: usize,
    #[serde(default)]
    pub prefill: Prefill,
    /// A token press for the heads not chosen (`knorm`, `snapkv`, `pyramidkv`, `tova`,
    /// `observed_attention`, `adakv`), instead of `sink` + `window`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub others: Option<Box<PolicyConfig>>,
}

impl Press for StaticHeads {
    fn check(&self) -> Result<()> {
        check_window(self.window)?;
        if let Some(others) = &self.others {
            if !others.press().presses_tokens() {
                return Err(Error::invalid(
                    "others",
                    format!("{} (must be a token press: knorm, snapkv, pyramidkv, tova, observed_attention, expected_attention, kvzip, adakv)", others.kind()),
                ));
            }
            others.press().check()?;
        }
        self.heads.check("static_heads")
    }

    fn apply(&self, plan: &mut Plan, target: &Target<'_>) -> Result<()> {
        let chosen = self.heads.choose(target, true)?;
        let keep = plan.kv_heads(&chosen, self.gqa)?;
        if let Some(others) = &self.others {
            // Every head keeps its prompt through the prefill; the press then evicts from
            // the heads not chosen.
            others.press().apply(plan, target)?;
            let evict = plan
                .evict
                .as_mut()
                .ok_or(Error::Internal("a token press evicts"))?;
            evict.exempt = keep;
            return Ok(());
        }
        let stream = Retention::Stream {
            sink: self.sink,
            window: self.window,
        };
        for (r, keep) in plan.retention.iter_mut().zip(keep) {
            *r = if keep { Retention::Full } else { stream };
        }
        plan.prefill = self.prefill;
        Ok(())
    }

    fn sets_retention(&self) -> bool {
        true
    }
}
