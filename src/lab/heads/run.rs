//! Running scoring trials: one observed greedy generation per trial feeds both scorers.
//!
//! The prompt is prefilled unobserved except for its last token; from then on every
//! step is observed (attention rows and value vectors of every layer) and scored once
//! its token is known:
//! * [`crate::lab::heads::wu`] credits every step;
//! * [`crate::lab::heads::locos`] scores the steps of the model's own greedy output
//!   that produce the gold answer: the first place where the answer's tokens appear in
//!   the output, in order (the paper's "decoding steps that produce the correct
//!   answer"; small models often restate the question before answering, so the answer
//!   need not come first). [`LocosSteps::Teacher`] instead scores a second,
//!   teacher-forced pass over the gold answer's tokens right after the prompt.
//!
//! A trial is accepted when the ROUGE-1 recall of the answer in the generated text is at
//! least [`ACCEPT_RECALL`].

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::lab::heads::{locos, stability, wu};
use crate::lab::tasks::Trial;
use crate::metrics::rouge1_recall;
use crate::model::{argmax, Interventions, LoadedModel, NoObserver, Observer, Session, Wants};
use crate::policy::ranking::HeadMatrix;
use crate::{Error, Result};

/// Which decoding steps LOCOS scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LocosSteps {
    /// The model's own greedy steps that produce the answer (the default).
    Greedy,
    /// The gold answer's tokens teacher-forced after the prompt (one extra pass).
    Teacher,
}

impl LocosSteps {
    /// `greedy` or `teacher`.
    pub fn name(self) -> &'static str {
        match self {
            LocosSteps::Greedy => "greedy",
            LocosSteps::Teacher => "teacher",
        }
    }
}

/// ROUGE-1 recall of the answer needed to accept a trial.
pub const ACCEPT_RECALL: f64 = 0.5;

/// What one trial yielded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrialOutcome {
    /// The trial's id.
    pub id: String,
    /// Its haystack length in tokens.
    pub context_tokens: usize,
    /// The greedy continuation.
    pub generated: String,
    /// Its token ids.
    pub tokens: Vec<u32>,
    /// ROUGE-1 recall of the answer in it.
    pub recall: f64,
    /// Wu credit summed over the steps, `(n_layers * n_heads)` row-major.
    pub wu: Vec<f64>,
    /// LOCOS step scores summed over the scored steps, same layout.
    pub locos: Vec<f64>,
    /// Steps LOCOS scored.
    pub locos_steps: usize,
}

impl TrialOutcome {
    /// Whether the trial counts.
    pub fn accepted(&self) -> bool {
        self.recall >= ACCEPT_RECALL
    }
}

/// Holds the current step's attention rows and (if asked for) values, one entry per
/// layer.
struct StepObserver {
    attention: Vec<Option<Tensor>>,
    values: Vec<Option<Tensor>>,
    want_values: bool,
}

impl StepObserver {
    fn new(n_layers: usize, want_values: bool) -> Self {
        Self {
            attention: vec![None; n_layers],
            values: vec![None; n_layers],
            want_values,
        }
    }
}

impl Observer for StepObserver {
    fn wants(&self) -> Wants {
        Wants {
            attention: true,
            values: self.want_values,
            ..Wants::default()
        }
    }
    fn attention(&mut self, layer: usize, probs: &Tensor) {
        self.attention[layer] = Some(probs.clone());
    }
    fn values(&mut self, layer: usize, values: &Tensor) {
        self.values[layer] = Some(values.clone());
    }
}

/// Per-model data LOCOS needs, computed once: every layer's `W_O` and the unembedding
/// rows scaled by the final norm's weight.
pub struct Scorer<'a> {
    lm: &'a LoadedModel,
    w_o: Vec<Tensor>,
    unembed: Tensor,
    gamma: Tensor,
    steps: LocosSteps,
}

impl<'a> Scorer<'a> {
    /// Prepare scoring with `lm`.
    pub fn new(lm: &'a LoadedModel) -> Result<Self> {
        let n = lm.model.config().n_layers;
        Ok(Self {
            lm,
            w_o: (0..n)
                .map(|l| lm.model.output_projection(l))
                .collect::<Result<_>>()?,
            unembed: lm.model.unembedding()?,
            gamma: lm.model.final_norm_weight().clone(),
            steps: LocosSteps::Greedy,
        })
    }

    /// Score LOCOS on `steps` instead of the default greedy steps.
    pub fn with_locos_steps(mut self, steps: LocosSteps) -> Self {
        self.steps = steps;
        self
    }

    /// LOCOS scores of one observed step that produced (or was fed) `y`.
    fn locos_step(&self, obs: &StepObserver, y: u32, trial: &Trial) -> Result<HeadMatrix> {
        let cfg = self.lm.model.config();
        let mut m = HeadMatrix::zeros(cfg.n_layers, cfg.n_heads);
        let u = (self.unembed.get(y as usize)? * &self.gamma)?;
        for l in 0..cfg.n_layers {
            let (Some(probs), Some(values)) = (&obs.attention[l], &obs.values[l]) else {
                continue;
            };
            let dirs = locos::head_directions(&self.w_o[l], &u, cfg.n_heads)?;
            let s = locos::step_scores(probs, values, &dirs, &trial.needle)?;
            for (h, v) in s.into_iter().enumerate() {
                *m.at(l, h) += v;
            }
        }
        Ok(m)
    }

