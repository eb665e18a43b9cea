//! The 70/20/10 train/validation/test split by prompt: all steps of one prompt land in
//! the same split, so the probe is never tested on a prompt whose other steps it was
//! trained on (the steps of one generation are strongly correlated).

use std::collections::{BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use crate::rng::SplitMix64;
use crate::{Error, Result};

/// Share of the prompts in the train, validation and test splits.
pub const SPLIT_FRACTIONS: [f64; 3] = [0.7, 0.2, 0.1];

/// Row indices (ascending) and prompt ids (ascending) of the three splits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    /// The seed the prompt order was shuffled with.
    pub seed: u64,
    pub train: Vec<usize>,
    pub val: Vec<usize>,
    pub test: Vec<usize>,
    pub train_prompts: Vec<usize>,
    pub val_prompts: Vec<usize>,
    pub test_prompts: Vec<usize>,
}

/// Split the rows of a trace by prompt. `prompt`: `(steps,)`, the prompt id of each row
/// (any ids; need not be contiguous). The distinct prompts are sorted, shuffled with
/// `seed`, and cut into `round(0.1 n)` test, `round(0.2 n)` validation and the rest
/// train prompts; the same ids and seed always give the same split.
///
/// Errors when a split would hold no prompt (fewer than 5 prompts), naming the split.
pub fn split_by_prompt(prompt: &[usize], seed: u64) -> Result<Split> {
    let mut prompts: Vec<usize> = prompt
        .iter()
        .copied()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let n = prompts.len();
    let n_test = (SPLIT_FRACTIONS[2] * n as f64).round() as usize;
    let n_val = (SPLIT_FRACTIONS[1] * n as f64).round() as usize;
    let n_train = n.saturating_sub(n_test + n_val);
    for (name, count) in [("train", n_train), ("validation", n_val), ("test", n_test)] {
        if count == 0 {
            return Err(Error::invalid(
                "probe split",
                format!(
                    "the {name} split would be empty: {n} prompts split 70/20/10 by prompt \
                     (at least 5 prompts are needed)"
                ),
            ));
        }
    }
    SplitMix64::new(seed, 0).shuffle(&mut prompts);
    let mut which = HashMap::with_capacity(n);
    for (rank, &p) in prompts.iter().enumerate() {
        let part = if rank < n_train {
            0
        } else if rank < n_train + n_val {
            1
        } else {
            2
        };
        which.insert(p, part);
    }
    let mut rows: [Vec<usize>; 3] = Default::default();
    for (row, p) in prompt.iter().enumerate() {
        rows[which[p]].push(row);
    }
    let mut ids: [Vec<usize>; 3] = Default::default();
    for (&p, &part) in &which {
        ids[part].push(p);
    }
    for list in &mut ids {
        list.sort_unstable();
    }
    let [train, val, test] = rows;
    let [train_prompts, val_prompts, test_prompts] = ids;
    Ok(Split {
        seed,
        train,
        val,
        test,
        train_prompts,
        val_prompts,
        test_prompts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 23 prompts with 1..=4 steps each, in prompt order.
    fn prompts() -> Vec<usize> {
        (0..23)
            .flat_map(|p| std::iter::repeat_n(p * 3 + 1, 1 + p % 4))
            .collect()
    }

    #[test]
    fn no_prompt_straddles_two_splits_and_every_row_is_used_once() {
        let prompt = prompts();
        let s = split_by_prompt(&prompt, 11).unwrap();
        assert_eq!(
            (
                s.train_prompts.len(),
                s.val_prompts.len(),
                s.test_prompts.len()
            ),
            (16, 5, 2)
        );
        let mut all: Vec<usize> = [&s.train[..], &s.val[..], &s.test[..]].concat();
        all.sort_unstable();
        assert_eq!(all, (0..prompt.len()).collect::<Vec<_>>());
        for (rows, ids) in [
            (&s.train, &s.train_prompts),
            (&s.val, &s.val_prompts),
            (&s.test, &s.test_prompts),
        ] {
            assert!(rows.iter().all(|&r| ids.contains(&prompt[r])));
        }
    }

    #[test]
    fn the_split_is_deterministic_in_the_seed() {
        let prompt = prompts();
        assert_eq!(
            split_by_prompt(&prompt, 5).unwrap(),
            split_by_prompt(&prompt, 5).unwrap()
        );
        assert_ne!(
            split_by_prompt(&prompt, 5).unwrap().test_prompts,
            split_by_prompt(&prompt, 6).unwrap().test_prompts
        );
    }

    #[test]
    fn too_few_prompts_name_the_empty_split() {
        let err = split_by_prompt(&[0, 0, 1, 2, 3], 0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("test split would be empty") && err.contains("4 prompts"),
            "{err}"
        );
        let err = split_by_prompt(&[], 0).unwrap_err().to_string();
        assert!(
            err.contains("train split would be empty") && err.contains("0 prompts"),
            "{err}"
        );
        assert!(split_by_prompt(&[0, 1, 2, 3, 4], 0).is_ok());
    }
}
