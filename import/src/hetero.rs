//! Typed graphs in PyG's `HeteroData` layout, saved as NumPy arrays: what `--format npy`
//! reads when the directory holds it, and what [`crate::export_npy`] writes for a typed
//! dataset, so baselines train on exactly the data grandis trains on.
//!
//! | file | dtype | shape | contents |
//! |---|---|---|---|
//! | `hetero.json` | | | `{"node_types": [{"name": "paper", "count": N}, ...], "target": "paper"}`: the types in id order, their counts and the target (optional when every type has `x_{type}.npy`: then types sort by name and the target is the one type with as many rows as `y.npy`) |
//! | `x_{type}.npy` | float32 / float64 | (N_type, F_type) | a type's features (optional for a type `hetero.json` counts: featureless) |
//! | `edge_index_{src}__{rel}__{dst}.npy` | int64 / int32 | (2, E) | a relation's edges, ids local to their type (row 0 sources of type `src`, row 1 destinations of type `dst`) |
//! | `y.npy` | int64 / int32 | (N_target,) | the target type's classes, negative = unlabelled |
//! | `train_idx.npy`, `val_idx.npy`, `test_idx.npy` | int64 / int32 | (n,) | optional split, target-local ids |
//! | `link_*.npy`, `link_destinations.npy` | int64 | (2, n), (2,) | export only: a link split as the homogeneous layout writes it (global ids), `hetero.json`'s `link_relation` naming its relation |
//!
//! Ids become global by type: the first type's vertices first. Features are padded with
//! zeros to the widest type (the dataset records each type's own width).

use std::path::{Path, PathBuf};

use grandis_npy::{DType, NpyFile};
use grandis_store::{AtomicDir, DatasetView, Relation, TypeSchema, Types, VertexType};

use crate::error::{ImportError, Result};
use crate::{vertex_id, Ctx, Parts};

/// The layout's description file.
pub(crate) const HETERO_JSON: &str = "hetero.json";
const EDGE_PREFIX: &str = "edge_index_";

#[derive(serde::Serialize, serde::Deserialize)]
struct NodeTypeEntry {
    name: String,
    count: u64,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct HeteroJson {
    node_types: Vec<NodeTypeEntry>,
    target: String,
    /// The relation a link split's pairs belong to (`src__name__dst`), when the directory
    /// has one (`link_*.npy`, global ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    link_relation: Option<String>,
}

fn x_name(t: &str) -> String {
    format!("x_{t}.npy")
}

fn edge_name(key: &str) -> String {
    format!("{EDGE_PREFIX}{key}.npy")
}

/// Whether `dir` holds the typed layout (a `hetero.json` or any relation's edge file).
pub(crate) fn is_hetero(dir: &Path) -> bool {
    dir.join(HETERO_JSON).exists() || !relation_files(dir).unwrap_or_default().is_empty()
}

/// `(file, src, rel, dst)` of every `edge_index_{src}__{rel}__{dst}.npy`, sorted by name.
fn relation_files(dir: &Path) -> Result<Vec<(PathBuf, String, String, String)>> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| ImportError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| ImportError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(key) = name
            .strip_prefix(EDGE_PREFIX)
            .and_then(|k| k.strip_suffix(".npy"))
        else {
            continue;
        };
        let parts: Vec<&str> = key.split("__").collect();
        let [src, rel, dst] = parts[..] else {
            return Err(ImportError::invalid(
                entry.path(),
                "a relation's file is edge_index_{src}__{rel}__{dst}.npy",
            ));
        };
        out.push((entry.path(), src.into(), rel.into(), dst.into()));
    }
    out.sort();
    Ok(out)
}

/// The vertex types in id order with their counts, and the target.
fn node_types(dir: &Path) -> Result<(Vec<NodeTypeEntry>, String)> {
    let path = dir.join(HETERO_JSON);
    if path.exists() {
        let bytes = std::fs::read(&path).map_err(|e| ImportError::io(&path, e))?;
        let h: HeteroJson = serde_json::from_slice(&bytes)
            .map_err(|e| ImportError::invalid(&path, format!("not a valid {HETERO_JSON}: {e}")))?;
        return Ok((h.node_types, h.target));
    }
    // Without it: every type has its features; names sort; the target has y's rows.
    let mut types = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| ImportError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| ImportError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(t) = name.strip_prefix("x_").and_then(|t| t.strip_suffix(".npy")) {
            let x = NpyFile::open(entry.path())?;
            let count = x.expect_ndim(2)?[0];
            types.push(NodeTypeEntry {
                name: t.into(),
                count,
            });
        }
    }
    types.sort_by(|a, b| a.name.cmp(&b.name));
    let y = NpyFile::open(dir.join("y.npy"))?;
    let rows = y.shape().first().copied().unwrap_or(0);
    let candidates: Vec<&NodeTypeEntry> = types.iter().filter(|t| t.count == rows).collect();
    let [target] = candidates[..] else {
        return Err(ImportError::invalid(
            dir,
            format!(
                "{} vertex types have as many rows as y.npy ({rows}); name the types and the \
                 target in {HETERO_JSON}",
                candidates.len()
            ),
        ));
    };
    let target = target.name.clone();
    Ok((types, target))
}

