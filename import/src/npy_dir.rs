//! `--format npy`: a PyG-style directory of NumPy arrays.
//!
//! | file | dtype | shape | |
//! |---|---|---|---|
//! | `edge_index.npy` | int64 / int32 | (2, E) | row 0 sources, row 1 destinations |
//! | `x.npy` | float32 / float64 | (N, F) | features |
//! | `y.npy` | int64 / int32 | (N,) or (N, 1) | class, negative = unlabelled |
//! | `train_idx.npy`, `val_idx.npy`, `test_idx.npy` | int64 / int32, or bool (N,) masks | (n,) | optional split |
//!
//! | `link_train.npy`, `link_valid_pos.npy`, `link_valid_neg.npy`, `link_test_pos.npy`, `link_test_neg.npy` | int64 / int32 | (2, n) or (n, 2) | optional link split (`edge_index` is then the message-passing graph) |
//! | or OGB's names: `train_pos.npy`, `valid_pos.npy`, `valid_neg.npy`, `test_pos.npy`, `test_neg.npy` | int64 / int32 | (n, 2) or (2, n) | the same split as OGB's `get_edge_split()` gives it (`["train"]["edge"]`, `["valid"]["edge"]`, `["valid"]["edge_neg"]`, ...) |
//! | or OGB's per-source names (`ogbl-citation2`): `train_source_node.npy`, `train_target_node.npy`, `valid_source_node.npy`, `valid_target_node.npy`, `valid_target_node_neg.npy`, `test_source_node.npy`, `test_target_node.npy`, `test_target_node_neg.npy` | int64 / int32 | (n,), and (n, K) for `*_target_node_neg` | the split as `get_edge_split()` gives it for citation2 (`["valid"]["source_node"]`, ...): positive i is (source i, target i), its K negatives (source i, each of row i of the negatives) |
//! | `link_destinations.npy` | int64 / int32 | (2,) | optional: `[first, end)` of the ids the split's relation points at, where training negatives draw their destination |
//!
//! All three split files or none must be present, and all link files of one naming (five, or
//! eight per source) or none. With a link split, `y.npy` may be left out (a link-prediction dataset has no
//! labels). The held-out positives must not be edges of `edge_index` (OGB's graphs hold the
//! training edges only); the written dataset is verified for it. Arrays are memory-mapped, so
//! a multi-gigabyte `edge_index.npy` costs page cache, not heap.

use std::path::{Path, PathBuf};

use grandis_npy::{DType, NpyFile};
use grandis_telemetry::Progress;

use crate::error::{ImportError, Result};
use crate::{vertex_id, Ctx, Parts};

const ID_TYPES: &[DType] = &[DType::I64, DType::I32];

fn open(dir: &Path, name: &str, what: &str) -> Result<NpyFile> {
    let path = dir.join(name);
    if !path.exists() {
        return Err(ImportError::Missing {
            path,
            what: what.into(),
        });
    }
    Ok(NpyFile::open(path)?)
}

/// Integer array elements widened to i64, whatever the stored integer width.
fn ints(file: &NpyFile) -> Result<Vec<i64>> {
    Ok(match file.expect_dtype(ID_TYPES)? {
        DType::I64 => file.values::<i64>()?.into_owned(),
        _ => file.values::<i32>()?.iter().map(|&v| v as i64).collect(),
    })
}

