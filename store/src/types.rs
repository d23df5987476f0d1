//! Typed graphs: vertex types and relations over one vertex set (the manifest's `types`
//! section), as DistDGL and GraphStorm store a heterogeneous graph homogeneously.
//!
//! Vertex types are contiguous id ranges in the order the schema lists them (type 0 first),
//! so a vertex's type is a binary search over a handful of starts and partitioners, masking
//! and samplers see one graph. A relation is `(source type, name, destination type)`; the
//! dataset's CSR is the union of every relation's edges, and an edge's relation is the one
//! its ends' types name: **at most one relation per ordered pair of types**, which ogbn-mag,
//! MAG240M and IGB-H (the MLPerf R-GAT graph) satisfy. That rule is what lets every block a
//! plan builds be split by relation from its rows' types alone, with no per-edge array
//! travelling through partitioning, sampling and the exchanges. Within a row, sources are
//! sorted by id and so grouped by type: each relation's sources are one contiguous run.
//!
//! Features are one matrix as wide as the widest type; a type narrower than that has zeros
//! in the columns past its `feature_dim` (a type with none trains on learnable embeddings).
//! Labels and the node splits are the target type's.

use serde::{Deserialize, Serialize};

/// One vertex type: `count` vertices with ids right after the previous type's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VertexType {
    pub name: String,
    pub count: u64,
    /// Feature columns this type has (the rest of its rows are zero).
    pub feature_dim: u64,
}

/// One relation: edges from vertices of type `src` to vertices of type `dst`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Relation {
    pub src: String,
    pub name: String,
    pub dst: String,
    /// Its edges in the stored graph (counted by `Dataset::verify`).
    pub num_edges: u64,
}

impl VertexType {
    pub fn new(name: &str, count: u64, feature_dim: u64) -> VertexType {
        VertexType {
            name: name.into(),
            count,
            feature_dim,
        }
    }
}

impl Relation {
    /// A relation whose edges the dataset writer will count.
    pub fn new(src: &str, name: &str, dst: &str) -> Relation {
        Relation {
            src: src.into(),
            name: name.into(),
            dst: dst.into(),
            num_edges: 0,
        }
    }

    /// PyG's key of the relation, `src__name__dst`: unique, and what parameter names and the
    /// npy layout's file names use.
    pub fn key(&self) -> String {
        format!("{}__{}__{}", self.src, self.name, self.dst)
    }
}

/// The manifest's `types` section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeSchema {
    pub vertex_types: Vec<VertexType>,
    pub relations: Vec<Relation>,
    /// The type whose vertices carry the labels and the node splits.
    pub target: String,
}

/// A [`TypeSchema`] checked and indexed for lookups on hot paths.
#[derive(Debug, Clone, PartialEq)]
pub struct Types {
    pub schema: TypeSchema,
    /// `starts[t]..starts[t + 1]` are type `t`'s ids (`types + 1` entries).
    starts: Vec<u32>,
    /// `relation_of[src_type * types + dst_type]`.
    relation_of: Vec<Option<u16>>,
    /// Per relation: (source type, destination type).
    ends: Vec<(u16, u16)>,
    target: u16,
}

/// The most vertex types (and relations) a schema may have.
pub const MAX_TYPES: usize = 1 << 12;

