//! LOCOS on a tiny random model against an independent brute-force computation:
//! explicit loops over positions, the head's own `W_O` slice and the unembedding row.

mod common;

use common::{tiny_config, Weights};
use headwise::lab::heads::locos::{head_directions, step_scores};
use headwise::model::{HeadCache, Interventions, Logits, NoObserver, Numerics, Recorder, Wants};

#[test]
fn locos_matches_a_brute_force_loop_over_positions() {
    let w = Weights::random(tiny_config(), 31);
    let model = w.model(Numerics::Fast);
    let cfg = model.config().clone();
    let tokens = [5u32, 17, 3, 96, 42, 42, 8, 60, 1, 33];
    let mut cache = HeadCache::plain(&cfg, 16);
    model
        .forward(
            &tokens[..9],
            &mut cache,
            Logits::Last,
            &mut NoObserver,
            &Interventions::new(),
        )
        .unwrap();
    let mut rec = Recorder::new(Wants {
        attention: true,
        values: true,
        ..Wants::default()
    });
    model
        .forward(
            &tokens[9..],
            &mut cache,
            Logits::Last,
            &mut rec,
            &Interventions::new(),
        )
        .unwrap();
    let step = &rec.steps[0];
    let (y, needle) = (42usize, 3..6);
    let unembed: Vec<Vec<f32>> = model.unembedding().unwrap().to_vec2().unwrap();
    let gamma: Vec<f32> = model.final_norm_weight().to_vec1().unwrap();
    let u: Vec<f32> = unembed[y].iter().zip(&gamma).map(|(a, g)| a * g).collect();
    let u_t = candle_core::Tensor::new(u.as_slice(), &candle_core::Device::Cpu).unwrap();
    let group = cfg.n_heads / cfg.n_kv_heads;
    for layer in 0..cfg.n_layers {
        let probs = &step.attention[layer];
        let values = &step.values[layer];
        let dirs =
            head_directions(&model.output_projection(layer).unwrap(), &u_t, cfg.n_heads).unwrap();
        let fast = step_scores(probs, values, &dirs, &needle).unwrap();
        let alpha: Vec<Vec<Vec<f32>>> = probs.to_vec3().unwrap();
        let v: Vec<Vec<Vec<f32>>> = values.to_vec3().unwrap();
        let n = alpha[0][0].len();
        for head in 0..cfg.n_heads {
            // W_O[:, head] is (d_model, d_head): logit direction of value channel c is
            // sum_d W_O[d][c] * u[d]
            let wo: Vec<Vec<f32>> = model
                .head_output_projection(layer, head)
                .unwrap()
                .to_vec2()
                .unwrap();
            let (mut inside, mut outside) = (0f64, 0f64);
            for j in 0..n {
                let mut dot = 0f64;
                for c in 0..cfg.d_head {
                    let dir: f64 = (0..cfg.d_model)
                        .map(|d| wo[d][c] as f64 * u[d] as f64)
                        .sum();
                    dot += v[head / group][j][c] as f64 * dir;
                }
                let phi = alpha[head][0][j] as f64 * dot;
                if needle.contains(&j) {
                    inside += phi;
                } else {
                    outside += phi;
                }
            }
            let k = needle.len() as f64 / (n - needle.len()) as f64;
            let want = inside - k * outside;
            assert!(
                (fast[head] - want).abs() <= 1e-5 * want.abs().max(1.0),
                "layer {layer} head {head}: {} vs {want}",
                fast[head]
            );
        }
    }
}
