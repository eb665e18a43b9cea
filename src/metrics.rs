//! Answer metrics shared by scoring and evaluation: ROUGE-1 recall and ROUGE-L F1 over
//! lower-cased words, and SQuAD-style exact match and token F1 (with SQuAD's answer
//! normalisation: lower case, punctuation and the articles a/an/the removed, whitespace
//! collapsed), each also against a list of aliases (the best alias counts).

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

/// ROUGE-L F1 (beta = 1): from the longest common subsequence of the two word lists.
pub fn rouge_l_f1(reference: &str, candidate: &str) -> f64 {
    let (r, c) = (words(reference), words(candidate));
    if r.is_empty() || c.is_empty() {
        return 0.0;
    }
    // LCS by dynamic programming over one row.
    let mut row = vec![0usize; c.len() + 1];
    for rw in &r {
        let mut diag = 0;
        for (j, cw) in c.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = if rw == cw { diag + 1 } else { up.max(row[j]) };
            diag = up;
        }
    }
    let lcs = row[c.len()] as f64;
    if lcs == 0.0 {
        return 0.0;
    }
    let (p, rec) = (lcs / c.len() as f64, lcs / r.len() as f64);
    2.0 * p * rec / (p + rec)
}

/// SQuAD's answer normalisation: lower case, punctuation removed, the articles a, an and
/// the removed, whitespace collapsed.
pub fn normalize_answer(text: &str) -> String {
    let lower = text.to_lowercase();
    let no_punct: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    no_punct
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// SQuAD exact match: 1 if the normalised strings are equal.
pub fn exact_match(gold: &str, prediction: &str) -> f64 {
    f64::from(u8::from(
        normalize_answer(gold) == normalize_answer(prediction),
    ))
}

/// SQuAD token F1 between the normalised answers (bag of tokens); 1 when both are empty.
pub fn token_f1(gold: &str, prediction: &str) -> f64 {
    let g = normalize_answer(gold);
    let p = normalize_answer(prediction);
    let (g, mut p): (Vec<&str>, Vec<&str>) = (
        g.split_whitespace().collect(),
        p.split_whitespace().collect(),
    );
    if g.is_empty() || p.is_empty() {
        return f64::from(u8::from(g.is_empty() && p.is_empty()));
    }
    let n_p = p.len();
    let mut common = 0;
    for w in &g {
        if let Some(i) = p.iter().position(|x| x == w) {
            p.swap_remove(i);
            common += 1;
        }
    }
    if common == 0 {
        return 0.0;
    }
    let (precision, recall) = (common as f64 / n_p as f64, common as f64 / g.len() as f64);
    2.0 * precision * recall / (precision + recall)
}

/// The best value of `metric(alias, prediction)` over `aliases` (0 for no alias).
pub fn best_over_aliases(
    aliases: &[String],
    prediction: &str,
    metric: impl Fn(&str, &str) -> f64,
) -> f64 {
    aliases
        .iter()
        .map(|a| metric(a, prediction))
        .fold(0.0, f64::max)
}

/// Accuracy with aliases: 1 if some alias, normalised, occurs in the normalised
/// prediction as a whole-word phrase.
pub fn contains_answer(aliases: &[String], prediction: &str) -> f64 {
    let p = format!(" {} ", normalize_answer(prediction));
    let hit = aliases.iter().any(|a| {
        let a = normalize_answer(a);
        !a.is_empty() && p.contains(&format!(" {a} "))
    });
    f64::from(u8::from(hit))
}

/// The share of `expected` that occur in the prediction, each normalised and as a
/// whole-word phrase (0 when nothing is expected).
pub fn recall_all(expected: &[String], prediction: &str) -> f64 {
    if expected.is_empty() {
        return 0.0;
    }
    let found: f64 = expected
        .iter()
        .map(|e| contains_answer(std::slice::from_ref(e), prediction))
        .sum();
    found / expected.len() as f64
}

/// A metric by name, as specs and result records write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// ROUGE-L F1, best over aliases.
    RougeL,
    /// ROUGE-1 recall, best over aliases.
    Rouge1Recall,
    /// SQuAD exact match, best over aliases.
    Em,
    /// SQuAD token F1, best over aliases.
    F1,
    /// Whether some alias occurs in the prediction ([`contains_answer`]).
    Accuracy,
    /// The share of the expected strings that occur in the prediction, each as a
    /// whole-word phrase ([`recall_all`]; RULER's `string_match_all`).
    RecallAll,
}

