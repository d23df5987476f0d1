//! A map from global vertex id to a dense index, in the representation its size calls for:
//! an array over the whole graph when it holds a good part of it (one load per lookup, no
//! hashing), a hash map sized to its entries when it holds a small part (a mini-batch of a
//! large graph: no array of |V| allocated and cleared per step).

/// Global id -> index (see the module doc).
pub(crate) enum IdMap {
    /// `slots[v]`, `u32::MAX` for absent.
    Dense(Vec<u32>),
    Hash(rustc_hash::FxHashMap<u32, u32>),
}

impl IdMap {
    /// For about `expected` entries over a graph of `n` vertices: dense from a quarter of the
    /// graph on, where the array costs at most 4x the map's entries and every lookup is one load.
    pub(crate) fn for_size(expected: usize, n: usize) -> IdMap {
        if expected.saturating_mul(4) >= n {
            IdMap::Dense(vec![u32::MAX; n])
        } else {
            let mut m = rustc_hash::FxHashMap::default();
            m.reserve(expected);
            IdMap::Hash(m)
        }
    }

    /// Maps `v` to `index` unless it is mapped already; whether it was new.
    pub(crate) fn insert_new(&mut self, v: u32, index: u32) -> bool {
        match self {
            IdMap::Dense(slots) => {
                let slot = &mut slots[v as usize];
                let new = *slot == u32::MAX;
                if new {
                    *slot = index;
                }
                new
            }
            IdMap::Hash(m) => match m.entry(v) {
                std::collections::hash_map::Entry::Occupied(_) => false,
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(index);
                    true
                }
            },
        }
    }

    pub(crate) fn get(&self, v: u32) -> Option<u32> {
        match self {
            IdMap::Dense(slots) => slots.get(v as usize).copied().filter(|&i| i != u32::MAX),
            IdMap::Hash(m) => m.get(&v).copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::IdMap;

    #[test]
    fn both_representations_map_alike() {
        for mut m in [IdMap::for_size(10, 20), IdMap::for_size(1, 1000)] {
            assert!(matches!(m, IdMap::Dense(_)) || matches!(m, IdMap::Hash(_)));
            assert!(m.insert_new(7, 0));
            assert!(m.insert_new(3, 1));
            assert!(!m.insert_new(7, 5));
            assert_eq!(m.get(7), Some(0));
            assert_eq!(m.get(3), Some(1));
            assert_eq!(m.get(4), None);
        }
        assert!(matches!(IdMap::for_size(10, 20), IdMap::Dense(_)));
        assert!(matches!(IdMap::for_size(1, 1000), IdMap::Hash(_)));
    }
}
