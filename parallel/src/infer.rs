//! Layer-wise inference across the ranks: after training, every rank computes the final
//! layers of the vertices it owns (its [`Layout`] range) one stage at a time, as
//! `grandis predict` does in one process ([`grandis_trainer::layerwise`]), and writes its
//! rows' predictions (and embeddings) to `.npy` files in the job's output directory. Nothing
//! ever holds a whole layer: a rank keeps its own rows of the current layer in a scratch file
//! and, before each stage that reads neighbours, receives from their home ranks the rows of
//! its halo (the in-neighbours of its range that other ranks own) into a second one. Its
//! blocks then read both, so a stage is exactly the whole graph's convolution restricted to
//! the rank's rows (`tests/infer.rs` checks it against the one-process pass).
//!
//! The exchange: each rank tells every peer which of the peer's vertices it needs (once: the
//! graph does not change between stages); per stage, the rows go in rounds of at most
//! [`round_rows`] rows per peer, so what is in flight stays within the block budget however
//! large the halo. Halo rows are the stage's gathered rows: the narrow aggregated rows of a
//! split stage ([`grandis_models::Model::stage_splits`]), else its input.
//!
//! Files, per rank `r` (global rank = server × devices + device), in the rank's vertex order:
//! `predictions.r.npy` (int64 class ids, or f32 logits), `embeddings.r.npy` (f32, the last
//! stage's input) and `vertices.r.npy` (int64: the dataset's id of each row). They are
//! written under hidden names and renamed once every rank has written its own, so a failed
//! job leaves no partial set behind.
//!
//! The same pass, its last stage's rows handed to the caller instead of a file
//! ([`forward_rank`]), is how batched runs (cob, mb, cluster) evaluate: exactly, each vertex
//! computed once per layer.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use grandis_engine::norm::GlobalScales;
use grandis_engine::Backend;
use grandis_fabric::{Endpoint, Phase, Tag};
use grandis_masking::Layout;
use grandis_models::Model;
use grandis_store::{CsrView, DatasetView, RowReader};
use grandis_trainer::layerwise::{
    layer_rows, scratch_name, stream, Emit, LayerRows, LayerwiseOptions, Predictions, Scratch,
    StagePass, StageReport,
};
use serde::Serialize;

use crate::embedding_shard::EmbeddingShard;

/// What the ranks write (a job's option, declared with the others).
pub use crate::options::InferOptions;

/// Tags of inference traffic carry this epoch: apart from training's and evaluation's.
pub const INFER_EPOCH: u32 = 1 << 30;

/// What one rank's pass did.
#[derive(Debug, Clone, Serialize)]
pub struct RankInference {
    pub rank: usize,
    /// Vertices this rank wrote.
    pub vertices: usize,
    /// In-neighbours of its range owned by other ranks.
    pub halo_rows: usize,
    /// Rows received from other ranks: the halo, once per stage that reads neighbours.
    pub halo_rows_received: u64,
    pub stages: Vec<StageReport>,
    /// Wall seconds of each stage (its row pass, exchange and blocks).
    pub stage_seconds: Vec<f64>,
    /// Of those, seconds spent exchanging halo rows.
    pub exchange_seconds: f64,
    /// Bytes this rank sent to ranks on other servers (rows and requests).
    pub bytes_inter_server: u64,
    /// Bytes this rank sent to the other ranks of its server.
    pub bytes_intra_server: u64,
    pub seconds: f64,
}

/// What a layer-wise pass across the ranks reads, prediction and evaluation alike.
pub(crate) struct PassInputs<'a> {
    /// The graph in new ids, its layout and id map.
    pub part: &'a crate::PartitionedGraph,
    /// The dataset in original ids (stage 0 reads its features).
    pub view: DatasetView<'a>,
    pub scales: &'a GlobalScales,
    /// Bytes one block may use on a rank.
    pub block_budget: u64,
}

