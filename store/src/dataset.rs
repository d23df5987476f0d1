//! A dataset directory: `dataset.json` (the manifest) plus one array file per component.
//!
//! | file            | dtype | shape        | meaning                                   |
//! |-----------------|-------|--------------|-------------------------------------------|
//! | `graph.offsets` | u64   | (V + 1) × 1  | CSR row offsets (rows = destinations)     |
//! | `graph.indices` | u32   | E × 1        | CSR sources, sorted within each row       |
//! | `features.f32`  | f32   | V × F        | vertex features, row-major                |
//! | `labels.i32`    | i32   | V × 1        | class in `0..C`, or -1 for "no label"     |
//! | `train.idx`, `val.idx`, `test.idx` | u32 | n × 1 | sorted vertex ids of each split     |
//! | `link_*.pairs`  | u32   | n × 2        | optional link split ([`crate::link`])      |
//!
//! Limits: up to 2^32 − 1 vertices (u32 ids), up to 2^64 edges (u64 offsets).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::array::{ArraySummary, ArrayWriter, Element, MappedArray, RangeWriter};
use crate::atomic::AtomicDir;
use crate::csr::{CsrView, MAX_VERTICES};
use crate::edges::SortedEdges;
use crate::error::{Result, StoreError};
use crate::link::{LinkPart, LinkSizes, LinkSplit, LinkSplitView};
use crate::split::Split;
use crate::types::{TypeSchema, Types};

pub const MANIFEST: &str = "dataset.json";
pub const FORMAT_NAME: &str = "grandis-dataset";
pub const FORMAT_VERSION: u32 = 1;

const OFFSETS: &str = "graph.offsets";
const INDICES: &str = "graph.indices";
const FEATURES: &str = "features.f32";
const LABELS: &str = "labels.i32";
const TRAIN: &str = "train.idx";
const VAL: &str = "val.idx";
const TEST: &str = "test.idx";
const ALL_FILES: [&str; 7] = [OFFSETS, INDICES, FEATURES, LABELS, TRAIN, VAL, TEST];

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SplitSizes {
    pub train: u64,
    pub val: u64,
    pub test: u64,
}

/// Contents of `dataset.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub name: String,
    pub num_vertices: u64,
    pub num_edges: u64,
    pub feature_dim: u64,
    pub num_classes: u64,
    /// Every edge has its reverse.
    pub symmetric: bool,
    pub split: SplitSizes,
    /// Free-form lines on where the data came from and what was done to it
    /// (e.g. "split: seeded 20-per-class/500/1000, seed 0").
    #[serde(default)]
    pub provenance: Vec<String>,
    pub files: BTreeMap<String, ArraySummary>,
    /// Pair counts of the link split, when the dataset has one (`grandis data split-edges`);
    /// its graph is then the message-passing graph (no held-out edge in it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<LinkSizes>,
    /// `[first, end)`: the vertex ids the link split's relation points at (Last.fm's
    /// artists), where training negatives draw their corrupted destination; absent: every
    /// vertex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_destinations: Option<[u32; 2]>,
    /// Vertex types and relations of a typed graph ([`crate::types`]); absent: one type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub types: Option<TypeSchema>,
}

/// Describes a dataset being written; counts are derived from what was written.
#[derive(Debug, Clone, Default)]
pub struct DatasetInfo {
    pub name: String,
    pub num_classes: u64,
    pub provenance: Vec<String>,
}

/// Borrowed access to a dataset, whether memory-mapped or in memory.
#[derive(Debug, Clone, Copy)]
pub struct DatasetView<'a> {
    pub graph: CsrView<'a>,
    pub features: &'a [f32],
    pub feature_dim: usize,
    pub labels: &'a [i32],
    pub num_classes: usize,
    pub train: &'a [u32],
    pub val: &'a [u32],
    pub test: &'a [u32],
    /// Positioned reads of the file behind `features`, when there is one (see
    /// [`DatasetView::gather_features`]).
    pub feature_reader: Option<&'a crate::RowReader>,
    /// The link-prediction split, when the dataset has one.
    pub links: Option<LinkSplitView<'a>>,
    /// Vertex types and relations, for a typed graph.
    pub types: Option<&'a Types>,
}

