//! One answer segment: greedy tokens after a prompt until a stop token, a newline after
//! some text, the token cap, or the trigger. Three ways to make one:
//!
//! - [`instrumented`]: the instrumented model generates and observes each step inline
//!   (output entropy, last-layer attention averaged over heads, final hidden state for
//!   a probe);
//! - [`crate::reference::mistralrs::streamed`] (feature `mistralrs`): mistral.rs generates and streams; the
//!   instrumented model re-reads each streamed token teacher-forced to observe the same
//!   things; when the trigger fires the stream is dropped, which cancels it;
//! - [`masked`]: the instrumented model generates with chosen heads restricted to their
//!   top-k keys (in-context retrieval), the heads chosen before every step; whichever
//!   engine wrote the rest of the answer (mistral.rs cannot mask heads). It reads the
//!   prompt's last token as a masked decode step, so the first token is masked too.
//!
//! The first two judge the trigger after every token over the segment so far
//! ([`Segment::complete`] false), so both stop at the same token when they generate
//! the same tokens.

use candle_core::{DType, Tensor};

use crate::model::{
    last_row, HeadCache, LoadedModel, Observer, Retention, RowFormat, Session, TopK, Wants,
};
use crate::probe::{Probe, Workspace};
use crate::rag::text::Stopwords;
use crate::rag::trigger::{entropy, fires, Segment, TriggerConfig};
use crate::{Error, Result};

/// The probe behind a `retrieval_heads` trigger or a probe-chosen mask, and the heads
/// it watches.
#[derive(Debug, Clone, Copy)]
pub struct HeadSignal<'a> {
    /// Predicts every head's retrieval activity from the final hidden state.
    pub probe: Option<&'a Probe>,
    /// `layer * n_heads + head` of the watched heads (a ranking's top heads).
    pub heads: &'a [usize],
}

/// What the trigger needs to judge a segment.
#[derive(Debug, Clone, Copy)]
pub struct Judge<'a> {
    pub trigger: &'a TriggerConfig,
    pub stop: &'a Stopwords,
    /// Tokens generated before this segment.
    pub offset: usize,
    /// The watched heads' predicted activity, for `retrieval_heads`.
    pub signal: Option<HeadSignal<'a>>,
}

/// Everything one segment's steps showed.
#[derive(Debug, Clone, Default)]
pub struct SegmentRun {
    pub tokens: Vec<u32>,
    /// Each token's text (empty for a stop token).
    pub pieces: Vec<String>,
    /// Entropy (nats) of the distribution each token was drawn from (observed runs).
    pub entropy: Vec<f32>,
    /// `rows[j]`: last-layer attention (mean over heads) of generated token `j` as the
    /// query over positions `0..=prompt + j` (observed runs).
    pub rows: Vec<Vec<f32>>,
    /// Mean predicted activity of the watched heads at the step that produced token `j`.
    pub signal: Vec<f32>,
    /// The generated token at which the trigger fired.
    pub fired: Option<usize>,
}

/// Keeps the last layer's head-averaged attention row and the final hidden state of a
/// single-query step.
struct StepObserver {
    last_layer: usize,
    attention: bool,
    hidden: bool,
    row: Option<Vec<f32>>,
    final_hidden: Option<Vec<f32>>,
}

impl StepObserver {
    fn new(lm: &LoadedModel, attention: bool, hidden: bool) -> Self {
        Self {
            last_layer: lm.model.config().n_layers - 1,
            attention,
            hidden,
            row: None,
            final_hidden: None,
        }
    }
}

impl Observer for StepObserver {
    fn wants(&self) -> Wants {
        Wants {
            attention: self.attention,
            final_hidden: self.hidden,
            ..Wants::default()
        }
    }

    fn attention(&mut self, layer: usize, probs: &Tensor) {
        if layer == self.last_layer {
            self.row = probs
                .mean(0)
                .and_then(|m| m.flatten_all())
                .and_then(|m| m.to_dtype(DType::F32))
                .and_then(|m| m.to_vec1())
                .ok();
        }
    }

    /// `hidden` is `(q, d_model)`; the last position's row is kept.
    fn final_hidden(&mut self, hidden: &Tensor) {
        self.final_hidden = last_row(hidden);
    }
}

/// Whether generation ends after `last`: a stop token, or a newline after some text.
fn stops(lm: &LoadedModel, text: &str, last: u32) -> bool {
    lm.special.stop.contains(&last) || text.trim_start().contains('\n')
}

/// The instrumented model following a segment token by token: the tokens either come
/// from its own logits ([`Watch::logits`]) or from another engine (teacher forcing).
pub(crate) struct Watch<'a> {
    lm: &'a LoadedModel,
    session: Session<'a>,
    obs: StepObserver,
    judge: Option<Judge<'a>>,
    probe_ws: Option<Workspace>,
    probe_out: Vec<f32>,
    /// Whether each accepted token is run through the model (else only its text is
    /// followed).
    forward: bool,
    max_new: usize,
    prompt_len: usize,
    /// Logits `(1, vocab)` for the next token.
    next: Option<Tensor>,
    text: String,
    run: SegmentRun,
}

