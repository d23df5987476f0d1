//! Two-level graph partitioning for grandis, following the GraNNDIS cluster model: a dataset
//! is first split into `servers` parts that minimise the inter-server edge cut (the expensive,
//! network-crossing one), then each server's induced subgraph is split into `devices` parts.
//! Four methods: METIS (multi-constraint, balancing vertices and training vertices as in
//! DistDGL), SPRING (CATGNN's streaming, O(V)-memory partitioner), ByteGNN's block
//! partitioning (neighbourhood blocks for sampling locality) and seeded random (the baseline). The result is a partition directory: the vertices are relabelled so that every
//! (server, device) owns a contiguous id range (server-major), the full dataset is rewritten in
//! the new ids under `dataset/`, and `partition.json` records the ranges, the quality report
//! ([`Quality`]) and the source's checksums. Read it back with [`PartitionBook::open`].

mod book;
mod methods;
mod quality;
mod rewrite;
mod subgraph;

/// Sources per block of a pass over a graph that may not fit in memory (64 MiB of them): after
/// each block the pass releases the block's pages.
const PASS_BLOCK_EDGES: u64 = 16 << 20;

use std::path::{Path, PathBuf};
use std::time::Instant;

use grandis_store::{
    array::write_array, AtomicDir, CsrView, Dataset, DatasetInfo, DatasetView, DatasetWriter,
    StoreError,
};
use rayon::prelude::*;

pub use book::{
    BookMeta, PartitionBook, SourceInfo, BOOK_FILE, DATASET_DIR, NEW_TO_OLD_FILE, OLD_TO_NEW_FILE,
};
pub use quality::Quality;

use subgraph::Subgraph;

#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    #[error("invalid partition request: {0}")]
    Config(String),
    #[error("METIS: {0}")]
    Metis(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = PartitionError> = std::result::Result<T, E>;

/// How vertices are assigned to parts: the job spec's own enum (one definition, in
/// `grandis-wire`).
pub use grandis_wire::PartitionMethod;

/// What to partition into and how.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionConfig {
    pub servers: u32,
    /// Devices per server.
    pub devices: u32,
    pub method: PartitionMethod,
    pub seed: u64,
    /// SPRING's balance factor β (CATGNN uses 1.05); ByteGNN's vertex cap per part, as a
    /// multiple of the mean part.
    pub balance_factor: f64,
    /// ByteGNN's block radius K: hops of the breadth-first search around each labelled
    /// vertex (the model's layers: what one sample reads).
    pub block_hops: u32,
    /// Order the vertices inside each (server, device) part by METIS clusters of about this
    /// many vertices, each a contiguous id range, so that neighbours get nearby ids (the
    /// aggregation's gathers then hit cache); `None` keeps the original order inside a part.
    pub cluster_vertices: Option<u64>,
}

impl Default for PartitionConfig {
    fn default() -> Self {
        PartitionConfig {
            servers: 1,
            devices: 1,
            method: PartitionMethod::Metis,
            seed: 0,
            balance_factor: 1.05,
            block_hops: 2,
            cluster_vertices: None,
        }
    }
}

impl PartitionConfig {
    fn validate(&self, num_vertices: u64) -> Result<()> {
        let bad = |m: String| Err(PartitionError::Config(m));
        if self.servers == 0 {
            return bad("servers must be at least 1".into());
        }
        if self.devices == 0 {
            return bad("devices must be at least 1".into());
        }
        let parts = self.servers as u64 * self.devices as u64;
        if parts > num_vertices {
            return bad(format!(
                "{} servers x {} devices = {parts} parts, more than the {num_vertices} vertices of the graph",
                self.servers, self.devices
            ));
        }
        if self.method == PartitionMethod::Bytegnn && self.block_hops == 0 {
            return bad(
                "block hops must be at least 1 (ByteGNN's blocks are neighbourhoods)".into(),
            );
        }
        if self.cluster_vertices == Some(0) {
            return bad("cluster vertices must be at least 1".into());
        }
        if !self.balance_factor.is_finite() || self.balance_factor < 1.0 {
            return bad(format!(
                "balance factor must be at least 1, got {}",
                self.balance_factor
            ));
        }
        Ok(())
    }
}

