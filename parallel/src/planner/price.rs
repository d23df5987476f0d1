//! Counts and measured rates to seconds: each conv layer's kernels priced per row, input row
//! and edge ([`layer_seconds`]), links by bytes and messages, and a step's ranks run through
//! the timeline ([`predict`]). Knows no plans, only their counts.

use grandis_masking::Layout;
use grandis_wire::{ComputeRate, KernelCalibration, LinkRate, PlanRates, Prediction};

use super::counts::{DecoderWork, EpochCounts, LayerWork, Traffic, TypeRows};
use crate::timeline::{self, Op};

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
pub(super) struct LayerRowCounts<'a> {
    /// Output rows.
    pub(super) rows: f64,
    /// Input rows (at least `rows`).
    pub(super) inputs: f64,
    /// Edges aggregated (from the input rows).
    pub(super) edges: f64,
    /// Ranks sharing the caches the input rows are read through ([`Sources::shared`]).
    pub(super) cache_sharers: f64,
    /// A typed model's rows by type (None: untyped, or not counted).
    pub(super) types: Option<&'a TypeRows>,
}

impl<'a> LayerRowCounts<'a> {
    /// A layer reading exactly the rows it writes, alone (the calibration's whole graph).
    pub(super) fn square(rows: f64, edges: f64, types: Option<&'a TypeRows>) -> Self {
        LayerRowCounts {
            rows,
            inputs: rows,
            edges,
            cache_sharers: 1.0,
            types,
        }
    }

    /// The aggregation passes a layer runs over its rows: one, or a typed layer's one per
    /// relation with rows of both its types here (each a pass over every row of the block).
    fn aggregation_passes(&self, relations: &[grandis_models::RelationWork]) -> f64 {
        match (relations.is_empty(), self.types) {
            (true, _) => 1.0,
            (false, None) => relations.len() as f64,
            (false, Some(t)) => relations
                .iter()
                .filter(|r| t.inputs[r.src_type] > 0 && t.rows[r.dst_type] > 0)
                .count() as f64,
        }
    }

