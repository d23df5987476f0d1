//! A map from global vertex id to a dense index, in the representation its size calls for:
//! an array over the whole graph when it holds a good part of it (one load per lookup, no
//! hashing); a smaller part — a mini-batch of a products-sized graph — an array over the
//! graph reused across the maps of one thread, whose entries count only when stamped with
//! the map's stamp (so no map allocates or clears |V| entries: a step's cost stays its own);
//! a hash map sized to its entries when it holds a tiny part (a mini-batch of a 100M-vertex
//! graph, where even a reused array per thread would cost more memory than it saves).
//! Samplers number the vertices they reach with it too.

use std::cell::RefCell;

/// Global id -> index (see the module doc).
pub enum IdMap {
    /// `slots[v]`, `u32::MAX` for absent.
    Dense(Vec<u32>),
    Stamped(Stamped),
    Hash(rustc_hash::FxHashMap<u32, u32>),
}

/// `slots[v] = (stamp, index)`, present when `stamp` is this map's; the array goes back to
/// its thread's pool when the map is dropped.
pub struct Stamped {
    slots: Vec<(u32, u32)>,
    stamp: u32,
}

/// An array of a dropped [`Stamped`] map and its last stamp.
type KeptArray = (Vec<(u32, u32)>, u32);

thread_local! {
    /// Arrays of dropped [`Stamped`] maps, for the thread's next maps.
    static STAMPED: RefCell<Vec<KeptArray>> = const { RefCell::new(Vec::new()) };
}

/// Arrays a thread keeps: a step's sample, extraction and plan hold three at once.
const STAMPED_KEPT: usize = 4;

impl Stamped {
    /// A map over ids below `n` on a kept array of this thread (the smallest that covers
    /// them), or a new one.
    fn take(n: usize) -> Stamped {
        let kept = STAMPED
            .try_with(|pool| {
                let mut pool = pool.borrow_mut();
                let (i, _) = pool
                    .iter()
                    .enumerate()
                    .filter(|(_, (slots, _))| slots.len() >= n)
                    .min_by_key(|(_, (slots, _))| slots.len())?;
                Some(pool.swap_remove(i))
            })
            .ok()
            .flatten();
        let (mut slots, last) = kept.unwrap_or_else(|| (vec![(0, 0); n], 0));
        let stamp = last.wrapping_add(1);
        if stamp == 0 {
            // After 2^32 - 1 maps a stamp comes round again: start the array afresh.
            slots.fill((0, 0));
            return Stamped { slots, stamp: 1 };
        }
        Stamped { slots, stamp }
    }
}

impl Drop for Stamped {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        let stamp = self.stamp;
        let _ = STAMPED.try_with(|pool| {
            let mut pool = pool.borrow_mut();
            if pool.len() < STAMPED_KEPT {
                pool.push((slots, stamp));
            }
        });
    }
}

impl IdMap {
    /// For about `expected` entries over a graph of `n` vertices: dense from a quarter of the
    /// graph on, where the array costs at most 4x the map's entries and every lookup is one
    /// load; stamped from a sixteenth (a thread keeps at most two arrays, each at most 16x the
    /// entries of a map it serves); hashed below.
    pub fn for_size(expected: usize, n: usize) -> IdMap {
        if expected.saturating_mul(4) >= n {
            IdMap::Dense(vec![u32::MAX; n])
        } else if expected.saturating_mul(16) >= n {
            IdMap::Stamped(Stamped::take(n))
        } else {
            let mut m = rustc_hash::FxHashMap::default();
            m.reserve(expected);
            IdMap::Hash(m)
        }
    }

