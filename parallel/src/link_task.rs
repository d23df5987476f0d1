//! Link prediction across the ranks, in the exact modes (fb, flx): each rank's last layer
//! computes the embeddings of its inner rows; one all-reduce of those rows, every other row
//! zero, gives every rank the whole embedding matrix (x + 0 = x, so each row is bit for bit
//! what its owner computed, whatever order the all-reduce adds in); each rank then runs mode
//! single's own host decoder ([`grandis_trainer::link`]) over its share of the pairs (a
//! contiguous run of the supervision edges and their negatives, the draw mode single makes
//! for them), and a second all-reduce sums the ranks' gradients of the embeddings, of which
//! each back-propagates its own rows. The decoder's own parameters (the MLP's) get their
//! gradient all-reduced too, so every rank's copy takes the same Adam step and the copies
//! stay equal.
//!
//! The price is O(V x d) host memory and two all-reduces of that size per rank and step
//! (counted under [`grandis_fabric::Phase::Other`]): right for the graphs the full-batch
//! modes train, where the embeddings are a small fraction of the features. (Every rank
//! scoring every pair instead saved the second all-reduce but did not scale: on the 200k
//! graph of docs/benchmarks.md it was 3.6 s of a 3.8 s epoch on four ranks.)
//!
//! Mode mb scores a batch's edges instead ([`LinkSeeds`], PyG's `LinkNeighborLoader`): each
//! rank's mini-batch is a set of supervision edges (those whose source it owns, shuffled per
//! epoch), their negatives (the very pairs the whole epoch's draw has for them) and, as the
//! plan's targets, every end of those pairs; the rank's last layer computes exactly the
//! targets' embeddings and the decoder scores its own pairs ([`LinkBatch::loss`]). The losses
//! and gradients are sums over the ranks' pairs divided by the step's pair count, so a step
//! whose batches hold every edge is the full-batch step. Mode cob does it per server
//! ([`cobatch_loss`]: the step's targets gathered by one all-reduce); mode cluster scores the
//! edges from a server's cluster batch to the step's batches the same way
//! ([`LinkSeeds::batch_inside`]), negatives drawn among the step's vertices.

use anyhow::{bail, Context};
use grandis_fabric::{Endpoint, Tag};
use grandis_store::{CsrGraph, LinkSplitView};
use grandis_trainer::{link, Decoder};
use grandis_wire::LinkSummary;

/// A run's link-prediction task: the dataset's checked split and the negatives per positive.
#[derive(Clone, Copy)]
pub(crate) struct LinkTask<'a> {
    pub split: LinkSplitView<'a>,
    pub negatives: u32,
}

/// The layer number of the embedding gather's tag ([`Tag::other`]): "LINK" in ASCII, apart
/// from every layer number other transfers of a training epoch use under that phase (the loss
/// all-reduce 0, the feature fetch's exchanges 0 and 1), so the run summary can count its
/// bytes (`link_embedding_bytes_per_epoch`).
pub(crate) const GATHER_LAYER: u32 = 0x4C49_4E4B;

/// The layer number of the MLP decoder's gradient all-reduce in every mode ([`Tag::other`]):
/// "LDEC" in ASCII, counted with [`GATHER_LAYER`]'s bytes.
pub(crate) const DECODER_LAYER: u32 = 0x4C44_4543;

/// Binary cross-entropy of the pairs `pos` and `neg` (rows of `z`) as their share of a step
/// scoring `step_pairs` pairs over every rank: their loss sum, with `d(step loss)/dz` and
/// `/d(decoder parameters)` added into `dz` and `decoder_grad` (summed over the ranks, they
/// are the step's). The decoder averages over the pairs it is given; the step over all.
fn share_of_bce(
    decoder: &Decoder,
    z: &[f32],
    (pos, neg): (&[u32], &[u32]),
    (dz, decoder_grad): (&mut [f32], &mut [f32]),
    step_pairs: usize,
) -> f64 {
    let scored = (pos.len() + neg.len()) / 2;
    if scored == 0 {
        return 0.0;
    }
    let mean = decoder.bce(z, pos, neg, dz, decoder_grad);
    let share = scored as f32 / step_pairs.max(1) as f32;
    for g in dz.iter_mut().chain(decoder_grad.iter_mut()) {
        *g *= share;
    }
    mean * scored as f64
}

