//! Answer metrics shared by scoring and evaluation.

/// Lower-cased alphanumeric words of `text`.
pub fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// ROUGE-1 recall: the share of the reference's words (with multiplicity) that the
/// candidate contains; 0 for an empty reference.
pub fn rouge1_recall(reference: &str, candidate: &str) -> f64 {
    let reference = words(reference);
    if reference.is_empty() {
        return 0.0;
    }
    let mut pool = words(candidate);
    let mut hits = 0;
    for w in &reference {
        if let Some(i) = pool.iter().position(|c| c == w) {
            pool.swap_remove(i);
            hits += 1;
        }
    }
    hits as f64 / reference.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rouge1_recall_on_hand_computed_cases() {
        assert_eq!(rouge1_recall("7392", " The number is 7392."), 1.0);
        assert_eq!(rouge1_recall("New York", "new"), 0.5);
        // multiplicity: "the the" needs two "the"s
        assert_eq!(rouge1_recall("the the", "the"), 0.5);
        assert_eq!(rouge1_recall("Yuki", "Omar"), 0.0);
        assert_eq!(rouge1_recall("", "anything"), 0.0);
    }
}
