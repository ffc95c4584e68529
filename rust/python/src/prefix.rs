//! Bindings for the prefix picture: a prompt's block hashes, and the per-engine map.

use narwhal_core::prefix::{block_hashes, PrefixMap as CoreMap};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Hashes travel between routers as little-endian u64s.
fn packed<'py>(py: Python<'py>, hashes: &[u64]) -> Bound<'py, PyBytes> {
    PyBytes::new_with(py, hashes.len() * 8, |out| {
        for (chunk, h) in out.chunks_exact_mut(8).zip(hashes) {
            chunk.copy_from_slice(&h.to_le_bytes());
        }
        Ok(())
    })
    .expect("writing into a fresh buffer cannot fail")
}

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

    /// Hashes another router packed (`packed`): the same prompt, without its text.
    #[staticmethod]
    fn unpacked(raw: &[u8]) -> PyResult<Self> {
        if raw.len() % 8 != 0 {
            return Err(PyValueError::new_err("packed block hashes are 8 bytes each"));
        }
        let hashes = raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8"))).collect();
        Ok(PromptBlocks { hashes })
    }

    /// The hashes, packed for another router.
    fn packed<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        packed(py, &self.hashes)
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

    /// The blocks held for `engine`, newest first, packed (`PromptBlocks.unpacked` of it,
    /// recorded, gives another picture the same blocks in the same order).
    fn held<'py>(&self, py: Python<'py>, engine: usize) -> Bound<'py, PyBytes> {
        let mut held = self.inner.held(engine);
        held.reverse();
        packed(py, &held)
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
