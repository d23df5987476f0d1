//! The one-level partitioners. Each maps the vertices of a [`Subgraph`] to `0..parts`;
//! the two-level driver in `lib.rs` applies them to the whole graph and then inside each
//! server.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use grandis_store::{CsrGraph, EdgeListBuilder, EdgeOptions, SelfLoops};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::subgraph::Subgraph;
use crate::{PartitionError, Result};

const NONE: u32 = u32::MAX;

static METIS_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Seeded uniform assignment: the baseline every other method is compared against.
pub(crate) fn random_parts(sub: &Subgraph<'_>, parts: u32, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..sub.num_vertices())
        .map(|_| rng.gen_range(0..parts))
        .collect()
}

/// METIS k-way on the symmetrized subgraph, balancing vertices and training vertices at once
/// (vertex weights `[1, is_train]`, DistDGL §4.1.2) so every part gets its share of work.
pub(crate) fn metis_parts(
    sub: &Subgraph<'_>,
    parts: u32,
    seed: u64,
    is_train: &[bool],
) -> Result<Vec<u32>> {
    let n = sub.num_vertices();
    if parts == 1 || n == 0 {
        return Ok(vec![0; n]);
    }
    if n <= parts as usize {
        // METIS misbehaves with fewer vertices than parts; one vertex per part is optimal.
        return Ok((0..n as u32).collect());
    }
    check_metis_memory(sub, grandis_telemetry::mem_available_bytes())?;
    let (xadj, adjncy) = metis_adjacency(sub)?;
    let train: Vec<bool> = (0..n as u32)
        .map(|l| is_train[sub.global(l) as usize])
        .collect();
    let n_train = train.iter().filter(|&&t| t).count();
    // The second constraint only makes sense when it differs from the first: with no or all
    // training vertices it would be all-zero (METIS divides by its total) or redundant.
    let two_constraints = n_train > 0 && n_train < n;
    let vwgt: Vec<metis::Idx> = if two_constraints {
        train.iter().flat_map(|&t| [1, t as metis::Idx]).collect()
    } else {
        Vec::new()
    };
    let ncon = if two_constraints { 2 } else { 1 };
    let mut part = vec![0 as metis::Idx; n];
    // METIS keeps its random state in C globals (GKlib), so concurrent calls in one process
    // would both race and make results depend on thread timing: serialise them.
    let _guard = METIS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let graph = metis::Graph::new(ncon, parts as metis::Idx, &xadj, &adjncy)
        .map_err(|e| PartitionError::Metis(format!("rejected the graph: {e}")))?
        .set_option(metis::option::Seed((seed & 0x7fff_ffff) as metis::Idx));
    let graph = if two_constraints {
        graph.set_vwgt(&vwgt)
    } else {
        graph
    };
    graph
        .part_kway(&mut part)
        .map_err(|e| PartitionError::Metis(format!("k-way partitioning failed: {e}")))?;
    Ok(part.into_iter().map(|p| p as u32).collect())
}

/// CSR adjacency of the undirected subgraph in METIS's 32-bit format.
/// What METIS takes per vertex plus directed edge of its input, in bytes: its own copy of
/// the adjacency and the coarsened graphs on top of ours. Calibrated on this machine: 7.4 GB
/// for 2.4M vertices / 118M edges, 2.5 GB for 1M / 39M (peak RSS of `grandis partition`).
pub(crate) const METIS_BYTES_PER_ENTRY: u64 = 64;

