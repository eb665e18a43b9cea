//! SplitMix64 (Steele, Lea and Flood, 2014): the crate's one seeded generator, for trial
//! generation, random head sets, and the probe's split, initialisation, shuffling and
//! dropout. It is written out here rather than taken from `rand` so that its output is
//! fixed forever: a seed means the same trial, head set, split and training run in every
//! build, whatever `rand` version the crate is later built with.

/// SplitMix64: a 64-bit state advanced by a fixed odd increment, output through a
/// bijective mixer. The field is the raw state.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    /// A generator for `seed` in the stream named by `salt` (one salt per use, so that
    /// e.g. the needle and the haystack start of one seed are independent draws).
    pub(crate) fn new(seed: u64, salt: u64) -> Self {
        let mut g = SplitMix64(salt);
        let s = g.next_u64() ^ seed;
        SplitMix64(s)
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw from `0..n` (`n > 0`), by the multiply-shift method (bias below
    /// 2^-64 * n).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Uniform in `[0, 1)` with 24 random bits.
    pub(crate) fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Fisher-Yates shuffle in place.
    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_splitmix64_sequence() {
        // Reference outputs of splitmix64.c (Vigna) from the state 1234567.
        let mut r = SplitMix64(1_234_567);
        assert_eq!(r.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(r.next_u64(), 3_203_168_211_198_807_973);
    }

    #[test]
    fn streams_are_deterministic_and_distinct() {
        let draws = |seed, salt| {
            let mut r = SplitMix64::new(seed, salt);
            (0..4).map(|_| r.next_u64()).collect::<Vec<u64>>()
        };
        assert_eq!(draws(7, 0), draws(7, 0));
        assert_ne!(draws(7, 0), draws(7, 1));
        let mut r = SplitMix64::new(3, 0);
        assert!((0..1000).all(|_| (0.0..1.0).contains(&r.next_f32())));
        let mut v: Vec<usize> = (0..50).collect();
        r.shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(v, sorted);
    }
}
