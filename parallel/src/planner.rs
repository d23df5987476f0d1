//! The performance model and the planner: what a candidate plan (mode, k, sampler, batch
//! size) costs per epoch, predicted from the plan's exact counts and measured rates, before
//! anything trains.
//!
//! **Counts** ([`EpochCounts`]) come from the same code that makes a run's steps (`decide`,
//! `steps::build_step`): per rank and conv layer the rows computed and the edges aggregated,
//! per layer the rows every rank receives from every other (forward halo exchange) and sends
//! back (backward), the replicated features fetched from their home server, the parameters
//! the all-reduce sums, and the memory model's bytes. Per-iteration plans (cob, mb) count the
//! first [`COUNTED_STEPS`] steps of the epoch and scale to its iterations.
//!
//! **Time** ([`predict`]): GraNNDIS Eqs. 1-4 generalised to the plan's own counts. A step is
//! every rank's sequence of layer computes and halo exchanges, run through
//! `timeline`: a rank sends its halo rows when its own layer ends and starts the next
//! layer when its rows are in, and each link (a server's NIC, shared by its devices, between
//! servers; a device's link inside one) carries its messages in the order they were sent. With
//! every rank ending together an exchange lasts as long as its busiest link (Eq. 3's max); a
//! bottleneck link starts on a layer's rows while slower ranks still compute. What the paper's
//! equations leave out and this model adds: the backward pass (twice the forward dense
//! products, the transposed aggregation, the same exchange reversed), the hierarchical
//! all-reduce of every iteration (reduce to the head and back over the intra links, a
//! reduce-scatter and all-gather among heads over the NICs), the fetch of replicated features
//! per step (and once at setup for static plans), and CPU contention when several ranks share
//! one machine's cores, with the host's step building (sampling, plans, the ranks' inputs)
//! when CPU ranks share its cores. Not modelled: evaluation, and overlap inside a rank (the
//! runtime does not compute while its own exchange is in flight).

use std::sync::Arc;

use grandis_masking::{DevicePlan, Layout, ModelDims};
use grandis_models::ModelConfig;
use grandis_wire::{ComputeRate, KernelCalibration, LinkBytes, LinkRate, PlanRates, Prediction};
use serde::Serialize;

use crate::fetch::FeatureSource;
use crate::link_task::{LinkSeeds, LinkTask};
use crate::prepare::{BufferPool, HostInput, Preparer};
use crate::steps::Step;
use crate::timeline::{self, Op};

/// Steps of a per-iteration schedule counted for one epoch (the rest are assumed alike).
pub const COUNTED_STEPS: usize = 16;

/// Of the counted steps, those whose ranks' inputs the planner prepares and times.
const INPUT_STEPS: usize = 2;

/// Bytes a rank sends to another in one exchange (only pairs with traffic).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Traffic {
    /// (from rank, to rank, bytes).
    pub pairs: Vec<(usize, usize, u64)>,
}

impl Traffic {
    fn add(&mut self, from: usize, to: usize, bytes: u64) {
        if bytes > 0 {
            self.pairs.push((from, to, bytes));
        }
    }

    fn scaled(&self, f: f64) -> Traffic {
        Traffic {
            pairs: self
                .pairs
                .iter()
                .map(|&(a, b, x)| (a, b, (x as f64 * f).round() as u64))
                .collect(),
        }
    }

    /// Bytes by link class.
    pub fn bytes(&self, layout: &Layout) -> LinkBytes {
        let mut out = LinkBytes::default();
        for &(a, b, x) in &self.pairs {
            if layout.same_server(a, b) {
                out.intra_server += x;
            } else {
                out.inter_server += x;
            }
        }
        out
    }
}

/// What one step does, in counts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepCounts {
    /// `[rank][layer]` rows computed (valid owned rows) and edges aggregated.
    pub rows: Vec<Vec<u64>>,
    pub edges: Vec<Vec<u64>>,
    /// `[rank][layer]` the layer's input rows (its compact space's `n_src`): the rows its
    /// input-row products run on and its aggregation reads from.
    pub inputs: Vec<Vec<u64>>,
    /// `[layer]` the forward halo exchange feeding the layer, and its backward (empty for
    /// layers without one).
    pub forward: Vec<Traffic>,
    pub backward: Vec<Traffic>,
    /// Replicated features fetched from their home server for this step (see
    /// [`EpochCounts::setup_fetch`] for plans that serve the whole run).
    pub fetch: Traffic,
    /// Learnable node embeddings' asks, rows and gradients (`crate::embedding_shard`).
    pub embeddings: Traffic,
}

/// What one epoch of a candidate does, in counts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EpochCounts {
    pub iterations: usize,
    /// The counted steps (each standing for [`Self::scale`] iterations).
    pub steps: Vec<StepCounts>,
    /// Fetched once before the first epoch (static plans), not per epoch.
    pub setup_fetch: Traffic,
    /// Iterations per counted step (1 when every step was counted).
    pub scale: f64,
    /// Parameters the all-reduce sums every iteration.
    pub parameters: usize,
    /// The memory model's peak over the counted steps, per rank.
    pub model_bytes: Vec<u64>,
    /// Host seconds building the epoch's steps (sampling, extraction, and preparing the
    /// ranks' inputs; per-iteration schedules only, scaled like the steps): CPU work that
    /// competes with CPU ranks. Sampled FLX's redraw once an epoch is left out: a 200k graph's
    /// flx-eas epochs (0.33-0.47 s of builder time each) measured what their ranks' compute
    /// alone predicts, and counting it put them at 1.12x.
    pub build_seconds: f64,
    /// A link job's decoder, every iteration on every rank (none for node classification).
    pub decoder: DecoderWork,
}

/// What a link job's decoder does on each rank each iteration (`link_task`): score
/// `pairs_per_rank` pairs of `cols`-wide embeddings out of a matrix of `rows` rows and add
/// their gradients, with the MLP's per-pair products when `mlp`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DecoderWork {
    pub pairs_per_rank: f64,
    pub cols: usize,
    pub rows: f64,
    pub mlp: bool,
}

/// The per-layer constants of a model that turn rows and edges into work.
#[derive(Debug, Clone, Serialize)]
pub struct LayerWork {
    /// Dense flops of one row's forward pass at this layer (its weights; the encoder of
    /// ResSAGE+ on its first layer, its head on its last), `input_flops_per_row` of them
    /// per input row rather than per output row.
    pub flops_per_row: f64,
    /// [`grandis_models::StageWork::input_flops_per_row`] of the layer's convolution.
    pub input_flops_per_row: f64,
    /// Columns the layer aggregates per edge.
    pub aggregated_cols: usize,
    /// Columns of a halo row in its exchange (the layer's input width).
    pub exchanged_cols: usize,
    /// Whether the layer's input gets a gradient (all but layer 0 of a plain stack, whose
    /// input is the features): backward then runs the input's products too, and the halo
    /// rows' gradients go back to their owners.
    pub input_gradient: bool,
}

/// The work constants of every conv layer of `config`.
pub fn layer_work(config: &ModelConfig, dims: &ModelDims) -> anyhow::Result<Vec<LayerWork>> {
    let work = config
        .stage_work()
        .map_err(|e| anyhow::anyhow!("invalid model configuration: {e}"))?;
    let stage_flops = |s: usize| work[s].flops_per_row;
    let stages = work.len();
    let first_conv = config.stage_layout().first_conv;
    Ok((0..config.layers)
        .map(|l| {
            let s = l + first_conv;
            let mut flops = stage_flops(s);
            // Row-local stages before the first convolution and after the last are priced
            // with them (an encoder, a head).
            if l == 0 {
                flops += (0..first_conv).map(stage_flops).sum::<f64>();
            }
            if l + 1 == config.layers {
                flops += (s + 1..stages).map(stage_flops).sum::<f64>();
            }
            LayerWork {
                flops_per_row: flops,
                input_flops_per_row: work[s].input_flops_per_row,
                aggregated_cols: work[s].aggregated_cols.unwrap_or(work[s].d_in),
                exchanged_cols: dims.in_width(l),
                // Layer 0's input gradient goes only to a stage before it.
                input_gradient: l > 0 || first_conv > 0,
            }
        })
        .collect())
}

