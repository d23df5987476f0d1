//! Every importer on tiny inputs built here: the happy path (including isolated vertices,
//! given and seeded splits) and every kind of bad input, which must fail with a message that
//! names the file and leave no output directory behind.

use std::io::Write;
use std::path::{Path, PathBuf};

use grandis_import::{import, Delimiter, Format, ImportOptions};
use grandis_npy::write_npy;
use grandis_store::{Dataset, SelfLoops};

/// Input fixtures live in one temporary directory, outputs in another, so that "nothing left
/// behind" can be checked by listing the output parent.
struct Fixture {
    input: tempfile::TempDir,
    out_root: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture {
            input: tempfile::tempdir().unwrap(),
            out_root: tempfile::tempdir().unwrap(),
        }
    }
    fn path(&self, name: &str) -> PathBuf {
        self.input.path().join(name)
    }
    fn out(&self) -> PathBuf {
        self.out_root.path().join("ds")
    }
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        path
    }
    fn write_gz(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut enc = flate2::write::GzEncoder::new(
            std::fs::File::create(&path).unwrap(),
            flate2::Compression::fast(),
        );
        enc.write_all(text.as_bytes()).unwrap();
        enc.finish().unwrap();
        path
    }
    fn import(&self, format: Format, input: &Path, options: &ImportOptions) -> Dataset {
        import(format, input, &self.out(), options).unwrap_or_else(|e| panic!("import failed: {e}"))
    }
    /// Runs an import that must fail; checks the message and that nothing was left behind.
    fn fails(&self, format: Format, input: &Path, options: &ImportOptions, needles: &[&str]) {
        let err = match import(format, input, &self.out(), options) {
            Ok(_) => panic!("import of {} should have failed", input.display()),
            Err(e) => e.to_string(),
        };
        for needle in needles {
            assert!(err.contains(needle), "{needle:?} not in error: {err}");
        }
        let left: Vec<_> = std::fs::read_dir(self.out_root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "left behind after {err}: {left:?}");
    }
}

fn opts() -> ImportOptions {
    ImportOptions::default()
}

// ---------------------------------------------------------------------------------------
// npy

/// A 5-vertex graph with vertex 4 isolated; 2 classes; vertex 3 unlabelled.
fn npy_dir(f: &Fixture, with_split: bool) -> PathBuf {
    let dir = f.path("pyg");
    std::fs::create_dir_all(&dir).unwrap();
    write_npy(
        dir.join("edge_index.npy"),
        &[2, 4],
        &[0i64, 1, 2, 1, 1, 0, 3, 1],
    )
    .unwrap();
    let x: Vec<f32> = (0..15).map(|i| i as f32).collect();
    write_npy(dir.join("x.npy"), &[5, 3], &x).unwrap();
    write_npy(dir.join("y.npy"), &[5], &[0i64, 1, 0, -1, 1]).unwrap();
    if with_split {
        write_npy(dir.join("train_idx.npy"), &[2], &[1i64, 0]).unwrap();
        write_npy(dir.join("val_idx.npy"), &[1], &[2i64]).unwrap();
        write_npy(dir.join("test_idx.npy"), &[1], &[4i64]).unwrap();
    }
    dir
}

#[test]
fn npy_imports_graph_features_labels_and_split() {
    let f = Fixture::new();
    let dir = npy_dir(&f, true);
    let ds = f.import(Format::Npy, &dir, &opts());
    let m = ds.manifest();
    assert_eq!(
        (m.num_vertices, m.num_edges, m.feature_dim, m.num_classes),
        (5, 4, 3, 2)
    );
    assert_eq!(m.name, "ds");
    let v = ds.view();
    // Rows list sources of edges into each vertex: 0->1, 1->0, 2->3, 1->1 (a self-loop kept).
    assert!(v.graph.has_edge(0, 1) && v.graph.has_edge(1, 0) && v.graph.has_edge(2, 3));
    assert!(v.graph.has_edge(1, 1));
    assert_eq!(v.graph.degree(4), 0, "isolated vertex kept");
    assert_eq!(v.feature_row(4), &[12.0, 13.0, 14.0]);
    assert_eq!(v.labels, &[0, 1, 0, -1, 1]);
    assert_eq!(
        (v.train, v.val, v.test),
        (&[0u32, 1][..], &[2u32][..], &[4u32][..])
    );
    assert!(m
        .provenance
        .iter()
        .any(|l| l == "split: taken from the input"));
    ds.verify().unwrap();
}

