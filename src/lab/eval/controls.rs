//! Specificity controls: closed-book questions (no context, so no support) that a model
//! answers from what it knows or computes, not by retrieving from its prompt. A head
//! ablation that hurts retrieval but leaves these intact is specific to retrieval.
//!
//! Three kinds ([`ControlKind`]), generated in code:
//!
//! - `capital`: "What is the capital of {country}?" over a fixed list of well-known
//!   countries with one undisputed capital ([`pool_size`] of them); answers the capital,
//!   plus common spellings (`Kyiv` / `Kiev`, `Washington, D.C.` / `Washington`);
//! - `city`: "In which country is the city of {city}?" over well-known cities that are
//!   not capitals and whose name is not shared by a better-known place; answers the
//!   country, plus common names (`United Kingdom` / `UK` / `England`);
//! - `arithmetic`: "What is {a} plus {b}?" (2-50 each), "... minus ..." (10-99 minus a
//!   smaller positive number) or "... times ..." (2-12 each), drawn from a seed without
//!   repeats; answers the number in digits, then in words (`"37"`, `"thirty-seven"`).
//!
//! Prompt (raw completion, one piece, BOS first when the tokenizer adds one): a one-line
//! instruction, two fixed demonstrations, then the question. No pool item repeats a
//! demonstration or has a demonstration's answer, so nothing can be copied from the
//! prompt:
//!
//! ```text
//! Answer with the name of a city.
//!
//! Question: What is the capital of Spain?
//! Answer: Madrid
//!
//! Question: What is the capital of Japan?
//! Answer: Tokyo
//!
//! Question: What is the capital of Peru?
//! Answer:
//! ```
//!
//! A seed picks the items (for `capital` and `city`, a seeded shuffle of the list, of
//! which the first `n` are kept) and fixes their order; the same seed gives the same pool.
//! Examples: task [`ControlKind::name`], id `{task}-{item}` (`control_capital-peru`,
//! `control_arithmetic-12-plus-7`), context tokens 0, support empty.

use crate::lab::eval::datasets::ANSWER_RESERVE;
use crate::lab::eval::{Example, PromptBuilder};
use crate::lab::tasks::Encoder;
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// The pool size a run uses unless told otherwise.
pub const DEFAULT_POOL: usize = 60;

/// The largest arithmetic pool.
const MAX_ARITHMETIC: usize = 1000;

/// Salt of the seeded shuffle and draws.
const POOL_SALT: u64 = 0xC0E7_0015_0A5E_D0CC;

/// A kind of control question.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlKind {
    /// The capital of a country.
    Capital,
    /// The country of a city.
    City,
    /// A small sum, difference or product.
    Arithmetic,
}

impl ControlKind {
    /// The task name of its examples: `control_capital`, `control_city`,
    /// `control_arithmetic`.
    pub fn name(self) -> &'static str {
        match self {
            ControlKind::Capital => "control_capital",
            ControlKind::City => "control_city",
            ControlKind::Arithmetic => "control_arithmetic",
        }
    }

    /// The instruction that opens its prompts.
    fn instruction(self) -> &'static str {
        match self {
            ControlKind::Capital => "Answer with the name of a city.",
            ControlKind::City => "Answer with the name of a country.",
            ControlKind::Arithmetic => "Answer with a number.",
        }
    }

    /// Its two demonstrations, (question, answer).
    fn demos(self) -> [(String, String); 2] {
        match self {
            ControlKind::Capital => [
                (capital_question("Spain"), "Madrid".into()),
                (capital_question("Japan"), "Tokyo".into()),
            ],
            ControlKind::City => [
                (city_question("Barcelona"), "Spain".into()),
                (city_question("Osaka"), "Japan".into()),
            ],
            ControlKind::Arithmetic => [
                (Sum::new(23, Op::Plus, 14).question(), "37".into()),
                (Sum::new(9, Op::Times, 4).question(), "36".into()),
            ],
        }
    }
}

/// The most items a pool of `kind` can hold.
pub fn pool_size(kind: ControlKind) -> usize {
    match kind {
        ControlKind::Capital => CAPITALS.len(),
        ControlKind::City => CITIES.len(),
        ControlKind::Arithmetic => MAX_ARITHMETIC,
    }
}

