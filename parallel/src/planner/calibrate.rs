//! The model trained on a sample of the graph, against what [`super::price`] says its kernels
//! take: the factors ([`Calibration`]) that carry the probe's rates over to this model on this
//! graph.

use grandis_models::ModelConfig;
use grandis_wire::{ComputeRate, KernelCalibration};

use super::counts::{layer_work, TypeRows};
use super::price::{layer_seconds, KernelSeconds, LayerRowCounts};

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

/// [`grandis_wire::PlanRates::calibration`] and
/// [`grandis_wire::PlanRates::kernel_calibration`] for `config` on `view`: trains the model
/// full-batch for three to ten epochs (about `CALIBRATION_SECONDS`) on the first
/// [`CALIBRATION_VERTICES`] vertices (their features, labels and in-edges, sources beyond them
/// folded in) with `threads` threads, and compares the fastest epoch after the first, and its
/// kernels' timers, with what the kernel rates `rate` predict for the same rows and edges
/// ([`Calibration::of`]).
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
    let types = sv.types.map(TypeRows::whole);
    let whole = LayerRowCounts::square(n as f64, sv.graph.num_edges() as f64, types.as_ref());
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
    let fastest = b.install(|| -> anyhow::Result<Option<grandis_trainer::TimedStep>> {
        let mut model = grandis_models::Model::new(b, config.clone())?;
        let mut fastest: Option<grandis_trainer::TimedStep> = None;
        for epoch in 1..=epochs {
            let step = prepared.timed_train_step(&mut model, &opts, epoch, b)?;
            if epoch > 1 && fastest.as_ref().is_none_or(|f| step.seconds < f.seconds) {
                fastest = Some(step);
            }
        }
        Ok(fastest)
    })?;
    Ok(match fastest {
        Some(step) if modelled_s > 0.0 && step.seconds > 0.0 => {
            Calibration::of(step.seconds, &step.ops, modelled)
        }
        _ => Calibration::default(),
    })
}

/// What [`calibrate`] measured: [`grandis_wire::PlanRates::calibration`] and
/// [`grandis_wire::PlanRates::kernel_calibration`].
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
}
