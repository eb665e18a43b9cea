//! Generate under two compression policies and compare what they kept.
//!
//! ```text
//! cargo run --release --example policy_generate [MODEL.gguf]
//! ```
//!
//! The model defaults to `models/SmolLM2-135M-Instruct.Q4_1.gguf` (fetch it with
//! `headwise model fetch`). The prompt is a ~2,000-token story with one fact in the
//! middle; `full` keeps every head's history, `static-locos` only that of the heads
//! LOCOS ranks as retrieval heads.

use std::io::Write;

use headwise::policy::{GenerateRequest, Policy, Prompt, Runtime};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let filler = "The caravan moved slowly along the dry river bed, and the traders \
                  talked about the weather, the prices in the last town and the long road ahead. ";
    let mut story = filler.repeat(40);
    story.push_str("The password of the northern gate is amber-falcon. ");
    story.push_str(&filler.repeat(40));
    story.push_str(
        "\nQuestion: What is the password of the northern gate?\nAnswer: The password is",
    );
    let request = GenerateRequest::new(Prompt::Text(story), 12);
    for preset in ["policies/full.toml", "policies/static-locos.toml"] {
        let runtime = Runtime::builder()
            .model(&model)
            .policy(Policy::load(preset.as_ref(), &[])?)
            .build()?;
        print!("{preset}:");
        let out = runtime.generate(&request, &mut |step| {
            print!("{}", step.text);
            let _ = std::io::stdout().flush();
            true
        })?;
        println!("\n  {}", out.stats);
    }
    Ok(())
}
