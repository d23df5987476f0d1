//! Layer-wise full-graph inference for graphs whose features and embeddings do not fit in
//! memory (what `grandis predict` runs).
//!
//! A mini-batch forward pass recomputes a vertex's neighbourhood for every target that reads
//! it; a whole-graph forward pass holds every layer of every vertex at once. Layer-wise
//! inference does neither: it computes stage 0 for all vertices, writes the result to a file,
//! then stage 1 from that file, and so on (the approach DGL and PyG document for large-graph
//! inference, and what GraphTheta and CATGNN use on billion-edge graphs). Within a stage the
//! destination vertices are cut into contiguous **blocks**, each as large as the memory budget
//! allows: a block's sources are its own rows and the in-neighbours outside it (the halo), whose
//! rows are gathered from the mapped input, so a block is exactly the full graph's convolution
//! restricted to its rows ([`grandis_engine::norm::range_block`] keeps the global
//! normalisation). Results are therefore the whole-graph forward pass's, block size aside
//! (test: `layerwise_equals_whole_graph`).
//!
//! Stages that aggregate through a weight are **split** ([`Model::stage_splits`]): a first,
//! row-local pass computes once per vertex the rows the convolution aggregates (`h W_neigh`
//! when that is the narrow side, or the pre-op'd input) into a scratch file, and the blocks
//! then gather those rows for their sources and only their own input rows. Without the
//! split, every block would transform its halo rows again (on a graph without locality,
//! the halos of all blocks add up to several times the vertex count) and would gather the
//! input's full width: a 64-feature layer into 16 hidden columns gathers a quarter of the
//! bytes split. Attention stages run whole.
//!
//! Memory: the budget bounds one block ([`block_bytes`]); besides it the pass keeps O(V)
//! state (normalisation scales, a bitmap of the block's sources). Input rows are gathered by
//! positioned reads ([`RowReader`]), not through a mapping, and the adjacency's mapped pages
//! are released behind every block, so the resident set does not grow with the graph: the
//! page cache holds what is hot and the kernel may drop it. Layer outputs are streamed to
//! `.npy` files (intermediate ones in a scratch directory, removed as soon as the next layer
//! is written). I/O: a block reads its own rows sequentially and its halo in ascending id
//! order, nearby rows coalesced; graphs ordered for locality (`grandis data reorder`, a
//! partition's relabelled graph) have small halos and read little more than once.

use crate::{argmax, load_checked};
use anyhow::{bail, Context};
use grandis_engine::norm::{global_scales, range_block, GlobalScales};
use grandis_engine::{Backend, BlockGraph};
use grandis_models::{Model, RelationGraphs, StageCtx};
use grandis_npy::NpyFile;
use grandis_store::{CsrView, Dataset, RowReader};
use rayon::prelude::*;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How the pass may use memory and disk.
#[derive(Debug, Clone)]
pub struct LayerwiseOptions {
    /// Bytes one block may use ([`block_bytes`]); a vertex whose block alone exceeds it is an
    /// error before anything is written.
    pub block_budget: u64,
    /// At most this many destination rows per block (`None`: as many as the budget allows).
    pub max_block_rows: Option<usize>,
    /// Where intermediate layers are written (each removed once the next one is written).
    pub scratch_dir: PathBuf,
}

/// What the last stage's output is written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Predictions {
    /// int64, one class id (the argmax logit) per vertex.
    ClassIds,
    /// f32, vertices x classes.
    Logits,
}

/// The files a pass writes.
#[derive(Debug, Clone)]
pub struct LayerwiseOutputs {
    pub predictions: PathBuf,
    pub kind: Predictions,
    /// The input of the last stage (f32, vertices x its width): the vertex embeddings.
    pub embeddings: Option<PathBuf>,
}

/// What one stage's pass did.
#[derive(Debug, Clone, Serialize)]
pub struct StageReport {
    pub stage: usize,
    pub d_in: usize,
    pub d_out: usize,
    /// Columns gathered per source row: the stage's aggregated rows when it splits (see
    /// [`Model::stage_splits`]), else its input.
    pub gathered_cols: usize,
    /// Seconds of the row-local pass that computed the aggregated rows (split stages).
    pub rows_pass_seconds: f64,
    pub blocks: usize,
    /// Source rows gathered over all blocks (the excess over the vertex count is halo rows
    /// read again by later blocks).
    pub source_rows: u64,
    pub edges: u64,
    /// The largest block's [`block_bytes`].
    pub largest_block_bytes: u64,
    pub seconds: f64,
}

