//! Numbering a sample's vertices as a plan orders its rows, on every thread at once.
//!
//! A layer-wise sample numbers its vertices level by level (the hop that first reached a
//! vertex; the targets are level 0), by global id within a level, and names every drawn
//! source by its number, as a DGL block does. Numbering a hop means one map look-up per drawn
//! edge at a scattered id — the part of a step that was still one thread. Here the ids are cut
//! into contiguous ranges, one per thread (an *owner*), each with its own map: an owner walks
//! the hop's sources, numbers those in its range (its map alone deduplicates them, no shared
//! writes, no atomics on the map) and collects its new vertices; sorted, each owner's new
//! vertices follow the previous owner's, so their concatenation is the level in global-id
//! order. The numbers are therefore the same for any number of owners.

use std::sync::atomic::{AtomicU32, Ordering};

use grandis_masking::IdMap;
use rayon::prelude::*;

/// How many edges ahead an owner prefetches its map entries.
const PREFETCH_AHEAD: usize = 8;

/// Global id -> sample number, in one map per contiguous range of ids.
pub(crate) struct Numbering {
    /// Owner `t` numbers ids in `bounds[t]..bounds[t + 1]`.
    bounds: Vec<u32>,
    /// Owner `t`'s map, keyed by `id - bounds[t]`.
    maps: Vec<IdMap>,
}

impl Numbering {
    /// Maps for about `expected` vertices over a graph of `n`, one per thread of the pool.
    pub(crate) fn new(expected: usize, n: usize) -> Numbering {
        let owners = rayon::current_num_threads().clamp(1, n.max(1));
        let bounds: Vec<u32> = (0..=owners).map(|t| (n * t / owners) as u32).collect();
        let maps = bounds
            .windows(2)
            .map(|w| IdMap::for_size(expected.div_ceil(owners), (w[1] - w[0]) as usize))
            .collect();
        Numbering { bounds, maps }
    }

    fn owner(&self, v: u32) -> usize {
        // Ranges are near-equal, so the guess is at most one off.
        let owners = self.maps.len();
        let n = *self.bounds.last().unwrap() as u64;
        let mut t = ((v as u64 * owners as u64) / n.max(1)) as usize;
        t = t.min(owners - 1);
        while v < self.bounds[t] {
            t -= 1;
        }
        while v >= self.bounds[t + 1] {
            t += 1;
        }
        t
    }

    /// Numbers the targets `0..targets.len()` in their order (they are distinct).
    pub(crate) fn number_targets(&mut self, targets: &[u32]) {
        for (i, &v) in targets.iter().enumerate() {
            let t = self.owner(v);
            self.maps[t].insert_new(v - self.bounds[t], i as u32);
        }
    }

    /// Names every source of a hop by its number, numbering those not reached before from
    /// `next` on in global-id order; returns the new vertices in that order.
    pub(crate) fn number_hop(&mut self, srcs: &mut Vec<u32>, next: u32) -> Vec<u32> {
        let owners = self.maps.len();
        let drawn = std::mem::take(srcs);
        // Written by the owner of each source, read by no other owner until pass 2.
        let named: Vec<AtomicU32> = (0..drawn.len()).map(|_| AtomicU32::new(0)).collect();
        // Pass 1, every owner at once: its sources' numbers, or a provisional one (`next` +
        // j * owners + t for its j-th new vertex) until the level is sorted.
        let fresh: Vec<Vec<u32>> = self
            .maps
            .par_iter_mut()
            .zip(self.bounds.par_windows(2))
            .enumerate()
            .map(|(t, (map, range))| {
                let owned = range[0]..range[1];
                let mut fresh = Vec::new();
                for (i, &u) in drawn.iter().enumerate() {
                    if let Some(&ahead) = drawn.get(i + PREFETCH_AHEAD) {
                        if owned.contains(&ahead) {
                            map.prefetch(ahead - owned.start);
                        }
                    }
                    if !owned.contains(&u) {
                        continue;
                    }
                    let provisional = next + (fresh.len() * owners + t) as u32;
                    let number = map.get_or_insert(u - owned.start, provisional);
                    if number == provisional {
                        fresh.push(u);
                    }
                    named[i].store(number, Ordering::Relaxed);
                }
                fresh
            })
            .collect();
        // Each owner's new vertices by global id: the level's order, owner after owner.
        let mut first = next;
        let mut starts = Vec::with_capacity(owners);
        for f in &fresh {
            starts.push(first);
            first += f.len() as u32;
        }
        let longest = fresh.iter().map(Vec::len).max().unwrap_or(0);
        let final_of: Vec<AtomicU32> = (0..longest * owners).map(|_| AtomicU32::new(0)).collect();
        let sorted: Vec<Vec<u32>> = self
            .maps
            .par_iter_mut()
            .zip(self.bounds.par_windows(2))
            .zip(fresh.into_par_iter())
            .enumerate()
            .map(|(t, ((map, range), fresh))| {
                let lo = range[0];
                let locals = fresh.into_iter().map(|g| g - lo).collect();
                let mut locals = sorted_ids(locals, (range[1] - lo) as usize);
                for (rank, local) in locals.iter_mut().enumerate() {
                    let number = starts[t] + rank as u32;
                    let provisional = map.get(*local).expect("numbered in pass 1");
                    map.set(*local, number);
                    final_of[(provisional - next) as usize].store(number, Ordering::Relaxed);
                    *local += lo;
                }
                locals
            })
            .collect();
        // Pass 2: provisional numbers to final ones, into the drawn ids' own buffer.
        let mut drawn = drawn;
        drawn
            .par_iter_mut()
            .zip(named.into_par_iter())
            .for_each(|(slot, n)| {
                let n = n.into_inner();
                *slot = if n >= next {
                    final_of[(n - next) as usize].load(Ordering::Relaxed)
                } else {
                    n
                };
            });
        *srcs = drawn;
        sorted.concat()
    }
}