#[test]
fn npy_options_symmetrize_self_loops_and_seeded_split() {
    let f = Fixture::new();
    let dir = npy_dir(&f, false);
    let options = ImportOptions {
        symmetrize: true,
        self_loops: SelfLoops::Remove,
        name: Some("tiny".into()),
        seed: 3,
        ..opts()
    };
    let ds = f.import(Format::Npy, &dir, &options);
    let m = ds.manifest();
    assert_eq!(m.name, "tiny");
    assert!(m.symmetric);
    assert_eq!(m.num_edges, 4, "0<->1 and 2<->3; the self-loop removed");
    // Seeded per-class split: 20 per class would take every labelled vertex into training.
    assert_eq!((m.split.train, m.split.val, m.split.test), (4, 0, 0));
    assert!(
        m.provenance
            .iter()
            .any(|l| l.contains("seeded per-class:20:500:1000 split (seed 3)")),
        "{:?}",
        m.provenance
    );
    // --force replaces; without it an existing output is an error.
    let err = import(Format::Npy, &dir, &f.out(), &options)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("already exists"), "{err}");
    let forced = ImportOptions {
        force: true,
        self_loops: SelfLoops::Add,
        ..options
    };
    let ds = import(Format::Npy, &dir, &f.out(), &forced).unwrap();
    assert_eq!(ds.manifest().num_edges, 4 + 5);
}

#[test]
fn npy_accepts_f64_int32_fortran_order_and_masks() {
    let f = Fixture::new();
    let dir = npy_dir(&f, false);
    write_npy(dir.join("x.npy"), &[5, 1], &[0.5f64, 1.0, 1.5, 2.0, 2.5]).unwrap();
    write_npy(dir.join("y.npy"), &[5, 1], &[0i32, 1, 0, 1, 1]).unwrap();
    // edge_index stored column-major (what np.save writes for a transposed (E, 2) array).
    let mut bytes = grandis_npy::encode_header(grandis_npy::DType::I64, &[2, 2]);
    let dict = String::from_utf8(bytes.split_off(10))
        .unwrap()
        .replace("'fortran_order': False", "'fortran_order': True ");
    bytes.extend_from_slice(dict.as_bytes());
    for v in [0i64, 4, 3, 2] {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(dir.join("edge_index.npy"), bytes).unwrap();
    grandis_npy::write_npy_bool(
        dir.join("train_idx.npy"),
        &[5],
        &[true, true, false, false, false],
    )
    .unwrap();
    grandis_npy::write_npy_bool(
        dir.join("val_idx.npy"),
        &[5],
        &[false, false, true, false, false],
    )
    .unwrap();
    write_npy(dir.join("test_idx.npy"), &[2], &[3i32, 4]).unwrap();
    let ds = f.import(Format::Npy, &dir, &opts());
    let v = ds.view();
    assert!(v.graph.has_edge(0, 4) && v.graph.has_edge(3, 2));
    assert_eq!(v.graph.num_edges(), 2);
    assert_eq!(v.features, &[0.5, 1.0, 1.5, 2.0, 2.5]);
    assert_eq!((v.train.len(), v.val.len(), v.test.len()), (2, 1, 2));
}

#[test]
fn npy_bad_inputs() {
    let f = Fixture::new();
    let dir = npy_dir(&f, false);
    let good_edges = std::fs::read(dir.join("edge_index.npy")).unwrap();
    let restore = || std::fs::write(dir.join("edge_index.npy"), &good_edges).unwrap();

    // Truncated payload.
    std::fs::write(
        dir.join("edge_index.npy"),
        &good_edges[..good_edges.len() - 3],
    )
    .unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["edge_index.npy", "truncated", "expected"],
    );
    restore();

    // Wrong dtypes.
    write_npy(dir.join("edge_index.npy"), &[2, 1], &[0.0f32, 1.0]).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["edge_index.npy", "float32", "int64 or int32"],
    );
    restore();
    write_npy(dir.join("x.npy"), &[5, 1], &[1i64; 5]).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["x.npy", "int64", "float32 or float64"],
    );
    write_npy(dir.join("x.npy"), &[5, 1], &[1.0f32; 5]).unwrap();

    // Out-of-range and negative ids.
    write_npy(dir.join("edge_index.npy"), &[2, 2], &[0i64, 1, 1, 5]).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["edge_index.npy", "edge 1", "out of range", "5 vertices"],
    );
    write_npy(dir.join("edge_index.npy"), &[2, 1], &[-1i64, 0]).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["edge_index.npy", "negative vertex id -1"],
    );
    write_npy(dir.join("edge_index.npy"), &[3, 1], &[0i64, 0, 0]).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["edge_index.npy", "expected (2, E)"],
    );
    restore();

    // Mismatched lengths.
    write_npy(dir.join("y.npy"), &[4], &[0i64; 4]).unwrap();
    f.fails(Format::Npy, &dir, &opts(), &["y.npy", "4 labels", "5 rows"]);
    write_npy(dir.join("y.npy"), &[5], &[0i64; 5]).unwrap();

    // Non-finite features.
    write_npy(
        dir.join("x.npy"),
        &[5, 1],
        &[0.0f32, f32::NAN, 0.0, 0.0, 0.0],
    )
    .unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["x.npy", "row 1", "not finite"],
    );
    write_npy(dir.join("x.npy"), &[5, 1], &[0.0f64, 1e300, 0.0, 0.0, 0.0]).unwrap();
    f.fails(Format::Npy, &dir, &opts(), &["x.npy", "row 1", "float32"]);
    write_npy(dir.join("x.npy"), &[5, 1], &[1.0f32; 5]).unwrap();

    // Split problems.
    write_npy(dir.join("train_idx.npy"), &[1], &[0i64]).unwrap();
    f.fails(Format::Npy, &dir, &opts(), &["val_idx.npy", "missing"]);
    write_npy(dir.join("val_idx.npy"), &[1], &[0i64]).unwrap();
    write_npy(dir.join("test_idx.npy"), &[1], &[9i64]).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["test_idx.npy", "out of range"],
    );
    write_npy(dir.join("test_idx.npy"), &[1], &[1i64]).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["val_idx.npy", "also in", "train_idx.npy"],
    );
    for name in ["train_idx.npy", "val_idx.npy", "test_idx.npy"] {
        std::fs::remove_file(dir.join(name)).unwrap();
    }

    // Missing file, missing directory.
    std::fs::remove_file(dir.join("y.npy")).unwrap();
    f.fails(Format::Npy, &dir, &opts(), &["y.npy", "missing"]);
    f.fails(Format::Npy, &f.path("nope"), &opts(), &["nope", "missing"]);

    // Empty graph: no vertices at all.
    write_npy::<f32>(dir.join("x.npy"), &[0, 3], &[]).unwrap();
    write_npy::<i64>(dir.join("y.npy"), &[0], &[]).unwrap();
    write_npy::<i64>(dir.join("edge_index.npy"), &[2, 0], &[]).unwrap();
    f.fails(Format::Npy, &dir, &opts(), &["x.npy", "empty graph"]);
}