/// Counts of one step: every rank's rows and edges per layer, its exchanges and fetch.
pub(crate) fn count_step(
    step: &Step,
    layout: &Layout,
    work: &[LayerWork],
    (features, embedding_dim): (usize, usize),
) -> StepCounts {
    let layers = work.len();
    let mut rows = vec![vec![0u64; layers]; step.plans.len()];
    let mut edges = vec![vec![0u64; layers]; step.plans.len()];
    let mut inputs = vec![vec![0u64; layers]; step.plans.len()];
    let mut forward = vec![Traffic::default(); layers];
    let mut backward = vec![Traffic::default(); layers];
    let mut fetch = Traffic::default();
    let mut embeddings = Traffic::default();
    for (r, plans) in step.plans.iter().enumerate() {
        for (l, p) in plans.iter().enumerate().take(layers) {
            let w = p.work_at(l);
            rows[r][l] = w.rows;
            inputs[r][l] = p.layer_rows(l).n_src as u64;
            edges[r][l] = w.edges;
            let row_bytes = (work[l].exchanged_cols * 4) as u64;
            for (gi, g) in p.halo.iter().enumerate() {
                let n = p.recv_rows(l, gi).len() as u64;
                forward[l].add(g.peer, r, n * row_bytes);
                if work[l].input_gradient {
                    backward[l].add(r, g.peer, n * row_bytes);
                }
            }
        }
        if let Some(p) = plans.first() {
            fetch_of(p, r, layout, features, &mut fetch);
            if embedding_dim > 0 {
                embeddings_of(p, r, layout, embedding_dim, &mut embeddings);
            }
        }
    }
    StepCounts {
        rows,
        edges,
        inputs,
        forward,
        backward,
        fetch,
        embeddings,
    }
}

/// What rank `r`'s layer-0 plan `p` moves for learnable embeddings of `dim` columns
/// (`crate::embedding_shard`): its ask to every other rank (a count, then an id for each of
/// its rows homed there), the asked rows' values back (its owned rows homed elsewhere: FLX's
/// replicated ones), and each borrowed row's gradient home (the halo's too).
fn embeddings_of(p: &DevicePlan, r: usize, layout: &Layout, dim: usize, out: &mut Traffic) {
    let (id, row) = (4u64, 4 * dim as u64);
    for peer in (0..layout.num_ranks()).filter(|&o| o != r) {
        out.add(r, peer, id);
    }
    let halo = (0..p.halo.len()).flat_map(|gi| p.recv_rows(0, gi));
    for (i, asked) in (0..p.n_owned as u32)
        .map(|i| (i, true))
        .chain(halo.map(|i| (i, false)))
    {
        let home = layout.owner(p.global_ids[i as usize]);
        if home != r {
            out.add(r, home, id + row);
            if asked {
                out.add(home, r, row);
            }
        }
    }
}

/// The features rank `r`'s layer-0 plan `p` owns but whose home is another server.
fn fetch_of(p: &Arc<DevicePlan>, r: usize, layout: &Layout, features: usize, out: &mut Traffic) {
    let server = layout.server_of_rank(r);
    let mut from: std::collections::BTreeMap<usize, u64> = Default::default();
    for &g in &p.global_ids[..p.n_owned] {
        if layout.server_of(g) != server {
            *from.entry(layout.owner(g)).or_default() += (features * 4) as u64;
        }
    }
    for (home, bytes) in from {
        out.add(home, r, bytes);
    }
}

/// The rows an aggregation reads from, and how many ranks share the caches they are read
/// through (their own sources each).
#[derive(Debug, Clone, Copy)]
struct Sources {
    rows: f64,
    sharers: f64,
}

impl Sources {
    /// Sources read alone (the calibration, a decoder's table).
    fn alone(rows: f64) -> Sources {
        Sources { rows, sharers: 1.0 }
    }

    fn shared(rows: f64, sharers: f64) -> Sources {
        Sources {
            rows,
            sharers: sharers.max(1.0),
        }
    }
}

/// The aggregation rate over `sources` of `cols` columns: between the cached and the uncached
/// calibration, by the bytes the sources take (log-linear in between). Ranks sharing the
/// caches each keep a share of them: the cached rate ends at that share of the calibration's
/// cached size, while the uncached rate (sources far beyond any cache) does not move. At 20k
/// vertices, 4 ranks on 2 cores, flx k=3's aggregation ran 1.25x what its own sources' bytes
/// alone predicted; moving both ends instead overpredicted a 200k graph's plans 1.25-1.47x.
fn aggregation_rate(rate: &ComputeRate, sources: Sources, cols: usize) -> f64 {
    use crate::measure::{CACHED_SOURCE_ROWS, UNCACHED_SOURCE_ROWS};
    let cached = rate.aggregation_edge_cols_per_s.max(1.0);
    let uncached = rate.aggregation_uncached_edge_cols_per_s;
    if uncached <= 0.0 {
        return cached;
    }
    // Rows of the calibration's width holding as many bytes.
    let rows = sources.rows * cols as f64 / rate.width.max(1) as f64;
    let (lo, hi) = (
        (CACHED_SOURCE_ROWS as f64 / sources.sharers).ln(),
        (UNCACHED_SOURCE_ROWS as f64).ln(),
    );
    let t = ((rows.max(1.0).ln() - lo) / (hi - lo)).clamp(0.0, 1.0);
    (cached.ln() * (1.0 - t) + uncached.ln() * t).exp()
}

/// The rows one conv layer of one rank runs on.
#[derive(Debug, Clone, Copy)]
struct LayerRowCounts {
    /// Output rows.
    rows: f64,
    /// Input rows (at least `rows`).
    inputs: f64,
    /// Edges aggregated (from the input rows).
    edges: f64,
    /// Ranks sharing the caches the input rows are read through ([`Sources::shared`]).
    cache_sharers: f64,
}

impl LayerRowCounts {
    /// A layer reading exactly the rows it writes, alone (the calibration's whole graph).
    fn square(rows: f64, edges: f64) -> LayerRowCounts {
        LayerRowCounts {
            rows,
            inputs: rows,
            edges,
            cache_sharers: 1.0,
        }
    }
}

/// Seconds of kernel work, by the class it is timed and calibrated as.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KernelSeconds {
    pub dense: f64,
    pub aggregation: f64,
}

impl KernelSeconds {
    /// The seconds with each class's calibration applied.
    fn calibrated(self, factors: &KernelCalibration) -> f64 {
        self.dense * factors.dense + self.aggregation * factors.aggregation
    }
}

impl std::ops::Add for KernelSeconds {
    type Output = KernelSeconds;

    fn add(self, o: KernelSeconds) -> KernelSeconds {
        KernelSeconds {
            dense: self.dense + o.dense,
            aggregation: self.aggregation + o.aggregation,
        }
    }
}

/// Seconds of the forward (`backward = false`) or backward pass of a conv layer doing `w`
/// on `n`, at `rate`: the dense products (backward: the weights' gradient, and the input's
/// when it has one), per output row and per input row, and the aggregation (transposed
/// backward, reading the output rows' gradients).
fn layer_seconds(
    n: &LayerRowCounts,
    w: &LayerWork,
    rate: &ComputeRate,
    backward: bool,
) -> KernelSeconds {
    let gemm_factor = if backward && w.input_gradient {
        2.0
    } else {
        1.0
    };
    let flops = n.rows * (w.flops_per_row - w.input_flops_per_row)
        + n.inputs.max(n.rows) * w.input_flops_per_row;
    // The forward pass gathers from the input rows; the backward walks the transposed
    // graph, gathering from the output rows' gradients (and writing the input rows' in
    // order). A replicated plan's layer reads 2-3x as many input rows as it writes: a 200k
    // graph's flx k=3 layer of 58k rows over 178k inputs gathered its backward at 1.5x
    // its forward rate.
    let read = match backward {
        false => n.inputs,
        true => n.rows,
    };
    KernelSeconds {
        dense: gemm_factor * flops / rate.gemm_flops_per_s.max(1.0),
        aggregation: n.edges * w.aggregated_cols as f64
            / aggregation_rate(
                rate,
                Sources::shared(read, n.cache_sharers),
                w.aggregated_cols,
            ),
    }
}