/// A training step's loss over the whole embedding matrix.
pub(crate) struct LinkLoss {
    /// This rank's share of the loss sum (over the pairs it scored; the run all-reduces the
    /// shares).
    pub loss_sum: f64,
    /// Positive and negative pairs the step scores over every rank (the loss is the sum over
    /// them, divided by this).
    pub pairs: usize,
    /// `d(loss)/d(z)` of this rank's inner rows (`inner x d`, in their row order).
    pub grad: Vec<f32>,
    /// This rank's part of `d(loss)/d(decoder parameters)` (the caller sums it over the
    /// ranks).
    pub decoder_grad: Vec<f32>,
}

/// Every vertex's embedding (`vertices x d`, ORIGINAL ids) from every rank's `rows`
/// (`ids.len() x d`, the rows of NEW ids `ids`), exchanged under epoch `tag_epoch`.
fn gather_embeddings(
    ep: &mut Endpoint,
    new_to_old: &[u32],
    (ids, rows): (&[u32], &[f32]),
    d: usize,
    tag_epoch: u32,
) -> anyhow::Result<Vec<f32>> {
    if rows.len() != ids.len() * d {
        bail!(
            "internal: {} embedding values for {} rows of {d}",
            rows.len(),
            ids.len()
        );
    }
    let mut z = vec![0f32; new_to_old.len() * d];
    for (&g, row) in ids.iter().zip(rows.chunks_exact(d.max(1))) {
        let o = new_to_old[g as usize] as usize;
        z[o * d..(o + 1) * d].copy_from_slice(row);
    }
    ep.all_reduce_sum(&mut z, Tag::other(tag_epoch, GATHER_LAYER))
        .context("gathering the embeddings for the link decoder")?;
    Ok(z)
}

impl LinkTask<'_> {
    /// The step's binary cross-entropy of epoch `epoch` (its negatives are
    /// [`link::Negatives`]' for it, as in mode single), given this rank's inner
    /// rows `rows` of NEW ids `ids`. Each rank scores its share of the supervision edges (a
    /// contiguous run of them, with their negatives) over the gathered embeddings; one more
    /// all-reduce sums the ranks' gradients of the embeddings, of which each keeps its rows
    /// (the decoder's own gradient is left to the caller to sum).
    pub fn loss(
        &self,
        ep: &mut Endpoint,
        new_to_old: &[u32],
        (ids, rows): (&[u32], &[f32]),
        decoder: &Decoder,
        (seed, epoch): (u64, usize),
    ) -> anyhow::Result<LinkLoss> {
        let d = decoder.dim();
        let z = gather_embeddings(ep, new_to_old, (ids, rows), d, epoch as u32)?;
        let n = new_to_old.len();
        let all = self.split.train;
        let edges = all.len() / 2;
        let (rank, world) = (ep.rank(), ep.world().max(1));
        let mine = edges * rank / world..edges * (rank + 1) / world;
        let indices: Vec<u32> = mine.clone().map(|i| i as u32).collect();
        let pos = &all[2 * mine.start..2 * mine.end];
        let neg = link::Negatives::new(
            self.negatives,
            self.split.negative_destinations(n as u32),
            seed,
            epoch as u64,
        )
        .at(all, &indices);
        let pairs = edges * (1 + self.negatives as usize);
        let mut dz = vec![0f32; n * d];
        let mut decoder_grad = vec![0f32; decoder.num_params()];
        let loss_sum = share_of_bce(
            decoder,
            &z,
            (pos, &neg),
            (&mut dz, &mut decoder_grad),
            pairs,
        );
        ep.all_reduce_sum(&mut dz, Tag::other(epoch as u32, GATHER_LAYER))
            .context("summing the link decoder's gradient of the embeddings")?;
        let mut grad = vec![0f32; rows.len()];
        for (&g, out) in ids.iter().zip(grad.chunks_exact_mut(d.max(1))) {
            let o = new_to_old[g as usize] as usize;
            out.copy_from_slice(&dz[o * d..(o + 1) * d]);
        }
        Ok(LinkLoss {
            loss_sum,
            pairs,
            grad,
            decoder_grad,
        })
    }

    /// The validation and test scores of the embeddings whose inner rows this rank holds
    /// (`tag_epoch`: the evaluation's epoch number in tags); the same on every rank.
    pub fn scores(
        &self,
        ep: &mut Endpoint,
        new_to_old: &[u32],
        (ids, rows): (&[u32], &[f32]),
        decoder: &Decoder,
        tag_epoch: u32,
    ) -> anyhow::Result<LinkSummary> {
        let d = decoder.dim();
        let z = gather_embeddings(ep, new_to_old, (ids, rows), d, tag_epoch)?;
        Ok(link::summary_of(decoder, &z, &self.split))
    }
}