/// Reads the typed layout of `dir` into `ctx`'s dataset: features (padded), the relations'
/// edges, the target's labels and split, and the types.
pub(crate) fn import(ctx: &mut Ctx<'_>, dir: &Path) -> Result<Parts> {
    let (types, target) = node_types(dir)?;
    let link = dir.join(crate::export::link_npy_name(grandis_store::LinkPart::Train));
    if link.exists() {
        return Err(ImportError::invalid(
            link,
            "a typed dataset's link split is not imported yet (import the graph, then \
             `grandis data split-edges --relation`)",
        ));
    }
    let relations = relation_files(dir)?;
    let index = |name: &str, file: &Path| {
        types.iter().position(|t| t.name == name).ok_or_else(|| {
            ImportError::invalid(
                file,
                format!("names vertex type {name:?}, which is not one of the vertex types"),
            )
        })
    };
    // Starts of each type's ids, and each type's features (checked before the long work).
    let mut starts = vec![0u64];
    for t in &types {
        starts.push(starts.last().unwrap() + t.count);
    }
    let n = *starts.last().unwrap();
    let mut widths = Vec::with_capacity(types.len());
    let mut x_files = Vec::with_capacity(types.len());
    for t in &types {
        let path = dir.join(x_name(&t.name));
        if !path.exists() {
            x_files.push(None);
            widths.push(0);
            continue;
        }
        let x = NpyFile::open(&path)?;
        let shape = x.expect_ndim(2)?;
        if shape[0] != t.count {
            return Err(ImportError::invalid(
                &path,
                format!(
                    "has {} rows; type {:?} has {} vertices",
                    shape[0], t.name, t.count
                ),
            ));
        }
        widths.push(shape[1] as usize);
        x_files.push(Some(x));
    }
    let width = widths.iter().copied().max().unwrap_or(0);
    let mut features = vec![0f32; n as usize * width];
    for (t, x) in x_files.iter().enumerate() {
        let Some(x) = x else { continue };
        let (first, w) = (starts[t] as usize, widths[t]);
        crate::npy_dir::feature_rows(x, |r, row| {
            features[(first + r) * width..(first + r) * width + w].copy_from_slice(row);
            Ok(())
        })?;
    }
    ctx.writer.write_features(&features, width as u64)?;
    drop(features);
    ctx.provenance.push(format!(
        "features: {} types, widths {widths:?}, padded to {width}",
        types.len()
    ));

    // Edges, relation by relation, made global.
    let mut builder = ctx.edge_builder(None)?;
    let mut input_edges = 0u64;
    let mut schema_relations = Vec::with_capacity(relations.len());
    for (path, src, rel, dst) in &relations {
        let (s, d) = (index(src, path)?, index(dst, path)?);
        let file = NpyFile::open(path)?;
        let shape = file.expect_ndim(2)?;
        if shape[0] != 2 {
            return Err(ImportError::invalid(
                path,
                format!("shape is {shape:?}, expected (2, E): row 0 sources, row 1 destinations"),
            ));
        }
        let e = shape[1] as usize;
        let (sn, dn) = (types[s].count, types[d].count);
        let src_of = format!("type {src:?} has {sn} vertices");
        let dst_of = format!("type {dst:?} has {dn} vertices");
        let mut push = |i: usize, u: i64, v: i64| -> Result<()> {
            let err = |m: String| ImportError::invalid(path, format!("edge {i} ({u} -> {v}): {m}"));
            let u = vertex_id(u, Some(sn), &src_of).map_err(err)?;
            let v = vertex_id(v, Some(dn), &dst_of).map_err(err)?;
            builder
                .push(starts[s] as u32 + u, starts[d] as u32 + v)
                .map_err(|e| err(e.to_string()))
        };
        match file.expect_dtype(&[DType::I64, DType::I32])? {
            DType::I64 => {
                let m = file.matrix::<i64>()?;
                for i in 0..e {
                    push(i, m.at(0, i), m.at(1, i))?;
                }
            }
            _ => {
                let m = file.matrix::<i32>()?;
                for i in 0..e {
                    push(i, m.at(0, i) as i64, m.at(1, i) as i64)?;
                }
            }
        }
        input_edges += e as u64;
        schema_relations.push(Relation::new(src, rel, dst));
    }
    let edges = builder
        .finish(Some(n))
        .map_err(|err| crate::edge_error(dir, err))?;

    // The target's labels and split, made global.
    let t = index(&target, &dir.join(HETERO_JSON))?;
    let first = starts[t];
    let y = NpyFile::open(dir.join("y.npy"))?;
    let rows_of = format!("type {:?} has", types[t].name);
    let (target_labels, labels_path) = crate::npy_dir::read_labels_of(y, types[t].count, &rows_of)?;
    let mut labels = vec![-1i32; n as usize];
    labels[first as usize..(first + types[t].count) as usize].copy_from_slice(&target_labels);
    let names = ["train_idx.npy", "val_idx.npy", "test_idx.npy"];
    let split = if dir.join(names[0]).exists() {
        let global = |name| -> Result<(PathBuf, Vec<u32>)> {
            let (path, ids) = crate::npy_dir::read_split_of(dir, name, types[t].count, &rows_of)?;
            Ok((path, ids.into_iter().map(|v| v + first as u32).collect()))
        };
        let [train, val, test] = names.map(global);
        Some([train?, val?, test?])
    } else {
        None
    };
    let schema = TypeSchema {
        vertex_types: types
            .iter()
            .zip(&widths)
            .map(|(t, &w)| VertexType::new(&t.name, t.count, w as u64))
            .collect(),
        relations: schema_relations,
        target,
    };
    Types::new(schema.clone(), n, width as u64)
        .map_err(|m| ImportError::invalid(dir.join(HETERO_JSON), m))?;
    ctx.provenance.push(format!(
        "types: {} vertex types, {} relations, target {:?}",
        schema.vertex_types.len(),
        schema.relations.len(),
        schema.target
    ));
    Ok(Parts {
        input: dir.to_path_buf(),
        edges,
        input_edges,
        labels,
        labels_path,
        split,
        link: None,
        types: Some(schema),
    })
}