/// Server and device (within the server) of every original vertex.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub server: Vec<u32>,
    pub device: Vec<u32>,
    /// With [`PartitionConfig::cluster_vertices`]: the locality cluster of every vertex
    /// within its part.
    pub cluster: Option<Vec<u32>>,
}

/// The index of (server, device) among all parts, server-major (as in [`Relabel::starts`]).
fn part_index(server: u32, device: u32, devices: u32) -> usize {
    server as usize * devices as usize + device as usize
}

impl Assignment {
    /// The part of vertex `v` ([`part_index`]).
    fn part(&self, v: usize, devices: u32) -> usize {
        part_index(self.server[v], self.device[v], devices)
    }

    /// How many locality clusters each of the `parts` parts is numbered into: its largest
    /// cluster id + 1 (0 for an empty part); 1 per part without clusters.
    fn clusters_per_part(&self, parts: usize, devices: u32) -> Vec<usize> {
        let Some(c) = &self.cluster else {
            return vec![1; parts];
        };
        let mut k = vec![0usize; parts];
        for (v, &id) in c.iter().enumerate() {
            let p = self.part(v, devices);
            k[p] = k[p].max(id as usize + 1);
        }
        k
    }
}

/// Runs the two-level partitioning of `view` (no I/O). `symmetric` says whether every edge
/// has its reverse (the manifest knows); it lets partitioners stream each pair once.
pub fn assign(
    view: &DatasetView<'_>,
    symmetric: bool,
    cfg: &PartitionConfig,
) -> Result<Assignment> {
    let n = view.num_vertices();
    cfg.validate(n as u64)?;
    let mut is_train = vec![false; n];
    for &v in view.train {
        is_train[v as usize] = true;
    }
    let role = match cfg.method {
        PartitionMethod::Bytegnn => roles(view),
        _ => Vec::new(),
    };
    let run = |sub: &Subgraph<'_>, parts: u32, seed: u64| -> Result<Vec<u32>> {
        Ok(match cfg.method {
            PartitionMethod::Metis => methods::metis_parts(sub, parts, seed, &is_train)?,
            PartitionMethod::Spring => methods::spring_parts(sub, parts, cfg.balance_factor),
            PartitionMethod::Random => methods::random_parts(sub, parts, seed),
            PartitionMethod::Bytegnn => {
                methods::bytegnn_parts(sub, parts, cfg.block_hops, &role, cfg.balance_factor)
            }
        })
    };
    let whole = Subgraph {
        graph: view.graph,
        symmetric,
        scope: None,
    };
    let started = Instant::now();
    let server = run(&whole, cfg.servers, cfg.seed)?;
    tracing::info!(
        "{}: {} server parts in {:.2}s",
        cfg.method,
        cfg.servers,
        started.elapsed().as_secs_f64()
    );

    // Second level: each server's induced subgraph, with its own local ids.
    let (members, local) = members_of(&server, cfg.servers as usize);
    let mut device = vec![0u32; n];
    let mut progress = grandis_telemetry::Progress::new("device parts", Some(cfg.servers as u64));
    for (s, m) in members.iter().enumerate() {
        let sub = Subgraph::induced(view.graph, symmetric, m, &local, &server, s as u32);
        // A different seed per server so random/METIS choices are not correlated across them.
        let seed = cfg.seed.wrapping_add(1 + s as u64);
        for (i, d) in run(&sub, cfg.devices, seed)?.into_iter().enumerate() {
            device[m[i] as usize] = d;
        }
        progress.inc(1);
    }
    progress.finish();
    let cluster = match cfg.cluster_vertices {
        Some(size) => Some(clusters(view, symmetric, cfg, &server, &device, size)?),
        None => None,
    };
    Ok(Assignment {
        server,
        device,
        cluster,
    })
}

/// Every vertex's split (a vertex in several splits counts as its first of train, validation,
/// test).
fn roles(view: &DatasetView<'_>) -> Vec<methods::Role> {
    let mut role = vec![methods::Role::Unlabelled; view.num_vertices()];
    for (ids, r) in [
        (view.test, methods::Role::Test),
        (view.val, methods::Role::Val),
        (view.train, methods::Role::Train),
    ] {
        for &v in ids {
            role[v as usize] = r;
        }
    }
    role
}

