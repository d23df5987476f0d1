//! `--format edgelist`: a CSV/TSV/whitespace edge list (`src dst [ignored columns...]`),
//! plus an optional features file (one row of numbers per vertex) and labels file (one
//! integer per line). Also home of the table readers the OGB importer shares.

use std::path::{Path, PathBuf};

use grandis_telemetry::Progress;

use crate::error::{ImportError, Result};
use crate::text::{self, Delimiter, Lines};
use crate::{vertex_id, Ctx, Parts};

pub(crate) fn import(ctx: &mut Ctx<'_>, input: &Path) -> Result<Parts> {
    let o = ctx.options;
    if input.is_dir() {
        return Err(ImportError::invalid(
            input,
            "is a directory; --format edgelist reads one edge-list file",
        ));
    }
    // Vertex count: every source that states one must agree.
    let mut n: Option<(u64, String)> = o.num_vertices.map(|n| (n, "--num-vertices".into()));
    let mut agree = |count: u64, path: &Path, what: &str| -> Result<()> {
        match &n {
            Some((m, src)) if *m != count => Err(ImportError::invalid(
                path,
                format!("has {count} {what}, but {src} says there are {m} vertices"),
            )),
            Some(_) => Ok(()),
            None => {
                n = Some((count, path.display().to_string()));
                Ok(())
            }
        }
    };
    match &o.features {
        Some(path) => {
            let (rows, dim) = write_feature_table(ctx, path, o.delimiter, "--features file")?;
            agree(rows, path, "feature rows")?;
            ctx.provenance
                .push(format!("features: {rows} x {dim} from {}", path.display()));
        }
        None => write_no_features(ctx)?,
    }
    let labels = match &o.labels {
        Some(path) => {
            let labels = read_label_lines(path, "--labels file", false)?;
            agree(labels.len() as u64, path, "labels")?;
            Some(labels)
        }
        None => None,
    };
    let known = n.clone();

    let mut lines = Lines::open(input, "the edge list")?;
    let mut builder = ctx.edge_builder(None)?;
    let mut delimiter = o.delimiter;
    let mut columns = None::<usize>;
    let mut first = true;
    let read = text::read_edge_lines(&mut lines, &mut builder, |line| {
        let d = *delimiter.get_or_insert_with(|| Delimiter::detect(line));
        if first {
            first = false;
            if o.header || !text::is_numeric_line(line, d) {
                tracing::info!("{}: skipping header line {:?}", input.display(), line);
                return Ok(None);
            }
        }
        let mut count = 0usize;
        let mut ids = [0i64; 2];
        for field in d.fields(line) {
            if count < 2 {
                ids[count] = text::parse_int(field)?;
            }
            count += 1;
        }
        if count < 2 {
            return Err(format!(
                "{count} field(s); an edge needs a source and a destination (delimiter: {d})"
            ));
        }
        match columns {
            None => columns = Some(count),
            Some(c) if c != count => {
                return Err(format!(
                    "{count} fields, but earlier lines have {c} (ragged rows)"
                ))
            }
            Some(_) => {}
        }
        let bound = known.as_ref().map(|(n, _)| *n);
        let src_of_n = known.as_ref().map_or("", |(_, s)| s.as_str());
        let src = vertex_id(ids[0], bound, src_of_n)?;
        let dst = vertex_id(ids[1], bound, src_of_n)?;
        Ok(Some((src, dst)))
    })?;
    if let Some(c) = columns.filter(|&c| c > 2) {
        ctx.provenance.push(format!(
            "edge list: {} extra column(s) per line ignored",
            c - 2
        ));
    }
    let num_vertices = known.as_ref().map(|(n, _)| *n);
    let edges = builder
        .finish(num_vertices)
        .map_err(|e| crate::edge_error(input, e))?;
    let n = edges.num_vertices();
    let labels_path = o.labels.clone();
    let labels = labels.unwrap_or_else(|| vec![-1; n as usize]);
    Ok(Parts {
        input: input.to_path_buf(),
        edges,
        input_edges: read,
        labels,
        labels_path,
        split: None,
        link: None,
        types: None,
    })
}