/// `ids` (distinct, each below `span`) in ascending order: read off a bitmap over the span
/// when they are dense enough in it that scanning its words costs less than sorting them (a
/// hop's ~400k new vertices of a products-sized graph: a comparison sort of those cost more
/// than drawing them), by a comparison sort when they are few.
fn sorted_ids(mut ids: Vec<u32>, span: usize) -> Vec<u32> {
    let words = span.div_ceil(64);
    if words > ids.len().saturating_mul(4) {
        ids.sort_unstable();
        return ids;
    }
    let mut bits = vec![0u64; words];
    for &i in &ids {
        bits[i as usize / 64] |= 1 << (i % 64);
    }
    ids.clear();
    for (w, &word) in bits.iter().enumerate() {
        let mut rest = word;
        while rest != 0 {
            ids.push((w * 64) as u32 + rest.trailing_zeros());
            rest &= rest - 1;
        }
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::{sorted_ids, Numbering};

    /// Ids come out ascending whether read off the bitmap (dense in their span) or sorted
    /// (sparse), for spans that need one to four bytes.
    #[test]
    fn ids_come_out_ascending_dense_or_sparse() {
        for span in [1u64, 200, 70_000, 3_000_000, u32::MAX as u64 + 1] {
            for count in [0u64, 1, 5000] {
                let mut ids: Vec<u32> = (0..count)
                    .map(|j| ((j * 2_654_435_761) % span) as u32)
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                let mut shuffled = ids.clone();
                shuffled.reverse();
                shuffled.rotate_left(ids.len() / 3);
                assert_eq!(sorted_ids(shuffled, span as usize), ids, "span {span}");
            }
        }
    }

    /// Numbers as the definition gives them (targets in order, then each hop's new vertices
    /// by global id), for one to five owners and maps of every representation.
    #[test]
    fn numbers_level_by_level_by_global_id_for_any_owner_count() {
        for n in [7usize, 1000, 100_000, 1_000_000] {
            let targets: Vec<u32> = (0..5u32).map(|i| (i * 37 + 3) % n as u32).collect();
            let hops: Vec<Vec<u32>> = (0..3u64)
                .map(|h| {
                    (0..400u64)
                        .map(|i| ((i * 7919 + h * 104_729) * 2_654_435_761 % n as u64) as u32)
                        .collect()
                })
                .collect();
            // The definition, written out.
            let mut want_number = std::collections::HashMap::new();
            for (i, &t) in targets.iter().enumerate() {
                want_number.insert(t, i as u32);
            }
            let mut want_levels = Vec::new();
            let mut want_named = Vec::new();
            for hop in &hops {
                let mut new: Vec<u32> = hop
                    .iter()
                    .copied()
                    .filter(|u| !want_number.contains_key(u))
                    .collect();
                new.sort_unstable();
                new.dedup();
                for &u in &new {
                    let next = want_number.len() as u32;
                    want_number.insert(u, next);
                }
                want_named.push(hop.iter().map(|u| want_number[u]).collect::<Vec<_>>());
                want_levels.push(new);
            }
            for owners in 1..=5 {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(owners)
                    .build()
                    .unwrap();
                pool.install(|| {
                    for expected in [1, n / 10, n] {
                        let mut numbering = Numbering::new(expected, n);
                        numbering.number_targets(&targets);
                        let mut next = targets.len() as u32;
                        for (h, hop) in hops.iter().enumerate() {
                            let mut srcs = hop.clone();
                            let level = numbering.number_hop(&mut srcs, next);
                            assert_eq!(level, want_levels[h], "n {n} owners {owners} hop {h}");
                            assert_eq!(srcs, want_named[h], "n {n} owners {owners} hop {h}");
                            next += level.len() as u32;
                        }
                    }
                });
            }
        }
    }
}
