//! Intervention: what a caller can change inside a forward pass, per (layer, query head).
//!
//! * the head's output before `W_O` (zeroed, or replaced by a given vector: the zero- and
//!   mean-ablations of `docs/methods.md`, "Ablation modes");
//! * the head's query (replaced by a given vector before RoPE, or zeroed after it so that
//!   attention is uniform over the visible keys: the mean-query and uniform-attention
//!   ablations);
//! * an additive bias on its pre-softmax attention scores, per key position;
//! * the key positions it may attend to (sink + recent window, or explicit ranges).
//!
//! The query's own position always stays visible, so a restriction can never leave a
//! softmax over nothing. Layers without edits take the plain path.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::{Device, Tensor};

use crate::model::Config;
use crate::{Error, Result};

/// Replacement of a head's output (its `d_head` vector before `W_O`).
#[derive(Debug, Clone, PartialEq)]
pub enum OutputEdit {
    /// The output is zero (`zero-output` ablation).
    Zero,
    /// The output is this `d_head` vector at every position (`mean-output` ablation).
    Replace(Vec<f32>),
}

/// Replacement of a head's query vector.
#[derive(Debug, Clone, PartialEq)]
pub enum QueryEdit {
    /// The query before RoPE (after QK-norm where the model has it) is this `d_head`
    /// vector at every position; RoPE still rotates it to each position, so relative
    /// positions keep their meaning (`mean-query` ablation).
    Replace(Vec<f32>),
    /// The query is zero after RoPE: every visible key scores 0, so the head attends
    /// uniformly over the keys it may see (`uniform-attention` ablation).
    Uniform,
}

/// Which key positions a head may attend to.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyRestriction {
    /// The first `sink` positions and the `window` most recent ones (query included).
    SinkWindow { sink: usize, window: usize },
    /// Only positions inside these ranges.
    Ranges(Vec<Range<usize>>),
}

impl KeyRestriction {
    fn allows(&self, key: usize, query: usize) -> bool {
        match self {
            KeyRestriction::SinkWindow { sink, window } => key < *sink || key + window > query,
            KeyRestriction::Ranges(ranges) => ranges.iter().any(|r| r.contains(&key)),
        }
    }
}

/// Which scores one attention call computes: queries at absolute positions `queries`
/// against the stored keys at absolute positions `keys`, in a layer that sees the
/// `window` most recent positions (or everything).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MaskSpan {
    pub queries: Range<usize>,
    pub keys: Range<usize>,
    pub window: Option<usize>,
}

/// All edits applied to one head.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadEdit {
    /// Replace the head's output.
    pub output: Option<OutputEdit>,
    /// Replace the head's query.
    pub query: Option<QueryEdit>,
    /// Added to the pre-softmax score of key position `j` (index `j`; missing = 0).
    pub bias: Option<Vec<f32>>,
    /// Restrict the visible key positions.
    pub keys: Option<KeyRestriction>,
}

/// Edits per (layer, query head), validated against a model's shape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Interventions {
    layers: BTreeMap<usize, BTreeMap<usize, HeadEdit>>,
}

impl Interventions {
    /// No edits.
    pub fn new() -> Self {
        Self::default()
    }

    /// The edit of (layer, head), created empty if absent.
    pub fn head(&mut self, layer: usize, head: usize) -> &mut HeadEdit {
        self.layers
            .entry(layer)
            .or_default()
            .entry(head)
            .or_default()
    }

    /// Replace the output of (layer, head).
    pub fn set_output(&mut self, layer: usize, head: usize, edit: OutputEdit) -> &mut Self {
        self.head(layer, head).output = Some(edit);
        self
    }

    /// Replace the query of (layer, head).
    pub fn set_query(&mut self, layer: usize, head: usize, edit: QueryEdit) -> &mut Self {
        self.head(layer, head).query = Some(edit);
        self
    }

    /// Add every edit of `other`; a head edited in both takes `other`'s edit.
    pub fn merge(&mut self, other: &Interventions) {
        for (&layer, heads) in &other.layers {
            for (&head, edit) in heads {
                *self.head(layer, head) = edit.clone();
            }
        }
    }

    /// Whether any head has a score bias or a key restriction.
    pub fn restricts_keys(&self) -> bool {
        self.layers
            .values()
            .flat_map(|heads| heads.values())
            .any(|e| e.bias.is_some() || e.keys.is_some())
    }

    /// Whether there is no edit at all.
    pub fn is_empty(&self) -> bool {
        self.layers.values().all(|heads| heads.is_empty())
    }

    /// Add `bias[j]` to (layer, head)'s score for key position `j`.
    pub fn set_bias(&mut self, layer: usize, head: usize, bias: Vec<f32>) -> &mut Self {
        self.head(layer, head).bias = Some(bias);
        self
    }

