//! The partitioned input of a parallel run: the graph relabelled so that every (server, device)
//! owns a contiguous id range ([`Layout`]), and the map back to the dataset's own ids. Features,
//! labels and splits are read from the ORIGINAL dataset through that map, and dropout masks are
//! keyed by original ids, which is what makes a partitioned run reproduce `--mode single` on
//! the unpartitioned dataset exactly.

use anyhow::{bail, Context};
use grandis_masking::Layout;
use grandis_partition::{PartitionBook, PartitionConfig, PartitionMethod};
use grandis_store::{CsrGraph, CsrView, Dataset, DatasetView};
use std::sync::Arc;

/// The relabelled graph: built in memory, or mapped from the dataset a partition directory
/// holds (the graph in new ids that `grandis partition` wrote), which costs page cache
/// instead of a second copy of the edges in memory.
pub enum PartGraph {
    Built(CsrGraph),
    Mapped(Arc<Dataset>),
}

impl PartGraph {
    pub fn view(&self) -> CsrView<'_> {
        match self {
            PartGraph::Built(g) => g.view(),
            PartGraph::Mapped(d) => d.graph(),
        }
    }

    /// Lets go of the mapped adjacency of `rows` (nothing for a built graph).
    pub fn release_rows(&self, rows: std::ops::Range<usize>) {
        if let PartGraph::Mapped(d) = self {
            d.release_rows(rows);
        }
    }

    /// Keeps a mapped graph's pages resident for as long as it is mapped (see
    /// [`Dataset::lock_graph_resident`]); a built graph is resident anyway.
    pub fn lock_resident(&self) -> std::io::Result<()> {
        match self {
            PartGraph::Built(_) => Ok(()),
            PartGraph::Mapped(d) => d.lock_graph_resident(),
        }
    }
}

impl std::fmt::Debug for PartGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.view();
        let kind = match self {
            PartGraph::Built(_) => "built",
            PartGraph::Mapped(_) => "mapped",
        };
        write!(
            f,
            "PartGraph({kind}, {} vertices, {} edges)",
            g.num_vertices(),
            g.num_edges()
        )
    }
}

/// A relabelled graph with its layout and id map.
#[derive(Debug)]
pub struct PartitionedGraph {
    /// The graph in new ids (row v = sorted new ids of the sources of edges into v).
    pub graph: PartGraph,
    /// `new_to_old[new]` = the dataset's id of new vertex `new` (a permutation).
    pub new_to_old: Vec<u32>,
    pub layout: Layout,
    /// How it was made, for logs and JSON ("metis", "identity", "partition dir ...").
    pub source: String,
    /// Every edge u→v has v→u (the dataset's manifest says so): the graph is its own
    /// transpose, and plan building needs no transposed copy.
    pub symmetric: bool,
}

