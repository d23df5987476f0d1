//! Importers that turn datasets in other people's layouts into grandis dataset directories,
//! and the exporter back to the PyG layout ([`export_npy`]).
//!
//! Four input layouts are supported — a PyG-style directory of NumPy arrays ([`Format::Npy`]),
//! the raw OGB node-property-prediction layout of gzipped CSVs ([`Format::Ogb`]), a plain
//! CSV/TSV edge list with optional feature and label files ([`Format::EdgeList`]), and a Neo4j
//! GDS Parquet export such as the Cora tables shipped with `graphdatascience`
//! ([`Format::Parquet`]); two more read `graphdatascience`'s Last.fm and IMDB directories as
//! typed graphs ([`Format::LastFm`], [`Format::Imdb`]). Every importer streams its input (CSV
//! line by line, NumPy and Parquet without materialising more than one row group or one
//! mapping), funnels edges through the shared
//! [`EdgeListBuilder`](grandis_store::EdgeListBuilder) (a bounded buffer that spills
//! sorted runs into the staging directory, so edge lists larger than memory import; dedup,
//! symmetrize, self-loop policy) and writes through [`DatasetWriter`], whose staging directory
//! disappears on any error, so a failed import leaves nothing behind. Bad input is reported
//! with the file (and line or row) that holds it. Inputs without a split get a seeded one,
//! recorded in the dataset's provenance.

mod edgelist;
mod error;
mod export;
mod gds;
mod hetero;
mod imdb;
mod lastfm;
mod npy_dir;
mod ogb;
mod text;

use std::path::{Path, PathBuf};
use std::str::FromStr;

use grandis_store::{
    Dataset, DatasetInfo, DatasetWriter, EdgeError, EdgeListBuilder, EdgeOptions, SelfLoops,
    SortedEdges, Split, DEFAULT_RUN_BYTES,
};

pub use error::{ImportError, Result};
pub use export::{export_npy, ExportSummary};
pub use text::Delimiter;

/// Input layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Directory with `edge_index.npy`, `x.npy`, `y.npy` and optional `{train,val,test}_idx.npy`.
    Npy,
    /// OGB raw layout: `raw/*.csv.gz` and `split/<name>/{train,valid,test}.csv.gz`.
    Ogb,
    /// A CSV/TSV edge list file, with optional `--features` and `--labels` files.
    EdgeList,
    /// Neo4j GDS export: a directory holding `*nodes*.parquet*` and `*rels*.parquet*`.
    Parquet,
    /// The Last.fm recommendation graph of the `graphdatascience` package
    /// (`resources/lastfm`): users and artists, friendships and listens, a link split of
    /// the listens.
    LastFm,
    /// The IMDB movie graph of the `graphdatascience` package (`resources/imdb`): movies,
    /// directors and actors with plot-keyword features, movies labelled by genre.
    Imdb,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Npy => "npy",
            Format::Ogb => "ogb",
            Format::EdgeList => "edgelist",
            Format::Parquet => "parquet",
            Format::LastFm => "lastfm",
            Format::Imdb => "imdb",
        }
    }
}

impl FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "npy" => Ok(Format::Npy),
            "ogb" => Ok(Format::Ogb),
            "edgelist" => Ok(Format::EdgeList),
            "parquet" => Ok(Format::Parquet),
            "lastfm" => Ok(Format::LastFm),
            "imdb" => Ok(Format::Imdb),
            _ => Err(format!(
                "unknown format {s:?} (expected npy, ogb, edgelist, parquet, lastfm or imdb)"
            )),
        }
    }
}

/// How to split the labelled vertices when the input has no split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SplitPolicy {
    /// Planetoid style: `per_class` training vertices per class, then `val` and `test`.
    PerClass {
        per_class: usize,
        val: usize,
        test: usize,
    },
    /// Fractions of all labelled vertices for training and validation; the rest is test.
    Fraction { train: f64, val: f64 },
}

impl Default for SplitPolicy {
    /// The Cora/Citeseer/PubMed convention (Kipf & Welling): 20 per class / 500 / 1000.
    fn default() -> Self {
        SplitPolicy::PerClass {
            per_class: 20,
            val: 500,
            test: 1000,
        }
    }
}

impl std::fmt::Display for SplitPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SplitPolicy::PerClass {
                per_class,
                val,
                test,
            } => write!(f, "per-class:{per_class}:{val}:{test}"),
            SplitPolicy::Fraction { train, val } => write!(f, "fraction:{train}:{val}"),
        }
    }
}

