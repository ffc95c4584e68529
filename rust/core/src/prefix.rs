//! The router's picture of what each engine holds in its prefix cache.
//!
//! A prompt is cut into fixed-size blocks of its text bytes, and each block gets a hash
//! chained on the one before it, as the engines chain their KV blocks: equal leading hashes
//! mean an equal leading text, whatever the dialect or tokenizer. Per engine a bounded LRU
//! keeps the blocks the router placed there; a new prompt's expected cache hit on an engine
//! is the run of its leading blocks that engine still holds.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

const K0: u64 = 0x9E37_79B9_7F4A_7C15;
const K1: u64 = 0xC2B2_AE3D_27D4_EB4F;

#[inline]
fn mix(h: u64, w: u64) -> u64 {
    let x = (h ^ w).wrapping_mul(K1);
    (x ^ (x >> 29)).rotate_left(23).wrapping_mul(K0)
}

/// One block's hash, chained on the previous block's (`seed` for the first).
fn block_hash(prev: u64, block: &[u8]) -> u64 {
    let mut h = mix(prev, block.len() as u64);
    let mut words = block.chunks_exact(8);
    for w in &mut words {
        h = mix(h, u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut tail = [0u8; 8];
        tail[..rest.len()].copy_from_slice(rest);
        h = mix(h, u64::from_le_bytes(tail));
    }
    h ^ (h >> 31)
}

/// The chained hashes of `text`'s whole blocks of `block` bytes (a trailing partial block is
/// never cached by an engine, so it has no hash). `seed` keeps the hashes private to one
/// router process: a client cannot aim a collision at a family it does not own.
pub fn block_hashes(text: &[u8], block: usize, seed: u64) -> Vec<u64> {
    let block = block.max(1);
    let mut out = Vec::with_capacity(text.len() / block);
    let mut h = seed;
    for b in text.chunks_exact(block) {
        h = block_hash(h, b);
        out.push(h);
    }
    out
}

/// The keys are hashes already: no second hashing.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Blocks = HashMap<u64, u64, BuildHasherDefault<Identity>>;

/// One engine's blocks, least recently used first out. `order` may hold stale entries (a
/// block touched again later); they are skipped at eviction and compacted away.
struct Lru {
    last_use: Blocks,
    order: VecDeque<(u64, u64)>,
    capacity: usize,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Lru { last_use: Blocks::default(), order: VecDeque::new(), capacity }
    }

    fn touch(&mut self, hash: u64, tick: u64) {
        match self.last_use.entry(hash) {
            Entry::Occupied(mut e) => {
                e.insert(tick);
            }
            Entry::Vacant(e) => {
                e.insert(tick);
            }
        }
        self.order.push_back((tick, hash));
    }

    fn evict(&mut self) {
        while self.last_use.len() > self.capacity {
            let Some((tick, hash)) = self.order.pop_front() else { break };
            if self.last_use.get(&hash) == Some(&tick) {
                self.last_use.remove(&hash);
            }
        }
        if self.order.len() > 2 * self.last_use.len() + 64 {
            let last_use = &self.last_use;
            self.order.retain(|(tick, hash)| last_use.get(hash) == Some(tick));
        }
    }
}

/// Per engine, the blocks placed there, bounded by what the engine can hold.
pub struct PrefixMap {
    engines: Vec<Lru>,
    tick: u64,
}

impl PrefixMap {
    pub fn new(engines: usize, capacity_blocks: usize) -> Self {
        PrefixMap { engines: (0..engines).map(|_| Lru::new(capacity_blocks)).collect(), tick: 0 }
    }

    pub fn engines(&self) -> usize {
        self.engines.len()
    }

    /// An engine added at the end (the fleet grew); its picture starts empty.
    pub fn add_engine(&mut self, capacity_blocks: usize) -> usize {
        self.engines.push(Lru::new(capacity_blocks));
        self.engines.len() - 1
    }

    pub fn set_capacity(&mut self, engine: usize, capacity_blocks: usize) {
        if let Some(lru) = self.engines.get_mut(engine) {
            lru.capacity = capacity_blocks;
            lru.evict();
        }
    }

    /// How many of `hashes`' leading blocks `engine` is thought to hold.
    pub fn matched(&self, engine: usize, hashes: &[u64]) -> usize {
        let Some(lru) = self.engines.get(engine) else { return 0 };
        hashes.iter().take_while(|h| lru.last_use.contains_key(h)).count()
    }

    /// `matched` for every engine, in order.
    pub fn matched_all(&self, hashes: &[u64], out: &mut Vec<usize>) {
        out.clear();
        out.extend((0..self.engines.len()).map(|e| self.matched(e, hashes)));
    }

    /// The prompt was placed on `engine`: its blocks are there now, most recently used.
    pub fn record(&mut self, engine: usize, hashes: &[u64]) {
        let Some(lru) = self.engines.get_mut(engine) else { return };
        self.tick += 1;
        // Deepest first into the queue, so a chain is evicted from its tail, as engines do:
        // what stays is still a leading run.
        for &h in hashes.iter().rev() {
            lru.touch(h, self.tick);
        }
        lru.evict();
    }

    /// The engine reported holding only the first `keep` blocks of this prompt: the rest
    /// are gone from it (evicted, or never cached), whatever the picture said.
    pub fn forget_after(&mut self, engine: usize, hashes: &[u64], keep: usize) {
        let Some(lru) = self.engines.get_mut(engine) else { return };
        for h in hashes.iter().skip(keep) {
            lru.last_use.remove(h);
        }
    }

