//! One forward pass over the parallel runner ([`embeddings`]) and checkpoint weights for it.

use std::sync::Arc;

use anyhow::{bail, Context};
use grandis_engine::norm::global_scales;
use grandis_engine::{Backend, CpuBackend};
use grandis_fabric::{Fabric, FabricConfig};
use grandis_masking::{DevicePlan, FlxPlan};
use grandis_models::ModelConfig;
use grandis_store::DatasetView;
use grandis_trainer::TrainOptions;

use crate::setup::{check_inputs, labelled, plan_context};
use crate::{steps, worker, PartitionedGraph};

/// Per-layer and final outputs of one forward pass, in ORIGINAL vertex order.
#[derive(Debug, Clone)]
pub struct Embeddings {
    /// `layers[l]`: `n x widths[l]` outputs of conv layer l (after its activation; the
    /// logits for the last layer of sage/gcn). Rows of vertices that were no target are NaN.
    pub layers: Vec<Vec<f32>>,
    pub widths: Vec<usize>,
    /// `n x classes` model outputs (NaN rows for non-targets).
    pub logits: Vec<f32>,
    /// Which vertices were targets (computed).
    pub computed: Vec<bool>,
}

/// One forward pass (dropout off) over the partition-parallel runner: on the exact FB plan
/// (`plan` None), or on a masked plan whose every layer is masked (`plan.k` = the model's
/// layers: a co-batch, EAS, fanout or SAINT plan built over [`plan_context`] of the same
/// `part`). `weights` (model parameter order, e.g. from [`checkpoint_weights`]) replace the
/// seeded initialisation. Only the plan's targets (inner rows) get outputs.
pub fn embeddings(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    weights: Option<&[Vec<f32>]>,
    plan: Option<FlxPlan>,
    threads_per_rank: Option<usize>,
) -> anyhow::Result<Embeddings> {
    check_inputs(&view, part, config)?;
    let n = view.num_vertices();
    let layout = &part.layout;
    let ranks = layout.num_ranks();
    let (labelled_flags, totals) = labelled(&view, part)?;
    let per_rank: Vec<Vec<Arc<DevicePlan>>> = match plan {
        Some(p) => {
            if p.k != config.layers || p.devices.len() != ranks {
                bail!(
                    "the plan has {} masked layers over {} devices; the model has {} layers \
                     and the layout {ranks} devices",
                    p.k,
                    p.devices.len(),
                    config.layers
                );
            }
            p.devices
                .into_iter()
                .map(|d| steps::every_layer(d, config.layers))
                .collect()
        }
        None => {
            let ctx = plan_context(&view, part)?;
            ctx.fb_plan()?
                .devices
                .into_iter()
                .map(|d| steps::every_layer(d, config.layers))
                .collect()
        }
    };
    let feed = crate::feed::Feed::new(ranks, 1, 0);
    feed.push(0, Arc::new(steps::Step::new(per_rank, 0)));
    let scales = global_scales(part.graph.view(), grandis_models::aggregation(config.kind));
    let opts: TrainOptions = serde_json::from_value(serde_json::json!({
        "epochs": 0, "lr": 0.0, "weight_decay": 0.0, "adamw": false, "grad_clip": null, "seed": 0,
        "eval": "never"
    }))?;
    let shared = crate::shared::Shared {
        view,
        new_to_old: &part.new_to_old,
        layout: &part.layout,
        scales: &scales,
        config,
        opts: &opts,
        link: None,
        labelled_flags: &labelled_flags,
        totals,
        collect_logits: false,
        infer: None,
        feed: &feed,
        prefetch: None,
        answerer: None,
        iterations: 1,
        eval: crate::shared::EvalOn::TrainingPlans,
        weights,
        resume: None,
        checkpoint: &grandis_trainer::CheckpointOptions::default(),
        staleness: None,
        remote_features: None,
        buffers: &crate::prepare::BufferPool::default(),
        server_counts: None,
        steps_read_every_vertex: true,
    };
    let threads = threads_per_rank.unwrap_or_else(|| crate::compute::cores_per_rank(ranks));
    let fabric = Fabric::new(FabricConfig {
        servers: layout.servers(),
        devices: layout.devices(),
        ..FabricConfig::default()
    })?;
    let results = fabric.run(|ep| {
        let backend = CpuBackend::new(Some(threads))?;
        worker::Worker::new(&shared, &backend, ep, crate::links::RankLinks::fabric())?.embed()
    })?;
    let model = grandis_models::Model::new(&CpuBackend::new(Some(1))?, config.clone())?;
    let first_conv = config.stage_layout().first_conv;
    let widths: Vec<usize> = (0..config.layers)
        .map(|l| model.stage_dims(first_conv + l).1)
        .collect();
    let c = config.classes;
    let mut layers: Vec<Vec<f32>> = widths.iter().map(|&w| vec![f32::NAN; n * w]).collect();
    let mut logits = vec![f32::NAN; n * c];
    let mut computed = vec![false; n];
    for r in &results {
        for (i, &o) in r.ids.iter().enumerate() {
            let o = o as usize;
            computed[o] = true;
            logits[o * c..(o + 1) * c].copy_from_slice(&r.logits[i * c..(i + 1) * c]);
            for (l, &w) in widths.iter().enumerate() {
                let src = r.layers.get(l).context("a captured layer")?;
                layers[l][o * w..(o + 1) * w].copy_from_slice(&src[i * w..(i + 1) * w]);
            }
        }
    }
    Ok(Embeddings {
        layers,
        widths,
        logits,
        computed,
    })
}

/// The model configuration and host weights (parameter order) of a trainer checkpoint.
pub fn checkpoint_weights(path: &std::path::Path) -> anyhow::Result<(ModelConfig, Vec<Vec<f32>>)> {
    let ck = grandis_trainer::load_checkpoint(path)?;
    if ck.train.as_ref().is_some_and(|t| t.embedding_dim > 0) {
        bail!(
            "the checkpoint's model reads learnable node embeddings besides the features; this \
             pass reads the features only so far"
        );
    }
    let b = CpuBackend::new(Some(1))?;
    let mut model = grandis_models::Model::new(&b, ck.model.clone())?;
    ck.restore(&b, &mut model, false)
        .with_context(|| format!("restoring checkpoint {}", path.display()))?;
    let weights = model
        .params
        .iter()
        .map(|p| {
            let mut host = vec![0f32; p.len()];
            b.download(&p.value, 0, &mut host).map(|_| host)
        })
        .collect::<grandis_engine::Result<Vec<_>>>()?;
    Ok((ck.model, weights))
}
