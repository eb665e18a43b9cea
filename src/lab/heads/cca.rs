//! How predictable are the next steps' retrieval heads from the current hidden state?
//! Canonical correlation analysis between the final hidden state at step `n` and the
//! head-score vector at step `n + lag`, after "Retrieval Heads are Dynamic" (2026), which
//! reports 0.966 / 0.931 / 0.915 for lags 0 / 1 / 2 on NIAH and 0.856 at lag 0 on HotpotQA.
//!
//! Pipeline, per call:
//! 1. Prompts are split into train and test by a seeded shuffle; every step of a prompt
//!    goes to the same side, and `(n, n + lag)` pairs are formed inside one prompt only.
//! 2. PCA, fitted on every step of the train prompts (once per call: the population of
//!    hidden states and of score vectors does not depend on the lag), keeps the fewest
//!    components that explain [`CcaConfig::variance_x`] (95%) of the hidden-state variance
//!    and [`CcaConfig::variance_y`] (99%) of the score variance, at most
//!    [`CcaConfig::max_components`] (50) each, as the paper. Columns constant on the train
//!    split are dropped first (they carry no variance). The paper does not say whether it
//!    standardised before PCA; the default does not ([`CcaConfig::standardize`]).
//! 3. Classical CCA on the train pairs of each lag: whiten both blocks (symmetric
//!    eigendecomposition, a small ridge on the diagonal), then the singular value
//!    decomposition of the whitened cross-covariance gives the canonical pairs.
//! 4. The canonical weights project the held-out pairs; the reported correlation of each
//!    pair is the Pearson correlation of its two projections, on train (in-sample) and on
//!    test.
//!
//! The paper's numbers are most likely in-sample: they come from fitting CCA on the
//! collected steps with no held-out split mentioned, and with up to 50 + 50 components
//! even unrelated data reaches sizeable in-sample correlations (about
//! `sqrt(kx / n) + sqrt(ky / n)`), which is why the held-out numbers are reported beside.

use std::collections::BTreeSet;

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis};
use plotters::prelude::{Color, RGBColor, SeriesLabelPosition, BLUE, CYAN, MAGENTA, RED};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use crate::lab::heads::dynamics::lag_pairs;
use crate::lab::heads::trace::Trace;
use crate::lab::plot::{line_chart, Chart, Mark, Series};
use crate::{Error, Result};

/// Settings of [`cca_by_lag`].
#[derive(Debug, Clone, PartialEq)]
pub struct CcaConfig {
    /// Fraction of the hidden-state variance the kept PCA components explain (0.95).
    pub variance_x: f64,
    /// Fraction of the head-score variance the kept PCA components explain (0.99).
    pub variance_y: f64,
    /// At most this many PCA components per block (50).
    pub max_components: usize,
    /// Fraction of prompts held out (0.3); at least one prompt goes to each side.
    pub test_fraction: f64,
    /// Seed of the prompt shuffle (0).
    pub seed: u64,
    /// Canonical pairs averaged in `mean_top_*` (10, fewer when fewer pairs exist).
    pub top_m: usize,
    /// Divide every column by its train standard deviation before PCA (false).
    pub standardize: bool,
    /// Ridge added to the diagonal of each block's covariance before whitening, relative
    /// to the block's mean variance (1e-6).
    pub ridge: f64,
}

impl Default for CcaConfig {
    fn default() -> Self {
        Self {
            variance_x: 0.95,
            variance_y: 0.99,
            max_components: 50,
            test_fraction: 0.3,
            seed: 0,
            top_m: 10,
            standardize: false,
            ridge: 1e-6,
        }
    }
}

/// Canonical correlations at one lag.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CcaPoint {
    /// Hidden state at step `n`, scores at step `n + lag`.
    pub lag: usize,
    /// Pairs in the train and test prompts.
    pub n_train: usize,
    pub n_test: usize,
    /// Correlation of the first canonical pair, in-sample and held out.
    pub first_train: f64,
    pub first_test: f64,
    /// Mean correlation of the first `top_m` canonical pairs (ordered by their train
    /// correlation; held-out correlations are not re-sorted and may be negative).
    pub mean_top_train: f64,
    pub mean_top_test: f64,
    /// The number of pairs averaged: `min(cfg.top_m, canonical pairs)`.
    pub top_m: usize,
    /// PCA components kept for the hidden states and the scores.
    pub components_x: usize,
    pub components_y: usize,
}