#[test]
fn npy_graph_without_edges_is_all_isolated() {
    let f = Fixture::new();
    let dir = npy_dir(&f, false);
    write_npy::<i64>(dir.join("edge_index.npy"), &[2, 0], &[]).unwrap();
    let ds = f.import(Format::Npy, &dir, &opts());
    assert_eq!(ds.manifest().num_edges, 0);
    assert_eq!(ds.graph().degree_stats().isolated, 5);
}

// ---------------------------------------------------------------------------------------
// ogb

fn ogb_dir(f: &Fixture) -> PathBuf {
    f.write_gz("ogb/raw/edge.csv.gz", "0,1\n1,2\n2,0\n0,1\n");
    f.write_gz("ogb/raw/num-node-list.csv.gz", "4\n");
    f.write_gz(
        "ogb/raw/node-feat.csv.gz",
        "0.1,0.2\n0.3,0.4\n0.5,0.6\n-1e-3,2\n",
    );
    f.write_gz("ogb/raw/node-label.csv.gz", "1\n0\nnan\n2\n");
    f.write_gz("ogb/split/time/train.csv.gz", "0\n1\n");
    f.write_gz("ogb/split/time/valid.csv.gz", "3\n");
    f.write_gz("ogb/split/time/test.csv.gz", "");
    f.path("ogb")
}

#[test]
fn ogb_imports_raw_layout_with_split() {
    let f = Fixture::new();
    let dir = ogb_dir(&f);
    let ds = f.import(Format::Ogb, &dir, &opts());
    let m = ds.manifest();
    assert_eq!(
        (m.num_vertices, m.num_edges, m.feature_dim, m.num_classes),
        (4, 3, 2, 3)
    );
    let v = ds.view();
    assert_eq!(v.labels, &[1, 0, -1, 2]);
    assert_eq!(v.feature_row(3), &[-1e-3, 2.0]);
    assert_eq!(v.graph.degree(3), 0, "vertex 3 is isolated");
    assert_eq!(
        (v.train, v.val, v.test),
        (&[0u32, 1][..], &[3u32][..], &[][..])
    );
    assert!(m.provenance.iter().any(|l| l.contains("split/time")));
}

