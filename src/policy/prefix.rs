//! Shared prompt prefixes, prefilled and compressed once: a long document asked many
//! questions is prefilled under a policy once, and later requests under the same policy
//! whose prompts start with it continue from its per-head cache.
//!
//! A [`Prefix`] holds a whole number of the model's prefill chunks (a streaming
//! prefill taken at its deepest multiple of [`prefix_grain`]), so a request continued
//! from it runs the rest of its prompt in exactly the chunks a cold prefill would: its
//! tokens are the same bits. Only policies that stream their prefill share prefixes (a press decides
//! what to keep from the whole prompt, so its result does not continue). The
//! [`PrefixCache`] keeps prefixes per policy under a byte cap, evicting the least
//! recently used that no running sequence reads. A prefix's rows are shared
//! copy-on-write ([`HeadCache::share`]): a hit reads them in place and appends its own
//! positions after them (a ring, rewritten as it turns, is the one part it copies).

use crate::model::HeadCache;

/// Prefixes are kept at multiples of about this many positions: with small prefill
/// chunks (one position, when prompts run as decode steps), every position could be
/// shared, and a prompt's own question would end its prefix.
pub const PREFIX_GRAIN: usize = 256;

/// The spacing of the points where a prefill with chunks of `chunk` positions can be
/// shared: the smallest multiple of `chunk` not below [`PREFIX_GRAIN`].
pub fn prefix_grain(chunk: usize) -> usize {
    PREFIX_GRAIN.div_ceil(chunk.max(1)) * chunk.max(1)
}

/// A prefilled prompt prefix under one policy.
#[derive(Debug, Clone)]
pub struct Prefix {
    /// The prefix's tokens (positions `0..tokens.len()`).
    pub tokens: Vec<u32>,
    /// The per-head cache holding them, no top-k restriction set.
    pub cache: HeadCache,
    /// The final hidden state `(d_model,)` of the last position, for a probe.
    pub hidden: Option<Vec<f32>>,
}

impl Prefix {
    /// Bytes its cache holds.
    pub fn bytes(&self) -> usize {
        self.cache.bytes().total()
    }

    /// Whether another cache reads its rows (a sequence that continued it, or the one
    /// that offered it): evicting it then would free nothing.
    pub fn in_use(&self) -> bool {
        self.cache.shared_bytes().total() > 0
    }
}

struct Entry {
    policy: String,
    prefix: Prefix,
    last_use: u64,
}

/// Prefixes of several policies under a byte cap, least recently used evicted first.
#[derive(Default)]
pub struct PrefixCache {
    cap: usize,
    entries: Vec<Entry>,
    clock: u64,
}