/// The vertices of each of `groups` groups (ascending) and every vertex's position in its
/// group (its local id in the group's induced subgraph).
fn members_of(group_of: &[u32], groups: usize) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); groups];
    for (v, &g) in group_of.iter().enumerate() {
        members[g as usize].push(v as u32);
    }
    let mut local = vec![0u32; group_of.len()];
    for m in &members {
        for (i, &v) in m.iter().enumerate() {
            local[v as usize] = i as u32;
        }
    }
    (members, local)
}

/// Third level, for locality only: METIS splits each (server, device) part's induced
/// subgraph into clusters of about `size` vertices. METIS whatever the partitioning method:
/// the parts are small enough for it, and streaming methods cut nearly every edge at this
/// granularity.
fn clusters(
    view: &DatasetView<'_>,
    symmetric: bool,
    cfg: &PartitionConfig,
    server: &[u32],
    device: &[u32],
    size: u64,
) -> Result<Vec<u32>> {
    let n = server.len();
    let part: Vec<u32> = (0..n)
        .map(|v| part_index(server[v], device[v], cfg.devices) as u32)
        .collect();
    let parts = cfg.servers as usize * cfg.devices as usize;
    fine_clusters(view.graph, symmetric, &part, parts, size, cfg.seed)
}

/// METIS clusters of about `size` vertices inside each of `groups` groups (`group_of[v]` for
/// every vertex): the induced subgraph of every group is split on its own, so no cluster
/// spans two groups. Returns every vertex's cluster, numbered from 0 within its group.
/// Vertices only are balanced. Locality ordering uses it per device part; GraphTheta-style
/// cluster batches per server.
pub fn fine_clusters(
    graph: CsrView<'_>,
    symmetric: bool,
    group_of: &[u32],
    groups: usize,
    size: u64,
    seed: u64,
) -> Result<Vec<u32>> {
    if size == 0 {
        return Err(PartitionError::Config(
            "clusters must hold at least 1 vertex".into(),
        ));
    }
    if group_of.len() != graph.num_vertices() {
        return Err(PartitionError::Config(format!(
            "{} group entries for {} vertices",
            group_of.len(),
            graph.num_vertices()
        )));
    }
    if let Some(&g) = group_of.iter().find(|&&g| g as usize >= groups) {
        return Err(PartitionError::Config(format!(
            "group {g} of {groups} groups"
        )));
    }
    let n = group_of.len();
    let (members, local) = members_of(group_of, groups);
    let no_train = vec![false; n];
    let mut cluster = vec![0u32; n];
    let mut progress = grandis_telemetry::Progress::new("clusters", Some(groups as u64));
    for (p, m) in members.iter().enumerate() {
        let count = (m.len() as u64).div_ceil(size).max(1);
        let count = u32::try_from(count).map_err(|_| {
            PartitionError::Config(format!(
                "{} vertices in clusters of {size} is more than 2^32 clusters",
                m.len()
            ))
        })?;
        let sub = Subgraph::induced(graph, symmetric, m, &local, group_of, p as u32);
        let seed = seed.wrapping_add(0x10_0000 + p as u64);
        for (i, c) in methods::metis_parts(&sub, count, seed, &no_train)?
            .into_iter()
            .enumerate()
        {
            cluster[m[i] as usize] = c;
        }
        progress.inc(1);
    }
    progress.finish();
    Ok(cluster)
}

/// The relabelling: new ids grouped by (server, device), then by locality cluster when the
/// assignment has them; the original order is kept inside a group (so locality of the
/// original numbering survives).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relabel {
    pub new_to_old: Vec<u32>,
    pub old_to_new: Vec<u32>,
    /// Device-part boundaries, server-major (servers * devices + 1 entries).
    pub starts: Vec<u64>,
    /// Finer boundaries: one range per (part, locality cluster), or `starts` without
    /// clusters. Inside one, new ids follow old ids in order, which is what lets the rewrite
    /// stream (`rewrite`).
    pub buckets: Vec<u64>,
}

