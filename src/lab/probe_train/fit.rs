//! Training the probe network with candle: seeded initialisation, AdamW, mini-batches in
//! a seeded order, seeded dropout after every hidden activation, gradient clipping by
//! global norm, reduce-LR-on-plateau and early stopping on the validation loss (the
//! weights of the best validation epoch are kept).
//!
//! Losses, per step a row of `H` head logits `z` with labels `y`:
//! - asymmetric loss (Ridnik et al. 2021, "Asymmetric Loss For Multi-Label
//!   Classification", eq. 4 with the probability shift of eq. 6): with `p = sigmoid(z)` and
//!   `p_m = max(p - m, 0)`,
//!   `L = -sum_h [ y (1 - p)^gamma_pos log p + (1 - y) p_m^gamma_neg log(1 - p_m) ]`;
//! - positive-weighted BCE: `L = -sum_h [ w_h y log p + (1 - y) log(1 - p) ]`, with `w_h`
//!   the head's train ratio of negatives to positives, clamped to `[1, max_pos_weight]`;
//!
//!   both averaged over the rows of a batch;
//! - MSE (continuous labels): the mean of `(z - y)^2` over all entries.

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Linear, Module, Optimizer, ParamsAdamW};
use ndarray::Array2;

use crate::probe::mlp::{Activation, Dense, Mlp};
use crate::probe::LabelKind;
use crate::probe::{BinaryLoss, EpochLog, ProbeConfig};
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// Relative improvement of the validation loss that counts as progress (as PyTorch's
/// `ReduceLROnPlateau` with `threshold_mode="rel"`).
const IMPROVEMENT: f64 = 1e-4;
/// Added to `p_m` before raising it to `gamma_neg`, so the power's gradient stays
/// finite where `p_m = 0`.
const POWER_EPS: f64 = 1e-8;

/// Standardised inputs and labels of the train and validation splits.
pub(crate) struct FitData<'a> {
    /// `(train_steps, input_dim)`, standardised.
    pub(crate) x_train: &'a Array2<f32>,
    /// `(train_steps, heads)`.
    pub(crate) y_train: &'a Array2<f32>,
    /// `(val_steps, input_dim)`, standardised with the train statistics.
    pub(crate) x_val: &'a Array2<f32>,
    /// `(val_steps, heads)`.
    pub(crate) y_val: &'a Array2<f32>,
}

/// A trained network and its training record.
pub(crate) struct Fitted {
    /// The dense stack of the best validation epoch (standardisation still unset:
    /// `mean` 0, `std` 1).
    pub(crate) mlp: Mlp,
    pub(crate) history: Vec<EpochLog>,
    pub(crate) best_epoch: usize,
    pub(crate) best_val_loss: f64,
}

enum Loss {
    Asymmetric {
        gamma_neg: f64,
        gamma_pos: f64,
        clip: f64,
    },
    WeightedBce {
        /// `(1, heads)`.
        pos_weight: Tensor,
    },
    Mse,
}

/// `log(1 + exp(x))` without overflow: `max(x, 0) + log(1 + exp(-|x|))`.
fn softplus(x: &Tensor) -> candle_core::Result<Tensor> {
    x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

impl Loss {
    fn new(kind: LabelKind, cfg: &ProbeConfig, y_train: &Array2<f32>) -> Result<Self> {
        Ok(match (kind, cfg.binary_loss) {
            (LabelKind::Continuous, _) => Loss::Mse,
            (
                LabelKind::Binary,
                BinaryLoss::Asymmetric {
                    gamma_neg,
                    gamma_pos,
                    clip,
                },
            ) => Loss::Asymmetric {
                gamma_neg,
                gamma_pos,
                clip,
            },
            (LabelKind::Binary, BinaryLoss::WeightedBce { max_pos_weight }) => {
                let rows = y_train.nrows() as f64;
                let weights: Vec<f32> = y_train
                    .columns()
                    .into_iter()
                    .map(|c| {
                        let pos = c.iter().filter(|&&v| v > 0.5).count() as f64;
                        if pos == 0.0 {
                            1.0
                        } else {
                            ((rows - pos) / pos).clamp(1.0, max_pos_weight) as f32
                        }
                    })
                    .collect();
                let n = weights.len();
                Loss::WeightedBce {
                    pos_weight: Tensor::from_vec(weights, (1, n), &Device::Cpu)?,
                }
            }
        })
    }

    /// The scalar loss of `logits` against `y`, both `(rows, heads)`.
    fn value(&self, logits: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Loss::Mse => (logits - y)?.sqr()?.mean_all(),
            Loss::WeightedBce { pos_weight } => {
                let log_p = softplus(&logits.neg()?)?.neg()?;
                let log_not_p = softplus(logits)?.neg()?;
                let pos = (y.broadcast_mul(pos_weight)? * log_p)?;
                let neg = (y.affine(-1.0, 1.0)? * log_not_p)?;
                (pos + neg)?.neg()?.sum(1)?.mean(0)
            }
            Loss::Asymmetric {
                gamma_neg,
                gamma_pos,
                clip,
            } => {
                let log_p = softplus(&logits.neg()?)?.neg()?;
                let pos_term = if *gamma_pos > 0.0 {
                    // (1 - p)^gamma = exp(-gamma softplus(z)).
                    (log_p * (softplus(logits)? * -gamma_pos)?.exp()?)?
                } else {
                    log_p
                };
                let (p_m, log_not_p_m) = if *clip > 0.0 {
                    let p_m = (candle_nn::ops::sigmoid(logits)? - *clip)?.relu()?;
                    let log = p_m.affine(-1.0, 1.0)?.log()?;
                    (p_m, log)
                } else {
                    (candle_nn::ops::sigmoid(logits)?, softplus(logits)?.neg()?)
                };
                let neg_term = if *gamma_neg > 0.0 {
                    (log_not_p_m * (p_m + POWER_EPS)?.powf(*gamma_neg)?)?
                } else {
                    log_not_p_m
                };
                let total = ((y * pos_term)? + (y.affine(-1.0, 1.0)? * neg_term)?)?;
                total.neg()?.sum(1)?.mean(0)
            }
        }
    }
}