impl Metric {
    /// The name in specs and records: `rouge_l`, `rouge1_recall`, `em`, `f1`,
    /// `accuracy`, `recall_all`.
    pub fn name(self) -> &'static str {
        match self {
            Metric::RougeL => "rouge_l",
            Metric::Rouge1Recall => "rouge1_recall",
            Metric::Em => "em",
            Metric::F1 => "f1",
            Metric::Accuracy => "accuracy",
            Metric::RecallAll => "recall_all",
        }
    }

    /// Score `prediction` against `aliases` (gold answer first; for
    /// [`Metric::RecallAll`], every string expected).
    pub fn score(self, aliases: &[String], prediction: &str) -> f64 {
        match self {
            Metric::RougeL => best_over_aliases(aliases, prediction, rouge_l_f1),
            Metric::Rouge1Recall => best_over_aliases(aliases, prediction, rouge1_recall),
            Metric::Em => best_over_aliases(aliases, prediction, exact_match),
            Metric::F1 => best_over_aliases(aliases, prediction, token_f1),
            Metric::Accuracy => contains_answer(aliases, prediction),
            Metric::RecallAll => recall_all(aliases, prediction),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_by_name_score_against_the_best_alias() {
        let aliases = vec!["Washington, D.C.".to_string(), "Washington".to_string()];
        assert_eq!(Metric::Em.score(&aliases, "washington"), 1.0);
        assert_eq!(Metric::Accuracy.score(&aliases, "It is Washington."), 1.0);
        // "the capital" vs "Washington": no overlap
        assert_eq!(Metric::F1.score(&aliases, "the capital"), 0.0);
        // reference "washington", candidate "washington dc": recall 1, ROUGE-L 2/3
        assert_eq!(Metric::Rouge1Recall.score(&aliases, "Washington DC"), 1.0);
        let expected = vec!["1234".to_string(), "QWERT".to_string(), "5678".to_string()];
        let r = Metric::RecallAll.score(&expected, "qwert, 5678 and 12345");
        assert!((r - 2.0 / 3.0).abs() < 1e-12, "{r}");
        let l = Metric::RougeL.score(&aliases[1..], "Washington DC");
        assert!((l - 2.0 / 3.0).abs() < 1e-12, "{l}");
        let json = serde_json::to_string(&Metric::Rouge1Recall).unwrap();
        assert_eq!(json, "\"rouge1_recall\"");
    }

    #[test]
    fn rouge_l_on_a_hand_computed_case() {
        // reference "the cat sat on the mat" (6), candidate "the cat lay on a mat" (6):
        // LCS "the cat on mat" = 4 -> P = R = 4/6 -> F1 = 2/3
        let f = rouge_l_f1("the cat sat on the mat", "the cat lay on a mat");
        assert!((f - 2.0 / 3.0).abs() < 1e-12, "{f}");
        // order matters: "cat on mat" and "mat on cat" share a subsequence of one word
        let f = rouge_l_f1("cat on mat", "mat on cat");
        assert!((f - 1.0 / 3.0).abs() < 1e-12, "{f}");
        assert_eq!(rouge_l_f1("x", ""), 0.0);
    }

    #[test]
    fn squad_normalisation_exact_match_and_f1() {
        assert_eq!(normalize_answer("The  Eiffel-Tower!"), "eiffeltower");
        assert_eq!(exact_match("the Paris", "Paris."), 1.0);
        assert_eq!(exact_match("Paris", "Paris, France"), 0.0);
        // gold "barack obama" vs "president barack obama": P = 2/3, R = 1 -> F1 = 0.8
        assert!((token_f1("Barack Obama", "President Barack Obama") - 0.8).abs() < 1e-12);
        assert_eq!(token_f1("a", "the"), 1.0); // both normalise to nothing
        assert_eq!(token_f1("Lisbon", "Madrid"), 0.0);
    }

    #[test]
    fn aliases_take_the_best_match() {
        let aliases = vec!["United States".to_string(), "USA".to_string()];
        assert_eq!(best_over_aliases(&aliases, "the USA", exact_match), 1.0);
        assert_eq!(
            contains_answer(&aliases, "It is in the United States."),
            1.0
        );
        assert_eq!(contains_answer(&aliases, "the USAF base"), 0.0);
        assert_eq!(best_over_aliases(&[], "x", exact_match), 0.0);
    }

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
