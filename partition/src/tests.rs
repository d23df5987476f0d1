use super::*;
use grandis_store::{EdgeOptions, InMemoryDataset, Split};
use grandis_synth::{generate_in_memory, grid_dataset, SynthConfig};

fn cfg(servers: u32, devices: u32, method: PartitionMethod) -> PartitionConfig {
    PartitionConfig {
        servers,
        devices,
        method,
        seed: 1,
        ..Default::default()
    }
}

/// The relabelled graph, built the obvious way in memory (the reference for the streamed
/// rewrite): row `new` is the old row of `new_to_old[new]`, mapped and sorted.
fn relabel_graph(graph: grandis_store::CsrView<'_>, r: &Relabel) -> grandis_store::CsrGraph {
    let mut offsets = vec![0u64];
    let mut indices = Vec::new();
    for &old in &r.new_to_old {
        let mut row: Vec<u32> = graph
            .neighbors(old)
            .iter()
            .map(|&s| r.old_to_new[s as usize])
            .collect();
        row.sort_unstable();
        indices.extend(row);
        offsets.push(indices.len() as u64);
    }
    grandis_store::CsrGraph { offsets, indices }
}

/// Partition quality without touching the disk.
fn quality_of(ds: &InMemoryDataset, symmetric: bool, c: &PartitionConfig) -> Quality {
    let view = ds.view();
    let a = assign(&view, symmetric, c).unwrap();
    let r = relabel(&a, c.servers, c.devices);
    let g = relabel_graph(view.graph, &r);
    let train = r.map_sorted(view.train);
    quality::measure(
        g.view(),
        symmetric,
        &r.starts,
        c.devices as usize,
        &train,
        &|_| {},
    )
}

/// A 10x10 grid where every vertex trains, so METIS balances vertices only.
fn all_train_grid() -> InMemoryDataset {
    let mut ds = grid_dataset(10, 10, 0);
    ds.split = Split {
        train: (0..100).collect(),
        val: vec![],
        test: vec![],
    };
    ds
}