/// `n` control examples of `kind`, chosen and ordered by `seed`.
///
/// Errors: [`Error::InvalidArgument`] when `n` exceeds [`pool_size`];
/// [`Error::ContextOverflow`] when a prompt plus
/// [`crate::lab::eval::datasets::ANSWER_RESERVE`] tokens exceeds the context;
/// tokenizer failures.
pub fn pool(kind: ControlKind, enc: &Encoder, n: usize, seed: u64) -> Result<Vec<Example>> {
    if n > pool_size(kind) {
        return Err(Error::invalid(
            "n",
            format!(
                "{} holds at most {} items, not {n}",
                kind.name(),
                pool_size(kind)
            ),
        ));
    }
    let items: Vec<Item> = match kind {
        ControlKind::Capital => shuffled(CAPITALS.len(), n, seed)
            .into_iter()
            .map(|k| {
                let (country, capital, aliases) = CAPITALS[k];
                Item {
                    key: slug(country),
                    question: capital_question(country),
                    answers: answers(capital, aliases),
                }
            })
            .collect(),
        ControlKind::City => shuffled(CITIES.len(), n, seed)
            .into_iter()
            .map(|k| {
                let (city, country, aliases) = CITIES[k];
                Item {
                    key: slug(city),
                    question: city_question(city),
                    answers: answers(country, aliases),
                }
            })
            .collect(),
        ControlKind::Arithmetic => sums(n, seed, &kind.demos())?,
    };
    let mut head = format!("{}\n\n", kind.instruction());
    for (q, a) in kind.demos() {
        head.push_str(&format!("Question: {q}\nAnswer: {a}\n\n"));
    }
    items
        .into_iter()
        .map(|item| {
            let mut b = PromptBuilder::new(*enc);
            b.push(&format!("{head}Question: {}\nAnswer:", item.question))?;
            let prompt = b.finish();
            if prompt.len() + ANSWER_RESERVE > enc.max_context() {
                return Err(Error::ContextOverflow {
                    prompt: prompt.len(),
                    max_new: ANSWER_RESERVE,
                    context: enc.max_context(),
                });
            }
            Ok(Example {
                id: format!("{}-{}", kind.name(), item.key),
                task: kind.name().to_string(),
                context_tokens: 0,
                prompt,
                answers: item.answers,
                support: Vec::new(),
                question_start: None,
            })
        })
        .collect()
}

/// One question before tokenization.
struct Item {
    /// The id suffix.
    key: String,
    question: String,
    /// Gold first.
    answers: Vec<String>,
}

/// The first `n` of `0..len` in an order shuffled by `seed` (Fisher-Yates).
fn shuffled(len: usize, n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    let mut rng = SplitMix64::new(seed, POOL_SALT);
    for i in (1..len).rev() {
        order.swap(i, rng.below(i + 1));
    }
    order.truncate(n);
    order
}

/// `gold`, then `aliases`.
fn answers(gold: &str, aliases: &[&str]) -> Vec<String> {
    std::iter::once(gold)
        .chain(aliases.iter().copied())
        .map(str::to_string)
        .collect()
}

fn capital_question(country: &str) -> String {
    format!("What is the capital of {country}?")
}

fn city_question(city: &str) -> String {
    format!("In which country is the city of {city}?")
}

/// `s` as an id part: a leading `the ` dropped, lower-case ASCII letters and digits,
/// other runs as one `_`.
fn slug(s: &str) -> String {
    let mut out = String::new();
    for c in s.strip_prefix("the ").unwrap_or(s).chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.is_empty() && !out.ends_with('_') {
            out.push('_');
        }
    }
    out.trim_end_matches('_').to_string()
}

/// An arithmetic operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Plus,
    Minus,
    Times,
}

/// One arithmetic question.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sum {
    a: u32,
    op: Op,
    b: u32,
}

impl Sum {
    fn new(a: u32, op: Op, b: u32) -> Self {
        Self { a, op, b }
    }