/// CCA between hidden states at step `n` and head scores at step `n + lag`, one point per
/// lag (for example `&[0, 1, 2, 3, 4, 5]`), fitted on train prompts and evaluated on both
/// splits; see the module documentation for the pipeline.
///
/// Errors: a malformed trace, non-finite features or labels, fewer than two prompts,
/// a block with no varying column on the train split, too few train pairs at a lag for
/// the kept components (CCA needs more pairs than `components_x + components_y + 1`), fewer
/// than 3 test pairs at a lag, a config out of range.
pub fn cca_by_lag(trace: &Trace, lags: &[usize], cfg: &CcaConfig) -> Result<Vec<CcaPoint>> {
    check_config(cfg)?;
    if lags.is_empty() {
        return Err(Error::invalid("lags", "empty"));
    }
    // shapes first (lag 0 pairs every row with itself)
    lag_pairs(trace, 0)?;
    check_finite(trace.features.view(), "hidden-state feature")?;
    check_finite(trace.labels.view(), "label")?;

    let test_prompts = split_prompts(&trace.prompt, cfg.test_fraction, cfg.seed)?;
    let is_test = |row: usize| test_prompts.contains(&trace.prompt[row]);
    let train_rows: Vec<usize> = (0..trace.prompt.len()).filter(|&r| !is_test(r)).collect();

    let x = trace.features.mapv(f64::from);
    let y = trace.labels.mapv(f64::from);
    let pca_x = Pca::fit(
        x.select(Axis(0), &train_rows).view(),
        cfg,
        cfg.variance_x,
        "hidden states",
    )?;
    let pca_y = Pca::fit(
        y.select(Axis(0), &train_rows).view(),
        cfg,
        cfg.variance_y,
        "head scores",
    )?;
    let (xr, yr) = (pca_x.project(x.view()), pca_y.project(y.view()));
    let (kx, ky) = (xr.ncols(), yr.ncols());

    let mut points = Vec::with_capacity(lags.len());
    for &lag in lags {
        let (train, test): (Vec<_>, Vec<_>) = lag_pairs(trace, lag)?
            .into_iter()
            .partition(|&(a, _)| !is_test(a));
        if train.len() <= kx + ky + 1 {
            return Err(Error::invalid(
                "cca",
                format!(
                    "lag {lag}: {} train pairs for {kx} + {ky} components; CCA needs more \
                     pairs than components (lower max_components or add prompts)",
                    train.len()
                ),
            ));
        }
        if test.len() < 3 {
            return Err(Error::invalid(
                "cca",
                format!("lag {lag}: {} held-out pairs, need 3 at least", test.len()),
            ));
        }
        let block = |pairs: &[(usize, usize)]| {
            let (a, b): (Vec<usize>, Vec<usize>) = pairs.iter().copied().unzip();
            (xr.select(Axis(0), &a), yr.select(Axis(0), &b))
        };
        let (x_train, y_train) = block(&train);
        let (x_test, y_test) = block(&test);
        let cca = Cca::fit(&x_train, &y_train, cfg.ridge)?;
        let r_train = cca.correlations(&x_train, &y_train);
        let r_test = cca.correlations(&x_test, &y_test);
        let m = cfg.top_m.min(r_train.len());
        let mean = |r: &[f64]| r[..m].iter().sum::<f64>() / m as f64;
        points.push(CcaPoint {
            lag,
            n_train: train.len(),
            n_test: test.len(),
            first_train: r_train[0],
            first_test: r_test[0],
            mean_top_train: mean(&r_train),
            mean_top_test: mean(&r_test),
            top_m: m,
            components_x: kx,
            components_y: ky,
        });
    }
    Ok(points)
}

