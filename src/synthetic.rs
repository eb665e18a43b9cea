//! Deterministic synthetic text: the long prompts of the speed benchmark and of the
//! parity checks, the same on every machine.

/// Deterministic filler: `n` numbered notes of ~17 tokens each, with an optional needle
/// sentence after note `needle_after`.
pub fn synthetic_notes(n: usize, needle_after: Option<usize>) -> String {
    const CITIES: &[&str] = &[
        "Lisbon", "Oslo", "Kyoto", "Lima", "Cairo", "Dublin", "Quito", "Perth", "Turin", "Hanoi",
    ];
    const THINGS: &[&str] = &[
        "a red bicycle",
        "an old clock",
        "a blue kite",
        "a wooden boat",
        "a silver key",
        "a paper lamp",
        "a glass bird",
        "a green hat",
    ];
    let mut text = String::new();
    for i in 0..n {
        let city = CITIES[(i * 7) % CITIES.len()];
        let thing = THINGS[(i * 3) % THINGS.len()];
        text.push_str(&format!(
            "Note {}: In {city}, a traveller found {thing} near the market on day {}.\n",
            i + 1,
            (i * 13) % 31 + 1
        ));
        if Some(i) == needle_after {
            text.push_str("Note 51b: The secret number of the archive is 4817.\n");
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_deterministic_and_hold_the_needle_once() {
        let a = synthetic_notes(60, Some(50));
        assert_eq!(a, synthetic_notes(60, Some(50)));
        assert_eq!(a.matches("4817").count(), 1);
        assert_eq!(a.lines().count(), 61);
    }
}
