//! Typed synthetic graphs (`grandis data synth --hetero`): vertex types with their own
//! sizes and feature widths, relations with their own average degrees, and planted classes
//! on every type (labels only on the target type), so that a relation carries class signal
//! from its source type to its destination type. A vertex's features are its type's class
//! centroid scaled by `signal` plus unit noise; a relation's edge into `v` comes, with
//! probability `homophily`, from a source of `v`'s class, otherwise from any source. In
//! memory (typed graphs here are test and benchmark sizes: 200k vertices, a few million
//! edges); a pure function of the config.

use grandis_store::{
    graph_from_edges, split::fraction_split, EdgeOptions, InMemoryDataset, Relation, SelfLoops,
    TypeSchema, Types, VertexType,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{gaussian, Result, SynthError};

/// One vertex type: `name:count:features` on the command line.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TypeSpec {
    pub name: String,
    pub count: u64,
    /// Its feature columns (0: featureless, zero rows).
    pub features: usize,
}

/// One relation: `src:name:dst:degree` on the command line (`degree`: average edges into a
/// destination vertex).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RelationSpec {
    pub src: String,
    pub name: String,
    pub dst: String,
    pub avg_degree: f64,
}

impl std::str::FromStr for TypeSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let [name, count, features] = parts[..] else {
            return Err(format!("{s:?}: a vertex type is name:count:features"));
        };
        Ok(TypeSpec {
            name: name.to_string(),
            count: count
                .parse()
                .map_err(|e| format!("{s:?}: count {count:?}: {e}"))?,
            features: features
                .parse()
                .map_err(|e| format!("{s:?}: features {features:?}: {e}"))?,
        })
    }
}

impl std::str::FromStr for RelationSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let [src, name, dst, degree] = parts[..] else {
            return Err(format!("{s:?}: a relation is src:name:dst:degree"));
        };
        Ok(RelationSpec {
            src: src.to_string(),
            name: name.to_string(),
            dst: dst.to_string(),
            avg_degree: degree
                .parse()
                .map_err(|e| format!("{s:?}: degree {degree:?}: {e}"))?,
        })
    }
}

/// Everything that decides a typed synthetic dataset.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HeteroConfig {
    pub name: String,
    pub types: Vec<TypeSpec>,
    pub relations: Vec<RelationSpec>,
    /// The type with labels and splits.
    pub target: String,
    pub classes: usize,
    pub homophily: f64,
    pub signal: f64,
    pub seed: u64,
    pub train_fraction: f64,
    pub val_fraction: f64,
    pub test_fraction: Option<f64>,
}

impl HeteroConfig {
    /// The default typed graph of `nodes` vertices: papers (half, `features` columns),
    /// authors (35 %, half as many columns) and institutions (the rest, featureless); papers
    /// cite papers (8 per paper), authors write papers (3 per paper), papers are written by
    /// authors (4 per author) and authors are affiliated with institutions (5 per
    /// institution): 3 types, 4 relations, every type a destination; papers are the target.
    pub fn academic(nodes: u64, features: usize, classes: usize, seed: u64) -> HeteroConfig {
        let papers = nodes / 2;
        let authors = nodes * 35 / 100;
        let ty = |name: &str, count, features| TypeSpec {
            name: name.into(),
            count,
            features,
        };
        let rel = |src: &str, name: &str, dst: &str, avg_degree| RelationSpec {
            src: src.into(),
            name: name.into(),
            dst: dst.into(),
            avg_degree,
        };
        HeteroConfig {
            name: format!("synth-hetero-{nodes}n"),
            types: vec![
                ty("paper", papers, features),
                ty("author", authors, features / 2),
                ty("institution", nodes - papers - authors, 0),
            ],
            relations: vec![
                rel("paper", "cites", "paper", 8.0),
                rel("author", "writes", "paper", 3.0),
                rel("paper", "written_by", "author", 4.0),
                rel("author", "affiliated_with", "institution", 5.0),
            ],
            target: "paper".into(),
            classes,
            homophily: 0.7,
            signal: 1.0,
            seed,
            train_fraction: 0.6,
            val_fraction: 0.2,
            test_fraction: None,
        }
    }

    fn schema(&self) -> TypeSchema {
        TypeSchema {
            vertex_types: self
                .types
                .iter()
                .map(|t| VertexType::new(&t.name, t.count, t.features as u64))
                .collect(),
            relations: self
                .relations
                .iter()
                .map(|r| Relation::new(&r.src, &r.name, &r.dst))
                .collect(),
            target: self.target.clone(),
        }
    }