/// Seconds of one rank's decoder work `w` at `rate`. A pair reads its two ends' rows and adds
/// into their two gradient rows, at scattered places of the matrix: four row accesses of
/// `cols` columns, priced as aggregation edges over that many source rows are; the MLP adds
/// its `cols x cols` matrix-vector products (forward, and backward for the input and the
/// weights) at the dense rate.
fn decoder_seconds(w: &DecoderWork, rate: &ComputeRate) -> KernelSeconds {
    if w.pairs_per_rank <= 0.0 {
        return KernelSeconds::default();
    }
    let cols = w.cols as f64;
    KernelSeconds {
        aggregation: 4.0 * w.pairs_per_rank * cols
            / aggregation_rate(rate, Sources::alone(w.rows), w.cols),
        dense: match w.mlp {
            true => 6.0 * w.pairs_per_rank * cols * cols / rate.gemm_flops_per_s.max(1.0),
            false => 0.0,
        },
    }
}

/// Seconds `link` takes to carry `bytes` in `messages` messages (an unmeasured bandwidth
/// counts as unlimited).
fn transfer_seconds(link: &LinkRate, bytes: f64, messages: f64) -> f64 {
    let bandwidth = if link.bandwidth_bytes_per_s > 0.0 {
        bytes / link.bandwidth_bytes_per_s
    } else {
        0.0
    };
    bandwidth + messages * link.latency_s
}

/// Seconds of one exchange: its busiest link per class, plus a latency for each class used.
/// Returns (intra, inter) seconds; the exchange lasts their maximum.
fn exchange_seconds(t: &Traffic, layout: &Layout, rates: &PlanRates) -> (f64, f64) {
    let ranks = layout.num_ranks();
    let servers = layout.servers();
    let (mut dev_out, mut dev_in) = (vec![0u64; ranks], vec![0u64; ranks]);
    let (mut nic_out, mut nic_in) = (vec![0u64; servers], vec![0u64; servers]);
    let (mut intra_used, mut inter_used) = (false, false);
    for &(a, b, x) in &t.pairs {
        if layout.same_server(a, b) {
            dev_out[a] += x;
            dev_in[b] += x;
            intra_used = true;
        } else {
            nic_out[layout.server_of_rank(a)] += x;
            nic_in[layout.server_of_rank(b)] += x;
            inter_used = true;
        }
    }
    let busiest = |a: &[u64], b: &[u64]| a.iter().chain(b).copied().max().unwrap_or(0) as f64;
    let time = |bytes: f64, link: &LinkRate, used: bool| match used {
        true => transfer_seconds(link, bytes, 1.0),
        false => 0.0,
    };
    (
        time(busiest(&dev_out, &dev_in), &rates.intra, intra_used),
        time(busiest(&nic_out, &nic_in), &rates.inter, inter_used),
    )
}

/// Predicts one epoch of `counts` on `layout` with `rates`.
pub fn predict(
    counts: &EpochCounts,
    work: &[LayerWork],
    layout: &Layout,
    rates: &PlanRates,
) -> Prediction {
    let mut p = Prediction::default();
    // Ranks sharing a machine's cores (CPU ranks: a server's, or every rank when one machine
    // runs them all) share them as the timeline runs them: while more of them compute than
    // the cores hold, each runs that much slower than alone; one that waits leaves its share
    // to the others. (A constant slowdown, whether the others compute or wait, put a 200k
    // graph's flx k=3 at 1.36-1.44x its epoch once its input rows were priced; this puts it
    // at 1.05-1.35x over two runs, and a 20k graph's plans move by a few per cent either way.)
    let contention = rates.contention.max(1.0);
    let one_machine = rates.shared_cores.is_some();
    let sharing = match one_machine {
        true => layout.num_ranks(),
        false => layout.devices(),
    };
    let cores = timeline::Cores {
        one_machine,
        slots: sharing as f64 / contention,
    };
    let factors = rates.kernel_factors();
    let ranks = layout.num_ranks();
    // Every rank's compute seconds, summed: the CPU work of the shared-cores bound below.
    let mut cpu_seconds = 0.0;
    // The decoder runs on every rank after its last layer, each rank on its own pairs.
    let decoder = decoder_seconds(&counts.decoder, &rates.compute).calibrated(&factors);
    for step in &counts.steps {
        let rows: u64 = step.rows.iter().flatten().sum();
        p.computed_vertex_layers += (rows as f64 * counts.scale).round() as u64;
        // A rank's seconds of layer `l` alone on its device (sharing aside).
        let alone = |l: usize, backward: bool| -> Vec<f64> {
            (0..ranks)
                .map(|r| {
                    let n = LayerRowCounts {
                        rows: step.rows[r][l] as f64,
                        inputs: step.inputs[r][l] as f64,
                        edges: step.edges[r][l] as f64,
                        cache_sharers: rates.cache_sharers,
                    };
                    layer_seconds(&n, &work[l], &rates.compute, backward).calibrated(&factors)
                })
                .collect()
        };
        // The step as every rank runs it: each layer's halo exchange then its forward pass;
        // the decoder; each layer's backward pass then its gradients' exchange.
        let mut ops = Vec::with_capacity(4 * work.len() + 1);
        for l in 0..work.len() {
            ops.push(Op::Exchange(&step.forward[l].pairs));
            ops.push(Op::Compute(alone(l, false)));
        }
        ops.push(Op::Compute(vec![decoder; ranks]));
        for l in (0..work.len()).rev() {
            ops.push(Op::Compute(alone(l, true)));
            ops.push(Op::Exchange(&step.backward[l].pairs));
        }
        for op in &ops {
            if let Op::Compute(seconds) = op {
                cpu_seconds += seconds.iter().sum::<f64>() * counts.scale;
            }
        }
        let t = timeline::simulate(&ops, layout, &cores, &rates.intra, &rates.inter);
        p.compute_s += t.compute_s * counts.scale;
        p.intra_s += t.intra_s * counts.scale;
        p.inter_s += t.inter_s * counts.scale;
        for t in step.forward.iter().chain(&step.backward) {
            let b = t.bytes(layout);
            p.halo_bytes.intra_server += (b.intra_server as f64 * counts.scale) as u64;
            p.halo_bytes.inter_server += (b.inter_server as f64 * counts.scale) as u64;
        }
        // The embeddings' rows before the forward pass and gradients after the backward,
        // each an exchange of its own beside the halo's.
        let (intra, inter) = exchange_seconds(&step.embeddings, layout, rates);
        match inter >= intra {
            true => p.inter_s += inter * counts.scale,
            false => p.intra_s += intra * counts.scale,
        }
        p.node_embedding_bytes
            .add(&step.embeddings.scaled(counts.scale).bytes(layout));
        let (intra, inter) = exchange_seconds(&step.fetch, layout, rates);
        p.fetch_s += intra.max(inter) * counts.scale;
        let b = step.fetch.scaled(counts.scale).bytes(layout);
        p.fetch_bytes.add(&b);
    }
    // Every iteration sums the weight gradients (the last one the epoch's loss with them).
    p.all_reduce_s =
        counts.iterations as f64 * all_reduce_seconds(counts.parameters, layout, rates);
    let (intra, inter) = exchange_seconds(&counts.setup_fetch, layout, rates);
    p.setup_fetch_s = intra.max(inter);
    let setup = counts.setup_fetch.bytes(layout);
    p.setup_fetch_bytes = setup.intra_server + setup.inter_server;
    p.peak_bytes = counts.model_bytes.iter().copied().max().unwrap_or(0);
    // Ranks sharing a machine's cores cannot compute faster than their CPU work spread over
    // the cores, and with the plan builders (that share them too) cannot get through the
    // epoch faster than all that work spread over them. The builders run while the ranks
    // wait (for rows, fetches, the all-reduce): charging their work to the ranks' compute
    // instead predicted a 20k-vertex graph's co-batch plans at 1.15-1.3x their epochs, their
    // compute at 1.5x (in a single rank's run, where the builders only get the ranks' waits,
    // the same step's compute is priced within 10 %).
    p.epoch_s = p.compute_s + p.intra_s + p.inter_s + p.fetch_s + p.all_reduce_s;
    if let Some(cores) = rates.shared_cores {
        let cores = cores.max(1) as f64;
        let floor = (cpu_seconds / cores).max(p.compute_s);
        p.epoch_s += floor - p.compute_s;
        p.compute_s = floor;
        let busy = (cpu_seconds + counts.build_seconds) / cores;
        if busy > p.epoch_s {
            p.compute_s += busy - p.epoch_s;
            p.epoch_s = busy;
        }
    }
    p
}

