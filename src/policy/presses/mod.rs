//! The policies, one file each, and the registry that makes them a TOML `type`.
//!
//! A policy is a [`Press`]: it checks its own values ([`Press::check`], once, when a
//! [`crate::policy::Policy`] is made) and writes what it decides into the [`Plan`]
//! being resolved for a model ([`Press::apply`]): what each KV head keeps, which query
//! heads are top-k restricted or ablated, how dynamic heads are picked. Head-level
//! policies score heads and keep the best through the shared selector
//! ([`crate::policy::select`]). Adding a policy is a file here and a line in
//! `registry!`'s list below; `docs/adding-a-policy.md` walks through
//! [`window`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::model::{Config, ModelId};
use crate::policy::evict::Eviction;
use crate::policy::plan::{Plan, Prefill};
use crate::Result;

/// Default attention-sink positions a streaming head keeps.
pub const DEFAULT_SINK: usize = 16;
/// Default recent window a streaming head keeps.
pub const DEFAULT_WINDOW: usize = 256;

pub(crate) fn default_sink() -> usize {
    DEFAULT_SINK
}

pub(crate) fn default_window() -> usize {
    DEFAULT_WINDOW
}

/// What every policy does.
pub trait Press {
    /// Check every value that can be checked without the model (ranges, required
    /// fields); errors name the key.
    fn check(&self) -> Result<()>;

    /// Write what this policy decides into `plan`, resolved for the model of `target`;
    /// files, model identity and head ranges fail here, before generation.
    fn apply(&self, plan: &mut Plan, target: &Target<'_>) -> Result<()>;

    /// Whether this policy decides what KV heads keep (a composition has at most one);
    /// every token press does.
    fn sets_retention(&self) -> bool {
        self.presses_tokens()
    }

    /// Whether this policy is a token press (it evicts prompt positions by a score).
    fn presses_tokens(&self) -> bool {
        false
    }

    /// Its name in reports when that is not its TOML `type` (e.g. `dynamic_oracle`).
    fn label(&self) -> Option<String> {
        None
    }
}

/// A token press's part of a plan: the prompt prefilled in full, then `eviction`.
pub(crate) fn press_tokens(plan: &mut Plan, eviction: Eviction) {
    plan.prefill = Prefill::FullThenEvict;
    plan.evict = Some(eviction);
}

/// The model a policy is resolved for, and where its relative paths start.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub cfg: &'a Config,
    pub id: &'a ModelId,
    /// The folder relative paths are read from.
    pub base: &'a Path,
}

impl Target<'_> {
    /// A path of the policy, relative to the base folder, with `{model}` replaced by the
    /// model's name (so one preset serves every model).
    pub fn path(&self, p: &Path) -> PathBuf {
        let text = p.to_string_lossy().replace("{model}", &self.id.name);
        self.base.join(text)
    }
}

/// Declares the policy modules and [`PolicyConfig`], the tagged enum over them (the
/// variant `Window` is `type = "window"`: the module name is the TOML type).
macro_rules! registry {
    ($($(#[$doc:meta])* $module:ident => $Type:ident,)*) => {
        $(pub mod $module;)*
        $(pub use $module::$Type;)*

        /// One policy as written in TOML (`type = "<module>"` plus its keys), not yet
        /// checked: [`PolicyConfig::check`] makes the [`crate::policy::Policy`] that
        /// plans are resolved from.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "type", rename_all = "snake_case")]
        pub enum PolicyConfig {
            $($(#[$doc])* $Type($Type),)*
        }

        impl PolicyConfig {
            /// Every TOML `type`, in registry order.
            pub const KINDS: &'static [&'static str] = &[$(stringify!($module)),*];

            /// The TOML `type` of this policy.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(PolicyConfig::$Type(_) => stringify!($module),)*
                }
            }

            /// The policy behind the variant.
            pub fn press(&self) -> &dyn Press {
                match self {
                    $(PolicyConfig::$Type(p) => p,)*
                }
            }
        }
    };
}

registry! {
    /// No compression: every head keeps every position.
    full => Full,
    /// Every head keeps `sink` + `window` positions (StreamingLLM).
    window => Window,
    /// Heads selected from a ranking keep everything; the others stream.
    static_heads => StaticHeads,
    /// Heads picked every step by a probe (or the oracle) read a cold tier.
    dynamic_heads => DynamicHeads,
    /// Chosen heads attend only to their top-k keys at decode steps (a mask).
    topk_mask => TopkMask,
    /// Chosen heads are silenced.
    ablate => Ablate,
    /// Every KV head keeps the prompt positions with the smallest key norms.
    knorm => Knorm,
    /// Every KV head keeps what the prompt's last window attends to (SnapKV).
    snapkv => Snapkv,
    /// SnapKV's scores with budgets falling with depth (PyramidKV).
    pyramidkv => Pyramidkv,
    /// Every KV head keeps what the prompt's last position attends to (TOVA).
    tova => Tova,
    /// Every KV head keeps what the whole prefill attended to most (H2O).
    observed_attention => ObservedAttention,
    /// Every KV head keeps what the next queries are expected to attend to.
    expected_attention => ExpectedAttention,
    /// Every KV head keeps what the model reads to repeat the context (KVzip).
    kvzip => Kvzip,
    /// Another press's scores with the budget shared across a layer's heads (AdaKV).
    adakv => Adakv,
    /// Every store's rows in f16 or 8-bit blocks (llama.cpp's q8_0).
    quantize => Quantize,
    /// Several policies at once.
    compose => Compose,
}

impl PolicyConfig {
    /// The policy's short name (`full`, `window`, `static_heads`, ...; `compose` joins
    /// its parts with `+`).
    pub fn name(&self) -> String {
        self.press()
            .label()
            .unwrap_or_else(|| self.kind().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_name_is_its_toml_type() {
        for kind in PolicyConfig::KINDS {
            // The bare type parses far enough to name its variant (missing keys are
            // errors about those keys, never about the type).
            let err = match toml::from_str::<PolicyConfig>(&format!("type = \"{kind}\"")) {
                Ok(p) => {
                    assert_eq!(p.kind(), *kind);
                    continue;
                }
                Err(e) => e.to_string(),
            };
            assert!(!err.contains("unknown variant"), "{kind}: {err}");
        }
        let err = toml::from_str::<PolicyConfig>("type = \"sparse\"").unwrap_err();
        assert!(err.to_string().contains("unknown variant"), "{err}");
    }
}
