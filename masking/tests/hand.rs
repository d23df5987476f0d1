//! A hand-checked case in the spirit of the paper's Figure 7c: 8 vertices, two servers
//! (inner vertices 0-3 and 4-7), two devices each, k = 2. Every expected value below was
//! worked out by hand from the placement rule documented on `PlanContext::flx_plan`.

use grandis_masking::{
    InputCopy, Layout, ModelDims, PlanContext, SplitMembership, SPLIT_TRAIN, SPLIT_VAL,
};
use grandis_store::CsrGraph;

/// Undirected edges 0-1, 1-2, 1-3, 2-4, 3-5, 4-5, 5-6, 6-7, 4-7 (stored in both directions).
fn graph() -> CsrGraph {
    let edges = [
        (0, 1),
        (1, 2),
        (1, 3),
        (2, 4),
        (3, 5),
        (4, 5),
        (5, 6),
        (6, 7),
        (4, 7),
    ];
    grandis_masking::testing::undirected(8, &edges)
}

fn ctx(g: &CsrGraph) -> PlanContext<'_> {
    let splits = SplitMembership::from_lists(8, &[1, 4, 6], &[2, 7], &[0]).unwrap();
    grandis_masking::testing::two_by_two_of_eight(g, splits)
}

#[test]
fn fb_plan_by_hand() {
    let g = graph();
    let fb = ctx(&g).fb_plan().unwrap();
    let d = &fb.devices[2]; // server 1, device 0: owns 4, 5
    assert_eq!(d.n_owned, 2);
    // in(4) = {2, 5, 7}, in(5) = {3, 4, 6}: halo 2, 3 from rank 1 and 6, 7 from rank 3.
    assert_eq!(d.global_ids, vec![4, 5, 2, 3, 6, 7]);
    assert_eq!(d.halo.len(), 2);
    assert_eq!((d.halo[0].peer, d.halo[0].rows.clone()), (1, 2..4));
    assert_eq!((d.halo[1].peer, d.halo[1].rows.clone()), (3, 4..6));
    assert_eq!(d.row(0), &[1, 2, 5]); // 5, 2, 7
    assert_eq!(d.row(1), &[0, 3, 4]); // 4, 3, 6
                                      // Rank 1 (owns 2, 3) sends 2 and 3 to rank 2, as its local rows 0 and 1.
    let r1 = &fb.devices[1];
    let to2 = r1.sends.iter().find(|s| s.peer == 2).unwrap();
    assert_eq!(to2.rows, vec![0, 1]);
    assert_eq!(d.in_degree, vec![3, 3, 2, 2, 2, 2]);
    assert_eq!(d.loss_rows(), vec![0]); // vertex 4 trains
    assert_eq!(d.inner_rows_with(SPLIT_VAL), Vec::<u32>::new());
    assert_eq!(fb.devices[3].inner_rows_with(SPLIT_VAL), vec![1]); // vertex 7
    assert!(d.masks.is_empty());
    let stats = fb.stats();
    assert_eq!(stats.devices[2].halo_rows.intra_server, 2);
    assert_eq!(stats.devices[2].halo_rows.inter_server, 2);
}