impl PrefixCache {
    /// An empty cache that holds at most `cap` bytes of prefixes (0: holds none).
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            entries: Vec::new(),
            clock: 0,
        }
    }

    /// The longest prefix of `policy` that `prompt` starts with, if any: a clone that
    /// reads the kept rows in place.
    pub fn lookup(&mut self, policy: &str, prompt: &[u32]) -> Option<Prefix> {
        self.clock += 1;
        let clock = self.clock;
        let best = self.best(policy, prompt)?;
        let entry = &mut self.entries[best];
        entry.last_use = clock;
        Some(entry.prefix.clone())
    }

    /// The prefix [`PrefixCache::lookup`] would return, seen in place (no clone, its use
    /// not recorded): e.g. to size a request's reservation before it is admitted.
    pub fn peek(&self, policy: &str, prompt: &[u32]) -> Option<&Prefix> {
        self.best(policy, prompt).map(|i| &self.entries[i].prefix)
    }

    /// The entry of the longest prefix of `policy` that `prompt` starts with.
    fn best(&self, policy: &str, prompt: &[u32]) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.policy == policy && prompt.starts_with(&e.prefix.tokens))
            .max_by_key(|(_, e)| e.prefix.tokens.len())
            .map(|(i, _)| i)
    }

    /// Keep `prefix` of `policy`, evicting the least recently used prefixes that no
    /// sequence reads until it fits; one that does not fit then is not kept (nor one
    /// whose tokens are kept already: that entry is marked used instead).
    pub fn insert(&mut self, policy: &str, prefix: Prefix) {
        self.clock += 1;
        let clock = self.clock;
        if let Some(same) = self
            .entries
            .iter_mut()
            .find(|e| e.policy == policy && e.prefix.tokens == prefix.tokens)
        {
            same.last_use = clock;
            return;
        }
        let held: usize = self
            .entries
            .iter()
            .filter(|e| e.prefix.in_use())
            .map(|e| e.prefix.bytes())
            .sum();
        if held + prefix.bytes() > self.cap {
            return;
        }
        while self.bytes() + prefix.bytes() > self.cap {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| !e.prefix.in_use())
                .min_by_key(|(_, e)| e.last_use)
                .map(|(i, _)| i)
            else {
                return;
            };
            self.entries.swap_remove(oldest);
        }
        self.entries.push(Entry {
            policy: policy.to_string(),
            prefix,
            last_use: self.clock,
        });
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.prefix.bytes()).sum()
    }

    /// Prefixes held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::tests::tiny;
    use crate::model::{Retention, RowFormat};

    fn prefix(tokens: &[u32]) -> Prefix {
        let cfg = tiny();
        let retention = vec![Retention::Full; cfg.n_layers * cfg.n_kv_heads];
        Prefix {
            tokens: tokens.to_vec(),
            cache: HeadCache::new(&cfg, &retention, RowFormat::F32, tokens.len()).unwrap(),
            hidden: None,
        }
    }

    #[test]
    fn prefixes_are_shared_at_whole_chunks_near_the_grain() {
        assert_eq!(prefix_grain(1), 256);
        assert_eq!(prefix_grain(256), 256);
        assert_eq!(prefix_grain(100), 300);
        assert_eq!(prefix_grain(512), 512);
    }

    #[test]
    fn the_longest_matching_prefix_of_the_same_policy_is_found() {
        let mut cache = PrefixCache::new(usize::MAX);
        cache.insert("a", prefix(&[1, 2]));
        cache.insert("a", prefix(&[1, 2, 3, 4]));
        cache.insert("b", prefix(&[1, 2, 3, 4, 5]));
        cache.insert("a", prefix(&[9, 9, 9]));
        let hit = cache.lookup("a", &[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(hit.tokens, [1, 2, 3, 4]);
        assert_eq!(cache.lookup("a", &[1, 2, 7]).unwrap().tokens, [1, 2]);
        assert!(cache.lookup("a", &[2, 1]).is_none());
        assert!(cache.lookup("c", &[1, 2, 3]).is_none());
        // The same tokens again replace their entry.
        cache.insert("a", prefix(&[1, 2]));
        assert_eq!(cache.len(), 4);
    }

    /// `prefix(tokens)` with every position stored and shared, as a prefill offers it.
    fn shared(tokens: &[u32]) -> Prefix {
        let mut p = prefix(tokens);
        let cfg = tiny();
        for pos in 0..tokens.len() {
            for layer in 0..cfg.n_layers {
                for h in 0..cfg.n_kv_heads {
                    let row = vec![pos as f32; cfg.d_head];
                    p.cache.store_mut(layer, h).push(pos, &row, &row);
                }
            }
            p.cache.commit(1);
        }
        p.cache.share();
        p
    }

    #[test]
    fn a_prefix_a_sequence_reads_is_not_evicted_and_is_not_copied() {
        let one = shared(&[1; 8]).bytes();
        let mut cache = PrefixCache::new(one);
        cache.insert("a", shared(&[1; 8]));
        let peeked = cache
            .peek("a", &[1; 9])
            .unwrap()
            .cache
            .bytes_behind_shares();
        assert!(
            !cache.peek("a", &[1; 9]).unwrap().in_use(),
            "a peek holds nothing"
        );
        let reader = cache.lookup("a", &[1; 9]).unwrap();
        // The hit reads the kept rows: nothing of it is its own.
        assert_eq!(reader.cache.shared_bytes(), reader.cache.bytes());
        assert_eq!(reader.cache.shared_bytes(), peeked);
        // In use: a newer prefix does not evict it, and is not kept.
        cache.insert("a", shared(&[2; 8]));
        assert!(cache.lookup("a", &[2; 9]).is_none());
        assert!(cache.lookup("a", &[1; 9]).is_some());
        // Once its reader is gone it goes first.
        drop(reader);
        cache.insert("a", shared(&[2; 8]));
        assert!(cache.lookup("a", &[2; 9]).is_some());
        assert!(cache.lookup("a", &[1; 9]).is_none());
        assert!(cache.bytes() <= one);
    }

    #[test]
    fn the_least_recently_used_prefix_goes_first_and_the_cap_holds() {
        let one = prefix(&[1; 8]).bytes();
        let mut cache = PrefixCache::new(2 * one);
        cache.insert("a", prefix(&[1; 8]));
        cache.insert("a", prefix(&[2; 8]));
        assert!(cache.lookup("a", &[1; 9]).is_some());
        cache.insert("a", prefix(&[3; 8]));
        assert_eq!(cache.len(), 2);
        assert!(cache.bytes() <= 2 * one);
        assert!(
            cache.lookup("a", &[2; 9]).is_none(),
            "[2; 8] was the oldest in use"
        );
        assert!(cache.lookup("a", &[1; 9]).is_some());
        // Larger than the whole cap: not kept; a cap of 0 keeps nothing.
        cache.insert("a", prefix(&[4; 40]));
        assert!(cache.lookup("a", &[4; 41]).is_none());
        let mut off = PrefixCache::new(0);
        off.insert("a", prefix(&[1; 8]));
        assert!(off.is_empty());
    }
}
