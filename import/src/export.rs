//! The other direction: a grandis dataset written in the PyG layout that
//! [`Format::Npy`](crate::Format::Npy) reads, so baselines (PyG, DGL, plain NumPy) train on
//! exactly the data grandis trains on.
//!
//! | file | dtype | shape | contents |
//! |---|---|---|---|
//! | `edge_index.npy` | int64 | (2, E) | row 0 sources, row 1 destinations |
//! | `x.npy` | float32 | (N, F) | features |
//! | `y.npy` | int64 | (N,) | class, -1 = unlabelled |
//! | `train_idx.npy`, `val_idx.npy`, `test_idx.npy` | int64 | (n,) | vertex ids |
//! | `link_train.npy`, `link_valid_pos.npy`, `link_valid_neg.npy`, `link_test_pos.npy`, `link_test_neg.npy` | int64 | (2, n) | a link split's pairs (row 0 sources, row 1 destinations, as PyG's `edge_label_index`), when the dataset has one |
//!
//! A typed dataset is written in PyG's `HeteroData` layout instead (`x_{type}.npy`,
//! `edge_index_{src}__{rel}__{dst}.npy`, the target's `y.npy` and splits, `hetero.json`:
//! see `crate::hetero`).
//!
//! Edges are streamed from the CSR in chunks (never 16 bytes per edge in memory), and the
//! directory appears only once every file is complete ([`AtomicDir`]).

use std::path::{Path, PathBuf};

use grandis_store::{AtomicDir, DatasetView};

use crate::error::{ImportError, Result};

/// Vertices whose edges go out per chunk of `edge_index.npy`.
const EDGE_CHUNK_VERTICES: usize = 1 << 16;

/// What [`export_npy`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSummary {
    pub out: PathBuf,
    pub vertices: u64,
    pub edges: u64,
    pub features: u64,
    pub files: Vec<String>,
}

/// Writes `view` into the directory `out` in the PyG layout (see the module doc). An
/// existing `out` is refused unless `overwrite`; on any error nothing is left behind.
pub fn export_npy(view: &DatasetView<'_>, out: &Path, overwrite: bool) -> Result<ExportSummary> {
    let dir = AtomicDir::create(out, overwrite)?;
    if let Some(types) = view.types {
        // A typed dataset goes out in PyG's HeteroData layout (`crate::hetero`).
        let files = crate::hetero::export(view, types, &dir)?;
        let out = dir.commit().map_err(ImportError::from)?;
        return Ok(ExportSummary {
            out,
            vertices: view.num_vertices() as u64,
            edges: view.graph.num_edges() as u64,
            features: view.feature_dim as u64,
            files,
        });
    }
    let p = |name: &str| dir.path().join(name);
    let g = &view.graph;
    let (n, e) = (g.num_vertices(), g.num_edges() as u64);
    // Row 0: the sources, which are the CSR's indices in order; row 1: each row's vertex,
    // repeated once per in-edge.
    grandis_npy::write_npy_streamed::<i64>(p("edge_index.npy"), &[2, e], |write| {
        let mut buf: Vec<i64> = Vec::new();
        for chunk in g.indices.chunks(EDGE_CHUNK_VERTICES * 16) {
            buf.clear();
            buf.extend(chunk.iter().map(|&u| u as i64));
            write(&buf)?;
        }
        for first in (0..n).step_by(EDGE_CHUNK_VERTICES) {
            buf.clear();
            for v in first..(first + EDGE_CHUNK_VERTICES).min(n) {
                let deg = (g.offsets[v + 1] - g.offsets[v]) as usize;
                buf.extend(std::iter::repeat_n(v as i64, deg));
            }
            write(&buf)?;
        }
        Ok(())
    })?;
    grandis_npy::write_npy(
        p("x.npy"),
        &[n as u64, view.feature_dim as u64],
        view.features,
    )?;
    let labels: Vec<i64> = view.labels.iter().map(|&l| l as i64).collect();
    grandis_npy::write_npy(p("y.npy"), &[n as u64], &labels)?;
    for (name, ids) in [
        ("train_idx.npy", view.train),
        ("val_idx.npy", view.val),
        ("test_idx.npy", view.test),
    ] {
        let ids: Vec<i64> = ids.iter().map(|&v| v as i64).collect();
        grandis_npy::write_npy(p(name), &[ids.len() as u64], &ids)?;
    }
    let mut files: Vec<String> = [
        "edge_index.npy",
        "x.npy",
        "y.npy",
        "train_idx.npy",
        "val_idx.npy",
        "test_idx.npy",
    ]
    .map(String::from)
    .to_vec();
    if let Some(links) = &view.links {
        write_links(links, dir.path(), &mut files)?;
    }
    let out = dir.commit().map_err(ImportError::from)?;
    Ok(ExportSummary {
        out,
        vertices: n as u64,
        edges: e,
        features: view.feature_dim as u64,
        files,
    })
}