impl<'a> DatasetView<'a> {
    pub fn num_vertices(&self) -> usize {
        self.graph.num_vertices()
    }
    pub fn feature_row(&self, v: u32) -> &'a [f32] {
        let f = self.feature_dim;
        &self.features[v as usize * f..(v as usize + 1) * f]
    }
    /// Copies the feature rows of `ids` (any order, repeats allowed) into `out` (`ids.len()
    /// x feature_dim`). A dataset on disk is read by positioned reads in id order, not
    /// through its mapping: the pages stay in the page cache, out of this process's resident
    /// set. Reading a step's scattered rows through the mapping would make resident every
    /// page they are on and, by the kernel's fault-around, up to 64 KiB around each: a
    /// scaled-down run held all 410 MB of its features to read 55 MB of rows per step.
    pub fn gather_features(&self, ids: &[u32], out: &mut [f32]) -> Result<()> {
        let f = self.feature_dim;
        assert_eq!(out.len(), ids.len() * f, "feature gather output size");
        let Some(reader) = self.feature_reader else {
            // Rows in memory: a memory-bound copy, split over the pool's threads in runs long
            // enough that handing one out costs nothing next to it.
            out.par_chunks_exact_mut(f.max(1))
                .zip(ids.par_iter())
                .with_min_len(4096)
                .for_each(|(row, &v)| row.copy_from_slice(self.feature_row(v)));
            return Ok(());
        };
        if ids.is_sorted() {
            return reader.gather(ids, out);
        }
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_unstable_by_key(|&i| ids[i as usize]);
        let sorted: Vec<u32> = order.iter().map(|&i| ids[i as usize]).collect();
        // Read in id order through a bounded buffer, then put each row in its place: a copy of
        // the whole output (228 MB for a products-like mini-batch) would be resident beside it.
        const CHUNK_ROWS: usize = 16384;
        let mut rows = vec![0f32; CHUNK_ROWS.min(ids.len()) * f];
        for (order, sorted) in order.chunks(CHUNK_ROWS).zip(sorted.chunks(CHUNK_ROWS)) {
            let rows = &mut rows[..sorted.len() * f];
            reader.gather(sorted, rows)?;
            for (&i, row) in order.iter().zip(rows.chunks_exact(f.max(1))) {
                out[i as usize * f..(i as usize + 1) * f].copy_from_slice(row);
            }
        }
        Ok(())
    }

    /// (cached, sampled) pages of the feature gathers so far ([`crate::RowReader::cached_pages`]);
    /// None for features in memory.
    pub fn feature_pages_cached(&self) -> Option<(u64, u64)> {
        self.feature_reader.and_then(|r| r.cached_pages())
    }

    /// Starts reading the pages of feature rows `ids` (ascending) into the page cache without
    /// waiting ([`crate::RowReader::prefetch`]); nothing for features in memory.
    pub fn prefetch_features(&self, ids: &[u32]) {
        if let Some(reader) = self.feature_reader {
            reader.prefetch(ids);
        }
    }
}

/// A dataset held in memory: what generators and tests build, and what `write` stores.
#[derive(Debug, Clone, PartialEq)]
pub struct InMemoryDataset {
    pub name: String,
    pub graph: crate::csr::CsrGraph,
    pub features: Vec<f32>,
    pub feature_dim: usize,
    pub labels: Vec<i32>,
    pub num_classes: usize,
    pub split: Split,
    /// Vertex types and relations, for a typed graph.
    pub types: Option<Types>,
}

impl InMemoryDataset {
    pub fn view(&self) -> DatasetView<'_> {
        DatasetView {
            graph: self.graph.view(),
            features: &self.features,
            feature_dim: self.feature_dim,
            labels: &self.labels,
            num_classes: self.num_classes,
            train: &self.split.train,
            val: &self.split.val,
            test: &self.split.test,
            feature_reader: None,
            links: None,
            types: self.types.as_ref(),
        }
    }

    /// Writes the dataset atomically to `dir` (which must not exist unless `overwrite`).
    pub fn write(&self, dir: impl AsRef<Path>, overwrite: bool) -> Result<Dataset> {
        let mut w = DatasetWriter::create(dir, overwrite)?;
        w.write_graph_parts(&self.graph.offsets, &self.graph.indices)?;
        w.write_features(&self.features, self.feature_dim as u64)?;
        w.write_labels(&self.labels)?;
        w.write_split(&self.split)?;
        if let Some(types) = &self.types {
            w.set_types(types.schema.clone());
        }
        w.finish(DatasetInfo {
            name: self.name.clone(),
            num_classes: self.num_classes as u64,
            provenance: vec![],
        })
    }
}

/// Builds a dataset directory in a staging location; nothing is visible until `finish`.
pub struct DatasetWriter {
    dir: AtomicDir,
    files: BTreeMap<String, ArraySummary>,
    symmetric: Option<bool>,
    link: Option<LinkSizes>,
    link_destinations: Option<[u32; 2]>,
    types: Option<TypeSchema>,
}

impl DatasetWriter {
    pub fn create(dir: impl AsRef<Path>, overwrite: bool) -> Result<Self> {
        Ok(DatasetWriter {
            dir: AtomicDir::create(dir, overwrite)?,
            files: BTreeMap::new(),
            symmetric: None,
            link: None,
            link_destinations: None,
            types: None,
        })
    }

    /// Makes the dataset typed ([`crate::types`]); `finish` checks the schema against what
    /// was written and counts each relation's edges.
    pub fn set_types(&mut self, schema: TypeSchema) {
        self.types = Some(schema);
    }