/// The trainable network: one `(weight, bias)` pair of variables per layer.
struct Network {
    vars: Vec<Var>,
    layers: Vec<Linear>,
    activation: Activation,
    dropout: f32,
}

impl Network {
    /// Layers `dims[0] -> dims[1] -> ...`, weights and biases uniform in
    /// `[-1/sqrt(fan_in), 1/sqrt(fan_in)]` (PyTorch's `nn.Linear` default).
    fn new(dims: &[usize], cfg: &ProbeConfig) -> Result<Self> {
        let mut rng = SplitMix64::new(cfg.seed, 1);
        let (mut vars, mut layers) = (Vec::new(), Vec::new());
        for pair in dims.windows(2) {
            let (inputs, outputs) = (pair[0], pair[1]);
            let bound = 1.0 / (inputs as f32).sqrt();
            let mut uniform = |n: usize| -> Vec<f32> {
                (0..n)
                    .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
                    .collect()
            };
            let w = Var::from_vec(uniform(outputs * inputs), (outputs, inputs), &Device::Cpu)?;
            let b = Var::from_vec(uniform(outputs), outputs, &Device::Cpu)?;
            layers.push(Linear::new(
                w.as_tensor().clone(),
                Some(b.as_tensor().clone()),
            ));
            vars.push(w);
            vars.push(b);
        }
        Ok(Network {
            vars,
            layers,
            activation: cfg.activation,
            dropout: cfg.dropout,
        })
    }

    /// Logits `(rows, heads)` of `x` `(rows, input_dim)`; dropout when a generator is
    /// given.
    fn forward(&self, x: &Tensor, mut dropout: Option<&mut SplitMix64>) -> Result<Tensor> {
        let last = self.layers.len() - 1;
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i == last {
                break;
            }
            h = match self.activation {
                Activation::Gelu => h.gelu()?,
                Activation::Relu => h.relu()?,
            };
            if let Some(rng) = dropout.as_deref_mut() {
                if self.dropout > 0.0 {
                    let keep = 1.0 - self.dropout;
                    let mask: Vec<f32> = (0..h.elem_count())
                        .map(|_| {
                            if rng.next_f32() < keep {
                                1.0 / keep
                            } else {
                                0.0
                            }
                        })
                        .collect();
                    let mask = Tensor::from_vec(mask, h.shape(), &Device::Cpu)?;
                    h = (h * mask)?;
                }
            }
        }
        Ok(h)
    }

    /// Scale the gradients so their global L2 norm is at most `max_norm`.
    fn clip_gradients(&self, grads: &mut GradStore, max_norm: f64) -> Result<()> {
        let mut sum_sq = 0.0f64;
        for v in &self.vars {
            if let Some(g) = grads.get(v) {
                sum_sq += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
            }
        }
        let norm = sum_sq.sqrt();
        if norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            for v in &self.vars {
                if let Some(g) = grads.get(v) {
                    let scaled = (g * scale)?;
                    grads.insert(v, scaled);
                }
            }
        }
        Ok(())
    }

    fn snapshot(&self) -> Result<Vec<Tensor>> {
        Ok(self
            .vars
            .iter()
            .map(|v| v.as_tensor().copy())
            .collect::<candle_core::Result<_>>()?)
    }

    fn restore(&self, snapshot: &[Tensor]) -> Result<()> {
        for (v, t) in self.vars.iter().zip(snapshot) {
            v.set(t)?;
        }
        Ok(())
    }

    fn into_mlp(self, input_dim: usize, sigmoid: bool) -> Result<Mlp> {
        let mut layers = Vec::with_capacity(self.vars.len() / 2);
        for pair in self.vars.chunks_exact(2) {
            let (outputs, inputs) = pair[0].as_tensor().dims2()?;
            layers.push(Dense {
                weight: pair[0].as_tensor().flatten_all()?.to_vec1::<f32>()?,
                bias: pair[1].as_tensor().to_vec1::<f32>()?,
                inputs,
                outputs,
            });
        }
        Ok(Mlp {
            mean: vec![0.0; input_dim],
            std: vec![1.0; input_dim],
            layers,
            activation: self.activation,
            sigmoid,
        })
    }
}