impl FromStr for SplitPolicy {
    type Err = String;
    /// `per-class:TRAIN_PER_CLASS:VAL:TEST` or `fraction:TRAIN:VAL` (e.g. `fraction:0.6:0.2`).
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let bad = || {
            format!("bad split policy {s:?}: expected per-class:N:VAL:TEST or fraction:TRAIN:VAL")
        };
        match parts.as_slice() {
            ["per-class", a, b, c] => Ok(SplitPolicy::PerClass {
                per_class: a.parse().map_err(|_| bad())?,
                val: b.parse().map_err(|_| bad())?,
                test: c.parse().map_err(|_| bad())?,
            }),
            ["fraction", a, b] => {
                let train: f64 = a.parse().map_err(|_| bad())?;
                let val: f64 = b.parse().map_err(|_| bad())?;
                if !(0.0..=1.0).contains(&train) || !(0.0..=1.0).contains(&val) || train + val > 1.0
                {
                    return Err(format!(
                        "bad split policy {s:?}: fractions must be in 0..1 and sum to at most 1"
                    ));
                }
                Ok(SplitPolicy::Fraction { train, val })
            }
            _ => Err(bad()),
        }
    }
}

/// Options shared by all importers (some apply to one format only, as noted).
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// Add the reverse of every edge.
    pub symmetrize: bool,
    pub self_loops: SelfLoops,
    /// Dataset name; defaults to the output directory's name.
    pub name: Option<String>,
    /// Seed of the split made when the input has none.
    pub seed: u64,
    pub split_policy: SplitPolicy,
    /// Replace an existing output directory (otherwise it is an error).
    pub force: bool,
    /// OGB: which `split/<name>` directory to use when there are several.
    pub split_name: Option<String>,
    /// Edge list (and its feature file): field separator; `None` detects it from the first line.
    pub delimiter: Option<Delimiter>,
    /// Edge list: the first non-comment line is a header (otherwise detected: a first line that
    /// is not numeric is taken as a header).
    pub header: bool,
    /// Edge list: features file (one row of numbers per vertex).
    pub features: Option<PathBuf>,
    /// Edge list: labels file (one integer per line and vertex; negative = unlabelled).
    pub labels: Option<PathBuf>,
    /// Edge list: number of vertices, when the largest id does not say it (isolated tail).
    pub num_vertices: Option<u64>,
    /// Parquet: node property holding the class (default `subject`).
    pub label_column: Option<String>,
    /// Parquet: node property holding the feature list (default `features`).
    pub features_column: Option<String>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            symmetrize: false,
            self_loops: SelfLoops::Keep,
            name: None,
            seed: 0,
            split_policy: SplitPolicy::default(),
            force: false,
            split_name: None,
            delimiter: None,
            header: false,
            features: None,
            labels: None,
            num_vertices: None,
            label_column: None,
            features_column: None,
        }
    }
}

/// Imports `input` (a file or directory, depending on `format`) into the dataset directory
/// `out`. Nothing appears at `out` unless the whole import succeeds.
pub fn import(
    format: Format,
    input: &Path,
    out: &Path,
    options: &ImportOptions,
) -> Result<Dataset> {
    if !input.exists() {
        return Err(ImportError::Missing {
            path: input.to_path_buf(),
            what: format!("the input of --format {}", format.name()),
        });
    }
    // Last.fm's friendships and listens are undirected (its split holds out both directions),
    // and so are IMDB's directing and acting.
    let undirected;
    let options = if matches!(format, Format::LastFm | Format::Imdb) {
        undirected = ImportOptions {
            symmetrize: true,
            ..options.clone()
        };
        &undirected
    } else {
        options
    };
    // Created first so that an existing output fails before any parsing work.
    let writer = DatasetWriter::create(out, options.force)?;
    let name = options.name.clone().unwrap_or_else(|| {
        out.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "dataset".into())
    });
    tracing::info!(
        "importing {} ({}) into {}",
        input.display(),
        format.name(),
        out.display()
    );
    let mut ctx = Ctx {
        writer,
        options,
        provenance: vec![format!(
            "imported from {} input {}",
            format.name(),
            input
                .canonicalize()
                .unwrap_or_else(|_| input.to_path_buf())
                .display()
        )],
    };
    let parts = match format {
        Format::Npy => npy_dir::import(&mut ctx, input)?,
        Format::Ogb => ogb::import(&mut ctx, input)?,
        Format::EdgeList => edgelist::import(&mut ctx, input)?,
        Format::Parquet => gds::import(&mut ctx, input)?,
        Format::LastFm => lastfm::import(&mut ctx, input)?,
        Format::Imdb => imdb::import(&mut ctx, input)?,
    };
    ctx.finish(parts, name)
}