/// One hierarchical all-reduce of `parameters` values (`fabric`'s): the devices send their
/// buffers to the head and get the result back over its intra link; the heads reduce-scatter
/// and all-gather over their NICs (each sends and receives 2 (S-1)/S of the buffer).
fn all_reduce_seconds(parameters: usize, layout: &Layout, rates: &PlanRates) -> f64 {
    let bytes = (parameters * 4) as f64;
    let (s, g) = (layout.servers() as f64, layout.devices() as f64);
    let intra = if g > 1.0 {
        transfer_seconds(&rates.intra, 2.0 * (g - 1.0) * bytes, 2.0)
    } else {
        0.0
    };
    let inter = if s > 1.0 {
        transfer_seconds(&rates.inter, 2.0 * (s - 1.0) / s * bytes, 2.0)
    } else {
        0.0
    };
    intra + inter
}

/// One plan the planner considers: a mode with its knobs.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Candidate {
    pub mode: grandis_wire::Mode,
    pub preload_hops: Option<usize>,
    pub sampling: grandis_wire::Sampling,
    pub batch_size: Option<usize>,
}

impl Candidate {
    /// A short name: `fb`, `flx k=2`, `flx-eas h=1 f=15`, `cob 1024 sage(10,5)`, `mb 256 ...`.
    pub fn name(&self) -> String {
        use grandis_wire::{Mode, Sampling};
        let sampler = |s: &Sampling| match s {
            Sampling::None => "exact".to_string(),
            Sampling::Eas { hops, fanout, .. } => format!("eas h={hops} f={fanout}"),
            Sampling::Fanout { fanouts, .. } => format!(
                "sage({})",
                fanouts
                    .iter()
                    .map(|f| f.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Sampling::Saint { walk_length } => format!("saint(walk {walk_length})"),
        };
        match (self.mode, &self.sampling) {
            (Mode::Flx, Sampling::None) => format!("flx k={}", self.preload_hops.unwrap_or(0)),
            (Mode::Flx, s) => format!("flx-{}", sampler(s)),
            (Mode::Cob | Mode::Mb, s) => format!(
                "{} {} {}",
                self.mode.name(),
                self.batch_size.unwrap_or(0),
                sampler(s)
            ),
            (m, _) => m.name().to_string(),
        }
    }

    /// Whether the candidate trains on the exact graph (no sampling).
    pub fn is_exact(&self) -> bool {
        self.sampling == grandis_wire::Sampling::None
    }

    /// `base` with this candidate's mode and knobs.
    pub fn options(&self, base: &crate::ParallelOptions) -> crate::ParallelOptions {
        let mut options = base.clone();
        options.job.mode = self.mode;
        options.job.preload_hops = self.preload_hops.map(|k| k as u32);
        options.job.sampling = self.sampling.clone();
        options.job.batch_size = self.batch_size.map(|b| b as u32);
        options
    }
}

/// The candidates for a model of `layers` layers: fb; exact flx with k = 1..=layers; flx-eas
/// with k = layers over hops {1, 2} x fanout {5, 15}; cob with the co-batch size `batch` and
/// its half and quarter, each with `sampling` (exact when none); mb with `batch` / devices per
/// device when `sampling` is a sampler mb runs (fanout or eas). `batch` 0: neither cob nor mb.
pub fn candidates(
    layers: usize,
    batch: usize,
    devices: usize,
    sampling: &grandis_wire::Sampling,
) -> Vec<Candidate> {
    use grandis_wire::{Mode, Priority, Sampling};
    let mut out = vec![Candidate {
        mode: Mode::Fb,
        preload_hops: None,
        sampling: Sampling::None,
        batch_size: None,
    }];
    for k in 1..=layers {
        out.push(Candidate {
            mode: Mode::Flx,
            preload_hops: Some(k),
            sampling: Sampling::None,
            batch_size: None,
        });
    }
    for hops in [1, 2] {
        for fanout in [5, 15] {
            out.push(Candidate {
                mode: Mode::Flx,
                preload_hops: Some(layers),
                sampling: Sampling::Eas {
                    hops,
                    fanout,
                    priority: Priority::Degree,
                },
                batch_size: None,
            });
        }
    }
    let cob_sampling = match sampling {
        Sampling::Saint { .. } => Sampling::None,
        s => s.clone(),
    };
    for b in [batch, batch / 2, batch / 4] {
        if b > 0 {
            out.push(Candidate {
                mode: Mode::Cob,
                preload_hops: None,
                sampling: cob_sampling.clone(),
                batch_size: Some(b),
            });
        }
    }
    if batch > 0 && matches!(sampling, Sampling::Fanout { .. } | Sampling::Eas { .. }) {
        out.push(Candidate {
            mode: Mode::Mb,
            preload_hops: None,
            sampling: sampling.clone(),
            batch_size: Some((batch / devices.max(1)).max(1)),
        });
    }
    out
}

/// A candidate with its counts and prediction, or why it cannot run or was not counted.
#[derive(Debug, Clone, Serialize)]
pub struct Planned {
    pub candidate: Candidate,
    pub name: String,
    pub prediction: Option<Prediction>,
    /// Whether the memory model's worst rank fits the budget.
    pub fits: bool,
    pub error: Option<String>,
    /// Why the candidate was not counted ([`Counting::Pruned`]): the floor that rules it out.
    pub pruned: Option<String>,
    /// Seconds spent counting it.
    pub count_seconds: f64,
}

/// Which candidates [`plan`] counts. The static ones (FB and FLX: one plan over the whole
/// graph) are the expensive ones to count, as long as a run's setup; the per-iteration ones
/// (cob, mb) count a few steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Counting {
    /// Every candidate.
    Every,
    /// The per-iteration candidates first, then a static one only when its floors (what its
    /// owned rows alone cost, [`StaticFloor`]) leave it able to fit the budget and to be
    /// chosen by [`choose`] with this `exact_preference` over what was counted before it.
    Pruned { exact_preference: f64 },
}

/// Lower bounds on every static plan of a job, from the partition alone: each FB or FLX plan
/// (exact or EAS-sampled) computes at least every rank's own rows at every layer, aggregating
/// at least their in-edges from the rank's server (EAS samples only the inter-server ones;
/// exact plans keep them all), and holds at least those rows in memory.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StaticFloor {
    /// Predicted seconds of an exact static plan's epoch on the owned rows and all their
    /// in-edges, with nothing exchanged or fetched.
    pub exact_s: f64,
    /// The same with only the in-edges from the rank's own server.
    pub sampled_s: f64,
    /// [`grandis_masking::owned_rows_floor`] of the largest rank.
    pub bytes: u64,
}

