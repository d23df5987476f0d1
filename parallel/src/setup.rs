//! Setup shared by training and embedding: input checks, labelled flags, planning context.

use anyhow::{bail, Context};
use grandis_masking::{PlanContext, SplitMembership, SPLIT_TEST, SPLIT_TRAIN, SPLIT_VAL};
use grandis_models::ModelConfig;
use grandis_store::{DatasetView, LinkSplitView};
use grandis_trainer::Objective;

use crate::PartitionedGraph;

/// `old_to_new[original id]`: the inverse of the partition's relabelling.
pub(crate) fn old_to_new(part: &PartitionedGraph) -> Vec<u32> {
    let mut old_to_new = vec![0u32; part.new_to_old.len()];
    for (new, &old) in part.new_to_old.iter().enumerate() {
        old_to_new[old as usize] = new as u32;
    }
    old_to_new
}

/// Labelled-vertex flags (`SPLIT_*` by NEW id, only vertices with a valid label) and the
/// labelled train / val / test totals.
pub(crate) fn labelled(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
) -> anyhow::Result<(Vec<u8>, [usize; 3])> {
    let n = view.num_vertices();
    let old_to_new = old_to_new(part);
    let mut flags = vec![0u8; n];
    let mut totals = [0usize; 3];
    for (j, (ids, bit)) in [
        (view.train, SPLIT_TRAIN),
        (view.val, SPLIT_VAL),
        (view.test, SPLIT_TEST),
    ]
    .into_iter()
    .enumerate()
    {
        for &o in ids {
            let l = *view
                .labels
                .get(o as usize)
                .with_context(|| format!("split id {o} is out of range ({n} vertices)"))?;
            if l >= 0 && (l as usize) < view.num_classes {
                let f = &mut flags[old_to_new[o as usize] as usize];
                if *f & bit == 0 {
                    *f |= bit;
                    totals[j] += 1;
                }
            }
        }
    }
    Ok((flags, totals))
}

/// Whether new id `g` is a labelled train vertex, by the flags of [`labelled`].
pub(crate) fn in_train_split(flags: &[u8], g: u32) -> bool {
    flags[g as usize] & SPLIT_TRAIN != 0
}

/// The job's dependency sampler ([`grandis_sampling::dependency_sampler`]) on `part`: its
/// per-relation fanouts read the dataset's types through the partition's relabelling.
pub(crate) fn dependency_sampler(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    sampling: &grandis_wire::Sampling,
    layers: usize,
    seed: u64,
) -> anyhow::Result<Option<Box<dyn grandis_sampling::Sampler>>> {
    let typed = view.types.map(|types| grandis_sampling::TypedGraph {
        types,
        new_to_old: &part.new_to_old,
    });
    Ok(grandis_sampling::dependency_sampler(
        sampling, layers, seed, typed,
    )?)
}

/// The planning context of a partitioned dataset: the relabelled graph, its layout and the
/// LABELLED split membership (so co-batches and mini-batches only draw vertices that carry a
/// loss).
pub fn plan_context<'a>(
    view: &DatasetView<'_>,
    part: &'a PartitionedGraph,
) -> anyhow::Result<PlanContext<'a>> {
    let n = view.num_vertices();
    if part.graph.view().num_vertices() != n || part.new_to_old.len() != n {
        bail!(
            "the partitioned graph has {} vertices, the dataset {n}",
            part.graph.view().num_vertices()
        );
    }
    let (flags, _) = labelled(view, part)?;
    let ids = |bit: u8| -> Vec<u32> {
        (0..n as u32)
            .filter(|&v| flags[v as usize] & bit != 0)
            .collect()
    };
    let splits =
        SplitMembership::from_lists(n, &ids(SPLIT_TRAIN), &ids(SPLIT_VAL), &ids(SPLIT_TEST))?;
    let (graph, layout) = (part.graph.view(), part.layout.clone());
    Ok(if part.symmetric {
        PlanContext::symmetric(graph, layout, splits)?
    } else {
        PlanContext::new(graph, layout, splits)?
    })
}

/// Checks that `view`, `part` and `config` belong together.
pub(crate) fn check_inputs(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
) -> anyhow::Result<()> {
    check_job_inputs(view, part, config, Objective::Node, 0).map(drop)
}

/// [`check_inputs`] for a run trained for `objective` with `embedding_dim` learnable input
/// columns: for link prediction, the dataset's checked link split
/// ([`grandis_trainer::check_config`]).
pub(crate) fn check_job_inputs<'v>(
    view: &DatasetView<'v>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    objective: Objective,
    embedding_dim: usize,
) -> anyhow::Result<Option<LinkSplitView<'v>>> {
    let n = view.num_vertices();
    let links = grandis_trainer::check_config(view, config, objective, embedding_dim)?;
    if embedding_dim > 0 && config.stage_layout().first_conv > 0 {
        // The ranks' embedding gradients come from the first convolution's input
        // (`crate::embedding_shard`); a job spec never gets here with such a model.
        bail!(
            "learnable node embeddings train with models whose first stage is a convolution, \
             not {}",
            config.kind.name()
        );
    }
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid model configuration: {e}"))?;
    if !config.stage_layout().reads_graph {
        bail!(
            "--model mlp reads no graph; partition-parallel modes need sage, gcn, gat or ressage"
        );
    }
    if view.features.len() != n * view.feature_dim || view.labels.len() != n {
        bail!(
            "dataset holds {} feature values and {} labels for {n} vertices x {} features",
            view.features.len(),
            view.labels.len(),
            view.feature_dim
        );
    }
    if part.graph.view().num_vertices() != n || part.new_to_old.len() != n {
        bail!(
            "the partitioned graph has {} vertices, the dataset {n}",
            part.graph.view().num_vertices()
        );
    }
    let layout = &part.layout;
    let (servers, devices) = (layout.servers(), layout.devices());
    let ranks = layout.num_ranks();
    if ranks > n {
        bail!(
            "{servers} servers x {devices} devices = {ranks} ranks is more than the {n} vertices"
        );
    }
    if let Some(r) = layout.ranges().iter().position(|r| r.is_empty()) {
        bail!(
            "rank {r} (server {}, device {}) owns no vertex; use fewer servers/devices or \
             another partition",
            layout.server_of_rank(r),
            layout.device_of_rank(r)
        );
    }
    Ok(links)
}