impl<'a> PassInputs<'a> {
    /// The inputs of a pass of `popts`'s run with `local_ranks` ranks in this process: blocks
    /// of at most half a rank's memory budget unless `block_budget` says otherwise.
    pub fn new(
        popts: &crate::ParallelOptions,
        part: &'a crate::PartitionedGraph,
        view: DatasetView<'a>,
        scales: &'a GlobalScales,
        local_ranks: usize,
        block_budget: Option<u64>,
    ) -> anyhow::Result<Self> {
        let block_budget = match (block_budget, popts.job.device_memory) {
            (Some(b), _) => b,
            (None, Some(memory)) => memory / 2,
            (None, None) => crate::default_budget(&popts.machine.compute, 1, local_ranks)?.0 / 2,
        };
        Ok(PassInputs {
            part,
            view,
            scales,
            block_budget,
        })
    }
}

/// The inputs every rank of a process shares for the inference after training.
pub(crate) struct InferShared<'a> {
    pub opts: InferOptions,
    pub pass: PassInputs<'a>,
}

impl<'a> InferShared<'a> {
    /// The inputs of `popts`'s inference (None without one) for `local_ranks` ranks in this
    /// process.
    pub fn new(
        popts: &'a crate::ParallelOptions,
        part: &'a crate::PartitionedGraph,
        view: DatasetView<'a>,
        scales: &'a GlobalScales,
        local_ranks: usize,
    ) -> anyhow::Result<Option<Self>> {
        let Some(opts) = popts.infer() else {
            return Ok(None);
        };
        let pass = PassInputs::new(popts, part, view, scales, local_ranks, opts.block_budget)?;
        Ok(Some(InferShared { opts, pass }))
    }
}