pub(crate) fn import(ctx: &mut Ctx<'_>, dir: &Path) -> Result<Parts> {
    if !dir.is_dir() {
        return Err(ImportError::invalid(
            dir,
            "is not a directory; --format npy reads a directory of .npy files",
        ));
    }
    if crate::hetero::is_hetero(dir) {
        return crate::hetero::import(ctx, dir);
    }
    // Open (and so validate) everything before the long work, so that a missing or
    // malformed file is reported at once.
    let edge_file = open(dir, "edge_index.npy", "graph edges, shape (2, E)")?;
    let x_file = open(dir, "x.npy", "vertex features, shape (N, F)")?;
    let link_files = link_files(dir)?;
    // A link-prediction dataset needs no labels.
    let y_file = match (&link_files, dir.join("y.npy").exists()) {
        (Some(_), false) => None,
        _ => Some(open(dir, "y.npy", "vertex labels, shape (N,)")?),
    };
    let split_names = ["train_idx.npy", "val_idx.npy", "test_idx.npy"];
    let present: Vec<bool> = split_names.iter().map(|f| dir.join(f).exists()).collect();
    if present.iter().any(|&p| p) && !present.iter().all(|&p| p) {
        let missing = split_names[present.iter().position(|&p| !p).unwrap_or(0)];
        return Err(ImportError::Missing {
            path: dir.join(missing),
            what: "the other split files exist; give all three or none".into(),
        });
    }

    // Features decide the vertex count.
    let x_shape = x_file.expect_ndim(2)?.to_vec();
    let n = x_shape[0];
    let dim = x_shape[1];
    let x_path = x_file.path().display().to_string();
    write_features(ctx, &x_file)?;
    ctx.provenance.push(format!(
        "features: {n} x {dim} from x.npy ({})",
        x_file.dtype()
    ));
    drop(x_file);

    // Labels.
    let (labels, labels_path) = match y_file {
        Some(y_file) => read_labels(y_file, n)?,
        None => (vec![-1; n as usize], None),
    };

    // Edges.
    let shape = edge_file.expect_ndim(2)?;
    if shape[0] != 2 {
        return Err(ImportError::invalid(
            edge_file.path(),
            format!("shape is {shape:?}, expected (2, E): row 0 sources, row 1 destinations"),
        ));
    }
    let e = shape[1] as usize;
    let mut builder = ctx.edge_builder(Some(e))?;
    let source_of_n = format!("x.npy has {n} rows");
    let edge_path = edge_file.path().to_path_buf();
    let mut progress = Progress::new("edges", Some(e as u64));
    let mut push = |i: usize, src: i64, dst: i64| -> Result<()> {
        let err =
            |m: String| ImportError::invalid(&edge_path, format!("edge {i} ({src} -> {dst}): {m}"));
        let s = vertex_id(src, Some(n), &source_of_n).map_err(err)?;
        let d = vertex_id(dst, Some(n), &source_of_n).map_err(err)?;
        builder.push(s, d).map_err(|e| err(e.to_string()))
    };
    const CHUNK: usize = 1 << 20;
    match edge_file.expect_dtype(ID_TYPES)? {
        DType::I64 => {
            let m = edge_file.matrix::<i64>()?;
            for start in (0..e).step_by(CHUNK) {
                for i in start..(start + CHUNK).min(e) {
                    push(i, m.at(0, i), m.at(1, i))?;
                }
                progress.inc(((start + CHUNK).min(e) - start) as u64);
            }
        }
        _ => {
            let m = edge_file.matrix::<i32>()?;
            for start in (0..e).step_by(CHUNK) {
                for i in start..(start + CHUNK).min(e) {
                    push(i, m.at(0, i) as i64, m.at(1, i) as i64)?;
                }
                progress.inc(((start + CHUNK).min(e) - start) as u64);
            }
        }
    }
    progress.finish();
    drop(edge_file);
    let edges = builder
        .finish(Some(n))
        .map_err(|err| crate::edge_error(&edge_path, err))?;

    let link = match &link_files {
        Some(files) => Some(read_link_split(dir, n, files)?),
        None => None,
    };
    let split = if present[0] {
        let [train, val, test] = split_names.map(|name| read_split(dir, name, n));
        Some([train?, val?, test?])
    } else {
        None
    };
    Ok(Parts {
        input: PathBuf::from(x_path),
        edges,
        input_edges: e as u64,
        labels,
        labels_path,
        split,
        link,
        types: None,
    })
}

/// `y.npy`'s labels (one per row of `x.npy`, negative = unlabelled) and its path.
pub(crate) fn read_labels(y_file: NpyFile, n: u64) -> Result<(Vec<i32>, Option<PathBuf>)> {
    read_labels_of(y_file, n, "x.npy has")
}

/// [`read_labels`] for `n` vertices that `rows_of` names ("x.npy has").
pub(crate) fn read_labels_of(
    y_file: NpyFile,
    n: u64,
    rows_of: &str,
) -> Result<(Vec<i32>, Option<PathBuf>)> {
    let y_len = match y_file.shape() {
        [len] | [len, 1] => *len,
        other => {
            return Err(ImportError::invalid(
                y_file.path(),
                format!("shape is {other:?}, expected (N,) or (N, 1)"),
            ))
        }
    };
    if y_len != n {
        return Err(ImportError::invalid(
            y_file.path(),
            format!("has {y_len} labels, but {rows_of} {n} rows (vertices)"),
        ));
    }
    let labels = ints(&y_file)?
        .into_iter()
        .enumerate()
        .map(|(i, raw)| {
            crate::label_value(raw)
                .map_err(|m| ImportError::invalid(y_file.path(), format!("entry {i}: {m}")))
        })
        .collect::<Result<Vec<i32>>>()?;
    let labels_path = y_file.path().to_path_buf();
    Ok((labels, Some(labels_path)))
}

