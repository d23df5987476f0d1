//! The typed npy layout (PyG's `HeteroData` as arrays): a typed dataset exported and
//! imported again is the same dataset, ids, features, labels, split and types; bad typed
//! data is a clear error naming the file, and nothing is written.

use std::path::Path;

use grandis_import::{export_npy, import, Format, ImportOptions};
use grandis_synth::{generate_hetero_in_memory, HeteroConfig};

fn exported(dir: &Path) -> grandis_store::InMemoryDataset {
    let ds = generate_hetero_in_memory(&HeteroConfig::academic(300, 6, 3, 1)).unwrap();
    export_npy(&ds.view(), dir, false).unwrap();
    ds
}

#[test]
fn a_typed_dataset_round_trips_through_the_heterodata_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let npy = tmp.path().join("npy");
    let ds = exported(&npy);
    for f in [
        "x_paper.npy",
        "x_author.npy",
        "edge_index_author__writes__paper.npy",
        "y.npy",
        "hetero.json",
    ] {
        assert!(npy.join(f).exists(), "{f}");
    }
    // Institutions have no features: no x file, hetero.json counts them.
    assert!(!npy.join("x_institution.npy").exists());
    let back = import(
        Format::Npy,
        &npy,
        &tmp.path().join("d"),
        &ImportOptions::default(),
    )
    .unwrap()
    .to_in_memory();
    assert_eq!(back.graph, ds.graph);
    assert_eq!(back.features, ds.features);
    assert_eq!(back.labels, ds.labels);
    assert_eq!(back.split, ds.split);
    let (a, b) = (back.types.unwrap().schema, ds.types.unwrap().schema);
    assert_eq!(a.vertex_types, b.vertex_types);
    assert_eq!(a.target, b.target);
    // Relations come back in file-name order, each with its edges counted.
    let mut keys: Vec<String> = b.relations.iter().map(|r| r.key()).collect();
    keys.sort();
    assert_eq!(
        a.relations.iter().map(|r| r.key()).collect::<Vec<_>>(),
        keys
    );
    assert!(a.relations.iter().all(|r| r.num_edges > 0));
}

/// Imports `npy` after `break_it`, expecting an error that contains `needle`.
fn refused(break_it: impl Fn(&Path), needle: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let npy = tmp.path().join("npy");
    exported(&npy);
    break_it(&npy);
    let out = tmp.path().join("d");
    let err = match import(Format::Npy, &npy, &out, &ImportOptions::default()) {
        Ok(_) => panic!("{needle}: imported"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains(needle), "{err}");
    assert!(!out.exists(), "nothing half-written");
}

#[test]
fn bad_typed_data_names_the_file() {
    let write_i64 = |path: &Path, shape: &[u64], values: &[i64]| {
        grandis_npy::write_npy(path, shape, values).unwrap();
    };
    // A relation naming a type that does not exist.
    refused(
        |d| {
            write_i64(
                &d.join("edge_index_venue__hosts__paper.npy"),
                &[2, 1],
                &[0, 0],
            )
        },
        "edge_index_venue__hosts__paper.npy: names vertex type \"venue\"",
    );
    // An author id outside its type (300 vertices make 105 authors).
    refused(
        |d| {
            write_i64(
                &d.join("edge_index_author__writes__paper.npy"),
                &[2, 1],
                &[105, 0],
            )
        },
        "edge_index_author__writes__paper.npy: edge 0 (105 -> 0)",
    );
    // Features whose rows disagree with the type's count in hetero.json.
    refused(
        |d| grandis_npy::write_npy(d.join("x_author.npy"), &[3, 2], &[0f32; 6]).unwrap(),
        "x_author.npy: has 3 rows; type \"author\" has 105 vertices",
    );
    // Two relations joining the same ordered pair of types.
    refused(
        |d| {
            write_i64(
                &d.join("edge_index_author__reviews__paper.npy"),
                &[2, 1],
                &[0, 0],
            )
        },
        "at most one relation per ordered pair of vertex types",
    );
    // A split id outside the target type.
    refused(
        |d| write_i64(&d.join("test_idx.npy"), &[1], &[150]),
        "test_idx.npy: entry 0",
    );
}

/// A typed dataset with a link split exports its pairs as the homogeneous layout does
/// (global ids) and names their relation in hetero.json; importing that back is refused
/// with a message (split the imported graph instead).
#[test]
fn a_typed_link_split_exports_with_its_relation() {
    let ds = generate_hetero_in_memory(&HeteroConfig::academic(300, 6, 3, 1)).unwrap();
    let types = ds.types.as_ref().unwrap();
    let r = 1; // author writes paper
    let (s, t) = types.ends(r);
    let g = ds.graph.view();
    let (mut candidates, mut kept) = (Vec::new(), Vec::new());
    for v in 0..g.num_vertices() as u32 {
        for &u in g.neighbors(v) {
            let ours = (types.type_of(u), types.type_of(v)) == (s, t);
            if ours { &mut candidates } else { &mut kept }.push((u, v));
        }
    }
    let opts = grandis_store::EdgeSplitOptions {
        val: 0.1,
        test: 0.1,
        negatives: 1,
        seed: 3,
    };
    let (_, split) =
        grandis_store::split_relation(g, candidates, &kept, types.range(t), false, &opts).unwrap();
    let mut view = ds.view();
    view.links = Some(split.view());
    let tmp = tempfile::tempdir().unwrap();
    let npy = tmp.path().join("npy");
    let summary = export_npy(&view, &npy, false).unwrap();
    assert!(
        summary.files.iter().any(|f| f == "link_test_neg.npy"),
        "{:?}",
        summary.files
    );
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(npy.join("hetero.json")).unwrap()).unwrap();
    assert_eq!(json["link_relation"], "author__writes__paper");
    let pairs = grandis_npy::NpyFile::open(npy.join("link_train.npy")).unwrap();
    assert_eq!(pairs.shape(), &[2, (split.train.len() / 2) as u64]);
    let out = tmp.path().join("d");
    let err = match import(Format::Npy, &npy, &out, &ImportOptions::default()) {
        Ok(_) => panic!("imported a typed link split"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("split-edges --relation"), "{err}");
}