    /// Flops of a typed layer's relations `relations` (each per row of its types), one pass.
    /// Without the rows by type, every relation is priced on every row.
    fn relation_flops(&self, relations: &[grandis_models::RelationWork]) -> f64 {
        relations
            .iter()
            .map(|r| {
                let (sources, destinations) = match self.types {
                    Some(t) => (t.inputs[r.src_type] as f64, t.rows[r.dst_type] as f64),
                    None => (self.inputs, self.rows),
                };
                sources * r.per_source_input_row + destinations * r.per_destination_output_row
            })
            .sum()
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
    pub(super) fn calibrated(self, factors: &KernelCalibration) -> f64 {
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
pub(super) fn layer_seconds(
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
        + n.inputs.max(n.rows) * w.input_flops_per_row
        + n.relation_flops(&w.relations);
    // The forward pass gathers from the input rows; the backward walks the transposed
    // graph, gathering from the output rows' gradients (and writing the input rows' in
    // order). A replicated plan's layer reads 2-3x as many input rows as it writes: a 200k
    // graph's flx k=3 layer of 58k rows over 178k inputs gathered its backward at 1.5x
    // its forward rate.
    let (read, walked) = match backward {
        false => (n.inputs, n.rows),
        true => (n.rows, n.inputs.max(n.rows)),
    };
    let cols = w.aggregated_cols as f64;
    let at = aggregation_rate(
        rate,
        Sources::shared(read, n.cache_sharers),
        w.aggregated_cols,
    );
    // Every pass writes its rows once (a typed layer passes once per relation, each over
    // every row), at the cached rate whatever the sources; the rates include a row per
    // `DEGREE` edges, which the edges' cost alone does not.
    let rows = walked * n.aggregation_passes(&w.relations) * rate.aggregation_row_edges;
    let edge_share = 1.0 + rate.aggregation_row_edges / crate::measure::DEGREE as f64;
    let cached = rate.aggregation_edge_cols_per_s.max(1.0);
    let aggregation = match backward && !w.backward_aggregates {
        true => 0.0,
        false => (n.edges * cols / at + rows * cols / cached) / edge_share,
    };
    KernelSeconds {
        dense: gemm_factor * flops / rate.gemm_flops_per_s.max(1.0),
        aggregation,
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
                        types: step.type_rows.get(r).map(|t| &t[l]),
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

#[cfg(test)]
mod tests {
    use grandis_models::ModelConfig;

    use super::super::counts::{layer_work, StepCounts};
    use super::*;

    fn rates() -> PlanRates {
        PlanRates {
            compute: ComputeRate {
                gemm_flops_per_s: 1e9,
                aggregation_edge_cols_per_s: 1e9,
                aggregation_uncached_edge_cols_per_s: 0.0,
                width: 8,
                aggregation_row_edges: 0.0,
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
            types: None,
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

    /// Two vertex types, a and b, and a relation each way.
    fn two_way_relations() -> Vec<grandis_models::ModelRelation> {
        let relation = |key: &str, src_type, dst_type| grandis_models::ModelRelation {
            key: key.into(),
            src_type,
            dst_type,
        };
        vec![relation("a__to__b", 0, 1), relation("b__to__a", 1, 0)]
    }

    /// A typed layer's relations run each on its own types' rows: R-GCN's neighbour map on
    /// its source type's input rows (it transforms first), its root on every output row;
    /// hetero-SAGE's self weight on its destination type's output rows.
    #[test]
    fn relations_are_priced_on_their_types_rows() {
        let relations = two_way_relations();
        let work = |kind| {
            let config = ModelConfig {
                relations: relations.clone(),
                ..ModelConfig::new(kind, 1, 16, 8, 8)
            };
            layer_work(&config, &crate::model_dims(&config)).unwrap()
        };
        // Dense seconds of layer `w` over `rows` output and `inputs` input rows by type.
        let dense = |rows: [u64; 2], inputs: [u64; 2], w: &LayerWork| {
            let types = TypeRows {
                rows: rows.to_vec(),
                inputs: inputs.to_vec(),
            };
            let n = LayerRowCounts {
                rows: rows.iter().sum::<u64>() as f64,
                inputs: inputs.iter().sum::<u64>() as f64,
                edges: 0.0,
                cache_sharers: 1.0,
                types: Some(&types),
            };
            layer_seconds(&n, w, &rates().compute, false).dense
        };
        let map = 2.0 * 16.0 * 8.0 / 1e9;
        let (rgcn, sage) = (
            work(grandis_models::ModelKind::Rgcn),
            work(grandis_models::ModelKind::HeteroSage),
        );
        // 10 output rows, all of type a; 100 input rows, 90 of them of type b. R-GCN: a -> b
        // maps the 10 rows of a, b -> a the 90 of b; the root the 10 outputs. Hetero-SAGE:
        // the same neighbour maps, and b -> a's self weight on the 10 outputs of a (a -> b's
        // has no output rows).
        let expected = (10.0 + 90.0 + 10.0) * map;
        assert!((dense([10, 0], [10, 90], &rgcn[0]) - expected).abs() < 1e-15);
        assert!((dense([10, 0], [10, 90], &sage[0]) - expected).abs() < 1e-15);
        // Type b's outputs now: a -> b's self weight runs on them instead.
        assert!((dense([0, 10], [10, 90], &sage[0]) - expected).abs() < 1e-15);
        // Every row of type a: only a -> b's map and b -> a's self weight (R-GCN: its root)
        // remain.
        let expected = (100.0 + 10.0) * map;
        assert!((dense([10, 0], [100, 0], &sage[0]) - expected).abs() < 1e-15);
        assert!((dense([10, 0], [100, 0], &rgcn[0]) - expected).abs() < 1e-15);
    }

    /// Every aggregation pass writes its rows: with rows measured at `row_edges` edges each, a
    /// layer of the probe's shape (16 edges per row) prices as the rates alone say, a layer
    /// of fewer edges per row more per edge, and a typed layer's relations each pass over
    /// the rows (those whose types have rows here).
    #[test]
    fn aggregation_passes_pay_for_their_rows() {
        let mut rate = rates().compute;
        let config = ModelConfig::new(grandis_models::ModelKind::Sage, 1, 8, 8, 8);
        let w = &layer_work(&config, &crate::model_dims(&config)).unwrap()[0];
        let n = |rows: f64, edges: f64| LayerRowCounts {
            rows,
            inputs: rows,
            edges,
            cache_sharers: 1.0,
            types: None,
        };
        let aggregation = |rate: &ComputeRate, n: &LayerRowCounts, w: &LayerWork| {
            layer_seconds(n, w, rate, false).aggregation
        };
        let unpriced = aggregation(&rate, &n(100.0, 1600.0), w);
        rate.aggregation_row_edges = 4.0;
        let probe_shaped = aggregation(&rate, &n(100.0, 1600.0), w);
        assert!((probe_shaped - unpriced).abs() < 1e-12 * unpriced);
        // One edge per row: each edge costs (1 + 4) / (1 + 4 / 16) of what the rates say.
        let sparse = aggregation(&rate, &n(1600.0, 1600.0), w);
        assert!((sparse - unpriced * 5.0 / 1.25).abs() < 1e-12 * sparse);
        // A typed layer: both relations pass over the rows where both have rows, one where
        // the other's source type has none here.
        let relations = two_way_relations();
        let config = ModelConfig {
            relations,
            ..ModelConfig::new(grandis_models::ModelKind::Rgcn, 1, 8, 8, 8)
        };
        let typed = &layer_work(&config, &crate::model_dims(&config)).unwrap()[0];
        let both = TypeRows {
            rows: vec![800, 800],
            inputs: vec![800, 800],
        };
        // Type b's inputs feed a's outputs; no output of b, so a -> b does not run.
        let one = TypeRows {
            rows: vec![1600, 0],
            inputs: vec![1600, 800],
        };
        let with = |t| LayerRowCounts {
            types: Some(t),
            ..n(1600.0, 1600.0)
        };
        let edges_part = |t| {
            aggregation(&rate, &with(t), typed)
                - aggregation(
                    &rate,
                    &LayerRowCounts {
                        edges: 0.0,
                        ..with(t)
                    },
                    typed,
                )
        };
        // The edges cost the same; the rows once more for the second relation.
        assert!((edges_part(&both) - edges_part(&one)).abs() < 1e-12 * sparse);
        let row_cost = |t| {
            aggregation(
                &rate,
                &LayerRowCounts {
                    edges: 0.0,
                    ..with(t)
                },
                typed,
            )
        };
        assert!((row_cost(&both) - 2.0 * row_cost(&one)).abs() < 1e-12 * sparse);
        assert!(row_cost(&one) > 0.0);
    }

    /// A layer that aggregates before it maps keeps its aggregate for its weights' gradient:
    /// its backward reads the graph only for its input's gradient (not on layer 0 of a plain
    /// stack). One that maps first aggregates backward on every layer.
    #[test]
    fn the_first_layer_aggregating_first_does_not_aggregate_backward() {
        let n = LayerRowCounts::square(100.0, 1000.0, None);
        let aggregation = |in_dim, layer: usize| {
            let config = ModelConfig::new(grandis_models::ModelKind::Sage, 2, in_dim, 8, 8);
            let work = layer_work(&config, &crate::model_dims(&config)).unwrap();
            layer_seconds(&n, &work[layer], &rates().compute, true).aggregation
        };
        // 4 -> 8 aggregates first: nothing backward on layer 0, its input gradient on layer 1
        // (8 -> 8 maps first there anyway).
        assert_eq!(aggregation(4, 0), 0.0);
        assert!(aggregation(4, 1) > 0.0);
        // 16 -> 8 maps first.
        assert!(aggregation(16, 0) > 0.0);
    }
}
