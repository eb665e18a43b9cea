//! Test-split metrics for head-activity predictions: micro / macro F1, precision,
//! recall and average precision (AUPRC) for binary labels, R^2 for continuous ones,
//! the validation-split threshold search, and the per-head breakdown.
//!
//! Conventions (scikit-learn's): F1 = 2 TP / (2 TP + FP + FN), 0 when nothing is
//! predicted or true; precision and recall are 0 when their denominator is 0. Average
//! precision is `sum_n (R_n - R_{n-1}) P_n` over the distinct score values in descending
//! order (tied scores enter together), undefined without positives. Micro R^2 pools the
//! residual and total sums of squares over heads, each head's total taken around its own
//! test mean (scikit-learn's `variance_weighted`); the per-head mean averages the R^2 of
//! the heads whose test labels vary. The micro F1 and micro R^2 carry 95% intervals from
//! resampling test prompts whole ([`group_bootstrap95`]).

use crate::lab::stats::group_bootstrap95;
use crate::probe::{
    BinaryHeadMetrics, BinaryMetrics, ContinuousHeadMetrics, ContinuousMetrics, PER_HEAD_TOP,
};
use ndarray::{ArrayView2, Axis};

/// `2 tp / (2 tp + fp + fn)`, `None` when all three are 0.
fn f1(tp: usize, fp: usize, fn_: usize) -> Option<f64> {
    let d = 2 * tp + fp + fn_;
    (d > 0).then(|| 2.0 * tp as f64 / d as f64)
}

fn ratio(num: usize, den: usize) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// Average precision of `scores` against `labels` (same length); `None` without
/// positives. Non-finite scores sort last.
pub fn average_precision(scores: &[f32], labels: &[bool]) -> Option<f64> {
    let positives = labels.iter().filter(|&&l| l).count();
    if positives == 0 {
        return None;
    }
    let order = descending(scores);
    let (mut tp, mut seen, mut ap) = (0usize, 0usize, 0.0f64);
    let mut i = 0;
    while i < order.len() {
        let s = scores[order[i]];
        let group_tp = order[i..]
            .iter()
            .take_while(|&&k| scores[k] == s || (s.is_nan() && scores[k].is_nan()))
            .fold((0usize, 0usize), |(t, n), &k| {
                (t + labels[k] as usize, n + 1)
            });
        tp += group_tp.0;
        seen += group_tp.1;
        i += group_tp.1;
        ap += group_tp.0 as f64 / positives as f64 * (tp as f64 / seen as f64);
    }
    Some(ap)
}

/// Indices of `scores` by descending score (NaN last), ties by index.
fn descending(scores: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (scores[a], scores[b]);
        match (x.is_nan(), y.is_nan()) {
            (false, false) => y.total_cmp(&x),
            (nan_x, nan_y) => nan_x.cmp(&nan_y),
        }
        .then(a.cmp(&b))
    });
    order
}

/// The threshold that maximises micro F1 of `scores >= threshold` over all entries of
/// `scores` / `labels` (both `(rows, heads)`): one of the score values, the highest among
/// equally good ones. Returns 0.5 when no entry is positive (F1 is then 0 everywhere).
pub fn best_threshold(scores: ArrayView2<f32>, labels: ArrayView2<f32>) -> f32 {
    let s: Vec<f32> = scores.iter().copied().collect();
    let l: Vec<bool> = labels.iter().map(|&v| v > 0.5).collect();
    let positives = l.iter().filter(|&&b| b).count();
    if positives == 0 {
        return 0.5;
    }
    let order = descending(&s);
    let (mut tp, mut predicted) = (0usize, 0usize);
    let (mut best, mut best_f1) = (0.5f32, -1.0f64);
    let mut i = 0;
    while i < order.len() {
        let v = s[order[i]];
        if v.is_nan() {
            break;
        }
        while i < order.len() && s[order[i]] == v {
            tp += l[order[i]] as usize;
            predicted += 1;
            i += 1;
        }
        let f = 2.0 * tp as f64 / (predicted + positives) as f64;
        if f > best_f1 {
            (best, best_f1) = (v, f);
        }
    }
    best
}

