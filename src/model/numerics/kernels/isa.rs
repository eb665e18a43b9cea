//! The instruction set the kernels run on, detected when first needed: the best this CPU
//! has, or lower when `HEADWISE_ISA` caps it (so the AVX2 path can be run and tested on
//! an AVX-512 machine). Nothing depends on the flags the binary was built with: every
//! SIMD path is compiled with `#[target_feature]` and entered only after
//! `is_x86_feature_detected!` said yes.

use std::sync::OnceLock;

use crate::{Error, Result};

/// The environment variable that caps the instruction set.
pub const ISA_ENV: &str = "HEADWISE_ISA";

/// An instruction set of the kernels, from the lowest to the highest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust loops, on any CPU.
    Portable,
    /// x86-64 AVX2 with FMA and F16C: `vpmaddubsw` + `vpmaddwd` integer dot products.
    Avx2,
    /// x86-64 AVX-VNNI (the VEX-encoded, 256-bit VNNI of Alder Lake, Zen 5 and newer Xeons,
    /// which may lack AVX-512): `vpdpbusd` on AVX2's registers.
    AvxVnni,
    /// x86-64 AVX-512 VNNI (with BW and VL): `vpdpbusd` on 512-bit registers, two blocks
    /// at a time.
    Avx512Vnni,
}

/// An [`Isa`] that this CPU was checked to run (else [`Isa::Portable`]): what the
/// kernels take, so that their unsafe paths are entered only where the CPU has them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Supported(Isa);

impl Supported {
    /// `isa` if the CPU runs it, else the portable loop.
    pub(super) fn new(isa: Isa) -> Self {
        Supported(if isa.supported() { isa } else { Isa::Portable })
    }

    /// The instruction set that runs.
    pub(super) fn isa(self) -> Isa {
        self.0
    }
}

/// Every instruction set, lowest first.
const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni];

impl Isa {
    /// The name `HEADWISE_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }

    /// Whether this CPU can run it.
    pub fn supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Isa::Avx2.supported() && std::arch::is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.supported()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every instruction set this CPU runs, lowest first (tests run each).
    pub fn available() -> Vec<Isa> {
        ALL.into_iter().filter(|i| i.supported()).collect()
    }

    /// The best this CPU runs, capped by `cap` when given: an error if `cap` is not a
    /// name of [`Isa::name`] or names a set this CPU lacks.
    pub fn select(cap: Option<&str>) -> Result<Isa> {
        let best = Isa::available().into_iter().max().unwrap_or(Isa::Portable);
        let Some(cap) = cap else {
            return Ok(best);
        };
        let wanted = ALL.into_iter().find(|i| i.name() == cap).ok_or_else(|| {
            Error::invalid(
                ISA_ENV,
                format!("`{cap}` (expected portable, avx2, avxvnni or avx512vnni)"),
            )
        })?;
        if !wanted.supported() {
            let names: Vec<&str> = Isa::available().iter().map(|i| i.name()).collect();
            return Err(Error::invalid(
                ISA_ENV,
                format!("`{cap}`: this CPU lacks it (it runs {})", names.join(", ")),
            ));
        }
        Ok(wanted)
    }

    /// [`Isa::select`] with `HEADWISE_ISA`: call it where a bad value should stop the work
    /// (model load), before [`Isa::active`] runs.
    pub fn from_env() -> Result<Isa> {
        Isa::select(std::env::var(ISA_ENV).ok().as_deref())
    }

    /// The instruction set in force, fixed at the first call: [`Isa::from_env`], or the
    /// best available if `HEADWISE_ISA` is invalid (model load reports that as an error
    /// before any kernel runs).
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            Isa::from_env().unwrap_or_else(|_| Isa::select(None).unwrap_or(Isa::Portable))
        })
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_is_always_available_and_caps_are_checked() {
        assert!(Isa::available().contains(&Isa::Portable));
        assert_eq!(Isa::select(Some("portable")).unwrap(), Isa::Portable);
        let best = Isa::select(None).unwrap();
        assert_eq!(best, *Isa::available().last().unwrap());
        assert!(Isa::select(Some("sse9"))
            .unwrap_err()
            .to_string()
            .contains("expected"));
        for isa in ALL {
            assert_eq!(Isa::select(Some(isa.name())).is_ok(), isa.supported());
        }
    }
}
