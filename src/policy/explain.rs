//! Per-token introspection of a generation ("explain"): for every generated token,
//!
//! - the entropy (nats) of the distribution it was drawn from: the `H` of DRAGIN's
//!   RIND trigger, the part of its retrieval signal known at the token itself (the
//!   attention factor needs later tokens);
//! - for chosen query heads (a server takes the top retrieval heads of a ranking), the
//!   prompt positions each read most at the step that produced the token, with their
//!   weight and the text around them: a pointer from the answer back to its source;
//! - under a probe-driven policy, the heads the probe predicted most active for that
//!   step (the prediction that chose which heads read their cold tier).
//!
//! The attention is the decode step's own (an [`Observer`] of the step, over what each
//! head's store holds): a position a policy evicted reads 0.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::model::{entropy, Config, Observer, Wants};
use crate::{Error, Result};

/// What to explain about each token.
#[derive(Debug, Clone, PartialEq)]
pub struct ExplainConfig {
    /// Query heads `(layer, head)` whose reading is reported, in this order.
    pub heads: Vec<(usize, usize)>,
    /// Prompt positions reported per head (those it read most).
    pub positions: usize,
    /// Prompt tokens either side of a position in its text.
    pub context: usize,
    /// Heads reported from a probe's prediction (probe-driven policies).
    pub probe_heads: usize,
}

impl ExplainConfig {
    /// Refuse heads outside the model of `cfg` and empty reports.
    pub fn check(&self, cfg: &Config) -> Result<()> {
        if let Some(&(l, h)) = self
            .heads
            .iter()
            .find(|&&(l, h)| l >= cfg.n_layers || h >= cfg.n_heads)
        {
            return Err(Error::invalid(
                "explain",
                format!(
                    "head ({l}, {h}) is outside the model's {} layers x {} heads",
                    cfg.n_layers, cfg.n_heads
                ),
            ));
        }
        if self.positions == 0 {
            return Err(Error::invalid("explain", "positions must be at least 1"));
        }
        Ok(())
    }
}

/// One generated token, explained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenExplain {
    /// Entropy (nats) of the distribution the token was drawn from.
    pub entropy: f32,
    /// What each chosen head read.
    pub heads: Vec<HeadRead>,
    /// The probe's most active heads for this step (probe-driven policies only).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub probe: Option<Vec<ProbeHead>>,
}

/// The prompt positions one query head read most at a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadRead {
    pub layer: usize,
    pub head: usize,
    /// Most read first.
    pub reads: Vec<PositionRead>,
}

/// A prompt position, its attention weight, and the prompt text around it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PositionRead {
    pub position: usize,
    pub weight: f32,
    pub text: String,
}

/// A head and the activity a probe predicted for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeHead {
    pub layer: usize,
    pub head: usize,
    pub activity: f32,
}

/// Observes a decode step's attention and keeps, per chosen head, the prompt positions
/// it read most.
#[derive(Debug)]
pub(crate) struct HeadReads {
    cfg: ExplainConfig,
    prompt_len: usize,
    reads: Vec<HeadRead>,
}

impl HeadReads {
    pub(crate) fn new(cfg: ExplainConfig, prompt_len: usize) -> Self {
        Self {
            cfg,
            prompt_len,
            reads: Vec::new(),
        }
    }

    /// Prompt tokens either side of a position in its text.
    pub(crate) fn context(&self) -> usize {
        self.cfg.context
    }

    /// The step's token, explained from its `logits` `(1, vocab)` and, under a probe,
    /// the probe's prediction `(n_layers * n_heads)` for the step; texts are left empty
    /// ([`fill_text`] adds them).
    pub(crate) fn explain(
        &mut self,
        logits: &Tensor,
        probe: Option<&[f32]>,
        n_heads: usize,
    ) -> Result<TokenExplain> {
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let mut heads = std::mem::take(&mut self.reads);
        let order = |r: &HeadRead| self.cfg.heads.iter().position(|&h| h == (r.layer, r.head));
        heads.sort_by_key(order);
        let probe = probe.map(|p| {
            top(p, self.cfg.probe_heads)
                .into_iter()
                .map(|(i, activity)| ProbeHead {
                    layer: i / n_heads,
                    head: i % n_heads,
                    activity,
                })
                .collect()
        });
        Ok(TokenExplain {
            entropy: entropy(&logits),
            heads,
            probe,
        })
    }
}

