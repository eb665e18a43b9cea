//! The baselines every probe is reported against, fitted on the same train split and
//! the same standardised hidden states:
//! - **linear**: per head, L2-regularised logistic regression (`linfa-logistic`) for
//!   binary labels; ridge regression for continuous labels, all heads at once in closed
//!   form on centred data (`W = (Xc^T Xc + lambda I)^-1 Xc^T Yc`, unpenalised intercept),
//!   with `lambda` chosen from a grid by validation error. (Closed form rather than
//!   `linfa-linear`, whose least squares refactorises the inputs for every target: one
//!   factorisation here serves all `n_layers * n_heads` heads, and the penalty keeps the
//!   fit defined when there are fewer train steps than hidden dimensions.) Heads constant in train predict
//!   the constant.
//! - **static**: the same heads on every step: the `k` heads most often active in train
//!   (or a given list, e.g. the Wu et al. static top-20) for binary labels; each head's
//!   train mean for continuous labels.

use linfa::traits::Fit;
use linfa::DatasetBase;
use linfa_logistic::LogisticRegression;
use ndarray::{Array1, Array2, Axis};
use rayon::prelude::*;

use super::metrics::top_heads;
use crate::probe::{BaselineConfig, LabelKind, StaticHeads};
use crate::{Error, Result};

/// A fitted linear baseline: `scores = link(X W + b)`, `W` `(input_dim, heads)`.
pub(crate) struct LinearBaseline {
    weights: Array2<f64>,
    intercept: Array1<f64>,
    /// Heads predicted as a constant (logistic regression cannot fit one class).
    constant: Vec<Option<f64>>,
    logistic: bool,
    pub(crate) ridge_lambda: Option<f64>,
}

impl LinearBaseline {
    /// Fit on standardised `x_train` `(rows, input_dim)` and `y_train` `(rows, heads)`;
    /// the validation split chooses the ridge penalty.
    pub(crate) fn fit(
        kind: LabelKind,
        cfg: &BaselineConfig,
        x_train: &Array2<f32>,
        y_train: &Array2<f32>,
        x_val: &Array2<f32>,
        y_val: &Array2<f32>,
        n_heads: usize,
    ) -> Result<Self> {
        let x = x_train.mapv(f64::from);
        match kind {
            LabelKind::Binary => fit_logistic(cfg, &x, y_train, n_heads),
            LabelKind::Continuous => fit_ridge(cfg, &x, y_train, x_val, y_val),
        }
    }

    /// Scores `(rows, heads)` of standardised `x` `(rows, input_dim)`: probabilities
    /// (binary) or values (continuous).
    pub(crate) fn predict(&self, x: &Array2<f32>) -> Array2<f32> {
        let mut z = x.mapv(f64::from).dot(&self.weights) + &self.intercept;
        if self.logistic {
            z.mapv_inplace(|t| 1.0 / (1.0 + (-t).exp()));
        }
        for (c, value) in self.constant.iter().enumerate() {
            if let Some(v) = value {
                z.column_mut(c).fill(*v);
            }
        }
        z.mapv(|v| v as f32)
    }

    pub(crate) fn constant_heads(&self) -> usize {
        self.constant.iter().filter(|c| c.is_some()).count()
    }
}

/// One head's logistic fit: `(constant, weights (input_dim,), intercept)`, the
/// constant set for heads with one class in train.
type HeadFit = (Option<f64>, Array1<f64>, f64);

fn fit_logistic(
    cfg: &BaselineConfig,
    x: &Array2<f64>,
    y: &Array2<f32>,
    n_heads: usize,
) -> Result<LinearBaseline> {
    let (rows, dim) = x.dim();
    let heads: Vec<Result<HeadFit>> = (0..y.ncols())
        .into_par_iter()
        .map(|c| {
            let labels: Array1<bool> = y.column(c).mapv(|v| v > 0.5);
            let positives = labels.iter().filter(|&&b| b).count();
            if positives == 0 || positives == rows {
                let value = if positives == 0 { 0.0 } else { 1.0 };
                return Ok((Some(value), Array1::zeros(dim), 0.0));
            }
            let model = LogisticRegression::default()
                .alpha(cfg.logistic_alpha)
                .max_iterations(cfg.logistic_max_iterations)
                .fit(&DatasetBase::new(x.view(), labels))
                .map_err(|e| {
                    Error::invalid(
                        "linear baseline",
                        format!(
                            "logistic regression for head ({}, {}): {e}",
                            c / n_heads,
                            c % n_heads
                        ),
                    )
                })?;
            // linfa's "positive" class is the more frequent one; turn the model into
            // P(active).
            let sign = if model.labels().pos.class { 1.0 } else { -1.0 };
            Ok((None, model.params() * sign, model.intercept() * sign))
        })
        .collect();
    let mut weights = Array2::zeros((dim, y.ncols()));
    let mut intercept = Array1::zeros(y.ncols());
    let mut constant = Vec::with_capacity(y.ncols());
    for (c, head) in heads.into_iter().enumerate() {
        let (value, w, b) = head?;
        weights.column_mut(c).assign(&w);
        intercept[c] = b;
        constant.push(value);
    }
    Ok(LinearBaseline {
        weights,
        intercept,
        constant,
        logistic: true,
        ridge_lambda: None,
    })
}

