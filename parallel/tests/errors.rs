//! Clear errors for impossible requests.

mod common;

use common::*;
use grandis_masking::Layout;
use grandis_models::ModelKind;
use grandis_parallel::{JobSpec, Mode, ParallelOptions, PartitionedGraph};
use grandis_partition::{PartitionBook, PartitionConfig, PartitionMethod};

fn err_of(r: anyhow::Result<impl Sized>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn more_ranks_than_vertices() {
    let ds = random_dataset(1, 3, 6, 2, 2);
    let view = ds.view();
    let e = err_of(PartitionedGraph::partition(
        &view,
        false,
        2,
        2,
        PartitionMethod::Random,
        0,
    ));
    assert!(e.contains("more than the 3 vertices"), "{e}");
    let layout = Layout::from_bounds(2, 2, &[0, 1, 2, 3, 3]).unwrap();
    let part = PartitionedGraph::identity(view.graph, layout).unwrap();
    let config = config(&view, ModelKind::Sage, 2);
    let e = err_of(parallel(view, &part, &config, &opts(1), Mode::Fb, None));
    assert!(e.contains("more than the 3 vertices"), "{e}");
    let layout = Layout::from_bounds(1, 3, &[0, 1, 1, 3]).unwrap();
    let part = PartitionedGraph::identity(view.graph, layout).unwrap();
    let e = err_of(parallel(view, &part, &config, &opts(1), Mode::Fb, None));
    assert!(
        e.contains("rank 1 (server 0, device 1) owns no vertex"),
        "{e}"
    );
}

#[test]
fn budget_too_small_for_k0() {
    let (ds, part) = random_case(2, 40, 120, 4, 3, 2, 1);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 2);
    let popts = ParallelOptions {
        job: JobSpec {
            mode: Mode::Flx,
            device_memory: Some(1000),
            ..JobSpec::default()
        },
        ..Default::default()
    };
    let e = err_of(grandis_parallel::train(
        view,
        &part,
        config,
        &opts(1),
        &popts,
        &mut |_| {},
    ));
    assert!(e.contains("1000"), "{e}");
    assert!(e.to_lowercase().contains("budget"), "{e}");
}

#[test]
fn bad_mode_and_k_combinations() {
    let (ds, part) = random_case(3, 30, 90, 4, 3, 2, 1);
    let view = ds.view();
    let sage = config(&view, ModelKind::Sage, 2);
    let e = err_of(parallel(view, &part, &sage, &opts(1), Mode::Fb, Some(1)));
    assert!(e.contains("needs --mode flx"), "{e}");
    let e = err_of(parallel(view, &part, &sage, &opts(1), Mode::Flx, Some(3)));
    assert!(e.contains("more than the model's 2 layers"), "{e}");
    let mlp = config(&view, ModelKind::Mlp, 2);
    let e = err_of(parallel(view, &part, &mlp, &opts(1), Mode::Fb, None));
    assert!(e.contains("mlp"), "{e}");
}

#[test]
fn partition_dir_of_another_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let a = random_dataset(4, 30, 90, 4, 3)
        .write(tmp.path().join("a"), false)
        .unwrap();
    let b = random_dataset(5, 30, 90, 4, 3)
        .write(tmp.path().join("b"), false)
        .unwrap();
    let pdir = tmp.path().join("a-parts");
    grandis_partition::partition_dataset(
        a.dir(),
        &pdir,
        &PartitionConfig {
            servers: 2,
            devices: 1,
            method: PartitionMethod::Random,
            ..Default::default()
        },
        false,
    )
    .unwrap();
    let book = PartitionBook::open(&pdir).unwrap();
    // The matching dataset works: its mapped graph is the relabelling of the dataset's, and
    // it runs exactly like single mode.
    let part = PartitionedGraph::from_book(&book, &a).unwrap();
    let built = PartitionedGraph::relabel(
        a.graph(),
        book.new_to_old().to_vec(),
        part.layout.clone(),
        "built",
    )
    .unwrap();
    assert!(matches!(part.graph, grandis_parallel::PartGraph::Mapped(_)));
    assert_eq!(part.graph.view().offsets, built.graph.view().offsets);
    assert_eq!(part.graph.view().indices, built.graph.view().indices);
    let view = a.view();
    let config = config(&view, ModelKind::Gcn, 2);
    let reference = single(view, &config, &opts(2));
    check_exact(
        view,
        &part,
        &config,
        &opts(2),
        &reference,
        Mode::Flx,
        Some(1),
    );
    let e = err_of(PartitionedGraph::from_book(&book, &b));
    assert!(e.contains("different dataset"), "{e}");
    // A damaged relabelled graph in the directory is an error naming it, not a wrong run.
    let indices = std::fs::read_dir(pdir.join(grandis_partition::DATASET_DIR))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .ends_with(".indices")
        })
        .expect("the relabelled dataset has an indices file");
    let mut bytes = std::fs::read(&indices).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x5a;
    std::fs::write(&indices, bytes).unwrap();
    let e = err_of(PartitionedGraph::from_book(&book, &a));
    assert!(e.contains("relabelled dataset"), "{e}");
}

#[test]
fn explicit_budget_is_enforced_by_the_memory_model_in_every_mode() {
    let (ds, part) = random_case(4, 120, 600, 8, 3, 2, 2);
    let view = ds.view();
    let config = config(&view, ModelKind::Sage, 2);
    for (mode, batch_size) in [(Mode::Fb, None), (Mode::Cob, Some(16)), (Mode::Mb, Some(8))] {
        let popts = |device_memory| ParallelOptions {
            job: JobSpec {
                mode,
                batch_size,
                device_memory,
                ..JobSpec::default()
            },
            ..Default::default()
        };
        let run = |p: &ParallelOptions| {
            grandis_parallel::train(view, &part, config.clone(), &opts(1), p, &mut |_| {})
        };
        // The largest per-step estimate of any rank is exactly what the budget must cover.
        let need = peak_model_bytes(&run(&popts(None)).unwrap());
        let e = err_of(run(&popts(Some(need - 1))));
        assert!(e.contains("out of memory (memory model)"), "{mode:?}: {e}");
        assert!(e.contains(&format!("needs {need} bytes")), "{mode:?}: {e}");
        run(&popts(Some(need))).unwrap();
    }
}