impl Types {
    /// Checks `schema` against a graph of `num_vertices` vertices and `feature_dim` columns:
    /// type names unique and counts adding up, relations naming known types, one relation per
    /// ordered pair of types, the target a known type, widths within the features.
    pub fn new(schema: TypeSchema, num_vertices: u64, feature_dim: u64) -> Result<Types, String> {
        let t = schema.vertex_types.len();
        if t == 0 {
            return Err("types: no vertex type".into());
        }
        if t > MAX_TYPES || schema.relations.len() > MAX_TYPES {
            return Err(format!(
                "types: {t} vertex types and {} relations (at most {MAX_TYPES} each)",
                schema.relations.len()
            ));
        }
        let mut starts = vec![0u32];
        let mut total = 0u64;
        for (i, vt) in schema.vertex_types.iter().enumerate() {
            if vt.name.is_empty() {
                return Err(format!("types: vertex type {i} has an empty name"));
            }
            if schema.vertex_types[..i].iter().any(|o| o.name == vt.name) {
                return Err(format!("types: vertex type {:?} is listed twice", vt.name));
            }
            if vt.feature_dim > feature_dim {
                return Err(format!(
                    "types: vertex type {:?} has {} feature columns, the features have {feature_dim}",
                    vt.name, vt.feature_dim
                ));
            }
            total += vt.count;
            if total > num_vertices {
                break;
            }
            starts.push(total as u32);
        }
        if total != num_vertices {
            return Err(format!(
                "types: the vertex types count {total} vertices, the graph has {num_vertices}"
            ));
        }
        let index = |name: &str, what: &str, r: &Relation| {
            schema
                .vertex_types
                .iter()
                .position(|vt| vt.name == name)
                .map(|i| i as u16)
                .ok_or_else(|| {
                    format!(
                        "types: relation {:?} names {what} type {name:?}, which is not a vertex type",
                        r.key()
                    )
                })
        };
        let mut relation_of = vec![None; t * t];
        let mut ends = Vec::with_capacity(schema.relations.len());
        for (i, r) in schema.relations.iter().enumerate() {
            let (s, d) = (
                index(&r.src, "source", r)?,
                index(&r.dst, "destination", r)?,
            );
            let slot = &mut relation_of[s as usize * t + d as usize];
            if let Some(other) = slot {
                return Err(format!(
                    "types: relations {:?} and {:?} both join {:?} to {:?}; a typed dataset \
                     has at most one relation per ordered pair of vertex types",
                    schema.relations[*other as usize].key(),
                    r.key(),
                    r.src,
                    r.dst
                ));
            }
            *slot = Some(i as u16);
            ends.push((s, d));
        }
        let target = schema
            .vertex_types
            .iter()
            .position(|vt| vt.name == schema.target)
            .ok_or_else(|| format!("types: the target {:?} is not a vertex type", schema.target))?
            as u16;
        Ok(Types {
            schema,
            starts,
            relation_of,
            ends,
            target,
        })
    }

    pub fn num_types(&self) -> usize {
        self.schema.vertex_types.len()
    }

    pub fn num_relations(&self) -> usize {
        self.schema.relations.len()
    }

    /// The type of vertex `v`.
    pub fn type_of(&self, v: u32) -> usize {
        self.starts.partition_point(|&s| s <= v) - 1
    }

    /// The type of each of `ids`, as the engine's relation blocks take them.
    pub fn types_of(&self, ids: &[u32]) -> Vec<u16> {
        ids.iter().map(|&v| self.type_of(v) as u16).collect()
    }

    /// The ids of type `t`.
    pub fn range(&self, t: usize) -> std::ops::Range<u32> {
        self.starts[t]..self.starts[t + 1]
    }

    /// The relation joining a vertex of type `src` to one of type `dst`, if any.
    pub fn relation(&self, src: usize, dst: usize) -> Option<usize> {
        self.relation_of[src * self.num_types() + dst].map(usize::from)
    }

    /// (source type, destination type) of relation `r`.
    pub fn ends(&self, r: usize) -> (usize, usize) {
        let (s, d) = self.ends[r];
        (s as usize, d as usize)
    }

    /// The target type's index.
    pub fn target(&self) -> usize {
        self.target as usize
    }

    /// PyG's keys of the relations, in order.
    pub fn relation_keys(&self) -> Vec<String> {
        self.schema.relations.iter().map(Relation::key).collect()
    }

    /// The relation `name` names: its key (`src__name__dst`), or its name when only one
    /// relation has it. The error lists the relations, or says to give the key.
    pub fn find_relation(&self, name: &str) -> Result<usize, String> {
        let keys = self.relation_keys();
        if let Some(r) = keys.iter().position(|k| k == name) {
            return Ok(r);
        }
        let named: Vec<usize> = (0..keys.len())
            .filter(|&r| self.schema.relations[r].name == name)
            .collect();
        match named[..] {
            [r] => Ok(r),
            [] => Err(format!(
                "{name:?} is no relation of the dataset (its relations: {})",
                keys.join(", ")
            )),
            _ => Err(format!(
                "{name:?} names {} relations; give one as src__name__dst",
                named.len()
            )),
        }
    }

