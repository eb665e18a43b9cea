//! Observation: what a caller can see inside a forward pass.
//!
//! The forward pass asks its [`Observer`] once per call what it [`Wants`], and computes
//! or copies only that: the plain path (`Wants::default()`) allocates no attention
//! matrix beyond the one softmax needs. Tensors handed to an observer are the forward
//! pass's own values (cheap `Arc` clones), never recomputed.

use candle_core::Tensor;

/// What an observer asks the forward pass for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Wants {
    /// Attention probabilities of every (layer, query head).
    pub attention: bool,
    /// Each head's value-weighted output, before `W_O`.
    pub head_outputs: bool,
    /// The residual stream after each block.
    pub residual: bool,
    /// The final hidden state (after the final norm, before the LM head).
    pub final_hidden: bool,
    /// The value vectors of every position each layer attends over.
    pub values: bool,
    /// Each head's query before RoPE.
    pub queries: bool,
}

impl Wants {
    /// Everything.
    pub fn all() -> Self {
        Self {
            attention: true,
            head_outputs: true,
            residual: true,
            final_hidden: true,
            values: true,
            queries: true,
        }
    }

    /// Whether nothing is asked for.
    pub fn none(&self) -> bool {
        *self == Self::default()
    }

    /// Whether at most the final hidden state is asked for (what a run of several
    /// positions as decode steps in one row can give, for its last position).
    pub fn at_most_final_hidden(&self) -> bool {
        Self {
            final_hidden: false,
            ..*self
        }
        .none()
    }
}

/// The last row of a `(q, d)` tensor (e.g. [`Observer::final_hidden`]'s) as a vector, or
/// `None` if it cannot be read.
pub fn last_row(t: &Tensor) -> Option<Vec<f32>> {
    let q = t.dim(0).ok()?;
    t.narrow(0, q.checked_sub(1)?, 1)
        .and_then(|r| r.flatten_all())
        .and_then(|r| r.to_vec1())
        .ok()
}

/// Receives internals of a forward pass over query positions `start..start + q`.
///
/// Every method has a no-op default; implement what you need and say so in
/// [`Observer::wants`]. Observers are `Send` because the forward pass runs on a worker
/// thread of rayon's pool while the caller waits.
pub trait Observer: Send {
    /// What to compute for this observer.
    fn wants(&self) -> Wants;
    /// A forward pass over positions `start..start + q` begins.
    fn begin(&mut self, _start: usize, _q: usize) {}
    /// Attention probabilities of layer `layer`: `(n_heads, q, kv_len)`, column `j`
    /// being position `j` (zero where a sliding window or restriction hides it).
    fn attention(&mut self, _layer: usize, _probs: &Tensor) {}
    /// Value vectors of layer `layer`: `(n_kv_heads, kv_len, d_head)`, row `j` being
    /// position `j` (zero for positions a sliding-window layer no longer keeps).
    fn values(&mut self, _layer: usize, _values: &Tensor) {}
    /// Queries of layer `layer` before RoPE (after QK-norm where the model has it):
    /// `(q, n_heads, d_head)`.
    fn queries(&mut self, _layer: usize, _queries: &Tensor) {}
    /// Head outputs of layer `layer` before `W_O`: `(q, n_heads, d_head)`.
    fn head_outputs(&mut self, _layer: usize, _outputs: &Tensor) {}
    /// Residual stream after block `layer`: `(q, d_model)`.
    fn residual(&mut self, _layer: usize, _resid: &Tensor) {}
    /// Final hidden state after the final norm: `(q, d_model)`.
    fn final_hidden(&mut self, _hidden: &Tensor) {}
}

/// Observes nothing: the plain, allocation-free path.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoObserver;

impl Observer for NoObserver {
    fn wants(&self) -> Wants {
        Wants::default()
    }
}

/// Two observers of one pass: each gets what either asks for, in order.
pub struct Tee<'a>(pub &'a mut dyn Observer, pub &'a mut dyn Observer);

