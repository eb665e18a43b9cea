//! The few statistics the reports use.

/// Mean and standard error of `xs` (the sample standard deviation over `sqrt(n)`; 0 for
/// a single value).
pub(crate) fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, (var / n).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_standard_error_by_hand() {
        // 1, 2, 3: mean 2, sample variance 1, se 1 / sqrt(3)
        let (m, se) = mean_se(&[1.0, 2.0, 3.0]);
        assert!((m - 2.0).abs() < 1e-12);
        assert!((se - 1.0 / 3f64.sqrt()).abs() < 1e-12);
        assert_eq!(mean_se(&[5.0]), (5.0, 0.0));
    }
}
