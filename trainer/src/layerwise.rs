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
use grandis_models::{Model, StageCtx};
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
    pub blocks: usize,
    /// Input rows gathered over all blocks (`vertices` when no stage reads neighbours; the
    /// excess over it is the halo rows read again).
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
    let mut input = dataset.feature_rows()?;
    let mut reports = Vec::with_capacity(stages);
    // The scratch file the current input lives in, removed once the next stage is written.
    let mut input_scratch: Option<Scratch> = None;
    for s in 0..stages {
        let (d_in, d_out) = model.stage_dims(s);
        let last = s + 1 == stages;
        let (path, scratch) = if last {
            (outputs.predictions.clone(), None)
        } else if let (true, Some(e)) = (s + 2 == stages, &outputs.embeddings) {
            (e.clone(), None)
        } else {
            let p = opts
                .scratch_dir
                .join(format!(".grandis-layer{s}-{}.npy", std::process::id()));
            (p.clone(), Some(Scratch(p)))
        };
        let pass = StagePass {
            b,
            model: &model,
            stage: s,
            graph: view.graph,
            scales: scales.as_ref(),
            input: &input,
            dataset,
            opts,
        };
        let mut progress = grandis_telemetry::Progress::new(
            format!("predict: stage {}/{stages}", s + 1),
            Some(n as u64),
        );
        let mut failure = None;
        let mut report = None;
        let mut produce = |emit: &mut dyn FnMut(&[f32]) -> std::io::Result<()>| {
            pass.run(emit, &mut progress)
                .map(|r| report = Some(r))
                .map_err(|e| {
                    failure = Some(e);
                    std::io::Error::other("the stage failed")
                })
        };
        let written = match (last, outputs.kind) {
            (true, Predictions::ClassIds) => {
                grandis_npy::write_npy_streamed::<i64>(&path, &[n as u64], |emit| {
                    produce(&mut |rows: &[f32]| {
                        let ids: Vec<i64> =
                            rows.chunks_exact(d_out).map(|r| argmax(r) as i64).collect();
                        emit(&ids)
                    })
                })
            }
            _ => grandis_npy::write_npy_streamed::<f32>(&path, &[n as u64, d_out as u64], produce),
        };
        if let Some(e) = failure {
            return Err(e.context(format!("stage {s} of layer-wise inference")));
        }
        written.with_context(|| format!("writing {}", path.display()))?;
        progress.finish();
        let report = report.expect("a stage that wrote its output reported");
        tracing::info!(
            "stage {s} ({d_in} -> {d_out} columns): {} blocks, {} source rows, {:.1} s",
            report.blocks,
            report.source_rows,
            report.seconds
        );
        reports.push(report);
        if !last {
            input = layer_rows(&path, n, d_out)?;
            // The previous input's file goes now that nothing maps it.
            input_scratch = scratch;
        } else {
            drop(input_scratch.take());
        }
    }
    Ok(LayerwiseReport {
        vertices: n,
        stages: reports,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Bytes one block of `dst` destinations reading `src` source rows over `edges` edges takes
/// at most, for a stage mapping `d_in` to `d_out` columns: the gathered input, its copy on
/// the backend and the stage's transformed copy (pre-ops) of it; the transformed or attention
/// rows of every source (at most `2 d_out` wide); the aggregated input of the destinations;
/// the output, its normalised and activated copies and its download; and the block graph
/// (host and backend: offsets, edges, scales, global ids).
pub fn block_bytes(dst: u64, src: u64, edges: u64, d_in: u64, d_out: u64) -> u64 {
    let rows = 3 * src * d_in + 2 * src * d_out + dst * d_in + 4 * dst * d_out;
    let graph = 2 * (8 * (dst + 1) + 4 * edges + 4 * (2 * dst + src)) + 3 * 4 * src;
    4 * rows + graph
}

/// Reads back a layer written as `.npy` (checked to be `n x cols` f32).
fn layer_rows(path: &Path, n: usize, cols: usize) -> anyhow::Result<RowReader> {
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

/// A scratch file, removed when dropped (also when a pass fails half way).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One stage over every vertex.
struct StagePass<'a, B: Backend> {
    b: &'a B,
    model: &'a Model<B>,
    stage: usize,
    graph: CsrView<'a>,
    scales: Option<&'a GlobalScales>,
    input: &'a RowReader,
    dataset: &'a Dataset,
    opts: &'a LayerwiseOptions,
}

impl<B: Backend> StagePass<'_, B> {
    fn run(
        &self,
        emit: &mut dyn FnMut(&[f32]) -> std::io::Result<()>,
        progress: &mut grandis_telemetry::Progress,
    ) -> anyhow::Result<StageReport> {
        let start = Instant::now();
        let (b, s) = (self.b, self.stage);
        let (d_in, d_out) = self.model.stage_dims(s);
        let n = self.graph.num_vertices();
        if self.input.rows() != n as u64 || self.input.cols() != d_in {
            bail!(
                "stage {s} expects {n} x {d_in} input values, found {} x {}",
                self.input.rows(),
                self.input.cols()
            );
        }
        let neighbours = self.model.stage_reads_neighbors(s);
        let mut planner = BlockPlanner::new(n, neighbours);
        let mut report = StageReport {
            stage: s,
            d_in,
            d_out,
            blocks: 0,
            source_rows: 0,
            edges: 0,
            largest_block_bytes: 0,
            seconds: 0.0,
        };
        let mut lo = 0;
        while lo < n {
            let blk = planner.next(self.graph, lo, d_in, d_out, self.opts)?;
            let dst = blk.dst.clone();
            let (n_dst, n_src) = (dst.len(), dst.len() + blk.halo.len());
            let graph = if neighbours {
                let scales = self
                    .scales
                    .expect("scales exist when a stage reads neighbours");
                range_block(
                    self.graph,
                    scales,
                    dst.start as u32..dst.end as u32,
                    &blk.halo,
                )
                .expect("the planner's halo holds every neighbour outside the block")
            } else {
                no_edges(n_dst)
            };
            let src_ids: Vec<u32> = (dst.start as u32..dst.end as u32)
                .chain(blk.halo.iter().copied())
                .collect();
            let mut host = vec![0.0f32; n_src * d_in];
            // Own rows, then the (sorted) halo: two ascending runs of positioned reads.
            self.input.gather(&src_ids, &mut host)?;
            let rows = b.upload(&host)?;
            drop(host);
            let g = b.upload_graph(&graph)?;
            drop(graph);
            let ids = b.upload_index(&src_ids)?;
            drop(src_ids);
            let ctx = StageCtx {
                graph: &g,
                n_dst,
                n_src,
                global_ids: &ids,
                train: None,
            };
            let (y, _) = self.model.forward_stage(b, s, &ctx, &rows)?;
            drop((rows, g, ids));
            let mut out = vec![0.0f32; n_dst * d_out];
            b.download(&y, 0, &mut out)?;
            emit(&out)?;
            // The block's adjacency was read through the mapping: drop it behind the cursor.
            self.dataset.release_rows(dst.clone());
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

/// One block: destinations `dst` and their in-neighbours outside it, sorted.
struct Block {
    dst: std::ops::Range<usize>,
    halo: Vec<u32>,
    edges: u64,
    bytes: u64,
}

/// Cuts a stage's destinations into the largest blocks that fit the budget, counting each
/// block's distinct sources exactly (a bitmap over the vertices).
struct BlockPlanner {
    marks: Vec<u64>,
    neighbours: bool,
}

impl BlockPlanner {
    fn new(n: usize, neighbours: bool) -> Self {
        let words = if neighbours { n.div_ceil(64) } else { 0 };
        BlockPlanner {
            marks: vec![0; words],
            neighbours,
        }
    }

    /// Marks `v`; true when it was not marked.
    fn mark(&mut self, v: u32) -> bool {
        let (w, bit) = (v as usize / 64, 1u64 << (v % 64));
        let fresh = self.marks[w] & bit == 0;
        self.marks[w] |= bit;
        fresh
    }

    fn unmark(&mut self, v: u32) {
        self.marks[v as usize / 64] &= !(1u64 << (v % 64));
    }

    /// The block starting at destination `lo`.
    fn next(
        &mut self,
        graph: CsrView<'_>,
        lo: usize,
        d_in: usize,
        d_out: usize,
        opts: &LayerwiseOptions,
    ) -> anyhow::Result<Block> {
        let n = graph.num_vertices();
        let cap = opts.max_block_rows.unwrap_or(usize::MAX).max(1);
        let (d_in, d_out) = (d_in as u64, d_out as u64);
        let cost = |dst: u64, src: u64, edges: u64| block_bytes(dst, src, edges, d_in, d_out);
        let too_big = |v: usize, bytes: u64| {
            anyhow::anyhow!(
                "the block budget of {} cannot hold vertex {v} alone ({} with its {} \
                 in-neighbours and {d_in} input columns); raise the memory budget",
                human_bytes(opts.block_budget),
                human_bytes(bytes),
                graph.degree(v as u32)
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
                    self.unmark(u);
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
        for &u in &touched {
            self.unmark(u);
        }
        let (lo32, hi32) = (lo as u32, hi as u32);
        touched.retain(|&u| u < lo32 || u >= hi32);
        touched.par_sort_unstable();
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