/// Refuses, before allocating anything, a graph whose METIS run would need more memory than
/// `available` (the machine's `MemAvailable`; no check when unknown): the process would be
/// killed for memory, possibly after minutes, instead of saying what to do.
pub(crate) fn check_metis_memory(sub: &Subgraph<'_>, available: Option<u64>) -> Result<()> {
    let Some(available) = available else {
        return Ok(());
    };
    let edges = match &sub.scope {
        None => sub.graph.num_edges() as u64,
        // An induced subgraph: its rows' entries bound the edges kept.
        Some(s) => s.members.iter().map(|&v| sub.graph.degree(v) as u64).sum(),
    };
    let entries = sub.num_vertices() as u64 + edges;
    let need = entries * METIS_BYTES_PER_ENTRY;
    if need > available {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        return Err(PartitionError::Metis(format!(
            "METIS would need about {:.1} GiB for {} vertices and {edges} edges, and this \
             machine has {:.1} GiB available: use --method spring (streaming, O(V) memory, a \
             larger cut) or a machine with more memory",
            gib(need),
            sub.num_vertices(),
            gib(available)
        )));
    }
    Ok(())
}

fn metis_adjacency(sub: &Subgraph<'_>) -> Result<(Vec<metis::Idx>, Vec<metis::Idx>)> {
    let n = sub.num_vertices();
    let too_large = |edges: u64| {
        PartitionError::Metis(format!(
            "the graph has {edges} adjacency entries, more than METIS's 32-bit indices allow \
             ({}): use --method spring (streaming, O(V) memory)",
            metis::Idx::MAX
        ))
    };
    if sub.symmetric {
        // Rows already list every neighbour once: copy the in-scope ones.
        let mut xadj = Vec::with_capacity(n + 1);
        xadj.push(0 as metis::Idx);
        let mut count: u64 = 0;
        for l in 0..n as u32 {
            sub.for_each_neighbor(l, |_| count += 1);
            xadj.push(metis::Idx::try_from(count).map_err(|_| too_large(count))?);
        }
        let mut adjncy = Vec::with_capacity(count as usize);
        for l in 0..n as u32 {
            sub.for_each_neighbor(l, |u| adjncy.push(u as metis::Idx));
        }
        Ok((xadj, adjncy))
    } else {
        // METIS needs each edge in both rows; symmetrize through the one CSR builder.
        let mut builder = EdgeListBuilder::new(EdgeOptions {
            symmetrize: true,
            self_loops: SelfLoops::Remove,
        });
        let mut err = None;
        sub.for_each_edge(|u, v| {
            if let Err(e) = builder.push(u, v) {
                err.get_or_insert(e);
            }
        });
        if let Some(e) = err {
            return Err(PartitionError::Metis(e.to_string()));
        }
        let csr = builder
            .finish(Some(n as u64))
            .and_then(|sorted| sorted.into_csr())
            .map_err(|e| PartitionError::Metis(e.to_string()))?;
        let m = csr.indices.len() as u64;
        if m > metis::Idx::MAX as u64 {
            return Err(too_large(m));
        }
        let xadj = csr.offsets.iter().map(|&o| o as metis::Idx).collect();
        let adjncy = csr.indices.iter().map(|&u| u as metis::Idx).collect();
        Ok((xadj, adjncy))
    }
}