    /// The word for the operation.
    fn word(self) -> &'static str {
        match self.op {
            Op::Plus => "plus",
            Op::Minus => "minus",
            Op::Times => "times",
        }
    }

    fn question(self) -> String {
        format!("What is {} {} {}?", self.a, self.word(), self.b)
    }

    /// The result (never negative: `b < a` for differences).
    fn value(self) -> u32 {
        match self.op {
            Op::Plus => self.a + self.b,
            Op::Minus => self.a - self.b,
            Op::Times => self.a * self.b,
        }
    }

    /// A uniform draw of the operation, then of its operands (ranges in the module docs).
    fn draw(rng: &mut SplitMix64) -> Self {
        let between =
            |rng: &mut SplitMix64, lo: u32, hi: u32| lo + rng.below((hi - lo + 1) as usize) as u32;
        match rng.below(3) {
            0 => Sum::new(between(rng, 2, 50), Op::Plus, between(rng, 2, 50)),
            1 => {
                let a = between(rng, 10, 99);
                Sum::new(a, Op::Minus, between(rng, 1, a - 1))
            }
            _ => Sum::new(between(rng, 2, 12), Op::Times, between(rng, 2, 12)),
        }
    }
}

/// `n` distinct arithmetic items drawn by `seed`, none a demonstration or with a
/// demonstration's answer.
fn sums(n: usize, seed: u64, demos: &[(String, String)]) -> Result<Vec<Item>> {
    let mut rng = SplitMix64::new(seed, POOL_SALT);
    let mut chosen: Vec<Sum> = Vec::with_capacity(n);
    // Far more distinct questions exist than MAX_ARITHMETIC; the bound only guards the
    // loop.
    let mut draws = 0;
    while chosen.len() < n {
        draws += 1;
        if draws > 100 * MAX_ARITHMETIC {
            return Err(Error::invalid(
                "n",
                format!("could not draw {n} distinct arithmetic questions"),
            ));
        }
        let s = Sum::draw(&mut rng);
        let demo = demos
            .iter()
            .any(|(q, a)| *q == s.question() || *a == s.value().to_string());
        if !demo && !chosen.contains(&s) {
            chosen.push(s);
        }
    }
    Ok(chosen
        .into_iter()
        .map(|s| Item {
            key: format!("{}-{}-{}", s.a, s.word(), s.b),
            question: s.question(),
            answers: vec![s.value().to_string(), number_words(s.value())],
        })
        .collect())
}

/// `n` (below 1000) in English words: `seven`, `forty-two`, `one hundred forty-four`.
fn number_words(n: u32) -> String {
    const ONES: [&str; 20] = [
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
    ];
    const TENS: [&str; 10] = [
        "", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
    ];
    match n {
        0..=19 => ONES[n as usize].to_string(),
        20..=99 if n.is_multiple_of(10) => TENS[(n / 10) as usize].to_string(),
        20..=99 => format!("{}-{}", TENS[(n / 10) as usize], ONES[(n % 10) as usize]),
        _ if n.is_multiple_of(100) => format!("{} hundred", number_words(n / 100)),
        _ => format!(
            "{} hundred {}",
            number_words(n / 100),
            number_words(n % 100)
        ),
    }
}

/// Names a British city's country is known by.
const UK_ENGLAND: &[&str] = &["UK", "England", "Britain", "Great Britain"];
/// Names a Scottish city's country is known by.
const UK_SCOTLAND: &[&str] = &["UK", "Scotland", "Britain", "Great Britain"];
/// Other names of the United States.
const US: &[&str] = &["USA", "US", "United States of America", "America"];