impl<'a> Watch<'a> {
    /// Read `prompt`; `forward` false follows only the text (nothing to observe and
    /// another engine generates).
    pub(crate) fn start(
        lm: &'a LoadedModel,
        prompt: &[u32],
        max_new: usize,
        judge: Option<Judge<'a>>,
        forward: bool,
    ) -> Result<Self> {
        if prompt.is_empty() {
            return Err(Error::invalid("prompt", "empty"));
        }
        let probe = judge.and_then(|j| j.signal).and_then(|s| s.probe);
        let mut w = Self {
            lm,
            session: Session::new(&lm.model, prompt.len() + max_new + 1),
            obs: StepObserver::new(lm, judge.is_some(), probe.is_some()),
            judge,
            probe_ws: probe.map(Probe::workspace),
            probe_out: Vec::new(),
            forward: forward || judge.is_some(),
            max_new,
            prompt_len: prompt.len(),
            next: None,
            text: String::new(),
            run: SegmentRun::default(),
        };
        if w.forward {
            // The whole prompt in one pass, as mistral.rs reads it: the first token's
            // distribution then comes from the same arithmetic in both engines. (The
            // prompt's attention rows are not needed; a probe needs the last hidden
            // state.)
            let mut obs = StepObserver::new(lm, false, probe.is_some());
            let edits = Default::default();
            let logits = w.session.prefill(prompt, &mut obs, &edits)?;
            w.obs.final_hidden = obs.final_hidden;
            w.next = Some(logits);
        }
        Ok(w)
    }

    /// Run `token` through the model: the next logits, and `token`'s attention row.
    fn step(&mut self, token: u32) -> Result<()> {
        let edits = Default::default();
        let logits = self.session.step(token, &mut self.obs, &edits)?;
        self.next = Some(logits);
        Ok(())
    }

    /// The distribution of the next token, `(1, vocab)`.
    fn logits(&self) -> Result<&Tensor> {
        last_logits(&self.next)
    }

    /// The next token, drawn greedily from the last step's logits.
    fn sample(&mut self) -> Result<u32> {
        self.session.sample(last_logits(&self.next)?)
    }

    /// Take `token` as the next generated token; returns whether the segment goes on
    /// (no stop, no cap, no trigger).
    /// The segment watched so far.
    pub(crate) fn finish(self) -> SegmentRun {
        self.run
    }

    pub(crate) fn accept(&mut self, token: u32) -> Result<bool> {
        if let Some(judge) = self.judge {
            let values: Vec<f32> = self
                .logits()?
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_vec1()?;
            self.run.entropy.push(entropy(&values));
            if let Some(HeadSignal {
                probe: Some(probe),
                heads,
            }) = judge.signal
            {
                let hidden = self.obs.final_hidden.take().unwrap_or_default();
                let ws = self
                    .probe_ws
                    .as_mut()
                    .ok_or(Error::Internal("a probe workspace is made with the probe"))?;
                self.probe_out.resize(probe.output_dim(), 0.0);
                probe.predict_into(&hidden, ws, &mut self.probe_out)?;
                let mean = heads.iter().map(|&i| self.probe_out[i]).sum::<f32>()
                    / heads.len().max(1) as f32;
                self.run.signal.push(mean);
            }
        }
        let piece = if self.lm.special.stop.contains(&token) {
            String::new()
        } else {
            self.lm.decode(&[token])?
        };
        self.text.push_str(&piece);
        self.run.tokens.push(token);
        self.run.pieces.push(piece);
        let ended = stops(self.lm, &self.text, token) || self.run.tokens.len() == self.max_new;
        if self.judge.is_some() || (self.forward && !ended) {
            self.obs.row = None;
            self.step(token)?;
            if self.judge.is_some() {
                let row = self.obs.row.take().unwrap_or_default();
                self.run.rows.push(row);
            }
        }
        if let Some(judge) = self.judge {
            self.run.fired = self.judge_now(&judge, ended)?;
        }
        Ok(!ended && self.run.fired.is_none())
    }

    /// The trigger's verdict on the segment so far.
    fn judge_now(&self, judge: &Judge, complete: bool) -> Result<Option<usize>> {
        let p = self.prompt_len;
        let n = self.run.tokens.len();
        let pieces: Vec<&str> = self.run.pieces.iter().map(String::as_str).collect();
        let attention: Vec<Vec<f32>> = self
            .run
            .rows
            .iter()
            .map(|row| {
                (0..n)
                    .map(|i| row.get(p + i).copied().unwrap_or(0.0))
                    .collect()
            })
            .collect();
        let segment = Segment {
            pieces: &pieces,
            entropy: &self.run.entropy,
            attention: &attention,
            head_signal: (!self.run.signal.is_empty()).then_some(self.run.signal.as_slice()),
            offset: judge.offset,
            complete,
        };
        fires(judge.trigger, &segment, judge.stop)
    }
}