/// The rows of each prompt: `prompt` `(rows,)` names each row's prompt; groups in order
/// of first appearance.
fn rows_by_prompt(prompt: &[usize]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = Vec::new();
    let mut groups: std::collections::HashMap<usize, Vec<usize>> = Default::default();
    for (row, &p) in prompt.iter().enumerate() {
        groups
            .entry(p)
            .or_insert_with(|| {
                order.push(p);
                Vec::new()
            })
            .push(row);
    }
    order
        .into_iter()
        .filter_map(|p| groups.remove(&p))
        .collect()
}

/// Binary metrics of `scores` against `labels`, both `(rows, heads)`, at `threshold`;
/// `prompt` `(rows,)` names each row's prompt (for the interval), `train_frequency`
/// `(heads,)` picks the per-head breakdown, `n_heads` turns a column into (layer, head).
pub fn binary_metrics(
    scores: ArrayView2<f32>,
    labels: ArrayView2<f32>,
    threshold: f32,
    prompt: &[usize],
    train_frequency: &[f64],
    n_heads: usize,
) -> BinaryMetrics {
    debug_assert_eq!(prompt.len(), labels.nrows(), "one prompt per row");
    let heads = labels.ncols();
    let mut counts = vec![(0usize, 0usize, 0usize); heads]; // (tp, fp, fn) per head
    let mut row_counts = Vec::with_capacity(labels.nrows()); // (tp, fp, fn) per row
    for (srow, lrow) in scores.outer_iter().zip(labels.outer_iter()) {
        let mut row = (0, 0, 0);
        for (c, (&s, &l)) in srow.iter().zip(lrow.iter()).enumerate() {
            match (s >= threshold, l > 0.5) {
                (true, true) => (counts[c].0, row.0) = (counts[c].0 + 1, row.0 + 1),
                (true, false) => (counts[c].1, row.1) = (counts[c].1 + 1, row.1 + 1),
                (false, true) => (counts[c].2, row.2) = (counts[c].2 + 1, row.2 + 1),
                (false, false) => {}
            }
        }
        row_counts.push(row);
    }
    let per_prompt: Vec<(usize, usize, usize)> = rows_by_prompt(prompt)
        .iter()
        .map(|rows| {
            rows.iter().fold((0, 0, 0), |a, &r| {
                let c = row_counts[r];
                (a.0 + c.0, a.1 + c.1, a.2 + c.2)
            })
        })
        .collect();
    let micro_f1_ci95 = group_bootstrap95(&per_prompt, |picked| {
        let (tp, fp, fn_) = picked
            .iter()
            .fold((0, 0, 0), |a, c| (a.0 + c.0, a.1 + c.1, a.2 + c.2));
        f1(tp, fp, fn_)
    });
    let (tp, fp, fn_) = counts
        .iter()
        .fold((0, 0, 0), |a, c| (a.0 + c.0, a.1 + c.1, a.2 + c.2));
    let supported: Vec<f64> = counts
        .iter()
        .filter(|c| c.0 + c.2 > 0)
        .map(|c| f1(c.0, c.1, c.2).unwrap_or(0.0))
        .collect();
    let flat_scores: Vec<f32> = scores.iter().copied().collect();
    let flat_labels: Vec<bool> = labels.iter().map(|&v| v > 0.5).collect();
    let per_head = top_heads(train_frequency, PER_HEAD_TOP)
        .into_iter()
        .map(|c| {
            let col_labels: Vec<bool> = labels.column(c).iter().map(|&v| v > 0.5).collect();
            let col_scores: Vec<f32> = scores.column(c).to_vec();
            BinaryHeadMetrics {
                layer: c / n_heads.max(1),
                head: c % n_heads.max(1),
                train_frequency: train_frequency[c],
                support: counts[c].0 + counts[c].2,
                f1: f1(counts[c].0, counts[c].1, counts[c].2),
                ap: average_precision(&col_scores, &col_labels),
            }
        })
        .collect();
    BinaryMetrics {
        threshold,
        micro_f1: f1(tp, fp, fn_).unwrap_or(0.0),
        micro_f1_ci95,
        macro_f1: if supported.is_empty() {
            0.0
        } else {
            supported.iter().sum::<f64>() / supported.len() as f64
        },
        macro_f1_heads: supported.len(),
        auprc: average_precision(&flat_scores, &flat_labels),
        precision: ratio(tp, tp + fp),
        recall: ratio(tp, tp + fn_),
        rows: labels.nrows(),
        positives: tp + fn_,
        per_head,
    }
}