#[test]
fn ogb_without_split_or_features_gets_seeded_split() {
    let f = Fixture::new();
    let dir = ogb_dir(&f);
    std::fs::remove_dir_all(dir.join("split")).unwrap();
    std::fs::remove_file(dir.join("raw/node-feat.csv.gz")).unwrap();
    // Uncompressed tables are accepted too.
    std::fs::remove_file(dir.join("raw/edge.csv.gz")).unwrap();
    f.write("ogb/raw/edge.csv", "0,1\n3,2\n");
    let ds = f.import(Format::Ogb, &dir, &opts());
    let m = ds.manifest();
    assert_eq!((m.num_vertices, m.num_edges, m.feature_dim), (4, 2, 0));
    assert_eq!(
        m.split.train, 3,
        "every labelled vertex (fewer than 20 per class)"
    );
    assert!(m
        .provenance
        .iter()
        .any(|l| l.contains("the input has none")));
}

#[test]
fn ogb_bad_inputs() {
    let f = Fixture::new();
    let dir = ogb_dir(&f);
    let edge = "ogb/raw/edge.csv.gz";

    f.write_gz(edge, "0,1\n1,2,3\n");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["edge.csv.gz", "line 2", "ragged"],
    );
    f.write_gz(edge, "0,1\n1,-2\n");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["edge.csv.gz", "line 2", "negative vertex id -2"],
    );
    f.write_gz(edge, "0,4\n");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["edge.csv.gz", "line 1", "out of range", "num-node-list"],
    );
    f.write_gz(edge, "0,x\n");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["edge.csv.gz", "\"x\" is not an integer"],
    );
    // A gzip stream cut short.
    let good = f.write_gz(edge, &"0,1\n".repeat(5000));
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&good, &bytes[..bytes.len() / 2]).unwrap();
    f.fails(Format::Ogb, &dir, &opts(), &["edge.csv.gz"]);
    f.write_gz(edge, "0,1\n");

    f.write_gz("ogb/raw/node-feat.csv.gz", "1,2\n3\n4,5\n6,7\n");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["node-feat.csv.gz", "line 2", "ragged"],
    );
    f.write_gz("ogb/raw/node-feat.csv.gz", "1,2\n3,4\n4,5\n");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["node-feat.csv.gz", "3 feature rows", "4 vertices"],
    );
    f.write_gz("ogb/raw/node-feat.csv.gz", "1,2\n3,4\n4,5\n6,7\n");

    f.write_gz("ogb/raw/node-label.csv.gz", "1\n0\n2\n");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["node-label.csv.gz", "3 labels", "4 vertices"],
    );
    f.write_gz("ogb/raw/node-label.csv.gz", "1,0\n0,1\n1,1\n0,0\n");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["node-label.csv.gz", "multi-label"],
    );
    f.write_gz("ogb/raw/node-label.csv.gz", "1\n0\n2\n2\n");

    f.write_gz("ogb/split/time/test.csv.gz", "7\n");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["test.csv.gz", "line 1", "out of range"],
    );
    f.write_gz("ogb/split/time/test.csv.gz", "");
    f.write_gz("ogb/split/other/train.csv.gz", "");
    f.fails(
        Format::Ogb,
        &dir,
        &opts(),
        &["split", "other, time", "--split-name"],
    );
    let chosen = ImportOptions {
        split_name: Some("time".into()),
        ..opts()
    };
    f.import(Format::Ogb, &dir, &chosen);
    std::fs::remove_dir_all(f.out()).unwrap();
    let missing = ImportOptions {
        split_name: Some("nope".into()),
        ..opts()
    };
    f.fails(Format::Ogb, &dir, &missing, &["split/nope", "missing"]);
}

#[test]
fn ogb_missing_and_empty() {
    let f = Fixture::new();
    let dir = ogb_dir(&f);
    std::fs::remove_file(dir.join("raw/edge.csv.gz")).unwrap();
    f.fails(Format::Ogb, &dir, &opts(), &["raw/edge.csv.gz", "missing"]);
    f.fails(
        Format::Ogb,
        &f.path("ogb/raw"),
        &opts(),
        &["raw/raw", "missing"],
    );

    let f = Fixture::new();
    let dir = ogb_dir(&f);
    std::fs::remove_dir_all(dir.join("split")).unwrap();
    f.write_gz("ogb/raw/edge.csv.gz", "");
    f.write_gz("ogb/raw/num-node-list.csv.gz", "0\n");
    std::fs::remove_file(dir.join("raw/node-feat.csv.gz")).unwrap();
    std::fs::remove_file(dir.join("raw/node-label.csv.gz")).unwrap();
    f.fails(Format::Ogb, &dir, &opts(), &["edge.csv.gz", "empty graph"]);
}