    /// Checks the config, naming the offending field; returns the checked types.
    fn check(&self) -> Result<Types> {
        let bad = |m: String| SynthError::Config(m);
        if self.classes == 0 {
            return Err(bad("classes must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.homophily) {
            return Err(bad(format!(
                "homophily {} is outside 0..=1",
                self.homophily
            )));
        }
        if let Some(t) = self.types.iter().find(|t| t.count == 0) {
            return Err(bad(format!("vertex type {:?} has no vertices", t.name)));
        }
        if let Some(r) = self
            .relations
            .iter()
            .find(|r| !(r.avg_degree.is_finite() && r.avg_degree >= 0.0))
        {
            return Err(bad(format!(
                "relation {}:{}:{} has degree {}",
                r.src, r.name, r.dst, r.avg_degree
            )));
        }
        let n: u64 = self.types.iter().map(|t| t.count).sum();
        if n > grandis_store::MAX_VERTICES {
            return Err(bad(format!("{n} vertices exceed the u32 id limit")));
        }
        let width = self.types.iter().map(|t| t.features).max().unwrap_or(0);
        Types::new(self.schema(), n, width as u64).map_err(bad)
    }
}

/// Generates the typed dataset `cfg` describes.
pub fn generate_hetero_in_memory(cfg: &HeteroConfig) -> Result<InMemoryDataset> {
    let types = cfg.check()?;
    let n: u64 = cfg.types.iter().map(|t| t.count).sum();
    let width = cfg.types.iter().map(|t| t.features).max().unwrap_or(0);
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x6865_7465_726f);
    let classes: Vec<u32> = (0..n)
        .map(|_| rng.gen_range(0..cfg.classes as u32))
        .collect();
    // Per type and class, its vertices (edges of a homophilous draw pick among them).
    let by_class: Vec<Vec<Vec<u32>>> = (0..types.num_types())
        .map(|t| {
            let mut lists = vec![Vec::new(); cfg.classes];
            for v in types.range(t) {
                lists[classes[v as usize] as usize].push(v);
            }
            lists
        })
        .collect();
    let mut features = vec![0f32; n as usize * width];
    for (t, spec) in cfg.types.iter().enumerate() {
        let f = spec.features;
        if f == 0 {
            continue;
        }
        let scale = cfg.signal / (f as f64).sqrt();
        let centroids: Vec<f64> = (0..cfg.classes * f).map(|_| gaussian(&mut rng)).collect();
        for v in types.range(t) {
            let c = classes[v as usize] as usize;
            let row = &mut features[v as usize * width..v as usize * width + f];
            for (j, x) in row.iter_mut().enumerate() {
                *x = (scale * centroids[c * f + j] + gaussian(&mut rng)) as f32;
            }
        }
    }
    let mut edges: Vec<(u32, u32)> = Vec::new();
    for r in 0..types.num_relations() {
        let (src_type, dst_type) = types.ends(r);
        let sources = types.range(src_type);
        let mean = cfg.relations[r].avg_degree;
        for v in types.range(dst_type) {
            // Exponentially distributed degrees around the mean: a tail of busy vertices.
            let k = (-mean * (1.0 - rng.gen::<f64>()).ln()).round() as usize;
            let same = &by_class[src_type][classes[v as usize] as usize];
            for _ in 0..k {
                let u = if !same.is_empty() && rng.gen::<f64>() < cfg.homophily {
                    same[rng.gen_range(0..same.len())]
                } else {
                    rng.gen_range(sources.clone())
                };
                edges.push((u, v));
            }
        }
    }
    let options = EdgeOptions {
        symmetrize: false,
        self_loops: SelfLoops::Remove,
    };
    let graph = graph_from_edges(n, edges, options)?;
    let target = types.range(types.target());
    let labels: Vec<i32> = (0..n as u32)
        .map(|v| {
            if target.contains(&v) {
                classes[v as usize] as i32
            } else {
                -1
            }
        })
        .collect();
    let split = fraction_split(
        &labels,
        cfg.train_fraction,
        cfg.val_fraction,
        cfg.test_fraction,
        cfg.seed,
    );
    Ok(InMemoryDataset {
        name: cfg.name.clone(),
        graph,
        features,
        feature_dim: width,
        labels,
        num_classes: cfg.classes,
        split,
        types: Some(types),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_academic_graph_is_typed_reproducible_and_verifies() {
        let cfg = HeteroConfig::academic(2_000, 16, 4, 3);
        let a = generate_hetero_in_memory(&cfg).unwrap();
        assert_eq!(a, generate_hetero_in_memory(&cfg).unwrap());
        let types = a.types.as_ref().unwrap();
        assert_eq!((types.num_types(), types.num_relations()), (3, 4));
        let counts = types.count_edges(a.graph.view()).unwrap();
        // About the configured degree into each destination type.
        for (r, &c) in counts.iter().enumerate() {
            let dst = types.range(types.ends(r).1);
            let per = c as f64 / dst.len() as f64;
            let want = cfg.relations[r].avg_degree;
            assert!(
                (per - want).abs() < 0.25 * want,
                "relation {r}: {per} per vertex"
            );
        }
        // Labels only on papers; authors carry 8 feature columns, institutions none.
        assert!(a.split.train.iter().all(|&v| types.type_of(v) == 0));
        let author = types.range(1).start as usize;
        assert!(a.features[author * 16 + 8..author * 16 + 16]
            .iter()
            .all(|&x| x == 0.0));
        let dir = tempfile::tempdir().unwrap();
        let written = a.write(dir.path().join("d"), false).unwrap();
        written.verify().unwrap();
        let relations = &written.manifest().types.as_ref().unwrap().relations;
        assert_eq!(
            relations.iter().map(|r| r.num_edges).collect::<Vec<_>>(),
            counts
        );
    }

    #[test]
    fn bad_configs_are_named() {
        let mut cfg = HeteroConfig::academic(100, 4, 2, 0);
        cfg.relations[1].src = "venue".into();
        let e = generate_hetero_in_memory(&cfg).unwrap_err().to_string();
        assert!(e.contains("source type \"venue\""), "{e}");
        assert!("a:b"
            .parse::<TypeSpec>()
            .unwrap_err()
            .contains("name:count:features"));
        assert!("a:r:b:x"
            .parse::<RelationSpec>()
            .unwrap_err()
            .contains("degree \"x\""));
    }
}