/// SPRING (CATGNN, Algorithm 1): streaming clustering over the edge stream (Hollocou et al.),
/// cluster merging along each cluster's richest neighbour, then greedy sorted list scheduling
/// of clusters onto `parts` partitions. Two passes over the edges (degrees, clustering); all
/// state is a handful of per-vertex / per-cluster arrays, so memory is O(V).
///
/// `beta` is the balance factor: merged clusters stay below `beta * |V| / parts` vertices.
/// The clustering volume threshold is one partition's share of the total volume, so that no
/// streaming cluster grows past what a partition could hold.
pub(crate) fn spring_parts(sub: &Subgraph<'_>, parts: u32, beta: f64) -> Vec<u32> {
    let n = sub.num_vertices();
    if parts == 1 || n == 0 {
        return vec![0; n];
    }
    // Pass 1: degrees (CATGNN assumes them known; one pass over the stream gives them).
    let mut degree = vec![0u32; n];
    sub.for_each_edge(|u, v| {
        degree[u as usize] += 1;
        degree[v as usize] += 1;
    });
    let total_volume: u64 = degree.iter().map(|&d| d as u64).sum();
    let tau = (total_volume / parts as u64).max(1);

    // Pass 2: streaming clustering (Algorithm 1, lines 3-22).
    let mut cluster = vec![NONE; n];
    let mut volume: Vec<u64> = Vec::new();
    let mut size: Vec<u32> = Vec::new();
    let mut richest = vec![NONE; n];
    sub.for_each_edge(|u, v| {
        let (u, v) = (u as usize, v as usize);
        for w in [u, v] {
            if cluster[w] == NONE {
                cluster[w] = volume.len() as u32;
                volume.push(degree[w] as u64);
                size.push(1);
            }
        }
        let (cu, cv) = (cluster[u] as usize, cluster[v] as usize);
        if cu != cv && volume[cu] <= tau && volume[cv] <= tau {
            // Move the endpoint of the lighter cluster into the heavier one.
            let (w, from, to) = if volume[cu] <= volume[cv] {
                (u, cu, cv)
            } else {
                (v, cv, cu)
            };
            volume[from] -= degree[w] as u64;
            volume[to] += degree[w] as u64;
            size[from] -= 1;
            size[to] += 1;
            cluster[w] = to as u32;
        }
        if richest[u] == NONE || degree[richest[u] as usize] < degree[v] {
            richest[u] = v as u32;
        }
        if richest[v] == NONE || degree[richest[v] as usize] < degree[u] {
            richest[v] = u as u32;
        }
    });
    drop(volume);
    // Vertices no edge touched are clusters of their own.
    for c in cluster.iter_mut().filter(|c| **c == NONE) {
        *c = size.len() as u32;
        size.push(1);
    }
    let k = size.len();
    tracing::debug!(
        clusters = size.iter().filter(|&&s| s > 0).count(),
        largest = size.iter().max().copied().unwrap_or(0),
        tau,
        "SPRING streaming clustering done"
    );

    // Representative of each cluster: the member whose richest neighbour is richest (24-25).
    let richness = |v: u32| -> u32 {
        match richest[v as usize] {
            NONE => 0,
            r => degree[r as usize],
        }
    };
    let mut rep = vec![NONE; k];
    for v in 0..n as u32 {
        if richest[v as usize] == NONE {
            continue;
        }
        let c = cluster[v as usize] as usize;
        if rep[c] == NONE || richness(rep[c]) < richness(v) {
            rep[c] = v;
        }
    }

    // Cluster merging (26-30): smallest first, each into the cluster of its representative's
    // richest neighbour while the union stays within the balance limit. A merged cluster is
    // re-queued at its new size; stale queue entries are recognised by their size.
    let limit = (beta * n as f64 / parts as f64).floor().max(1.0) as u64;
    let mut parent: Vec<u32> = (0..k as u32).collect();
    fn find(parent: &mut [u32], mut c: u32) -> u32 {
        while parent[c as usize] != c {
            let p = parent[c as usize];
            parent[c as usize] = parent[p as usize];
            c = p;
        }
        c
    }
    let mut queue: BinaryHeap<Reverse<(u32, u32)>> = (0..k as u32)
        .filter(|&c| size[c as usize] > 0)
        .map(|c| Reverse((size[c as usize], c)))
        .collect();
    while let Some(Reverse((s, i))) = queue.pop() {
        if parent[i as usize] != i || size[i as usize] != s || rep[i as usize] == NONE {
            continue;
        }
        let target = richest[rep[i as usize] as usize];
        let j = find(&mut parent, cluster[target as usize]);
        if j == i || (size[i as usize] + size[j as usize]) as u64 > limit {
            continue;
        }
        parent[i as usize] = j;
        size[j as usize] += size[i as usize];
        size[i as usize] = 0;
        let (ri, rj) = (rep[i as usize], rep[j as usize]);
        if rj == NONE || richness(rj) < richness(ri) {
            rep[j as usize] = ri;
        }
        queue.push(Reverse((size[j as usize], j)));
    }

    // Greedy sorted list scheduling (31-34): largest cluster to the least loaded partition.
    let mut roots: Vec<u32> = (0..k as u32)
        .filter(|&c| parent[c as usize] == c && size[c as usize] > 0)
        .collect();
    roots.sort_unstable_by_key(|&c| (Reverse(size[c as usize]), c));
    tracing::debug!(
        clusters = roots.len(),
        largest = roots.first().map_or(0, |&c| size[c as usize]),
        limit,
        "SPRING cluster merging done"
    );
    let mut load: BinaryHeap<Reverse<(u64, u32)>> = (0..parts).map(|p| Reverse((0, p))).collect();
    let mut part_of_cluster = vec![NONE; k];
    for c in roots {
        let Reverse((l, p)) = load.pop().expect("parts > 0");
        part_of_cluster[c as usize] = p;
        load.push(Reverse((l + size[c as usize] as u64, p)));
    }
    (0..n)
        .map(|v| part_of_cluster[find(&mut parent, cluster[v]) as usize])
        .collect()
}

