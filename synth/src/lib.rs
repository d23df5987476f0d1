//! Synthetic graphs for grandis: undirected power-law graphs (Chung-Lu with power-law weights)
//! with planted classes, tunable homophily and weakly informative features, written straight to
//! the grandis dataset format. Everything is a pure function of the [`SynthConfig`] (seeded
//! ChaCha streams per chunk, so rayon parallelism does not change the output), and the
//! generator streams: edges go through the store's [`EdgeListBuilder`], which spills sorted
//! runs to the output's file system past a bounded buffer, and features are produced and
//! written a block of rows at a time, so a 100M-vertex / 1B-edge graph needs about 6 GiB. Features are built so that neighbour aggregation helps:
//! each vertex's row is a scaled-down class centroid plus unit Gaussian noise, so a model that
//! only sees its own row does clearly worse than one that averages over (mostly same-class)
//! neighbours. [`grid_graph`] and [`grid_dataset`] build tiny 2-D grids for other crates' tests.

mod hetero;

pub use hetero::{generate_hetero_in_memory, HeteroConfig, RelationSpec, TypeSpec};

use std::path::Path;

use grandis_store::{
    split::fraction_split, CsrGraph, Dataset, DatasetInfo, DatasetView, DatasetWriter, EdgeError,
    EdgeListBuilder, EdgeOptions, InMemoryDataset, SelfLoops, SortedEdges, Split, StoreError,
    DEFAULT_RUN_BYTES, MAX_VERTICES,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// Everything that decides a synthetic dataset. Same config, same bytes.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SynthConfig {
    /// Dataset name recorded in the manifest.
    pub name: String,
    /// Number of vertices.
    pub nodes: u64,
    /// Target average *directed* degree after symmetrization and deduplication (the stored
    /// edge count is about `nodes * avg_degree`; duplicates among hubs make it a bit lower).
    pub avg_degree: f64,
    /// Feature dimension.
    pub features: usize,
    /// Number of planted classes; every vertex gets one, uniformly at random.
    pub classes: usize,
    /// Fraction of generated edges whose endpoints share a class.
    pub homophily: f64,
    pub seed: u64,
    /// Power-law exponent γ of the expected-degree distribution, P(d) ∝ d^-γ (must be > 2).
    pub exponent: f64,
    /// Distance between class centroids in units of the per-coordinate noise: a vertex row is
    /// `signal / sqrt(F) * centroid + noise` with centroid and noise standard normal, so two
    /// centroids sit about `signal * sqrt(2)` noise units apart whatever the dimension.
    pub signal: f64,
    /// Fractions of vertices in the train, validation and test splits; test defaults to
    /// the rest (a smaller one leaves vertices in no split, as papers100M does).
    pub train_fraction: f64,
    pub val_fraction: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_fraction: Option<f64>,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            name: "synth".into(),
            nodes: 10_000,
            avg_degree: 10.0,
            features: 32,
            classes: 8,
            homophily: 0.8,
            seed: 0,
            exponent: 2.5,
            signal: 1.0,
            train_fraction: 0.6,
            val_fraction: 0.2,
            test_fraction: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("invalid synthetic graph config: {0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Edge(#[from] EdgeError),
}

pub type Result<T, E = SynthError> = std::result::Result<T, E>;

impl SynthConfig {
    /// Checks every field; the message names the offending one.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(SynthError::Config(msg));
        if self.nodes == 0 || self.nodes > MAX_VERTICES {
            return bad(format!(
                "nodes must be between 1 and {MAX_VERTICES}, got {}",
                self.nodes
            ));
        }
        if !self.avg_degree.is_finite() || self.avg_degree < 0.0 {
            return bad(format!(
                "avg-degree must be a non-negative number, got {}",
                self.avg_degree
            ));
        }
        if self.avg_degree > (self.nodes - 1) as f64 {
            return bad(format!(
                "avg-degree {} is impossible with {} nodes (at most {} without self-loops)",
                self.avg_degree,
                self.nodes,
                self.nodes - 1
            ));
        }
        if self.classes == 0 || self.classes as u64 > self.nodes {
            return bad(format!(
                "classes must be between 1 and the number of nodes ({}), got {}",
                self.nodes, self.classes
            ));
        }
        if self.classes > i32::MAX as usize {
            return bad(format!(
                "classes {} exceeds the i32 label range",
                self.classes
            ));
        }
        if !(0.0..=1.0).contains(&self.homophily) {
            return bad(format!(
                "homophily must be in [0, 1], got {}",
                self.homophily
            ));
        }
        if !self.exponent.is_finite() || self.exponent <= 2.0 {
            return bad(format!(
                "power-law exponent must be a number above 2 (finite mean degree), got {}",
                self.exponent
            ));
        }
        if !self.signal.is_finite() || self.signal < 0.0 {
            return bad(format!(
                "signal must be a non-negative number, got {}",
                self.signal
            ));
        }
        let test = self.test_fraction.unwrap_or(0.0);
        let fractions_ok = (0.0..=1.0).contains(&self.train_fraction)
            && (0.0..=1.0).contains(&self.val_fraction)
            && (0.0..=1.0).contains(&test)
            && self.train_fraction + self.val_fraction + test <= 1.0 + 1e-9;
        if !fractions_ok {
            return bad(format!(
                "train/val/test fractions must be in [0, 1] and sum to at most 1, got {}, {} and {}",
                self.train_fraction,
                self.val_fraction,
                self.test_fraction
                    .map_or("the rest".to_string(), |t| t.to_string())
            ));
        }
        Ok(())
    }

    /// Number of undirected edges sampled (before deduplication).
    fn sampled_edges(&self) -> u64 {
        (self.nodes as f64 * self.avg_degree / 2.0).round() as u64
    }

    fn provenance(&self) -> Vec<String> {
        vec![
            format!(
                "synthetic: Chung-Lu power-law graph (exponent {}), {} nodes, target average directed degree {}, symmetrized, self-loops removed, duplicates merged",
                self.exponent, self.nodes, self.avg_degree
            ),
            format!(
                "synthetic: {} planted classes (uniform), homophily {} (fraction of sampled edges within a class)",
                self.classes, self.homophily
            ),
            match self.features {
                0 => "synthetic: no features (train with --embedding-dim)".to_string(),
                f => format!(
                    "synthetic: {f} features = {} / sqrt({f}) * class centroid + N(0, 1) noise",
                    self.signal
                ),
            },
            format!(
                "split: seeded fraction split {}/{}/{} of all vertices, seed {}",
                self.train_fraction,
                self.val_fraction,
                self.test_fraction
                    .unwrap_or(1.0 - self.train_fraction - self.val_fraction),
                self.seed
            ),
            format!(
                "synthetic config: {}",
                serde_json::to_string(self).expect("config serializes")
            ),
        ]
    }
}