// ---------------------------------------------------------------------------------------
// edgelist

#[test]
fn edgelist_with_comments_header_features_and_labels() {
    let f = Fixture::new();
    let edges = f.write(
        "g.tsv",
        "# a comment\n% another\nsrc\tdst\tweight\n0\t1\t0.5\n\n1\t2\t1\n2\t0\t1\n",
    );
    let features = f.write("feat.csv", "a,b\n1,2\n3,4\n5,6\n7,8\n");
    let labels = f.write("labels.txt", "0\n1\n-1\n1\n");
    let options = ImportOptions {
        features: Some(features),
        labels: Some(labels),
        symmetrize: true,
        ..opts()
    };
    let ds = f.import(Format::EdgeList, &edges, &options);
    let m = ds.manifest();
    assert_eq!(
        (m.num_vertices, m.num_edges, m.feature_dim, m.num_classes),
        (4, 6, 2, 2)
    );
    assert!(m.symmetric);
    let v = ds.view();
    assert_eq!(v.graph.degree(3), 0, "vertex 3 only has features: isolated");
    assert_eq!(v.labels, &[0, 1, -1, 1]);
    assert_eq!(v.feature_row(3), &[7.0, 8.0]);
    assert!(m.provenance.iter().any(|l| l.contains("1 extra column")));
}

#[test]
fn edgelist_plain_whitespace_and_explicit_options() {
    let f = Fixture::new();
    let edges = f.write("g.txt", "1 0\n3   1\n");
    let ds = f.import(Format::EdgeList, &edges, &opts());
    let m = ds.manifest();
    assert_eq!(
        (m.num_vertices, m.num_edges, m.feature_dim, m.num_classes),
        (4, 2, 0, 0)
    );
    assert_eq!(
        m.split.train + m.split.val + m.split.test,
        0,
        "no labels, empty split"
    );
    assert_eq!(ds.graph().degree_stats().isolated, 2);
    std::fs::remove_dir_all(f.out()).unwrap();

    let edges = f.write("g.csv", "1;0\n2;1\n");
    let options = ImportOptions {
        delimiter: Some(Delimiter::Char(';')),
        num_vertices: Some(6),
        ..opts()
    };
    let ds = f.import(Format::EdgeList, &edges, &options);
    assert_eq!(ds.manifest().num_vertices, 6);
    std::fs::remove_dir_all(f.out()).unwrap();
    // --header skips a numeric first line too.
    let options = ImportOptions {
        header: true,
        ..opts()
    };
    let ds = f.import(Format::EdgeList, &edges, &options);
    assert_eq!(ds.manifest().num_edges, 1);
}