impl Relabel {
    /// `ids` (old ids) under their new ids, ascending: a split's vertex list after relabelling.
    pub fn map_sorted(&self, ids: &[u32]) -> Vec<u32> {
        let mut out: Vec<u32> = ids.iter().map(|&v| self.old_to_new[v as usize]).collect();
        out.par_sort_unstable();
        out
    }
}

pub fn relabel(a: &Assignment, servers: u32, devices: u32) -> Relabel {
    let n = a.server.len();
    let parts = servers as usize * devices as usize;
    let part = |v: usize| a.part(v, devices);
    // Buckets: one per part, or one per (part, cluster) in part-major order; a counting sort
    // over them keeps the original order inside a bucket.
    let clusters_of_part = a.clusters_per_part(parts, devices);
    let mut first_bucket = vec![0usize; parts + 1];
    for p in 0..parts {
        // An empty part still has its (empty) bucket.
        first_bucket[p + 1] = first_bucket[p] + clusters_of_part[p].max(1);
    }
    let bucket = |v: usize| first_bucket[part(v)] + a.cluster.as_ref().map_or(0, |c| c[v] as usize);
    let mut bucket_starts = vec![0u64; first_bucket[parts] + 1];
    for v in 0..n {
        bucket_starts[bucket(v) + 1] += 1;
    }
    for b in 0..first_bucket[parts] {
        bucket_starts[b + 1] += bucket_starts[b];
    }
    let starts: Vec<u64> = first_bucket.iter().map(|&b| bucket_starts[b]).collect();
    let buckets = bucket_starts.clone();
    let mut cursor = bucket_starts;
    let mut new_to_old = vec![0u32; n];
    let mut old_to_new = vec![0u32; n];
    for v in 0..n {
        let slot = &mut cursor[bucket(v)];
        new_to_old[*slot as usize] = v as u32;
        old_to_new[v] = *slot as u32;
        *slot += 1;
    }
    Relabel {
        new_to_old,
        old_to_new,
        starts,
        buckets,
    }
}

/// Timing, memory and quality of one partitioning run (what `--json` prints).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PartitionReport {
    pub method: PartitionMethod,
    pub servers: u32,
    pub devices: u32,
    pub seed: u64,
    pub num_vertices: u64,
    pub num_edges: u64,
    #[serde(flatten)]
    pub quality: Quality,
    /// Wall time of the whole run: reading, partitioning, relabelling, writing.
    pub seconds: f64,
    /// Wall time of the assignment alone (the partitioning algorithm).
    pub assign_seconds: f64,
    /// Peak resident memory of the process when the run finished (mapped dataset pages that
    /// were read count too).
    pub peak_rss_bytes: u64,
    /// With locality clusters ([`PartitionConfig::cluster_vertices`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clusters: Option<ClusterReport>,
}

/// How local the cluster order is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClusterReport {
    /// Clusters over all parts.
    pub count: u64,
    /// Directed edges whose ends lie in one cluster (of one part).
    pub edges_inside: u64,
}

/// Counts the clusters of `a` (over `servers` x `devices` parts) and the edges inside them;
/// `None` without clusters.
fn cluster_report(
    graph: CsrView<'_>,
    a: &Assignment,
    servers: u32,
    devices: u32,
) -> Option<ClusterReport> {
    let cluster = a.cluster.as_ref()?;
    let same =
        |u: usize, v: usize| a.part(u, devices) == a.part(v, devices) && cluster[u] == cluster[v];
    let edges_inside = (0..graph.num_vertices())
        .into_par_iter()
        .map(|v| {
            let inside = graph
                .neighbors(v as u32)
                .iter()
                .filter(|&&u| same(u as usize, v));
            inside.count() as u64
        })
        .sum();
    let parts = servers as usize * devices as usize;
    Some(ClusterReport {
        count: a.clusters_per_part(parts, devices).iter().sum::<usize>() as u64,
        edges_inside,
    })
}