/// Runs the pass on one rank with its trained `model`, writes its files and returns what it
/// did. Every rank of the job must call it (the exchanges pair up).
pub(crate) fn infer_rank<B: Backend>(
    b: &B,
    model: &Model<B>,
    ep: &mut Endpoint,
    sh: &InferShared<'_>,
    embeddings: Option<&EmbeddingShard>,
) -> anyhow::Result<RankInference> {
    let start = Instant::now();
    let opts = &sh.opts;
    let rank = ep.rank();
    if opts.embeddings && model.num_stages() < 2 {
        bail!("the model has a single stage: its input is the features, there are no embeddings to write");
    }
    std::fs::create_dir_all(&opts.dir)
        .with_context(|| format!("creating the prediction directory {}", opts.dir.display()))?;
    let own = sh.pass.part.layout.range(rank);
    let own = own.start as usize..own.end as usize;
    let n_own = own.len();
    let pass = Pass {
        what: "predict",
        owner: rank,
        epoch: INFER_EPOCH,
        scratch_dir: &opts.dir,
        keep_embeddings: opts.embeddings,
        // Nothing samples the graph any more: its pages may go once read.
        release_rows: true,
        node_embeddings: embeddings,
    };
    let predictions = Scratch(opts.dir.join(scratch_name("predictions", 0, Some(rank))));
    let class_ids = opts.kind == Predictions::ClassIds;
    let passed = pass_rank(b, model, ep, &sh.pass, &pass, &mut |cols, produce| {
        stream(
            &predictions.0,
            n_own,
            cols,
            class_ids.then_some(cols),
            |emit| produce(emit),
        )
    })?;
    let mut outputs = vec![(predictions, opts.file("predictions", rank))];
    if let Some(embeddings) = passed.embeddings {
        outputs.push((embeddings, opts.file("embeddings", rank)));
    }
    let vertices = Scratch(opts.dir.join(scratch_name("vertices", 0, Some(rank))));
    let ids: Vec<i64> = sh.pass.part.new_to_old[own]
        .iter()
        .map(|&v| v as i64)
        .collect();
    grandis_npy::write_npy(&vertices.0, &[n_own as u64], &ids)?;
    outputs.push((vertices, opts.file("vertices", rank)));
    // Every rank has written its files: only now do any of them take their names.
    ep.barrier(Tag::new(INFER_EPOCH, 0, Phase::Other))
        .context("waiting for every rank's predictions")?;
    for (scratch, target) in outputs {
        scratch
            .persist(&target)
            .with_context(|| format!("renaming {} into place", target.display()))?;
    }
    let counters = ep.counters();
    let traffic = counters.epoch(INFER_EPOCH);
    Ok(RankInference {
        rank,
        vertices: n_own,
        halo_rows: passed.halo_rows,
        halo_rows_received: passed.halo_rows_received,
        stages: passed.stages,
        stage_seconds: passed.stage_seconds,
        exchange_seconds: passed.exchange_seconds,
        bytes_inter_server: traffic.map_or(0, |t| t.bytes_inter_server),
        bytes_intra_server: traffic.map_or(0, |t| t.bytes_intra_server),
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The whole graph's forward pass (dropout off) under `model` as it stands, on one rank:
/// the output rows of the vertices it owns go to `rows` in their (new) id order. Its traffic
/// carries `epoch` in its tags; its layers pass through scratch files in the system's
/// temporary directory (`TMPDIR`). Every rank of the job must call it (the exchanges pair
/// up). This is how batched runs evaluate: each vertex computed once per layer, where exact
/// co-batches recompute the overlapping closures of every batch.
pub(crate) fn forward_rank<B: Backend>(
    b: &B,
    (model, embeddings): (&Model<B>, Option<&EmbeddingShard>),
    ep: &mut Endpoint,
    inputs: &PassInputs<'_>,
    epoch: u32,
    rows: &mut Emit<'_>,
) -> anyhow::Result<()> {
    // Scratch names are unique per process and owner: other jobs of this process (tests, a
    // daemon's runs) evaluate into the same directory.
    static PASSES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir();
    let pass = Pass {
        what: "evaluate",
        owner: PASSES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        epoch,
        scratch_dir: &dir,
        keep_embeddings: false,
        // Training goes on sampling the graph, kept resident for it.
        release_rows: false,
        node_embeddings: embeddings,
    };
    pass_rank(b, model, ep, inputs, &pass, &mut |_, produce| produce(rows))?;
    Ok(())
}

/// A pass's own settings.
struct Pass<'p> {
    /// Names its progress lines.
    what: &'static str,
    /// Tells its scratch files from other passes' in the same directory and process.
    owner: usize,
    /// The epoch its traffic's tags carry.
    epoch: u32,
    /// Where its scratch files go.
    scratch_dir: &'p Path,
    /// Hand back the last stage's input (the embeddings) instead of removing it.
    keep_embeddings: bool,
    /// Let the graph's mapped pages go behind each block.
    release_rows: bool,
    /// This rank's rows of the learnable node embeddings: stage 0 reads them after the
    /// features (their owners' rows reach the halo with the features).
    node_embeddings: Option<&'p EmbeddingShard>,
}

impl Pass<'_> {
    /// The scratch file of `what` of stage `stage`.
    fn scratch(&self, what: &str, stage: usize) -> PathBuf {
        self.scratch_dir
            .join(scratch_name(what, stage, Some(self.owner)))
    }
}

/// What a pass did on a rank.
struct Passed {
    halo_rows: usize,
    halo_rows_received: u64,
    stages: Vec<StageReport>,
    stage_seconds: Vec<f64>,
    exchange_seconds: f64,
    /// The last stage's input, when kept.
    embeddings: Option<Scratch>,
}

/// Produces a stage's rows into the sink it is given, returning the stage's report.
type Produce<'p> = dyn FnMut(&mut Emit<'_>) -> anyhow::Result<StageReport> + 'p;

/// Takes the last stage's rows: called once with the stage's width and its producer.
type LastStage<'l> = dyn FnMut(usize, &mut Produce<'_>) -> anyhow::Result<StageReport> + 'l;