impl Observer for Tee<'_> {
    fn wants(&self) -> Wants {
        let (a, b) = (self.0.wants(), self.1.wants());
        Wants {
            attention: a.attention || b.attention,
            head_outputs: a.head_outputs || b.head_outputs,
            residual: a.residual || b.residual,
            final_hidden: a.final_hidden || b.final_hidden,
            values: a.values || b.values,
            queries: a.queries || b.queries,
        }
    }
    fn begin(&mut self, start: usize, q: usize) {
        self.0.begin(start, q);
        self.1.begin(start, q);
    }
    fn attention(&mut self, layer: usize, probs: &Tensor) {
        self.0.attention(layer, probs);
        self.1.attention(layer, probs);
    }
    fn values(&mut self, layer: usize, values: &Tensor) {
        self.0.values(layer, values);
        self.1.values(layer, values);
    }
    fn queries(&mut self, layer: usize, queries: &Tensor) {
        self.0.queries(layer, queries);
        self.1.queries(layer, queries);
    }
    fn head_outputs(&mut self, layer: usize, outputs: &Tensor) {
        self.0.head_outputs(layer, outputs);
        self.1.head_outputs(layer, outputs);
    }
    fn residual(&mut self, layer: usize, resid: &Tensor) {
        self.0.residual(layer, resid);
        self.1.residual(layer, resid);
    }
    fn final_hidden(&mut self, hidden: &Tensor) {
        self.0.final_hidden(hidden);
        self.1.final_hidden(hidden);
    }
}

/// One forward call's captured internals, as recorded by [`Recorder`].
#[derive(Debug, Clone, Default)]
pub struct Capture {
    /// First query position of the call.
    pub start: usize,
    /// Per layer `(n_heads, q, kv_len)`; empty unless asked for.
    pub attention: Vec<Tensor>,
    /// Per layer `(q, n_heads, d_head)`; empty unless asked for.
    pub head_outputs: Vec<Tensor>,
    /// Per layer `(q, d_model)`; empty unless asked for.
    pub residual: Vec<Tensor>,
    /// `(q, d_model)`; `None` unless asked for.
    pub final_hidden: Option<Tensor>,
    /// Per layer `(n_kv_heads, kv_len, d_head)`; empty unless asked for.
    pub values: Vec<Tensor>,
    /// Per layer `(q, n_heads, d_head)`, before RoPE; empty unless asked for.
    pub queries: Vec<Tensor>,
}

/// Records what it wants, one [`Capture`] per forward call (i.e. per decode step when
/// used during generation).
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    wants: Wants,
    /// One entry per forward call, in order.
    pub steps: Vec<Capture>,
}

impl Recorder {
    /// A recorder for `wants`.
    pub fn new(wants: Wants) -> Self {
        Self {
            wants,
            steps: Vec::new(),
        }
    }

    fn current(&mut self) -> &mut Capture {
        if self.steps.is_empty() {
            self.steps.push(Capture::default());
        }
        let last = self.steps.len() - 1;
        &mut self.steps[last]
    }
}

impl Observer for Recorder {
    fn wants(&self) -> Wants {
        self.wants
    }
    fn begin(&mut self, start: usize, _q: usize) {
        self.steps.push(Capture {
            start,
            ..Capture::default()
        });
    }
    fn attention(&mut self, _layer: usize, probs: &Tensor) {
        self.current().attention.push(probs.clone());
    }
    fn head_outputs(&mut self, _layer: usize, outputs: &Tensor) {
        self.current().head_outputs.push(outputs.clone());
    }
    fn queries(&mut self, _layer: usize, queries: &Tensor) {
        self.current().queries.push(queries.clone());
    }
    fn residual(&mut self, _layer: usize, resid: &Tensor) {
        self.current().residual.push(resid.clone());
    }
    fn final_hidden(&mut self, hidden: &Tensor) {
        self.current().final_hidden = Some(hidden.clone());
    }
    fn values(&mut self, _layer: usize, values: &Tensor) {
        self.current().values.push(values.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::Wants;

    #[test]
    fn at_most_the_final_hidden_state_is_nothing_else() {
        let hidden = Wants {
            final_hidden: true,
            ..Wants::default()
        };
        assert!(Wants::default().at_most_final_hidden());
        assert!(hidden.at_most_final_hidden());
        for more in [
            Wants {
                residual: true,
                ..hidden
            },
            Wants {
                attention: true,
                ..Wants::default()
            },
            Wants::all(),
        ] {
            assert!(!more.at_most_final_hidden(), "{more:?}");
        }
    }
}
