//! Kernels compiled once per source: a bounded cache keyed by the blake3 hash of a
//! task's shader source and entry point, shared by everything on a node that needs
//! a [`Kernel`] (the API validating a submit, the worker running its shards). Parsing
//! and validating WGSL with naga costs milliseconds; a mesh running one kernel over
//! many tasks pays it once per node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gpumesh_protocol::ShaderSource;

use crate::error::Result;
use crate::kernel::Kernel;

/// How many compiled kernels a node keeps by default.
pub const DEFAULT_CAPACITY: usize = 64;

/// Compiled kernels by source hash; the least recently used goes first when full.
pub struct KernelCache {
    capacity: usize,
    inner: Mutex<Entries>,
}

#[derive(Default)]
struct Entries {
    by_key: HashMap<[u8; 32], (Arc<Kernel>, u64)>,
    /// A counter that orders uses, for eviction.
    clock: u64,
    compiled: u64,
}

impl Default for KernelCache {
    fn default() -> Self {
        KernelCache::new(DEFAULT_CAPACITY)
    }
}

impl KernelCache {
    pub fn new(capacity: usize) -> Self {
        KernelCache {
            capacity: capacity.max(1),
            inner: Mutex::default(),
        }
    }

    /// What a kernel is cached under: the hash of its source kind, text and entry
    /// point, each length-prefixed so no two different pairs collide by concatenation.
    pub fn key(source: &ShaderSource, entry_point: &str) -> [u8; 32] {
        let (kind, text) = match source {
            ShaderSource::Wgsl(text) => (0u8, text.as_str()),
            ShaderSource::Builtin(name) => (1u8, name.as_str()),
        };
        let mut hasher = blake3::Hasher::new();
        hasher.update(&[kind]);
        hasher.update(&(text.len() as u64).to_le_bytes());
        hasher.update(text.as_bytes());
        hasher.update(&(entry_point.len() as u64).to_le_bytes());
        hasher.update(entry_point.as_bytes());
        *hasher.finalize().as_bytes()
    }

    /// The compiled kernel for `source` at `entry_point`, compiling it on first use.
    /// A source that does not compile is not cached: its error comes back each time.
    pub fn get(&self, source: &ShaderSource, entry_point: &str) -> Result<Arc<Kernel>> {
        let key = Self::key(source, entry_point);
        if let Some(kernel) = self.lookup(&key) {
            return Ok(kernel);
        }
        // Compiled outside the lock: two first uses at once may both compile, and
        // the second result replaces the first; neither waits on the other.
        let kernel = Arc::new(Kernel::for_source(source, entry_point)?);
        let mut entries = self.lock();
        entries.compiled += 1;
        entries.clock += 1;
        let now = entries.clock;
        if entries.by_key.len() >= self.capacity && !entries.by_key.contains_key(&key) {
            let oldest = entries
                .by_key
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k);
            if let Some(oldest) = oldest {
                entries.by_key.remove(&oldest);
            }
        }
        entries.by_key.insert(key, (kernel.clone(), now));
        Ok(kernel)
    }

    /// How many compiles this cache has done (a hit compiles nothing).
    pub fn compiled(&self) -> u64 {
        self.lock().compiled
    }

    /// Kernels held now.
    pub fn len(&self) -> usize {
        self.lock().by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lookup(&self, key: &[u8; 32]) -> Option<Arc<Kernel>> {
        let mut entries = self.lock();
        entries.clock += 1;
        let now = entries.clock;
        let (kernel, used) = entries.by_key.get_mut(key)?;
        *used = now;
        Some(kernel.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        // A panic while holding the lock leaves plain data behind, still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wgsl(n: u32) -> ShaderSource {
        ShaderSource::Wgsl(format!(
            "@group(0) @binding(0) var<storage, read_write> out: array<u32>;\n\
             @compute @workgroup_size(64) fn main(@builtin(global_invocation_id) id: vec3<u32>) {{\n\
                 if (id.x < arrayLength(&out)) {{ out[id.x] = id.x + {n}u; }}\n\
             }}\n"
        ))
    }

    #[test]
    fn one_source_compiles_once_and_each_source_its_own_kernel() {
        let cache = KernelCache::new(8);
        let first = cache.get(&wgsl(1), "main").unwrap();
        let again = cache.get(&wgsl(1), "main").unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(cache.compiled(), 1);
        let other = cache.get(&wgsl(2), "main").unwrap();
        assert!(!Arc::ptr_eq(&first, &other));
        let builtin = cache
            .get(&ShaderSource::Builtin("vector_add".into()), "main")
            .unwrap();
        assert!(!Arc::ptr_eq(&first, &builtin));
        assert_eq!(cache.compiled(), 3);
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn errors_are_not_cached_and_name_the_problem() {
        let cache = KernelCache::new(8);
        let bad = ShaderSource::Wgsl("fn main( {".into());
        assert!(cache.get(&bad, "main").is_err());
        assert!(cache.get(&bad, "main").is_err());
        let missing = cache.get(&wgsl(1), "nope").unwrap_err().to_string();
        assert!(missing.contains("nope"), "{missing}");
        assert!(cache.is_empty());
    }

    #[test]
    fn the_least_recently_used_kernel_goes_first_when_full() {
        let cache = KernelCache::new(2);
        cache.get(&wgsl(1), "main").unwrap();
        cache.get(&wgsl(2), "main").unwrap();
        cache.get(&wgsl(1), "main").unwrap(); // 1 is now newer than 2
        cache.get(&wgsl(3), "main").unwrap(); // evicts 2
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.compiled(), 3);
        cache.get(&wgsl(1), "main").unwrap();
        assert_eq!(cache.compiled(), 3, "1 stayed");
        cache.get(&wgsl(2), "main").unwrap();
        assert_eq!(cache.compiled(), 4, "2 was evicted and compiled again");
    }

    #[test]
    fn keys_do_not_collide_by_concatenation() {
        let a = KernelCache::key(&ShaderSource::Wgsl("ab".into()), "c");
        let b = KernelCache::key(&ShaderSource::Wgsl("a".into()), "bc");
        let c = KernelCache::key(&ShaderSource::Builtin("ab".into()), "c");
        assert_ne!(a, b);
        assert_ne!(a, c);
    }
}