impl Observer for HeadReads {
    fn wants(&self) -> Wants {
        Wants {
            attention: true,
            ..Wants::default()
        }
    }

    fn begin(&mut self, _start: usize, _q: usize) {
        self.reads.clear();
    }

    /// `probs` `(n_heads, 1, kv_len)`: keep each chosen head's most read prompt
    /// positions.
    fn attention(&mut self, layer: usize, probs: &Tensor) {
        for &(l, h) in self.cfg.heads.iter().filter(|(l, _)| *l == layer) {
            let Ok(row) = probs.get(h).and_then(|r| r.flatten_all()?.to_vec1::<f32>()) else {
                continue;
            };
            let prompt = &row[..self.prompt_len.min(row.len())];
            let reads = top(prompt, self.cfg.positions)
                .into_iter()
                .map(|(position, weight)| PositionRead {
                    position,
                    weight,
                    text: String::new(),
                })
                .collect();
            self.reads.push(HeadRead {
                layer: l,
                head: h,
                reads,
            });
        }
    }
}

/// The `k` largest values of `xs` with their indices, largest first (ties: lower index
/// first).
fn top(xs: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut v: Vec<(usize, f32)> = xs.iter().copied().enumerate().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    v.truncate(k);
    v
}

/// Fill each read's text: the prompt tokens `context` either side of its position,
/// decoded by `decode`.
pub(crate) fn fill_text(
    explain: &mut TokenExplain,
    prompt: &[u32],
    context: usize,
    decode: &dyn Fn(&[u32]) -> String,
) {
    for read in explain.heads.iter_mut().flat_map(|h| h.reads.iter_mut()) {
        let from = read.position.saturating_sub(context);
        let to = (read.position + context + 1).min(prompt.len());
        if from < to {
            read.text = decode(&prompt[from..to]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn top_is_largest_first_with_ties_by_position() {
        assert_eq!(
            top(&[0.1, 0.4, 0.2, 0.4], 3),
            [(1, 0.4), (3, 0.4), (2, 0.2)]
        );
        assert_eq!(top(&[0.5], 3), [(0, 0.5)]);
    }

    #[test]
    fn reads_keep_the_chosen_heads_prompt_positions_in_the_asked_order() {
        let cfg = ExplainConfig {
            heads: vec![(1, 0), (0, 1)],
            positions: 2,
            context: 1,
            probe_heads: 2,
        };
        // a prompt of 4 tokens; the step is at position 5 (a generated token before it)
        let mut reads = HeadReads::new(cfg, 4);
        reads.begin(5, 1);
        let layer =
            |rows: [[f32; 6]; 2]| Tensor::from_vec(rows.concat(), (2, 1, 6), &Device::Cpu).unwrap();
        // layer 0, head 1: most on generated position 4 (not a prompt position), then 2, 0
        reads.attention(
            0,
            &layer([
                [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                [0.2, 0.0, 0.3, 0.0, 0.5, 0.0],
            ]),
        );
        reads.attention(
            1,
            &layer([
                [0.0, 0.6, 0.0, 0.4, 0.0, 0.0],
                [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            ]),
        );
        let logits = Tensor::from_vec(vec![0.0f32; 4], (1, 4), &Device::Cpu).unwrap();
        let probe = [0.1, 0.9, 0.3, 0.7];
        let mut e = reads.explain(&logits, Some(&probe), 2).unwrap();
        assert!((e.entropy - 4f32.ln()).abs() < 1e-6);
        let got: Vec<(usize, usize, Vec<usize>)> = e
            .heads
            .iter()
            .map(|h| {
                (
                    h.layer,
                    h.head,
                    h.reads.iter().map(|r| r.position).collect(),
                )
            })
            .collect();
        assert_eq!(got, [(1, 0, vec![1, 3]), (0, 1, vec![2, 0])]);
        let probe: Vec<(usize, usize)> = e
            .probe
            .as_ref()
            .unwrap()
            .iter()
            .map(|p| (p.layer, p.head))
            .collect();
        assert_eq!(probe, [(0, 1), (1, 1)]);
        let prompt = [10, 11, 12, 13];
        fill_text(&mut e, &prompt, 1, &|ids| format!("{ids:?}"));
        assert_eq!(e.heads[0].reads[0].text, "[10, 11, 12]");
        assert_eq!(e.heads[1].reads[1].text, "[10, 11]");
    }
}