#[test]
fn edgelist_bad_inputs() {
    let f = Fixture::new();
    let edges = f.write("g.csv", "0,1\n1,2,7\n");
    f.fails(
        Format::EdgeList,
        &edges,
        &opts(),
        &["g.csv", "line 2", "ragged"],
    );
    f.write("g.csv", "0,1\n1\n");
    f.fails(
        Format::EdgeList,
        &edges,
        &opts(),
        &["g.csv", "line 2", "1 field(s)"],
    );
    f.write("g.csv", "0,1\n-3,1\n");
    f.fails(
        Format::EdgeList,
        &edges,
        &opts(),
        &["g.csv", "line 2", "negative vertex id -3"],
    );
    f.write("g.csv", "0,1\n4294967295,1\n");
    f.fails(
        Format::EdgeList,
        &edges,
        &opts(),
        &["g.csv", "line 2", "exceeds"],
    );
    f.write("g.csv", "0,1\n1,two\n");
    f.fails(
        Format::EdgeList,
        &edges,
        &opts(),
        &["g.csv", "line 2", "not an integer"],
    );
    f.write("g.csv", "0,1\n2,1\n");

    let features = f.write("feat.csv", "1,2\n3,4\n");
    let with_features = ImportOptions {
        features: Some(features.clone()),
        ..opts()
    };
    f.fails(
        Format::EdgeList,
        &edges,
        &with_features,
        &["g.csv", "line 2", "out of range", "feat.csv"],
    );
    f.write("feat.csv", "1,2\n3\n5,6\n");
    f.fails(
        Format::EdgeList,
        &edges,
        &with_features,
        &["feat.csv", "line 2", "ragged"],
    );
    f.write("feat.csv", "1,2\n3,inf\n5,6\n");
    f.fails(
        Format::EdgeList,
        &edges,
        &with_features,
        &["feat.csv", "line 2", "not finite"],
    );
    f.write("feat.csv", "1,2\n3,4\n5,6\n");

    let labels = f.write("labels.txt", "0\n1\n");
    let both = ImportOptions {
        labels: Some(labels),
        ..with_features.clone()
    };
    f.fails(
        Format::EdgeList,
        &edges,
        &both,
        &["labels.txt", "2 labels", "3 vertices"],
    );
    let conflicting = ImportOptions {
        num_vertices: Some(10),
        ..with_features.clone()
    };
    f.fails(
        Format::EdgeList,
        &edges,
        &conflicting,
        &["feat.csv", "3 feature rows", "--num-vertices"],
    );
    let missing = ImportOptions {
        labels: Some(f.path("nolabels.txt")),
        ..opts()
    };
    f.fails(
        Format::EdgeList,
        &edges,
        &missing,
        &["nolabels.txt", "missing"],
    );
    f.fails(
        Format::EdgeList,
        &f.path("none.csv"),
        &opts(),
        &["none.csv", "missing"],
    );
    f.fails(
        Format::EdgeList,
        f.input.path(),
        &opts(),
        &["is a directory"],
    );

    let empty = f.write("empty.csv", "# nothing here\n\n");
    f.fails(
        Format::EdgeList,
        &empty,
        &opts(),
        &["empty.csv", "empty graph"],
    );
    // Vertices without edges are fine.
    let isolated = ImportOptions {
        num_vertices: Some(3),
        ..opts()
    };
    let ds = f.import(Format::EdgeList, &empty, &isolated);
    assert_eq!(
        (ds.manifest().num_vertices, ds.manifest().num_edges),
        (3, 0)
    );
}

// ---------------------------------------------------------------------------------------
// parquet (Neo4j GDS export)

mod gds_fixture;
/// Four nodes with sparse ids; node 40 is isolated and unlabelled.
fn gds_dir(f: &Fixture) -> PathBuf {
    let dir = f.path("gds");
    std::fs::create_dir_all(&dir).unwrap();
    gds_fixture::nodes(
        &dir.join("g_nodes.parquet.gzip"),
        &[
            (1000, Some(2), Some(vec![1.0, 0.0])),
            (7, Some(0), Some(vec![0.0, 1.0])),
            (-5, Some(1), Some(vec![0.5, 0.5])),
            (40, None, Some(vec![0.0, 0.0])),
        ],
    );
    gds_fixture::rels(
        &dir.join("g_rels.parquet.gzip"),
        &[(1000, 7), (7, -5), (1000, 7)],
    );
    dir
}

#[test]
fn parquet_maps_node_ids_in_table_order() {
    let f = Fixture::new();
    let dir = gds_dir(&f);
    let ds = f.import(Format::Parquet, &dir, &opts());
    let m = ds.manifest();
    assert_eq!(
        (m.num_vertices, m.num_edges, m.feature_dim, m.num_classes),
        (4, 2, 2, 3)
    );
    let v = ds.view();
    assert!(v.graph.has_edge(0, 1) && v.graph.has_edge(1, 2));
    assert_eq!(v.labels, &[2, 0, 1, -1]);
    assert_eq!(v.feature_row(2), &[0.5, 0.5]);
    assert_eq!(v.graph.degree(3), 0);
    assert_eq!(m.split.train, 3);
}