/// Partitions the dataset at `source` and writes the partition directory `out` (atomically;
/// an existing `out` is replaced only when `overwrite`). Returns the report also stored in
/// `out/partition.json`.
pub fn partition_dataset(
    source: impl AsRef<Path>,
    out: impl AsRef<Path>,
    cfg: &PartitionConfig,
    overwrite: bool,
) -> Result<PartitionReport> {
    let started = Instant::now();
    let source = source.as_ref();
    let ds = Dataset::open(source)?;
    let view = ds.view();
    let m = ds.manifest();
    cfg.validate(m.num_vertices)?;
    let dir = AtomicDir::create(out.as_ref(), overwrite)?;

    let assign_started = Instant::now();
    let assignment = assign(&view, m.symmetric, cfg)?;
    let assign_seconds = assign_started.elapsed().as_secs_f64();
    let r = relabel(&assignment, cfg.servers, cfg.devices);
    let clusters = cluster_report(view.graph, &assignment, cfg.servers, cfg.devices);
    drop(assignment);

    let split = grandis_store::Split {
        train: r.map_sorted(view.train),
        val: r.map_sorted(view.val),
        test: r.map_sorted(view.test),
    };

    // The relabelled dataset, streamed: memory stays O(V) whatever the graph's size.
    let mut writer = DatasetWriter::create(dir.path().join(DATASET_DIR), false)?;
    let offsets = rewrite::graph(&ds, &r, &mut writer)?;
    writer.set_symmetric(m.symmetric);
    let indices = writer.staged_indices()?;
    let quality = quality::measure(
        CsrView {
            offsets: &offsets,
            indices: indices.as_slice(),
        },
        m.symmetric,
        &r.starts,
        cfg.devices as usize,
        &split.train,
        &|edges| indices.release(edges),
    );
    drop((indices, offsets));
    rewrite::features(&ds, &r, &mut writer)?;
    let labels: Vec<i32> = r
        .new_to_old
        .iter()
        .map(|&old| view.labels[old as usize])
        .collect();
    writer.write_labels(&labels)?;
    drop(labels);
    writer.write_split(&split)?;
    let mut provenance = m.provenance.clone();
    let locality = match cfg.cluster_vertices {
        Some(size) => format!(", ordered by METIS clusters of ~{size} vertices"),
        None => String::new(),
    };
    let method = match cfg.method {
        PartitionMethod::Bytegnn => format!("bytegnn ({}-hop blocks)", cfg.block_hops),
        m => m.to_string(),
    };
    provenance.push(format!(
        "partition: relabelled by {method} into {} servers x {} devices (seed {}){locality} from {}",
        cfg.servers,
        cfg.devices,
        cfg.seed,
        source.display()
    ));
    writer.finish(DatasetInfo {
        name: m.name.clone(),
        num_classes: m.num_classes,
        provenance,
    })?;

    write_array(dir.path().join(NEW_TO_OLD_FILE), &r.new_to_old, 1)?;
    write_array(dir.path().join(OLD_TO_NEW_FILE), &r.old_to_new, 1)?;

    let report = PartitionReport {
        method: cfg.method,
        servers: cfg.servers,
        devices: cfg.devices,
        seed: cfg.seed,
        num_vertices: m.num_vertices,
        num_edges: m.num_edges,
        quality,
        seconds: started.elapsed().as_secs_f64(),
        assign_seconds,
        peak_rss_bytes: grandis_telemetry::peak_rss_bytes(),
        clusters,
    };
    let meta = BookMeta {
        format: book::BOOK_FORMAT.into(),
        version: book::BOOK_VERSION,
        method: cfg.method,
        servers: cfg.servers,
        devices: cfg.devices,
        seed: cfg.seed,
        balance_factor: cfg.balance_factor,
        block_hops: (cfg.method == PartitionMethod::Bytegnn).then_some(cfg.block_hops),
        num_vertices: m.num_vertices,
        ranges: r.starts.windows(2).map(|w| [w[0], w[1]]).collect(),
        report: report.clone(),
        source: SourceInfo {
            path: std::fs::canonicalize(source).unwrap_or_else(|_| source.to_path_buf()),
            name: m.name.clone(),
            files: m.files.clone(),
        },
    };
    let json = serde_json::to_vec_pretty(&meta).expect("partition book serializes");
    grandis_store::write_file_atomic(dir.path().join(BOOK_FILE), &json)?;
    dir.commit()?;
    Ok(report)
}

#[cfg(test)]
mod tests;
