//! Bindings for the prefix picture: a prompt's block hashes, and the per-engine map.

use narwhal_core::prefix::{block_hashes, PrefixMap as CoreMap};
use pyo3::prelude::*;

/// A prompt's chained block hashes (opaque to Python: they only travel back to the map).
#[pyclass(frozen, module = "narwhal._native")]
pub struct PromptBlocks {
    hashes: Vec<u64>,
}

#[pymethods]
impl PromptBlocks {
    #[new]
    fn new(text: &[u8], block_bytes: usize, seed: u64) -> Self {
        PromptBlocks { hashes: block_hashes(text, block_bytes, seed) }
    }

    fn __len__(&self) -> usize {
        self.hashes.len()
    }
}

/// Per engine (by index), the blocks placed there, least recently used evicted first.
#[pyclass(module = "narwhal._native")]
pub struct PrefixMap {
    inner: CoreMap,
    matched: Vec<usize>,
}

#[pymethods]
impl PrefixMap {
    #[new]
    fn new(engines: usize, capacity_blocks: usize) -> Self {
        PrefixMap { inner: CoreMap::new(engines, capacity_blocks), matched: Vec::new() }
    }

    /// For each engine, how many of the prompt's leading blocks it is thought to hold.
    fn matched(&mut self, blocks: &PromptBlocks) -> Vec<usize> {
        self.inner.matched_all(&blocks.hashes, &mut self.matched);
        self.matched.clone()
    }

    /// The prompt was placed on `engine`.
    fn record(&mut self, engine: usize, blocks: &PromptBlocks) {
        self.inner.record(engine, &blocks.hashes);
    }

    /// `engine` reported holding only the prompt's first `keep` blocks.
    fn forget_after(&mut self, engine: usize, blocks: &PromptBlocks, keep: usize) {
        self.inner.forget_after(engine, &blocks.hashes, keep);
    }

    fn set_capacity(&mut self, engine: usize, capacity_blocks: usize) {
        self.inner.set_capacity(engine, capacity_blocks);
    }

    /// A new engine at the end; its index.
    fn add_engine(&mut self, capacity_blocks: usize) -> usize {
        self.inner.add_engine(capacity_blocks)
    }

    /// Blocks kept for `engine`.
    fn blocks(&self, engine: usize) -> usize {
        self.inner.len(engine)
    }

    /// Heap bytes the picture holds.
    #[getter]
    fn heap_bytes(&self) -> usize {
        self.inner.heap_bytes()
    }
}
