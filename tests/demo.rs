//! `headwise demo`, the README's first command: it runs on the real model from the
//! repository's root, prints both answers and the memory each held, and refuses bad
//! input with one line.

mod common;

use std::process::Command;

fn demo(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_headwise"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("demo")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_demo_answers_under_both_caches_and_the_policy_holds_less() {
    let model = common::real_model();
    let model = model.to_str().unwrap();
    let (code, out, err) = demo(&["--model", model, "--notes", "60", "--max-tokens", "4"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("full: \""), "{out}");
    assert!(out.contains("static-locos: \""), "{out}");
    // "static-locos held P% of the full cache's peak KV memory (A MiB against B MiB)"
    let line = out
        .lines()
        .find(|l| l.starts_with("static-locos held"))
        .unwrap();
    let share: f64 = line
        .trim_start_matches("static-locos held ")
        .split('%')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(share > 0.0 && share < 100.0, "{line}");
}

#[test]
fn the_demo_refuses_bad_input_with_one_line() {
    let (code, _, err) = demo(&["--policy", "no/such/policy.toml"]);
    assert_eq!(code, 1, "{err}");
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: ") && last.contains("no such policy file"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let (code, _, err) = demo(&["--notes", "5"]);
    assert_eq!(code, 2, "a usage error: {err}");
    assert!(
        err.contains("60..=2000") || err.contains("60..2001"),
        "{err}"
    );
}
