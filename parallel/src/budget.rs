//! Memory budgets: default budget, priced model shape, choice of k, predicted halo bytes.

use anyhow::{bail, Context};
use grandis_masking::{AttentionDims, InputCopy, KChoice, ModelDims, PlanContext, PreloadPlan};
use grandis_models::ModelConfig;
use grandis_sampling::Sampler;

use grandis_wire::{LinkBytes, Mode};

use crate::{steps, ParallelOptions};

/// Available system memory divided by the `ranks` that share this machine: the default
/// per-device budget of CPU workers (all S × G ranks run in this process, so the "server's"
/// memory is the machine's). `MemAvailable` from `/proc/meminfo`.
pub fn default_device_memory(ranks: usize) -> anyhow::Result<u64> {
    let bytes = grandis_telemetry::mem_available_bytes().context(
        "cannot read MemAvailable from /proc/meminfo for the default --device-memory; pass \
         --device-memory BYTES",
    )?;
    Ok(bytes / ranks.max(1) as u64)
}

/// The page cache a run relies on: the bytes of a mapped graph (a partition dir's). Sampling
/// and plan building read neighbour lists at scattered vertices every step; with the graph
/// evicted each of those reads is a disk request (on a 5M-vertex graph starved of cache the
/// producer took 4x longer). Features are not counted: a step reads its rows into process
/// memory (`RowReader::scattered`), not into the mapping.
pub(crate) fn page_cache_relied_on(part: &crate::PartitionedGraph) -> u64 {
    match &part.graph {
        crate::input::PartGraph::Mapped(_) => {
            let g = part.graph.view();
            (std::mem::size_of_val(g.offsets) + std::mem::size_of_val(g.indices)) as u64
        }
        crate::input::PartGraph::Built(_) => 0,
    }
}

/// The host-memory side of the memory model, checked before training: the page cache the
/// run relies on ([`page_cache_relied_on`]) and the learnable node embeddings this process's
/// ranks will hold (`embeddings`, [`crate::embedding_shard::host_bytes`]) must fit in what the
/// machine has available (`available`, `MemAvailable`; nothing is checked when unknown). What
/// the ranks allocate is their budget's business ([`check_budget`]); what is already resident
/// (the O(V) state) is no longer in `available`.
pub(crate) fn check_host_memory(
    relied_on: u64,
    embeddings: u64,
    available: Option<u64>,
) -> anyhow::Result<()> {
    let Some(available) = available else {
        return Ok(());
    };
    if embeddings > 0 && relied_on + embeddings > available {
        bail!(
            "out of memory (host memory model): the learnable node embeddings of this \
             process's ranks take {embeddings} bytes (their rows, Adam's moments and step \
             counts) beside {relied_on} bytes of the mapped graph in the page cache, and this \
             machine has {available} bytes available: use fewer --embedding-dim columns, more \
             servers, or a machine with more memory"
        );
    }
    if relied_on > available {
        bail!(
            "out of memory (host memory model): sampling reads the mapped graph at scattered \
             vertices every step, so its {relied_on} bytes must stay in the page cache, and \
             this machine has {available} bytes available: free memory on it, or train on a \
             machine with more"
        );
    }
    Ok(())
}

/// The shape the memory model prices: the widths of the rows the convolutions read and
/// write (a model with an encoder exchanges hidden-width rows from layer 0 on).
pub fn model_dims(config: &ModelConfig) -> ModelDims {
    let layout = config.stage_layout();
    ModelDims {
        layers: config.layers,
        features: layout.conv_in,
        hidden: config.hidden,
        classes: layout.conv_out,
        // A transformed conv input, or one dropped out: either way backward recomputes it
        // (grandis-models).
        input_copy: if layout.recomputes_conv_inputs || config.dropout > 0.0 {
            InputCopy::Recomputed
        } else {
            InputCopy::None
        },
        attention: layout
            .attention_output_heads
            .map(|output_heads| AttentionDims { output_heads }),
        link_embedding_values: 0,
        relations: config.relations.len(),
    }
}