fn power_law(nodes: u64) -> InMemoryDataset {
    generate_in_memory(&SynthConfig {
        nodes,
        avg_degree: 10.0,
        features: 8,
        classes: 4,
        seed: 5,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn metis_cuts_a_grid_into_quadrants() {
    let ds = all_train_grid();
    let q = quality_of(&ds, true, &cfg(4, 1, PartitionMethod::Metis));
    assert_eq!((q.inter_server_cut, q.intra_server_cut), (20, 0), "{q:?}");
    assert_eq!(q.undirected_edges, 180);
    assert_eq!(q.vertex_balance, 1.0);
    let q = quality_of(&ds, true, &cfg(2, 2, PartitionMethod::Metis));
    assert_eq!((q.inter_server_cut, q.intra_server_cut), (10, 10), "{q:?}");
    // 4 quadrants of 25, each with a halo of 10 (5 across each of two borders).
    assert!((q.replication_factor - 1.4).abs() < 1e-9, "{q:?}");
    assert!((q.server_replication_factor - 1.2).abs() < 1e-9, "{q:?}");

    // With a random 60% training set the second constraint costs a little cut at most.
    let q = quality_of(
        &grid_dataset(10, 10, 0),
        true,
        &cfg(4, 1, PartitionMethod::Metis),
    );
    assert!(q.inter_server_cut <= 30, "{q:?}");
}

#[test]
fn metis_beats_random_on_a_power_law_graph() {
    let ds = power_law(3000);
    let metis = quality_of(&ds, true, &cfg(4, 2, PartitionMethod::Metis));
    let random = quality_of(&ds, true, &cfg(4, 2, PartitionMethod::Random));
    assert!(
        (metis.inter_server_cut as f64) < 0.6 * random.inter_server_cut as f64,
        "metis {metis:?}\nrandom {random:?}"
    );
    assert!(metis.replication_factor < random.replication_factor);
    // Multi-constraint balance keeps vertices and training vertices near even.
    assert!(
        metis.vertex_balance < 1.1 && metis.train_balance < 1.15,
        "{metis:?}"
    );
}

#[test]
fn spring_replicates_less_than_random() {
    let ds = power_law(3000);
    let spring = quality_of(&ds, true, &cfg(2, 2, PartitionMethod::Spring));
    let random = quality_of(&ds, true, &cfg(2, 2, PartitionMethod::Random));
    assert!(
        spring.replication_factor < random.replication_factor,
        "spring {spring:?}\nrandom {random:?}"
    );
    assert!(spring.inter_server_cut < random.inter_server_cut);
    // List scheduling with β = 1.05 keeps parts within a few percent.
    assert!(spring.vertex_balance < 1.15, "{spring:?}");
}

#[test]
fn assignments_are_deterministic_and_in_range() {
    let ds = power_law(1000);
    for &method in PartitionMethod::ALL {
        let c = cfg(3, 2, method);
        let a = assign(&ds.view(), true, &c).unwrap();
        assert_eq!(a, assign(&ds.view(), true, &c).unwrap(), "{method}");
        assert!(a.server.iter().all(|&s| s < 3) && a.device.iter().all(|&d| d < 2));
    }
}

#[test]
fn directed_graphs_are_partitioned_on_their_undirected_view() {
    // A directed 6x6 grid (edges only rightwards and downwards) plus a reciprocated pair.
    let sym = grid_dataset(6, 6, 0);
    let mut edges = Vec::new();
    for dst in 0..36u32 {
        for &src in sym.graph.view().neighbors(dst) {
            if src < dst || (src, dst) == (1, 0) {
                edges.push((src, dst));
            }
        }
    }
    let mut ds = sym.clone();
    ds.graph = grandis_store::graph_from_edges(36, edges, EdgeOptions::default()).unwrap();
    assert!(!ds.graph.view().is_symmetric());
    ds.split.train = (0..36).collect();
    ds.split.val.clear();
    ds.split.test.clear();
    let q = quality_of(&ds, false, &cfg(2, 1, PartitionMethod::Metis));
    // The pair {0, 1} exists in both directions but is one undirected edge.
    assert_eq!(q.undirected_edges, 60);
    assert_eq!(q.inter_server_cut, 6, "{q:?}");
    let q = quality_of(&ds, false, &cfg(2, 2, PartitionMethod::Spring));
    assert!(q.inter_server_cut + q.intra_server_cut <= q.undirected_edges);
}

#[test]
fn partition_directory_round_trips_and_is_isomorphic() {
    let root = tempfile::tempdir().unwrap();
    let src_dir = root.path().join("src");
    let ds = power_law(800);
    ds.write(&src_dir, false).unwrap();
    let original = Dataset::open(&src_dir).unwrap();
    // With locality clusters the rewrite streams into many more buckets than parts.
    let clustered = |m| PartitionConfig {
        cluster_vertices: Some(40),
        ..cfg(2, 3, m)
    };
    let configs = PartitionMethod::ALL
        .iter()
        .flat_map(|&m| [cfg(2, 3, m), clustered(m)]);
    for (i, config) in configs.enumerate() {
        let method = config.method;
        let out = root.path().join(format!("{}-{i}", method.name()));
        let report = partition_dataset(&src_dir, &out, &config, false).unwrap();
        let book = PartitionBook::open(&out).unwrap();
        // JSON floats may differ in the last bit; the counts must match exactly.
        let q = book.quality();
        assert_eq!(
            (q.inter_server_cut, q.intra_server_cut, q.undirected_edges),
            (
                report.quality.inter_server_cut,
                report.quality.intra_server_cut,
                report.quality.undirected_edges
            )
        );
        assert!((q.replication_factor - report.quality.replication_factor).abs() < 1e-12);
        assert_eq!((book.num_servers(), book.num_devices()), (2, 3));
        assert_eq!(book.meta().source.files, original.manifest().files);
        let n = 800u32;

        // Bijection.
        let mut seen = vec![false; n as usize];
        for v in 0..n {
            let old = book.to_original(v);
            assert_eq!(book.to_new(old), v);
            assert!(!std::mem::replace(&mut seen[old as usize], true));
        }
        // Ranges: contiguous, server-major, covering, and agreeing with server_of/device_of.
        let mut next = 0;
        for s in 0..2 {
            let sr = book.server_range(s);
            assert_eq!(sr.start, next);
            for d in 0..3 {
                let r = book.range(s, d);
                assert_eq!(r.start, next);
                next = r.end;
                for v in r {
                    assert_eq!((book.server_of(v), book.device_of(v)), (s, d));
                }
            }
            assert_eq!(sr.end, next);
        }
        assert_eq!(next, n);

        // Isomorphism: every edge maps through old_to_new, features/labels move with vertices.
        let new = book.dataset().unwrap();
        new.verify().unwrap();
        let (a, b) = (original.view(), new.view());
        assert_eq!(a.graph.num_edges(), b.graph.num_edges());
        for dst in 0..n {
            for &src in a.graph.neighbors(dst) {
                assert!(b.graph.has_edge(book.to_new(src), book.to_new(dst)));
            }
        }
        // Rows exactly as the in-memory relabelling makes them (sorted, mapped).
        let r = Relabel {
            new_to_old: (0..n).map(|v| book.to_original(v)).collect(),
            old_to_new: (0..n).map(|v| book.to_new(v)).collect(),
            starts: Vec::new(),
            buckets: Vec::new(),
        };
        assert_eq!(b.graph.to_owned(), relabel_graph(a.graph, &r));
        for old in 0..n {
            let v = book.to_new(old);
            assert_eq!(a.feature_row(old), b.feature_row(v));
            assert_eq!(a.labels[old as usize], b.labels[v as usize]);
        }
        for (x, y) in [(a.train, b.train), (a.val, b.val), (a.test, b.test)] {
            let mut mapped: Vec<u32> = x.iter().map(|&v| book.to_new(v)).collect();
            mapped.sort_unstable();
            assert_eq!(mapped, y);
        }
        assert!(new.manifest().symmetric);
        assert!(new
            .manifest()
            .provenance
            .last()
            .unwrap()
            .contains(method.name()));
    }
}

#[test]
fn bad_requests_fail_clearly_and_leave_nothing() {
    let root = tempfile::tempdir().unwrap();
    let src_dir = root.path().join("src");
    grid_dataset(3, 3, 0).write(&src_dir, false).unwrap();
    let out = root.path().join("out");
    let err = |c: PartitionConfig, src: &Path| match partition_dataset(src, &out, &c, false) {
        Ok(_) => panic!("{c:?} on {} should fail", src.display()),
        Err(e) => e.to_string(),
    };
    let e = err(cfg(0, 1, PartitionMethod::Metis), &src_dir);
    assert!(e.contains("servers must be at least 1"), "{e}");
    let e = err(cfg(1, 0, PartitionMethod::Spring), &src_dir);
    assert!(e.contains("devices must be at least 1"), "{e}");
    let e = err(cfg(5, 2, PartitionMethod::Random), &src_dir);
    assert!(e.contains("10 parts") && e.contains("9 vertices"), "{e}");
    let e = err(
        cfg(2, 1, PartitionMethod::Metis),
        &root.path().join("missing"),
    );
    assert!(
        e.contains("missing") && e.contains("no such dataset"),
        "{e}"
    );
    assert!(!out.exists());
    // Only the source dataset is left in the root: no staging directories either.
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    // An existing output is refused without overwrite, replaced with it.
    partition_dataset(&src_dir, &out, &cfg(3, 3, PartitionMethod::Metis), false).unwrap();
    let e = err(cfg(1, 1, PartitionMethod::Metis), &src_dir);
    assert!(e.contains("already exists"), "{e}");
    partition_dataset(&src_dir, &out, &cfg(1, 1, PartitionMethod::Random), true).unwrap();
    assert_eq!(
        PartitionBook::open(&out).unwrap().meta().method,
        PartitionMethod::Random
    );
    let e = PartitionBook::open(root.path().join("nope"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no such partition directory"), "{e}");
}

/// Locality clusters reorder ids only inside each device's range: the ranges (and so every
/// part's vertex set) are those of the run without clusters, and each cluster is one
/// contiguous id range.
#[test]
fn locality_clusters_are_contiguous_inside_unchanged_parts() {
    let ds = generate_in_memory(&SynthConfig {
        nodes: 2000,
        seed: 3,
        ..Default::default()
    })
    .unwrap();
    let view = ds.view();
    let plain = cfg(2, 2, PartitionMethod::Metis);
    let clustered = PartitionConfig {
        cluster_vertices: Some(100),
        ..plain.clone()
    };
    let a = assign(&view, true, &plain).unwrap();
    let b = assign(&view, true, &clustered).unwrap();
    assert_eq!((&a.server, &a.device), (&b.server, &b.device));
    assert!(a.cluster.is_none());
    let (ra, rb) = (relabel(&a, 2, 2), relabel(&b, 2, 2));
    assert_eq!(ra.starts, rb.starts);
    let cluster = b.cluster.as_ref().unwrap();
    for p in 0..4 {
        let (lo, hi) = (rb.starts[p] as usize, rb.starts[p + 1] as usize);
        let mut old: Vec<u32> = rb.new_to_old[lo..hi].to_vec();
        let mut want: Vec<u32> = ra.new_to_old[lo..hi].to_vec();
        old.sort_unstable();
        want.sort_unstable();
        assert_eq!(old, want, "part {p} holds the same vertices");
        // Cluster ids along the range only ever increase: every cluster is contiguous.
        let ids: Vec<u32> = rb.new_to_old[lo..hi]
            .iter()
            .map(|&v| cluster[v as usize])
            .collect();
        assert!(ids.windows(2).all(|w| w[0] <= w[1]), "part {p}: {ids:?}");
        assert!(
            ids.last().copied().unwrap_or(0) >= 4,
            "part {p} has several clusters"
        );
    }
    let report = cluster_report(view.graph, &b, 2, 2).unwrap();
    assert!(report.count >= 16);
    assert!(report.edges_inside > 0);
    assert!(cluster_report(view.graph, &a, 2, 2).is_none());
    assert!(PartitionConfig {
        cluster_vertices: Some(0),
        ..plain
    }
    .validate(2000)
    .is_err());
}

/// METIS refuses a graph it would need more memory for than the machine has, naming the
/// alternative, before allocating anything; no check when the available memory is unknown.
#[test]
fn metis_beyond_memory_is_a_clear_error_naming_spring() {
    let ds = generate_in_memory(&SynthConfig {
        nodes: 500,
        seed: 1,
        ..Default::default()
    })
    .unwrap();
    let view = ds.view();
    let sub = Subgraph {
        graph: view.graph,
        symmetric: true,
        scope: None,
    };
    let entries = 500 + view.graph.num_edges() as u64;
    let need = entries * methods::METIS_BYTES_PER_ENTRY;
    let e = methods::check_metis_memory(&sub, Some(need - 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("use --method spring"), "{e}");
    assert!(e.contains("500 vertices"), "{e}");
    assert!(methods::check_metis_memory(&sub, Some(need)).is_ok());
    assert!(methods::check_metis_memory(&sub, None).is_ok());
}

/// Hop distances from `from` along in-neighbour rows (what ByteGNN's search follows).
fn hops_from(graph: grandis_store::CsrView<'_>, from: u32) -> Vec<u32> {
    let mut dist = vec![u32::MAX; graph.num_vertices()];
    dist[from as usize] = 0;
    let mut queue = std::collections::VecDeque::from([from]);
    while let Some(v) = queue.pop_front() {
        for &u in graph.neighbors(v) {
            if dist[u as usize] == u32::MAX {
                dist[u as usize] = dist[v as usize] + 1;
                queue.push_back(u);
            }
        }
    }
    dist
}

#[test]
fn bytegnn_blocks_are_their_centres_nearest_neighbourhoods() {
    // A 12x12 grid with five labelled vertices, blocks of radius 2.
    let mut ds = grid_dataset(12, 12, 0);
    ds.split = Split {
        train: vec![0, 77, 143],
        val: vec![30],
        test: vec![100],
    };
    let view = ds.view();
    let role = roles(&view);
    let whole = Subgraph {
        graph: view.graph,
        symmetric: true,
        scope: None,
    };
    let (block, blocks) =
        methods::bytegnn_blocks(&whole, 2, |l| role[l as usize] != methods::Role::Unlabelled);
    // Centres first, in id order: 0, 30, 77, 100, 143.
    let centres = [0u32, 30, 77, 100, 143];
    let dist: Vec<Vec<u32>> = centres.iter().map(|&c| hops_from(view.graph, c)).collect();
    for (b, &c) in centres.iter().enumerate() {
        assert_eq!(
            block[c as usize], b as u32,
            "centre {c} keeps its own block"
        );
    }
    for v in 0..144usize {
        let nearest = dist.iter().map(|d| d[v]).min().unwrap();
        let b = block[v] as usize;
        if nearest <= 2 {
            // Reached by the search: in the block of a centre at the nearest distance.
            assert!(b < centres.len(), "vertex {v} is within 2 hops of a centre");
            assert_eq!(dist[b][v], nearest, "vertex {v} joined a farther centre");
        } else {
            // Unreached vertices form blocks of their own, never a centre's.
            assert!(
                b >= centres.len(),
                "vertex {v} is {nearest} hops from every centre"
            );
        }
    }
    assert!(blocks > centres.len());
    // A block grown from an unclaimed vertex stays within 2 hops of its first member.
    let first_of = |b: u32| (0..144).find(|&v| block[v] == b).unwrap() as u32;
    for (v, &b) in block.iter().enumerate() {
        if b as usize >= centres.len() {
            assert!(hops_from(view.graph, first_of(b))[v] <= 2);
        }
    }
}

#[test]
fn bytegnn_balances_every_split_and_cuts_less_than_random() {
    let ds = power_law(3000);
    let c = cfg(2, 2, PartitionMethod::Bytegnn);
    let a = assign(&ds.view(), true, &c).unwrap();
    let parts = 4usize;
    let share = |ids: &[u32]| {
        let mut n = vec![0usize; parts];
        for &v in ids {
            n[a.part(v as usize, 2)] += 1;
        }
        *n.iter().max().unwrap() as f64 / (ids.len() as f64 / parts as f64)
    };
    let all: Vec<u32> = (0..3000).collect();
    // The vertex cap (β = 1.05, rounded up) and the split balance score.
    assert!(share(&all) <= 1.06, "vertices {}", share(&all));
    for (name, ids) in [
        ("train", &ds.split.train),
        ("val", &ds.split.val),
        ("test", &ds.split.test),
    ] {
        assert!(share(ids) < 1.25, "{name} balance {}", share(ids));
    }
    let bytegnn = quality_of(&ds, true, &c);
    let random = quality_of(&ds, true, &cfg(2, 2, PartitionMethod::Random));
    assert!(
        (bytegnn.inter_server_cut as f64) < 0.9 * random.inter_server_cut as f64,
        "bytegnn {bytegnn:?}\nrandom {random:?}"
    );
    // Zero hops would make every block a single vertex: refused.
    let zero = PartitionConfig {
        block_hops: 0,
        ..c.clone()
    };
    let e = assign(&ds.view(), true, &zero).unwrap_err().to_string();
    assert!(e.contains("block hops"), "{e}");
}

/// A partition directory is verified once per file version, like a dataset: a flipped id in
/// a map is caught by its checksum (and a map that is not the other's inverse by the
/// permutation check).
#[test]
fn partition_maps_are_verified_once_and_flips_are_caught() {
    let root = tempfile::tempdir().unwrap();
    let src_dir = root.path().join("src");
    power_law(300).write(&src_dir, false).unwrap();
    let out = root.path().join("part");
    partition_dataset(&src_dir, &out, &cfg(2, 1, PartitionMethod::Random), false).unwrap();
    let record = root.path().join("verified.json");
    let book = PartitionBook::open(&out).unwrap();
    assert_eq!(
        book.verify_once(&record).unwrap(),
        grandis_store::Verification::Verified
    );
    assert_eq!(
        book.verify_once(&record).unwrap(),
        grandis_store::Verification::Remembered
    );
    drop(book);
    let map = out.join(crate::book::NEW_TO_OLD_FILE);
    let mut bytes = std::fs::read(&map).unwrap();
    let n = bytes.len();
    bytes.swap(n - 4, n - 8);
    std::fs::write(&map, &bytes).unwrap();
    let book = PartitionBook::open(&out).unwrap();
    let err = book.verify_once(&record).unwrap_err().to_string();
    assert!(
        err.contains("new_to_old.u32") && err.contains("checksum"),
        "{err}"
    );
}