/// What a vertex is to the training job, for ByteGNN's balance (its split).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Unlabelled = 0,
    Train = 1,
    Val = 2,
    Test = 3,
}

/// ByteGNN's block partitioning (Zheng et al., "ByteGNN", §4.2.3; in
/// `distdgl-bytegnn-sancus.txt`), for the locality of mini-batch sampling.
///
/// 1. **Blocks.** A breadth-first search of `hops` levels from every train, validation and test
///    vertex (the block centres, all at once, level by level) along the in-neighbour rows that
///    sampling follows; a vertex joins the block of the first centre that reaches it, so a
///    block is its centre's sampling neighbourhood minus what nearer centres took. Vertices no
///    centre reaches form blocks the same way from the lowest unclaimed id (they are computed
///    in full-batch modes, and this keeps their neighbourhoods together too).
/// 2. **Assignment.** Blocks in descending order of their largest split count (big blocks
///    first, small ones fill up the parts later); each goes to the part maximising
///    `(CE + 1) / (|P| + 1) · BS`, where `CE` counts the edges between the block and the part's
///    vertices (cut edges avoided), `|P|` the part's vertices (so the count is per vertex
///    held), and `BS = 1 − Σ_t w_t |P(t)| / C(t)` the balance score over the train, validation
///    and test splits the block has vertices of (`C(t)` the per-part average, `w_t` the
///    split's share of labelled vertices, the paper's α, β, γ by scale), floored at 0. The
///    `+ 1`s define the paper's ratio for an empty part. A part already holding `balance · |V| / parts` vertices takes no more blocks
///    (memory balance, which GraNNDIS's per-device budgets need); a block no part can take
///    goes to the part with the fewest vertices.
///
/// Memory: a few per-vertex arrays and the block lists, O(V); time O(E + blocks · parts).
pub(crate) fn bytegnn_parts(
    sub: &Subgraph<'_>,
    parts: u32,
    hops: u32,
    role: &[Role],
    balance: f64,
) -> Vec<u32> {
    let n = sub.num_vertices();
    if parts == 1 || n == 0 {
        return vec![0; n];
    }
    let role_of = |l: u32| role[sub.global(l) as usize];
    let (block, blocks) = bytegnn_blocks(sub, hops, |l| role_of(l) != Role::Unlabelled);

    // Members of every block (CSR by block) and each block's count per split.
    let members = CsrGraph::group_by_key(&block, blocks);
    let mut counts = vec![[0u32; 4]; blocks];
    for l in 0..n as u32 {
        counts[block[l as usize] as usize][role_of(l) as usize] += 1;
    }

    // Per-part average of each split, and the splits' weights by scale.
    let mut totals = [0u64; 4];
    for c in &counts {
        for t in 0..4 {
            totals[t] += c[t] as u64;
        }
    }
    let labelled: u64 = totals[1..].iter().sum();
    let avg: Vec<f64> = totals.iter().map(|&t| t as f64 / parts as f64).collect();
    let weight: Vec<f64> = totals
        .iter()
        .map(|&t| {
            if labelled == 0 {
                0.0
            } else {
                t as f64 / labelled as f64
            }
        })
        .collect();

    let mut order: Vec<u32> = (0..blocks as u32).collect();
    // Stable: equal blocks keep their creation order, so the result is deterministic.
    order.sort_by_key(|&b| Reverse(counts[b as usize][1..].iter().copied().max().unwrap_or(0)));

    let cap = (balance * n as f64 / parts as f64).ceil().max(1.0) as u64;
    let k = parts as usize;
    let mut part_of = vec![NONE; n];
    let mut size = vec![0u64; k];
    let mut held = vec![[0u64; 4]; k];
    let mut cross = vec![0u64; k];
    for b in order {
        let b = b as usize;
        let vs = members.view().neighbors(b as u32);
        cross.fill(0);
        for &l in vs {
            sub.for_each_neighbor(l, |u| {
                let p = part_of[u as usize];
                if p != NONE {
                    cross[p as usize] += 1;
                }
            });
        }
        let fits = |p: usize| size[p] + vs.len() as u64 <= cap;
        // Only the splits this block has vertices of: an unlabelled block adds no work to
        // balance, and goes where its edges are.
        let balance_score = |p: usize| {
            1.0 - (1..4)
                .filter(|&t| counts[b][t] > 0 && avg[t] > 0.0)
                .map(|t| weight[t] * held[p][t] as f64 / avg[t])
                .sum::<f64>()
        };
        // (score, balance score): a part past its share scores 0, and among those the least
        // loaded wins.
        let score = |p: usize| {
            let bs = balance_score(p);
            let locality = (cross[p] + 1) as f64 / (size[p] + 1) as f64;
            (locality * bs.max(0.0), bs)
        };
        let better = |a: (f64, f64), b: (f64, f64)| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1));
        let chosen = (0..k)
            .filter(|&p| fits(p))
            // Ties go to the lower part index.
            .max_by(|&a, &b| better(score(a), score(b)).then(b.cmp(&a)))
            .unwrap_or_else(|| (0..k).min_by_key(|&p| (size[p], p)).expect("parts > 0"));
        for &l in vs {
            part_of[l as usize] = chosen as u32;
        }
        size[chosen] += vs.len() as u64;
        for t in 0..4 {
            held[chosen][t] += counts[b][t] as u64;
        }
    }
    tracing::debug!(blocks, cap, "ByteGNN block assignment done");
    part_of
}