fn tensor(a: &Array2<f32>) -> Result<Tensor> {
    Ok(Tensor::from_iter(a.iter().copied(), &Device::Cpu)?.reshape(a.dim())?)
}

fn finite(loss: f64, what: &str, epoch: usize) -> Result<f64> {
    if loss.is_finite() {
        Ok(loss)
    } else {
        Err(Error::invalid(
            "probe training",
            format!("the {what} loss became {loss} in epoch {epoch}; lower the learning rate"),
        ))
    }
}

/// Train a network on `data`; `on_epoch` sees each epoch's record as it ends.
pub(crate) fn fit(
    data: &FitData,
    kind: LabelKind,
    cfg: &ProbeConfig,
    on_epoch: &mut dyn FnMut(&EpochLog),
) -> Result<Fitted> {
    let (n, input_dim) = data.x_train.dim();
    let dims: Vec<usize> = std::iter::once(input_dim)
        .chain(cfg.hidden.iter().copied())
        .chain(std::iter::once(data.y_train.ncols()))
        .collect();
    let net = Network::new(&dims, cfg)?;
    let loss = Loss::new(kind, cfg, data.y_train)?;
    let (x_train, y_train) = (tensor(data.x_train)?, tensor(data.y_train)?);
    let (x_val, y_val) = (tensor(data.x_val)?, tensor(data.y_val)?);
    let mut opt = AdamW::new(
        net.vars.clone(),
        ParamsAdamW {
            lr: cfg.lr,
            weight_decay: cfg.weight_decay,
            ..ParamsAdamW::default()
        },
    )?;
    let mut order_rng = SplitMix64::new(cfg.seed, 2);
    let mut dropout_rng = SplitMix64::new(cfg.seed, 3);
    let mut order: Vec<u32> = (0..n as u32).collect();
    let (mut best_val_loss, mut best_epoch) = (f64::INFINITY, 0);
    let mut best = net.snapshot()?;
    let (mut since_best, mut since_reduce) = (0usize, 0usize);
    let mut history = Vec::new();
    for epoch in 1..=cfg.max_epochs {
        order_rng.shuffle(&mut order);
        let mut train_loss = 0.0f64;
        for batch in order.chunks(cfg.batch_size) {
            let idx = Tensor::from_slice(batch, batch.len(), &Device::Cpu)?;
            let xb = x_train.index_select(&idx, 0)?;
            let yb = y_train.index_select(&idx, 0)?;
            let logits = net.forward(&xb, Some(&mut dropout_rng))?;
            let l = loss.value(&logits, &yb)?;
            train_loss += f64::from(l.to_scalar::<f32>()?) * batch.len() as f64;
            let mut grads = l.backward()?;
            net.clip_gradients(&mut grads, cfg.grad_clip)?;
            opt.step(&grads)?;
        }
        let train_loss = finite(train_loss / n as f64, "train", epoch)?;
        let val_logits = net.forward(&x_val, None)?;
        let val_loss = finite(
            f64::from(loss.value(&val_logits, &y_val)?.to_scalar::<f32>()?),
            "validation",
            epoch,
        )?;
        let log = EpochLog {
            epoch,
            train_loss,
            val_loss,
            lr: opt.learning_rate(),
        };
        on_epoch(&log);
        history.push(log);
        if best_epoch == 0 || val_loss < best_val_loss - IMPROVEMENT * best_val_loss.abs() {
            (best_val_loss, best_epoch) = (val_loss, epoch);
            best = net.snapshot()?;
            (since_best, since_reduce) = (0, 0);
        } else {
            since_best += 1;
            since_reduce += 1;
            if since_best >= cfg.early_stopping_patience {
                break;
            }
            if since_reduce > cfg.plateau_patience {
                opt.set_learning_rate((opt.learning_rate() * cfg.plateau_factor).max(cfg.min_lr));
                since_reduce = 0;
            }
        }
    }
    net.restore(&best)?;
    Ok(Fitted {
        mlp: net.into_mlp(input_dim, kind == LabelKind::Binary)?,
        history,
        best_epoch,
        best_val_loss,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(activation: Activation) -> ProbeConfig {
        ProbeConfig {
            activation,
            seed: 9,
            ..ProbeConfig::default()
        }
    }

    fn sigmoid(z: f64) -> f64 {
        1.0 / (1.0 + (-z).exp())
    }

    #[test]
    fn the_candle_network_and_the_inference_loops_agree() {
        let x = Array2::from_shape_fn((4, 3), |(i, j)| (i as f32 - 1.5) * (j as f32 + 0.5));
        for activation in [Activation::Gelu, Activation::Relu] {
            let net = Network::new(&[3, 5, 4, 2], &config(activation)).unwrap();
            let want = net.forward(&tensor(&x).unwrap(), None).unwrap();
            let want = want.to_vec2::<f32>().unwrap();
            let got = net
                .into_mlp(3, false)
                .unwrap()
                .forward_batch(x.view())
                .unwrap();
            for (r, row) in want.iter().enumerate() {
                for (c, w) in row.iter().enumerate() {
                    assert!((got[[r, c]] - w).abs() < 1e-5, "{activation:?} ({r}, {c})");
                }
            }
        }
    }

    #[test]
    fn losses_match_their_formulas_entry_by_entry() {
        let z = [[2.0f32, -1.0, 0.3], [-3.0, 0.5, 4.0]];
        let y = [[1.0f32, 0.0, 0.0], [0.0, 1.0, 1.0]];
        let zt = Tensor::new(&z, &Device::Cpu).unwrap();
        let yt = Tensor::new(&y, &Device::Cpu).unwrap();
        let (gn, gp, m) = (4.0, 1.0, 0.05);
        let asl = Loss::Asymmetric {
            gamma_neg: gn,
            gamma_pos: gp,
            clip: m,
        };
        let pos_weight = [3.0f64, 1.0, 2.0];
        let bce = Loss::WeightedBce {
            pos_weight: Tensor::new(&[[3.0f32, 1.0, 2.0]], &Device::Cpu).unwrap(),
        };
        let (mut want_asl, mut want_bce, mut want_mse) = (0.0, 0.0, 0.0);
        for r in 0..2 {
            for c in 0..3 {
                let (zv, yv) = (f64::from(z[r][c]), f64::from(y[r][c]));
                let p = sigmoid(zv);
                if yv == 1.0 {
                    want_asl -= (1.0 - p).powf(gp) * p.ln();
                    want_bce -= pos_weight[c] * p.ln();
                } else {
                    let pm = (p - m).max(0.0);
                    want_asl -= pm.powf(gn) * (1.0 - pm).ln();
                    want_bce -= (1.0 - p).ln();
                }
                want_mse += (zv - yv).powi(2);
            }
        }
        let value = |l: &Loss| f64::from(l.value(&zt, &yt).unwrap().to_scalar::<f32>().unwrap());
        assert!((value(&asl) - want_asl / 2.0).abs() < 1e-5);
        assert!((value(&bce) - want_bce / 2.0).abs() < 1e-5);
        assert!((value(&Loss::Mse) - want_mse / 6.0).abs() < 1e-5);
    }

    #[test]
    fn gradients_are_clipped_to_the_global_norm() {
        let net = Network::new(&[3, 4, 2], &config(Activation::Relu)).unwrap();
        let x = tensor(&Array2::from_elem((5, 3), 10.0f32)).unwrap();
        let loss = (net
            .forward(&x, None)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            * 100.0)
            .unwrap();
        let mut grads = loss.backward().unwrap();
        let norm = |g: &GradStore| -> f64 {
            net.vars
                .iter()
                .filter_map(|v| g.get(v))
                .map(|t| {
                    f64::from(
                        t.sqr()
                            .unwrap()
                            .sum_all()
                            .unwrap()
                            .to_scalar::<f32>()
                            .unwrap(),
                    )
                })
                .sum::<f64>()
                .sqrt()
        };
        assert!(norm(&grads) > 10.0);
        net.clip_gradients(&mut grads, 1.0).unwrap();
        assert!((norm(&grads) - 1.0).abs() < 1e-3);
    }
}
