//! Retrieval-head scoring: Wu et al.'s token-match score ([`wu`]), LOCOS logit
//! contribution ([`locos`]), the trial runner that feeds both from one observed greedy
//! generation per trial ([`run`]), and the bootstrap stability of a ranking's top heads
//! ([`stability`]); the rankings they produce are
//! [`crate::policy::ranking`] files.

pub mod cca;
pub mod dynamic_ablation;
pub mod dynamics;
pub mod locos;
pub mod run;
pub mod stability;
pub mod trace;
pub mod wu;