/// What a mini-batch step of a link job is seeded with: the supervision edges and how their
/// negatives are drawn, with the map from the dataset's ids to the plans' (NEW) ids.
pub(crate) struct LinkSeeds<'a> {
    pub task: LinkTask<'a>,
    /// `old_to_new[original id]`.
    pub old_to_new: Vec<u32>,
    pub seed: u64,
    /// The supervision edges by source, for batches that are sets of vertices (mode
    /// cluster: [`LinkSeeds::batch_inside`]); None for batches of edges.
    pub by_source: Option<EdgesBySource<'a>>,
}

/// The supervision edges of each source vertex (NEW ids), and the partition's map back to
/// the dataset's ids.
pub(crate) struct EdgesBySource<'a> {
    /// Row `v`: the supervision edges whose source is new id `v`, ascending.
    edges: CsrGraph,
    new_to_old: &'a [u32],
}

impl<'a> LinkSeeds<'a> {
    /// Seeds for batches of edges (`by_vertices` false: mb, cob) or of vertices (cluster) of
    /// a job partitioned as `part`.
    pub fn new(
        task: LinkTask<'a>,
        part: &'a crate::PartitionedGraph,
        seed: u64,
        by_vertices: bool,
    ) -> LinkSeeds<'a> {
        let mut seeds = LinkSeeds {
            task,
            old_to_new: crate::setup::old_to_new(part),
            seed,
            by_source: None,
        };
        if by_vertices {
            seeds.by_source = Some(EdgesBySource {
                edges: CsrGraph::group_by_key(&seeds.sources(), part.new_to_old.len()),
                new_to_old: &part.new_to_old,
            });
        }
        seeds
    }
}

/// The supervision pairs of one rank's mini-batch (mb) or one server's co-batch (cob), in NEW
/// ids, flattened `(u, v)` pairs; a positive's negatives follow each other in `neg`, the
/// positives' order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LinkBatch {
    pub pos: Vec<u32>,
    pub neg: Vec<u32>,
    /// Every end of the pairs, sorted and distinct: the plan's targets (made once with the
    /// batch; every rank of a co-batch step looks its rows up in every server's).
    pub targets: Vec<u32>,
}

impl LinkSeeds<'_> {
    /// Every supervision edge's source in NEW ids (what the edges are dealt to ranks by).
    pub fn sources(&self) -> Vec<u32> {
        self.task
            .split
            .train
            .chunks_exact(2)
            .map(|p| self.old_to_new[p[0] as usize])
            .collect()
    }

    /// The pairs of supervision edges `indices` in epoch `epoch` (1-based, as the ranks and
    /// mode single count): the edges and their negatives, mode single's draw for them.
    pub fn batch(&self, indices: &[u32], epoch: u64) -> LinkBatch {
        let split = &self.task.split;
        let n = self.old_to_new.len() as u32;
        let neg = link::Negatives::new(
            self.task.negatives,
            split.negative_destinations(n),
            self.seed,
            epoch,
        )
        .at(split.train, indices);
        let (pos, neg) = self.pairs(indices, neg);
        let mut targets: Vec<u32> = pos.iter().chain(&neg).copied().collect();
        targets.sort_unstable();
        targets.dedup();
        LinkBatch { pos, neg, targets }
    }

    /// Supervision edges `indices` and their negatives `neg` (ORIGINAL ids), in NEW ids.
    fn pairs(&self, indices: &[u32], mut neg: Vec<u32>) -> (Vec<u32>, Vec<u32>) {
        let train = self.task.split.train;
        let mut pos = Vec::with_capacity(indices.len() * 2);
        for &i in indices {
            let i = i as usize;
            pos.extend_from_slice(&train[2 * i..2 * i + 2]);
        }
        for v in pos.iter_mut().chain(neg.iter_mut()) {
            *v = self.old_to_new[*v as usize];
        }
        (pos, neg)
    }
}