/// Writes a typed `view` into `dir` (staged by the caller) in the layout above; returns
/// the files written.
pub(crate) fn export(
    view: &DatasetView<'_>,
    types: &Types,
    dir: &AtomicDir,
) -> Result<Vec<String>> {
    let p = |name: &str| dir.path().join(name);
    let mut files = Vec::new();
    let f = view.feature_dim;
    for (t, vt) in types.schema.vertex_types.iter().enumerate() {
        let range = types.range(t);
        let w = vt.feature_dim as usize;
        if w == 0 {
            continue; // featureless: hetero.json counts it
        }
        let mut x = Vec::with_capacity(range.len() * w);
        for v in range.clone() {
            x.extend_from_slice(&view.features[v as usize * f..v as usize * f + w]);
        }
        let name = x_name(&vt.name);
        grandis_npy::write_npy(p(&name), &[range.len() as u64, w as u64], &x)?;
        files.push(name);
    }
    let g = &view.graph;
    for (r, rel) in types.schema.relations.iter().enumerate() {
        let (s, d) = types.ends(r);
        let (src, dst) = (types.range(s), types.range(d));
        let (mut sources, mut destinations) = (Vec::new(), Vec::new());
        for v in dst.clone() {
            for &u in g.neighbors(v) {
                if src.contains(&u) {
                    sources.push((u - src.start) as i64);
                    destinations.push((v - dst.start) as i64);
                }
            }
        }
        let e = sources.len() as u64;
        sources.extend(destinations);
        let name = edge_name(&rel.key());
        grandis_npy::write_npy(p(&name), &[2, e], &sources)?;
        files.push(name);
    }
    let target = types.range(types.target());
    let labels: Vec<i64> = view.labels[target.start as usize..target.end as usize]
        .iter()
        .map(|&l| l as i64)
        .collect();
    grandis_npy::write_npy(p("y.npy"), &[labels.len() as u64], &labels)?;
    files.push("y.npy".into());
    for (name, ids) in [
        ("train_idx.npy", view.train),
        ("val_idx.npy", view.val),
        ("test_idx.npy", view.test),
    ] {
        let ids: Vec<i64> = ids.iter().map(|&v| (v - target.start) as i64).collect();
        grandis_npy::write_npy(p(name), &[ids.len() as u64], &ids)?;
        files.push(name.into());
    }
    let json = HeteroJson {
        node_types: types
            .schema
            .vertex_types
            .iter()
            .map(|t| NodeTypeEntry {
                name: t.name.clone(),
                count: t.count,
            })
            .collect(),
        target: types.schema.target.clone(),
        link_relation: match &view.links {
            Some(links) => Some(export_links(links, types, dir, &mut files)?),
            None => None,
        },
    };
    let bytes = serde_json::to_vec_pretty(&json).expect("hetero.json serializes");
    grandis_store::write_file_atomic(p(HETERO_JSON), &bytes)?;
    files.push(HETERO_JSON.into());
    Ok(files)
}

/// Writes a typed dataset's link split as the homogeneous layout does (`link_*.npy`, global
/// ids) and returns the key of the relation its pairs belong to.
fn export_links(
    links: &grandis_store::LinkSplitView<'_>,
    types: &Types,
    dir: &AtomicDir,
    files: &mut Vec<String>,
) -> Result<String> {
    let pairs = links.part(grandis_store::LinkPart::Train);
    let relation = match pairs {
        [u, v, ..] => types.relation(types.type_of(*u), types.type_of(*v)),
        _ => None,
    };
    let Some(r) = relation else {
        return Err(ImportError::invalid(
            dir.target(),
            "the link split's training pairs join no relation's types",
        ));
    };
    crate::export::write_links(links, dir.path(), files)?;
    Ok(types.relation_keys()[r].clone())
}