/// OGB's names of the five link arrays, in [`grandis_store::LinkPart::ALL`]'s order.
const OGB_LINK_NAMES: [&str; 5] = [
    "train_pos.npy",
    "valid_pos.npy",
    "valid_neg.npy",
    "test_pos.npy",
    "test_neg.npy",
];

/// OGB's per-source names (`ogbl-citation2`'s `get_edge_split()`), one array each: the
/// training sources and targets, then for validation and for test the sources, the targets
/// and the (n, K) negative targets of each source.
const OGB_SOURCE_NAMES: [&str; 8] = [
    "train_source_node.npy",
    "train_target_node.npy",
    "valid_source_node.npy",
    "valid_target_node.npy",
    "valid_target_node_neg.npy",
    "test_source_node.npy",
    "test_target_node.npy",
    "test_target_node_neg.npy",
];

/// The files of the link split a directory holds.
enum LinkFiles {
    /// Five pair arrays in [`grandis_store::LinkPart::ALL`]'s order: ours (what `grandis data
    /// export` writes, (2, n)) or OGB's (`by_row`: one pair a row).
    Pairs { names: Vec<String>, by_row: bool },
    /// OGB's per-source arrays ([`OGB_SOURCE_NAMES`]).
    PerSource,
}

/// The link split `dir` holds, if any: all files of one naming or none.
fn link_files(dir: &Path) -> Result<Option<LinkFiles>> {
    use grandis_store::LinkPart;
    let ours: Vec<String> = LinkPart::ALL
        .iter()
        .map(|&p| crate::export::link_npy_name(p))
        .collect();
    let owned = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let namings = [
        ("link_*.npy", ours),
        ("OGB's train_pos.npy, ...", owned(&OGB_LINK_NAMES)),
        ("OGB's train_source_node.npy, ...", owned(&OGB_SOURCE_NAMES)),
    ];
    let present: Vec<Vec<bool>> = namings
        .iter()
        .map(|(_, names)| names.iter().map(|f| dir.join(f).exists()).collect())
        .collect();
    let used: Vec<usize> = (0..namings.len())
        .filter(|&i| present[i].iter().any(|&p| p))
        .collect();
    let i = match used[..] {
        [] => return Ok(None),
        [i] => i,
        [a, b, ..] => {
            let first = present[b].iter().position(|&p| p).unwrap_or(0);
            return Err(ImportError::invalid(
                dir.join(&namings[b].1[first]),
                format!(
                    "the directory holds a link split under two namings ({} and {}): keep one",
                    namings[a].0, namings[b].0
                ),
            ));
        }
    };
    let names = &namings[i].1;
    if let Some(missing) = present[i].iter().position(|&p| !p) {
        return Err(ImportError::Missing {
            path: dir.join(&names[missing]),
            what: format!(
                "the other link split files exist; give all {} or none",
                if names.len() == 5 { "five" } else { "eight" }
            ),
        });
    }
    Ok(Some(match i {
        2 => LinkFiles::PerSource,
        _ => LinkFiles::Pairs {
            names: names.clone(),
            by_row: i == 1,
        },
    }))
}

/// The link split in `files` (see [`link_files`]).
fn read_link_split(dir: &Path, n: u64, files: &LinkFiles) -> Result<grandis_store::LinkSplit> {
    let parts = match files {
        LinkFiles::Pairs { names, by_row } => read_pair_arrays(dir, n, names, *by_row)?,
        LinkFiles::PerSource => read_per_source(dir, n)?,
    };
    let mut parts = parts.into_iter();
    let mut next = || parts.next().expect("five parts");
    Ok(grandis_store::LinkSplit {
        train: next(),
        valid_pos: next(),
        valid_neg: next(),
        test_pos: next(),
        test_neg: next(),
        destinations: read_link_destinations(dir, n)?,
    })
}