impl LinkSeeds<'_> {
    /// The pairs of server batch `own` of a cluster step whose batches together are `all`
    /// (sorted NEW ids) in epoch `epoch`: every supervision edge from `own` to `all`,
    /// ascending, and their negatives, drawn among the vertices of `all`
    /// ([`link::Negatives::within`]: mode single's draw where it lands inside). The
    /// targets are the whole of `own` (every vertex of it is computed), so batches holding
    /// every vertex are mode single's epoch.
    pub fn batch_inside(&self, own: &[u32], all: &[u32], epoch: u64) -> anyhow::Result<LinkBatch> {
        let index = self
            .by_source
            .as_ref()
            .context("internal: link seeds without their index by source")?;
        let split = &self.task.split;
        let inside = |new: u32| all.binary_search(&new).is_ok();
        let mut edges: Vec<u32> = own
            .iter()
            .flat_map(|&v| index.edges.view().neighbors(v).iter().copied())
            .filter(|&i| inside(self.old_to_new[split.train[2 * i as usize + 1] as usize]))
            .collect();
        edges.sort_unstable();
        let n = self.old_to_new.len() as u32;
        let destinations = split.negative_destinations(n);
        let candidates: Vec<u32> = all
            .iter()
            .map(|&v| index.new_to_old[v as usize])
            .filter(|w| destinations.contains(w))
            .collect();
        let neg = link::Negatives::new(self.task.negatives, destinations, self.seed, epoch).within(
            split.train,
            &edges,
            |w| inside(self.old_to_new[w as usize]),
            &candidates,
        );
        let (pos, neg) = self.pairs(&edges, neg);
        Ok(LinkBatch {
            pos,
            neg,
            targets: own.to_vec(),
        })
    }
}

impl LinkBatch {
    /// Pairs scored (positives and negatives).
    pub fn pairs(&self) -> usize {
        (self.pos.len() + self.neg.len()) / 2
    }

    /// The batch's binary cross-entropy over the embeddings `rows` of its targets (`ids`,
    /// sorted NEW ids, as the plan's inner rows hold them), as this rank's share of a step
    /// scoring `step_pairs` pairs over every rank: the loss sum of its pairs, and
    /// `d(step loss)/d(rows)` and `/d(decoder parameters)` (summed over the ranks, they are
    /// the step's).
    pub fn loss(
        &self,
        (ids, rows): (&[u32], &[f32]),
        decoder: &Decoder,
        step_pairs: usize,
    ) -> anyhow::Result<(f64, Vec<f32>, Vec<f32>)> {
        let local = |pairs: &[u32]| -> anyhow::Result<Vec<u32>> {
            pairs
                .iter()
                .map(|&g| {
                    ids.binary_search(&g).map(|i| i as u32).map_err(|_| {
                        anyhow::anyhow!("internal: an end of a batch's pair ({g}) is no target")
                    })
                })
                .collect()
        };
        let (pos, neg) = (local(&self.pos)?, local(&self.neg)?);
        let mut dz = vec![0f32; rows.len()];
        let mut decoder_grad = vec![0f32; decoder.num_params()];
        let loss_sum = share_of_bce(
            decoder,
            rows,
            (&pos, &neg),
            (&mut dz, &mut decoder_grad),
            step_pairs,
        );
        Ok((loss_sum, dz, decoder_grad))
    }
}

