//! What the benchmarks share: the graph they run on (a dataset, or a synthetic graph from
//! the common flags, partitioned) and the time-to-accuracy reading of a curve.

use anyhow::Context;
use grandis_models::{ModelConfig, ModelKind};
use grandis_parallel::{LinkModel, PartitionedGraph};
use grandis_partition::PartitionMethod;
use grandis_store::InMemoryDataset;
use grandis_synth::{GraphStats, SynthConfig};

/// Training seconds until the validation accuracy first reached `target`, from a curve of
/// (training seconds so far, validation accuracy) after each evaluated epoch.
pub(super) fn seconds_to(curve: &[(f64, f64)], target: f64) -> Option<f64> {
    curve
        .iter()
        .find(|(_, acc)| *acc >= target)
        .map(|(s, _)| *s)
}

/// The dataset in `data`, or the synthetic graph of `synth` when there is none, in memory,
/// with whether every edge has its reverse: the manifest's word, and synthetic graphs are
/// symmetric by construction (checking would walk every edge).
pub(crate) fn dataset_or_synthetic(
    data: Option<&std::path::Path>,
    synth: &SynthConfig,
) -> anyhow::Result<(InMemoryDataset, bool)> {
    Ok(match data {
        Some(dir) => {
            let d = grandis_store::Dataset::open(dir)
                .with_context(|| format!("opening dataset {}", dir.display()))?;
            let v = d.view();
            let copy = 8 * (v.num_vertices() as u64 + 1)
                + 4 * v.graph.num_edges() as u64
                + 4 * v.num_vertices() as u64 * (v.feature_dim as u64 + 1);
            fits_in_memory(dir, copy, grandis_telemetry::mem_available_bytes())?;
            (d.to_in_memory(), d.manifest().symmetric)
        }
        None => (
            grandis_synth::generate_in_memory(synth).context("generating the graph")?,
            true,
        ),
    })
}

/// Refuses a dataset whose in-memory copy (`copy` bytes: graph, features, labels) the
/// benchmarks cannot hold twice (they copy it, then partition the copy) in `available` bytes
/// (`MemAvailable`; nothing is checked when unknown): a clear error instead of an aborted
/// allocation.
fn fits_in_memory(dir: &std::path::Path, copy: u64, available: Option<u64>) -> anyhow::Result<()> {
    match available {
        Some(available) if copy.saturating_mul(2) > available => anyhow::bail!(
            "{}: the benchmarks copy the dataset into memory and partition the copy (about {} \
             bytes) and {available} bytes are available; use a smaller dataset (`grandis \
             train` and `grandis predict` read large ones from disk)",
            dir.display(),
            copy.saturating_mul(2)
        ),
        _ => Ok(()),
    }
}

/// The synthetic power-law graph (or a dataset directory), its partition over S x G ranks
/// (threads of this process) and the model (SAGE unless --model) that `bench modes`, `bench
/// plan` and `bench techniques` run, with the links they emulate.
#[derive(clap::Args)]
pub struct BenchGraphArgs {
    /// A dataset directory (`grandis data ...`, e.g. data/cora) to run on instead of the
    /// synthetic graph; --vertices, --avg-degree, --features and --classes are then unused.
    #[arg(long)]
    pub data: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 200_000)]
    pub vertices: u64,
    /// Target average directed degree of the power-law graph.
    #[arg(long, default_value_t = 20.0)]
    pub avg_degree: f64,
    /// Input features (equal to --hidden by default, as the paper's model assumes).
    #[arg(long, default_value_t = 64)]
    pub features: usize,
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    #[arg(long, default_value_t = 16)]
    pub classes: usize,
    #[arg(long, default_value_t = 3)]
    pub layers: usize,
    /// The model (as `grandis train --model`): sage, gcn, ressage or gat; on a typed --data
    /// dataset also rgcn, heterosage or rgat.
    #[arg(long, default_value_t = ModelKind::Sage)]
    pub model: ModelKind,
    /// gat, rgat: attention heads of each hidden layer (they split --hidden).
    #[arg(long, default_value_t = grandis_wire::defaults::HEADS)]
    pub heads: u32,
    /// Epochs per run (default 3; `bench techniques`: 20). Epoch times are medians, so the
    /// first epoch's warm-up barely moves them.
    #[arg(long)]
    pub epochs: Option<usize>,
    #[arg(long, default_value_t = 2)]
    pub servers: usize,
    #[arg(long, default_value_t = 2)]
    pub devices: usize,
    #[arg(long, default_value = "metis")]
    pub partition: String,
    /// Emulated intra-server bandwidth per device link, bytes/s.
    #[arg(long, default_value_t = 400e6)]
    pub intra_bandwidth: f64,
    /// Emulated inter-server latency per message, milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub inter_latency_ms: f64,
    /// Rayon threads per rank.
    #[arg(long, default_value_t = 1)]
    pub threads_per_rank: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl BenchGraphArgs {
    /// The emulated links: intra-server at `--intra-bandwidth`, inter-server at `1 /
    /// inter_ratio` of it with `--inter-latency-ms` per message.
    pub fn links(&self, inter_ratio: f64) -> (LinkModel, LinkModel) {
        let intra = LinkModel::new(self.intra_bandwidth, std::time::Duration::ZERO);
        let inter = LinkModel::new(
            self.intra_bandwidth / inter_ratio,
            std::time::Duration::from_secs_f64(self.inter_latency_ms / 1000.0),
        );
        (intra, inter)
    }
}

