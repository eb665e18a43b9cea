//! A branch-free `exp` for softmax rows that the compiler vectorises: `libm`'s `expf` is
//! a call per element, and one decode step of SmolLM2 at 2k context takes half a million
//! of them.
//!
//! `exp(x) = 2^n * exp(r)` with `n = round(x / ln 2)` and `|r| <= ln 2 / 2`; `exp(r)` is a
//! degree-6 Taylor polynomial (truncation error below `r^7 / 7! ≈ 1.2e-7` relative, about
//! one f32 ulp), `2^n` is built in the exponent bits. Inputs below `-87.3` (where f32
//! stops being normal), including `-inf` from masks, give exactly `0`.

/// `ln 2` split into a part exact in f32 and the remainder (Cody and Waite).
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding and subtracting `1.5 * 2^23` rounds an f32 below `2^22` to the nearest integer.
pub(crate) const ROUND: f32 = 12_582_912.0;
/// Below this `exp` is not a normal f32; the result is flushed to zero.
const LOWEST: f32 = -87.3;

/// `exp(x)` for `x <= 88`, to about one ulp; `0` below [`LOWEST`].
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(LOWEST, 88.0);
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r / 720.0)))));
    let scale = f32::from_bits((held_integer(t).wrapping_add(127) as u32) << 23);
    if x < LOWEST {
        0.0
    } else {
        p * scale
    }
}

/// The integer `n` of `t = n + ROUND` (`|n| < 2^22`, `t` computed in f32): `t`'s exponent
/// and top mantissa bit are those of [`ROUND`], its low mantissa bits hold `n`. Read from
/// the bits because `as i32` saturates, which the compiler does lane by lane in scalar
/// code (measured: the hottest loop of a batched decode step's attention).
#[inline(always)]
pub(crate) fn held_integer(t: f32) -> i32 {
    (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32)
}

/// Independent accumulators of [`sum`] and [`max`]: a reduction into one float is a
/// chain the compiler may not reorder, so it would not vectorise.
const LANES: usize = 16;

/// Replace every `x` of `row` by `exp(x - max)` and return their sum.
#[inline(always)]
pub fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
    row.iter_mut().for_each(|x| *x = exp(*x - max));
    sum(row)
}

/// Sum of `xs` in [`LANES`] interleaved partial sums.
#[inline(always)]
pub fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        acc.iter_mut().zip(c).for_each(|(a, x)| *a += x);
    }
    acc.iter().sum::<f32>() + rest
}

/// Largest of `xs` (`-inf` when empty).
#[inline(always)]
pub fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        acc.iter_mut().zip(c).for_each(|(a, x)| *a = a.max(*x));
    }
    acc.iter().copied().fold(rest, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f64_exp_to_a_few_ulp() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 87.5 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp(x) as f64 - want) / want).abs());
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        // 2^n read from the bits is 2^n: exact at integers, where r = 0.
        for n in -125..=88 {
            let x = n as f32 * std::f32::consts::LN_2;
            let want = (x as f64).exp();
            assert!(((exp(x) as f64 - want) / want).abs() < 3e-7, "exp({x})");
        }
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn lane_reductions_match_plain_folds() {
        for n in [0, 5, 16, 37, 300] {
            let xs: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let plain: f64 = xs.iter().map(|&x| x as f64).sum();
            assert!((sum(&xs) as f64 - plain).abs() < 1e-4, "n {n}");
            let top = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&xs), top, "n {n}");
        }
    }

    #[test]
    fn masked_and_tiny_inputs_are_zero() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        let mut row = [0.0, f32::NEG_INFINITY, (0.5f32).ln()];
        let sum = exp_shifted(&mut row, 0.0);
        assert_eq!(row[1], 0.0);
        assert!((sum - 1.5).abs() < 1e-6 && (row[2] - 0.5).abs() < 1e-7);
    }
}