/// Where a rank sits in a co-batch step: its server, and its device of `devices`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CobatchSeat {
    pub server: usize,
    pub device: usize,
    pub devices: usize,
}

/// A co-batch step's binary cross-entropy (modes cob and cluster; `batches[server]`, every
/// server's pairs), given this rank's inner rows `rows` of NEW ids `ids` (its share of its
/// server's targets). The targets' embeddings are gathered by one all-reduce over the step's targets,
/// laid out server after server; this rank scores its share of its server's pairs (its
/// device's run of the positives, with their negatives); a second all-reduce sums the
/// gradients of the embeddings. Returns this rank's loss sum, `d(step loss)/d(rows)` and its
/// part of the decoder's gradient (the caller sums those over the ranks).
pub(crate) fn cobatch_loss(
    ep: &mut Endpoint,
    batches: &[LinkBatch],
    seat: CobatchSeat,
    (ids, rows): (&[u32], &[f32]),
    decoder: &Decoder,
    tag_epoch: u32,
) -> anyhow::Result<(f64, Vec<f32>, Vec<f32>)> {
    let d = decoder.dim();
    let mut first = Vec::with_capacity(batches.len());
    let mut total = 0usize;
    for b in batches {
        first.push(total);
        total += b.targets.len();
    }
    let mine = &batches
        .get(seat.server)
        .context("internal: a co-batch step without this server's pairs")?
        .targets;
    let at = |g: u32| -> anyhow::Result<usize> {
        mine.binary_search(&g)
            .map(|j| first[seat.server] + j)
            .map_err(|_| anyhow::anyhow!("internal: vertex {g} is not a target of its co-batch"))
    };
    let mut z = vec![0f32; total * d];
    let slots: Vec<usize> = ids.iter().map(|&g| at(g)).collect::<anyhow::Result<_>>()?;
    for (&j, row) in slots.iter().zip(rows.chunks_exact(d.max(1))) {
        z[j * d..(j + 1) * d].copy_from_slice(row);
    }
    ep.all_reduce_sum(&mut z, Tag::other(tag_epoch, GATHER_LAYER))
        .context("gathering the co-batches' embeddings for the link decoder")?;
    // This rank's run of its server's positives, and their negatives.
    let batch = &batches[seat.server];
    let positives = batch.pos.len() / 2;
    let k = batch.neg.len() / batch.pos.len().max(1);
    let devices = seat.devices.max(1);
    let run = positives * seat.device / devices..positives * (seat.device + 1) / devices;
    // A pair's end is its server's target in cob (the plan placed it there); in a cluster
    // step it may be another server's batch vertex, whose row the gather holds too.
    let end = |g: u32| -> anyhow::Result<usize> {
        at(g).or_else(|e| {
            batches
                .iter()
                .enumerate()
                .find_map(|(s, b)| b.targets.binary_search(&g).ok().map(|j| first[s] + j))
                .ok_or(e)
        })
    };
    let local = |pairs: &[u32]| -> anyhow::Result<Vec<u32>> {
        pairs.iter().map(|&g| end(g).map(|j| j as u32)).collect()
    };
    let pos = local(&batch.pos[2 * run.start..2 * run.end])?;
    let neg = local(&batch.neg[2 * k * run.start..2 * k * run.end])?;
    let step_pairs: usize = batches.iter().map(LinkBatch::pairs).sum();
    let mut dz = vec![0f32; total * d];
    let mut decoder_grad = vec![0f32; decoder.num_params()];
    let loss_sum = share_of_bce(
        decoder,
        &z,
        (&pos, &neg),
        (&mut dz, &mut decoder_grad),
        step_pairs,
    );
    ep.all_reduce_sum(&mut dz, Tag::other(tag_epoch, GATHER_LAYER))
        .context("summing the link decoder's gradient of the embeddings")?;
    let mut grad = vec![0f32; rows.len()];
    for (&j, out) in slots.iter().zip(grad.chunks_exact_mut(d.max(1))) {
        out.copy_from_slice(&dz[j * d..(j + 1) * d]);
    }
    Ok((loss_sum, grad, decoder_grad))
}