/// The stages of `model` on the vertices rank `ep` owns, one at a time: each reads the rank's
/// rows of the previous one (stage 0 the features) and, when it reads neighbours, the halo's
/// rows received from their owners. Every stage but the last writes a scratch file; the
/// last one's rows go to `last`.
fn pass_rank<B: Backend>(
    b: &B,
    model: &Model<B>,
    ep: &mut Endpoint,
    inputs: &PassInputs<'_>,
    pass: &Pass<'_>,
    last_stage: &mut LastStage<'_>,
) -> anyhow::Result<Passed> {
    let rank = ep.rank();
    let part = inputs.part;
    let (graph, layout, new_to_old) = (part.graph.view(), &part.layout, &part.new_to_old);
    let release = |rows: Range<usize>| {
        if pass.release_rows {
            part.graph.release_rows(rows)
        }
    };
    let range = layout.range(rank);
    let own = range.start as usize..range.end as usize;
    let stages = model.num_stages();
    let reads_neighbours = (0..stages).any(|s| model.stage_reads_neighbors(s));
    // Who needs what, once: the halo of this range by owner, and the rows each peer needs.
    let halo = if reads_neighbours {
        halo_of(graph, own.clone())
    } else {
        Vec::new()
    };
    let plan = ExchangePlan::agree(ep, layout, &halo, pass.epoch)?;
    let lw = LayerwiseOptions {
        block_budget: inputs.block_budget,
        max_block_rows: None,
        scratch_dir: pass.scratch_dir.to_path_buf(),
    };
    let stage_pass = StagePass {
        b,
        model,
        graph,
        scales: reads_neighbours.then_some(inputs.scales),
        vertex_ids: Some(new_to_old),
        types: inputs.view.types,
        release: &release,
        opts: &lw,
    };
    let features = Features {
        view: inputs.view,
        new_to_old,
        own: own.clone(),
        embeddings: pass.node_embeddings,
    };
    // This rank's rows of the current stage's input: the features, then each stage's output
    // (its file removed once the next stage has read it, unless kept).
    let mut input: Box<dyn LayerRows + '_> = Box::new(features);
    let mut input_file: Option<Scratch> = None;
    let mut passed = Passed {
        halo_rows: halo.len(),
        halo_rows_received: 0,
        stages: Vec::with_capacity(stages),
        stage_seconds: Vec::with_capacity(stages),
        exchange_seconds: 0.0,
        embeddings: None,
    };
    let n_own = own.len();
    for s in 0..stages {
        let stage_start = Instant::now();
        let (_, d_out) = model.stage_dims(s);
        let last = s + 1 == stages;
        let split = model.stage_splits(s);
        let mut rows_pass_seconds = 0.0;
        let mut progress = grandis_telemetry::Progress::new(
            format!("{}: rank {rank}, stage {}/{stages}", pass.what, s + 1),
            Some(n_own as u64),
        );
        // A splitting stage first computes its own vertices' aggregated rows.
        let rows_file = match model.stage_neighbour_width(s).filter(|_| split) {
            Some(w) => {
                let t = Instant::now();
                let p = pass.scratch("rows", s);
                let scratch = Scratch(p.clone());
                stream(&p, n_own, w, None, |emit| {
                    stage_pass.neighbour_rows(s, input.as_ref(), own.clone(), emit, &mut progress)
                })?;
                rows_pass_seconds = t.elapsed().as_secs_f64();
                Some((OwnRows::open(&p, own.clone(), w)?, scratch))
            }
            None => None,
        };
        // The rows the blocks gather for their sources, with the halo's from its owners.
        let gathered: &dyn LayerRows = match &rows_file {
            Some((rows, _)) => rows,
            None => input.as_ref(),
        };
        let halo_rows = if model.stage_reads_neighbors(s) {
            let p = pass.scratch("halo", s);
            let scratch = Scratch(p.clone());
            let t = Instant::now();
            plan.exchange(ep, s, gathered, &p, &lw)
                .with_context(|| format!("exchanging the halo rows of stage {s}"))?;
            passed.exchange_seconds += t.elapsed().as_secs_f64();
            passed.halo_rows_received += halo.len() as u64;
            Some((layer_rows(&p, halo.len(), gathered.cols())?, scratch))
        } else {
            None
        };
        let with_halo = RankRows {
            own: gathered,
            halo: halo_rows.as_ref().map(|(r, _)| (halo.as_slice(), r)),
        };
        let own_input = RankRows {
            own: input.as_ref(),
            halo: None,
        };
        let (block_input, block_rows): (&dyn LayerRows, Option<&dyn LayerRows>) = match &rows_file {
            Some(_) => (&own_input, Some(&with_halo)),
            None => (&with_halo, None),
        };
        let mut produce = |emit: &mut Emit<'_>| {
            stage_pass.blocks(
                s,
                split,
                block_input,
                block_rows,
                own.clone(),
                emit,
                &mut progress,
            )
        };
        let failed = || format!("stage {s} of the layer-wise {} on rank {rank}", pass.what);
        let mut output = None;
        let mut report = if last {
            last_stage(d_out, &mut produce).with_context(failed)?
        } else {
            let path = pass.scratch("layer", s);
            output = Some(Scratch(path.clone()));
            stream(&path, n_own, d_out, None, produce).with_context(failed)?
        };
        progress.finish();
        report.rows_pass_seconds = rows_pass_seconds;
        passed.stages.push(report);
        passed
            .stage_seconds
            .push(stage_start.elapsed().as_secs_f64());
        drop((halo_rows, rows_file));
        if let Some(output) = output {
            input = Box::new(OwnRows::open(&output.0, own.clone(), d_out)?);
            // The previous input's file goes now that nothing reads it.
            input_file = Some(output);
        }
    }
    drop(input);
    if pass.keep_embeddings && stages >= 2 {
        passed.embeddings = input_file.take();
    }
    Ok(passed)
}