/// Writes a link split's parts into `dir` (int64, 2 x n: row 0 sources, row 1 destinations,
/// global ids) and its destinations when it names them, adding their names to `files`.
pub(crate) fn write_links(
    links: &grandis_store::LinkSplitView<'_>,
    dir: &Path,
    files: &mut Vec<String>,
) -> Result<()> {
    for part in grandis_store::LinkPart::ALL {
        let name = link_npy_name(part);
        let pairs = links.part(part);
        let (sources, destinations): (Vec<i64>, Vec<i64>) = pairs
            .chunks_exact(2)
            .map(|p| (p[0] as i64, p[1] as i64))
            .unzip();
        let both: Vec<i64> = sources.into_iter().chain(destinations).collect();
        grandis_npy::write_npy(dir.join(&name), &[2, (pairs.len() / 2) as u64], &both)?;
        files.push(name);
    }
    if let Some((first, end)) = links.destinations {
        let path = dir.join(LINK_DESTINATIONS_NPY);
        grandis_npy::write_npy(path, &[2], &[first as i64, end as i64])?;
        files.push(LINK_DESTINATIONS_NPY.into());
    }
    Ok(())
}

/// `[first, end)` of the vertices a link split's relation points at (its training negatives'
/// destinations), when the split names them: int64, shape (2,).
pub(crate) const LINK_DESTINATIONS_NPY: &str = "link_destinations.npy";