/// Makes answer segments: the instrumented model itself ([`Instrumented`]) or, with
/// the `mistralrs` feature, mistral.rs streaming
/// ([`MistralRsEngine`](crate::reference::mistralrs::MistralRsEngine)).
pub trait SegmentSource: std::fmt::Debug + Sync {
    /// Generate one segment greedily after `prompt`, judging the trigger after every
    /// token if `judge` is given (the instrumented model observes).
    fn segment(
        &self,
        lm: &LoadedModel,
        prompt: &[u32],
        max_new: usize,
        judge: Option<Judge>,
    ) -> Result<SegmentRun>;
}

/// The instrumented model generates (observation inline, a single pass).
#[derive(Debug, Clone, Copy, Default)]
pub struct Instrumented;

impl SegmentSource for Instrumented {
    fn segment(
        &self,
        lm: &LoadedModel,
        prompt: &[u32],
        max_new: usize,
        judge: Option<Judge>,
    ) -> Result<SegmentRun> {
        instrumented(lm, prompt, max_new, judge)
    }
}

/// The logits of a watch's last step.
fn last_logits(next: &Option<Tensor>) -> Result<&Tensor> {
    next.as_ref()
        .ok_or_else(|| Error::invalid("segment", "no logits: the model is not run"))
}

/// A segment generated by the instrumented model; `judge` none: no trigger is watched.
pub fn instrumented(
    lm: &LoadedModel,
    prompt: &[u32],
    max_new: usize,
    judge: Option<Judge>,
) -> Result<SegmentRun> {
    let mut watch = Watch::start(lm, prompt, max_new, judge, true)?;
    for _ in 0..max_new {
        let next = watch.sample()?;
        if !watch.accept(next)? {
            break;
        }
    }
    Ok(watch.run)
}

/// How the heads of a masked segment are chosen, `layer * n_heads + head` each.
#[derive(Debug, Clone, Copy)]
pub enum MaskHeads<'a> {
    /// The same heads at every step.
    Fixed(&'a [usize]),
    /// At every step, the `n` heads the probe predicts most active from the final
    /// hidden state of the step before.
    Probe { probe: &'a Probe, n: usize },
}

/// A segment generated by the instrumented model with the chosen heads restricted, at
/// every decode step, to their top `mask.k` keys plus a sink and a recent window.
pub fn masked(
    lm: &LoadedModel,
    prompt: &[u32],
    max_new: usize,
    heads: MaskHeads,
    mask: TopK,
) -> Result<SegmentRun> {
    let model = &lm.model;
    let cfg = model.config();
    let (&last, head) = prompt
        .split_last()
        .ok_or_else(|| Error::invalid("prompt", "empty"))?;
    let retention = vec![Retention::Full; cfg.n_layers * cfg.n_kv_heads];
    let cache = HeadCache::new(cfg, &retention, RowFormat::F32, prompt.len() + max_new + 1)?;
    let mut session = Session::with_cache(model, cache);
    let probe = match heads {
        MaskHeads::Probe { probe, .. } => Some(probe),
        MaskHeads::Fixed(_) => None,
    };
    let mut obs = StepObserver::new(lm, false, probe.is_some());
    let edits = Default::default();
    if !head.is_empty() {
        session.prefill(head, &mut obs, &edits)?;
    }
    let set = |cache: &mut HeadCache, chosen: &[usize], tk: Option<TopK>| -> Result<()> {
        for &i in chosen {
            cache.set_topk(i / cfg.n_heads, i % cfg.n_heads, tk)?;
        }
        Ok(())
    };
    let mut chosen: Vec<usize> = match heads {
        MaskHeads::Fixed(h) => h.to_vec(),
        MaskHeads::Probe { .. } => Vec::new(),
    };
    set(session.cache_mut(), &chosen, Some(mask))?;
    let mut ws = probe.map(Probe::workspace);
    let mut predicted = Vec::new();
    let mut run = SegmentRun::default();
    let mut text = String::new();
    let mut input = last;
    while run.tokens.len() < max_new {
        if let (MaskHeads::Probe { probe, n }, Some(hidden)) = (heads, obs.final_hidden.take()) {
            let ws = ws
                .as_mut()
                .ok_or(Error::Internal("a probe workspace is made with the probe"))?;
            predicted.resize(probe.output_dim(), 0.0);
            probe.predict_into(&hidden, ws, &mut predicted)?;
            set(session.cache_mut(), &chosen, None)?;
            chosen = top_indices(&predicted, n);
            set(session.cache_mut(), &chosen, Some(mask))?;
        }
        let logits = session.step(input, &mut obs, &edits)?;
        let next = session.sample(&logits)?;
        let piece = if lm.special.stop.contains(&next) {
            String::new()
        } else {
            lm.decode(&[next])?
        };
        text.push_str(&piece);
        run.tokens.push(next);
        run.pieces.push(piece);
        if stops(lm, &text, next) {
            break;
        }
        input = next;
    }
    Ok(run)
}

/// Indices of the `n` largest values, largest first (ties to the lower index).
fn top_indices(values: &[f32], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(n);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_indices_are_the_largest_first() {
        assert_eq!(top_indices(&[0.1, 0.9, 0.5, 0.9], 3), vec![1, 3, 2]);
        assert_eq!(top_indices(&[0.1], 3), vec![0]);
    }
}