/// The five pair arrays `names` as flat (source, destination) lists; a square (2, 2) array is
/// read the way its naming lays pairs out (`by_row`: one pair a row).
fn read_pair_arrays(dir: &Path, n: u64, names: &[String], by_row: bool) -> Result<Vec<Vec<u32>>> {
    let mut parts: Vec<Vec<u32>> = Vec::with_capacity(5);
    for name in names {
        let file = open(dir, name, "link split pairs, shape (2, n) or (n, 2)")?;
        let given = match by_row {
            true => file.pairs_by_row()?,
            false => file.pairs()?,
        };
        let mut pairs = Vec::with_capacity(2 * given.len());
        for (i, (s, d)) in given.into_iter().enumerate() {
            for v in [s, d] {
                let id = vertex_id(v, Some(n), &format!("x.npy has {n} rows")).map_err(|m| {
                    ImportError::invalid(file.path(), format!("pair {i} ({s}, {d}): {m}"))
                })?;
                pairs.push(id);
            }
        }
        parts.push(pairs);
    }
    Ok(parts)
}

/// OGB's per-source arrays ([`OGB_SOURCE_NAMES`]) as the five pair lists: positive i of a
/// part is (source i, target i); its negatives, K per positive in the order of row i of the
/// part's negative targets, are (source i, each of them), grouped per positive as a dataset
/// keeps them (what MRR ranks each positive against).
fn read_per_source(dir: &Path, n: u64) -> Result<Vec<Vec<u32>>> {
    let source_of_n = format!("x.npy has {n} rows");
    // The ids of a (len,) or (len, K) array, checked against the vertices; its shape.
    let ids = |name: &str| -> Result<(Vec<u32>, Vec<u64>, PathBuf)> {
        let file = open(
            dir,
            name,
            "vertex ids, shape (n,) or, for negatives, (n, K)",
        )?;
        let shape = file.shape().to_vec();
        let values = ints(&file)?
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                vertex_id(v, Some(n), &source_of_n)
                    .map_err(|m| ImportError::invalid(file.path(), format!("entry {i}: {m}")))
            })
            .collect::<Result<Vec<u32>>>()?;
        Ok((values, shape, file.path().to_path_buf()))
    };
    let positives = |part: &str| -> Result<Vec<u32>> {
        let (src, src_shape, _) = ids(&format!("{part}_source_node.npy"))?;
        let (dst, dst_shape, dst_path) = ids(&format!("{part}_target_node.npy"))?;
        if src_shape.len() != 1 || dst_shape != src_shape {
            return Err(ImportError::invalid(
                dst_path,
                format!(
                    "shape {dst_shape:?} beside {part}_source_node.npy's {src_shape:?}: both                      must be (n,), one entry per positive"
                ),
            ));
        }
        Ok(src.iter().zip(&dst).flat_map(|(&s, &d)| [s, d]).collect())
    };
    let negatives = |part: &str, pos: &[u32]| -> Result<Vec<u32>> {
        let (neg, shape, path) = ids(&format!("{part}_target_node_neg.npy"))?;
        let count = pos.len() / 2;
        let k = match shape[..] {
            [rows, k] if rows as usize == count && k > 0 => k as usize,
            _ => {
                return Err(ImportError::invalid(
                    path,
                    format!(
                        "shape {shape:?}: expected ({count}, K), K >= 1 negative targets for                          each of the {count} sources of {part}_source_node.npy"
                    ),
                ))
            }
        };
        Ok(pos
            .chunks_exact(2)
            .zip(neg.chunks_exact(k))
            .flat_map(|(p, row)| row.iter().flat_map(move |&d| [p[0], d]))
            .collect())
    };
    let train = positives("train")?;
    let valid_pos = positives("valid")?;
    let valid_neg = negatives("valid", &valid_pos)?;
    let test_pos = positives("test")?;
    let test_neg = negatives("test", &test_pos)?;
    Ok(vec![train, valid_pos, valid_neg, test_pos, test_neg])
}