/// What [`BenchGraphArgs::build`] makes.
pub struct BenchGraph {
    pub dataset: InMemoryDataset,
    pub stats: GraphStats,
    pub part: PartitionedGraph,
    pub config: ModelConfig,
}

impl BenchGraphArgs {
    /// Generates the graph (named `name`) or reads `--data`, partitions it and configures the
    /// model, logging what each took.
    pub fn build(&self, name: &str) -> anyhow::Result<BenchGraph> {
        let t = std::time::Instant::now();
        let (dataset, symmetric) = dataset_or_synthetic(
            self.data.as_deref(),
            &SynthConfig {
                name: name.into(),
                nodes: self.vertices,
                avg_degree: self.avg_degree,
                features: self.features,
                classes: self.classes,
                seed: self.seed,
                ..SynthConfig::default()
            },
        )?;
        let view = dataset.view();
        let stats = grandis_synth::measure(&view);
        eprintln!(
            "graph: {} vertices, {} edges (avg degree {:.2}, max {}) in {:.1}s",
            stats.num_vertices,
            stats.num_edges,
            stats.avg_degree,
            stats.max_degree,
            t.elapsed().as_secs_f64()
        );
        let method: PartitionMethod = self.partition.parse()?;
        let t = std::time::Instant::now();
        let part = PartitionedGraph::partition(
            &view,
            symmetric,
            self.servers,
            self.devices,
            method,
            self.seed,
        )?;
        eprintln!(
            "partition: {} into {} x {} in {:.1}s",
            method,
            self.servers,
            self.devices,
            t.elapsed().as_secs_f64()
        );
        let config = ModelConfig::for_job(
            &grandis_wire::JobSpec {
                model: self.model,
                layers: u32::try_from(self.layers).context("--layers is out of range")?,
                hidden: u32::try_from(self.hidden).context("--hidden is out of range")?,
                heads: self.heads,
                seed: self.seed,
                ..grandis_wire::JobSpec::default()
            },
            &dataset.view(),
        );
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("--model {}: {e}", self.model.name()))?;
        Ok(BenchGraph {
            dataset,
            stats,
            part,
            config,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dataset the benchmarks could not hold is refused by name with both sizes, before
    /// anything is copied; unknown available memory checks nothing.
    #[test]
    fn a_dataset_too_big_for_memory_is_refused_before_the_copy() {
        let dir = std::path::Path::new("/data/g100m");
        let err = fits_in_memory(dir, 26_000_000_000, Some(24_000_000_000))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("/data/g100m: "), "{err}");
        assert!(
            err.contains("52000000000 bytes") && err.contains("24000000000"),
            "{err}"
        );
        fits_in_memory(dir, 1_000, Some(24_000_000_000)).unwrap();
        fits_in_memory(dir, u64::MAX, None).unwrap();
    }
}