/// [`model_dims`] for `job` on a graph of `vertices`: a link-prediction job also holds the
/// output embeddings the decoder reads, gathered on every rank, and their gradient
/// (`link_task`): every vertex's in fb and flx (and, as a bound on its batches, in cluster),
/// a step's targets in cob, none in mb. They are host memory, where CPU ranks compute; a CUDA
/// rank's budget counts them too (the decoder runs on the host), which over-states its
/// device's need by that much rather than let the host run out.
pub fn job_dims(config: &ModelConfig, job: &grandis_wire::JobSpec, vertices: usize) -> ModelDims {
    use grandis_wire::Mode;
    let mut dims = model_dims(config);
    if job.task == grandis_wire::Task::Link {
        let rows = match job.mode {
            // A rank scores its batch's pairs over its own targets' rows: no gathered matrix.
            Mode::Mb => 0,
            // Every server's co-batch targets, one after another: a co-batch of B supervision
            // edges and k negatives each has at most B sources and B (1 + k) destinations.
            Mode::Cob => {
                let b = job.batch_size_or_default() as u64;
                let k = job.link.unwrap_or_default().negatives as u64;
                job.servers as u64 * (b * (2 + k)).min(vertices as u64)
            }
            _ => vertices as u64,
        };
        dims.link_embedding_values = rows * config.classes as u64;
    }
    dims
}

/// The k a run will use, with its reason and estimates.
pub fn choose_preload_hops(
    ctx: &PlanContext<'_>,
    config: &ModelConfig,
    popts: &ParallelOptions,
) -> anyhow::Result<KChoice> {
    let dims = job_dims(config, &popts.job, ctx.num_vertices());
    match (popts.job.mode, popts.preload_hops()) {
        (Mode::Cob | Mode::Mb | Mode::Cluster | Mode::Single | Mode::Auto, _) => bail!(
            "--mode {} runs every layer on its per-iteration plans; preloading is for --mode flx",
            popts.job.mode.name()
        ),
        (Mode::Fb, Some(k)) if k > 0 => {
            bail!("--preload-hops {k} needs --mode flx (FB_base never preloads)")
        }
        (Mode::Fb, _) => Ok(KChoice {
            k: 0,
            estimates: vec![grandis_masking::estimate(&dims, &ctx.fb_plan()?, None)],
            reason: "FB_base: no preloading (k = 0)".into(),
        }),
        (Mode::Flx, Some(k)) => {
            if k > config.layers {
                bail!(
                    "--preload-hops {k} is more than the model's {} layers",
                    config.layers
                );
            }
            Ok(KChoice {
                k,
                estimates: Vec::new(),
                reason: format!("k = {k} fixed by --preload-hops"),
            })
        }
        (Mode::Flx, None) => {
            let (budget, from) = budget(popts, ctx.layout())?;
            let choice = ctx.choose_k(&dims, budget).with_context(|| {
                format!("choosing k for a per-device budget of {budget} bytes ({from})")
            })?;
            Ok(KChoice {
                reason: format!("{} (budget from {from})", choice.reason),
                ..choice
            })
        }
    }
}

/// Enforces a given per-device budget (`--device-memory`; a daemon always resolves one) the
/// way a device of that size would, but before anything is allocated: a plan whose
/// memory-model estimate (`model_bytes`, per rank) exceeds the budget is out of memory.
/// Without a budget nothing is checked (an in-process run's default budget is a share of this
/// machine's free memory, which the model only approximates).
pub(crate) fn check_budget(
    budget: Option<u64>,
    model_bytes: &[u64],
    what: &str,
) -> anyhow::Result<()> {
    let Some(budget) = budget else {
        return Ok(());
    };
    if let Some((rank, &need)) = model_bytes
        .iter()
        .enumerate()
        .filter(|&(_, &b)| b > budget)
        .max_by_key(|&(_, &b)| b)
    {
        bail!(
            "out of memory (memory model): {what} needs {need} bytes on rank {rank}, over the \
             per-device budget of {budget} bytes (--device-memory, or device_memory of the job \
             or daemon); try a smaller --cobatch-size or --batch-size, --sampling eas, or \
             --mode auto"
        );
    }
    Ok(())
}

/// The per-device budget of a run and where it came from: `--device-memory` when given, else
/// a share of what this machine's ranks compute on (see [`default_budget`]).
pub(crate) fn budget(
    popts: &ParallelOptions,
    layout: &grandis_masking::Layout,
) -> anyhow::Result<(u64, String)> {
    Ok(match popts.job.device_memory {
        Some(b) => (b, "--device-memory".to_string()),
        None => default_budget(&popts.machine.compute, layout.servers(), layout.devices())?,
    })
}

/// The default per-device budget of `servers` x `devices` ranks run on this machine, and
/// where it came from. CPU ranks share the machine's available memory. CUDA ranks get
/// 90% of their device's free memory (the rest is left to the context, the loaded
/// kernels and cuBLAS's workspace), divided among the ranks that share the device; the
/// smallest share over the devices used is the budget.
pub fn default_budget(
    compute: &crate::Compute,
    servers: usize,
    devices: usize,
) -> anyhow::Result<(u64, String)> {
    let ranks = servers.max(1) * devices.max(1);
    match compute {
        crate::Compute::Cpu => Ok((
            default_device_memory(ranks)?,
            format!("available system memory / {ranks} ranks on this machine"),
        )),
        crate::Compute::Cuda { .. } => cuda_budget(compute, servers, devices),
    }
}