/// Records an empty feature matrix (a graph without vertex features).
pub(crate) fn write_no_features(ctx: &mut Ctx<'_>) -> Result<()> {
    let w = ctx.writer.features_writer()?;
    ctx.writer.finish_features(w, 0)?;
    ctx.provenance.push("features: none".into());
    Ok(())
}

/// Streams a table of numbers (one row per vertex) into the dataset's features file.
/// Returns `(rows, columns)`. A non-numeric first line is taken as a header.
pub(crate) fn write_feature_table(
    ctx: &mut Ctx<'_>,
    path: &Path,
    delimiter: Option<Delimiter>,
    what: &str,
) -> Result<(u64, u64)> {
    let mut lines = Lines::open(path, what)?;
    let mut writer = ctx.writer.features_writer()?;
    let mut dim = None::<usize>;
    let mut delimiter = delimiter;
    let mut row = Vec::new();
    let mut rows = 0u64;
    let mut first = true;
    let mut progress = Progress::new("features", None);
    while lines.advance()? {
        let line = lines.line();
        let d = *delimiter.get_or_insert_with(|| Delimiter::detect(line));
        if std::mem::take(&mut first) && !text::is_numeric_line(line, d) {
            continue;
        }
        row.clear();
        for field in d.fields(line) {
            row.push(text::parse_feature(field).map_err(|m| lines.error(m))?);
        }
        match dim {
            None => dim = Some(row.len()),
            Some(f) if f != row.len() => {
                return Err(lines.error(format!(
                    "{} values, but earlier rows have {f} (ragged rows)",
                    row.len()
                )))
            }
            Some(_) => {}
        }
        writer.push(&row)?;
        rows += 1;
        if rows.is_multiple_of(65536) {
            progress.inc(65536);
        }
    }
    progress.inc(rows % 65536);
    progress.finish();
    let dim = dim.unwrap_or(0) as u64;
    ctx.writer.finish_features(writer, dim)?;
    Ok((rows, dim))
}

/// Reads one label per line. Negative labels (and, when `nan_unlabelled`, `nan` or an
/// empty field) mean "unlabelled". A line with several fields is an error: only
/// single-label classification is supported.
pub(crate) fn read_label_lines(path: &Path, what: &str, nan_unlabelled: bool) -> Result<Vec<i32>> {
    let mut lines = Lines::open(path, what)?;
    let mut labels = Vec::new();
    let mut first = true;
    while lines.advance()? {
        let line = lines.line();
        let d = Delimiter::detect(line);
        let fields: Vec<&str> = d.fields(line).collect();
        if fields.len() != 1 {
            return Err(lines.error(format!(
                "{} fields; expected one label per line (multi-label data is not supported)",
                fields.len()
            )));
        }
        let field = fields[0];
        if nan_unlabelled && field.eq_ignore_ascii_case("nan") {
            labels.push(-1);
            continue;
        }
        let value = match text::parse_int(field) {
            Ok(v) => v,
            // A non-numeric first line is a header ("label", "y", ...).
            Err(_) if std::mem::take(&mut first) && field.parse::<f64>().is_err() => continue,
            Err(m) => return Err(lines.error(m)),
        };
        first = false;
        labels.push(crate::label_value(value).map_err(|m| lines.error(m))?);
    }
    Ok(labels)
}

/// Reads a list of vertex ids (one per line), checking each against `n`.
pub(crate) fn read_id_lines(path: &Path, n: u64, what: &str) -> Result<(PathBuf, Vec<u32>)> {
    let mut lines = Lines::open(path, what)?;
    let mut ids = Vec::new();
    while lines.advance()? {
        let line = lines.line();
        let raw = text::parse_int(line).map_err(|m| lines.error(m))?;
        ids.push(vertex_id(raw, Some(n), "the vertex count").map_err(|m| lines.error(m))?);
    }
    Ok((path.to_path_buf(), ids))
}
