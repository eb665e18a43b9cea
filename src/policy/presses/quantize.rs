//! `quantize`: every store holds its rows (keys and values) in f16 or in 8-bit blocks
//! (llama.cpp's `q8_0`, its `-ctk q8_0 -ctv q8_0` cache) instead of f32; rows are
//! decoded when a query reads them. Alone it compresses every head by the same factor;
//! composed with a policy that decides what heads keep, it quantizes what they keep:
//!
//! ```toml
//! type = "compose"
//! policies = [
//!   { type = "static_heads", heads = { ranking = "policies/rankings/{model}/locos-niah.json", select = { top_k = 27 } }, others = { type = "snapkv", compression_ratio = 0.75 } },
//!   { type = "quantize", format = "q8_0" },
//! ]
//! ```
//!
//! A token press then scores the keys as stored (decoded from the quantized rows).

use serde::{Deserialize, Serialize};

use crate::model::RowFormat;
use crate::policy::plan::Plan;
use crate::policy::presses::{Press, Target};
use crate::{Error, Result};

/// The `quantize` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quantize {
    /// `f16` or `q8_0`.
    pub format: RowFormat,
}

impl Press for Quantize {
    fn check(&self) -> Result<()> {
        if self.format == RowFormat::F32 {
            return Err(Error::invalid(
                "format",
                "f32 is what every store holds unquantized (use f16 or q8_0)",
            ));
        }
        Ok(())
    }

    fn apply(&self, plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        plan.rows = self.format;
        Ok(())
    }

    fn label(&self) -> Option<String> {
        Some(format!("quantize_{}", self.format.name()))
    }
}