fn cuda_budget(
    compute: &crate::Compute,
    servers: usize,
    devices: usize,
) -> anyhow::Result<(u64, String)> {
    use grandis_engine::cuda;
    let available = cuda::device_count()?;
    let mut sharing: std::collections::BTreeMap<usize, u64> = Default::default();
    for d in 0..devices.max(1) {
        let ordinal = compute.ordinal(d, available).unwrap_or(0);
        *sharing.entry(ordinal).or_default() += servers.max(1) as u64;
    }
    let mut best: Option<(u64, String)> = None;
    for (ordinal, ranks) in sharing {
        let (free, _) = cuda::device_memory(ordinal)?;
        let share = free / 10 * 9 / ranks;
        if best.as_ref().is_none_or(|(b, _)| share < *b) {
            best = Some((
                share,
                format!("90% of cuda:{ordinal}'s free memory ({free} bytes) / {ranks} ranks on it"),
            ));
        }
    }
    best.context("no CUDA device to size the budget on")
}

/// FLX with a sampler: the largest k whose sampled FLX plan (over the FB plan) fits the
/// budget, built from k = L downwards (sampled plans are small, and the first that fits wins).
pub(crate) fn choose_sampled_k(
    ctx: &PlanContext<'_>,
    dims: &ModelDims,
    fb: &grandis_masking::FbPlan,
    sampler: &dyn Sampler,
    popts: &ParallelOptions,
) -> anyhow::Result<KChoice> {
    let (budget, from) = budget(popts, ctx.layout())?;
    let mut estimates = Vec::new();
    for k in (1..=dims.layers).rev() {
        let flx = steps::flx_sampled(ctx, sampler, k, 0)?;
        let e = grandis_masking::estimate(dims, fb, Some(&flx));
        let fits = e.max_bytes <= budget;
        let (bytes, rank) = (e.max_bytes, e.worst_rank);
        estimates.push(e);
        if fits {
            estimates.reverse();
            return Ok(KChoice {
                k,
                estimates,
                reason: format!(
                    "k = {k} with {}: worst device (rank {rank}) needs {bytes} bytes of the \
                     {budget}-byte budget (from {from})",
                    sampler.name()
                ),
            });
        }
    }
    bail!(
        "no k >= 1 fits the {budget}-byte per-device budget ({from}) with {}; the smallest \
         sampled FLX plan (k = 1) needs {} bytes: use --mode cob",
        sampler.name(),
        estimates.last().map_or(0, |e| e.max_bytes)
    )
}

/// The plan's prediction of one epoch's halo traffic: the forward exchange feeding every
/// layer, plus the same rows back as gradients for every layer whose input gradient is needed
/// (all but layer 0 of sage/gcn, whose input is the features; ResSAGE+ needs layer 0's for its
/// encoder).
pub fn predicted_halo_bytes(plan: &PreloadPlan, config: &ModelConfig) -> LinkBytes {
    let dims = model_dims(config);
    let mut out = LinkBytes::default();
    for l in 0..plan.layers {
        let b = plan.forward_exchange_bytes(l, &dims);
        // Layer 0's input gradient goes back only to a stage before it (an encoder).
        let times = if l > 0 || config.stage_layout().first_conv > 0 {
            2
        } else {
            1
        };
        out.intra_server += times * b.intra_server;
        out.inter_server += times * b.inter_server;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page cache a run relies on is checked against what is available before training;
    /// unknown availability checks nothing.
    #[test]
    fn host_memory_check_names_the_graph_and_the_machine() {
        check_host_memory(4 << 30, 0, Some(4 << 30)).unwrap();
        check_host_memory(4 << 30, 0, None).unwrap();
        let e = check_host_memory(5 << 30, 0, Some(4 << 30))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("out of memory (host memory model)"), "{e}");
        assert!(
            e.contains(&format!("{} bytes must stay", 5u64 << 30)),
            "{e}"
        );
        assert!(
            e.contains(&format!("{} bytes available", 4u64 << 30)),
            "{e}"
        );
        // The embeddings count beside the graph.
        check_host_memory(3 << 30, 1 << 30, Some(4 << 30)).unwrap();
        let e = check_host_memory(3 << 30, (1 << 30) + 1, Some(4 << 30))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "embeddings of this process's ranks take {} bytes",
                (1u64 << 30) + 1
            )),
            "{e}"
        );
    }
}