fn check_config(cfg: &CcaConfig) -> Result<()> {
    for (name, v) in [
        ("variance_x", cfg.variance_x),
        ("variance_y", cfg.variance_y),
    ] {
        if !(v > 0.0 && v <= 1.0) {
            return Err(Error::invalid(name, format!("{v} is not in (0, 1]")));
        }
    }
    if !(cfg.test_fraction > 0.0 && cfg.test_fraction < 1.0) {
        return Err(Error::invalid(
            "test_fraction",
            format!("{} is not in (0, 1)", cfg.test_fraction),
        ));
    }
    if cfg.max_components == 0 || cfg.top_m == 0 {
        return Err(Error::invalid(
            "cca config",
            "max_components and top_m must be at least 1",
        ));
    }
    if !(cfg.ridge >= 0.0 && cfg.ridge.is_finite()) {
        return Err(Error::invalid(
            "ridge",
            format!("{} is not >= 0", cfg.ridge),
        ));
    }
    Ok(())
}

fn check_finite(a: ArrayView2<f32>, what: &str) -> Result<()> {
    match a.indexed_iter().find(|(_, v)| !v.is_finite()) {
        Some(((r, c), v)) => Err(Error::invalid(
            "trace",
            format!("{what} at row {r}, column {c} is {v}"),
        )),
        None => Ok(()),
    }
}

/// The held-out prompt ids: a seeded shuffle of the distinct ids, the first
/// `round(test_fraction * n)` of them (at least 1, at most `n - 1`).
fn split_prompts(prompt: &[usize], test_fraction: f64, seed: u64) -> Result<BTreeSet<usize>> {
    let mut ids: Vec<usize> = prompt
        .iter()
        .copied()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if ids.len() < 2 {
        return Err(Error::invalid(
            "trace",
            format!(
                "{} prompt(s); a train/test split by prompt needs 2 at least",
                ids.len()
            ),
        ));
    }
    ids.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let n_test = ((test_fraction * ids.len() as f64).round() as usize).clamp(1, ids.len() - 1);
    Ok(ids.into_iter().take(n_test).collect())
}

/// PCA fitted on one block `(rows, cols)`: the varying columns, their means and scales,
/// and the kept principal axes `(varying cols, components)`.
struct Pca {
    keep: Vec<usize>,
    mean: Array1<f64>,
    scale: Array1<f64>,
    axes: Array2<f64>,
}

impl Pca {
    fn fit(x: ArrayView2<f64>, cfg: &CcaConfig, variance: f64, what: &str) -> Result<Self> {
        let n = x.nrows();
        if n < 2 {
            return Err(Error::invalid(
                "cca",
                format!("{n} train rows of {what}; PCA needs 2 at least"),
            ));
        }
        let mean_all = x
            .mean_axis(Axis(0))
            .unwrap_or_else(|| Array1::zeros(x.ncols()));
        let std_all = x.std_axis(Axis(0), 1.0);
        let keep: Vec<usize> = (0..x.ncols())
            .filter(|&c| std_all[c] > 1e-12 * mean_all[c].abs().max(1.0))
            .collect();
        if keep.is_empty() {
            return Err(Error::invalid(
                "cca",
                format!("every column of the {what} is constant on the train split"),
            ));
        }
        let mean = mean_all.select(Axis(0), &keep);
        let scale = if cfg.standardize {
            std_all.select(Axis(0), &keep)
        } else {
            Array1::ones(keep.len())
        };
        let centered = (&x.select(Axis(1), &keep) - &mean) / &scale;
        let cov = centered.t().dot(&centered) / (n - 1) as f64;
        let total: f64 = cov.diag().sum();
        let (values, vectors) = sym_eigen(&cov)?;
        let cap = cfg.max_components.min(n - 1).min(values.len());
        let mut k = 0;
        let mut explained = 0.0;
        while k < cap && explained < variance * total && values[k] > 1e-12 * values[0] {
            explained += values[k];
            k += 1;
        }
        Ok(Self {
            keep,
            mean,
            scale,
            axes: vectors.slice(ndarray::s![.., ..k]).to_owned(),
        })
    }