/// (country, capital, other accepted names of the capital). Spain and Japan are the
/// demonstrations and stay out.
const CAPITALS: &[(&str, &str, &[&str])] = &[
    ("France", "Paris", &[]),
    ("Germany", "Berlin", &[]),
    ("Italy", "Rome", &[]),
    ("Portugal", "Lisbon", &[]),
    ("the United Kingdom", "London", &[]),
    ("Ireland", "Dublin", &[]),
    ("Belgium", "Brussels", &[]),
    ("Austria", "Vienna", &[]),
    ("Poland", "Warsaw", &[]),
    ("the Czech Republic", "Prague", &[]),
    ("Hungary", "Budapest", &[]),
    ("Greece", "Athens", &[]),
    ("Sweden", "Stockholm", &[]),
    ("Norway", "Oslo", &[]),
    ("Denmark", "Copenhagen", &[]),
    ("Finland", "Helsinki", &[]),
    ("Iceland", "Reykjavik", &["Reykjavík"]),
    ("Russia", "Moscow", &[]),
    ("Ukraine", "Kyiv", &["Kiev"]),
    ("Romania", "Bucharest", &[]),
    ("Bulgaria", "Sofia", &[]),
    ("Serbia", "Belgrade", &[]),
    ("Croatia", "Zagreb", &[]),
    ("Slovakia", "Bratislava", &[]),
    ("Slovenia", "Ljubljana", &[]),
    ("Estonia", "Tallinn", &[]),
    ("Latvia", "Riga", &[]),
    ("Lithuania", "Vilnius", &[]),
    ("Belarus", "Minsk", &[]),
    ("Albania", "Tirana", &[]),
    ("Turkey", "Ankara", &[]),
    ("Egypt", "Cairo", &[]),
    ("Kenya", "Nairobi", &[]),
    ("Ethiopia", "Addis Ababa", &[]),
    ("Nigeria", "Abuja", &[]),
    ("Ghana", "Accra", &[]),
    ("Morocco", "Rabat", &[]),
    ("Algeria", "Algiers", &[]),
    ("Tunisia", "Tunis", &[]),
    ("Senegal", "Dakar", &[]),
    ("Uganda", "Kampala", &[]),
    ("Zimbabwe", "Harare", &[]),
    ("China", "Beijing", &["Peking"]),
    ("South Korea", "Seoul", &[]),
    ("North Korea", "Pyongyang", &[]),
    ("India", "New Delhi", &["Delhi"]),
    ("Pakistan", "Islamabad", &[]),
    ("Bangladesh", "Dhaka", &[]),
    ("Nepal", "Kathmandu", &[]),
    ("Thailand", "Bangkok", &[]),
    ("Vietnam", "Hanoi", &[]),
    ("the Philippines", "Manila", &[]),
    ("Afghanistan", "Kabul", &[]),
    ("Iran", "Tehran", &[]),
    ("Iraq", "Baghdad", &[]),
    ("Saudi Arabia", "Riyadh", &[]),
    ("Syria", "Damascus", &[]),
    ("Jordan", "Amman", &[]),
    ("Lebanon", "Beirut", &[]),
    ("Qatar", "Doha", &[]),
    ("Mongolia", "Ulaanbaatar", &["Ulan Bator"]),
    ("Cambodia", "Phnom Penh", &[]),
    ("Laos", "Vientiane", &[]),
    ("Armenia", "Yerevan", &[]),
    ("Azerbaijan", "Baku", &[]),
    ("Uzbekistan", "Tashkent", &[]),
    (
        "the United States",
        "Washington, D.C.",
        &["Washington", "Washington D.C.", "Washington DC"],
    ),
    ("Canada", "Ottawa", &[]),
    ("Mexico", "Mexico City", &[]),
    ("Cuba", "Havana", &[]),
    ("Jamaica", "Kingston", &[]),
    ("Argentina", "Buenos Aires", &[]),
    ("Brazil", "Brasilia", &["Brasília"]),
    ("Chile", "Santiago", &[]),
    ("Peru", "Lima", &[]),
    ("Colombia", "Bogota", &["Bogotá"]),
    ("Venezuela", "Caracas", &[]),
    ("Ecuador", "Quito", &[]),
    ("Uruguay", "Montevideo", &[]),
    ("Paraguay", "Asuncion", &["Asunción"]),
    ("Australia", "Canberra", &[]),
    ("New Zealand", "Wellington", &[]),
];