/// The in-neighbours of `own` outside it, ascending (a bitmap over the graph: 1 bit a
/// vertex, where collecting the edges first would take 4 bytes an edge).
fn halo_of(graph: CsrView<'_>, own: Range<usize>) -> Vec<u32> {
    let n = graph.num_vertices();
    let mut marked = vec![0u64; n.div_ceil(64)];
    for v in own.clone() {
        for &u in graph.neighbors(v as u32) {
            let u = u as usize;
            if !own.contains(&u) {
                marked[u / 64] |= 1 << (u % 64);
            }
        }
    }
    let mut halo = Vec::new();
    for (w, &bits) in marked.iter().enumerate() {
        let mut bits = bits;
        while bits != 0 {
            halo.push((w * 64 + bits.trailing_zeros() as usize) as u32);
            bits &= bits - 1;
        }
    }
    halo
}

/// Rows per peer in one round of a stage's exchange: in flight at once are a round's rows to
/// and from every peer, which the block budget bounds.
fn round_rows(budget: u64, cols: usize, peers: usize) -> usize {
    let per_row = (2 * peers.max(1) * cols.max(1) * 4) as u64;
    ((budget / per_row) as usize).clamp(1, 1 << 20)
}

/// Which rows this rank receives from and sends to each peer.
struct ExchangePlan {
    /// (peer, range of the halo it owns), ascending peers.
    recv: Vec<(usize, Range<usize>)>,
    /// (peer, own vertices it asked for, ascending).
    send: Vec<(usize, Vec<u32>)>,
    /// The epoch the pass's tags carry.
    epoch: u32,
}

impl ExchangePlan {
    /// Sends every peer the ids of its vertices in `halo` and receives theirs (tagged with
    /// `epoch`, as the exchanges are).
    fn agree(ep: &mut Endpoint, layout: &Layout, halo: &[u32], epoch: u32) -> anyhow::Result<Self> {
        let me = ep.rank();
        let tag = Tag::new(epoch, 0, Phase::Other);
        let own = layout.range(me);
        let mut recv = Vec::new();
        let mut lo = 0;
        for peer in 0..ep.world() {
            let r = layout.range(peer);
            let hi = lo + halo[lo..].partition_point(|&v| v < r.end);
            if peer != me {
                let ids: Vec<u8> = bytemuck::cast_slice(&halo[lo..hi]).to_vec();
                ep.send_bytes(peer, ids, tag)?;
                recv.push((peer, lo..hi));
            } else if hi != lo {
                bail!("the halo holds vertices of this rank's own range");
            }
            lo = hi;
        }
        let mut send = Vec::new();
        for peer in (0..ep.world()).filter(|&p| p != me) {
            let bytes = ep.recv_bytes(peer, tag)?;
            if bytes.len() % 4 != 0 {
                bail!(
                    "rank {peer} asked for rows in a message of {} bytes, not whole ids",
                    bytes.len()
                );
            }
            let ids: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if !ids.is_sorted() || ids.iter().any(|v| !own.contains(v)) {
                bail!(
                    "rank {peer} asked for rows that are not this rank's ({:?}) in ascending order",
                    own
                );
            }
            send.push((peer, ids));
        }
        Ok(ExchangePlan { recv, send, epoch })
    }