/// The [`StaticFloor`] of `ctx`'s partition for a model of `work`, `dims` and `parameters`.
pub fn static_floor(
    ctx: &grandis_masking::PlanContext<'_>,
    dims: &ModelDims,
    work: &[LayerWork],
    parameters: usize,
    rates: &PlanRates,
) -> StaticFloor {
    let layout = ctx.layout();
    let ranks = layout.num_ranks();
    let (mut owned, mut all, mut inner) = (vec![0u64; ranks], vec![0u64; ranks], vec![0u64; ranks]);
    for r in 0..ranks {
        let server = layout.server_range(layout.server_of_rank(r));
        for v in layout.range(r) {
            let sources = ctx.in_neighbors(v);
            owned[r] += 1;
            all[r] += sources.len() as u64;
            inner[r] += sources.iter().filter(|u| server.contains(u)).count() as u64;
        }
    }
    let layers = work.len();
    let epoch_s = |edges: &[u64]| {
        let per_layer = |x: &[u64]| x.iter().map(|&n| vec![n; layers]).collect::<Vec<_>>();
        let counts = EpochCounts {
            iterations: 1,
            steps: vec![StepCounts {
                rows: per_layer(&owned),
                edges: per_layer(edges),
                inputs: per_layer(&owned),
                forward: vec![Traffic::default(); layers],
                backward: vec![Traffic::default(); layers],
                ..StepCounts::default()
            }],
            scale: 1.0,
            parameters,
            ..EpochCounts::default()
        };
        predict(&counts, work, layout, rates).epoch_s
    };
    StaticFloor {
        exact_s: epoch_s(&all),
        sampled_s: epoch_s(&inner),
        bytes: owned
            .iter()
            .map(|&n| grandis_masking::owned_rows_floor(dims, n))
            .max()
            .unwrap_or(0),
    }
}

/// The parameters of `config` (what every iteration's all-reduce sums).
pub fn parameters(config: &ModelConfig) -> anyhow::Result<usize> {
    Ok(config
        .parameter_shapes()
        .map_err(|e| anyhow::anyhow!("invalid model configuration: {e}"))?
        .iter()
        .map(|(_, shape)| shape.iter().product::<usize>())
        .sum())
}

/// Counts and predicts the candidates for `config` on `part` (whose plan context is `ctx`)
/// with `rates` (all of them, or as `counting` prunes); `base` carries the budget
/// (`device_memory`, else what the ranks' devices have) and everything a candidate does not
/// set. The result is in `candidates`' order.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    view: grandis_store::DatasetView<'_>,
    part: &crate::PartitionedGraph,
    ctx: &grandis_masking::PlanContext<'_>,
    config: &ModelConfig,
    seed: u64,
    base: &crate::ParallelOptions,
    candidates: &[Candidate],
    rates: &PlanRates,
    counting: Counting,
) -> anyhow::Result<Vec<Planned>> {
    let link = base.job.task == grandis_wire::Task::Link;
    let objective = grandis_trainer::Objective::for_job(&base.job);
    let embedding_dim = base.job.embedding_dim as usize;
    crate::setup::check_job_inputs(&view, part, config, objective, embedding_dim)?;
    let (flags, totals) = crate::setup::labelled(&view, part)?;
    if totals[0] == 0 && !link {
        anyhow::bail!("the dataset's train split has no labelled vertices");
    }
    let work = layer_work(config, &crate::model_dims(config))?;
    let (budget, _) = crate::budget::budget(base, &part.layout)?;
    let labelled_train = |g: u32| crate::setup::in_train_split(&flags, g);
    let link_task = match (objective, view.links) {
        (grandis_trainer::Objective::Link { negatives, decoder }, Some(split)) => Some((
            LinkTask { split, negatives },
            decoder == grandis_wire::LinkDecoder::Mlp,
        )),
        _ => None,
    };
    // What a run's producers prepare after building a batched step, as a run sets it up.
    let scales = grandis_engine::norm::global_scales(
        part.graph.view(),
        grandis_models::aggregation(config.kind),
    );
    let buffers = BufferPool::default();
    let preparer = Preparer::for_model(
        FeatureSource {
            view,
            new_to_old: &part.new_to_old,
            layout: &part.layout,
        },
        config,
        &scales,
        &flags,
        &buffers,
    );
    let count = |c: &Candidate| -> Planned {
        let mut popts = c.options(base);
        popts.job.device_memory = Some(budget);
        let started = std::time::Instant::now();
        let counted = (|| -> anyhow::Result<EpochCounts> {
            let sampler = crate::setup::dependency_sampler(
                &view,
                part,
                &popts.job.sampling,
                config.layers,
                seed,
            )?;
            // The candidate's own dims: a link job's gathered embeddings depend on the mode.
            let dims = crate::budget::job_dims(config, &popts.job, view.num_vertices());
            // A link job's batches (cob, mb) are seeded by its supervision edges, as a run's.
            let seeds = match (&link_task, c.mode) {
                (Some((task, _)), grandis_wire::Mode::Cob | grandis_wire::Mode::Mb) => {
                    Some(LinkSeeds::new(*task, part, seed, false))
                }
                _ => None,
            };
            let inputs = crate::steps::StepInputs {
                ctx,
                dims: &dims,
                step_part: crate::steps::StepPart::All,
                labelled_train: &labelled_train,
                link: seeds.as_ref(),
            };
            let decision =
                crate::decide::decide(&inputs, config, &popts, sampler.as_deref(), seed)?;
            let (counts, step_pairs) = count_epoch(
                &inputs,
                &decision,
                &work,
                (view.feature_dim, embedding_dim),
                &preparer,
            )?;
            // Link prediction all-reduces the embeddings it gathers and their gradients each
            // step besides the parameters (`link_task`).
            let parameters = parameters(config)? + 2 * dims.link_embedding_values as usize;
            // The decoder: every rank scores its share of a batched step's pairs, or of every
            // supervision edge and its negatives in the exact modes (`link_task`).
            let ranks = part.layout.num_ranks() as f64;
            let decoder = match &link_task {
                Some((task, mlp)) => {
                    let (pairs, rows) = if step_pairs > 0.0 {
                        (
                            step_pairs,
                            (2.0 * step_pairs).min(view.num_vertices() as f64),
                        )
                    } else {
                        let edges = (task.split.train.len() / 2) as f64;
                        (
                            edges * (1 + task.negatives) as f64,
                            view.num_vertices() as f64,
                        )
                    };
                    DecoderWork {
                        pairs_per_rank: pairs / ranks,
                        cols: config.classes,
                        rows,
                        mlp: *mlp,
                    }
                }
                None => DecoderWork::default(),
            };
            Ok(EpochCounts {
                parameters,
                decoder,
                ..counts
            })
        })();
        let count_seconds = started.elapsed().as_secs_f64();
        tracing::info!(candidate = %c.name(), seconds = count_seconds, "counted");
        let (prediction, error) = match counted {
            Ok(counts) => (Some(predict(&counts, &work, &part.layout, rates)), None),
            Err(e) => (None, Some(format!("{e:#}"))),
        };
        Planned {
            candidate: c.clone(),
            name: c.name(),
            fits: prediction.as_ref().is_some_and(|p| p.peak_bytes <= budget),
            prediction,
            error,
            pruned: None,
            count_seconds,
        }
    };
    let is_static =
        |c: &Candidate| matches!(c.mode, grandis_wire::Mode::Fb | grandis_wire::Mode::Flx);
    let exact_preference = match counting {
        Counting::Every => return Ok(candidates.iter().map(count).collect()),
        Counting::Pruned { exact_preference } => exact_preference,
    };
    let floor = candidates
        .iter()
        .any(is_static)
        .then(|| -> anyhow::Result<StaticFloor> {
            // What the static candidates (fb, flx) hold: an exact mode's dims and parameters.
            let exact = grandis_wire::JobSpec {
                mode: grandis_wire::Mode::Fb,
                ..base.job.clone()
            };
            let dims = crate::budget::job_dims(config, &exact, view.num_vertices());
            let parameters = parameters(config)? + 2 * dims.link_embedding_values as usize;
            Ok(static_floor(ctx, &dims, &work, parameters, rates))
        })
        .transpose()?;
    let mut out: Vec<Option<Planned>> = vec![None; candidates.len()];
    let per_iteration_first = (0..candidates.len())
        .filter(|&i| !is_static(&candidates[i]))
        .chain((0..candidates.len()).filter(|&i| is_static(&candidates[i])));
    for i in per_iteration_first {
        let c = &candidates[i];
        let pruned = floor.and_then(|floor| {
            let counted: Vec<&Planned> = out.iter().flatten().collect();
            is_static(c)
                .then(|| ruled_out(c, &floor, budget, &counted, exact_preference))
                .flatten()
        });
        out[i] = Some(match pruned {
            Some(why) => {
                tracing::info!(candidate = %c.name(), %why, "not counted");
                Planned {
                    candidate: c.clone(),
                    name: c.name(),
                    prediction: None,
                    fits: false,
                    error: None,
                    pruned: Some(why),
                    count_seconds: 0.0,
                }
            }
            None => count(c),
        });
    }
    Ok(out.into_iter().flatten().collect())
}

