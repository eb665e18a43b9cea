//! Wu et al.'s retrieval score ("Retrieval Head Mechanistically Explains Long-Context
//! Factuality", 2024, the retrieval score): at each generation step, a head
//! whose most-attended position lies in the needle and holds the token just generated
//! earns `1 / |needle|`.

use std::ops::Range;

use candle_core::{Tensor, D};

use crate::policy::ranking::HeadMatrix;
use crate::Result;

/// Add one step's token-match credit of every head of one layer to `scores`.
///
/// `probs`: the step's attention `(n_heads, 1, kv_len)` (column `j` = position `j`);
/// `sequence`: the tokens at positions `0..kv_len` (prompt and tokens generated so
/// far); `generated`: the token this step produced.
pub fn add_step(
    scores: &mut HeadMatrix,
    layer: usize,
    probs: &Tensor,
    sequence: &[u32],
    needle: &Range<usize>,
    generated: u32,
) -> Result<()> {
    let argmax: Vec<u32> = probs.squeeze(1)?.argmax(D::Minus1)?.to_vec1()?;
    let credit = 1.0 / needle.len().max(1) as f64;
    for (head, &j) in argmax.iter().enumerate() {
        let j = j as usize;
        if needle.contains(&j) && sequence.get(j) == Some(&generated) {
            *scores.at(layer, head) += credit;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Attention rows of 3 heads over 6 positions, each peaked at `peaks[h]`.
    fn peaked(peaks: [usize; 3]) -> Tensor {
        let mut rows = vec![0.02f32; 3 * 6];
        for (h, p) in peaks.iter().enumerate() {
            rows[h * 6 + p] = 0.9;
        }
        Tensor::from_vec(rows, (3, 1, 6), &Device::Cpu).unwrap()
    }

    #[test]
    fn only_a_needle_hit_on_the_generated_token_scores() {
        // positions:    0  1   2   3   4  5 ; needle [2, 4) holds 70 and 71
        let sequence = [5, 9, 70, 71, 9, 70];
        let needle = 2..4;
        let mut s = HeadMatrix::zeros(1, 3);
        // head 0 hits the needle on the generated token 70; head 1 hits the needle on
        // another token (71); head 2 hits 70 outside the needle (position 5)
        add_step(&mut s, 0, &peaked([2, 3, 5]), &sequence, &needle, 70).unwrap();
        assert_eq!(s.data, vec![0.5, 0.0, 0.0]);
    }
}