/// The `.npy` file of a link split's part: its dataset file's name with `.npy`
/// (`link_valid_pos.pairs` → `link_valid_pos.npy`).
pub fn link_npy_name(part: grandis_store::LinkPart) -> String {
    part.file().replace(".pairs", ".npy")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{import, Format, ImportOptions};
    use grandis_store::{Dataset, EdgeOptions, InMemoryDataset, SelfLoops, Split};

    fn small() -> InMemoryDataset {
        let edges = vec![(0, 1), (1, 0), (2, 1), (3, 3), (1, 4), (4, 2)];
        let graph = grandis_store::graph_from_edges(
            5,
            edges,
            EdgeOptions {
                symmetrize: false,
                self_loops: SelfLoops::Keep,
            },
        )
        .unwrap();
        InMemoryDataset {
            name: "small".into(),
            graph,
            features: (0..15).map(|i| i as f32 * 0.5 - 3.0).collect(),
            feature_dim: 3,
            labels: vec![0, 1, -1, 2, 1],
            num_classes: 3,
            split: Split {
                train: vec![0, 3],
                val: vec![1],
                test: vec![4],
            },
            types: None,
        }
    }

    /// import -> export -> import: the second import is the same dataset (graph, features,
    /// labels, split), for a graph with a self-loop, an unlabelled vertex and a vertex with
    /// no in-edges.
    #[test]
    fn round_trip_gives_the_same_dataset() {
        let tmp = tempfile::tempdir().unwrap();
        let ds = small();
        let first = tmp.path().join("first");
        ds.write(&first, false).unwrap();
        let first = Dataset::open_verified(&first).unwrap();
        let pyg = tmp.path().join("pyg");
        let summary = export_npy(&first.view(), &pyg, false).unwrap();
        assert_eq!((summary.vertices, summary.edges), (5, 6));
        let again = tmp.path().join("again");
        // Defaults: no symmetrization, self-loops kept (the graph exactly as given).
        import(Format::Npy, &pyg, &again, &ImportOptions::default()).unwrap();
        let again = Dataset::open_verified(&again).unwrap();
        let (a, b) = (first.view(), again.view());
        assert_eq!(a.graph.offsets, b.graph.offsets);
        assert_eq!(a.graph.indices, b.graph.indices);
        assert_eq!(a.features, b.features);
        assert_eq!(a.labels, b.labels);
        assert_eq!((a.train, a.val, a.test), (b.train, b.val, b.test));
        assert_eq!(a.num_classes, b.num_classes);
        // An existing output is refused and left alone.
        let err = export_npy(&first.view(), &pyg, false).unwrap_err();
        assert!(err.to_string().contains("already exists"), "{err}");
        assert!(pyg.join("x.npy").exists());
    }

    /// A link split survives export -> import (the five `link_*.npy` arrays), and a missing
    /// one is named.
    #[test]
    fn a_link_split_round_trips_through_npy() {
        let tmp = tempfile::tempdir().unwrap();
        let ring = grandis_store::graph_from_edges(
            40,
            (0..40u32).map(|v| (v, (v + 1) % 40)),
            EdgeOptions {
                symmetrize: true,
                self_loops: SelfLoops::Keep,
            },
        )
        .unwrap();
        let opts = grandis_store::EdgeSplitOptions {
            val: 0.1,
            test: 0.1,
            negatives: 2,
            seed: 4,
        };
        let (graph, mut split) = grandis_store::split_edges(ring.view(), true, &opts).unwrap();
        // The relation's destinations travel too (every training destination is above 0).
        split.destinations = Some((1, 40));
        let ds = InMemoryDataset {
            name: "ring".into(),
            graph,
            features: vec![1.0; 40],
            feature_dim: 1,
            labels: vec![0; 40],
            num_classes: 1,
            split: Split::default(),
            types: None,
        };
        let mut view = ds.view();
        view.links = Some(split.view());
        let pyg = tmp.path().join("pyg");
        export_npy(&view, &pyg, false).unwrap();
        let again = tmp.path().join("again");
        import(Format::Npy, &pyg, &again, &ImportOptions::default()).unwrap();
        let again = Dataset::open_verified(&again).unwrap();
        let links = again.view().links.expect("the link split came back");
        for part in grandis_store::LinkPart::ALL {
            assert_eq!(links.part(part), split.view().part(part), "{part:?}");
        }
        assert_eq!(links.destinations, Some((1, 40)));
        assert_eq!(again.view().graph.indices, ds.graph.indices);

        // A range outside the graph is refused, naming the file.
        grandis_npy::write_npy(pyg.join(LINK_DESTINATIONS_NPY), &[2], &[0i64, 41]).unwrap();
        let err = match import(
            Format::Npy,
            &pyg,
            &tmp.path().join("bad-range"),
            &ImportOptions::default(),
        ) {
            Ok(_) => panic!("a range outside the graph was imported"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("link_destinations.npy") && err.contains("[0, 41)"),
            "{err}"
        );

        std::fs::remove_file(pyg.join("link_test_neg.npy")).unwrap();
        let err = match import(
            Format::Npy,
            &pyg,
            &tmp.path().join("bad"),
            &ImportOptions::default(),
        ) {
            Ok(_) => panic!("an incomplete link split was imported"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("link_test_neg.npy") && err.contains("all five"),
            "{err}"
        );
    }
}