    /// The final location of the dataset (for messages).
    pub fn target(&self) -> &Path {
        self.dir.target()
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn record(&mut self, name: &str, summary: ArraySummary) {
        self.files.insert(name.to_string(), summary);
    }

    /// Where a builder feeding this writer may put scratch files
    /// ([`EdgeListBuilder::spill_to`](crate::EdgeListBuilder::spill_to)): the staging
    /// directory, on the output's file system and removed with it if the write fails.
    pub fn scratch_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Streams the graph to disk; returns the number of stored edges.
    pub fn write_graph(&mut self, edges: &SortedEdges) -> Result<u64> {
        let mut w = ArrayWriter::<u32>::create(self.file(INDICES))?;
        let offsets = edges.stream_csr(|chunk| w.push(chunk))?;
        let summary = w.finish(1)?;
        self.record(INDICES, summary);
        let summary = crate::array::write_array(self.file(OFFSETS), &offsets, 1)?;
        self.record(OFFSETS, summary);
        Ok(offsets.last().copied().unwrap_or(0))
    }

    pub fn write_graph_parts(&mut self, offsets: &[u64], indices: &[u32]) -> Result<()> {
        self.write_offsets(offsets)?;
        let summary = crate::array::write_array(self.file(INDICES), indices, 1)?;
        self.record(INDICES, summary);
        Ok(())
    }

    /// The row offsets alone; the sources follow through [`Self::indices_by_range`].
    pub fn write_offsets(&mut self, offsets: &[u64]) -> Result<()> {
        let summary = crate::array::write_array(self.file(OFFSETS), offsets, 1)?;
        self.record(OFFSETS, summary);
        Ok(())
    }

    /// A writer for the sources whose positions arrive in several sequential streams
    /// ([`RangeWriter`]); hand it back to [`Self::finish_indices`].
    pub fn indices_by_range(&self, starts: &[u64]) -> Result<RangeWriter<u32>> {
        RangeWriter::create(self.file(INDICES), starts)
    }

    pub fn finish_indices(&mut self, writer: RangeWriter<u32>) -> Result<()> {
        let summary = writer.finish(1)?;
        self.record(INDICES, summary);
        Ok(())
    }

    /// The sources written so far, mapped (to measure the staged graph).
    pub fn staged_indices(&self) -> Result<MappedArray<u32>> {
        MappedArray::open(self.file(INDICES))
    }

    /// Features by range of positions, like [`Self::indices_by_range`]; `starts` count
    /// elements (rows times the dimension).
    pub fn features_by_range(&self, starts: &[u64]) -> Result<RangeWriter<f32>> {
        RangeWriter::create(self.file(FEATURES), starts)
    }

    pub fn finish_features_by_range(&mut self, writer: RangeWriter<f32>, dim: u64) -> Result<()> {
        let summary = writer.finish(dim)?;
        self.record(FEATURES, summary);
        Ok(())
    }

    /// Records whether the graph is symmetric when the writer knows it (saves a pass).
    pub fn set_symmetric(&mut self, symmetric: bool) {
        self.symmetric = Some(symmetric);
    }

    pub fn write_features(&mut self, features: &[f32], dim: u64) -> Result<()> {
        let summary = crate::array::write_array(self.file(FEATURES), features, dim)?;
        self.record(FEATURES, summary);
        Ok(())
    }

    /// A streaming writer for features too large to hold; hand it back to `finish_features`.
    pub fn features_writer(&self) -> Result<ArrayWriter<f32>> {
        ArrayWriter::create(self.file(FEATURES))
    }

    pub fn finish_features(&mut self, writer: ArrayWriter<f32>, dim: u64) -> Result<()> {
        let summary = writer.finish(dim)?;
        self.record(FEATURES, summary);
        Ok(())
    }

    pub fn write_labels(&mut self, labels: &[i32]) -> Result<()> {
        let summary = crate::array::write_array(self.file(LABELS), labels, 1)?;
        self.record(LABELS, summary);
        Ok(())
    }

    pub fn write_split(&mut self, split: &Split) -> Result<()> {
        for (name, ids) in [
            (TRAIN, &split.train),
            (VAL, &split.val),
            (TEST, &split.test),
        ] {
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            let summary = crate::array::write_array(self.file(name), &sorted, 1)?;
            self.record(name, summary);
        }
        Ok(())
    }

    /// Writes a link split (its graph must be the message-passing one: see [`crate::link`]).
    pub fn write_link_split(&mut self, split: &LinkSplit) -> Result<()> {
        let view = split.view();
        for part in LinkPart::ALL {
            let summary = crate::array::write_array(self.file(part.file()), view.part(part), 2)?;
            self.record(part.file(), summary);
        }
        self.link = Some(view.sizes());
        self.link_destinations = split.destinations.map(|d| [d.0, d.1]);
        Ok(())
    }

    /// Writes the manifest, fully verifies the staged dataset, and moves it into place.
    pub fn finish(mut self, info: DatasetInfo) -> Result<Dataset> {
        for name in ALL_FILES {
            if !self.files.contains_key(name) {
                return Err(StoreError::invalid(
                    self.dir.target(),
                    format!("internal error: {name} was never written"),
                ));
            }
        }
        let rows = |name: &str| self.files[name].rows;
        let num_vertices = rows(OFFSETS).saturating_sub(1);
        let feature_dim = self.files[FEATURES].cols;
        // An empty feature matrix still has one column in its header; report it as 0-dim.
        let feature_dim = if rows(FEATURES) == 0 && num_vertices > 0 {
            0
        } else {
            feature_dim
        };
        let mut manifest = Manifest {
            format: FORMAT_NAME.to_string(),
            version: FORMAT_VERSION,
            name: info.name,
            num_vertices,
            num_edges: rows(INDICES),
            feature_dim,
            num_classes: info.num_classes,
            symmetric: false,
            split: SplitSizes {
                train: rows(TRAIN),
                val: rows(VAL),
                test: rows(TEST),
            },
            provenance: info.provenance,
            files: std::mem::take(&mut self.files),
            link: self.link.take(),
            link_destinations: self.link_destinations.take(),
            types: self.types.take(),
        };
        // A typed dataset's edge counts are the writer's to fill in: open (which checks the
        // schema) and count the graph as written.
        let counts = match manifest.types {
            Some(_) => {
                let staged = Dataset::open_manifest(self.dir.path(), manifest.clone())?;
                let types = staged.types().expect("the manifest has types");
                Some(
                    types
                        .count_edges(staged.graph())
                        .map_err(|m| StoreError::invalid(staged.dir.join(INDICES), m))?,
                )
            }
            None => None,
        };
        if let (Some(schema), Some(counts)) = (&mut manifest.types, counts) {
            for (r, n) in schema.relations.iter_mut().zip(counts) {
                r.num_edges = n;
            }
        }
        let staged = Dataset::open_manifest(self.dir.path(), manifest.clone())?;
        // Verified first: the symmetry test below indexes by the stored ids.
        staged.verify()?;
        manifest.symmetric = match self.symmetric {
            Some(s) => s,
            None => staged.graph().is_symmetric(),
        };
        if manifest.symmetric {
            // `verify` checked a link split's pairs as directed (the manifest did not know the
            // symmetry yet); an undirected graph's split is checked with each pair unordered.
            if let Some(links) = staged.link_split() {
                links.check(num_vertices, true).map_err(|(part, msg)| {
                    StoreError::invalid(self.dir.path().join(part.file()), msg)
                })?;
            }
        }
        drop(staged);
        let json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
        crate::atomic::write_file_atomic(self.dir.path().join(MANIFEST), &json)?;
        let target = self.dir.commit()?;
        Dataset::open(target)
    }
}

/// A memory-mapped dataset directory. `open` checks headers and counts (cheap, independent
/// of size); `verify` (or `open_verified`) checks checksums and every id.
pub struct Dataset {
    dir: PathBuf,
    manifest: Manifest,
    offsets: MappedArray<u64>,
    indices: MappedArray<u32>,
    features: MappedArray<f32>,
    labels: MappedArray<i32>,
    train: MappedArray<u32>,
    val: MappedArray<u32>,
    test: MappedArray<u32>,
    /// Scattered positioned reads of the features, for [`DatasetView::gather_features`].
    feature_reader: Option<crate::RowReader>,
    /// The link split's arrays in [`LinkPart::ALL`] order, when the manifest has one.
    link: Option<Vec<MappedArray<u32>>>,
    /// The manifest's types, checked and indexed.
    types: Option<Types>,
}

impl Dataset {
    pub fn open(dir: impl AsRef<Path>) -> Result<Dataset> {
        let dir = dir.as_ref();
        let manifest_path = dir.join(MANIFEST);
        let bytes = std::fs::read(&manifest_path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound && !dir.exists() {
                StoreError::invalid(dir, "no such dataset directory")
            } else {
                StoreError::io(&manifest_path, e)
            }
        })?;
        let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
            StoreError::invalid(&manifest_path, format!("not a valid manifest: {e}"))
        })?;
        if manifest.format != FORMAT_NAME {
            return Err(StoreError::invalid(
                &manifest_path,
                format!("format is {:?}, expected {FORMAT_NAME:?}", manifest.format),
            ));
        }
        if manifest.version != FORMAT_VERSION {
            return Err(StoreError::BadVersion {
                path: manifest_path,
                found: manifest.version,
                supported: FORMAT_VERSION,
            });
        }
        Self::open_manifest(dir, manifest)
    }

    /// Opens and fully verifies.
    pub fn open_verified(dir: impl AsRef<Path>) -> Result<Dataset> {
        let ds = Self::open(dir)?;
        ds.verify()?;
        Ok(ds)
    }

    fn open_manifest(dir: &Path, manifest: Manifest) -> Result<Dataset> {
        fn load<T: Element>(dir: &Path, m: &Manifest, name: &str) -> Result<MappedArray<T>> {
            let array = MappedArray::<T>::open(dir.join(name))?;
            match m.files.get(name) {
                Some(expected) if *expected == array.summary() => Ok(array),
                Some(expected) => Err(StoreError::invalid(
                    array.path(),
                    format!(
                        "header ({} x {}, checksum {:016x}) disagrees with {MANIFEST} ({} x {}, checksum {:016x})",
                        array.summary().rows, array.summary().cols, array.summary().checksum,
                        expected.rows, expected.cols, expected.checksum
                    ),
                )),
                None => Err(StoreError::invalid(
                    dir.join(MANIFEST),
                    format!("does not list {name}"),
                )),
            }
        }
        let mut ds = Dataset {
            dir: dir.to_path_buf(),
            offsets: load(dir, &manifest, OFFSETS)?,
            indices: load(dir, &manifest, INDICES)?,
            features: load(dir, &manifest, FEATURES)?,
            labels: load(dir, &manifest, LABELS)?,
            train: load(dir, &manifest, TRAIN)?,
            val: load(dir, &manifest, VAL)?,
            test: load(dir, &manifest, TEST)?,
            link: match manifest.link {
                Some(_) => Some(
                    LinkPart::ALL
                        .iter()
                        .map(|p| load(dir, &manifest, p.file()))
                        .collect::<Result<_>>()?,
                ),
                None => None,
            },
            types: match &manifest.types {
                Some(schema) => Some(
                    Types::new(schema.clone(), manifest.num_vertices, manifest.feature_dim)
                        .map_err(|m| StoreError::invalid(dir.join(MANIFEST), m))?,
                ),
                None => None,
            },
            manifest,
            feature_reader: None,
        };
        ds.check_counts()?;
        ds.feature_reader = Some(ds.feature_rows()?.scattered());
        Ok(ds)
    }

    fn check_counts(&self) -> Result<()> {
        let m = &self.manifest;
        let bad = |file: &MappedArray<_>, what: String| Err(StoreError::invalid(file.path(), what));
        let v = m.num_vertices;
        if v > MAX_VERTICES {
            return Err(StoreError::invalid(
                self.dir.join(MANIFEST),
                format!("{v} vertices exceed the u32 id limit"),
            ));
        }
        if self.offsets.summary().rows != v + 1 {
            return bad(
                &self.offsets,
                format!(
                    "has {} rows, expected {}",
                    self.offsets.summary().rows,
                    v + 1
                ),
            );
        }
        if self.indices.summary().rows != m.num_edges {
            return Err(StoreError::invalid(
                self.indices.path(),
                format!(
                    "has {} edges, manifest says {}",
                    self.indices.summary().rows,
                    m.num_edges
                ),
            ));
        }
        let feature_rows = self.features.summary().rows;
        if !(feature_rows == v || (m.feature_dim == 0 && feature_rows == 0)) {
            return Err(StoreError::invalid(
                self.features.path(),
                format!("has {feature_rows} rows for {v} vertices"),
            ));
        }
        let feature_cols = self.features.summary().cols;
        if feature_rows > 0 && feature_cols != m.feature_dim {
            return Err(StoreError::invalid(
                self.dir.join(MANIFEST),
                format!(
                    "feature_dim is {}, but {FEATURES} has {feature_cols} columns",
                    m.feature_dim
                ),
            ));
        }
        for (file, count, name) in [
            (&self.train, m.split.train, "train"),
            (&self.val, m.split.val, "val"),
            (&self.test, m.split.test, "test"),
        ] {
            if file.summary().rows != count {
                return Err(StoreError::invalid(
                    self.dir.join(MANIFEST),
                    format!(
                        "split.{name} is {count}, but {} has {} rows",
                        file.path().display(),
                        file.summary().rows
                    ),
                ));
            }
        }
        if let (Some(sizes), Some(arrays)) = (&m.link, &self.link) {
            for (part, array) in LinkPart::ALL.iter().zip(arrays) {
                let summary = array.summary();
                if summary.rows != sizes.of(*part) || (summary.rows > 0 && summary.cols != 2) {
                    return Err(StoreError::invalid(
                        array.path(),
                        format!(
                            "has {} x {} values, expected {} pairs (x 2) as {MANIFEST} says",
                            summary.rows,
                            summary.cols,
                            sizes.of(*part)
                        ),
                    ));
                }
            }
        }
        if self.labels.summary().rows != v {
            return Err(StoreError::invalid(
                self.labels.path(),
                format!("has {} labels for {v} vertices", self.labels.summary().rows),
            ));
        }
        let offsets = self.offsets.as_slice();
        if offsets[0] != 0 || offsets[v as usize] != m.num_edges {
            return Err(StoreError::invalid(
                self.offsets.path(),
                format!(
                    "offsets must run from 0 to {} (the edge count), found {}..{}",
                    m.num_edges, offsets[0], offsets[v as usize]
                ),
            ));
        }
        Ok(())
    }

    /// Checksums every file and checks every id and label (parallel; seconds for billions).
    /// Every array file of the dataset.
    pub(crate) fn array_paths(&self) -> Vec<PathBuf> {
        [
            self.offsets.path(),
            self.indices.path(),
            self.features.path(),
            self.labels.path(),
            self.train.path(),
            self.val.path(),
            self.test.path(),
        ]
        .into_iter()
        .chain(self.link.iter().flatten().map(MappedArray::path))
        .map(Path::to_path_buf)
        .collect()
    }

    pub fn verify(&self) -> Result<()> {
        self.verify_checksums()?;
        self.check_structure()?;
        self.check_finite_features()
    }

    /// Every array file's payload against the checksum in its header (in parallel).
    pub(crate) fn verify_checksums(&self) -> Result<()> {
        let checks: Vec<Box<dyn Fn() -> Result<()> + Sync + '_>> = vec![
            Box::new(|| self.offsets.verify_checksum()),
            Box::new(|| self.indices.verify_checksum()),
            Box::new(|| self.features.verify_checksum()),
            Box::new(|| self.labels.verify_checksum()),
            Box::new(|| self.train.verify_checksum()),
            Box::new(|| self.val.verify_checksum()),
            Box::new(|| self.test.verify_checksum()),
        ];
        checks.par_iter().try_for_each(|c| c())?;
        self.link
            .iter()
            .flatten()
            .try_for_each(MappedArray::verify_checksum)
    }

    /// That every feature is finite, naming the first that is not.
    pub(crate) fn check_finite_features(&self) -> Result<()> {
        let f = self.manifest.feature_dim.max(1) as usize;
        self.features.scan_chunks(|start, chunk| {
            match chunk.par_iter().position_any(|x| !x.is_finite()) {
                Some(i) => Err(StoreError::invalid(
                    self.features.path(),
                    format!(
                        "non-finite feature at vertex {}, column {}",
                        (start + i) / f,
                        (start + i) % f
                    ),
                )),
                None => Ok(()),
            }
        })
    }

    fn offsets_decrease(&self, vertex: usize) -> StoreError {
        StoreError::invalid(
            self.offsets.path(),
            format!("offsets decrease at vertex {vertex}"),
        )
    }

    /// Checks what every reader relies on without reading the features: offsets that never
    /// decrease, vertex ids in range, labels in `-1..classes`, splits sorted, in range and
    /// disjoint. A file with the right size but corrupt contents fails here with the file and
    /// the first bad value named, instead of panicking whoever indexes with it. O(V + E),
    /// parallel; the daemons run it on every dataset they open (each server maps the whole
    /// graph but reads only its own feature rows).
    pub fn check_structure(&self) -> Result<()> {
        let v = self.manifest.num_vertices;
        // In chunks, releasing each one's pages: a graph larger than memory is checked with
        // bounded resident memory.
        let mut last: Option<u64> = None;
        self.offsets.scan_chunks(|start, chunk| {
            let mut prev = last.unwrap_or(0);
            if let Some(i) = chunk.first().filter(|&&o| o < prev).map(|_| start - 1) {
                return Err(self.offsets_decrease(i));
            }
            if let Some(i) = chunk.par_windows(2).position_any(|w| w[1] < w[0]) {
                return Err(self.offsets_decrease(start + i));
            }
            prev = *chunk.last().unwrap_or(&prev);
            last = Some(prev);
            Ok(())
        })?;
        self.indices.scan_chunks(|_, chunk| {
            match chunk.par_iter().find_any(|&&s| s as u64 >= v) {
                Some(&bad) => Err(StoreError::invalid(
                    self.indices.path(),
                    format!("vertex id {bad} is out of range (the graph has {v} vertices)"),
                )),
                None => Ok(()),
            }
        })?;
        let c = self.manifest.num_classes as i32;
        self.labels.scan_chunks(|_, chunk| {
            match chunk.par_iter().find_any(|&&l| l < -1 || l >= c) {
                Some(&bad) => Err(StoreError::invalid(
                    self.labels.path(),
                    format!("label {bad} is outside 0..{c} (or -1 for unlabelled)"),
                )),
                None => Ok(()),
            }
        })?;
        let mut seen = vec![false; v as usize];
        for split in [&self.train, &self.val, &self.test] {
            let ids = split.as_slice();
            if ids.windows(2).any(|w| w[1] <= w[0]) {
                return Err(StoreError::invalid(
                    split.path(),
                    "ids are not sorted and unique",
                ));
            }
            for &id in ids {
                if id as u64 >= v {
                    return Err(StoreError::invalid(
                        split.path(),
                        format!("vertex id {id} is out of range (the graph has {v} vertices)"),
                    ));
                }
                if std::mem::replace(&mut seen[id as usize], true) {
                    return Err(StoreError::invalid(
                        split.path(),
                        format!("vertex {id} appears in more than one split"),
                    ));
                }
            }
        }
        if let Some(links) = self.link_split() {
            links
                .check(v, self.manifest.symmetric)
                .and_then(|()| links.check_held_out(&self.graph()))
                .map_err(|(part, msg)| StoreError::invalid(self.dir.join(part.file()), msg))?;
        }
        if let Some(types) = &self.types {
            self.check_types(types)?;
        }
        Ok(())
    }

    /// A typed dataset's rules beyond its schema: every edge joins types some relation
    /// joins, each relation has the edges the manifest counts, labels and splits lie in the
    /// target type, and each type's feature columns past its width are zero.
    fn check_types(&self, types: &Types) -> Result<()> {
        let counts = types
            .count_edges(self.graph())
            .map_err(|m| StoreError::invalid(self.indices.path(), m))?;
        for (r, n) in types.schema.relations.iter().zip(counts) {
            if r.num_edges != n {
                return Err(StoreError::invalid(
                    self.dir.join(MANIFEST),
                    format!(
                        "relation {:?} has {n} edges in {INDICES}, the manifest says {}",
                        r.key(),
                        r.num_edges
                    ),
                ));
            }
        }
        let target = types.range(types.target());
        for split in [&self.train, &self.val, &self.test] {
            if let Some(&v) = split.as_slice().iter().find(|v| !target.contains(v)) {
                return Err(StoreError::invalid(
                    split.path(),
                    format!(
                        "vertex {v} is a {:?}, not of the target type {:?}",
                        types.schema.vertex_types[types.type_of(v)].name,
                        types.schema.target
                    ),
                ));
            }
        }
        let labels = self.labels.as_slice();
        if let Some(v) =
            (0..labels.len()).find(|&v| labels[v] >= 0 && !target.contains(&(v as u32)))
        {
            return Err(StoreError::invalid(
                self.labels.path(),
                format!(
                    "vertex {v} is a {:?} and has a label; only the target type {:?} has labels",
                    types.schema.vertex_types[types.type_of(v as u32)].name,
                    types.schema.target
                ),
            ));
        }
        let f = self.manifest.feature_dim as usize;
        let features = self.features.as_slice();
        for (t, vt) in types.schema.vertex_types.iter().enumerate() {
            let width = vt.feature_dim as usize;
            if width == f {
                continue;
            }
            let rows = types.range(t);
            let bad = rows.clone().into_par_iter().find_first(|&v| {
                features[v as usize * f + width..(v as usize + 1) * f]
                    .iter()
                    .any(|&x| x != 0.0)
            });
            if let Some(v) = bad {
                return Err(StoreError::invalid(
                    self.features.path(),
                    format!(
                        "vertex {v} is a {:?}, whose {width} feature columns the manifest lists, \
                         and has a non-zero value past them",
                        vt.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The vertex types and relations, for a typed dataset.
    pub fn types(&self) -> Option<&Types> {
        self.types.as_ref()
    }

    /// The link split, when the dataset has one.
    pub fn link_split(&self) -> Option<LinkSplitView<'_>> {
        let a = self.link.as_ref()?;
        Some(LinkSplitView {
            train: a[0].as_slice(),
            valid_pos: a[1].as_slice(),
            valid_neg: a[2].as_slice(),
            test_pos: a[3].as_slice(),
            test_neg: a[4].as_slice(),
            destinations: self.manifest.link_destinations.map(|[a, b]| (a, b)),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    pub fn graph(&self) -> CsrView<'_> {
        CsrView {
            offsets: self.offsets.as_slice(),
            indices: self.indices.as_slice(),
        }
    }
    pub fn features(&self) -> &[f32] {
        self.features.as_slice()
    }
    /// Drops the pages of `rows`' sources and feature rows from the resident set (see
    /// [`MappedArray::release`]): what a sequential pass over a graph larger than memory
    /// calls behind its cursor.
    pub fn release_rows(&self, rows: std::ops::Range<usize>) {
        let offsets = self.offsets.as_slice();
        if rows.end >= offsets.len() || rows.start > rows.end {
            return;
        }
        self.indices
            .release(offsets[rows.start] as usize..offsets[rows.end] as usize);
        let f = self.manifest.feature_dim as usize;
        self.features.release(rows.start * f..rows.end * f);
        self.offsets.release(rows);
    }
    /// Keeps the graph's pages resident ([`MappedArray::lock_resident`]).
    pub fn lock_graph_resident(&self) -> std::io::Result<()> {
        self.offsets.lock_resident()?;
        self.indices.lock_resident()
    }
    /// Positioned reads of feature rows (see [`crate::RowReader`]): gathers that leave the
    /// resident set alone, for passes over features larger than memory.
    pub fn feature_rows(&self) -> Result<crate::RowReader> {
        crate::RowReader::open(
            &self.dir.join(FEATURES),
            crate::array::HEADER_BYTES as u64,
            self.manifest.num_vertices,
            self.manifest.feature_dim as usize,
        )
    }
    pub fn labels(&self) -> &[i32] {
        self.labels.as_slice()
    }
    pub fn view(&self) -> DatasetView<'_> {
        DatasetView {
            graph: self.graph(),
            features: self.features(),
            feature_dim: self.manifest.feature_dim as usize,
            labels: self.labels(),
            num_classes: self.manifest.num_classes as usize,
            train: self.train.as_slice(),
            val: self.val.as_slice(),
            test: self.test.as_slice(),
            feature_reader: self.feature_reader.as_ref(),
            links: self.link_split(),
            types: self.types.as_ref(),
        }
    }
    /// Copies everything into memory (for small datasets and tests).
    pub fn to_in_memory(&self) -> InMemoryDataset {
        let v = self.view();
        InMemoryDataset {
            name: self.manifest.name.clone(),
            graph: v.graph.to_owned(),
            features: v.features.to_vec(),
            feature_dim: v.feature_dim,
            labels: v.labels.to_vec(),
            num_classes: v.num_classes,
            split: Split {
                train: v.train.to_vec(),
                val: v.val.to_vec(),
                test: v.test.to_vec(),
            },
            types: self.types.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csr::CsrGraph;
    use crate::edges::EdgeOptions;

    fn tiny() -> InMemoryDataset {
        let graph = crate::graph_from_edges(
            4,
            [(0, 1), (1, 2), (2, 3)],
            EdgeOptions {
                symmetrize: true,
                ..Default::default()
            },
        )
        .unwrap();
        InMemoryDataset {
            name: "tiny".into(),
            graph,
            features: (0..8).map(|i| i as f32).collect(),
            feature_dim: 2,
            labels: vec![0, 1, -1, 1],
            num_classes: 2,
            split: Split {
                train: vec![0, 1],
                val: vec![3],
                test: vec![],
            },
            types: None,
        }
    }

    /// `tiny` with two types: `a` = 0..3 (the target), `b` = {3} with one feature column.
    fn tiny_typed() -> InMemoryDataset {
        let mut ds = tiny();
        ds.features[7] = 0.0;
        ds.labels = vec![0, 1, 1, -1];
        ds.split.val = vec![2];
        let (vt, rel) = (crate::VertexType::new, crate::Relation::new);
        let schema = TypeSchema {
            vertex_types: vec![vt("a", 3, 2), vt("b", 1, 1)],
            relations: vec![
                rel("a", "links", "a"),
                rel("a", "to", "b"),
                rel("b", "to", "a"),
            ],
            target: "a".into(),
        };
        ds.types = Some(Types::new(schema, 4, 2).unwrap());
        ds
    }

    #[test]
    fn typed_datasets_count_relations_and_refuse_what_breaks_their_types() {
        let root = tempfile::tempdir().unwrap();
        let ds = tiny_typed().write(root.path().join("d"), false).unwrap();
        let counts: Vec<u64> = ds
            .manifest()
            .types
            .as_ref()
            .unwrap()
            .relations
            .iter()
            .map(|r| r.num_edges)
            .collect();
        assert_eq!(counts, vec![4, 1, 1]);
        let back = Dataset::open_verified(root.path().join("d")).unwrap();
        assert_eq!(back.types().unwrap().range(1), 3..4);
        assert_eq!(back.view().types.unwrap().relation(1, 0), Some(2));

        let fails = |ds: InMemoryDataset, needle: &str| {
            let dir = tempfile::tempdir().unwrap();
            let err = match ds.write(dir.path().join("d"), false) {
                Ok(_) => panic!("{needle}: written"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(needle), "{err}");
            assert!(!dir.path().join("d").exists(), "nothing half-written");
        };
        let mut ds = tiny_typed();
        ds.features[7] = 1.0;
        fails(ds, "vertex 3 is a \"b\", whose 1 feature columns");
        let mut ds = tiny_typed();
        ds.labels[3] = 0;
        fails(ds, "only the target type \"a\" has labels");
        let mut ds = tiny_typed();
        ds.split.test = vec![3];
        fails(ds, "vertex 3 is a \"b\", not of the target type");
        let mut ds = tiny_typed();
        let mut schema = ds.types.take().unwrap().schema;
        schema.relations.remove(2);
        ds.types = Some(Types::new(schema, 4, 2).unwrap());
        fails(ds, "edge 3 -> 2 joins a \"b\" to a \"a\"");
    }

    #[test]
    fn write_open_round_trip() {
        let root = tempfile::tempdir().unwrap();
        let ds = tiny().write(root.path().join("d"), false).unwrap();
        assert!(ds.manifest().symmetric);
        assert_eq!(ds.manifest().num_edges, 6);
        let back = Dataset::open_verified(root.path().join("d")).unwrap();
        assert_eq!(back.to_in_memory(), tiny());
    }

    /// A dataset on disk gathers feature rows by positioned reads, one in memory by copies:
    /// the same rows for any order and repeats, and an id past the end is an error.
    #[test]
    fn feature_gathers_read_the_named_rows() {
        let root = tempfile::tempdir().unwrap();
        let mem = tiny();
        let disk = mem.write(root.path().join("d"), false).unwrap();
        assert!(disk.view().feature_reader.is_some() && mem.view().feature_reader.is_none());
        for ids in [vec![], vec![3, 0, 0, 2], vec![0, 1, 2, 3], vec![1]] {
            let expect: Vec<f32> = ids
                .iter()
                .flat_map(|&v| mem.view().feature_row(v).to_vec())
                .collect();
            for view in [mem.view(), disk.view()] {
                view.prefetch_features(&ids);
                let mut out = vec![f32::NAN; expect.len()];
                view.gather_features(&ids, &mut out).unwrap();
                assert_eq!(out, expect, "{ids:?}");
            }
        }
        assert!(disk.view().gather_features(&[4], &mut [0.0; 2]).is_err());
    }

    #[test]
    fn corrupt_files_are_named() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("d");
        tiny().write(&dir, false).unwrap();
        // Flip a byte of the indices payload: open succeeds, verify names the file.
        let path = dir.join(INDICES);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let err = Dataset::open_verified(&dir).err().unwrap().to_string();
        assert!(
            err.contains("graph.indices") && err.contains("checksum"),
            "{err}"
        );
        // Truncate it: open already fails.
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let err = Dataset::open(&dir).err().unwrap().to_string();
        assert!(
            err.contains("graph.indices") && err.contains("truncated"),
            "{err}"
        );
    }

    #[test]
    fn bad_manifest_is_reported() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("d");
        tiny().write(&dir, false).unwrap();
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("\"version\": 1", "\"version\": 9")).unwrap();
        let err = Dataset::open(&dir).err().unwrap().to_string();
        assert!(err.contains("version 9"), "{err}");
        std::fs::write(&path, "{").unwrap();
        let err = Dataset::open(&dir).err().unwrap().to_string();
        assert!(err.contains("dataset.json"), "{err}");
        let err = Dataset::open(root.path().join("missing"))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no such dataset directory"), "{err}");
        // Counts that disagree with the files they describe.
        for (from, to, want) in [
            (
                "\"feature_dim\": 2",
                "\"feature_dim\": 3",
                "feature_dim is 3, but",
            ),
            ("\"val\": 1", "\"val\": 2", "split.val is 2, but"),
        ] {
            std::fs::write(&path, text.replace(from, to)).unwrap();
            let err = Dataset::open(&dir).err().unwrap().to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn invalid_contents_never_reach_disk() {
        let root = tempfile::tempdir().unwrap();
        let mut bad = tiny();
        bad.graph.indices[0] = 9;
        let err = bad
            .write(root.path().join("d"), false)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("out of range"), "{err}");
        let mut bad = tiny();
        bad.labels[0] = 5;
        assert!(bad.write(root.path().join("d"), false).is_err());
        let mut bad = tiny();
        bad.split.val = vec![0];
        let err = bad
            .write(root.path().join("d"), false)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("more than one split"), "{err}");
        let mut bad = tiny();
        bad.features[3] = f32::NAN;
        assert!(bad.write(root.path().join("d"), false).is_err());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }

    #[test]
    fn empty_graph_round_trips() {
        let root = tempfile::tempdir().unwrap();
        let empty = InMemoryDataset {
            name: "empty".into(),
            graph: CsrGraph {
                offsets: vec![0],
                indices: vec![],
            },
            features: vec![],
            feature_dim: 3,
            labels: vec![],
            num_classes: 0,
            split: Split::default(),
            types: None,
        };
        let ds = empty.write(root.path().join("e"), false).unwrap();
        assert_eq!(ds.manifest().num_vertices, 0);
    }
}
