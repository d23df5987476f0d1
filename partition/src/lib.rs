//! Two-level graph partitioning for grandis, following the GraNNDIS cluster model: a dataset
//! is first split into `servers` parts that minimise the inter-server edge cut (the expensive,
//! network-crossing one), then each server's induced subgraph is split into `devices` parts.
//! Three methods: METIS (multi-constraint, balancing vertices and training vertices as in
//! DistDGL), SPRING (CATGNN's streaming, O(V)-memory partitioner) and seeded random (the
//! baseline). The result is a partition directory: the vertices are relabelled so that every
//! (server, device) owns a contiguous id range (server-major), the full dataset is rewritten in
//! the new ids under `dataset/`, and `partition.json` records the ranges, the quality report
//! ([`Quality`]) and the source's checksums. Read it back with [`PartitionBook::open`].

mod book;
mod methods;
mod quality;
mod subgraph;

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

use subgraph::{Scope, Subgraph};

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
    /// SPRING's balance factor β (CATGNN uses 1.05).
    pub balance_factor: f64,
}

impl Default for PartitionConfig {
    fn default() -> Self {
        PartitionConfig {
            servers: 1,
            devices: 1,
            method: PartitionMethod::Metis,
            seed: 0,
            balance_factor: 1.05,
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
    let run = |sub: &Subgraph<'_>, parts: u32, seed: u64| -> Result<Vec<u32>> {
        Ok(match cfg.method {
            PartitionMethod::Metis => methods::metis_parts(sub, parts, seed, &is_train)?,
            PartitionMethod::Spring => methods::spring_parts(sub, parts, cfg.balance_factor),
            PartitionMethod::Random => methods::random_parts(sub, parts, seed),
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
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); cfg.servers as usize];
    for (v, &s) in server.iter().enumerate() {
        members[s as usize].push(v as u32);
    }
    let mut local = vec![0u32; n];
    for m in &members {
        for (i, &v) in m.iter().enumerate() {
            local[v as usize] = i as u32;
        }
    }
    let mut device = vec![0u32; n];
    let mut progress = grandis_telemetry::Progress::new("device parts", Some(cfg.servers as u64));
    for (s, m) in members.iter().enumerate() {
        let sub = Subgraph {
            graph: view.graph,
            symmetric,
            scope: Some(Scope {
                members: m,
                local: &local,
                group: &server,
                id: s as u32,
            }),
        };
        // A different seed per server so random/METIS choices are not correlated across them.
        let seed = cfg.seed.wrapping_add(1 + s as u64);
        for (i, d) in run(&sub, cfg.devices, seed)?.into_iter().enumerate() {
            device[m[i] as usize] = d;
        }
        progress.inc(1);
    }
    progress.finish();
    Ok(Assignment { server, device })
}

/// The relabelling: new ids grouped by (server, device), original order kept inside a part
/// (so locality of the original numbering survives).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relabel {
    pub new_to_old: Vec<u32>,
    pub old_to_new: Vec<u32>,
    /// Device-part boundaries, server-major (servers * devices + 1 entries).
    pub starts: Vec<u64>,
}

pub fn relabel(a: &Assignment, servers: u32, devices: u32) -> Relabel {
    let n = a.server.len();
    let parts = servers as usize * devices as usize;
    let part = |v: usize| a.server[v] as usize * devices as usize + a.device[v] as usize;
    let mut starts = vec![0u64; parts + 1];
    for v in 0..n {
        starts[part(v) + 1] += 1;
    }
    for p in 0..parts {
        starts[p + 1] += starts[p];
    }
    let mut cursor = starts.clone();
    let mut new_to_old = vec![0u32; n];
    let mut old_to_new = vec![0u32; n];
    for v in 0..n {
        let slot = &mut cursor[part(v)];
        new_to_old[*slot as usize] = v as u32;
        old_to_new[v] = *slot as u32;
        *slot += 1;
    }
    Relabel {
        new_to_old,
        old_to_new,
        starts,
    }
}

/// The graph in new ids: row `new` is the old row of `new_to_old[new]`, mapped and re-sorted.
fn relabel_graph(graph: CsrView<'_>, r: &Relabel) -> grandis_store::CsrGraph {
    let n = graph.num_vertices();
    let mut offsets = Vec::with_capacity(n + 1);
    offsets.push(0u64);
    let mut total = 0u64;
    for &old in &r.new_to_old {
        total += graph.degree(old) as u64;
        offsets.push(total);
    }
    let mut indices = vec![0u32; total as usize];
    // Fill blocks of rows in parallel: split `indices` at row boundaries every ~1M edges.
    let mut blocks: Vec<(usize, usize, &mut [u32])> = Vec::new();
    let mut rest: &mut [u32] = &mut indices;
    let mut row = 0usize;
    while row < n {
        let mut end = row + 1;
        while end < n && offsets[end] - offsets[row] < (1 << 20) {
            end += 1;
        }
        let len = (offsets[end] - offsets[row]) as usize;
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
        blocks.push((row, end, head));
        rest = tail;
        row = end;
    }
    blocks.into_par_iter().for_each(|(first, end, out)| {
        let base = offsets[first];
        for new in first..end {
            let a = (offsets[new] - base) as usize;
            let b = (offsets[new + 1] - base) as usize;
            let dst = &mut out[a..b];
            for (d, &src) in dst.iter_mut().zip(graph.neighbors(r.new_to_old[new])) {
                *d = r.old_to_new[src as usize];
            }
            dst.sort_unstable();
        }
    });
    grandis_store::CsrGraph { offsets, indices }
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
    drop(assignment);

    let graph = relabel_graph(view.graph, &r);
    let map_sorted = |ids: &[u32]| -> Vec<u32> {
        let mut out: Vec<u32> = ids.iter().map(|&v| r.old_to_new[v as usize]).collect();
        out.par_sort_unstable();
        out
    };
    let split = grandis_store::Split {
        train: map_sorted(view.train),
        val: map_sorted(view.val),
        test: map_sorted(view.test),
    };
    let quality = quality::measure(
        graph.view(),
        m.symmetric,
        &r.starts,
        cfg.devices as usize,
        &split.train,
    );

    // The relabelled dataset.
    let mut writer = DatasetWriter::create(dir.path().join(DATASET_DIR), false)?;
    writer.write_graph_parts(&graph.offsets, &graph.indices)?;
    writer.set_symmetric(m.symmetric);
    drop(graph);
    let f = view.feature_dim;
    let mut features = writer.features_writer()?;
    if f > 0 && !view.features.is_empty() {
        let mut block = Vec::with_capacity((1 << 20).max(f));
        for &old in &r.new_to_old {
            block.extend_from_slice(view.feature_row(old));
            if block.len() >= 1 << 20 {
                features.push(&block)?;
                block.clear();
            }
        }
        features.push(&block)?;
    }
    writer.finish_features(features, f as u64)?;
    let labels: Vec<i32> = r
        .new_to_old
        .iter()
        .map(|&old| view.labels[old as usize])
        .collect();
    writer.write_labels(&labels)?;
    drop(labels);
    writer.write_split(&split)?;
    let mut provenance = m.provenance.clone();
    provenance.push(format!(
        "partition: relabelled by {} into {} servers x {} devices (seed {}) from {}",
        cfg.method,
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
    };
    let meta = BookMeta {
        format: book::BOOK_FORMAT.into(),
        version: book::BOOK_VERSION,
        method: cfg.method,
        servers: cfg.servers,
        devices: cfg.devices,
        seed: cfg.seed,
        balance_factor: cfg.balance_factor,
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