    /// Counts the edges of every relation in `graph` (rows = destinations), failing on the
    /// first edge whose ends' types no relation joins.
    pub fn count_edges(&self, graph: crate::CsrView<'_>) -> Result<Vec<u64>, String> {
        use rayon::prelude::*;
        let t = self.num_types();
        (0..t)
            .into_par_iter()
            .map(|dst_type| {
                let mut counts = vec![0u64; self.num_relations()];
                for v in self.range(dst_type) {
                    let row = graph.neighbors(v);
                    // Sources are sorted, so each source type is one run of the row.
                    let mut at = 0;
                    while at < row.len() {
                        let src_type = self.type_of(row[at]);
                        let end =
                            at + row[at..].partition_point(|&u| u < self.starts[src_type + 1]);
                        let Some(r) = self.relation(src_type, dst_type) else {
                            return Err(format!(
                                "edge {} -> {v} joins a {:?} to a {:?}, and no relation does",
                                row[at],
                                self.schema.vertex_types[src_type].name,
                                self.schema.vertex_types[dst_type].name
                            ));
                        };
                        counts[r] += (end - at) as u64;
                        at = end;
                    }
                }
                Ok(counts)
            })
            .try_reduce(
                || vec![0u64; self.num_relations()],
                |mut a, b| {
                    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                    Ok(a)
                },
            )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> TypeSchema {
        let (vt, rel) = (VertexType::new, Relation::new);
        TypeSchema {
            vertex_types: vec![vt("paper", 3, 4), vt("author", 2, 0)],
            relations: vec![
                rel("paper", "cites", "paper"),
                rel("author", "writes", "paper"),
                rel("paper", "written_by", "author"),
            ],
            target: "paper".into(),
        }
    }

    fn graph(edges: &[(u32, u32)]) -> crate::CsrGraph {
        let options = crate::EdgeOptions {
            symmetrize: false,
            self_loops: crate::SelfLoops::Keep,
        };
        crate::graph_from_edges(5, edges.iter().copied(), options).unwrap()
    }

    #[test]
    fn types_index_ranges_and_relations() {
        let t = Types::new(schema(), 5, 4).unwrap();
        assert_eq!(t.type_of(0), 0);
        assert_eq!(t.type_of(2), 0);
        assert_eq!(t.type_of(3), 1);
        assert_eq!(t.type_of(4), 1);
        assert_eq!(t.range(1), 3..5);
        assert_eq!(t.relation(1, 0), Some(1));
        assert_eq!(t.relation(1, 1), None);
        assert_eq!((t.ends(0), t.ends(1), t.ends(2)), ((0, 0), (1, 0), (0, 1)));
        assert_eq!(t.relation_keys()[1], "author__writes__paper");
        // 3 -> 0 (writes), 1 -> 0 and 2 -> 0 (cites), 0 -> 4 (written_by).
        let g = graph(&[(1, 0), (2, 0), (3, 0), (0, 4)]);
        assert_eq!(t.count_edges(g.view()).unwrap(), vec![2, 1, 1]);
        let bad = graph(&[(3, 4)]);
        let err = t.count_edges(bad.view()).unwrap_err();
        assert!(
            err.contains("3 -> 4") && err.contains("\"author\""),
            "{err}"
        );
    }

    #[test]
    fn bad_schemas_are_named() {
        let err = |s: TypeSchema, v, f| Types::new(s, v, f).unwrap_err();
        assert!(err(schema(), 6, 4).contains("count 5 vertices, the graph has 6"));
        assert!(err(schema(), 5, 3).contains("\"paper\" has 4 feature columns"));
        let mut s = schema();
        s.relations[0].dst = "venue".into();
        assert!(err(s, 5, 4).contains("destination type \"venue\""));
        let mut s = schema();
        s.relations[2].name = "cites_too".into();
        s.relations[2].dst = "paper".into();
        assert!(err(s, 5, 4).contains("at most one relation per ordered pair"));
        let mut s = schema();
        s.target = "venue".into();
        assert!(err(s, 5, 4).contains("target \"venue\""));
    }
}