    /// Blocks kept for `engine`.
    /// The blocks held for `engine`, least recently used first (what another router's
    /// picture is given to start from: `record`ed newest first, it keeps this order).
    pub fn held(&self, engine: usize) -> Vec<u64> {
        let Some(lru) = self.engines.get(engine) else { return Vec::new() };
        let mut out = Vec::with_capacity(lru.last_use.len());
        out.extend(lru.order.iter().filter(|(tick, hash)| lru.last_use.get(hash) == Some(tick)).map(|&(_, hash)| hash));
        out
    }

    pub fn len(&self, engine: usize) -> usize {
        self.engines.get(engine).map_or(0, |l| l.last_use.len())
    }

    pub fn is_empty(&self) -> bool {
        self.engines.iter().all(|l| l.last_use.is_empty())
    }

    /// Bytes the picture holds on the heap (tables and queues at their capacity).
    pub fn heap_bytes(&self) -> usize {
        self.engines
            .iter()
            .map(|l| {
                // hashbrown: one control byte and one (key, value) slot per bucket.
                l.last_use.capacity() * (16 + 1) + l.order.capacity() * 16
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(words: &[&str]) -> Vec<u8> {
        words.join(" ").into_bytes()
    }

    #[test]
    fn equal_leading_text_is_equal_leading_hashes() {
        let a = text(&["sys"; 100]);
        let mut b = a.clone();
        b.extend_from_slice(b" and then something else entirely, long enough for blocks");
        let ha = block_hashes(&a, 16, 7);
        let hb = block_hashes(&b, 16, 7);
        assert_eq!(ha.len(), a.len() / 16);
        assert_eq!(&hb[..ha.len()], &ha[..]);
        assert!(hb.len() > ha.len());
    }

    #[test]
    fn a_changed_byte_changes_its_block_and_every_later_one() {
        let a = vec![b'x'; 64];
        let mut b = a.clone();
        b[20] = b'y';
        let ha = block_hashes(&a, 16, 1);
        let hb = block_hashes(&b, 16, 1);
        assert_eq!(ha[0], hb[0]);
        assert!(ha[1..].iter().zip(&hb[1..]).all(|(x, y)| x != y));
    }

    #[test]
    fn equal_blocks_at_other_places_hash_apart() {
        // The chain: a block's hash depends on everything before it.
        let h = block_hashes(&[b'a'; 48], 16, 0);
        assert_ne!(h[0], h[1]);
        assert_ne!(h[1], h[2]);
    }

    #[test]
    fn the_seed_keeps_hashes_private() {
        assert_ne!(block_hashes(b"0123456789abcdef", 16, 1), block_hashes(b"0123456789abcdef", 16, 2));
    }

    #[test]
    fn matched_counts_the_leading_run_only() {
        let mut m = PrefixMap::new(2, 100);
        m.record(0, &[1, 2, 3]);
        assert_eq!(m.matched(0, &[1, 2, 3, 4]), 3);
        assert_eq!(m.matched(0, &[1, 9, 3]), 1);
        assert_eq!(m.matched(1, &[1, 2, 3]), 0);
        let mut all = Vec::new();
        m.matched_all(&[1, 2], &mut all);
        assert_eq!(all, vec![2, 0]);
    }

    #[test]
    fn the_least_recently_used_blocks_go_first() {
        let mut m = PrefixMap::new(1, 4);
        m.record(0, &[1, 2]);
        m.record(0, &[3, 4]);
        m.record(0, &[1, 2]); // used again: now the newest
        m.record(0, &[5, 6]); // over capacity: 3 and 4 go
        assert_eq!(m.len(0), 4);
        assert_eq!(m.matched(0, &[1, 2]), 2);
        assert_eq!(m.matched(0, &[3]), 0);
        assert_eq!(m.matched(0, &[5, 6]), 2);
    }

    #[test]
    fn a_chain_is_evicted_from_its_tail() {
        let mut m = PrefixMap::new(1, 3);
        m.record(0, &[1, 2, 3]);
        m.record(0, &[7]);
        assert_eq!(m.matched(0, &[1, 2, 3]), 2);
    }

    #[test]
    fn held_blocks_recorded_newest_first_keep_their_order() {
        let mut m = PrefixMap::new(1, 6);
        m.record(0, &[1, 2]);
        m.record(0, &[3, 4]);
        m.record(0, &[1, 2]);
        let held = m.held(0);
        assert_eq!(held.len(), 4);
        assert_eq!(&held[2..], &[2, 1]); // used last; a chain's head is the newest
        let mut copy = PrefixMap::new(1, 6);
        let newest_first: Vec<u64> = held.iter().rev().copied().collect();
        copy.record(0, &newest_first);
        assert_eq!(copy.held(0), held);
        copy.record(0, &[5, 6, 7, 8]); // over capacity: the least recently used go first
        assert_eq!(copy.matched(0, &[3]), 0);
        assert_eq!(copy.matched(0, &[1, 2]), 2);
    }

    #[test]
    fn stale_order_entries_are_compacted() {
        let mut m = PrefixMap::new(1, 8);
        for _ in 0..10_000 {
            m.record(0, &[1, 2, 3]);
        }
        assert_eq!(m.len(0), 3);
        assert!(m.engines[0].order.len() < 200);
    }

    #[test]
    fn a_report_of_fewer_cached_blocks_corrects_the_picture() {
        let mut m = PrefixMap::new(1, 100);
        m.record(0, &[1, 2, 3, 4]);
        m.forget_after(0, &[1, 2, 3, 4], 1);
        assert_eq!(m.matched(0, &[1, 2, 3, 4]), 1);
    }

    #[test]
    fn capacity_shrinks_evict_at_once() {
        let mut m = PrefixMap::new(1, 10);
        m.record(0, &[1, 2, 3, 4, 5]);
        m.set_capacity(0, 2);
        assert_eq!(m.len(0), 2);
        assert_eq!(m.matched(0, &[1, 2, 3, 4, 5]), 2);
    }
}