/// Independent random streams, one per purpose, so that changing e.g. the feature dimension
/// does not change the graph.
#[derive(Clone, Copy)]
enum Purpose {
    Weights = 1,
    Classes = 2,
    Edges = 3,
    Centroids = 4,
    Features = 5,
}

fn rng_for(seed: u64, purpose: Purpose, stream: u64) -> ChaCha8Rng {
    // splitmix-style mixing keeps seeds 0, 1, 2... far apart in ChaCha's key space.
    let mut z = seed ^ (purpose as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let mut rng = ChaCha8Rng::seed_from_u64(z ^ (z >> 31));
    rng.set_stream(stream);
    rng
}

/// Walker/Vose alias table: O(1) sampling proportional to weights.
struct Alias {
    prob: Vec<f32>,
    alias: Vec<u32>,
}

impl Alias {
    fn new(weights: &[f64]) -> Alias {
        let n = weights.len();
        let total: f64 = weights.iter().sum();
        let mut prob: Vec<f32> = Vec::with_capacity(n);
        let mut alias = vec![0u32; n];
        if n == 0 || total <= 0.0 {
            // Degenerate: uniform.
            return Alias {
                prob: vec![1.0; n],
                alias: (0..n as u32).collect(),
            };
        }
        let mut scaled: Vec<f64> = weights.iter().map(|w| w * n as f64 / total).collect();
        let mut small = Vec::new();
        let mut large = Vec::new();
        for (i, &s) in scaled.iter().enumerate() {
            if s < 1.0 {
                small.push(i as u32)
            } else {
                large.push(i as u32)
            }
        }
        prob.resize(n, 1.0);
        while let (Some(&s), Some(&l)) = (small.last(), large.last()) {
            small.pop();
            prob[s as usize] = scaled[s as usize] as f32;
            alias[s as usize] = l;
            scaled[l as usize] -= 1.0 - scaled[s as usize];
            if scaled[l as usize] < 1.0 {
                large.pop();
                small.push(l);
            }
        }
        // Leftovers are 1 up to rounding.
        for i in small.into_iter().chain(large) {
            prob[i as usize] = 1.0;
            alias[i as usize] = i;
        }
        Alias { prob, alias }
    }

    #[inline]
    fn sample(&self, rng: &mut impl Rng) -> usize {
        let i = rng.gen_range(0..self.prob.len());
        if rng.gen::<f32>() < self.prob[i] {
            i
        } else {
            self.alias[i] as usize
        }
    }
}

/// The random structure shared by edges and features: classes and degree weights.
struct Model {
    classes: Vec<u32>,
    global: Alias,
    members: Vec<Vec<u32>>,
    class_alias: Vec<Alias>,
}

impl Model {
    fn new(cfg: &SynthConfig) -> Model {
        let n = cfg.nodes as usize;
        let mut rng = rng_for(cfg.seed, Purpose::Classes, 0);
        let c = cfg.classes as u32;
        let classes: Vec<u32> = (0..n).map(|_| rng.gen_range(0..c)).collect();

        // Power-law expected degrees w_r ∝ (r+1)^(-1/(γ-1)) give P(d) ∝ d^-γ; ranks are
        // shuffled so hubs are not all at low ids (real datasets are not sorted by degree).
        let alpha = 1.0 / (cfg.exponent - 1.0);
        let mut ranks: Vec<u32> = (0..n as u32).collect();
        ranks.shuffle(&mut rng_for(cfg.seed, Purpose::Weights, 0));
        let mut weights: Vec<f64> = ranks
            .iter()
            .map(|&r| (r as f64 + 1.0).powf(-alpha))
            .collect();
        drop(ranks);
        // Cap expected degrees at the structural cutoff sqrt(n * d): beyond it Chung-Lu needs
        // edge probabilities above 1, which would only turn into duplicates that dedup removes.
        let total: f64 = weights.iter().sum();
        let mean_degree = cfg.avg_degree.max(1.0);
        let cap = (n as f64 * mean_degree).sqrt() / mean_degree * total / n as f64;
        for w in &mut weights {
            *w = w.min(cap);
        }
        let global = Alias::new(&weights);
        let mut members = vec![Vec::new(); cfg.classes];
        for (v, &k) in classes.iter().enumerate() {
            members[k as usize].push(v as u32);
        }
        let class_alias = members
            .par_iter()
            .map(|m| {
                let w: Vec<f64> = m.iter().map(|&v| weights[v as usize]).collect();
                Alias::new(&w)
            })
            .collect();
        Model {
            classes,
            global,
            members,
            class_alias,
        }
    }

    fn labels(&self) -> Vec<i32> {
        self.classes.iter().map(|&c| c as i32).collect()
    }

    fn sample_edge(&self, cfg: &SynthConfig, rng: &mut impl Rng) -> (u32, u32) {
        let src = self.global.sample(rng) as u32;
        let c = self.classes[src as usize] as usize;
        let same_class = cfg.classes == 1 || rng.gen::<f64>() < cfg.homophily;
        // A few retries avoid self-loops (which the builder would drop, lowering the degree);
        // the bound keeps pathological configs (a one-vertex class) from spinning.
        for _ in 0..64 {
            let dst = if same_class {
                self.members[c][self.class_alias[c].sample(rng)]
            } else {
                // Rejection from the global distribution: with uniform classes this takes
                // C/(C-1) tries on average and keeps endpoint choice degree-proportional.
                let mut d = self.global.sample(rng) as u32;
                let mut tries = 0;
                while self.classes[d as usize] as usize == c && tries < 256 {
                    d = self.global.sample(rng) as u32;
                    tries += 1;
                }
                d
            };
            if dst != src {
                return (src, dst);
            }
        }
        (src, src)
    }

    /// Samples all edges (in parallel, chunk by chunk) into a symmetrized, deduplicated list;
    /// with `scratch` (a directory and a buffer size), beyond the buffer the builder spills
    /// sorted runs there (so the edge list never has to fit in memory).
    fn edges(&self, cfg: &SynthConfig, scratch: Option<(&Path, usize)>) -> Result<SortedEdges> {
        const CHUNK: u64 = 1 << 20;
        let total = cfg.sampled_edges();
        let chunks = total.div_ceil(CHUNK);
        let batch = (rayon::current_num_threads() * 2) as u64;
        let mut builder = EdgeListBuilder::new(EdgeOptions {
            symmetrize: true,
            self_loops: SelfLoops::Remove,
        });
        if let Some((dir, run_bytes)) = scratch {
            builder = builder.spill_to(dir, run_bytes)?;
        }
        let mut builder = builder.expect_edges(total as usize);
        let mut progress = grandis_telemetry::Progress::new("edges", Some(total));
        let mut first = 0;
        while first < chunks {
            let last = (first + batch).min(chunks);
            // Each chunk has its own stream, so the result does not depend on thread count.
            let pairs: Vec<Vec<(u32, u32)>> = (first..last)
                .into_par_iter()
                .map(|chunk| {
                    let mut rng = rng_for(cfg.seed, Purpose::Edges, chunk);
                    let count = CHUNK.min(total - chunk * CHUNK);
                    (0..count)
                        .map(|_| self.sample_edge(cfg, &mut rng))
                        .collect()
                })
                .collect();
            for chunk in pairs {
                progress.inc(chunk.len() as u64);
                for (s, d) in chunk {
                    builder.push(s, d)?;
                }
            }
            first = last;
        }
        progress.finish();
        Ok(builder.finish(Some(cfg.nodes))?)
    }

    /// Produces feature rows in order, a block at a time, handing each block to `sink`.
    fn features<E>(
        &self,
        cfg: &SynthConfig,
        mut sink: impl FnMut(&[f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let f = cfg.features;
        if f == 0 {
            // A featureless graph (its models learn node embeddings): nothing to write.
            return Ok(());
        }
        let mut rng = rng_for(cfg.seed, Purpose::Centroids, 0);
        let centroids: Vec<f32> = (0..cfg.classes * f)
            .map(|_| gaussian(&mut rng) as f32)
            .collect();
        let scale = (cfg.signal / (f as f64).sqrt()) as f32;
        let n = cfg.nodes as usize;
        // About 4 MiB of features per block whatever the dimension.
        let rows_per_block = ((1usize << 20) / f).max(1);
        let blocks = n.div_ceil(rows_per_block);
        let batch = rayon::current_num_threads() * 2;
        let mut progress = grandis_telemetry::Progress::new("features", Some(n as u64));
        let mut first = 0;
        while first < blocks {
            let last = (first + batch).min(blocks);
            let rows: Vec<Vec<f32>> = (first..last)
                .into_par_iter()
                .map(|b| {
                    let mut rng = rng_for(cfg.seed, Purpose::Features, b as u64);
                    let start = b * rows_per_block;
                    let end = (start + rows_per_block).min(n);
                    let mut out = Vec::with_capacity((end - start) * f);
                    for v in start..end {
                        let c = self.classes[v] as usize;
                        let centroid = &centroids[c * f..(c + 1) * f];
                        out.extend(
                            centroid
                                .iter()
                                .map(|&m| scale * m + gaussian(&mut rng) as f32),
                        );
                    }
                    out
                })
                .collect();
            for block in rows {
                progress.inc((block.len() / f) as u64);
                sink(&block)?;
            }
            first = last;
        }
        progress.finish();
        Ok(())
    }

    fn split(&self, cfg: &SynthConfig, labels: &[i32]) -> Split {
        fraction_split(
            labels,
            cfg.train_fraction,
            cfg.val_fraction,
            cfg.test_fraction,
            cfg.seed,
        )
    }
}

/// Standard normal (Box-Muller; one of the pair is discarded to keep streams simple).
fn gaussian(rng: &mut impl Rng) -> f64 {
    let u1: f64 = 1.0 - rng.gen::<f64>(); // (0, 1]: ln is finite
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Generates the dataset described by `cfg` into `out_dir` (atomically; an existing directory
/// is only replaced when `overwrite`). Memory: about 40 bytes per vertex (the degree model and
/// row offsets), a [`DEFAULT_RUN_BYTES`] edge buffer, and a few MiB of feature rows at a time.
pub fn generate(cfg: &SynthConfig, out_dir: impl AsRef<Path>, overwrite: bool) -> Result<Dataset> {
    generate_buffered(cfg, out_dir, overwrite, DEFAULT_RUN_BYTES)
}

/// [`generate`] holding at most `edge_buffer_bytes` of edges in memory (beyond that, sorted
/// runs spill into the output's staging directory). The output does not depend on it.
pub fn generate_buffered(
    cfg: &SynthConfig,
    out_dir: impl AsRef<Path>,
    overwrite: bool,
    edge_buffer_bytes: usize,
) -> Result<Dataset> {
    cfg.validate()?;
    // Create the writer first so that an existing output is refused before any work.
    let mut writer = DatasetWriter::create(out_dir, overwrite)?;
    tracing::info!(
        nodes = cfg.nodes,
        avg_degree = cfg.avg_degree,
        "generating synthetic graph into {}",
        writer.target().display()
    );
    let model = Model::new(cfg);
    let edges = model.edges(cfg, Some((writer.scratch_dir(), edge_buffer_bytes)))?;
    writer.write_graph(&edges)?;
    writer.set_symmetric(true);
    drop(edges);
    let mut features = writer.features_writer()?;
    model.features(cfg, |block| features.push(block))?;
    writer.finish_features(features, cfg.features as u64)?;
    let labels = model.labels();
    writer.write_labels(&labels)?;
    writer.write_split(&model.split(cfg, &labels))?;
    Ok(writer.finish(DatasetInfo {
        name: cfg.name.clone(),
        num_classes: cfg.classes as u64,
        provenance: cfg.provenance(),
    })?)
}

/// The same dataset as [`generate`] (identical contents), held in memory: for small graphs
/// in tests of other crates.
pub fn generate_in_memory(cfg: &SynthConfig) -> Result<InMemoryDataset> {
    cfg.validate()?;
    let model = Model::new(cfg);
    let graph = model.edges(cfg, None)?.into_csr()?;
    let mut features = Vec::with_capacity(cfg.nodes as usize * cfg.features);
    model.features(cfg, |block| {
        features.extend_from_slice(block);
        Ok::<(), SynthError>(())
    })?;
    let labels = model.labels();
    let split = model.split(cfg, &labels);
    Ok(InMemoryDataset {
        name: cfg.name.clone(),
        graph,
        features,
        feature_dim: cfg.features,
        labels,
        num_classes: cfg.classes,
        split,
        types: None,
    })
}

/// What a generated graph actually turned out to be (the config only states targets).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GraphStats {
    pub num_vertices: u64,
    /// Stored (directed) edges; each undirected edge counts twice.
    pub num_edges: u64,
    pub avg_degree: f64,
    pub max_degree: u64,
    pub isolated: u64,
    /// Fraction of edges between labelled vertices whose endpoints share a label.
    pub homophily: f64,
}

/// Measures degree and homophily of any dataset (one parallel pass over the edges).
pub fn measure(view: &DatasetView<'_>) -> GraphStats {
    let g = view.graph;
    let n = g.num_vertices();
    let (same, labelled) = (0..n as u32)
        .into_par_iter()
        .map(|dst| {
            let ld = view.labels[dst as usize];
            if ld < 0 {
                return (0u64, 0u64);
            }
            let mut same = 0;
            let mut labelled = 0;
            for &src in g.neighbors(dst) {
                let ls = view.labels[src as usize];
                if ls >= 0 {
                    labelled += 1;
                    same += (ls == ld) as u64;
                }
            }
            (same, labelled)
        })
        .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    let stats = g.degree_stats();
    GraphStats {
        num_vertices: n as u64,
        num_edges: g.num_edges() as u64,
        avg_degree: stats.mean,
        max_degree: stats.max,
        isolated: stats.isolated,
        homophily: if labelled == 0 {
            0.0
        } else {
            same as f64 / labelled as f64
        },
    }
}

/// A `rows × cols` 4-neighbour grid, symmetric, without self-loops. Vertex `r * cols + c`
/// sits at row `r`, column `c`.
pub fn grid_graph(rows: u32, cols: u32) -> CsrGraph {
    let n = rows as u64 * cols as u64;
    let id = |r: u32, c: u32| r * cols + c;
    let mut edges = Vec::new();
    for r in 0..rows {
        for c in 0..cols {
            if c + 1 < cols {
                edges.push((id(r, c), id(r, c + 1)));
            }
            if r + 1 < rows {
                edges.push((id(r, c), id(r + 1, c)));
            }
        }
    }
    grandis_store::graph_from_edges(
        n,
        edges,
        EdgeOptions {
            symmetrize: true,
            self_loops: SelfLoops::Remove,
        },
    )
    .expect("grid ids are in range")
}

/// A grid graph as a complete dataset: features `[row, col]`, label 1 for the left half of
/// the columns and 0 otherwise, and a seeded 60/20/20 split. For tests of other crates.
pub fn grid_dataset(rows: u32, cols: u32, seed: u64) -> InMemoryDataset {
    let graph = grid_graph(rows, cols);
    let n = rows as usize * cols as usize;
    let mut features = Vec::with_capacity(n * 2);
    let mut labels = Vec::with_capacity(n);
    for r in 0..rows {
        for c in 0..cols {
            features.extend([r as f32, c as f32]);
            labels.push((c < cols / 2) as i32);
        }
    }
    let split = fraction_split(&labels, 0.6, 0.2, None, seed);
    InMemoryDataset {
        name: format!("grid-{rows}x{cols}"),
        graph,
        features,
        feature_dim: 2,
        labels,
        num_classes: 2,
        split,
        types: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(seed: u64) -> SynthConfig {
        SynthConfig {
            nodes: 3000,
            avg_degree: 10.0,
            features: 16,
            classes: 4,
            seed,
            ..Default::default()
        }
    }

    #[test]
    fn graph_is_symmetric_loop_free_and_near_target() {
        let ds = generate_in_memory(&small(1)).unwrap();
        let g = ds.graph.view();
        assert!(g.is_symmetric());
        assert!((0..g.num_vertices() as u32).all(|v| !g.has_edge(v, v)));
        let stats = measure(&ds.view());
        eprintln!("{stats:?}");
        // Duplicates among hubs are merged, so the degree lands a little under the target.
        assert!(
            stats.avg_degree > 8.0 && stats.avg_degree <= 10.05,
            "{stats:?}"
        );
        assert!((stats.homophily - 0.8).abs() < 0.05, "{stats:?}");
        // Power law: the largest degree is far above the mean.
        assert!(
            stats.max_degree as f64 > 5.0 * stats.avg_degree,
            "{stats:?}"
        );
        assert_eq!(ds.labels.len(), 3000);
        assert!(ds.labels.iter().all(|&l| (0..4).contains(&l)));
        let s = &ds.split;
        assert_eq!(s.train.len() + s.val.len() + s.test.len(), 3000);
        assert_eq!(s.train.len(), 1800);
    }

    #[test]
    fn homophily_is_tunable() {
        let low = SynthConfig {
            homophily: 0.1,
            ..small(2)
        };
        let stats = measure(&generate_in_memory(&low).unwrap().view());
        assert!((stats.homophily - 0.1).abs() < 0.05, "{stats:?}");
    }

    /// A featureless graph (for learnable node embeddings): the same graph and labels as
    /// with features, an empty feature matrix on disk and in memory.
    #[test]
    fn features_zero_makes_a_featureless_dataset() {
        let cfg = SynthConfig {
            features: 0,
            ..small(3)
        };
        let root = tempfile::tempdir().unwrap();
        let on_disk = generate(&cfg, root.path().join("f0"), false).unwrap();
        assert_eq!(on_disk.manifest().feature_dim, 0);
        let v = on_disk.view();
        assert!(v.features.is_empty() && v.feature_dim == 0);
        let in_memory = generate_in_memory(&cfg).unwrap();
        assert!(in_memory.features.is_empty());
        let with = generate_in_memory(&small(3)).unwrap();
        assert_eq!(in_memory.graph.view().indices, with.graph.view().indices);
        assert_eq!(in_memory.labels, with.labels);
    }

    #[test]
    fn deterministic_per_seed_and_on_disk_matches_memory() {
        let root = tempfile::tempdir().unwrap();
        let a = generate(&small(7), root.path().join("a"), false).unwrap();
        // A 4 KiB edge buffer: the edges go through dozens of spilled runs, same bytes.
        let b = generate_buffered(&small(7), root.path().join("b"), false, 4096).unwrap();
        let c = generate(&small(8), root.path().join("c"), false).unwrap();
        assert_eq!(a.manifest().files, b.manifest().files);
        let leftovers = std::fs::read_dir(root.path().join("b")).unwrap();
        assert!(leftovers
            .map(|e| e.unwrap().file_name())
            .all(|name| !name.to_string_lossy().starts_with(".edges-")));
        for name in ["graph.indices", "features.f32", "labels.i32", "train.idx"] {
            assert_ne!(
                a.manifest().files[name].checksum,
                c.manifest().files[name].checksum,
                "{name} should change with the seed"
            );
        }
        a.verify().unwrap();
        assert!(a.manifest().symmetric);
        assert!(a
            .manifest()
            .provenance
            .iter()
            .any(|l| l.contains("split: seeded fraction split")));
        let mut mem = generate_in_memory(&small(7)).unwrap();
        mem.name = a.manifest().name.clone();
        assert_eq!(a.to_in_memory(), mem);
        // Refuses to overwrite without permission, and leaves the old one intact.
        assert!(generate(&small(9), root.path().join("a"), false).is_err());
        Dataset::open_verified(root.path().join("a")).unwrap();
    }

    fn nearest_centroid_accuracy(ds: &InMemoryDataset, x: &[f32]) -> f64 {
        let f = ds.feature_dim;
        let c = ds.num_classes;
        let mut centroids = vec![0f64; c * f];
        let mut counts = vec![0usize; c];
        for &v in &ds.split.train {
            let k = ds.labels[v as usize] as usize;
            counts[k] += 1;
            for j in 0..f {
                centroids[k * f + j] += x[v as usize * f + j] as f64;
            }
        }
        for k in 0..c {
            for j in 0..f {
                centroids[k * f + j] /= counts[k].max(1) as f64;
            }
        }
        let correct = ds
            .split
            .test
            .iter()
            .filter(|&&v| {
                let row = &x[v as usize * f..(v as usize + 1) * f];
                let best = (0..c)
                    .min_by(|&a, &b| {
                        let d = |k: usize| -> f64 {
                            row.iter()
                                .zip(&centroids[k * f..(k + 1) * f])
                                .map(|(&p, &q)| (p as f64 - q).powi(2))
                                .sum()
                        };
                        d(a).total_cmp(&d(b))
                    })
                    .unwrap();
                best as i32 == ds.labels[v as usize]
            })
            .count();
        correct as f64 / ds.split.test.len() as f64
    }

    #[test]
    fn neighbour_aggregation_beats_raw_features() {
        let cfg = SynthConfig {
            nodes: 4000,
            avg_degree: 10.0,
            features: 32,
            classes: 8,
            seed: 3,
            ..Default::default()
        };
        let ds = generate_in_memory(&cfg).unwrap();
        let f = ds.feature_dim;
        let g = ds.graph.view();
        let mut mean = vec![0f32; ds.features.len()];
        for v in 0..g.num_vertices() as u32 {
            let nbrs = g.neighbors(v);
            let out = &mut mean[v as usize * f..(v as usize + 1) * f];
            for &u in nbrs.iter().chain(std::iter::once(&v)) {
                for (o, &x) in out.iter_mut().zip(ds.view().feature_row(u)) {
                    *o += x;
                }
            }
            let k = (nbrs.len() + 1) as f32;
            out.iter_mut().for_each(|o| *o /= k);
        }
        let raw = nearest_centroid_accuracy(&ds, &ds.features);
        let agg = nearest_centroid_accuracy(&ds, &mean);
        eprintln!("nearest-centroid accuracy: raw {raw:.3}, mean-aggregated {agg:.3}");
        // Raw features carry some signal (better than chance 1/8) but aggregation wins big.
        assert!(raw > 0.125 + 0.03, "raw {raw}");
        assert!(agg >= raw + 0.10, "raw {raw}, aggregated {agg}");
    }

    #[test]
    fn bad_configs_are_named() {
        let cases: Vec<(SynthConfig, &str)> = vec![
            (
                SynthConfig {
                    nodes: 0,
                    ..small(0)
                },
                "nodes",
            ),
            (
                SynthConfig {
                    homophily: 1.5,
                    ..small(0)
                },
                "homophily",
            ),
            (
                SynthConfig {
                    classes: 0,
                    ..small(0)
                },
                "classes",
            ),
            (
                SynthConfig {
                    avg_degree: 5000.0,
                    ..small(0)
                },
                "avg-degree",
            ),
            (
                SynthConfig {
                    exponent: 1.5,
                    ..small(0)
                },
                "exponent",
            ),
        ];
        let root = tempfile::tempdir().unwrap();
        for (cfg, word) in cases {
            let err = generate(&cfg, root.path().join("x"), false)
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains(word), "{err} should mention {word}");
        }
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }

    #[test]
    fn grid_has_expected_shape() {
        let g = grid_graph(10, 10);
        assert_eq!(g.view().num_vertices(), 100);
        // 2 * (10 * 9 horizontal + 9 * 10 vertical) directed edges.
        assert_eq!(g.view().num_edges(), 360);
        assert!(g.view().is_symmetric());
        assert!(g.view().has_edge(0, 1) && g.view().has_edge(0, 10) && !g.view().has_edge(0, 11));
        let ds = grid_dataset(4, 6, 0);
        assert_eq!(ds.features.len(), 48);
        assert_eq!(ds.view().feature_row(7), &[1.0, 1.0]);
    }
}
