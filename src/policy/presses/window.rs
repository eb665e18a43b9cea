//! `window`: every KV head keeps the first `sink` positions and the last `window`
//! (StreamingLLM: Xiao et al., 2023, "Efficient Streaming Language Models with
//! Attention Sinks"). The simplest policy and the example of
//! `docs/adding-a-policy.md`.
//!
//! ```toml
//! type = "window"
//! sink = 16
//! window = 256
//! prefill = "stream"   # or "full_then_evict"
//! ```

use serde::{Deserialize, Serialize};

use crate::model::Retention;
use crate::policy::plan::{Plan, Prefill};
use crate::policy::presses::{default_sink, default_window, Press, Target};
use crate::{Error, Result};

/// The `window` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Window {
    /// First positions every head keeps.
    #[serde(default = "default_sink")]
    pub sink: usize,
    /// Most recent positions every head keeps.
    #[serde(default = "default_window")]
    pub window: usize,
    #[serde(default)]
    pub prefill: Prefill,
}

impl Press for Window {
    fn check(&self) -> Result<()> {
        check_window(self.window)
    }

    fn apply(&self, plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        plan.retention.fill(Retention::Stream {
            sink: self.sink,
            window: self.window,
        });
        plan.prefill = self.prefill;
        Ok(())
    }

    fn sets_retention(&self) -> bool {
        true
    }
}

/// A streaming window must hold at least one position (the one being decoded).
pub(crate) fn check_window(window: usize) -> Result<()> {
    if window == 0 {
        return Err(Error::invalid("window", "0 (must be at least 1)"));
    }
    Ok(())
}