    /// Principal-component scores of `x` `(rows, all cols)` -> `(rows, components)`.
    fn project(&self, x: ArrayView2<f64>) -> Array2<f64> {
        ((&x.select(Axis(1), &self.keep) - &self.mean) / &self.scale).dot(&self.axes)
    }
}

/// Canonical weights fitted on `(rows, kx)` and `(rows, ky)` blocks: block means and one
/// column per canonical pair, strongest first (`(kx, r)` and `(ky, r)`).
struct Cca {
    mean_x: Array1<f64>,
    mean_y: Array1<f64>,
    wx: Array2<f64>,
    wy: Array2<f64>,
}

impl Cca {
    fn fit(x: &Array2<f64>, y: &Array2<f64>, ridge: f64) -> Result<Self> {
        let n = x.nrows() as f64;
        let mean_x = x
            .mean_axis(Axis(0))
            .unwrap_or_else(|| Array1::zeros(x.ncols()));
        let mean_y = y
            .mean_axis(Axis(0))
            .unwrap_or_else(|| Array1::zeros(y.ncols()));
        let (xc, yc) = (x - &mean_x, y - &mean_y);
        let whitener = |c: &Array2<f64>| -> Result<Array2<f64>> {
            let mut c = c / (n - 1.0);
            let lift = ridge * c.diag().mean().unwrap_or(0.0);
            c.diag_mut().mapv_inplace(|v| v + lift);
            let (values, vectors) = sym_eigen(&c)?;
            let floor = 1e-12 * values[0].max(f64::MIN_POSITIVE);
            let kept: Vec<usize> = (0..values.len()).filter(|&i| values[i] > floor).collect();
            if kept.is_empty() {
                return Err(Error::invalid(
                    "cca",
                    "a block has no variance on the train pairs",
                ));
            }
            let mut w = vectors.select(Axis(1), &kept);
            for (mut col, &i) in w.columns_mut().into_iter().zip(&kept) {
                col /= values[i].sqrt();
            }
            Ok(w)
        };
        let (hx, hy) = (whitener(&xc.t().dot(&xc))?, whitener(&yc.t().dot(&yc))?);
        // whitened cross-covariance (rank x, rank y); its SVD gives the canonical pairs
        let m = hx.t().dot(&xc.t().dot(&yc)).dot(&hy) / (n - 1.0);
        let (s2, u) = sym_eigen(&m.dot(&m.t()))?;
        let r = s2.len().min(m.ncols());
        let floor = 1e-12 * s2[0].max(f64::MIN_POSITIVE);
        let pairs: Vec<usize> = (0..r).filter(|&i| s2[i] > floor).collect();
        if pairs.is_empty() {
            return Err(Error::invalid(
                "cca",
                "the two blocks have no cross-covariance on the train split",
            ));
        }
        let u = u.select(Axis(1), &pairs);
        let mut v = m.t().dot(&u);
        for (mut col, &i) in v.columns_mut().into_iter().zip(&pairs) {
            col /= s2[i].sqrt();
        }
        Ok(Self {
            mean_x,
            mean_y,
            wx: hx.dot(&u),
            wy: hy.dot(&v),
        })
    }

    /// Pearson correlation of every canonical pair's projections of `x` and `y`.
    fn correlations(&self, x: &Array2<f64>, y: &Array2<f64>) -> Vec<f64> {
        let px = (x - &self.mean_x).dot(&self.wx);
        let py = (y - &self.mean_y).dot(&self.wy);
        px.columns()
            .into_iter()
            .zip(py.columns())
            .map(|(a, b)| pearson(a, b))
            .collect()
    }
}

/// Pearson correlation; 0 when either side is constant.
fn pearson(a: ArrayView1<f64>, b: ArrayView1<f64>) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.sum() / n, b.sum() / n);
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        let (dx, dy) = (x - ma, y - mb);
        sab += dx * dy;
        saa += dx * dx;
        sbb += dy * dy;
    }
    if saa <= 0.0 || sbb <= 0.0 {
        return 0.0;
    }
    sab / (saa * sbb).sqrt()
}