#[test]
fn parquet_bad_inputs() {
    let f = Fixture::new();
    let dir = gds_dir(&f);
    let nodes = dir.join("g_nodes.parquet.gzip");
    let rels = dir.join("g_rels.parquet.gzip");

    gds_fixture::rels(&rels, &[(1000, 8)]);
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &[
            "g_rels.parquet.gzip",
            "row 0",
            "targetNodeId 8 is not a nodeId",
        ],
    );
    gds_fixture::rels(&rels, &[(1000, 7)]);

    gds_fixture::nodes(
        &nodes,
        &[(1, Some(0), Some(vec![1.0])), (1, Some(0), Some(vec![1.0]))],
    );
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &["g_nodes.parquet.gzip", "row 1", "appears twice"],
    );
    gds_fixture::nodes(
        &nodes,
        &[
            (1000, Some(0), Some(vec![1.0, 2.0])),
            (7, Some(0), Some(vec![1.0])),
        ],
    );
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &["g_nodes.parquet.gzip", "row 1", "ragged"],
    );
    gds_fixture::nodes(
        &nodes,
        &[(1000, Some(0), Some(vec![1.0])), (7, Some(0), None)],
    );
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &["g_nodes.parquet.gzip", "row 1", "features is null"],
    );
    gds_fixture::nodes(
        &nodes,
        &[
            (1000, Some(0), Some(vec![f64::NAN])),
            (7, Some(0), Some(vec![1.0])),
        ],
    );
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &["g_nodes.parquet.gzip", "row 0", "not finite"],
    );
    gds_fixture::nodes(
        &nodes,
        &[
            (1000, Some(0), Some(vec![1.0])),
            (7, Some(0), Some(vec![1.0])),
        ],
    );
    let wrong_column = ImportOptions {
        label_column: Some("class".into()),
        ..opts()
    };
    f.fails(
        Format::Parquet,
        &dir,
        &wrong_column,
        &[
            "g_nodes.parquet.gzip",
            "no column \"class\"",
            "nodeId, subject, features",
        ],
    );

    // A truncated copy of a real table.
    let bytes = std::fs::read(&nodes).unwrap();
    std::fs::write(&nodes, &bytes[..bytes.len() - 10]).unwrap();
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &["g_nodes.parquet.gzip", "cannot read Parquet"],
    );
    std::fs::write(&nodes, b"PAR1 not really").unwrap();
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &["g_nodes.parquet.gzip", "cannot read Parquet"],
    );

    // Empty tables: no vertices.
    gds_fixture::nodes(&nodes, &[]);
    gds_fixture::rels(&rels, &[]);
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &["g_nodes.parquet.gzip", "empty graph"],
    );
    // Nodes without relationships are fine.
    gds_fixture::nodes(&nodes, &[(3, Some(0), Some(vec![1.0]))]);
    let ds = f.import(Format::Parquet, &dir, &opts());
    assert_eq!(
        (ds.manifest().num_vertices, ds.manifest().num_edges),
        (1, 0)
    );
    std::fs::remove_dir_all(f.out()).unwrap();

    std::fs::remove_file(&rels).unwrap();
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &["*rels*.parquet*", "missing"],
    );
    f.fails(Format::Parquet, &nodes, &opts(), &["is not a directory"]);
}

#[test]
fn parquet_truncated_real_cora_table() {
    let Some(raw) = std::env::var_os("GRANDIS_CORA_RAW") else {
        eprintln!("skipping: GRANDIS_CORA_RAW is not set (cora.rs enforces it under CI)");
        return;
    };
    let f = Fixture::new();
    let dir = f.path("cora");
    std::fs::create_dir_all(&dir).unwrap();
    let raw = Path::new(&raw);
    let nodes = std::fs::read(raw.join("cora_nodes.parquet.gzip")).unwrap();
    std::fs::write(
        dir.join("cora_nodes.parquet.gzip"),
        &nodes[..nodes.len() / 2],
    )
    .unwrap();
    std::fs::copy(
        raw.join("cora_rels.parquet.gzip"),
        dir.join("cora_rels.parquet.gzip"),
    )
    .unwrap();
    f.fails(
        Format::Parquet,
        &dir,
        &opts(),
        &["cora_nodes.parquet.gzip", "cannot read Parquet"],
    );
}

/// The imported dataset's link split (train, valid pos / neg, test pos / neg), once the
/// dataset verifies.
fn link_parts(ds: &grandis_store::Dataset) -> [Vec<u32>; 5] {
    ds.verify().unwrap();
    let link = ds.link_split().expect("a link split");
    [
        link.train,
        link.valid_pos,
        link.valid_neg,
        link.test_pos,
        link.test_neg,
    ]
    .map(|p| p.to_vec())
}

/// `npy_dir`'s graph without labels and with a link split under OGB's names, each array as
/// OGB's `get_edge_split()` gives it (n, 2); `test_pos` as given.
fn ogb_link_dir(f: &Fixture, test_pos: &[i64]) -> PathBuf {
    let dir = npy_dir(f, false);
    std::fs::remove_file(dir.join("y.npy")).unwrap();
    let pairs = |name: &str, v: &[i64]| {
        write_npy(dir.join(name), &[v.len() as u64 / 2, 2], v).unwrap();
    };
    pairs("train_pos.npy", &[0, 1, 2, 3]);
    pairs("valid_pos.npy", &[3, 4]);
    pairs("valid_neg.npy", &[0, 4]);
    pairs("test_pos.npy", test_pos);
    pairs("test_neg.npy", &[3, 0]);
    dir
}