/// Continuous metrics of `pred` against `truth`, both `(rows, heads)`; `prompt`
/// `(rows,)` names each row's prompt (for the interval), `train_mean` `(heads,)` picks the
/// per-head breakdown, `n_heads` turns a column into (layer, head).
pub fn continuous_metrics(
    pred: ArrayView2<f32>,
    truth: ArrayView2<f32>,
    prompt: &[usize],
    train_mean: &[f64],
    n_heads: usize,
) -> ContinuousMetrics {
    debug_assert_eq!(prompt.len(), truth.nrows(), "one prompt per row");
    let rows = truth.nrows();
    let col_mean = truth
        .mapv(f64::from)
        .mean_axis(Axis(0))
        .map(|m| m.to_vec())
        .unwrap_or_else(|| vec![0.0; truth.ncols()]);
    // (residual, total) sums of squares per head.
    let mut ss = vec![(0.0f64, 0.0f64); truth.ncols()];
    for (prow, trow) in pred.outer_iter().zip(truth.outer_iter()) {
        for (c, (&p, &t)) in prow.iter().zip(trow.iter()).enumerate() {
            let (p, t) = (f64::from(p), f64::from(t));
            ss[c].0 += (t - p) * (t - p);
            ss[c].1 += (t - col_mean[c]) * (t - col_mean[c]);
        }
    }
    let head_r2 = |c: usize| (ss[c].1 > 1e-12).then(|| 1.0 - ss[c].0 / ss[c].1);
    let (res, tot) = ss.iter().fold((0.0, 0.0), |a, s| (a.0 + s.0, a.1 + s.1));
    let varying: Vec<f64> = (0..ss.len()).filter_map(head_r2).collect();
    let entries = rows * truth.ncols();
    ContinuousMetrics {
        r2_micro: (tot > 1e-12).then(|| 1.0 - res / tot),
        r2_micro_ci95: r2_micro_ci95(pred, truth, prompt),
        r2_mean_per_head: (!varying.is_empty())
            .then(|| varying.iter().sum::<f64>() / varying.len() as f64),
        r2_heads: varying.len(),
        mse: if entries == 0 {
            0.0
        } else {
            res / entries as f64
        },
        rows,
        per_head: top_heads(train_mean, PER_HEAD_TOP)
            .into_iter()
            .map(|c| ContinuousHeadMetrics {
                layer: c / n_heads.max(1),
                head: c % n_heads.max(1),
                train_mean: train_mean[c],
                test_mean: col_mean[c],
                r2: head_r2(c),
            })
            .collect(),
    }
}

