//! The fast numerics compute the same floats on every instruction set the CPU runs: a
//! greedy generation on each real model, forced onto each set with `HEADWISE_ISA`, gives
//! the same text (prefill through dequantized tiles, decode through the integer kernels
//! and the dispatched attention loops). Block-level bit-exactness against the portable
//! loop is tested beside the kernels (`src/model/numerics/kernels/`).

mod common;

use std::path::Path;
use std::process::Command;

use headwise::model::numerics::kernels::Isa;

/// A prompt of a few hundred tokens: two prefill chunks, both above the tiled threshold.
fn long_prompt() -> String {
    let mut text = String::from("Read the notes and answer.\n");
    for i in 0..40 {
        text.push_str(&format!(
            "Note {i}: the courier left crate {} at dock {} before noon.\n",
            (i * 37) % 101,
            (i * 11) % 17
        ));
    }
    text.push_str("Question: at which dock was crate 74 left? Answer:");
    text
}

/// stdout of a 16-token greedy generation on `isa`.
fn generate(model: &Path, isa: Isa) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_headwise"))
        .args(["generate", "--max-tokens", "16", "--numerics", "fast"])
        .arg("--model")
        .arg(model)
        .args(["--prompt", &long_prompt()])
        .env("HEADWISE_ISA", isa.name())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{isa}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn same_text_on_every_isa(model: &Path) {
    let isas = Isa::available();
    let reference = generate(model, Isa::Portable);
    assert!(!reference.trim().is_empty(), "no text generated");
    for isa in isas {
        assert_eq!(
            generate(model, isa),
            reference,
            "{isa} differs from portable"
        );
    }
}

#[test]
fn smollm2_generates_the_same_text_on_every_instruction_set() {
    same_text_on_every_isa(&common::real_model());
}

#[test]
fn gemma_generates_the_same_text_on_every_instruction_set() {
    same_text_on_every_isa(&common::real_gemma());
}