    /// Stage `stage`'s exchange: sends every peer its rows of `rows`, and writes the rows
    /// received into `path` (f32 `.npy`, halo order), in bounded rounds.
    fn exchange(
        &self,
        ep: &mut Endpoint,
        stage: usize,
        rows: &dyn LayerRows,
        path: &Path,
        opts: &LayerwiseOptions,
    ) -> anyhow::Result<()> {
        use std::os::unix::fs::FileExt;
        let cols = rows.cols();
        let halo_len = self.recv.last().map_or(0, |(_, r)| r.end);
        let header =
            grandis_npy::encode_header(grandis_npy::DType::F32, &[halo_len as u64, cols as u64]);
        let file =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        file.write_all_at(&header, 0)
            .and_then(|()| file.set_len((header.len() + halo_len * cols * 4) as u64))
            .with_context(|| format!("writing {}", path.display()))?;
        let per_round = round_rows(opts.block_budget, cols, self.send.len());
        let rounds = |n: usize| n.div_ceil(per_round);
        let total = self
            .send
            .iter()
            .map(|(_, ids)| rounds(ids.len()))
            .chain(self.recv.iter().map(|(_, r)| rounds(r.len())))
            .max()
            .unwrap_or(0);
        let tag = Tag::new(self.epoch, stage as u32, Phase::Forward);
        for round in 0..total {
            let at = round * per_round;
            for (peer, ids) in &self.send {
                if at < ids.len() {
                    let ids = &ids[at..(at + per_round).min(ids.len())];
                    let mut out = vec![0f32; ids.len() * cols];
                    rows.gather(ids, &mut out)?;
                    ep.send(*peer, out, tag)?;
                }
            }
            for (peer, r) in &self.recv {
                if at < r.len() {
                    let n = per_round.min(r.len() - at);
                    let got = ep.recv_exact(*peer, n * cols, tag)?;
                    let offset = header.len() + (r.start + at) * cols * 4;
                    file.write_all_at(bytemuck::cast_slice(&got), offset as u64)
                        .with_context(|| format!("writing {}", path.display()))?;
                }
            }
        }
        Ok(())
    }
}

/// Stage 0's input of this rank's vertices: their features, read from the dataset in its own
/// ids, then their learnable embedding rows when the model has them.
struct Features<'a> {
    view: DatasetView<'a>,
    new_to_old: &'a [u32],
    own: Range<usize>,
    embeddings: Option<&'a EmbeddingShard>,
}

impl LayerRows for Features<'_> {
    fn cols(&self) -> usize {
        self.view.feature_dim + self.embeddings.map_or(0, EmbeddingShard::dim)
    }

    fn gather(&self, ids: &[u32], out: &mut [f32]) -> anyhow::Result<()> {
        if let Some(v) = ids.iter().find(|&&v| !self.own.contains(&(v as usize))) {
            bail!("vertex {v} is not this rank's (it owns {:?})", self.own);
        }
        let old: Vec<u32> = ids.iter().map(|&v| self.new_to_old[v as usize]).collect();
        let Some(shard) = self.embeddings else {
            return Ok(self.view.gather_features(&old, out)?);
        };
        let (f, w) = (self.view.feature_dim, self.cols());
        let mut features = vec![0f32; ids.len() * f];
        self.view.gather_features(&old, &mut features)?;
        for (i, (&v, row)) in ids.iter().zip(out.chunks_exact_mut(w.max(1))).enumerate() {
            row[..f].copy_from_slice(&features[i * f..(i + 1) * f]);
            row[f..].copy_from_slice(
                shard
                    .home_row(v)
                    .with_context(|| format!("vertex {v}'s embedding is not this rank's"))?,
            );
        }
        Ok(())
    }
}