/// Why static candidate `c` cannot be what [`choose`] picks, whatever its counts, given its
/// `floor` and the candidates `counted` so far; None when it might be.
fn ruled_out(
    c: &Candidate,
    floor: &StaticFloor,
    budget: u64,
    counted: &[&Planned],
    exact_preference: f64,
) -> Option<String> {
    if floor.bytes > budget {
        return Some(format!(
            "its ranks' own rows alone need {} bytes, over the {budget}-byte budget",
            floor.bytes
        ));
    }
    let fastest = |exact: bool| {
        counted
            .iter()
            .filter(|p| p.fits && p.candidate.is_exact() == exact)
            .filter_map(|p| p.prediction.as_ref().map(|x| (x.epoch_s, p.name.as_str())))
            .min_by(|a, b| a.0.total_cmp(&b.0))
    };
    let (exact, sampled) = (fastest(true), fastest(false));
    if c.is_exact() {
        let at_least = floor.exact_s;
        if let Some((t, name)) = exact.filter(|&(t, _)| at_least > t) {
            return Some(format!(
                "at least {at_least:.3} s per epoch (its own rows' compute), slower than {name} \
                 ({t:.3} s)"
            ));
        }
        if let Some((t, name)) = sampled.filter(|&(t, _)| at_least > t * exact_preference) {
            return Some(format!(
                "at least {at_least:.3} s per epoch (its own rows' compute), more than \
                 {exact_preference:.2}x the {t:.3} s of {name}"
            ));
        }
    } else {
        let at_least = floor.sampled_s;
        if let Some((t, name)) = sampled.filter(|&(t, _)| at_least > t) {
            return Some(format!(
                "at least {at_least:.3} s per epoch (its own rows' compute), slower than {name} \
                 ({t:.3} s)"
            ));
        }
        if let Some((t, name)) = exact.filter(|&(t, _)| at_least * exact_preference >= t) {
            return Some(format!(
                "at least {at_least:.3} s per epoch (its own rows' compute): not \
                 {exact_preference:.2}x faster than the exact {name} ({t:.3} s)"
            ));
        }
    }
    None
}

/// Counts one epoch of `decision`'s schedule (epoch 0; per-iteration schedules: its first
/// [`COUNTED_STEPS`] steps, scaled), with the mean pairs a link job's batched step scores (0
/// for every other schedule).
fn count_epoch(
    inputs: &crate::steps::StepInputs<'_>,
    decision: &crate::decide::Decision<'_>,
    work: &[LayerWork],
    widths: (usize, usize),
    preparer: &Preparer<'_>,
) -> anyhow::Result<(EpochCounts, f64)> {
    let ctx = inputs.ctx;
    use crate::steps::Schedule;
    let iterations = decision.schedule.iterations();
    let counted = iterations.clamp(1, COUNTED_STEPS);
    let mut counts = EpochCounts {
        iterations,
        scale: iterations as f64 / counted as f64,
        ..EpochCounts::default()
    };
    let mut prev = None;
    let mut pairs = 0;
    for it in 0..counted {
        let t = std::time::Instant::now();
        let built = crate::steps::build_step(inputs, &decision.schedule, 0, it, prev.as_ref())?;
        if matches!(
            decision.schedule,
            Schedule::Cob { .. } | Schedule::Mb { .. } | Schedule::Cluster { .. }
        ) {
            counts.build_seconds += t.elapsed().as_secs_f64() * counts.scale;
            // A run's producers then prepare every rank's input of the step (its graphs and
            // its feature rows, `crate::feed::Fetch`): host work too, timed on the first
            // steps (reading every counted step's rows would make planning slow).
            if it < INPUT_STEPS {
                let t = std::time::Instant::now();
                for rank in 0..ctx.layout().num_ranks() {
                    HostInput::prepare(preparer, &built.1.plans, rank)?;
                }
                counts.build_seconds +=
                    t.elapsed().as_secs_f64() * iterations as f64 / counted.min(INPUT_STEPS) as f64;
            }
        }
        let mut step = count_step(&built.1, ctx.layout(), work, widths);
        crate::steps::raise_peaks(&mut counts.model_bytes, &built.2.model_bytes);
        let fetch = std::mem::take(&mut step.fetch);
        step.fetch = match &decision.schedule {
            // One plan for the whole run: its features are fetched once, before training.
            Schedule::Static { .. } => {
                counts.setup_fetch = fetch;
                Traffic::default()
            }
            // Sampled FLX fetches when it draws a sample: once, or every `every` epochs.
            Schedule::FlxSampled { every, .. } => match every {
                Some(n) if *n > 0 => fetch.scaled(1.0 / *n as f64),
                _ => {
                    counts.setup_fetch = fetch;
                    Traffic::default()
                }
            },
            Schedule::Cob { .. } | Schedule::Mb { .. } | Schedule::Cluster { .. } => fetch,
        };
        counts.steps.push(step);
        pairs += built.1.link.pairs();
        prev = Some(built);
    }
    Ok((counts, pairs as f64 / counted as f64))
}

/// The planner's rule over any epoch times of `planned` (`time(i)`, None for a candidate
/// without one): the fastest exact candidate, the fastest sampled one, and which of the two
/// the rule takes — the sampled one only when `exact_preference` times faster (sampling
/// changes what is learned; exact plans reproduce full-batch training). [`choose`] applies it
/// to the predictions; `grandis bench plan` to the measured epochs, to check the choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ruled {
    pub exact: Option<usize>,
    pub sampled: Option<usize>,
    pub chosen: Option<usize>,
}