    /// LOCOS summed over the gold answer's tokens teacher-forced after the prompt.
    fn teacher_locos(&self, trial: &Trial) -> Result<(HeadMatrix, usize)> {
        let model = &self.lm.model;
        let cfg = model.config();
        let none = Interventions::new();
        let prompt = &trial.prompt;
        let mut session = Session::new(model, prompt.len() + trial.answer_tokens.len());
        if prompt.len() > 1 {
            let head = &prompt[..prompt.len() - 1];
            session.prefill(head, &mut NoObserver, &none)?;
        }
        let mut sum = HeadMatrix::zeros(cfg.n_layers, cfg.n_heads);
        let mut input = *prompt
            .last()
            .ok_or(Error::Internal("prompts are never empty"))?;
        for &y in &trial.answer_tokens {
            let mut obs = StepObserver::new(cfg.n_layers, true);
            session.step(input, &mut obs, &none)?;
            sum.add(&self.locos_step(&obs, y, trial)?);
            input = y;
        }
        Ok((sum, trial.answer_tokens.len()))
    }

    /// Run one trial with up to `max_new` generated tokens.
    pub fn trial(&self, trial: &Trial, max_new: usize) -> Result<TrialOutcome> {
        let model = &self.lm.model;
        let cfg = model.config();
        let (n_layers, nh) = (cfg.n_layers, cfg.n_heads);
        let mut wu_sum = HeadMatrix::zeros(n_layers, nh);
        let mut locos_sum = HeadMatrix::zeros(n_layers, nh);
        let mut locos_steps = 0;
        let none = Interventions::new();
        let prompt = &trial.prompt;
        let mut session = Session::new(model, prompt.len() + max_new);
        if prompt.len() > 1 {
            session.prefill(&prompt[..prompt.len() - 1], &mut NoObserver, &none)?;
        }
        let mut sequence = prompt.clone();
        let mut generated: Vec<u32> = Vec::new();
        let mut input = *prompt
            .last()
            .ok_or(Error::Internal("prompts are never empty"))?;
        let mut candidates: Vec<Option<HeadMatrix>> = Vec::with_capacity(max_new);
        // Greedy LOCOS needs the values of every step; Wu only the attention.
        let greedy = self.steps == LocosSteps::Greedy;
        for _ in 0..max_new {
            let mut obs = StepObserver::new(n_layers, greedy);
            let logits = session.step(input, &mut obs, &none)?;
            let y = argmax(&logits)?;
            for l in 0..n_layers {
                if let Some(probs) = &obs.attention[l] {
                    wu::add_step(&mut wu_sum, l, probs, &sequence, &trial.needle, y)?;
                }
            }
            // Greedy LOCOS is computed for every step that emits an answer token; which
            // of them count is decided once the whole output is known.
            candidates.push(if greedy && trial.answer_tokens.contains(&y) {
                Some(self.locos_step(&obs, y, trial)?)
            } else {
                None
            });
            generated.push(y);
            sequence.push(y);
            if self.lm.special.stop.contains(&y) {
                break;
            }
            input = y;
        }
        match self.steps {
            LocosSteps::Greedy => {
                // The steps that produce the answer: its first complete occurrence.
                let m = trial.answer_tokens.len();
                let found = (0..generated.len().saturating_sub(m) + 1)
                    .find(|&i| m > 0 && generated.get(i..i + m) == Some(&trial.answer_tokens[..]));
                if let Some(at) = found {
                    for step in candidates[at..at + m].iter().flatten() {
                        locos_sum.add(step);
                        locos_steps += 1;
                    }
                }
            }
            LocosSteps::Teacher => {
                (locos_sum, locos_steps) = self.teacher_locos(trial)?;
            }
        }
        let text = self.lm.decode(&generated)?;
        Ok(TrialOutcome {
            id: trial.id.clone(),
            context_tokens: trial.context_tokens,
            recall: rouge1_recall(&trial.answer, &text),
            generated: text,
            tokens: generated,
            wu: wu_sum.data,
            locos: locos_sum.data,
            locos_steps,
        })
    }
}

/// Final scores over the accepted trials of `outcomes`: Wu = mean trial credit; LOCOS =
/// mean step score over their scored steps ([`stability::scores`]). Returns `(wu, locos,
/// accepted trials, LOCOS steps)`.
pub fn aggregate(
    outcomes: &[TrialOutcome],
    n_layers: usize,
    n_heads: usize,
) -> (HeadMatrix, HeadMatrix, usize, usize) {
    let accepted: Vec<&TrialOutcome> = outcomes.iter().filter(|o| o.accepted()).collect();
    let matrix = |data| HeadMatrix {
        n_layers,
        n_heads,
        data,
    };
    let len = n_layers * n_heads;
    let (wu, trials) = stability::scores(&accepted, stability::Method::Wu, len);
    let (locos, steps) = stability::scores(&accepted, stability::Method::Locos, len);
    (matrix(wu), matrix(locos), trials, steps)
}