/// A layer file holding the rows of this rank's range `own`, looked up by vertex id.
struct OwnRows {
    reader: RowReader,
    own: Range<usize>,
}

impl OwnRows {
    fn open(path: &Path, own: Range<usize>, cols: usize) -> anyhow::Result<Self> {
        Ok(OwnRows {
            reader: layer_rows(path, own.len(), cols)?,
            own,
        })
    }
}

impl LayerRows for OwnRows {
    fn cols(&self) -> usize {
        self.reader.cols()
    }

    fn gather(&self, ids: &[u32], out: &mut [f32]) -> anyhow::Result<()> {
        let lo = self.own.start as u32;
        let local: Vec<u32> = ids
            .iter()
            .map(|&v| match self.own.contains(&(v as usize)) {
                true => Ok(v - lo),
                false => Err(anyhow::anyhow!(
                    "vertex {v} is not this rank's (it owns {:?})",
                    self.own
                )),
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(self.reader.gather(&local, out)?)
    }
}

/// A stage's rows on one rank: its own (`own`, by vertex id) and, where received, its
/// halo's (`halo`: the sorted halo ids and their rows in that order).
struct RankRows<'a> {
    own: &'a dyn LayerRows,
    halo: Option<(&'a [u32], &'a RowReader)>,
}

impl LayerRows for RankRows<'_> {
    fn cols(&self) -> usize {
        self.own.cols()
    }

    fn gather(&self, ids: &[u32], out: &mut [f32]) -> anyhow::Result<()> {
        let cols = self.cols();
        let Some((halo, rows)) = self.halo else {
            return self.own.gather(ids, out);
        };
        // Split the request by where each row lives, read both sides in their order, and put
        // the rows back in the request's.
        let (mut own_at, mut own_ids, mut halo_at, mut halo_pos) = (vec![], vec![], vec![], vec![]);
        for (i, &v) in ids.iter().enumerate() {
            match halo.binary_search(&v) {
                Ok(p) => {
                    halo_at.push(i);
                    halo_pos.push(p as u32);
                }
                Err(_) => {
                    own_at.push(i);
                    own_ids.push(v);
                }
            }
        }
        let mut buf = vec![0f32; own_ids.len() * cols];
        self.own.gather(&own_ids, &mut buf)?;
        for (&i, row) in own_at.iter().zip(buf.chunks_exact(cols.max(1))) {
            out[i * cols..(i + 1) * cols].copy_from_slice(row);
        }
        let mut buf = vec![0f32; halo_pos.len() * cols];
        rows.gather(&halo_pos, &mut buf)?;
        for (&i, row) in halo_at.iter().zip(buf.chunks_exact(cols.max(1))) {
            out[i * cols..(i + 1) * cols].copy_from_slice(row);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_halo_is_every_outside_in_neighbour_once_ascending() {
        // 0 <- {3, 5}, 1 <- {0, 3}, 2 <- {4}, rows 3..6 empty.
        let offsets = vec![0u64, 2, 4, 5, 5, 5, 5];
        let indices = vec![3u32, 5, 0, 3, 4];
        let g = CsrView {
            offsets: &offsets,
            indices: &indices,
        };
        assert_eq!(halo_of(g, 0..2), vec![3, 5]);
        assert_eq!(halo_of(g, 0..3), vec![3, 4, 5]);
        assert_eq!(halo_of(g, 3..6), Vec::<u32>::new());
    }

    #[test]
    fn rounds_stay_within_the_budget() {
        assert_eq!(round_rows(1 << 20, 64, 3), (1 << 20) / (2 * 3 * 64 * 4));
        assert_eq!(round_rows(0, 64, 3), 1);
        assert_eq!(round_rows(u64::MAX, 1, 0), 1 << 20);
    }
}
