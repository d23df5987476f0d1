//! Link-prediction splits: the supervision edges training scores, and the held-out validation
//! and test positives with their negatives, as PyG's `RandomLinkSplit` makes them
//! (transductive) and OGB's link-prediction datasets ship them (`train`, `valid_pos` /
//! `valid_neg`, `test_pos` / `test_neg`).
//!
//! A dataset with a link split stores each part as a `u32` array of `(source, destination)`
//! pairs (`link_<part>.pairs`, rows = pairs, 2 columns), counted in the manifest's `link`
//! section. Its graph is the *message-passing* graph: the validation and test positives are
//! not in it, so no layer ever reads a held-out edge. Negatives are grouped per positive:
//! with `k` negatives per positive, negatives `i k .. (i + 1) k` belong to positive `i`
//! (what MRR ranks against), and all of them together are the shared negatives of AUC and
//! Hits@K.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::csr::{CsrGraph, CsrView};

/// One array of a link split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkPart {
    /// Supervision positives (training scores them against sampled negatives).
    Train,
    ValPos,
    ValNeg,
    TestPos,
    TestNeg,
}

impl LinkPart {
    pub const ALL: [LinkPart; 5] = [
        LinkPart::Train,
        LinkPart::ValPos,
        LinkPart::ValNeg,
        LinkPart::TestPos,
        LinkPart::TestNeg,
    ];

    /// The part's file in a dataset directory.
    pub fn file(self) -> &'static str {
        match self {
            LinkPart::Train => "link_train.pairs",
            LinkPart::ValPos => "link_valid_pos.pairs",
            LinkPart::ValNeg => "link_valid_neg.pairs",
            LinkPart::TestPos => "link_test_pos.pairs",
            LinkPart::TestNeg => "link_test_neg.pairs",
        }
    }

    fn is_negative(self) -> bool {
        matches!(self, LinkPart::ValNeg | LinkPart::TestNeg)
    }
}

/// Pair counts of a link split (the manifest's `link` section).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct LinkSizes {
    pub train: u64,
    pub valid_pos: u64,
    pub valid_neg: u64,
    pub test_pos: u64,
    pub test_neg: u64,
}

impl LinkSizes {
    pub fn of(&self, part: LinkPart) -> u64 {
        match part {
            LinkPart::Train => self.train,
            LinkPart::ValPos => self.valid_pos,
            LinkPart::ValNeg => self.valid_neg,
            LinkPart::TestPos => self.test_pos,
            LinkPart::TestNeg => self.test_neg,
        }
    }
}

/// A link split held in memory: each part a flat list of pairs (`[src0, dst0, src1, ...]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkSplit {
    pub train: Vec<u32>,
    pub valid_pos: Vec<u32>,
    pub valid_neg: Vec<u32>,
    pub test_pos: Vec<u32>,
    pub test_neg: Vec<u32>,
    /// `(first, end)`: the ids the split's relation points at, where training negatives
    /// draw their destination (a typed relation's destination type); `None`: every vertex.
    pub destinations: Option<(u32, u32)>,
}

impl LinkSplit {
    pub fn view(&self) -> LinkSplitView<'_> {
        LinkSplitView {
            train: &self.train,
            valid_pos: &self.valid_pos,
            valid_neg: &self.valid_neg,
            test_pos: &self.test_pos,
            test_neg: &self.test_neg,
            destinations: self.destinations,
        }
    }
}

/// Borrowed link split (from a dataset's mapped files or a [`LinkSplit`]).
#[derive(Debug, Clone, Copy)]
pub struct LinkSplitView<'a> {
    pub train: &'a [u32],
    pub valid_pos: &'a [u32],
    pub valid_neg: &'a [u32],
    pub test_pos: &'a [u32],
    pub test_neg: &'a [u32],
    /// As [`LinkSplit::destinations`].
    pub destinations: Option<(u32, u32)>,
}

impl From<LinkSplitView<'_>> for LinkSplit {
    fn from(v: LinkSplitView<'_>) -> LinkSplit {
        LinkSplit {
            train: v.train.to_vec(),
            valid_pos: v.valid_pos.to_vec(),
            valid_neg: v.valid_neg.to_vec(),
            test_pos: v.test_pos.to_vec(),
            test_neg: v.test_neg.to_vec(),
            destinations: v.destinations,
        }
    }
}