    /// Restrict the key positions (layer, head) sees.
    pub fn restrict_keys(&mut self, layer: usize, head: usize, keys: KeyRestriction) -> &mut Self {
        self.head(layer, head).keys = Some(keys);
        self
    }

    /// Check every address and vector length against `cfg`.
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        for (&layer, heads) in &self.layers {
            for (&head, edit) in heads {
                Error::check_head(layer, head, cfg.n_layers, cfg.n_heads)?;
                let replacements = [
                    (
                        "output replacement",
                        edit.output.as_ref().and_then(|o| match o {
                            OutputEdit::Replace(v) => Some(v),
                            OutputEdit::Zero => None,
                        }),
                    ),
                    (
                        "query replacement",
                        edit.query.as_ref().and_then(|q| match q {
                            QueryEdit::Replace(v) => Some(v),
                            QueryEdit::Uniform => None,
                        }),
                    ),
                ];
                for (what, v) in replacements {
                    if let Some(v) = v.filter(|v| v.len() != cfg.d_head) {
                        return Err(Error::invalid(
                            what,
                            format!(
                                "head ({layer}, {head}): {} values, the head has {}",
                                v.len(),
                                cfg.d_head
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Layer `layer`'s head edits, if any of them biases scores or restricts keys.
    fn mask_edits(&self, layer: usize) -> Option<&BTreeMap<usize, HeadEdit>> {
        self.layers
            .get(&layer)
            .filter(|h| h.values().any(|e| e.bias.is_some() || e.keys.is_some()))
    }

    /// Whether layer `layer` has edits that bias scores or restrict keys (so its
    /// attention needs [`Self::score_mask`] beyond causality and the window).
    pub(crate) fn masks_scores(&self, layer: usize) -> bool {
        self.mask_edits(layer).is_some()
    }

    /// The additive mask of layer `layer` over `span`: `(n_heads, q, kv_len)` combining
    /// causality, the layer's sliding window and this layer's biases and key
    /// restrictions; `None` when plain causal attention over the stored keys is exact
    /// (no edits on the layer and no stored key outside a query's window).
    pub(crate) fn score_mask(
        &self,
        layer: usize,
        n_heads: usize,
        span: &MaskSpan,
    ) -> Result<Option<Tensor>> {
        let heads = self.mask_edits(layer);
        let q = span.queries.len();
        let window_cuts = span
            .window
            .is_some_and(|w| span.keys.start + w < span.queries.end);
        if heads.is_none() && !window_cuts {
            return Ok(None);
        }
        let kv_len = span.keys.len();
        let mut mask = vec![0f32; n_heads * q * kv_len];
        for h in 0..n_heads {
            let edit = heads.and_then(|heads| heads.get(&h));
            for (t, query) in span.queries.clone().enumerate() {
                let row = &mut mask[(h * q + t) * kv_len..(h * q + t + 1) * kv_len];
                for (m, key) in row.iter_mut().zip(span.keys.clone()) {
                    let visible = key <= query
                        && span.window.is_none_or(|w| key + w > query)
                        && (key == query
                            || edit
                                .and_then(|e| e.keys.as_ref())
                                .is_none_or(|k| k.allows(key, query)));
                    *m = if !visible {
                        f32::NEG_INFINITY
                    } else {
                        edit.and_then(|e| e.bias.as_ref())
                            .and_then(|b| b.get(key).copied())
                            .unwrap_or(0.0)
                    };
                }
            }
        }
        Ok(Some(Tensor::from_vec(
            mask,
            (n_heads, q, kv_len),
            &Device::Cpu,
        )?))
    }

    /// Apply output edits of layer `layer` to `outputs`: `(q, n_heads, d_head)`.
    pub(crate) fn edit_outputs(&self, layer: usize, outputs: Tensor) -> Result<Tensor> {
        self.edit_rows(layer, outputs, false, |e| {
            e.output.as_ref().map(|o| match o {
                OutputEdit::Zero => None,
                OutputEdit::Replace(v) => Some(v.as_slice()),
            })
        })
    }

    /// Apply the pre-RoPE query replacements of layer `layer` to `queries`:
    /// `(1, n_heads, q, d_head)`.
    pub(crate) fn replace_queries(&self, layer: usize, queries: Tensor) -> Result<Tensor> {
        self.edit_rows(layer, queries, true, |e| match &e.query {
            Some(QueryEdit::Replace(v)) => Some(Some(v.as_slice())),
            _ => None,
        })
    }

    /// Zero the rotated queries of layer `layer`'s uniform-attention heads: `queries`
    /// `(n_heads, q, d_head)`.
    pub(crate) fn uniform_queries(&self, layer: usize, queries: Tensor) -> Result<Tensor> {
        self.edit_rows(layer, queries, true, |e| match &e.query {
            Some(QueryEdit::Uniform) => Some(None),
            _ => None,
        })
    }

    /// Overwrite the `d_head` rows of the heads that `pick` selects in a tensor whose
    /// last two axes are `(q, n_heads, d_head)` (`head_major == false`) or
    /// `(n_heads, q, d_head)` (`head_major == true`, after any leading unit axes):
    /// `pick` returns `Some(None)` for zeros and `Some(Some(v))` for `v`.
    fn edit_rows<'e>(
        &'e self,
        layer: usize,
        t: Tensor,
        head_major: bool,
        pick: impl Fn(&'e HeadEdit) -> Option<Option<&'e [f32]>>,
    ) -> Result<Tensor> {
        let Some(heads) = self.layers.get(&layer) else {
            return Ok(t);
        };
        let picked: Vec<(usize, Option<&[f32]>)> = heads
            .iter()
            .filter_map(|(&h, e)| pick(e).map(|v| (h, v)))
            .collect();
        if picked.is_empty() {
            return Ok(t);
        }
        let shape = t.dims().to_vec();
        let n = shape.len();
        let (a, b, d_head) = (shape[n - 3], shape[n - 2], shape[n - 1]);
        let (n_heads, q) = if head_major { (a, b) } else { (b, a) };
        let mut data = t.flatten_all()?.to_vec1::<f32>()?;
        for (h, v) in picked {
            for p in 0..q {
                let row = if head_major {
                    h * q + p
                } else {
                    p * n_heads + h
                };
                let slot = &mut data[row * d_head..(row + 1) * d_head];
                match v {
                    None => slot.fill(0.0),
                    Some(v) => slot.copy_from_slice(v),
                }
            }
        }
        Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sink_window_keeps_first_and_recent_positions() {
        let k = KeyRestriction::SinkWindow { sink: 2, window: 3 };
        let seen: Vec<usize> = (0..=10).filter(|&j| k.allows(j, 10)).collect();
        assert_eq!(seen, vec![0, 1, 8, 9, 10]);
    }

    #[test]
    fn mask_hides_future_and_restricted_keys_but_never_the_query_itself() {
        let mut iv = Interventions::new();
        let only_first = std::iter::once(0..1).collect();
        iv.restrict_keys(0, 1, KeyRestriction::Ranges(only_first));
        iv.set_bias(0, 0, vec![0.5, -0.5]);
        let m = iv
            .score_mask(0, 2, &span(1..3, 0..3, None))
            .unwrap()
            .unwrap();
        let m: Vec<Vec<Vec<f32>>> = m.to_vec3().unwrap();
        let inf = f32::NEG_INFINITY;
        // head 0: bias on keys 0 and 1, causal for queries at positions 1 and 2
        assert_eq!(m[0], vec![vec![0.5, -0.5, inf], vec![0.5, -0.5, 0.0]]);
        // head 1: only key 0, plus the query's own position
        assert_eq!(m[1], vec![vec![0.0, 0.0, inf], vec![0.0, inf, 0.0]]);
    }

    #[test]
    fn layers_without_edits_get_no_mask() {
        let mut iv = Interventions::new();
        iv.set_output(3, 0, OutputEdit::Zero);
        assert!(iv
            .score_mask(3, 4, &span(0..2, 0..2, None))
            .unwrap()
            .is_none());
        assert!(iv
            .score_mask(1, 4, &span(0..2, 0..2, None))
            .unwrap()
            .is_none());
        // a window that every query's keys fit in needs no mask either
        assert!(iv
            .score_mask(1, 4, &span(5..6, 2..6, Some(4)))
            .unwrap()
            .is_none());
    }

    fn span(queries: Range<usize>, keys: Range<usize>, window: Option<usize>) -> MaskSpan {
        MaskSpan {
            queries,
            keys,
            window,
        }
    }

    #[test]
    fn a_sliding_window_hides_keys_older_than_the_window() {
        let iv = Interventions::new();
        // queries at 10 and 11 over stored keys 8..12, window 3
        let m = iv
            .score_mask(0, 1, &span(10..12, 8..12, Some(3)))
            .unwrap()
            .unwrap();
        let m: Vec<Vec<Vec<f32>>> = m.to_vec3().unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(
            m[0],
            vec![vec![0.0, 0.0, 0.0, inf], vec![inf, 0.0, 0.0, 0.0]]
        );
        // biases are indexed by absolute position, restrictions apply on top
        let mut iv = Interventions::new();
        iv.set_bias(0, 0, vec![0.0; 9].into_iter().chain([0.25, 0.5]).collect());
        iv.restrict_keys(
            0,
            0,
            KeyRestriction::Ranges(std::iter::once(9..10).collect()),
        );
        let m = iv
            .score_mask(0, 1, &span(10..11, 8..11, Some(3)))
            .unwrap()
            .unwrap();
        assert_eq!(m.to_vec3::<f32>().unwrap()[0], vec![vec![inf, 0.25, 0.5]]);
    }
}