/// State shared by an importer and the common finishing steps.
pub(crate) struct Ctx<'o> {
    pub writer: DatasetWriter,
    pub options: &'o ImportOptions,
    pub provenance: Vec<String>,
}

/// What an importer hands to [`Ctx::finish`] after writing the features itself.
pub(crate) struct Parts {
    /// The file or directory the vertex count came from (for messages).
    pub input: PathBuf,
    pub edges: SortedEdges,
    /// Edges as read, before deduplication and symmetrization.
    pub input_edges: u64,
    /// One per vertex; -1 = unlabelled.
    pub labels: Vec<i32>,
    pub labels_path: Option<PathBuf>,
    /// The split the input came with, if any: `(file, ids)` for train, val, test.
    pub split: Option<[(PathBuf, Vec<u32>); 3]>,
    /// The link-prediction split the input came with, if any (its graph is then the
    /// message-passing one); checked when the dataset is written.
    pub link: Option<grandis_store::LinkSplit>,
    /// The vertex types and relations of a typed input (`crate::hetero`).
    pub types: Option<grandis_store::TypeSchema>,
}

impl Ctx<'_> {
    /// The edge builder every importer feeds: it spills sorted runs into the staging
    /// directory beyond [`DEFAULT_RUN_BYTES`], so edge lists larger than memory import.
    /// `expected` is the input's edge count when the format states it.
    pub fn edge_builder(&self, expected: Option<usize>) -> Result<EdgeListBuilder> {
        let options = EdgeOptions {
            symmetrize: self.options.symmetrize,
            self_loops: self.options.self_loops,
        };
        let builder = EdgeListBuilder::new(options)
            .spill_to(self.writer.scratch_dir(), DEFAULT_RUN_BYTES)
            .map_err(|e| edge_error(self.writer.target(), e))?;
        Ok(builder.expect_edges(expected.unwrap_or(0)))
    }

    fn finish(mut self, parts: Parts, name: String) -> Result<Dataset> {
        let n = parts.edges.num_vertices();
        if n == 0 {
            return Err(ImportError::invalid(
                &parts.input,
                "empty graph: the input has no vertices",
            ));
        }
        if parts.labels.len() as u64 != n {
            let path = parts.labels_path.as_deref().unwrap_or(&parts.input);
            return Err(ImportError::invalid(
                path,
                format!("has {} labels for {n} vertices", parts.labels.len()),
            ));
        }
        let num_classes = parts
            .labels
            .iter()
            .map(|&l| l as i64 + 1)
            .max()
            .unwrap_or(0) as u64;
        let labelled = parts.labels.iter().filter(|&&l| l >= 0).count();
        let split = match parts.split {
            Some(given) => {
                self.provenance
                    .push("split: taken from the input".to_string());
                check_split(n, &parts.labels, given)?
            }
            None => {
                let split = make_split(&parts.labels, num_classes as usize, self.options);
                self.provenance.push(format!(
                    "split: the input has none; made a seeded {} split (seed {}): {} train / {} val / {} test",
                    self.options.split_policy,
                    self.options.seed,
                    split.train.len(),
                    split.val.len(),
                    split.test.len()
                ));
                split
            }
        };
        let stored = self.writer.write_graph(&parts.edges)?;
        drop(parts.edges);
        let o = self.options;
        self.provenance.push(format!(
            "edges: {} read, {} stored (duplicates removed, symmetrize={}, self-loops={})",
            parts.input_edges,
            stored,
            o.symmetrize,
            match o.self_loops {
                SelfLoops::Add => "add",
                SelfLoops::Remove => "remove",
                SelfLoops::Keep => "keep",
            }
        ));
        self.provenance.push(format!(
            "labels: {labelled} of {n} vertices labelled, {num_classes} classes"
        ));
        if o.symmetrize {
            // Symmetrize adds every reverse and self-loops are their own reverse.
            self.writer.set_symmetric(true);
        }
        self.writer.write_labels(&parts.labels)?;
        self.writer.write_split(&split)?;
        if let Some(types) = parts.types {
            self.writer.set_types(types);
        }
        if let Some(link) = &parts.link {
            let s = link.view().sizes();
            self.provenance.push(format!(
                "link split: taken from the input ({} train, {} + {} validation, {} + {} test \
                 pairs)",
                s.train, s.valid_pos, s.valid_neg, s.test_pos, s.test_neg
            ));
            self.writer.write_link_split(link)?;
        }
        let dataset = self.writer.finish(DatasetInfo {
            name,
            num_classes,
            provenance: self.provenance,
        })?;
        Ok(dataset)
    }
}