fn fit_ridge(
    cfg: &BaselineConfig,
    x: &Array2<f64>,
    y: &Array2<f32>,
    x_val: &Array2<f32>,
    y_val: &Array2<f32>,
) -> Result<LinearBaseline> {
    let y = y.mapv(f64::from);
    let empty = || Error::invalid("linear baseline", "empty train split");
    let mean = y.mean_axis(Axis(0)).ok_or_else(empty)?;
    // Centre X too (standardised inputs are centred already, up to rounding), so the
    // intercept is unpenalised: b = mean(y) - mean(x) W.
    let x_mean = x.mean_axis(Axis(0)).ok_or_else(empty)?;
    let xc = x - &x_mean;
    let gram = xc.t().dot(&xc);
    let xty = xc.t().dot(&(&y - &mean));
    let x_val = x_val.mapv(f64::from);
    let y_val = y_val.mapv(f64::from);
    let mut best: Option<(f64, f64, Array2<f64>, Array1<f64>)> = None;
    for &lambda in &cfg.ridge_lambdas {
        let mut a = gram.clone();
        a.diag_mut().mapv_inplace(|v| v + lambda);
        let w = solve_spd(a, xty.clone())?;
        let b = &mean - &x_mean.dot(&w);
        let err = (x_val.dot(&w) + &b - &y_val).mapv(|v| v * v).sum();
        if best.as_ref().is_none_or(|best| err < best.0) {
            best = Some((err, lambda, w, b));
        }
    }
    let (_, lambda, weights, intercept) =
        best.ok_or_else(|| Error::invalid("ridge_lambdas", "no penalty to try"))?;
    let constant = y
        .columns()
        .into_iter()
        .map(|c| c.iter().all(|&v| v == c[0]).then(|| c[0]))
        .collect();
    Ok(LinearBaseline {
        weights,
        intercept,
        constant,
        logistic: false,
        ridge_lambda: Some(lambda),
    })
}

/// Solve `A X = B` for symmetric positive definite `A` `(n, n)` and `B` `(n, m)` by a
/// Cholesky factorisation `A = L L^T` and two triangular solves over all columns.
fn solve_spd(mut a: Array2<f64>, mut b: Array2<f64>) -> Result<Array2<f64>> {
    let n = a.nrows();
    // In place: the lower triangle of `a` becomes L.
    for j in 0..n {
        let d = a[[j, j]] - (0..j).map(|k| a[[j, k]] * a[[j, k]]).sum::<f64>();
        if d.is_nan() || d <= 0.0 {
            return Err(Error::invalid(
                "linear baseline",
                "the ridge system is not positive definite (non-finite features?)",
            ));
        }
        let d = d.sqrt();
        a[[j, j]] = d;
        for i in j + 1..n {
            let s = a[[i, j]] - (0..j).map(|k| a[[i, k]] * a[[j, k]]).sum::<f64>();
            a[[i, j]] = s / d;
        }
    }
    // L Z = B, row by row.
    for i in 0..n {
        for k in 0..i {
            let (done, mut rest) = b.view_mut().split_at(Axis(0), i);
            rest.row_mut(0).scaled_add(-a[[i, k]], &done.row(k));
        }
        let d = a[[i, i]];
        b.row_mut(i).mapv_inplace(|v| v / d);
    }
    // L^T X = Z, from the last row up.
    for i in (0..n).rev() {
        for k in i + 1..n {
            let (mut head, tail) = b.view_mut().split_at(Axis(0), k);
            head.row_mut(i).scaled_add(-a[[k, i]], &tail.row(0));
        }
        let d = a[[i, i]];
        b.row_mut(i).mapv_inplace(|v| v / d);
    }
    Ok(b)
}