impl<'a> LinkSplitView<'a> {
    /// The flat pairs of `part`.
    pub fn part(&self, part: LinkPart) -> &'a [u32] {
        match part {
            LinkPart::Train => self.train,
            LinkPart::ValPos => self.valid_pos,
            LinkPart::ValNeg => self.valid_neg,
            LinkPart::TestPos => self.test_pos,
            LinkPart::TestNeg => self.test_neg,
        }
    }

    /// Where training negatives draw their destination among `num_vertices` vertices.
    pub fn negative_destinations(&self, num_vertices: u32) -> std::ops::Range<u32> {
        self.destinations
            .map_or(0..num_vertices, |(first, end)| first..end)
    }

    pub fn sizes(&self) -> LinkSizes {
        let n = |p| (self.part(p).len() / 2) as u64;
        LinkSizes {
            train: n(LinkPart::Train),
            valid_pos: n(LinkPart::ValPos),
            valid_neg: n(LinkPart::ValNeg),
            test_pos: n(LinkPart::TestPos),
            test_neg: n(LinkPart::TestNeg),
        }
    }

    /// What training and evaluation rely on, the first problem named by its part: ids below
    /// `num_vertices`; no positive in two of train, validation and test (as unordered pairs
    /// when `undirected`: the two directions of an edge are one edge); no negative that is a
    /// positive of any part; at least one positive to train on.
    pub fn check(&self, num_vertices: u64, undirected: bool) -> Result<(), (LinkPart, String)> {
        for part in LinkPart::ALL {
            let pairs = self.part(part);
            if !pairs.len().is_multiple_of(2) {
                return Err((part, format!("holds {} ids, not pairs", pairs.len())));
            }
            if let Some(&bad) = pairs.iter().find(|&&v| v as u64 >= num_vertices) {
                return Err((
                    part,
                    format!(
                        "vertex id {bad} is out of range (the graph has {num_vertices} vertices)"
                    ),
                ));
            }
        }
        if self.train.is_empty() {
            return Err((LinkPart::Train, "has no edge to train on".into()));
        }
        if let Some((first, end)) = self.destinations {
            if first >= end || end as u64 > num_vertices {
                return Err((
                    LinkPart::Train,
                    format!(
                        "its negatives' destinations [{first}, {end}) are not a non-empty range \
                         of the {num_vertices} vertices"
                    ),
                ));
            }
            if let Some(p) = self
                .train
                .chunks_exact(2)
                .find(|p| !(first..end).contains(&p[1]))
            {
                return Err((
                    LinkPart::Train,
                    format!(
                        "edge ({}, {}) points outside its relation's destinations [{first}, {end})",
                        p[0], p[1]
                    ),
                ));
            }
        }
        let key = |s: u32, d: u32| {
            if undirected && d < s {
                (d, s)
            } else {
                (s, d)
            }
        };
        let mut owner: std::collections::HashMap<(u32, u32), LinkPart> = Default::default();
        for part in [LinkPart::Train, LinkPart::ValPos, LinkPart::TestPos] {
            for p in self.part(part).chunks_exact(2) {
                if let Some(&other) = owner.get(&key(p[0], p[1])) {
                    if other != part {
                        return Err((
                            part,
                            format!(
                                "edge ({}, {}) is also a positive of {}",
                                p[0],
                                p[1],
                                other.file()
                            ),
                        ));
                    }
                } else {
                    owner.insert(key(p[0], p[1]), part);
                }
            }
        }
        for part in LinkPart::ALL.into_iter().filter(|p| p.is_negative()) {
            for p in self.part(part).chunks_exact(2) {
                if let Some(&pos) = owner.get(&key(p[0], p[1])) {
                    return Err((
                        part,
                        format!(
                            "negative ({}, {}) is a positive of {}",
                            p[0],
                            p[1],
                            pos.file()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl LinkSplitView<'_> {
    /// Held-out positives (validation and test) must not be edges of the message-passing
    /// `graph`: a model that aggregates over the edge it is asked to predict scores it from
    /// the answer. Checked in the graph's direction (an undirected graph holds both).
    pub fn check_held_out(&self, graph: &CsrView<'_>) -> Result<(), (LinkPart, String)> {
        for part in [LinkPart::ValPos, LinkPart::TestPos] {
            if let Some(p) = self
                .part(part)
                .chunks_exact(2)
                .find(|p| graph.has_edge(p[0], p[1]))
            {
                return Err((
                    part,
                    format!(
                        "held-out edge ({}, {}) is an edge of the message-passing graph: remove \
                         the validation and test positives from the graph's edges",
                        p[0], p[1]
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Draws [`split_edges`] makes for one negative before it gives up.
const NEGATIVE_TRIES: u32 = 100_000;

/// How [`split_edges`] splits a graph's edges.
#[derive(Debug, Clone, PartialEq)]
pub struct EdgeSplitOptions {
    /// Fraction of the edges held out for validation (PyG's `num_val`).
    pub val: f64,
    /// Fraction held out for test (`num_test`).
    pub test: f64,
    /// Negatives per held-out positive (PyG's `neg_sampling_ratio`, an integer here so that
    /// every positive has its own for MRR).
    pub negatives: u32,
    pub seed: u64,
}

impl Default for EdgeSplitOptions {
    fn default() -> Self {
        EdgeSplitOptions {
            val: 0.05,
            test: 0.1,
            negatives: 1,
            seed: 0,
        }
    }
}

/// A transductive split of `graph`'s edges (PyG's `RandomLinkSplit`): the message-passing
/// graph (the training edges, both directions when `undirected`, with the graph's self-loops)
/// and the split. With `undirected` (a symmetric graph), each edge `{u, v}` is split once,
/// both directions together, and listed once as `(min, max)`; self-loops are never held out.
/// The edges are shuffled with `seed` and the first `floor(val m)` go to validation, the next
/// `floor(test m)` to test, the rest to training, as PyG orders them. Each held-out positive
/// `(u, v)` gets `negatives` negatives `(u, w)`: `w` uniform among the vertices that are not
/// `u` and not an edge of `graph` with `u` (the destination corrupted, as OGB's evaluation
/// sets are built), drawn from the same seeded stream.
pub fn split_edges(
    graph: CsrView<'_>,
    undirected: bool,
    opts: &EdgeSplitOptions,
) -> Result<(CsrGraph, LinkSplit), String> {
    let n = graph.num_vertices() as u32;
    // Edges as (source, destination); rows are destinations.
    let mut edges: Vec<(u32, u32)> = Vec::new();
    let mut self_loops: Vec<(u32, u32)> = Vec::new();
    for dst in 0..n {
        for &src in graph.neighbors(dst) {
            if src == dst {
                self_loops.push((src, src));
            } else if !undirected || src < dst {
                edges.push((src, dst));
            }
        }
    }
    split_relation(graph, edges, &self_loops, 0..n, undirected, opts)
}

/// [`split_edges`] over the edges `candidates` of `graph` alone (one relation's, such as
/// user-to-item edges; with `undirected`, each listed once): they are split, while the edges
/// `kept` stay in the message-passing graph whatever happens (other relations, self-loops).
/// Each held-out positive `(u, v)`'s negatives `(u, w)` draw `w` from `destinations` (the
/// relation's destination vertices), never `u` nor an edge of `graph` with `u`.
pub fn split_relation(
    graph: CsrView<'_>,
    mut candidates: Vec<(u32, u32)>,
    kept: &[(u32, u32)],
    destinations: std::ops::Range<u32>,
    undirected: bool,
    opts: &EdgeSplitOptions,
) -> Result<(CsrGraph, LinkSplit), String> {
    if !(0.0..1.0).contains(&opts.val)
        || !(0.0..1.0).contains(&opts.test)
        || opts.val + opts.test >= 1.0
    {
        return Err(format!(
            "validation {} and test {} must be fractions in [0, 1) that leave edges to train on",
            opts.val, opts.test
        ));
    }
    let n = graph.num_vertices() as u32;
    if destinations.is_empty() || destinations.end > n {
        return Err(format!(
            "negatives' destinations {destinations:?} must be a non-empty range of the {n} vertices"
        ));
    }
    let m = candidates.len();
    let n_val = (opts.val * m as f64).floor() as usize;
    let n_test = (opts.test * m as f64).floor() as usize;
    if m == 0 || n_val + n_test >= m {
        return Err(format!(
            "{m} edges leave none to train on after holding out {n_val} for validation and {n_test} for test"
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    // Fisher-Yates, so the order is this crate's own and stable across rand versions.
    for i in (1..m).rev() {
        let j = rng.gen_range(0..=i);
        candidates.swap(i, j);
    }
    let (val, rest) = candidates.split_at(n_val);
    let (test, train) = rest.split_at(n_test);

    let mut negatives = |pos: &[(u32, u32)]| -> Result<Vec<u32>, String> {
        let mut out = Vec::with_capacity(pos.len() * opts.negatives as usize * 2);
        for &(u, _) in pos {
            for _ in 0..opts.negatives {
                // Not u, and not an edge with u in either direction. A vertex adjacent to
                // nearly all others would loop for long: give up, naming it.
                let w = (0..NEGATIVE_TRIES)
                    .map(|_| rng.gen_range(destinations.clone()))
                    .find(|&w| w != u && !graph.has_edge(u, w) && !graph.has_edge(w, u))
                    .ok_or_else(|| {
                        format!(
                            "no negative found for vertex {u} in {NEGATIVE_TRIES} draws: it is \
                             adjacent to nearly every vertex"
                        )
                    })?;
                out.extend([u, w]);
            }
        }
        Ok(out)
    };
    let valid_neg = negatives(val)?;
    let test_neg = negatives(test)?;
    let flat = |pairs: &[(u32, u32)]| pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
    let split = LinkSplit {
        train: flat(train),
        valid_pos: flat(val),
        valid_neg,
        test_pos: flat(test),
        test_neg,
        // A relation's own destinations; a whole graph's edges (every vertex) need no range.
        destinations: (destinations != (0..n)).then_some((destinations.start, destinations.end)),
    };
    let message_passing = crate::graph_from_edges(
        n as u64,
        train.iter().chain(kept).copied(),
        crate::EdgeOptions {
            symmetrize: undirected,
            self_loops: crate::SelfLoops::Keep,
        },
    )
    .map_err(|e| e.to_string())?;
    Ok((message_passing, split))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(n: u32) -> CsrGraph {
        crate::graph_from_edges(
            n as u64,
            (0..n).map(|v| (v, (v + 1) % n)),
            crate::EdgeOptions {
                symmetrize: true,
                self_loops: crate::SelfLoops::Keep,
            },
        )
        .unwrap()
    }

    /// Every undirected edge lands in exactly one part, both directions together; held-out
    /// edges leave the message-passing graph; negatives are non-edges grouped per positive.
    #[test]
    fn an_undirected_split_partitions_the_edges_and_holds_out_both_directions() {
        let g = ring(200);
        let opts = EdgeSplitOptions {
            val: 0.1,
            test: 0.2,
            negatives: 3,
            seed: 7,
        };
        let (mp, split) = split_edges(g.view(), true, &opts).unwrap();
        let s = split.view().sizes();
        assert_eq!((s.valid_pos, s.test_pos, s.train), (20, 40, 140));
        assert_eq!((s.valid_neg, s.test_neg), (60, 120));
        assert!(mp.view().is_symmetric());
        assert_eq!(mp.view().num_edges(), 2 * 140);
        for p in split.train.chunks_exact(2) {
            assert!(
                p[0] < p[1] && mp.view().has_edge(p[0], p[1]) && mp.view().has_edge(p[1], p[0])
            );
        }
        for part in [&split.valid_pos, &split.test_pos] {
            for p in part.chunks_exact(2) {
                assert!(g.view().has_edge(p[0], p[1]));
                assert!(!mp.view().has_edge(p[0], p[1]) && !mp.view().has_edge(p[1], p[0]));
            }
        }
        for (pos, neg) in [
            (&split.valid_pos, &split.valid_neg),
            (&split.test_pos, &split.test_neg),
        ] {
            for (i, p) in pos.chunks_exact(2).enumerate() {
                for q in neg[i * 6..(i + 1) * 6].chunks_exact(2) {
                    assert_eq!(q[0], p[0], "the destination is corrupted, not the source");
                    assert!(q[0] != q[1] && !g.view().has_edge(q[0], q[1]));
                }
            }
        }
        split.view().check(200, true).unwrap();
        // Seeded: the same split again, another with another seed.
        assert_eq!(split_edges(g.view(), true, &opts).unwrap().1, split);
        let other = EdgeSplitOptions { seed: 8, ..opts };
        assert_ne!(split_edges(g.view(), true, &other).unwrap().1, split);
    }

    #[test]
    fn bad_splits_are_named_by_their_array() {
        let good = LinkSplit {
            train: vec![0, 1, 1, 2],
            valid_pos: vec![2, 3],
            valid_neg: vec![0, 3],
            test_pos: vec![3, 4],
            test_neg: vec![0, 4],
            destinations: None,
        };
        good.view().check(5, true).unwrap();
        let err = |s: LinkSplit, undirected| s.view().check(5, undirected).unwrap_err();
        let bad = [
            (
                LinkSplit {
                    test_pos: vec![2, 1],
                    ..good.clone()
                },
                LinkPart::TestPos,
                "(2, 1)",
                "link_train.pairs",
            ),
            (
                LinkSplit {
                    valid_neg: vec![4, 3],
                    ..good.clone()
                },
                LinkPart::ValNeg,
                "is a positive of link_test_pos.pairs",
                "",
            ),
            (
                LinkSplit {
                    test_neg: vec![0, 9],
                    ..good.clone()
                },
                LinkPart::TestNeg,
                "vertex id 9 is out of range",
                "",
            ),
            (
                LinkSplit {
                    train: vec![],
                    ..good.clone()
                },
                LinkPart::Train,
                "",
                "",
            ),
        ];
        for (split, want_part, says, and_says) in bad {
            let (part, msg) = err(split, true);
            assert_eq!(part, want_part, "{msg}");
            assert!(msg.contains(says) && msg.contains(and_says), "{msg}");
        }
        // Directed: (2, 1) is another edge than (1, 2).
        LinkSplit {
            test_pos: vec![2, 1],
            ..good.clone()
        }
        .view()
        .check(5, false)
        .unwrap();

        // A relation's destinations: a range of the graph holding every training destination.
        LinkSplit {
            destinations: Some((1, 3)),
            ..good.clone()
        }
        .view()
        .check(5, true)
        .unwrap();
        for (range, want) in [
            (
                (1, 2),
                "edge (1, 2) points outside its relation's destinations [1, 2)",
            ),
            ((2, 2), "[2, 2) are not a non-empty range of the 5 vertices"),
            ((0, 6), "[0, 6) are not a non-empty range of the 5 vertices"),
        ] {
            let (part, msg) = err(
                LinkSplit {
                    destinations: Some(range),
                    ..good.clone()
                },
                true,
            );
            assert_eq!(part, LinkPart::Train);
            assert!(msg.contains(want), "{msg}");
        }
    }

    #[test]
    fn fractions_that_leave_nothing_to_train_on_are_refused() {
        let g = ring(10);
        for (val, test) in [(0.5, 0.5), (1.0, 0.0), (-0.1, 0.1)] {
            let opts = EdgeSplitOptions {
                val,
                test,
                ..Default::default()
            };
            assert!(split_edges(g.view(), true, &opts).is_err(), "{val} {test}");
        }
    }
}

#[cfg(test)]
mod stored {
    use super::*;
    use crate::{Dataset, DatasetInfo, DatasetWriter, Split};

    fn write(dir: &std::path::Path, graph: &CsrGraph, split: &LinkSplit) -> crate::Result<Dataset> {
        let n = graph.view().num_vertices();
        let mut w = DatasetWriter::create(dir, false)?;
        w.write_graph_parts(&graph.offsets, &graph.indices)?;
        w.write_features(&vec![0.5; n * 2], 2)?;
        w.write_labels(&vec![0; n])?;
        w.write_split(&Split::default())?;
        w.write_link_split(split)?;
        w.finish(DatasetInfo {
            name: "links".into(),
            num_classes: 1,
            provenance: vec![],
        })
    }

    #[test]
    fn a_link_split_is_stored_verified_and_read_back() {
        let g = crate::graph_from_edges(
            60,
            (0..60u32).map(|v| (v, (v * 7 + 3) % 60)),
            crate::EdgeOptions {
                symmetrize: true,
                self_loops: crate::SelfLoops::Remove,
            },
        )
        .unwrap();
        let opts = EdgeSplitOptions {
            val: 0.1,
            test: 0.1,
            negatives: 2,
            seed: 1,
        };
        let (mp, split) = split_edges(g.view(), true, &opts).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let ds = write(&tmp.path().join("ok"), &mp, &split).unwrap();
        let ds = Dataset::open_verified(ds.dir()).unwrap();
        assert_eq!(ds.manifest().link, Some(split.view().sizes()));
        let links = ds.view().links.unwrap();
        for part in LinkPart::ALL {
            assert_eq!(links.part(part), split.view().part(part), "{part:?}");
        }

        // A negative that is a positive: the write fails naming the array, and leaves nothing.
        let bad = LinkSplit {
            valid_neg: split.test_pos.clone(),
            ..split.clone()
        };
        let err = match write(&tmp.path().join("bad"), &mp, &bad) {
            Ok(_) => panic!("a negative that is a positive was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("link_valid_neg.pairs") && err.contains("is a positive"),
            "{err}"
        );
        assert!(!tmp.path().join("bad").exists());
    }
}