/// The `k` columns with the highest `value`, highest first, ties by column.
pub(crate) fn top_heads(value: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..value.len()).collect();
    order.sort_by(|&a, &b| value[b].total_cmp(&value[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// One prompt's share of the micro R^2: its rows, and per head the residual sum of
/// squares, the sum and the sum of squares of the labels.
struct R2Sums {
    rows: usize,
    res: Vec<f64>,
    sum: Vec<f64>,
    sq: Vec<f64>,
}

/// Each prompt's [`R2Sums`], prompts in order of first appearance.
fn r2_sums(pred: ArrayView2<f32>, truth: ArrayView2<f32>, prompt: &[usize]) -> Vec<R2Sums> {
    let heads = truth.ncols();
    rows_by_prompt(prompt)
        .iter()
        .map(|rows| {
            let mut s = R2Sums {
                rows: rows.len(),
                res: vec![0.0; heads],
                sum: vec![0.0; heads],
                sq: vec![0.0; heads],
            };
            for &r in rows {
                for c in 0..heads {
                    let (p, t) = (f64::from(pred[[r, c]]), f64::from(truth[[r, c]]));
                    s.res[c] += (t - p) * (t - p);
                    s.sum[c] += t;
                    s.sq[c] += t * t;
                }
            }
            s
        })
        .collect()
}

/// The micro R^2 of the rows of `parts` pooled, each head's total sum of squares taken
/// around the pooled mean; `None` when no head's labels vary.
fn r2_of(parts: &[&R2Sums]) -> Option<f64> {
    let n: usize = parts.iter().map(|s| s.rows).sum();
    let heads = parts.first().map_or(0, |s| s.res.len());
    if n == 0 {
        return None;
    }
    let (mut res, mut tot) = (0.0, 0.0);
    for c in 0..heads {
        let (mut sum, mut sq) = (0.0, 0.0);
        for s in parts {
            res += s.res[c];
            sum += s.sum[c];
            sq += s.sq[c];
        }
        tot += (sq - sum * sum / n as f64).max(0.0);
    }
    (tot > 1e-12).then(|| 1.0 - res / tot)
}

/// The 95% interval of the micro R^2 over prompts resampled whole.
fn r2_micro_ci95(
    pred: ArrayView2<f32>,
    truth: ArrayView2<f32>,
    prompt: &[usize],
) -> Option<[f64; 2]> {
    group_bootstrap95(&r2_sums(pred, truth, prompt), r2_of)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn average_precision_matches_hand_computed_values() {
        // Ranking: 0.9 (+), 0.8 (-), 0.7 (+), 0.1 (-): AP = 1/2 * 1 + 1/2 * 2/3.
        let ap = average_precision(&[0.1, 0.9, 0.7, 0.8], &[false, true, true, false]);
        assert!(close(ap.unwrap(), 0.5 + 1.0 / 3.0));
        // A tie between a positive and a negative at the top: P = 1/2 at R = 1/2, then
        // the second positive at rank 4: P = 2/4.  AP = 1/2 * 1/2 + 1/2 * 1/2 = 0.5.
        let ap = average_precision(&[0.9, 0.9, 0.5, 0.2], &[true, false, false, true]);
        assert!(close(ap.unwrap(), 0.5));
        assert_eq!(average_precision(&[0.3, 0.2], &[false, false]), None);
    }

    #[test]
    fn micro_and_macro_f1_match_hand_computed_values() {
        // Columns (heads) 0..3; threshold 0.5.
        let scores = array![[0.9f32, 0.2, 0.6], [0.8, 0.7, 0.1], [0.1, 0.4, 0.3]];
        let labels = array![[1f32, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]];
        let m = binary_metrics(
            scores.view(),
            labels.view(),
            0.5,
            &[0, 1, 2],
            &[0.5, 0.4, 0.1],
            3,
        );
        // head 0: tp 2 fn 1 -> F1 4/5; head 1: tp 1 fn 1 -> 2/3; head 2: fp 1, no support.
        // micro: tp 3, fp 1, fn 2 -> 6 / 9.
        assert!(close(m.micro_f1, 6.0 / 9.0));
        assert!(close(m.macro_f1, (0.8 + 2.0 / 3.0) / 2.0));
        assert_eq!((m.macro_f1_heads, m.positives, m.rows), (2, 5, 3));
        assert!(close(m.precision, 0.75) && close(m.recall, 0.6));
        assert_eq!(m.per_head[0].support, 3);
        assert_eq!(m.per_head[2].f1, Some(0.0));
        assert_eq!(m.per_head[2].ap, None);
        assert_eq!((m.per_head[1].layer, m.per_head[1].head), (0, 1));
    }

    #[test]
    fn the_threshold_search_maximises_micro_f1() {
        let scores = array![[0.9f32, 0.3], [0.6, 0.2], [0.35, 0.1]];
        let labels = array![[1f32, 1.0], [1.0, 0.0], [0.0, 0.0]];
        // >= 0.3 predicts 4 entries with 3 tp: F1 6/7, better than any other cut.
        assert_eq!(best_threshold(scores.view(), labels.view()), 0.3);
        assert_eq!(best_threshold(scores.view(), (labels * 0.0).view()), 0.5);
    }

    #[test]
    fn r2_matches_hand_computed_values() {
        let truth = array![[1f32, 2.0, 5.0], [2.0, 2.0, 5.0], [3.0, 2.0, 5.0]];
        let pred = array![[1f32, 2.0, 5.0], [2.0, 3.0, 5.0], [4.0, 2.0, 5.0]];
        let m = continuous_metrics(pred.view(), truth.view(), &[0, 1, 2], &[0.0, 1.0, 2.0], 3);
        // head 0: ss_res 1, ss_tot 2 -> 0.5; heads 1, 2 constant (head 1 has ss_res 1).
        // micro: 1 - (1 + 1) / 2 = 0.
        assert!(close(m.r2_mean_per_head.unwrap(), 0.5));
        assert_eq!(m.r2_heads, 1);
        assert!(close(m.r2_micro.unwrap(), 0.0));
        assert!(close(m.mse, 2.0 / 9.0));
        assert_eq!(m.per_head[0].head, 2);
        assert_eq!(m.per_head[0].r2, None);
        assert!(close(m.per_head[2].r2.unwrap(), 0.5));
    }

    #[test]
    fn intervals_resample_prompts_whole() {
        // Two prompts of identical rows: every resample pools the same counts, so the
        // interval is the point itself.
        let scores = array![[0.9f32, 0.2], [0.8, 0.7], [0.9, 0.2], [0.8, 0.7]];
        let labels = array![[1f32, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]];
        let m = binary_metrics(
            scores.view(),
            labels.view(),
            0.5,
            &[4, 4, 9, 9],
            &[0.0; 2],
            2,
        );
        // tp 2, fp 1, fn 0 -> 4/5
        assert!(close(m.micro_f1, 0.8));
        assert_eq!(m.micro_f1_ci95, Some([0.8, 0.8]));
        // Prompts that differ: the interval spans the all-one-prompt extremes at most.
        let prompts = [0, 0, 1, 2];
        let m = binary_metrics(scores.view(), labels.view(), 0.5, &prompts, &[0.0; 2], 2);
        let [lo, hi] = m.micro_f1_ci95.unwrap();
        assert!(
            lo <= m.micro_f1 && m.micro_f1 <= hi && lo >= 0.0 && hi <= 1.0,
            "{lo} {hi}"
        );
        assert!(lo < hi);
    }

    #[test]
    fn pooled_prompt_sums_give_the_micro_r2() {
        let truth = array![[1f32, 2.0], [2.0, 4.0], [3.0, 1.0], [5.0, 0.5], [4.0, 2.5]];
        let pred = array![
            [1.5f32, 2.0],
            [2.0, 3.0],
            [2.5, 1.5],
            [4.0, 1.0],
            [4.5, 2.0]
        ];
        let prompts = [7, 7, 3, 3, 5];
        let m = continuous_metrics(pred.view(), truth.view(), &prompts, &[0.0; 2], 2);
        let sums = r2_sums(pred.view(), truth.view(), &prompts);
        assert_eq!(sums.iter().map(|s| s.rows).collect::<Vec<_>>(), [2, 2, 1]);
        let all: Vec<&R2Sums> = sums.iter().collect();
        assert!(close(r2_of(&all).unwrap(), m.r2_micro.unwrap()));
        // one prompt drawn twice is the prompt's own R^2 (the totals scale together)
        let twice = [&sums[0], &sums[0]];
        let one = continuous_metrics(
            pred.slice(ndarray::s![0..2, ..]),
            truth.slice(ndarray::s![0..2, ..]),
            &[7, 7],
            &[0.0; 2],
            2,
        );
        assert!(close(r2_of(&twice).unwrap(), one.r2_micro.unwrap()));
        let [lo, hi] = m.r2_micro_ci95.unwrap();
        assert!(lo <= hi && hi <= 1.0, "{lo} {hi}");
    }
}