/// Eigendecomposition of a symmetric matrix `(n, n)`: eigenvalues in descending order
/// `(n,)` and orthonormal eigenvectors as the matching columns `(n, n)`. Householder
/// reduction to tridiagonal form, then implicit QR steps with Wilkinson shifts.
fn sym_eigen(a: &Array2<f64>) -> Result<(Array1<f64>, Array2<f64>)> {
    let n = a.nrows();
    if n == 0 || a.ncols() != n {
        return Err(Error::invalid("eigendecomposition", "not a square matrix"));
    }
    let mut m: Vec<f64> = a.iter().copied().collect();
    // rows of `qt` are the basis the matrix is expressed in; at the end, eigenvectors
    let mut qt = vec![0.0; n * n];
    (0..n).for_each(|i| qt[i * n + i] = 1.0);
    let (mut v, mut w, mut u) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    for k in 0..n.saturating_sub(2) {
        // reflect column k below the subdiagonal onto the subdiagonal
        let s = k + 1;
        let len = n - s;
        let tail: f64 = (s + 1..n).map(|i| m[i * n + k] * m[i * n + k]).sum();
        if tail == 0.0 {
            continue;
        }
        let x0 = m[s * n + k];
        let alpha = (x0 * x0 + tail).sqrt();
        let sign = if x0 >= 0.0 { 1.0 } else { -1.0 };
        v[0] = x0 + sign * alpha;
        (1..len).for_each(|i| v[i] = m[(s + i) * n + k]);
        let beta = 2.0 / (v[0] * v[0] + tail);
        let (v, w) = (&v[..len], &mut w[..len]);
        // trailing block A <- H A H with H = I - beta v v^T: A -= v w^T + w v^T
        for i in 0..len {
            let row = &m[(s + i) * n + s..(s + i + 1) * n];
            w[i] = beta * row.iter().zip(v).map(|(a, b)| a * b).sum::<f64>();
        }
        let half = 0.5 * beta * w.iter().zip(v).map(|(a, b)| a * b).sum::<f64>();
        w.iter_mut().zip(v).for_each(|(wi, vi)| *wi -= half * vi);
        for i in 0..len {
            let (vi, wi) = (v[i], w[i]);
            let row = &mut m[(s + i) * n + s..(s + i + 1) * n];
            for ((a, &vj), &wj) in row.iter_mut().zip(v).zip(w.iter()) {
                *a -= vi * wj + wi * vj;
            }
        }
        m[s * n + k] = -sign * alpha;
        m[k * n + s] = -sign * alpha;
        for i in s + 1..n {
            m[i * n + k] = 0.0;
            m[k * n + i] = 0.0;
        }
        // basis rows s.. <- H (rows s..)
        u.fill(0.0);
        for (i, &vi) in v.iter().enumerate() {
            let row = &qt[(s + i) * n..(s + i + 1) * n];
            u.iter_mut().zip(row).for_each(|(ui, q)| *ui += vi * q);
        }
        for (i, &vi) in v.iter().enumerate() {
            let f = beta * vi;
            let row = &mut qt[(s + i) * n..(s + i + 1) * n];
            row.iter_mut().zip(&u).for_each(|(q, ui)| *q -= f * ui);
        }
    }
    let mut d: Vec<f64> = (0..n).map(|i| m[i * n + i]).collect();
    let mut e: Vec<f64> = (0..n.saturating_sub(1))
        .map(|i| m[(i + 1) * n + i])
        .collect();

    let mut hi = n - 1;
    let mut steps = 0;
    loop {
        for i in 0..hi {
            if e[i].abs() <= f64::EPSILON * (d[i].abs() + d[i + 1].abs())
                || e[i].abs() < f64::MIN_POSITIVE
            {
                e[i] = 0.0;
            }
        }
        while hi > 0 && e[hi - 1] == 0.0 {
            hi -= 1;
        }
        if hi == 0 {
            break;
        }
        let mut lo = hi - 1;
        while lo > 0 && e[lo - 1] != 0.0 {
            lo -= 1;
        }
        steps += 1;
        if steps > 30 * n {
            return Err(Error::invalid(
                "eigendecomposition",
                format!("no convergence after {steps} QR steps"),
            ));
        }
        // Wilkinson shift: the eigenvalue of the trailing 2x2 block nearer its corner
        let t = 0.5 * (d[hi - 1] - d[hi]);
        let b = e[hi - 1];
        let sign = if t >= 0.0 { 1.0 } else { -1.0 };
        let mu = d[hi] - b * b / (t + sign * t.hypot(b));
        let (mut x, mut z) = (d[lo] - mu, e[lo]);
        for k in lo..hi {
            // rotation in the (k, k + 1) plane zeroing z against x, then T <- R T R^T
            let r = x.hypot(z);
            let (c, s) = if r == 0.0 { (1.0, 0.0) } else { (x / r, z / r) };
            if k > lo {
                e[k - 1] = r;
            }
            let (a, bb, cc) = (d[k], e[k], d[k + 1]);
            d[k] = c * c * a + 2.0 * c * s * bb + s * s * cc;
            d[k + 1] = s * s * a - 2.0 * c * s * bb + c * c * cc;
            e[k] = c * s * (cc - a) + (c * c - s * s) * bb;
            if k + 1 < hi {
                z = s * e[k + 1];
                e[k + 1] *= c;
            }
            x = e[k];
            let (top, bottom) = qt.split_at_mut((k + 1) * n);
            let (rk, rk1) = (&mut top[k * n..], &mut bottom[..n]);
            for (p, q) in rk.iter_mut().zip(rk1.iter_mut()) {
                let (pk, qk) = (*p, *q);
                *p = c * pk + s * qk;
                *q = c * qk - s * pk;
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| d[j].total_cmp(&d[i]));
    let values = Array1::from_iter(order.iter().map(|&i| d[i]));
    let vectors = Array2::from_shape_fn((n, n), |(row, col)| qt[order[col] * n + row]);
    Ok((values, vectors))
}

/// Correlation against lag as SVG: the first canonical pair and the mean of the top-m
/// pairs, each on train (in-sample) and test (held out).
pub fn cca_svg(points: &[CcaPoint], title: &str) -> Result<String> {
    if points.is_empty() {
        return Err(Error::invalid("cca plot", "no points"));
    }
    let m = points[0].top_m;
    let line = |name: String, f: fn(&CcaPoint) -> f64, color: RGBColor| Series {
        name,
        points: points.iter().map(|p| (p.lag as f64, f(p))).collect(),
        color: color.to_rgba(),
        mark: Mark::Line { width: 2, dot: 3 },
        bars: Vec::new(),
    };
    let series = [
        line("first pair, train".into(), |p| p.first_train, BLUE),
        line("first pair, test".into(), |p| p.first_test, RED),
        line(format!("mean top-{m}, train"), |p| p.mean_top_train, CYAN),
        line(format!("mean top-{m}, test"), |p| p.mean_top_test, MAGENTA),
    ];
    let x_max = points.iter().map(|p| p.lag).max().unwrap_or(0) as f64 + 0.5;
    let y_min = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::min);
    let chart = Chart {
        title,
        title_size: 16,
        x_label: "lag (steps from hidden state to head scores)",
        y_label: "canonical correlation",
        x_range: -0.5..x_max,
        y_range: y_min..1.02,
        log_y: false,
        x_ticks: Some((2 * points.len() + 2, lag_label)),
        legend: SeriesLabelPosition::LowerLeft,
        size: (640, 400),
    };
    line_chart(&chart, &series)
}

/// The label of an x tick of the CCA plot: lags only, no labels between them or left
/// of 0.
fn lag_label(x: &f64) -> String {
    if *x >= 0.0 && (x - x.round()).abs() < 1e-9 {
        format!("{x:.0}")
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::LabelKind;
    use rand::{Rng, SeedableRng};

    fn uniform(rows: usize, cols: usize, rng: &mut rand::rngs::StdRng) -> Array2<f64> {
        Array2::from_shape_fn((rows, cols), |_| rng.random_range(-1.0..1.0))
    }

    /// Consecutive prompts of `len` steps each.
    fn trace(features: &Array2<f64>, labels: &Array2<f64>, len: usize) -> Trace {
        let rows = features.nrows();
        Trace {
            label_kind: LabelKind::Continuous,
            n_layers: 1,
            n_heads: labels.ncols(),
            features: features.mapv(|v| v as f32),
            labels: labels.mapv(|v| v as f32),
            prompt: (0..rows).map(|r| r / len).collect(),
            step: (0..rows).map(|r| r % len).collect(),
        }
    }

    #[test]
    fn eigendecomposition_reconstructs_symmetric_matrices() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for n in [1, 2, 3, 10, 40] {
            let b = uniform(n, n, &mut rng);
            let a = &b + &b.t();
            let (values, vectors) = sym_eigen(&a).unwrap();
            let eye = Array2::<f64>::eye(n);
            let orth = (vectors.t().dot(&vectors) - &eye).mapv(f64::abs).sum();
            let back = vectors.dot(&Array2::from_diag(&values)).dot(&vectors.t());
            let resid = (back - &a).mapv(f64::abs).sum();
            assert!(orth < 1e-10 && resid < 1e-10, "n {n}: {orth} {resid}");
            assert!(values.windows(2).into_iter().all(|w| w[0] >= w[1]));
        }
        // repeated eigenvalues and a zero matrix
        let (values, _) = sym_eigen(&(Array2::eye(4) * 2.0)).unwrap();
        assert_eq!(values.to_vec(), vec![2.0; 4]);
        let (values, vectors) = sym_eigen(&Array2::zeros((3, 3))).unwrap();
        assert_eq!(values.to_vec(), vec![0.0; 3]);
        assert_eq!(vectors, Array2::<f64>::eye(3));
        let a = ndarray::array![[2.0, 1.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 5.0]];
        let (values, _) = sym_eigen(&a).unwrap();
        let expect = [5.0, 3.0, 1.0];
        assert!(values
            .iter()
            .zip(expect)
            .all(|(a, b)| (a - b).abs() < 1e-12));
    }

    #[test]
    fn a_planted_linear_relation_is_recovered_on_held_out_prompts() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let (rows, len) = (900, 15);
        let x = uniform(rows, 40, &mut rng);
        let y = x.dot(&uniform(40, 12, &mut rng)) + uniform(rows, 12, &mut rng) * 1e-3;
        let t = trace(&x, &y, len);
        let points = cca_by_lag(&t, &[0], &CcaConfig::default()).unwrap();
        let p = &points[0];
        assert!(p.first_test > 0.99 && p.first_train > 0.99, "{p:?}");
        assert!(p.mean_top_test > 0.9, "{p:?}");
        assert_eq!(p.n_train + p.n_test, rows);
        // 60 prompts, 30% held out
        assert_eq!(p.n_test, 18 * len);
        assert!(p.components_x <= 40 && p.components_y <= 12);
    }

    #[test]
    fn scores_follow_hidden_states_in_the_lag_direction() {
        // labels at step s are a linear map of the features at step s - 1, features are
        // independent across steps: lag 1 recovers the map, lag 0 finds nothing
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let (rows, len) = (1200, 20);
        let x = uniform(rows, 20, &mut rng);
        let map = x.dot(&uniform(20, 8, &mut rng));
        let mut y = uniform(rows, 8, &mut rng);
        for r in (0..rows).filter(|r| r % len > 0) {
            y.row_mut(r).assign(&map.row(r - 1));
        }
        let t = trace(&x, &y, len);
        let points = cca_by_lag(&t, &[0, 1], &CcaConfig::default()).unwrap();
        assert!(points[0].first_test.abs() < 0.3, "{:?}", points[0]);
        assert!(points[1].first_test > 0.99, "{:?}", points[1]);
    }

    #[test]
    fn independent_noise_gives_no_held_out_correlation() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let (rows, len) = (1200, 20);
        let x = uniform(rows, 30, &mut rng);
        let y = uniform(rows, 10, &mut rng);
        let t = trace(&x, &y, len);
        let points = cca_by_lag(&t, &[0, 1, 2], &CcaConfig::default()).unwrap();
        for p in &points {
            assert!(p.first_test.abs() < 0.3, "{p:?}");
            // in-sample CCA finds something in noise: the reason to report both
            assert!(p.first_train > p.first_test, "{p:?}");
        }
        let svg = cca_svg(&points, "noise").unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("first pair, test"));
    }

    #[test]
    fn lag_pairs_stay_within_prompts() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // prompts of 30, 25, ... steps: lag l leaves len - l pairs per prompt
        let lens = [30usize, 25, 40, 35, 28, 33, 31, 27];
        let rows: usize = lens.iter().sum();
        let x = uniform(rows, 6, &mut rng);
        let y = uniform(rows, 4, &mut rng);
        let mut t = trace(&x, &y, rows);
        t.prompt = lens
            .iter()
            .enumerate()
            .flat_map(|(p, &l)| vec![p; l])
            .collect();
        t.step = lens.iter().flat_map(|&l| 0..l).collect();
        let cfg = CcaConfig {
            test_fraction: 0.25,
            ..CcaConfig::default()
        };
        let points = cca_by_lag(&t, &[0, 1, 5], &cfg).unwrap();
        for p in &points {
            let expect: usize = lens.iter().map(|l| l - p.lag).sum();
            assert_eq!(p.n_train + p.n_test, expect, "lag {}", p.lag);
        }
        for lag in [0, 3, 29] {
            let pairs = lag_pairs(&t, lag).unwrap();
            assert!(pairs
                .iter()
                .all(|&(a, b)| t.prompt[a] == t.prompt[b] && t.step[b] == t.step[a] + lag));
        }
        // the split is by prompt, deterministic in the seed
        let a = split_prompts(&t.prompt, 0.25, 9).unwrap();
        assert_eq!(a, split_prompts(&t.prompt, 0.25, 9).unwrap());
        assert_eq!(a.len(), 2);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let x = uniform(60, 5, &mut rng);
        let mut y = uniform(60, 3, &mut rng);
        y.column_mut(1).fill(0.5);
        let t = trace(&x, &y, 10);
        let e = |r: Result<Vec<CcaPoint>>| r.unwrap_err().to_string();
        let cfg = CcaConfig::default();
        // the constant score column is dropped, not divided by
        let ok = cca_by_lag(
            &t,
            &[0],
            &CcaConfig {
                standardize: true,
                ..cfg.clone()
            },
        );
        assert!(ok.unwrap()[0].components_y <= 2);
        // all the variance: every varying column, however the eigenvalues round
        let all = CcaConfig {
            variance_x: 1.0,
            variance_y: 1.0,
            ..cfg.clone()
        };
        let p = &cca_by_lag(&t, &[0], &all).unwrap()[0];
        assert_eq!((p.components_x, p.components_y), (5, 2));
        let mut bad = t.clone();
        bad.features[[7, 2]] = f32::NAN;
        assert!(e(cca_by_lag(&bad, &[0], &cfg)).contains("row 7, column 2 is NaN"));
        let mut bad = t.clone();
        bad.labels.fill(1.0);
        assert!(e(cca_by_lag(&bad, &[0], &cfg)).contains("constant"));
        // 6 prompts of 10: lag 9 leaves one pair per prompt
        assert!(e(cca_by_lag(&t, &[9], &cfg)).contains("train pairs"));
        let mut one = t.clone();
        one.prompt.fill(0);
        one.step = (0..60).collect();
        assert!(e(cca_by_lag(&one, &[0], &cfg)).contains("2 at least"));
        assert!(e(cca_by_lag(&t, &[], &cfg)).contains("empty"));
        let odd = CcaConfig {
            variance_x: 1.5,
            ..cfg.clone()
        };
        assert!(e(cca_by_lag(&t, &[0], &odd)).contains("variance_x"));
        assert!(cca_svg(&[], "x").is_err());
    }
}