#[test]
fn flx_plan_k2_by_hand() {
    let g = graph();
    let c = ctx(&g);
    let plan = c.preload_plan(2, 2).unwrap();
    let flx = plan.flx.as_ref().unwrap();
    // Server 1: level 0 = {4..7}, level 1 = {2, 3}, level 2 = {1}: extracted 1..=7 (Fig. 7c).
    assert_eq!(flx.extracted(1), vec![1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(flx.servers[1].level_sizes, vec![4, 2, 1]);
    assert_eq!(flx.servers[1].replicated, 3);
    // Server 0: level 1 = {4, 5}, level 2 = {6, 7}: everything.
    assert_eq!(flx.extracted(0), (0..8).collect::<Vec<_>>());

    // Placement on server 1 (cap 3 at level 1, 4 at level 2): 2 -> device 0 (its reader 4
    // is there), 3 -> device 1 (device 0 is full), 1 -> device 0 (tie 1:1, equal load,
    // lower index).
    let d0 = &flx.devices[2];
    let d1 = &flx.devices[3];
    assert_eq!(d0.global_ids[..d0.n_owned], [4, 5, 2, 1]);
    assert_eq!(d0.level[..d0.n_owned], [0, 0, 1, 2]);
    assert_eq!(d1.global_ids[..d1.n_owned], [6, 7, 3]);
    // Halo of device 0: rows 4, 5 (level 0) and 2 (level 1) read 7; 3, 6 -- all need 0.
    assert_eq!(d0.global_ids[d0.n_owned..], [3, 6, 7]);
    assert_eq!(d0.halo_need, vec![0, 0, 0]);
    // Halo of device 1: 6 reads 5, 7 reads 4 (need 0); 3 reads 1 and 5 (1 needs level 1).
    assert_eq!(d1.global_ids[d1.n_owned..], [4, 5, 1]);
    assert_eq!(d1.halo_need, vec![0, 0, 1]);
    assert_eq!(d0.halo.len(), 1);
    assert_eq!(d0.halo[0].peer, 3);
    // Vertex 1 (level 2) has no row: it is only ever a raw-feature input.
    assert_eq!(d0.row(3), &[] as &[u32]);
    assert_eq!(d0.row(2), &[0, 3]); // 2 reads 4 (row 0) and 1 (row 3)

    // Masks: layer 0 computes levels <= 1, layer 1 levels <= 0 (the inner vertices).
    assert_eq!(d0.valid_output_rows(0), vec![0, 1, 2]);
    assert_eq!(d0.valid_output_rows(1), vec![0, 1]);
    assert_eq!(d1.valid_output_rows(0), vec![0, 1, 2]);
    assert_eq!(d1.valid_output_rows(1), vec![0, 1]);
    assert_eq!(d1.recv_rows(0, 0), 3..6);
    assert_eq!(d1.recv_rows(1, 0), 3..5); // vertex 1 is not needed at layer 1
                                          // Send lists mirror the halo groups: device 1 sends 3, 6, 7 = its rows 2, 0, 1.
    assert_eq!(d1.sends[0].peer, 2);
    assert_eq!(d1.sends[0].rows, vec![2, 0, 1]);
    assert_eq!(d0.sends[0].rows, vec![0, 1, 3]); // 4, 5, 1
    assert_eq!(d0.send_rows(1, 0), &[0, 1]);

    // Intra-server only, and k = L: no inter-server traffic at any layer.
    let dims = small_dims();
    for l in 0..2 {
        assert_eq!(plan.forward_exchange_bytes(l, &dims).inter_server, 0);
    }
    // Server 0 by hand: level 1 = {4 -> dev 1, 5 -> dev 0}, level 2 = {6 -> dev 0, 7 -> dev 1};
    // dev 0 receives [2, 3 | 4] (needs 0, 0, 1), dev 1 receives [1, 5] (needs 0, 0).
    let s0 = &flx.devices[0];
    assert_eq!(s0.global_ids, vec![0, 1, 5, 6, 2, 3, 4]);
    assert_eq!(s0.halo_need, vec![0, 0, 1]);
    assert_eq!(flx.devices[1].global_ids, vec![2, 3, 4, 7, 1, 5]);
    // Layer 0 moves every halo row (server 0: 3 + 2, server 1: 3 + 3) of F = 3 floats;
    // layer 1 only need-0 rows (server 0: 2 + 2, server 1: 3 + 2) of H = 4 floats.
    assert_eq!(
        plan.forward_exchange_bytes(0, &dims).intra_server,
        11 * 3 * 4
    );
    assert_eq!(
        plan.forward_exchange_bytes(1, &dims).intra_server,
        9 * 4 * 4
    );
    assert!(plan.reshape_is_identity_prefix());
    assert_eq!(plan.reshape_map(2), vec![0, 1]);
    assert_eq!(plan.reshape_layer(), None);
    assert_eq!(d0.loss_rows(), vec![0]);
    assert_eq!(d0.split[3] & SPLIT_TRAIN, SPLIT_TRAIN); // replicated 1 trains, not a loss row
}

#[test]
fn reshape_switches_to_fb_after_k() {
    let g = graph();
    let plan = ctx(&g).preload_plan(1, 3).unwrap();
    assert_eq!(plan.reshape_layer(), Some(1));
    assert!(plan.reshape_is_identity_prefix());
    assert!(plan.device_plan(0, 2).is_masked(0));
    assert!(std::ptr::eq(plan.device_plan(1, 2), &plan.fb.devices[2]));
    assert!(ctx(&g).preload_plan(4, 3).is_err());
    assert!(ctx(&g).flx_plan(0).is_err());
}

#[test]
fn bad_inputs_give_clear_errors() {
    let g = graph();
    let wrong = Layout::even(9, 1, 2).unwrap();
    let e = PlanContext::new(g.view(), wrong, SplitMembership::none(8))
        .err()
        .unwrap();
    assert!(e.to_string().contains("8 vertices"), "{e}");
    let e = SplitMembership::from_lists(8, &[1], &[9], &[]).unwrap_err();
    assert!(e.to_string().contains("val split: vertex id 9"), "{e}");
    let dims = small_dims();
    let layout = Layout::from_bounds(2, 2, &[0, 2, 4, 6, 8]).unwrap();
    let e = grandis_masking::choose_k(g.view(), &layout, &dims, 10).unwrap_err();
    assert!(
        e.to_string()
            .contains("too small even for plain FB (k = 0)"),
        "{e}"
    );
    let ok = grandis_masking::choose_k(g.view(), &layout, &dims, u64::MAX).unwrap();
    assert_eq!(ok.k, 2);
    assert!(
        ok.reason.contains("no inter-server feature traffic"),
        "{}",
        ok.reason
    );
    let bad = ModelDims { layers: 0, ..dims };
    assert!(grandis_masking::choose_k(g.view(), &layout, &bad, u64::MAX).is_err());
}

/// A link-prediction job's gathered output embeddings and their gradient are priced on every
/// device, beside the plan's buffers, and k is chosen with them: a budget that fits every k
/// for node classification fits none once 1,000 embedding values are held.
#[test]
fn link_embeddings_are_priced_on_every_device() {
    let g = graph();
    let layout = Layout::from_bounds(2, 2, &[0, 2, 4, 6, 8]).unwrap();
    let node = small_dims();
    let link = ModelDims {
        link_embedding_values: 1000,
        ..node
    };
    let all = grandis_masking::choose_k(g.view(), &layout, &node, u64::MAX).unwrap();
    let with_link = grandis_masking::choose_k(g.view(), &layout, &link, u64::MAX).unwrap();
    for (a, b) in all.estimates.iter().zip(&with_link.estimates) {
        for (d, e) in a.devices.iter().zip(&b.devices) {
            assert_eq!(d.link_decoder, 0);
            assert_eq!(e.link_decoder, 2 * 1000 * 4);
            assert_eq!(e.total, d.total + 8000, "rank {}", d.rank);
        }
    }
    let node_peak = all.estimates.iter().map(|e| e.max_bytes).max().unwrap();
    assert!(grandis_masking::choose_k(g.view(), &layout, &node, node_peak).is_ok());
    assert!(grandis_masking::choose_k(g.view(), &layout, &link, node_peak).is_err());
}

/// A sample that declares its levels is held to them: ranges that do not cut its vertices,
/// a level out of global-id order, or levels that do not fit the extraction's targets and
/// hops are clear errors, not plans built on a wrong claim.
#[test]
fn declared_sample_levels_are_checked() {
    use grandis_masking::{Edges, ExtractionSpec, SampledEdges};
    // Target 1 (server 0) keeps in-edges from 0 and 2; vertices numbered 1 | 0, 2.
    let sample = || {
        SampledEdges::from_blocks(
            vec![1, 0, 2],
            1,
            vec![0, 2],
            vec![1, 2],
            Some((1, vec![1, 1])),
        )
        .unwrap()
    };
    let e = sample().with_levels(vec![0, 1, 2]).unwrap_err();
    assert!(e.to_string().contains("do not cut 3 vertices"), "{e}");
    let e = SampledEdges::from_blocks(vec![1, 2, 0], 1, vec![0, 2], vec![1, 2], None)
        .unwrap()
        .with_levels(vec![0, 1, 3])
        .unwrap_err();
    assert!(
        e.to_string().contains("level 1 lists vertex 2 before 0"),
        "{e}"
    );
    let g = graph();
    let cx = ctx(&g);
    let spec = |starts: Vec<usize>| ExtractionSpec {
        server: 0,
        targets: vec![1],
        hops: 1,
        edges: Edges::Sampled(sample().with_levels(starts).unwrap()),
    };
    let declared = cx.extract_device_plan(&spec(vec![0, 1, 3]), 0).unwrap();
    let scanned = cx
        .extract_device_plan(
            &ExtractionSpec {
                edges: Edges::Sampled(sample()),
                ..spec(vec![0, 1, 3])
            },
            0,
        )
        .unwrap();
    assert_eq!(declared, scanned);
    let e = cx
        .extract_device_plan(&spec(vec![0, 1, 2, 3]), 0)
        .unwrap_err();
    assert!(
        e.to_string().contains("do not fit 1 targets over 1 hops"),
        "{e}"
    );
    // Levels that do not start with the targets: vertex 0 leads, the target is vertex 1.
    let misled = SampledEdges::from_blocks(vec![0, 1, 2], 2, vec![0, 0, 2], vec![0, 2], None)
        .unwrap()
        .with_levels(vec![0, 1, 3])
        .unwrap();
    let e = cx
        .extract_device_plan(
            &ExtractionSpec {
                edges: Edges::Sampled(misled),
                ..spec(vec![0, 1, 3])
            },
            0,
        )
        .unwrap_err();
    assert!(e.to_string().contains("must lead the sample"), "{e}");
}

/// The 2-layer model (3 features, 4 hidden, 2 classes) the hand cases price.
fn small_dims() -> ModelDims {
    ModelDims {
        layers: 2,
        features: 3,
        hidden: 4,
        classes: 2,
        input_copy: InputCopy::None,
        attention: None,
        link_embedding_values: 0,
        relations: 0,
    }
}
