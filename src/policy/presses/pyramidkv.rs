//! `pyramidkv`: SnapKV's scores with budgets that fall with depth (Cai et al. 2024,
//! "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling";
//! kvpress's `PyramidKVPress`): the first pressed layer keeps about twice the average,
//! the last about `1 / beta` of it, linearly in between, so the pressed layers together
//! keep what an equal budget would. Where that shape does not fit (the smallest budget
//! under the window, one pressed layer) every layer keeps the equal budget. Depth counts
//! the layers that are pressed (Gemma 3's global layers), so the mean holds.
//!
//! ```toml
//! type = "pyramidkv"
//! compression_ratio = 0.5
//! window_size = 64   # default
//! kernel_size = 5    # default
//! beta = 20.0        # default
//! ```


use serde::{Deserialize, Serialize};

use crate::policy::evict::{Budget, Eviction};
use crate::policy::plan::Plan;
use crate::policy::presses::knorm::check_ratio;
use crate::policy::presses::snapkv::{
    check_window, default_kernel_size, default_window_size, WindowAttention,
};
use crate::policy::presses::{press_tokens, Press, Target};
use crate::{Error, Result};

/// The `pyramidkv` policy's keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pyramidkv {
    /// Share of the pressed positions dropped over all pressed layers, in `(0, 1)`.
    pub compression_ratio: f64,
    #[serde(default = "default_window_size")]
    pub window_size: usize,
    #[serde(default = "default_kernel_size")]
    pub kernel_size: usize,
    /// How steep the pyramid is: the last layer keeps about `1 / beta` of the mean.
    #[serde(default = "default_beta")]
    pub beta: f64,
}

fn default_beta() -> f64 {
    20.0
}

impl Press for Pyramidkv {
    fn check(&self) -> Result<()> {
        check_ratio(self.compression_ratio)?;
        check_window(self.window_size, self.kernel_size)?;
        if !(self.beta >= 1.0 && self.beta.is_finite()) {
            return Err(Error::invalid(
                "beta",
                format!("{} (must be at least 1)", self.beta),
            ));
        }
        Ok(())
    }

    fn apply(&self, plan: &mut Plan, _target: &Target<'_>) -> Result<()> {
        let scorer = WindowAttention {
            window: self.window_size,
            kernel: self.kernel_size,
        };
        let budget = Budget::Pyramid {
            window: self.window_size,
            beta: self.beta,
        };
        press_tokens(
            plan,
            Eviction {
                budget,
                ..Eviction::new(self.compression_ratio, scorer)
            },
        );
        Ok(())
    }

    fn presses_tokens(&self) -> bool {
        true
    }
}
