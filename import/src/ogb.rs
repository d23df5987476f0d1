//! `--format ogb`: the raw layout of an OGB node-property-prediction dataset directory:
//!
//! ```text
//! raw/edge.csv.gz            src,dst per line (required)
//! raw/num-node-list.csv.gz   vertex count (optional; else from features/labels/edges)
//! raw/node-feat.csv.gz       one row of floats per vertex (optional)
//! raw/node-label.csv.gz      one label per vertex, `nan` = unlabelled (optional)
//! split/<name>/{train,valid,test}.csv.gz   vertex ids (optional; else a seeded split)
//! ```
//! Uncompressed `.csv` files are accepted in place of `.csv.gz`.

use std::path::{Path, PathBuf};

use crate::edgelist::{read_id_lines, read_label_lines, write_feature_table, write_no_features};
use crate::error::{ImportError, Result};
use crate::text::{self, Delimiter, Lines};
use crate::{vertex_id, Ctx, Parts};

/// `dir/stem.csv.gz`, or `dir/stem.csv` when only that exists.
fn table(dir: &Path, stem: &str) -> PathBuf {
    let gz = dir.join(format!("{stem}.csv.gz"));
    let plain = dir.join(format!("{stem}.csv"));
    if !gz.exists() && plain.exists() {
        plain
    } else {
        gz
    }
}

pub(crate) fn import(ctx: &mut Ctx<'_>, input: &Path) -> Result<Parts> {
    let raw = input.join("raw");
    if !raw.is_dir() {
        return Err(ImportError::Missing {
            path: raw,
            what: "the raw/ directory of an OGB dataset".into(),
        });
    }
    let mut n: Option<(u64, PathBuf)> = None;
    let mut agree = |count: u64, path: &Path, what: &str| -> Result<()> {
        match &n {
            Some((m, src)) if *m != count => Err(ImportError::invalid(
                path,
                format!(
                    "has {count} {what}, but {} says there are {m} vertices",
                    src.display()
                ),
            )),
            Some(_) => Ok(()),
            None => {
                n = Some((count, path.to_path_buf()));
                Ok(())
            }
        }
    };

    let count_path = table(&raw, "num-node-list");
    if count_path.exists() {
        let mut lines = Lines::open(&count_path, "vertex count")?;
        if !lines.advance()? {
            return Err(ImportError::invalid(&count_path, "is empty"));
        }
        let count = text::parse_int(lines.line()).map_err(|m| lines.error(m))?;
        if count < 0 {
            return Err(lines.error(format!("negative vertex count {count}")));
        }
        if lines.advance()? {
            return Err(lines.error(
                "more than one graph listed; only single-graph (node prediction) datasets are supported",
            ));
        }
        agree(count as u64, &count_path, "as vertex count")?;
    }

    let feat_path = table(&raw, "node-feat");
    if feat_path.exists() {
        let (rows, dim) =
            write_feature_table(ctx, &feat_path, Some(Delimiter::Char(',')), "node features")?;
        agree(rows, &feat_path, "feature rows")?;
        ctx.provenance.push(format!("features: {rows} x {dim}"));
    } else {
        write_no_features(ctx)?;
    }

    let label_path = table(&raw, "node-label");
    let labels = if label_path.exists() {
        let labels = read_label_lines(&label_path, "node labels", true)?;
        agree(labels.len() as u64, &label_path, "labels")?;
        Some(labels)
    } else {
        None
    };

    let edge_path = table(&raw, "edge");
    let mut lines = Lines::open(&edge_path, "the edge list of an OGB dataset")?;
    let bound = n.as_ref().map(|(c, _)| *c);
    let src_of_n = n
        .as_ref()
        .map_or(String::new(), |(_, p)| p.display().to_string());
    let mut builder = ctx.edge_builder(None)?;
    let read = text::read_edge_lines(&mut lines, &mut builder, |line| {
        let mut fields = line.split(',').map(str::trim);
        let (Some(a), Some(b), None) = (fields.next(), fields.next(), fields.next()) else {
            let count = line.split(',').count();
            return Err(format!("{count} field(s); expected `src,dst` (ragged row)"));
        };
        let src = text::parse_int(a).and_then(|v| vertex_id(v, bound, &src_of_n))?;
        let dst = text::parse_int(b).and_then(|v| vertex_id(v, bound, &src_of_n))?;
        Ok(Some((src, dst)))
    })?;
    let edges = builder
        .finish(bound)
        .map_err(|e| crate::edge_error(&edge_path, e))?;
    let vertices = edges.num_vertices();
    let labels_path = labels.as_ref().map(|_| label_path);
    let labels = labels.unwrap_or_else(|| vec![-1; vertices as usize]);

    let split = match split_dir(input, ctx.options.split_name.as_deref())? {
        Some(dir) => {
            ctx.provenance
                .push(format!("split: OGB split directory {}", dir.display()));
            Some([
                read_id_lines(&table(&dir, "train"), vertices, "training split")?,
                read_id_lines(&table(&dir, "valid"), vertices, "validation split")?,
                read_id_lines(&table(&dir, "test"), vertices, "test split")?,
            ])
        }
        None => None,
    };
    Ok(Parts {
        input: edge_path,
        edges,
        input_edges: read,
        labels,
        labels_path,
        split,
        link: None,
        types: None,
    })
}

/// `split/<name>`: the requested one, the only one, or none when there is no `split/`.
fn split_dir(input: &Path, wanted: Option<&str>) -> Result<Option<PathBuf>> {
    let root = input.join("split");
    if let Some(name) = wanted {
        let dir = root.join(name);
        if !dir.is_dir() {
            return Err(ImportError::Missing {
                path: dir,
                what: "the split directory named by --split-name".into(),
            });
        }
        return Ok(Some(dir));
    }
    if !root.is_dir() {
        return Ok(None);
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .map_err(|e| ImportError::io(&root, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    match dirs.len() {
        0 => Ok(None),
        1 => Ok(dirs.pop()),
        _ => {
            let names: Vec<String> = dirs
                .iter()
                .filter_map(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect();
            Err(ImportError::invalid(
                &root,
                format!(
                    "holds several splits ({}); choose one with --split-name",
                    names.join(", ")
                ),
            ))
        }
    }
}