    /// Maps `v` to `index` unless it is mapped already; whether it was new.
    pub fn insert_new(&mut self, v: u32, index: u32) -> bool {
        match self {
            IdMap::Dense(slots) => {
                let slot = &mut slots[v as usize];
                let new = *slot == u32::MAX;
                if new {
                    *slot = index;
                }
                new
            }
            IdMap::Stamped(Stamped { slots, stamp }) => {
                let slot = &mut slots[v as usize];
                let new = slot.0 != *stamp;
                if new {
                    *slot = (*stamp, index);
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

    /// The index of `v`, mapping it to `index` first if it has none.
    pub fn get_or_insert(&mut self, v: u32, index: u32) -> u32 {
        match self {
            IdMap::Dense(slots) => {
                let slot = &mut slots[v as usize];
                if *slot == u32::MAX {
                    *slot = index;
                }
                *slot
            }
            IdMap::Stamped(Stamped { slots, stamp }) => {
                let slot = &mut slots[v as usize];
                if slot.0 != *stamp {
                    *slot = (*stamp, index);
                }
                slot.1
            }
            IdMap::Hash(m) => *m.entry(v).or_insert(index),
        }
    }

    /// Maps `v` to `index`, replacing what it was mapped to.
    pub fn set(&mut self, v: u32, index: u32) {
        match self {
            IdMap::Dense(slots) => slots[v as usize] = index,
            IdMap::Stamped(Stamped { slots, stamp }) => slots[v as usize] = (*stamp, index),
            IdMap::Hash(m) => {
                m.insert(v, index);
            }
        }
    }

    /// Prefetches the entry of `v` (a walk over scattered ids asks a few ids ahead, so the
    /// cache misses overlap); nothing for the hashed map, whose slot is not known up front.
    #[inline(always)]
    pub fn prefetch(&self, v: u32) {
        match self {
            IdMap::Dense(slots) => {
                if let Some(s) = slots.get(v as usize) {
                    grandis_store::prefetch(s);
                }
            }
            IdMap::Stamped(Stamped { slots, .. }) => {
                if let Some(s) = slots.get(v as usize) {
                    grandis_store::prefetch(s);
                }
            }
            IdMap::Hash(_) => {}
        }
    }

    pub fn get(&self, v: u32) -> Option<u32> {
        match self {
            IdMap::Dense(slots) => slots.get(v as usize).copied().filter(|&i| i != u32::MAX),
            IdMap::Stamped(Stamped { slots, stamp }) => slots
                .get(v as usize)
                .filter(|slot| slot.0 == *stamp)
                .map(|slot| slot.1),
            IdMap::Hash(m) => m.get(&v).copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::IdMap;

    #[test]
    fn every_representation_maps_alike() {
        for mut m in [
            IdMap::for_size(10, 20),
            IdMap::for_size(100, 1000),
            IdMap::for_size(1, 1000),
        ] {
            assert!(m.insert_new(7, 0));
            assert!(m.insert_new(3, 1));
            assert!(!m.insert_new(7, 5));
            assert_eq!(m.get(7), Some(0));
            assert_eq!(m.get(3), Some(1));
            assert_eq!(m.get(4), None);
            m.set(7, 9);
            m.set(4, 2);
            assert_eq!((m.get(7), m.get(4), m.get(3)), (Some(9), Some(2), Some(1)));
        }
        assert!(matches!(IdMap::for_size(10, 20), IdMap::Dense(_)));
        assert!(matches!(IdMap::for_size(100, 1000), IdMap::Stamped(_)));
        assert!(matches!(IdMap::for_size(1, 1000), IdMap::Hash(_)));
    }

    /// A stamped map reuses its thread's array without seeing the entries of the maps before
    /// it, also when two are alive at once and when the stamps come round again.
    #[test]
    fn stamped_maps_start_empty_on_a_reused_array() {
        for round in 0..5u32 {
            let mut a = IdMap::for_size(100, 1000);
            let mut b = IdMap::for_size(100, 1000);
            for v in 0..1000 {
                assert_eq!(a.get(v), None, "round {round}");
                assert_eq!(b.get(v), None, "round {round}");
            }
            for v in (round..1000).step_by(7) {
                assert!(a.insert_new(v, v + round));
                assert!(!a.insert_new(v, 0));
            }
            assert!(b.insert_new(3, 9));
            assert_eq!(a.get(round), Some(2 * round));
            assert_eq!(b.get(3), Some(9));
            assert_eq!(b.get(round + 7), None);
        }
        // The stamp that would wrap to 0 (absent) starts the array afresh instead (both kept
        // arrays are taken, so the next map gets one of them whichever it is).
        let mut maps: Vec<IdMap> = (0..super::STAMPED_KEPT)
            .map(|_| IdMap::for_size(100, 1000))
            .collect();
        for m in &mut maps {
            assert!(m.insert_new(5, 1));
            if let IdMap::Stamped(s) = m {
                s.stamp = u32::MAX;
            }
        }
        drop(maps);
        let m = IdMap::for_size(100, 1000);
        assert_eq!(m.get(5), None);
        assert!(matches!(&m, IdMap::Stamped(s) if s.stamp == 1));
    }
}