/// `link_destinations.npy`, when present: `[first, end)` of the vertices the split's
/// relation points at (absent: every vertex).
fn read_link_destinations(dir: &Path, n: u64) -> Result<Option<(u32, u32)>> {
    let name = crate::export::LINK_DESTINATIONS_NPY;
    if !dir.join(name).exists() {
        return Ok(None);
    }
    let file = open(
        dir,
        name,
        "the link relation's destination ids [first, end), shape (2,)",
    )?;
    let values: Vec<i64> = match (file.shape(), file.dtype()) {
        ([2], DType::I64) => file.values::<i64>()?.to_vec(),
        ([2], DType::I32) => file.values::<i32>()?.iter().map(|&v| v as i64).collect(),
        (shape, dtype) => {
            return Err(ImportError::invalid(
                file.path(),
                format!(
                    "{} of shape {shape:?}, expected two int64 [first, end)",
                    dtype.name()
                ),
            ))
        }
    };
    let (first, end) = (values[0], values[1]);
    if !(0 <= first && first < end && end as u64 <= n) {
        return Err(ImportError::invalid(
            file.path(),
            format!("[{first}, {end}) is not a non-empty range of the {n} vertices of x.npy"),
        ));
    }
    Ok(Some((first as u32, end as u32)))
}

/// Streams `x.npy` into the dataset's features, narrowing float64 and rejecting NaN/inf.
fn write_features(ctx: &mut Ctx<'_>, x: &NpyFile) -> Result<()> {
    let dim = x.shape()[1] as usize;
    let mut writer = ctx.writer.features_writer()?;
    let rows = x.shape()[0] as usize;
    let mut progress = Progress::new("features", Some(rows as u64));
    feature_rows(x, |r, row| {
        writer.push(row)?;
        if r % 65536 == 65535 {
            progress.inc(65536);
        }
        Ok(())
    })?;
    progress.inc(rows as u64 % 65536);
    progress.finish();
    ctx.writer.finish_features(writer, dim as u64)?;
    Ok(())
}

/// Every row of the feature matrix `x` (float32 or float64, N x F) as checked f32 values,
/// in order: a value that is not finite (or a float64 that overflows f32) is an error naming
/// the file and row.
pub(crate) fn feature_rows(
    x: &NpyFile,
    mut each: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let rows = x.shape()[0] as usize;
    let bad = |r: usize, m: String| ImportError::invalid(x.path(), format!("row {r}: {m}"));
    match x.expect_dtype(&[DType::F32, DType::F64])? {
        DType::F32 => {
            let m = x.matrix::<f32>()?;
            let mut buf = Vec::new();
            for r in 0..rows {
                let row = m.row(r, &mut buf);
                if let Some(&v) = row.iter().find(|v| !v.is_finite()) {
                    return Err(bad(r, format!("feature value {v} is not finite")));
                }
                each(r, row)?;
            }
        }
        _ => {
            let m = x.matrix::<f64>()?;
            let (mut buf, mut out) = (Vec::new(), Vec::with_capacity(x.shape()[1] as usize));
            for r in 0..rows {
                out.clear();
                for &v in m.row(r, &mut buf) {
                    out.push(crate::check_feature(v as f32, v).map_err(|msg| bad(r, msg))?);
                }
                each(r, &out)?;
            }
        }
    }
    Ok(())
}

/// A split file: vertex ids (int64/int32, shape (n,)) or a boolean mask of shape (N,).
fn read_split(dir: &Path, name: &str, n: u64) -> Result<(PathBuf, Vec<u32>)> {
    read_split_of(dir, name, n, "x.npy has")
}

/// [`read_split`] for `n` vertices that `rows_of` names ("x.npy has").
pub(crate) fn read_split_of(
    dir: &Path,
    name: &str,
    n: u64,
    rows_of: &str,
) -> Result<(PathBuf, Vec<u32>)> {
    let file = open(dir, name, "split vertex ids")?;
    let path = file.path().to_path_buf();
    let len = match file.shape() {
        [len] => *len,
        other => {
            return Err(ImportError::invalid(
                &path,
                format!("shape is {other:?}, expected (n,)"),
            ))
        }
    };
    if file.dtype() == DType::Bool {
        if len != n {
            return Err(ImportError::invalid(
                &path,
                format!("boolean mask has {len} entries, but {rows_of} {n} rows"),
            ));
        }
        let ids = file
            .bools()?
            .iter()
            .enumerate()
            .filter(|(_, &b)| b)
            .map(|(i, _)| i as u32)
            .collect();
        return Ok((path, ids));
    }
    file.expect_dtype(&[DType::I64, DType::I32, DType::Bool])?;
    let ids = ints(&file)?
        .into_iter()
        .enumerate()
        .map(|(i, raw)| {
            vertex_id(raw, Some(n), &format!("{rows_of} {n} rows"))
                .map_err(|m| ImportError::invalid(&path, format!("entry {i}: {m}")))
        })
        .collect::<Result<Vec<u32>>>()?;
    Ok((path, ids))
}