/// OGB's link-prediction arrays (train / valid / test positives, valid / test negatives, one
/// pair a row) import as the dataset's link split, and a link dataset needs no `y.npy`.
#[test]
fn npy_imports_an_ogb_link_split_without_labels() {
    let f = Fixture::new();
    let dir = ogb_link_dir(&f, &[4, 2]);
    let ds = f.import(Format::Npy, &dir, &opts());
    assert_eq!(
        link_parts(&ds),
        [
            vec![0, 1, 2, 3],
            vec![3, 4],
            vec![0, 4],
            vec![4, 2],
            vec![3, 0]
        ]
    );
    assert_eq!(ds.view().labels, &[-1; 5]);
}

/// `npy_dir`'s graph without labels and with a link split under OGB's per-source names
/// (`ogbl-citation2`): sources, targets and each source's negative targets, one array each;
/// the test negatives as given (2 rows).
fn ogb_source_dir(f: &Fixture, test_neg: (&[u64], &[i64])) -> PathBuf {
    let dir = npy_dir(f, false);
    std::fs::remove_file(dir.join("y.npy")).unwrap();
    let ids = |name: &str, shape: &[u64], v: &[i64]| {
        write_npy(dir.join(name), shape, v).unwrap();
    };
    ids("train_source_node.npy", &[2], &[0, 2]);
    ids("train_target_node.npy", &[2], &[1, 3]);
    ids("valid_source_node.npy", &[1], &[3]);
    ids("valid_target_node.npy", &[1], &[4]);
    ids("valid_target_node_neg.npy", &[1, 2], &[0, 2]);
    ids("test_source_node.npy", &[2], &[4, 4]);
    ids("test_target_node.npy", &[2], &[2, 0]);
    ids("test_target_node_neg.npy", test_neg.0, test_neg.1);
    dir
}

/// OGB's per-source link split (citation2's `source_node`, `target_node`,
/// `target_node_neg`) imports as pairs, each positive's K negatives after one another with
/// its source, as MRR ranks them; a negatives array whose rows are not the sources, a missing
/// array and two namings at once are refused, naming the file.
#[test]
fn npy_imports_an_ogb_per_source_link_split() {
    let f = Fixture::new();
    let dir = ogb_source_dir(&f, (&[2, 1], &[3, 1]));
    let ds = f.import(Format::Npy, &dir, &opts());
    assert_eq!(
        link_parts(&ds),
        [
            vec![0, 1, 2, 3],
            vec![3, 4],
            vec![3, 0, 3, 2],
            vec![4, 2, 4, 0],
            vec![4, 3, 4, 1]
        ]
    );

    let f = Fixture::new();
    let dir = ogb_source_dir(&f, (&[1, 1], &[3]));
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &[
            "test_target_node_neg.npy",
            "expected (2, K), K >= 1 negative targets",
        ],
    );
    let f = Fixture::new();
    let dir = ogb_source_dir(&f, (&[2, 1], &[3, 1]));
    std::fs::remove_file(dir.join("valid_target_node.npy")).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["valid_target_node.npy", "give all eight or none"],
    );
    let f = Fixture::new();
    let dir = ogb_source_dir(&f, (&[2, 1], &[3, 1]));
    write_npy(dir.join("train_pos.npy"), &[1, 2], &[0i64, 1]).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["two namings (OGB's train_pos.npy, ... and OGB's train_source_node.npy, ...)"],
    );
}

/// A held-out positive that is an edge of `edge_index` would let the model read the answer:
/// refused, naming the part; two namings of the split at once are refused too.
#[test]
fn npy_refuses_held_out_edges_in_the_graph_and_two_namings() {
    let f = Fixture::new();
    let dir = ogb_link_dir(&f, &[1, 0]);
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &[
            "link_test_pos",
            "(1, 0)",
            "message-passing graph: remove the validation and test positives",
        ],
    );
    let f = Fixture::new();
    let dir = ogb_link_dir(&f, &[4, 2]);
    write_npy(dir.join("link_train.npy"), &[2, 1], &[0i64, 1]).unwrap();
    f.fails(
        Format::Npy,
        &dir,
        &opts(),
        &["two namings (link_*.npy and OGB's train_pos.npy, ...): keep one"],
    );
}