/// What a whole pass did.
#[derive(Debug, Clone, Serialize)]
pub struct LayerwiseReport {
    pub vertices: usize,
    pub stages: Vec<StageReport>,
    pub seconds: f64,
}

/// Runs the model stored in `checkpoint` over every vertex of `dataset` one stage at a time
/// on backend `b` and writes `outputs`. Nothing is left behind on failure: outputs are
/// written atomically and the scratch files are removed.
pub fn predict_layerwise<B: Backend>(
    b: &B,
    dataset: &Dataset,
    checkpoint: &Path,
    outputs: &LayerwiseOutputs,
    opts: &LayerwiseOptions,
) -> anyhow::Result<LayerwiseReport> {
    let start = Instant::now();
    let view = dataset.view();
    let ck = load_checked(&view, checkpoint)?;
    if matches!(ck.objective(), crate::Objective::Link { .. })
        && outputs.kind == Predictions::ClassIds
    {
        bail!(
            "{} was trained for link prediction: its outputs are vertex embeddings, not \
             classes (write them as logits)",
            checkpoint.display()
        );
    }
    let mut model = Model::new(b, ck.model.clone())?;
    ck.restore(b, &mut model, false)?;
    let stages = model.num_stages();
    if outputs.embeddings.is_some() && stages < 2 {
        bail!("the model has a single stage: its input is the features, there are no embeddings to write");
    }
    let n = view.num_vertices();
    let scales = (0..stages)
        .any(|s| model.stage_reads_neighbors(s))
        .then(|| global_scales(view.graph, grandis_models::aggregation(ck.model.kind)));
    // The scales read every row's offsets through the mapping (8 bytes a vertex): let go.
    dataset.release_rows(0..n);
    let release = |rows: std::ops::Range<usize>| dataset.release_rows(rows);
    let pass = StagePass {
        b,
        model: &model,
        graph: view.graph,
        scales: scales.as_ref(),
        vertex_ids: None,
        types: view.types,
        release: &release,
        opts,
    };
    let mut input = dataset.feature_rows()?;
    let mut reports = Vec::with_capacity(stages);
    // Held for its Drop: the scratch file the current input lives in, removed once the next
    // stage is written (or when the pass returns).
    let mut _input_scratch: Option<Scratch> = None;
    if let Some(emb) = ck.node_embeddings(n, false)? {
        // The model reads the features and then its learnt columns: one input file for the
        // first stage, written once.
        let p = opts.scratch_dir.join(scratch_name("input", 0, None));
        let scratch = Scratch(p.clone());
        let cols = view.feature_dim + emb.dim();
        stream(&p, n, cols, None, |emit| write_input(&input, &emb, n, emit))?;
        input = layer_rows(&p, n, cols)?;
        _input_scratch = Some(scratch);
    }
    for s in 0..stages {
        let (d_in, d_out) = model.stage_dims(s);
        if input.rows() != n as u64 || input.cols() != d_in {
            bail!(
                "stage {s} expects {n} x {d_in} input values, found {} x {}",
                input.rows(),
                input.cols()
            );
        }
        let last = s + 1 == stages;
        let (path, scratch) = if last {
            (outputs.predictions.clone(), None)
        } else if let (true, Some(e)) = (s + 2 == stages, &outputs.embeddings) {
            (e.clone(), None)
        } else {
            let p = opts.scratch_dir.join(scratch_name("layer", s, None));
            (p.clone(), Some(Scratch(p)))
        };
        // A splitting stage first computes, once per vertex, the rows its blocks gather.
        let split = model.stage_splits(s);
        let mut rows_pass_seconds = 0.0;
        let rows_file = match model.stage_neighbour_width(s).filter(|_| split) {
            Some(w) => {
                let p = opts.scratch_dir.join(scratch_name("rows", s, None));
                let t = Instant::now();
                let mut progress = grandis_telemetry::Progress::new(
                    format!("predict: stage {}/{stages}, aggregated rows", s + 1),
                    Some(n as u64),
                );
                let scratch = Scratch(p.clone());
                stream(&p, n, w, None, |emit| {
                    pass.neighbour_rows(s, &input, 0..n, emit, &mut progress)
                })?;
                progress.finish();
                rows_pass_seconds = t.elapsed().as_secs_f64();
                Some((layer_rows(&p, n, w)?, scratch))
            }
            None => None,
        };
        let mut progress = grandis_telemetry::Progress::new(
            format!("predict: stage {}/{stages}", s + 1),
            Some(n as u64),
        );
        let ids = (last && outputs.kind == Predictions::ClassIds).then_some(d_out);
        let mut report = stream(&path, n, d_out, ids, |emit| {
            pass.blocks(
                s,
                split,
                &input,
                rows_file.as_ref().map(|(r, _)| r as &dyn LayerRows),
                0..n,
                emit,
                &mut progress,
            )
        })
        .with_context(|| format!("stage {s} of layer-wise inference"))?;
        progress.finish();
        drop(rows_file);
        report.rows_pass_seconds = rows_pass_seconds;
        tracing::info!(
            "stage {s} ({d_in} -> {d_out} columns, gathering {}): {} blocks, {} source rows, {:.1} s",
            report.gathered_cols,
            report.blocks,
            report.source_rows,
            report.seconds + rows_pass_seconds
        );
        reports.push(report);
        if !last {
            input = layer_rows(&path, n, d_out)?;
            // The previous input's file goes now that nothing reads it.
            _input_scratch = scratch;
        }
    }
    Ok(LayerwiseReport {
        vertices: n,
        stages: reports,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The name of a scratch file holding `what` of `stage`, unique to this process (and to
/// `owner`, when several passes share it: the ranks of one server).
pub fn scratch_name(what: &str, stage: usize, owner: Option<usize>) -> String {
    let owner = owner.map_or(String::new(), |o| format!("-r{o}"));
    format!(".grandis-{what}{stage}-{}{owner}.npy", std::process::id())
}

/// Sink of a stage's output rows, in vertex order.
pub type Emit<'e> = dyn FnMut(&[f32]) -> std::io::Result<()> + 'e;

/// Hands `emit` every vertex's model input in blocks: its row of `features`, then its row of
/// the learnt table `emb`.
fn write_input(
    features: &RowReader,
    emb: &crate::NodeEmbeddings,
    n: usize,
    emit: &mut Emit<'_>,
) -> anyhow::Result<()> {
    const ROWS: usize = 1 << 16;
    let (f, d) = (features.cols(), emb.dim());
    let mut rows = Vec::new();
    let mut block = Vec::new();
    for start in (0..n).step_by(ROWS) {
        let end = (start + ROWS).min(n);
        let ids: Vec<u32> = (start as u32..end as u32).collect();
        rows.resize(ids.len() * f, 0.0);
        features.gather(&ids, &mut rows)?;
        block.clear();
        for (i, v) in (start..end).enumerate() {
            block.extend_from_slice(&rows[i * f..(i + 1) * f]);
            block.extend_from_slice(&emb.table()[v * d..(v + 1) * d]);
        }
        emit(&block)?;
    }
    Ok(())
}

/// Writes the `n x cols` rows `produce` hands over to the `.npy` file `path` (atomically),
/// or with `class_ids = Some(cols)` the argmax of each row as int64. Returns what `produce`
/// returned; its error wins over the writer's.
pub fn stream<R>(
    path: &Path,
    n: usize,
    cols: usize,
    class_ids: Option<usize>,
    produce: impl FnOnce(&mut Emit<'_>) -> anyhow::Result<R>,
) -> anyhow::Result<R> {
    let mut failure = None;
    let mut result = None;
    let run = |emit: &mut Emit<'_>| match produce(emit) {
        Ok(r) => {
            result = Some(r);
            Ok(())
        }
        Err(e) => {
            failure = Some(e);
            Err(std::io::Error::other("the stage failed"))
        }
    };
    let written = match class_ids {
        Some(c) => grandis_npy::write_npy_streamed::<i64>(path, &[n as u64], |emit| {
            run(&mut |rows: &[f32]| {
                let ids: Vec<i64> = rows.chunks_exact(c).map(|r| argmax(r) as i64).collect();
                emit(&ids)
            })
        }),
        None => {
            grandis_npy::write_npy_streamed::<f32>(path, &[n as u64, cols as u64], |emit| run(emit))
        }
    };
    if let Some(e) = failure {
        return Err(e);
    }
    written.with_context(|| format!("writing {}", path.display()))?;
    Ok(result.expect("a stream that was written produced"))
}

/// Bytes one block of `dst` destinations reading `src` source rows over `edges` edges takes
/// at most on a stage mapping `d_in` to `d_out` columns.
///
/// Whole stages (`gathered = None`): the gathered input, its copy on the backend and the
/// stage's pre-op copy of it; the transformed or attention rows of every source (at most
/// `2 d_out` wide); the aggregated input of the destinations; the output, its normalised and
/// activated copies and its download. Split stages (`gathered = Some(w)`): the gathered
/// `w`-column rows and their backend copy; the destinations' input, its backend copy, its
/// pre-op copy and their aggregate; the same outputs. Both: the block graph on the host and
/// on the backend (offsets, edges, scales, global ids).
pub fn block_bytes(
    dst: u64,
    src: u64,
    edges: u64,
    d_in: u64,
    d_out: u64,
    gathered: Option<u64>,
) -> u64 {
    let rows = match gathered {
        None => 3 * src * d_in + 2 * src * d_out + dst * d_in + 4 * dst * d_out,
        Some(w) => 2 * src * w + 4 * dst * d_in + 4 * dst * d_out,
    };
    let graph = 2 * (8 * (dst + 1) + 4 * edges + 4 * (2 * dst + src)) + 3 * 4 * src;
    4 * rows + graph
}

/// Most rows per step of the row-local pass: nothing is shared between its steps, so larger
/// ones only page-fault larger fresh buffers (on the 5M-vertex graph of docs/benchmarks.md,
/// one 5M-row step took 6.4 s, 17 steps of 300k rows 1.8 s).
const ROWS_PASS_STEP: usize = 1 << 18;

/// Rows of one layer (a stage's input, or the rows it aggregates), looked up by vertex id.
/// A whole layer in one file is a [`RowReader`]; a rank of a distributed pass holds its own
/// vertices' rows and the halo rows its peers sent.
pub trait LayerRows: Sync {
    fn cols(&self) -> usize;
    /// Copies row `ids[i]` into `out[i * cols..]`. The ids come as at most a few ascending
    /// runs (a block's own rows, then its sorted halo).
    fn gather(&self, ids: &[u32], out: &mut [f32]) -> anyhow::Result<()>;
}

impl LayerRows for RowReader {
    fn cols(&self) -> usize {
        RowReader::cols(self)
    }

    fn gather(&self, ids: &[u32], out: &mut [f32]) -> anyhow::Result<()> {
        Ok(RowReader::gather(self, ids, out)?)
    }
}

/// A stage's passes over a range of destination vertices of `graph`: the whole graph for
/// [`predict_layerwise`], a rank's own vertices in a distributed pass.
pub struct StagePass<'a, B: Backend> {
    pub b: &'a B,
    pub model: &'a Model<B>,
    pub graph: CsrView<'a>,
    /// Present when some stage reads neighbours.
    pub scales: Option<&'a GlobalScales>,
    /// The id the model sees for each vertex of `graph` (a partitioned graph's original
    /// ids); `None`: the vertex id itself.
    pub vertex_ids: Option<&'a [u32]>,
    /// The dataset's types (typed models split each block by relation).
    pub types: Option<&'a grandis_store::Types>,
    /// Called with each block's destinations once it is done: their adjacency was read
    /// through a mapping, and may be let go.
    pub release: &'a (dyn Fn(std::ops::Range<usize>) + Sync),
    pub opts: &'a LayerwiseOptions,
}

impl<B: Backend> StagePass<'_, B> {
    /// The ids the model sees for graph vertices `ids`.
    fn model_ids(&self, ids: &[u32]) -> Vec<u32> {
        match self.vertex_ids {
            Some(map) => ids.iter().map(|&v| map[v as usize]).collect(),
            None => ids.to_vec(),
        }
    }

    /// The row-local half of splitting stage `s` ([`Model::stage_neighbour_rows`]) for the
    /// vertices of `range`, in row ranges that fit the budget.
    pub fn neighbour_rows(
        &self,
        s: usize,
        input: &dyn LayerRows,
        range: std::ops::Range<usize>,
        emit: &mut Emit<'_>,
        progress: &mut grandis_telemetry::Progress,
    ) -> anyhow::Result<()> {
        let b = self.b;
        let (d_in, _) = self.model.stage_dims(s);
        let w = self
            .model
            .stage_neighbour_width(s)
            .expect("a stage with its own rows");
        // Per row: the input on the host and the backend, its pre-op copy, the rows and
        // their download, the id.
        let per_row = 4 * (3 * d_in + 2 * w) as u64 + 8;
        let step = ((self.opts.block_budget / per_row) as usize).clamp(1, ROWS_PASS_STEP);
        for lo in range.clone().step_by(step) {
            let hi = (lo + step).min(range.end);
            let ids: Vec<u32> = (lo as u32..hi as u32).collect();
            let mut host = vec![0.0f32; ids.len() * d_in];
            input.gather(&ids, &mut host)?;
            let x = b.upload(&host)?;
            drop(host);
            let ids = b.upload_index(&self.model_ids(&ids))?;
            let r = self
                .model
                .stage_neighbour_rows(b, s, &x, hi - lo, &ids)?
                .expect("a stage with a neighbour width has its own rows");
            let mut out = vec![0.0f32; (hi - lo) * w];
            b.download(&r, 0, &mut out)?;
            emit(&out)?;
            progress.inc((hi - lo) as u64);
        }
        Ok(())
    }

    /// Stage `s` over the destinations of `range` in blocks: whole ([`Model::forward_stage`]
    /// on the gathered input rows) or split ([`Model::forward_stage_split`] on the rows
    /// gathered from `rows_file` and the destinations' input rows; without a rows file the
    /// stage aggregates its input, and the gathered rows start with the destinations' own).
    /// `input` (and `rows_file`) must hold the rows of `range` and of every in-neighbour of
    /// it.
    #[allow(clippy::too_many_arguments)]
    pub fn blocks(
        &self,
        s: usize,
        split: bool,
        input: &dyn LayerRows,
        rows_file: Option<&dyn LayerRows>,
        range: std::ops::Range<usize>,
        emit: &mut Emit<'_>,
        progress: &mut grandis_telemetry::Progress,
    ) -> anyhow::Result<StageReport> {
        let start = Instant::now();
        let b = self.b;
        let (d_in, d_out) = self.model.stage_dims(s);
        let n = self.graph.num_vertices();
        let gathered = rows_file.unwrap_or(input);
        let w = gathered.cols();
        let neighbours = self.model.stage_reads_neighbors(s);
        let shape = (d_in as u64, d_out as u64, split.then_some(w as u64));
        let mut planner = BlockPlanner::new(n, neighbours);
        let mut report = StageReport {
            stage: s,
            d_in,
            d_out,
            gathered_cols: w,
            rows_pass_seconds: 0.0,
            blocks: 0,
            source_rows: 0,
            edges: 0,
            largest_block_bytes: 0,
            seconds: 0.0,
        };
        let mut lo = range.start;
        while lo < range.end {
            let blk = planner.next(self.graph, lo..range.end, shape, self.opts)?;
            let dst = blk.dst.clone();
            let (n_dst, n_src) = (dst.len(), dst.len() + blk.halo.len());
            let graph = if neighbours {
                let scales = self
                    .scales
                    .expect("scales exist when a stage reads neighbours");
                let range = dst.start as u32..dst.end as u32;
                range_block(self.graph, scales, range, &blk.halo, |u| {
                    planner.position(u)
                })
                .expect("the planner's halo holds every neighbour outside the block")
            } else {
                no_edges(n_dst)
            };
            let src_ids: Vec<u32> = (dst.start as u32..dst.end as u32)
                .chain(blk.halo.iter().copied())
                .collect();
            // Own rows, then the (sorted) halo: two ascending runs of positioned reads.
            let mut host = vec![0.0f32; n_src * w];
            gathered.gather(&src_ids, &mut host)?;
            let rows = b.upload(&host)?;
            drop(host);
            let own = if split && rows_file.is_some() {
                let mut host = vec![0.0f32; n_dst * d_in];
                input.gather(&src_ids[..n_dst], &mut host)?;
                Some(b.upload(&host)?)
            } else {
                None
            };
            let model_ids = self.model_ids(&src_ids);
            let by_relation = grandis_models::split_block(
                self.model.config.kind,
                &graph,
                self.types,
                &model_ids,
            )?;
            let relations = RelationGraphs::upload(b, by_relation.as_ref())?;
            drop(by_relation);
            let g = b.upload_graph(&graph)?;
            drop(graph);
            let ids = b.upload_index(&model_ids)?;
            drop((src_ids, model_ids));
            let ctx = StageCtx {
                graph: &g,
                typed: relations.as_ref(),
                n_dst,
                n_src,
                global_ids: &ids,
                train: None,
            };
            let y = match (split, &own) {
                (true, own) => {
                    let own = own.as_ref().unwrap_or(&rows);
                    self.model.forward_stage_split(b, s, &ctx, own, &rows)?
                }
                (false, _) => self.model.forward_stage(b, s, &ctx, &rows)?.0,
            };
            drop((rows, own, g, relations, ids));
            let mut out = vec![0.0f32; n_dst * d_out];
            b.download(&y, 0, &mut out)?;
            emit(&out)?;
            planner.finish(&blk);
            // The block's adjacency was read through the mapping: drop it behind the cursor.
            (self.release)(dst.clone());
            report.blocks += 1;
            report.source_rows += n_src as u64;
            report.edges += blk.edges;
            report.largest_block_bytes = report.largest_block_bytes.max(blk.bytes);
            progress.inc(n_dst as u64);
            lo = dst.end;
        }
        report.seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }
}

/// A block graph with `rows` rows and no edges (what row-local stages are handed).
fn no_edges(rows: usize) -> BlockGraph {
    BlockGraph {
        n_dst: rows,
        n_src: rows,
        offsets: vec![0; rows + 1],
        indices: Vec::new(),
        dst_scale: vec![0.0; rows],
        src_scale: None,
        self_scale: None,
    }
}

/// Reads back a layer written as `.npy` (checked to be `n x cols` f32).
pub fn layer_rows(path: &Path, n: usize, cols: usize) -> anyhow::Result<RowReader> {
    let file = NpyFile::open(path)?;
    if file.dtype() != grandis_npy::DType::F32 || file.shape() != [n as u64, cols as u64] {
        bail!(
            "{} holds {} {:?}, expected f32 [{n}, {cols}]",
            path.display(),
            file.dtype(),
            file.shape()
        );
    }
    Ok(RowReader::open(
        path,
        file.data_offset() as u64,
        n as u64,
        cols,
    )?)
}

/// A scratch file, removed when dropped (also when a pass fails half way) unless it was
/// [persisted](Scratch::persist).
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// Keeps the file, renamed to `target`; on failure it is removed as any scratch file.
    pub fn persist(mut self, target: &Path) -> std::io::Result<()> {
        std::fs::rename(&self.0, target)?;
        self.0 = PathBuf::new();
        Ok(())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// One block: destinations `dst` and their in-neighbours outside it, sorted.
struct Block {
    dst: std::ops::Range<usize>,
    halo: Vec<u32>,
    edges: u64,
    bytes: u64,
}

/// Cuts a stage's destinations into the largest blocks that fit the budget, counting each
/// block's distinct sources exactly, and maps its halo vertices to their positions.
struct BlockPlanner {
    /// Per vertex: 0 when not a source of the current block, [`MARKED`] while the block
    /// grows, then `1 + position` in the halo (dense, so that building the block graph looks
    /// each edge up once instead of searching the halo: 4 bytes per vertex).
    slots: Vec<u32>,
    neighbours: bool,
}

const MARKED: u32 = u32::MAX;

impl BlockPlanner {
    fn new(n: usize, neighbours: bool) -> Self {
        BlockPlanner {
            slots: vec![0; if neighbours { n } else { 0 }],
            neighbours,
        }
    }

    /// Marks `v`; true when it was not marked.
    fn mark(&mut self, v: u32) -> bool {
        let slot = &mut self.slots[v as usize];
        let fresh = *slot == 0;
        *slot = MARKED;
        fresh
    }

    /// Where `u` is in the current block's halo.
    fn position(&self, u: u32) -> Option<usize> {
        match self.slots[u as usize] {
            0 | MARKED => None,
            p => Some(p as usize - 1),
        }
    }

    /// Clears the slots of `blk`'s sources for the next block.
    fn finish(&mut self, blk: &Block) {
        if !self.neighbours {
            return;
        }
        for &u in &blk.halo {
            self.slots[u as usize] = 0;
        }
        self.slots[blk.dst.clone()].fill(0);
    }

    /// The block starting at the first destination of `range`, within it.
    fn next(
        &mut self,
        graph: CsrView<'_>,
        range: std::ops::Range<usize>,
        (d_in, d_out, gathered): (u64, u64, Option<u64>),
        opts: &LayerwiseOptions,
    ) -> anyhow::Result<Block> {
        let (lo, n) = (range.start, range.end);
        let cap = opts.max_block_rows.unwrap_or(usize::MAX).max(1);
        let cost =
            |dst: u64, src: u64, edges: u64| block_bytes(dst, src, edges, d_in, d_out, gathered);
        let too_big = |v: usize, bytes: u64| {
            anyhow::anyhow!(
                "the block budget of {} cannot hold vertex {v} alone ({} with its {} \
                 in-neighbours and {} gathered columns); raise the memory budget",
                human_bytes(opts.block_budget),
                human_bytes(bytes),
                graph.degree(v as u32),
                gathered.unwrap_or(d_in)
            )
        };
        if !self.neighbours {
            // Row-local: every destination is its own only source.
            let per_row = cost(1, 1, 0).max(1);
            let rows = ((opts.block_budget / per_row) as usize)
                .min(cap)
                .min(n - lo);
            if rows == 0 {
                return Err(too_big(lo, per_row));
            }
            return Ok(Block {
                dst: lo..lo + rows,
                halo: Vec::new(),
                edges: 0,
                bytes: cost(rows as u64, rows as u64, 0),
            });
        }
        // Every source of the block so far (destinations included), in marking order.
        let mut touched: Vec<u32> = Vec::new();
        let mut edges = 0u64;
        let mut hi = lo;
        while hi < n && hi - lo < cap {
            let before = touched.len();
            let v = hi as u32;
            if self.mark(v) {
                touched.push(v);
            }
            for &u in graph.neighbors(v) {
                if self.mark(u) {
                    touched.push(u);
                }
            }
            let deg = graph.degree(v) as u64;
            let bytes = cost((hi - lo + 1) as u64, touched.len() as u64, edges + deg);
            if bytes > opts.block_budget {
                for &u in &touched[before..] {
                    self.slots[u as usize] = 0;
                }
                touched.truncate(before);
                if hi == lo {
                    return Err(too_big(lo, bytes));
                }
                break;
            }
            edges += deg;
            hi += 1;
        }
        let bytes = cost((hi - lo) as u64, touched.len() as u64, edges);
        let (lo32, hi32) = (lo as u32, hi as u32);
        touched.retain(|&u| u < lo32 || u >= hi32);
        // Ascending, so the gather reads the halo in file order.
        touched.par_sort_unstable();
        for (i, &u) in touched.iter().enumerate() {
            self.slots[u as usize] = i as u32 + 1;
        }
        Ok(Block {
            dst: lo..hi,
            halo: touched,
            edges,
            bytes,
        })
    }
}

fn human_bytes(b: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (MIB * 1024.0))
    } else {
        format!("{:.2} MiB", b as f64 / MIB)
    }
}