/// Step 1 of [`bytegnn_parts`]: the block of every local vertex and the number of blocks.
/// Blocks are numbered centres first (in local id order), then the blocks grown from
/// unclaimed vertices.
pub(crate) fn bytegnn_blocks(
    sub: &Subgraph<'_>,
    hops: u32,
    is_centre: impl Fn(u32) -> bool,
) -> (Vec<u32>, usize) {
    let n = sub.num_vertices();
    let mut block = vec![NONE; n];
    let mut blocks = 0usize;
    let mut frontier: Vec<u32> = Vec::new();
    for l in 0..n as u32 {
        if is_centre(l) {
            block[l as usize] = blocks as u32;
            blocks += 1;
            frontier.push(l);
        }
    }
    let mut next = Vec::new();
    let mut expand = |frontier: &mut Vec<u32>, block: &mut [u32]| {
        for _ in 0..hops {
            next.clear();
            for &v in frontier.iter() {
                let b = block[v as usize];
                sub.for_each_neighbor(v, |u| {
                    if block[u as usize] == NONE {
                        block[u as usize] = b;
                        next.push(u);
                    }
                });
            }
            std::mem::swap(frontier, &mut next);
            if frontier.is_empty() {
                break;
            }
        }
    };
    expand(&mut frontier, &mut block);
    for l in 0..n as u32 {
        if block[l as usize] == NONE {
            block[l as usize] = blocks as u32;
            blocks += 1;
            frontier.clear();
            frontier.push(l);
            expand(&mut frontier, &mut block);
        }
    }
    (block, blocks)
}