/// The static baseline's scores `(rows, heads)` and its heads: 1 on the static heads and
/// 0 elsewhere (binary), or each head's train mean `train_mean` (continuous).
pub(crate) fn static_scores(
    kind: LabelKind,
    cfg: &BaselineConfig,
    train_mean: &[f64],
    rows: usize,
    n_heads: usize,
) -> (Array2<f32>, Vec<(usize, usize)>) {
    let mut heads = Vec::new();
    let row: Vec<f32> = match kind {
        LabelKind::Continuous => train_mean.iter().map(|&m| m as f32).collect(),
        LabelKind::Binary => {
            heads = match &cfg.static_heads {
                StaticHeads::TopK { k } => top_heads(train_mean, *k)
                    .into_iter()
                    .map(|c| (c / n_heads, c % n_heads))
                    .collect(),
                StaticHeads::List { heads } => heads.clone(),
            };
            let mut r = vec![0.0f32; train_mean.len()];
            for &(l, h) in &heads {
                if let Some(v) = r.get_mut(l * n_heads + h) {
                    *v = 1.0;
                }
            }
            r
        }
    };
    let scores = Array2::from_shape_fn((rows, row.len()), |(_, c)| row[c]);
    (scores, heads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    #[test]
    fn cholesky_solve_matches_a_hand_solved_system() {
        // [[4, 2], [2, 3]] x = [[2, 8], [1, 7]] -> x = [[0.5, 1.25], [0, 1.5]].
        let x = solve_spd(
            array![[4.0, 2.0], [2.0, 3.0]],
            array![[2.0, 8.0], [1.0, 7.0]],
        )
        .unwrap();
        let want = array![[0.5, 1.25], [0.0, 1.5]];
        assert!((x - want).iter().all(|d| d.abs() < 1e-12));
        assert!(solve_spd(array![[0.0]], array![[1.0]]).is_err());
    }

    #[test]
    fn ridge_recovers_a_linear_map_and_predicts_constants_for_constant_heads() {
        let x = Array2::from_shape_fn((40, 3), |(i, j)| ((i * 7 + j * 3) % 11) as f32 - 5.0);
        let y = Array2::from_shape_fn((40, 2), |(i, j)| {
            if j == 0 {
                0.5 * x[[i, 0]] - 0.25 * x[[i, 2]] + 1.0
            } else {
                0.3
            }
        });
        let cfg = BaselineConfig::default();
        let fit = LinearBaseline::fit(LabelKind::Continuous, &cfg, &x, &y, &x, &y, 1).unwrap();
        let pred = fit.predict(&x);
        assert!((&pred - &y).iter().all(|d| d.abs() < 1e-2));
        assert_eq!(fit.constant_heads(), 1);
        assert_eq!(fit.ridge_lambda, Some(1e-2));
    }

    #[test]
    fn logistic_scores_are_probabilities_of_the_active_class() {
        // Head 0 active when x > 0 (rare: 3 of 10), head 1 never active.
        let x = Array2::from_shape_fn((10, 1), |(i, _)| i as f32 - 6.5);
        let y = Array2::from_shape_fn((10, 2), |(i, j)| (j == 0 && i > 6) as u8 as f32);
        let cfg = BaselineConfig::default();
        let fit = LinearBaseline::fit(LabelKind::Binary, &cfg, &x, &y, &x, &y, 2).unwrap();
        let p = fit.predict(&x);
        assert!(p[[9, 0]] > 0.5 && p[[0, 0]] < 0.5, "{p}");
        assert!(p.column(1).iter().all(|&v| v == 0.0));
        assert_eq!(fit.constant_heads(), 1);
    }

    #[test]
    fn static_heads_are_the_most_frequent_or_the_given_list() {
        let freq = [0.1, 0.5, 0.0, 0.4];
        let cfg = BaselineConfig {
            static_heads: StaticHeads::TopK { k: 2 },
            ..BaselineConfig::default()
        };
        let (s, heads) = static_scores(LabelKind::Binary, &cfg, &freq, 3, 2);
        assert_eq!(heads, vec![(0, 1), (1, 1)]);
        assert_eq!(s.row(2).to_vec(), vec![0.0, 1.0, 0.0, 1.0]);
        let (s, heads) = static_scores(LabelKind::Continuous, &cfg, &freq, 2, 2);
        assert!(heads.is_empty());
        assert_eq!(s.row(1).to_vec(), vec![0.1, 0.5, 0.0, 0.4]);
        let bad = BaselineConfig {
            static_heads: StaticHeads::List {
                heads: vec![(2, 0)],
            },
            ..BaselineConfig::default()
        };
        assert!(bad
            .validate(2, 2)
            .unwrap_err()
            .to_string()
            .contains("(2, 0)"));
    }
}