fn make_split(labels: &[i32], num_classes: usize, options: &ImportOptions) -> Split {
    match options.split_policy {
        SplitPolicy::PerClass {
            per_class,
            val,
            test,
        } => grandis_store::split::per_class_split(
            labels,
            num_classes,
            per_class,
            val,
            test,
            options.seed,
        ),
        SplitPolicy::Fraction { train, val } => {
            grandis_store::split::fraction_split(labels, train, val, None, options.seed)
        }
    }
}

/// Checks a split that came with the input: ids in range, labelled, no repeats.
fn check_split(n: u64, labels: &[i32], given: [(PathBuf, Vec<u32>); 3]) -> Result<Split> {
    // Which split file claimed each vertex first, to name both files on overlap.
    let mut owner = vec![u8::MAX; n as usize];
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(3);
    for (which, (path, mut ids)) in given.iter().cloned().enumerate() {
        for &id in &ids {
            if id as u64 >= n {
                return Err(ImportError::invalid(
                    &path,
                    format!("vertex id {id} is out of range: the graph has {n} vertices"),
                ));
            }
            if labels[id as usize] < 0 {
                return Err(ImportError::invalid(
                    &path,
                    format!("vertex {id} is in the split but has no label"),
                ));
            }
            let prev = owner[id as usize];
            if prev as usize == which {
                return Err(ImportError::invalid(
                    &path,
                    format!("vertex {id} appears more than once"),
                ));
            }
            if prev != u8::MAX {
                return Err(ImportError::invalid(
                    &path,
                    format!(
                        "vertex {id} is also in {}; splits must not overlap",
                        given[prev as usize].0.display()
                    ),
                ));
            }
            owner[id as usize] = which as u8;
        }
        ids.sort_unstable();
        out.push(ids);
    }
    let test = out.pop().unwrap_or_default();
    let val = out.pop().unwrap_or_default();
    let train = out.pop().unwrap_or_default();
    Ok(Split { train, val, test })
}

/// Narrows a raw vertex id from the input, checking sign, the u32 limit and (when known) the
/// vertex count. `Err` is a message for the caller to wrap with its file and position.
pub(crate) fn vertex_id(raw: i64, n: Option<u64>, source_of_n: &str) -> Result<u32, String> {
    if raw < 0 {
        return Err(format!("negative vertex id {raw}"));
    }
    if let Some(n) = n {
        if raw as u64 >= n {
            return Err(format!(
                "vertex id {raw} is out of range: the graph has {n} vertices ({source_of_n})"
            ));
        }
    }
    EdgeListBuilder::check_id(raw).map_err(|e: EdgeError| e.to_string())
}

/// A raw label: negative means unlabelled; huge values are rejected (they would make the
/// class count absurd and overflow i32).
pub(crate) fn label_value(raw: i64) -> Result<i32, String> {
    if raw < 0 {
        Ok(-1)
    } else if raw >= (1 << 24) {
        Err(format!(
            "label {raw} is too large (classes must be numbered 0..C with C < 2^24)"
        ))
    } else {
        Ok(raw as i32)
    }
}

/// Converts an `EdgeError` from `EdgeListBuilder::finish` into a message about `path`.
pub(crate) fn edge_error(path: &Path, e: EdgeError) -> ImportError {
    ImportError::invalid(path, e.to_string())
}

/// Feature values must be finite (the store rejects NaN/inf); `v` is already narrowed to f32.
pub(crate) fn check_feature(v: f32, raw: f64) -> Result<f32, String> {
    if v.is_finite() {
        Ok(v)
    } else if raw.is_finite() {
        Err(format!("feature value {raw:e} does not fit in float32"))
    } else {
        Err(format!("feature value {raw} is not finite"))
    }
}
