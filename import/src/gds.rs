//! `--format parquet`: a Neo4j Graph Data Science export, as shipped for Cora in the
//! `graphdatascience` Python package: a directory with a nodes table (`*nodes*.parquet*`:
//! `nodeId`, a label property such as `subject`, a `features` list) and a relationships table
//! (`*rels*.parquet*`: `sourceNodeId`, `targetNodeId`). Node ids are arbitrary integers; they
//! become `0..N-1` in node-table order. Only the needed columns are decoded (projection),
//! one row group at a time.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use grandis_telemetry::Progress;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::reader::RowIter;
use parquet::record::{Field, Row};
use parquet::schema::types::Type;

use crate::error::{ImportError, Result};
use crate::{Ctx, Parts};

const NODE_ID: &str = "nodeId";
const SOURCE: &str = "sourceNodeId";
const TARGET: &str = "targetNodeId";
const DEFAULT_LABEL: &str = "subject";
const DEFAULT_FEATURES: &str = "features";

fn pq_err(path: &Path, e: impl std::fmt::Display) -> ImportError {
    ImportError::invalid(path, format!("cannot read Parquet: {e}"))
}

/// The single file in `dir` whose name contains one of `keys` and `.parquet`.
pub(crate) fn find_table(dir: &Path, keys: &[&str], what: &str) -> Result<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ImportError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().to_lowercase())
                .unwrap_or_default();
            p.is_file() && name.contains(".parquet") && keys.iter().any(|k| name.contains(k))
        })
        .collect();
    found.sort();
    match found.len() {
        1 => Ok(found.pop().expect("one")),
        0 => Err(ImportError::Missing {
            path: dir.join(format!("*{}*.parquet*", keys[0])),
            what: what.into(),
        }),
        _ => Err(ImportError::invalid(
            dir,
            format!(
                "several {what} files match: {}",
                found
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// An opened table and the projection of the wanted columns (those that exist).
pub(crate) struct Table {
    path: PathBuf,
    reader: SerializedFileReader<File>,
    projection: Type,
    columns: Vec<String>,
}

impl Table {
    pub(crate) fn open(path: &Path) -> Result<Table> {
        let file = File::open(path).map_err(|e| ImportError::io(path, e))?;
        let reader = SerializedFileReader::new(file).map_err(|e| pq_err(path, e))?;
        let root = reader.metadata().file_metadata().schema();
        let columns = root
            .get_fields()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        Ok(Table {
            path: path.to_path_buf(),
            projection: root.clone(),
            reader,
            columns,
        })
    }

    fn has(&self, column: &str) -> bool {
        self.columns.iter().any(|c| c == column)
    }

    pub(crate) fn require(&self, column: &str) -> Result<()> {
        if self.has(column) {
            return Ok(());
        }
        Err(ImportError::invalid(
            &self.path,
            format!(
                "has no column {column:?} (columns: {})",
                self.columns.join(", ")
            ),
        ))
    }

    /// Restricts decoding to `wanted` columns.
    pub(crate) fn project(&mut self, wanted: &[&str]) -> Result<()> {
        let root = self.reader.metadata().file_metadata().schema();
        let fields: Vec<Arc<Type>> = root
            .get_fields()
            .iter()
            .filter(|f| wanted.contains(&f.name()))
            .cloned()
            .collect();
        self.projection = Type::group_type_builder(root.name())
            .with_fields(fields)
            .build()
            .map_err(|e| pq_err(&self.path, e))?;
        Ok(())
    }

    pub(crate) fn num_rows(&self) -> u64 {
        self.reader.metadata().file_metadata().num_rows().max(0) as u64
    }

    /// Calls `f` with every row (0-based index), one row group at a time.
    pub(crate) fn for_each_row(&self, mut f: impl FnMut(u64, &Row) -> Result<()>) -> Result<()> {
        let mut index = 0u64;
        for g in 0..self.reader.num_row_groups() {
            let group = self
                .reader
                .get_row_group(g)
                .map_err(|e| pq_err(&self.path, e))?;
            let rows = RowIter::from_row_group(Some(self.projection.clone()), group.as_ref())
                .map_err(|e| pq_err(&self.path, e))?;
            for row in rows {
                let row = row.map_err(|e| pq_err(&self.path, format!("row {index}: {e}")))?;
                f(index, &row)?;
                index += 1;
            }
        }
        Ok(())
    }

    pub(crate) fn row_error(&self, row: u64, message: impl std::fmt::Display) -> ImportError {
        ImportError::invalid(&self.path, format!("row {row}: {message}"))
    }

    /// Row `i`'s integer cell of column `name`, which must not be null.
    pub(crate) fn int_cell(&self, i: u64, row: &Row, name: &str) -> Result<i64> {
        int_of(column(row, name))
            .map_err(|m| self.row_error(i, format!("{name}: {m}")))?
            .ok_or_else(|| self.row_error(i, format!("{name} is null")))
    }

    /// Row `i`'s label cell of column `name` as a class ([`crate::label_value`]); -1 for null
    /// (an unlabelled vertex).
    pub(crate) fn label_cell(&self, i: u64, row: &Row, name: &str) -> Result<i32> {
        let err = |m: String| self.row_error(i, format!("{name}: {m}"));
        match int_of(column(row, name)).map_err(err)? {
            Some(raw) => crate::label_value(raw).map_err(err),
            None => Ok(-1),
        }
    }
}

/// The dense id the next new node gets: how many `ids` holds, within the store's vertex limit.
pub(crate) fn next_dense_id(ids: &HashMap<i64, u32>) -> Result<u32, String> {
    u32::try_from(ids.len())
        .ok()
        .filter(|&d| (d as u64) < grandis_store::MAX_VERTICES)
        .ok_or_else(|| "too many nodes for u32 vertex ids".into())
}

pub(crate) fn column<'r>(row: &'r Row, name: &str) -> Option<&'r Field> {
    row.get_column_iter()
        .find(|(n, _)| n.as_str() == name)
        .map(|(_, f)| f)
}

/// An integer cell; `Ok(None)` for null.
pub(crate) fn int_of(field: Option<&Field>) -> Result<Option<i64>, String> {
    Ok(Some(match field {
        None | Some(Field::Null) => return Ok(None),
        Some(Field::Byte(v)) => *v as i64,
        Some(Field::Short(v)) => *v as i64,
        Some(Field::Int(v)) => *v as i64,
        Some(Field::Long(v)) => *v,
        Some(Field::UByte(v)) => *v as i64,
        Some(Field::UShort(v)) => *v as i64,
        Some(Field::UInt(v)) => *v as i64,
        Some(Field::ULong(v)) => {
            i64::try_from(*v).map_err(|_| format!("value {v} is too large"))?
        }
        Some(other) => return Err(format!("expected an integer, found {other}")),
    }))
}

fn float_of(field: &Field) -> Result<f64, String> {
    Ok(match field {
        Field::Bool(b) => *b as u8 as f64,
        Field::Float(v) => *v as f64,
        Field::Double(v) => *v,
        Field::Null => return Err("null feature value".into()),
        other => match int_of(Some(other))? {
            Some(v) => v as f64,
            None => return Err("null feature value".into()),
        },
    })
}

/// Row `row`'s feature cell of column `c` into `out` (cleared first): a list of numbers, or a
/// single number as a 1-dimensional vector, as wide as every row before it (`width`, set by
/// the first); a null cell or value, a value beyond `f32` or a ragged row is an error naming
/// the column.
pub(crate) fn feature_row(
    row: &Row,
    c: &str,
    width: &mut Option<usize>,
    out: &mut Vec<f32>,
) -> Result<(), String> {
    out.clear();
    let mut push = |v: &Field| -> Result<(), String> {
        let raw = float_of(v).map_err(|m| format!("{c}: {m}"))?;
        out.push(crate::check_feature(raw as f32, raw).map_err(|m| format!("{c}: {m}"))?);
        Ok(())
    };
    match column(row, c) {
        Some(Field::ListInternal(list)) => list.elements().iter().try_for_each(push)?,
        Some(Field::Null) | None => return Err(format!("{c} is null")),
        Some(other) => push(other)?,
    }
    match *width {
        None => *width = Some(out.len()),
        Some(d) if d != out.len() => {
            return Err(format!(
                "{c} has {} values, but earlier rows have {d} (ragged rows)",
                out.len()
            ))
        }
        Some(_) => {}
    }
    Ok(())
}

/// The (source, target) dense pairs of a relationship table, each end looked up in `ids` and
/// required to fall in its range (`sources`, `targets`: the range and what its vertices are,
/// for the error).
pub(crate) fn id_pairs(
    path: &Path,
    ids: &HashMap<i64, u32>,
    (sources, source_what): (Range<u32>, &str),
    (targets, target_what): (Range<u32>, &str),
) -> Result<Vec<(u32, u32)>> {
    let mut table = Table::open(path)?;
    table.require(SOURCE)?;
    table.require(TARGET)?;
    table.project(&[SOURCE, TARGET])?;
    let mut out = Vec::with_capacity(table.num_rows() as usize);
    table.for_each_row(|i, row| {
        let end = |name: &str, range: &Range<u32>, what: &str| -> Result<u32> {
            let raw = table.int_cell(i, row, name)?;
            ids.get(&raw)
                .copied()
                .filter(|v| range.contains(v))
                .ok_or_else(|| table.row_error(i, format!("{name} {raw} is not a {what}")))
        };
        out.push((
            end(SOURCE, &sources, source_what)?,
            end(TARGET, &targets, target_what)?,
        ));
        Ok(())
    })?;
    Ok(out)
}

pub(crate) fn import(ctx: &mut Ctx<'_>, dir: &Path) -> Result<Parts> {
    if !dir.is_dir() {
        return Err(ImportError::invalid(
            dir,
            "is not a directory; --format parquet reads a directory holding *nodes*.parquet* and *rels*.parquet*",
        ));
    }
    let nodes_path = find_table(dir, &["nodes"], "nodes table")?;
    let rels_path = find_table(dir, &["rels", "relationships"], "relationships table")?;
    let o = ctx.options;

    let mut nodes = Table::open(&nodes_path)?;
    nodes.require(NODE_ID)?;
    // Explicitly named columns must exist; the defaults are used only when present.
    let label_col = match &o.label_column {
        Some(c) => {
            nodes.require(c)?;
            Some(c.as_str())
        }
        None => nodes.has(DEFAULT_LABEL).then_some(DEFAULT_LABEL),
    };
    let feat_col = match &o.features_column {
        Some(c) => {
            nodes.require(c)?;
            Some(c.as_str())
        }
        None => nodes.has(DEFAULT_FEATURES).then_some(DEFAULT_FEATURES),
    };
    let mut wanted = vec![NODE_ID];
    wanted.extend(label_col);
    wanted.extend(feat_col);
    nodes.project(&wanted)?;

    let total = nodes.num_rows();
    let mut ids: HashMap<i64, u32> = HashMap::with_capacity(total as usize);
    let mut labels: Vec<i32> = Vec::with_capacity(total as usize);
    let mut features = ctx.writer.features_writer()?;
    let mut dim = None::<usize>;
    let mut row_buf: Vec<f32> = Vec::new();
    let mut progress = Progress::new("nodes", Some(total));
    nodes.for_each_row(|i, row| {
        let err = |m: String| nodes.row_error(i, m);
        let id = nodes.int_cell(i, row, NODE_ID)?;
        let dense = next_dense_id(&ids).map_err(err)?;
        if let Some(prev) = ids.insert(id, dense) {
            return Err(err(format!(
                "{NODE_ID} {id} appears twice (first as row {prev})"
            )));
        }
        labels.push(match label_col {
            Some(c) => nodes.label_cell(i, row, c)?,
            None => -1,
        });
        if let Some(c) = feat_col {
            feature_row(row, c, &mut dim, &mut row_buf).map_err(err)?;
            features.push(&row_buf)?;
        }
        progress.inc(1);
        Ok(())
    })?;
    progress.finish();
    let n = ids.len() as u64;
    let dim = dim.unwrap_or(0) as u64;
    ctx.writer.finish_features(features, dim)?;
    ctx.provenance.push(format!(
        "nodes: {n} from {} ({NODE_ID} mapped to dense ids 0..={} in table order); labels from {}; features: {} x {dim} from {}",
        nodes_path.display(),
        n.saturating_sub(1),
        label_col.unwrap_or("(none)"),
        n,
        feat_col.unwrap_or("(none)")
    ));
    drop(nodes);

    let mut rels = Table::open(&rels_path)?;
    rels.require(SOURCE)?;
    rels.require(TARGET)?;
    rels.project(&[SOURCE, TARGET])?;
    let total = rels.num_rows();
    let mut builder = ctx.edge_builder(Some(total as usize))?;
    let mut progress = Progress::new("relationships", Some(total));
    let mut read = 0u64;
    rels.for_each_row(|i, row| {
        let end = |name: &str| -> Result<u32> {
            let raw = rels.int_cell(i, row, name)?;
            ids.get(&raw).copied().ok_or_else(|| {
                rels.row_error(
                    i,
                    format!(
                        "{name} {raw} is not a {NODE_ID} of the nodes table {}",
                        nodes_path.display()
                    ),
                )
            })
        };
        let src = end(SOURCE)?;
        let dst = end(TARGET)?;
        builder
            .push(src, dst)
            .map_err(|e| rels.row_error(i, e.to_string()))?;
        read += 1;
        progress.inc(1);
        Ok(())
    })?;
    progress.finish();
    drop(ids);
    let edges = builder
        .finish(Some(n))
        .map_err(|e| crate::edge_error(&rels_path, e))?;
    Ok(Parts {
        input: nodes_path.clone(),
        edges,
        input_edges: read,
        labels,
        labels_path: Some(nodes_path),
        split: None,
        link: None,
        types: None,
    })
}