pub fn rule(
    planned: &[Planned],
    exact_preference: f64,
    time: impl Fn(usize) -> Option<f64>,
) -> Ruled {
    let fastest = |exact: bool| {
        (0..planned.len())
            .filter(|&i| planned[i].candidate.is_exact() == exact)
            .filter_map(|i| time(i).map(|t| (i, t)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    };
    let (exact, sampled) = (fastest(true), fastest(false));
    // The candidate of the least [`rule_cost`] (the exact one on a tie).
    let chosen = match (exact, sampled) {
        (Some((_, e)), Some((s, st)))
            if rule_cost(false, st, exact_preference) < rule_cost(true, e, exact_preference) =>
        {
            Some(s)
        }
        (Some((e, _)), _) => Some(e),
        (None, s) => s.map(|(s, _)| s),
    };
    Ruled {
        exact: exact.map(|(i, _)| i),
        sampled: sampled.map(|(i, _)| i),
        chosen,
    }
}

/// What [`rule`] minimises: an exact plan's epoch, a sampled plan's epoch `exact_preference`
/// times over. The measure of a choice: a chosen plan 1.01x the best one's cost lost 1 % by
/// the rule's own account, where comparing epochs would call an exact choice 1.21x slower
/// than a sampled plan 1.21x faster (by 1.2x wanted) and 1.00x at 1.19x.
pub fn rule_cost(exact: bool, epoch_s: f64, exact_preference: f64) -> f64 {
    if exact {
        epoch_s
    } else {
        epoch_s * exact_preference
    }
}

/// The plan to run: [`rule`] over the predictions of the candidates that fit their budget.
/// Returns its index in `planned` and why; None when nothing fits.
pub fn choose(planned: &[Planned], exact_preference: f64) -> Option<(usize, String)> {
    let predicted = |i: usize| {
        let p: &Planned = &planned[i];
        p.prediction.as_ref().filter(|_| p.fits).map(|x| x.epoch_s)
    };
    let time = |i: usize| predicted(i).unwrap_or(f64::INFINITY);
    let ruled = rule(planned, exact_preference, predicted);
    let chosen = ruled.chosen?;
    let why = match (ruled.exact, ruled.sampled) {
        (Some(e), Some(s)) if chosen == s => format!(
            "{} is predicted {:.2}x faster than the fastest exact plan ({}), more than the \
             {exact_preference:.2}x a sampled plan must win by",
            planned[s].name,
            time(e) / time(s),
            planned[e].name
        ),
        (Some(_), Some(s)) => format!(
            "the fastest exact plan; the fastest sampled one ({}) is not {exact_preference:.2}x faster",
            planned[s].name
        ),
        (Some(_), None) => "the fastest plan that fits".into(),
        (None, _) => {
            if planned
                .iter()
                .any(|p| p.candidate.is_exact() && p.pruned.is_some())
            {
                format!(
                    "the fastest plan that fits; the exact plans are ruled out by their floors \
                     (more than {exact_preference:.2}x slower than this one, or over the budget)"
                )
            } else {
                "no exact plan fits the budget".into()
            }
        }
    };
    Some((chosen, why))
}

/// Vertices of [`calibrate`]'s sample.
pub const CALIBRATION_VERTICES: usize = 50_000;

/// About how long the calibration trains (at least three epochs, at most ten).
const CALIBRATION_SECONDS: f64 = 0.2;

/// The types of a typed dataset's first `n` vertices (the calibration sample): each type cut
/// to its ids below `n`, the relations as they are.
fn sample_types(
    types: &grandis_store::Types,
    n: usize,
    width: usize,
) -> anyhow::Result<grandis_store::Types> {
    let mut schema = types.schema.clone();
    for (t, vt) in schema.vertex_types.iter_mut().enumerate() {
        let r = types.range(t);
        vt.count = u64::from(r.end.min(n as u32).saturating_sub(r.start));
    }
    schema.relations.iter_mut().for_each(|r| r.num_edges = 0);
    grandis_store::Types::new(schema, n as u64, width as u64).map_err(anyhow::Error::msg)
}

/// [`PlanRates::calibration`] and [`PlanRates::kernel_calibration`] for `config` on `view`:
/// trains the model full-batch for three to ten epochs (about [`CALIBRATION_SECONDS`]) on the
/// first [`CALIBRATION_VERTICES`] vertices (their features, labels and in-edges, sources
/// beyond them folded in) with `threads` threads, and compares the fastest epoch after the
/// first, and its kernels' timers, with what the kernel rates `rate` predict for the same
/// rows and edges ([`Calibration::of`]).
pub fn calibrate(
    view: grandis_store::DatasetView<'_>,
    config: &ModelConfig,
    rate: &ComputeRate,
    threads: usize,
) -> anyhow::Result<Calibration> {
    let n = view.num_vertices().min(CALIBRATION_VERTICES);
    // The first `n` vertices, each with all its in-edges: a neighbour beyond the sample is
    // folded into it (`u mod n`), so the sample aggregates as many edges per row as the
    // plans do. Keeping only the edges inside the sample kept a quarter of a 200k-vertex
    // graph's (its first 50k vertices), and the calibration then charged the rows' fixed
    // costs at 1.45x the two rates where the whole 20k-vertex graph measured 0.95x: the
    // plans' compute was overpredicted 1.2-1.45x. A typed graph keeps only the edges inside
    // (a folded edge could join two types no relation joins).
    let fold = view.types.is_none();
    let mut edges = Vec::new();
    for v in 0..n as u32 {
        for &u in view.graph.neighbors(v) {
            if fold || (u as usize) < n {
                edges.push((u % n as u32, v));
            }
        }
    }
    let graph = grandis_store::graph_from_edges(
        n as u64,
        edges,
        grandis_store::EdgeOptions {
            symmetrize: false,
            self_loops: grandis_store::SelfLoops::Keep,
        },
    )?;
    let f = view.feature_dim;
    let mut read = vec![0f32; n * f];
    let ids: Vec<u32> = (0..n as u32).collect();
    view.gather_features(&ids, &mut read)?;
    // The model's whole input: learnable embedding columns after the features stand in as
    // zeros (the same products and sums).
    let width = config.in_dim.max(f);
    let features = match width == f {
        true => read,
        false => {
            let mut padded = vec![0f32; n * width];
            for (row, src) in padded
                .chunks_exact_mut(width)
                .zip(read.chunks_exact(f.max(1)))
            {
                row[..f].copy_from_slice(src);
            }
            padded
        }
    };
    // The model's own output width: a link job's encoder outputs embeddings, not the
    // dataset's classes; the timing is the same whatever the labels say.
    let classes = config.classes.max(1);
    let labels: Vec<i32> = (0..n)
        .map(|v| view.labels[v].max(0) % classes as i32)
        .collect();
    let sample = grandis_store::InMemoryDataset {
        name: "calibration".into(),
        graph,
        features,
        feature_dim: width,
        labels,
        num_classes: classes,
        split: grandis_store::Split {
            train: ids,
            val: Vec::new(),
            test: Vec::new(),
        },
        types: view.types.map(|t| sample_types(t, n, width)).transpose()?,
    };
    let sv = sample.view();
    let work = layer_work(config, &crate::model_dims(config))?;
    let whole = LayerRowCounts::square(n as f64, sv.graph.num_edges() as f64);
    let modelled = work
        .iter()
        .map(|w| layer_seconds(&whole, w, rate, false) + layer_seconds(&whole, w, rate, true))
        .fold(KernelSeconds::default(), |a, b| a + b);
    let modelled_s = modelled.dense + modelled.aggregation;
    // The fastest epoch after the first: of two, when epochs take tenths of a second; of
    // up to nine, when they take milliseconds (a small graph's calibration, from three epochs,
    // moved by a third between two plans of the same job).
    let epochs = (CALIBRATION_SECONDS / modelled_s.max(1e-9))
        .ceil()
        .clamp(3.0, 10.0) as usize;
    let opts: grandis_trainer::TrainOptions = serde_json::from_value(serde_json::json!({
        "epochs": epochs, "lr": 0.01, "weight_decay": 5e-4, "adamw": false, "grad_clip": null,
        "eval": "never", "seed": 0,
    }))?;
    let prepared = grandis_trainer::Prepared::new(sv, config.kind, Some(threads))?;
    let b = &prepared.backend;
    // On the backend's own thread, as a rank runs its kernels (and `grandis_trainer::train`).
    let fastest = b.install(
        || -> anyhow::Result<Option<(f64, grandis_engine::OpTimes)>> {
            use grandis_engine::{Kernels, OpProfile};
            let mut model = grandis_models::Model::new(b, config.clone())?;
            let mut fastest: Option<(f64, grandis_engine::OpTimes)> = None;
            for epoch in 1..=epochs {
                b.reset_op_times();
                let start = std::time::Instant::now();
                prepared.train_step(&mut model, None, &opts, epoch)?;
                b.synchronize()?;
                let seconds = start.elapsed().as_secs_f64();
                if epoch > 1 && fastest.as_ref().is_none_or(|(f, _)| seconds < *f) {
                    fastest = Some((seconds, b.op_times()));
                }
            }
            Ok(fastest)
        },
    )?;
    Ok(match fastest {
        Some((measured, ops)) if modelled_s > 0.0 && measured > 0.0 => {
            Calibration::of(measured, &ops, modelled)
        }
        _ => Calibration::default(),
    })
}

/// What [`calibrate`] measured: [`PlanRates::calibration`] and
/// [`PlanRates::kernel_calibration`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    pub step: f64,
    pub kernels: Option<KernelCalibration>,
}

impl Default for Calibration {
    /// Not calibrated: the rates as measured.
    fn default() -> Calibration {
        Calibration {
            step: 1.0,
            kernels: None,
        }
    }
}

impl Calibration {
    /// A step of `measured` seconds whose kernels' timers said `ops`, against `modelled`
    /// (both classes non-zero in sum). Each class gets its own measured seconds over its
    /// modelled ones, scaled by the step over the two classes' measured sum: the rest of the
    /// step (element-wise work, the loss, the optimiser) goes to both in proportion. A class
    /// the model prices at nothing, or the timers saw nothing of, takes the step's factor.
    /// The forward products' rate is measured on one shape and a step runs three (a weight
    /// gradient is a transposed product over all rows): on a 20k-vertex graph the products
    /// ran at 0.7x their modelled time and the aggregation 1.4x, which one factor for both
    /// cannot price for a mini-batch (many input rows, few edges each).
    pub fn of(measured: f64, ops: &grandis_engine::OpTimes, modelled: KernelSeconds) -> Self {
        let step = measured / (modelled.dense + modelled.aggregation);
        let timed = ops.gemm_s + ops.aggregate_s;
        let share = measured / timed.max(f64::MIN_POSITIVE);
        let factor = |seconds: f64, model: f64| match seconds > 0.0 && model > 0.0 {
            true => seconds / model * share,
            false => step,
        };
        Calibration {
            step,
            kernels: (timed > 0.0).then(|| KernelCalibration {
                dense: factor(ops.gemm_s, modelled.dense),
                aggregation: factor(ops.aggregate_s, modelled.aggregation),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates() -> PlanRates {
        PlanRates {
            compute: ComputeRate {
                gemm_flops_per_s: 1e9,
                aggregation_edge_cols_per_s: 1e9,
                aggregation_uncached_edge_cols_per_s: 0.0,
                width: 8,
            },
            intra: LinkRate::default(),
            inter: LinkRate::default(),
            contention: 1.0,
            calibration: 1.0,
            kernel_calibration: None,
            shared_cores: None,
            cache_sharers: 1.0,
        }
    }

    /// One rank's epoch of one step computing `rows` rows of every layer from `inputs` input
    /// rows, no edges.
    fn compute_s(work: &[LayerWork], rows: u64, inputs: u64) -> f64 {
        let layers = work.len();
        let counts = EpochCounts {
            iterations: 1,
            steps: vec![StepCounts {
                rows: vec![vec![rows; layers]],
                edges: vec![vec![0; layers]],
                inputs: vec![vec![inputs; layers]],
                forward: vec![Traffic::default(); layers],
                backward: vec![Traffic::default(); layers],
                ..StepCounts::default()
            }],
            scale: 1.0,
            ..EpochCounts::default()
        };
        predict(
            &counts,
            work,
            &Layout::even(rows as u32, 1, 1).unwrap(),
            &rates(),
        )
        .compute_s
    }

    /// The two kernel factors price the calibration's own step at what it measured, each
    /// class by its own timers; a class the timers did not see takes the step's factor.
    #[test]
    fn the_kernel_factors_reproduce_the_sampled_step() {
        let modelled = KernelSeconds {
            dense: 0.25,
            aggregation: 0.5,
        };
        let ops = |gemm_s, aggregate_s| grandis_engine::OpTimes {
            gemm_s,
            aggregate_s,
            other_s: 0.2,
            aggregate_bytes: 0,
        };
        let c = Calibration::of(1.0, &ops(0.5, 0.3), modelled);
        assert!((c.step - 1.0 / 0.75).abs() < 1e-12, "{c:?}");
        let k = c.kernels.unwrap();
        // 0.5 / 0.25 and 0.3 / 0.5, each x 1.0 / 0.8 (the element-wise 0.2 s in proportion).
        assert!((k.dense - 2.5).abs() < 1e-12 && (k.aggregation - 0.75).abs() < 1e-12);
        assert!((modelled.calibrated(&k) - 1.0).abs() < 1e-12);
        // An MLP: no aggregation modelled or timed.
        let mlp = KernelSeconds {
            dense: 0.5,
            aggregation: 0.0,
        };
        let k = Calibration::of(1.0, &ops(0.8, 0.0), mlp).kernels.unwrap();
        assert!((k.dense - 2.0).abs() < 1e-12 && (k.aggregation - 2.0).abs() < 1e-12);
    }

    /// The forward aggregation gathers from the input rows, the backward from the output
    /// rows' gradients: a layer reading far more rows than it writes (a replicated plan's)
    /// gathers its backward at the smaller set's rate.
    #[test]
    fn the_backward_aggregation_reads_the_output_rows() {
        let mut rate = rates().compute;
        rate.aggregation_uncached_edge_cols_per_s = rate.aggregation_edge_cols_per_s / 8.0;
        let config = ModelConfig::new(grandis_models::ModelKind::Sage, 1, 8, 8, 8);
        let w = &layer_work(&config, &crate::model_dims(&config)).unwrap()[0];
        let n = |rows: f64, inputs: f64| LayerRowCounts {
            rows,
            inputs,
            edges: 1e6,
            cache_sharers: 1.0,
        };
        let aggregation =
            |n: &LayerRowCounts, backward| layer_seconds(n, w, &rate, backward).aggregation;
        let (few, many) = (100.0, 1e7);
        // Within the caches both ways when the layer writes few rows; beyond them forward
        // when it reads many.
        let cached = aggregation(&n(few, few), false);
        assert_eq!(aggregation(&n(few, many), true), cached);
        assert!((aggregation(&n(few, many), false) - 8.0 * cached).abs() < 1e-9 * cached);
        // A square layer reads the same rows both ways.
        assert_eq!(
            aggregation(&n(many, many), true),
            aggregation(&n(many, many), false)
        );
    }

    /// A SAGE layer that maps before aggregating runs its neighbour weight on every input row
    /// (a rank's halo and replicated rows too) and its self weight on its output rows; one
    /// that aggregates first runs both on its output rows.
    #[test]
    fn input_row_products_are_priced_per_input_row() {
        let config = |in_dim| ModelConfig::new(grandis_models::ModelKind::Sage, 1, in_dim, 8, 8);
        let work = |c: &ModelConfig| layer_work(c, &crate::model_dims(c)).unwrap();
        // 16 -> 8: maps first; 100 output rows, 250 input rows. Forward: self 2*16*8 per
        // output row, neighbour 2*16*8 per input row; backward (no input gradient) the same.
        let narrowing = work(&config(16));
        assert_eq!(narrowing[0].input_flops_per_row, 2.0 * 16.0 * 8.0);
        let per_row = 2.0 * 16.0 * 8.0 / 1e9;
        let expected = 2.0 * (100.0 * per_row + 250.0 * per_row);
        let got = compute_s(&narrowing, 100, 250);
        assert!(
            (got - expected).abs() < 1e-12 * expected,
            "{got} vs {expected}"
        );
        // 4 -> 8 aggregates first: the input rows do not matter.
        let widening = work(&config(4));
        assert_eq!(widening[0].input_flops_per_row, 0.0);
        assert_eq!(
            compute_s(&widening, 100, 250),
            compute_s(&widening, 100, 100)
        );
    }
}