impl PartitionedGraph {
    /// Relabels `graph` with the permutation `new_to_old` (checked) under `layout`.
    pub fn relabel(
        graph: CsrView<'_>,
        new_to_old: Vec<u32>,
        layout: Layout,
        source: impl Into<String>,
    ) -> anyhow::Result<Self> {
        let n = graph.num_vertices();
        if new_to_old.len() != n {
            bail!(
                "the id map has {} entries for a graph of {n} vertices",
                new_to_old.len()
            );
        }
        if layout.num_vertices() as usize != n {
            bail!(
                "the layout covers {} vertices, the graph has {n}",
                layout.num_vertices()
            );
        }
        let mut old_to_new = vec![u32::MAX; n];
        for (new, &old) in new_to_old.iter().enumerate() {
            let slot = old_to_new
                .get_mut(old as usize)
                .with_context(|| format!("id map entry {new} is {old}, out of range (n = {n})"))?;
            if *slot != u32::MAX {
                bail!("id map is not a permutation: original id {old} appears twice");
            }
            *slot = new as u32;
        }
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0u64);
        let mut indices = Vec::with_capacity(graph.num_edges());
        for &old in &new_to_old {
            let start = indices.len();
            indices.extend(graph.neighbors(old).iter().map(|&u| old_to_new[u as usize]));
            indices[start..].sort_unstable();
            offsets.push(indices.len() as u64);
        }
        Ok(PartitionedGraph {
            graph: PartGraph::Built(CsrGraph { offsets, indices }),
            new_to_old,
            layout,
            source: source.into(),
            symmetric: false,
        })
    }

    /// No relabelling: `layout` is applied to the dataset's own ids (tests, pre-relabelled data).
    pub fn identity(graph: CsrView<'_>, layout: Layout) -> anyhow::Result<Self> {
        let n = graph.num_vertices();
        Self::relabel(graph, (0..n as u32).collect(), layout, "identity")
    }

    /// Partitions on the fly with the two-level partitioner (nothing written to disk).
    pub fn partition(
        view: &DatasetView<'_>,
        symmetric: bool,
        servers: usize,
        devices: usize,
        method: PartitionMethod,
        seed: u64,
    ) -> anyhow::Result<Self> {
        let cfg = PartitionConfig {
            servers: servers as u32,
            devices: devices as u32,
            method,
            seed,
            ..Default::default()
        };
        Self::partition_with(view, symmetric, &cfg)
    }

    /// [`Self::partition`] with every setting of the partitioner.
    pub fn partition_with(
        view: &DatasetView<'_>,
        symmetric: bool,
        cfg: &PartitionConfig,
    ) -> anyhow::Result<Self> {
        let method = cfg.method;
        let (servers, devices) = (cfg.servers as usize, cfg.devices as usize);
        let a = grandis_partition::assign(view, symmetric, cfg)
            .with_context(|| format!("partitioning with {method}"))?;
        let r = grandis_partition::relabel(&a, cfg.servers, cfg.devices);
        let bounds: Vec<u32> = r.starts.iter().map(|&s| s as u32).collect();
        let layout = Layout::from_bounds(servers, devices, &bounds)?;
        let mut part = Self::relabel(view.graph, r.new_to_old, layout, method.name())?;
        part.symmetric = symmetric;
        Ok(part)
    }

    /// The partition a job trains on: read from the job's `partition_dir` (written by
    /// `grandis partition`, checked against the dataset and the job's servers × devices), or
    /// computed now with the job's method and seed. Deterministic, so every server of a cluster job
    /// arrives at the same partition.
    pub fn for_job(dataset: &Dataset, spec: &grandis_wire::JobSpec) -> anyhow::Result<Self> {
        let (servers, devices) = (spec.servers as usize, spec.devices as usize);
        if servers == 0 || devices == 0 {
            bail!("servers ({servers}) and devices ({devices}) must both be at least 1");
        }
        let n = dataset.manifest().num_vertices;
        let ranks = (servers * devices) as u64;
        if ranks > n {
            bail!(
                "{servers} servers x {devices} devices = {ranks} ranks is more than the {n} \
                 vertices of {}",
                dataset.dir().display()
            );
        }
        if let Some(dir) = spec.partition_dir.as_deref().map(std::path::Path::new) {
            let book = PartitionBook::open(dir)
                .with_context(|| format!("opening partition dir {}", dir.display()))?;
            if book.num_servers() as usize != servers || book.num_devices() as usize != devices {
                bail!(
                    "partition dir {} is for {} servers x {} devices, the run asks for \
                     --servers {servers} --devices {devices}",
                    dir.display(),
                    book.num_servers(),
                    book.num_devices(),
                );
            }
            return PartitionedGraph::from_book(&book, dataset);
        }
        PartitionedGraph::partition_with(
            &dataset.view(),
            dataset.manifest().symmetric,
            &PartitionConfig {
                servers: servers as u32,
                devices: devices as u32,
                method: spec.partition,
                seed: spec.partition_seed,
                // ByteGNN's blocks: what one sample of this model reads.
                block_hops: spec.layers.max(1),
                ..Default::default()
            },
        )
    }

    /// The layout and id map of a partition directory written by `grandis partition` for
    /// `dataset` (checked: same vertex count and the same source file checksums).
    pub fn from_book(book: &PartitionBook, dataset: &Dataset) -> anyhow::Result<Self> {
        let dir = book.dir().display().to_string();
        let m = dataset.manifest();
        if book.num_vertices() != m.num_vertices {
            bail!(
                "partition dir {dir} has {} vertices, dataset {} has {}",
                book.num_vertices(),
                dataset.dir().display(),
                m.num_vertices
            );
        }
        let src = &book.meta().source.files;
        for (name, summary) in &m.files {
            match src.get(name) {
                Some(s) if s == summary => {}
                Some(_) => bail!(
                    "partition dir {dir} was made from a different dataset: file {name} of {} \
                     has another checksum than the one recorded in {dir}/partition.json",
                    dataset.dir().display()
                ),
                None => bail!(
                    "partition dir {dir} does not record file {name} of dataset {}; was it \
                     made from this dataset?",
                    dataset.dir().display()
                ),
            }
        }
        let bounds: Vec<u32> = book
            .meta()
            .ranges
            .iter()
            .map(|r| r[0] as u32)
            .chain(std::iter::once(m.num_vertices as u32))
            .collect();
        let layout = Layout::from_bounds(
            book.num_servers() as usize,
            book.num_devices() as usize,
            &bounds,
        )
        .with_context(|| format!("partition dir {dir}: ranges"))?;
        // The directory holds the graph already relabelled: map it (verified: checksums and
        // every id) rather than relabel the dataset's graph into memory again.
        let relabelled = Dataset::open_verified(book.dir().join(grandis_partition::DATASET_DIR))
            .with_context(|| format!("partition dir {dir}: the relabelled dataset"))?;
        let (g, edges) = (relabelled.graph(), dataset.graph().num_edges());
        if g.num_vertices() as u64 != m.num_vertices || g.num_edges() != edges {
            bail!(
                "partition dir {dir}: its relabelled graph has {} vertices and {} edges, dataset \
                 {} has {} and {}",
                g.num_vertices(),
                g.num_edges(),
                dataset.dir().display(),
                m.num_vertices,
                edges
            );
        }
        Ok(PartitionedGraph {
            graph: PartGraph::Mapped(Arc::new(relabelled)),
            new_to_old: book.new_to_old().to_vec(),
            layout,
            source: format!("partition dir {dir} ({})", book.meta().method),
            symmetric: m.symmetric,
        })
    }
}