/// (city, country, other accepted names of the country). Barcelona and Osaka are the
/// demonstrations and stay out, and so does every city of Spain or Japan, so that no
/// answer could be copied from a demonstration.
const CITIES: &[(&str, &str, &[&str])] = &[
    ("Munich", "Germany", &[]),
    ("Hamburg", "Germany", &[]),
    ("Frankfurt", "Germany", &[]),
    ("Cologne", "Germany", &[]),
    ("Milan", "Italy", &[]),
    ("Venice", "Italy", &[]),
    ("Florence", "Italy", &[]),
    ("Naples", "Italy", &[]),
    ("Lyon", "France", &[]),
    ("Marseille", "France", &[]),
    ("Bordeaux", "France", &[]),
    ("Manchester", "United Kingdom", UK_ENGLAND),
    ("Liverpool", "United Kingdom", UK_ENGLAND),
    ("Edinburgh", "United Kingdom", UK_SCOTLAND),
    ("Glasgow", "United Kingdom", UK_SCOTLAND),
    ("Porto", "Portugal", &[]),
    ("Rotterdam", "Netherlands", &["Holland"]),
    ("Antwerp", "Belgium", &[]),
    ("Bruges", "Belgium", &[]),
    ("Zurich", "Switzerland", &[]),
    ("Geneva", "Switzerland", &[]),
    ("Krakow", "Poland", &[]),
    ("Salzburg", "Austria", &[]),
    ("Gothenburg", "Sweden", &[]),
    ("Bergen", "Norway", &[]),
    ("Thessaloniki", "Greece", &[]),
    ("Dubrovnik", "Croatia", &[]),
    ("Istanbul", "Turkey", &["Türkiye"]),
    ("Novosibirsk", "Russia", &[]),
    ("Shanghai", "China", &[]),
    ("Mumbai", "India", &[]),
    ("Bangalore", "India", &[]),
    ("Kolkata", "India", &[]),
    ("Chennai", "India", &[]),
    ("Karachi", "Pakistan", &[]),
    ("Lahore", "Pakistan", &[]),
    ("Busan", "South Korea", &["Korea"]),
    ("Ho Chi Minh City", "Vietnam", &[]),
    ("Chiang Mai", "Thailand", &[]),
    ("Dubai", "United Arab Emirates", &["UAE"]),
    ("Jeddah", "Saudi Arabia", &[]),
    ("Tel Aviv", "Israel", &[]),
    ("Sydney", "Australia", &[]),
    ("Melbourne", "Australia", &[]),
    ("Auckland", "New Zealand", &[]),
    ("Toronto", "Canada", &[]),
    ("Vancouver", "Canada", &[]),
    ("Montreal", "Canada", &[]),
    ("Chicago", "United States", US),
    ("Los Angeles", "United States", US),
    ("San Francisco", "United States", US),
    ("Seattle", "United States", US),
    ("Houston", "United States", US),
    ("Rio de Janeiro", "Brazil", &[]),
    ("Sao Paulo", "Brazil", &[]),
    ("Guadalajara", "Mexico", &[]),
    ("Cancun", "Mexico", &[]),
    ("Medellin", "Colombia", &[]),
    ("Casablanca", "Morocco", &[]),
    ("Marrakesh", "Morocco", &[]),
    ("Alexandria", "Egypt", &[]),
    ("Johannesburg", "South Africa", &[]),
    ("Cape Town", "South Africa", &[]),
    ("Durban", "South Africa", &[]),
    ("Lagos", "Nigeria", &[]),
    ("Mombasa", "Kenya", &[]),
];

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::test_support::smollm2;

    const KINDS: [ControlKind; 3] = [
        ControlKind::Capital,
        ControlKind::City,
        ControlKind::Arithmetic,
    ];

    #[test]
    fn tables_are_big_distinct_and_leave_the_demonstrations_out() {
        assert!(CAPITALS.len() >= DEFAULT_POOL, "{}", CAPITALS.len());
        assert!(CITIES.len() >= DEFAULT_POOL, "{}", CITIES.len());
        let countries: BTreeSet<&str> = CAPITALS.iter().map(|c| c.0).collect();
        let capitals: BTreeSet<&str> = CAPITALS.iter().map(|c| c.1).collect();
        let cities: BTreeSet<&str> = CITIES.iter().map(|c| c.0).collect();
        assert_eq!(countries.len(), CAPITALS.len());
        assert_eq!(capitals.len(), CAPITALS.len());
        assert_eq!(cities.len(), CITIES.len());
        // The city task asks about cities that are no capital of the list.
        assert!(cities.is_disjoint(&capitals));
        for demo in ["Spain", "Japan"] {
            assert!(!countries.contains(demo));
        }
        for demo in ["Barcelona", "Osaka"] {
            assert!(!cities.contains(demo));
        }
        let slugs: BTreeSet<String> = CAPITALS.iter().map(|c| slug(c.0)).collect();
        assert_eq!(slugs.len(), CAPITALS.len());
        assert_eq!(slug("the United Kingdom"), "united_kingdom");
        assert_eq!(slug("Ho Chi Minh City"), "ho_chi_minh_city");
    }

    #[test]
    fn number_words_spell_numbers() {
        let rows = [
            (0, "zero"),
            (7, "seven"),
            (13, "thirteen"),
            (20, "twenty"),
            (42, "forty-two"),
            (99, "ninety-nine"),
            (100, "one hundred"),
            (144, "one hundred forty-four"),
            (110, "one hundred ten"),
        ];
        for (n, w) in rows {
            assert_eq!(number_words(n), w);
        }
    }

    #[test]
    fn pools_are_deterministic_distinct_and_correct() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        for kind in KINDS {
            let a = pool(kind, &enc, DEFAULT_POOL, 3).unwrap();
            assert_eq!(a.len(), DEFAULT_POOL);
            assert_eq!(a, pool(kind, &enc, DEFAULT_POOL, 3).unwrap());
            assert_ne!(a, pool(kind, &enc, DEFAULT_POOL, 4).unwrap());
            let ids: BTreeSet<&str> = a.iter().map(|e| e.id.as_str()).collect();
            assert_eq!(ids.len(), a.len());
            let demos = kind.demos();
            for ex in &a {
                assert_eq!(ex.task, kind.name());
                assert!(ex.id.starts_with(&format!("{}-", kind.name())));
                assert!(ex.support.is_empty());
                assert_eq!(ex.context_tokens, 0);
                assert!(!ex.answers.is_empty());
                let text = enc.decode(&ex.prompt).unwrap();
                assert!(text.starts_with(kind.instruction()) || enc.bos().is_some());
                assert!(text.ends_with("?\nAnswer:"), "{text}");
                // Two demonstrations, then the question, which is none of them.
                assert_eq!(text.matches("Question:").count(), 3);
                let question = text.rsplit("Question: ").next().unwrap();
                let question = question.strip_suffix("\nAnswer:").unwrap();
                assert!(!demos.iter().any(|(q, _)| q == question), "{question}");
                for (_, a) in &demos {
                    assert!(!ex.answers.contains(a), "{}: {a}", ex.id);
                }
            }
        }
        let all = pool(ControlKind::City, &enc, CITIES.len(), 0).unwrap();
        assert_eq!(all.len(), CITIES.len());
        let too_many = pool(ControlKind::Capital, &enc, CAPITALS.len() + 1, 0)
            .unwrap_err()
            .to_string();
        assert!(too_many.contains("at most"), "{too_many}");
        assert!(pool(ControlKind::Arithmetic, &enc, 0, 0)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn arithmetic_answers_are_right() {
        let Some((tok, special, ctx)) = smollm2() else {
            return;
        };
        let enc = Encoder::new(&tok, &special, ctx);
        let items = pool(ControlKind::Arithmetic, &enc, MAX_ARITHMETIC, 11).unwrap();
        let mut ops = BTreeSet::new();
        for ex in &items {
            let text = enc.decode(&ex.prompt).unwrap();
            let q = text.rsplit("Question: What is ").next().unwrap();
            let q = q.strip_suffix("?\nAnswer:").unwrap();
            let parts: Vec<&str> = q.split(' ').collect();
            let (a, b): (i64, i64) = (parts[0].parse().unwrap(), parts[2].parse().unwrap());
            let want = match parts[1] {
                "plus" => a + b,
                "minus" => a - b,
                "times" => a * b,
                op => panic!("unknown operation {op}"),
            };
            ops.insert(parts[1].to_string());
            assert!(want >= 0, "{q}");
            assert_eq!(ex.answers[0], want.to_string(), "{q}");
            assert_eq!(ex.answers.len(), 2);
            assert_eq!(ex.id, format!("control_arithmetic-{a}-{}-{b}", parts[1]));
        }
        assert_eq!(ops.len(), 3);
    }

    #[test]
    fn kinds_serialize_in_snake_case() {
        for (kind, json) in [
            (ControlKind::Capital, "\"capital\""),
            (ControlKind::City, "\"city\""),
            (ControlKind::Arithmetic, "\"arithmetic\""),
        ] {
            assert_eq!(serde_json::to_string(&kind).unwrap(), json);
            assert_eq!(serde_json::from_str::<ControlKind>(json).unwrap(), kind);
        }
    }
}
