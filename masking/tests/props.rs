//! Property tests over random graphs and random layouts: the structural invariants of the FB
//! and FLX plans, the exactness invariant of the masks, and the memory model.

use std::collections::{BTreeSet, HashMap};

use grandis_masking::testing::{self, Case, CaseBounds};
use grandis_masking::{
    choose_k, owned_rows_floor, DevicePlan, InputCopy, MaskingError, ModelDims, PlanContext,
};
use proptest::prelude::*;

fn case() -> impl Strategy<Value = Case> {
    testing::case(CaseBounds {
        max_servers: 3,
        max_devices: 4,
        max_vertices: 48,
        edges_per_vertex: 3,
    })
}

fn ctx(c: &Case) -> PlanContext<'_> {
    c.ctx()
}

/// Reference k-hop in-neighbourhood of a server: vertex -> distance.
fn khop(c: &Case, server: usize, k: usize) -> HashMap<u32, u8> {
    let g = c.graph.view();
    let mut dist: HashMap<u32, u8> = c.layout.server_range(server).map(|v| (v, 0)).collect();
    let mut frontier: Vec<u32> = dist.keys().copied().collect();
    for d in 1..=k {
        let mut next = Vec::new();
        for v in frontier {
            for &u in g.neighbors(v) {
                if let std::collections::hash_map::Entry::Vacant(e) = dist.entry(u) {
                    e.insert(d as u8);
                    next.push(u);
                }
            }
        }
        frontier = next;
    }
    dist
}

/// Local id space, metadata, halo layout and send/halo pairing, common to every plan.
fn check_common(c: &Case, plans: &[DevicePlan]) -> Result<(), TestCaseError> {
    let g = c.graph.view();
    let n = g.num_vertices() as u32;
    for d in plans {
        let nl = d.n_local();
        prop_assert!(d.n_inner <= d.n_owned && d.n_owned <= nl);
        prop_assert_eq!(d.level.len(), nl);
        prop_assert_eq!(d.in_degree.len(), nl);
        prop_assert_eq!(d.split.len(), d.n_owned);
        // Global <-> local are inverse maps, and only held vertices map.
        for (r, &gid) in d.global_ids.iter().enumerate() {
            prop_assert_eq!(d.local_of(gid), Some(r as u32));
            prop_assert_eq!(d.in_degree[r] as usize, g.degree(gid));
        }
        let held: BTreeSet<u32> = d.global_ids.iter().copied().collect();
        prop_assert_eq!(held.len(), nl);
        for v in 0..n {
            prop_assert_eq!(d.local_of(v).is_some(), held.contains(&v));
        }
        // Inner rows are the layout range, in order.
        let inner: Vec<u32> = c.layout.range(d.rank).collect();
        prop_assert_eq!(&d.global_ids[..d.n_inner], &inner[..]);
        // Graph: n_owned rows, columns sorted and local, each non-empty row is the complete
        // in-neighbourhood (every in-edge exactly once).
        prop_assert_eq!(d.graph.offsets.len(), d.n_owned + 1);
        for i in 0..d.n_owned as u32 {
            let row = d.row(i);
            prop_assert!(row.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(row.iter().all(|&x| (x as usize) < nl));
            if !row.is_empty() || g.degree(d.global_ids[i as usize]) == 0 {
                let mut back: Vec<u32> = row.iter().map(|&x| d.global_ids[x as usize]).collect();
                back.sort_unstable();
                prop_assert_eq!(&back[..], g.neighbors(d.global_ids[i as usize]));
            }
        }
        // Halo groups: contiguous, ascending peers, cover n_owned..n_local, sorted by
        // (need, global), each vertex owned by its peer.
        let mut next = d.n_owned as u32;
        let mut last_peer = None;
        for grp in &d.halo {
            prop_assert_eq!(grp.rows.start, next);
            prop_assert!(grp.rows.end > grp.rows.start);
            prop_assert!(last_peer < Some(grp.peer));
            prop_assert!(grp.peer != d.rank);
            last_peer = Some(grp.peer);
            next = grp.rows.end;
            let p = &plans[grp.peer];
            let keys: Vec<(u8, u32)> = grp
                .rows
                .clone()
                .map(|r| {
                    (
                        d.halo_need[r as usize - d.n_owned],
                        d.global_ids[r as usize],
                    )
                })
                .collect();
            prop_assert!(keys.windows(2).all(|w| w[0] < w[1]));
            // What p sends to d is exactly d's group from p, in the same order.
            let s = p.sends.iter().find(|s| s.peer == d.rank);
            prop_assert!(s.is_some());
            let sent: Vec<u32> = s
                .unwrap()
                .rows
                .iter()
                .map(|&r| {
                    assert!((r as usize) < p.n_owned);
                    p.global_ids[r as usize]
                })
                .collect();
            prop_assert_eq!(
                &sent[..],
                &d.global_ids[grp.rows.start as usize..grp.rows.end as usize]
            );
        }
        prop_assert_eq!(next as usize, nl);
        // No send list without a matching halo group.
        for s in &d.sends {
            prop_assert!(plans[s.peer].halo_from(d.rank).is_some());
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn fb_plan_invariants(c in case()) {
        let fb = ctx(&c).fb_plan().unwrap();
        check_common(&c, &fb.devices)?;
        let g = c.graph.view();
        let mut loss = Vec::new();
        for d in &fb.devices {
            prop_assert_eq!(d.n_inner, d.n_owned);
            prop_assert!(d.masks.is_empty());
            // Every owned row is complete and the halo is exactly the foreign in-neighbours.
            let mut foreign = BTreeSet::new();
            for i in 0..d.n_owned {
                let v = d.global_ids[i];
                prop_assert_eq!(d.row(i as u32).len(), g.degree(v));
                for &u in g.neighbors(v) {
                    if c.layout.owner(u) != d.rank {
                        foreign.insert(u);
                    }
                }
            }
            let halo: BTreeSet<u32> = d.global_ids[d.n_owned..].iter().copied().collect();
            prop_assert_eq!(halo, foreign);
            prop_assert!(d.halo.iter().all(|grp| d.global_ids[grp.rows.start as usize..grp.rows.end as usize]
                .iter().all(|&u| c.layout.owner(u) == grp.peer)));
            loss.extend(d.loss_rows().into_iter().map(|r| d.global_ids[r as usize]));
        }
        loss.sort_unstable();
        prop_assert_eq!(loss, c.train.clone());
    }

    #[test]
    fn flx_plan_invariants(c in case(), k in 1usize..=3, extra in 0usize..=1) {
        let layers = k + extra;
        let cx = ctx(&c);
        let plan = cx.preload_plan(k, layers).unwrap();
        let flx = plan.flx.as_ref().unwrap();
        check_common(&c, &flx.devices)?;
        let g = c.graph.view();
        for s in 0..c.layout.servers() {
            let reference = khop(&c, s, k);
            let mut want: Vec<u32> = reference.keys().copied().collect();
            want.sort_unstable();
            // Extracted set == k-hop in-neighbourhood, partitioned over the server's devices.
            prop_assert_eq!(flx.extracted(s), want.clone());
            let owned_total: usize = flx.devices.iter().filter(|d| d.server == s).map(|d| d.n_owned).sum();
            prop_assert_eq!(owned_total, want.len());
            for d in flx.devices.iter().filter(|d| d.server == s) {
                for (r, &gid) in d.global_ids.iter().enumerate() {
                    prop_assert_eq!(d.level[r], reference[&gid]);
                }
                // Intra-server only.
                prop_assert!(d.halo.iter().all(|grp| flx.devices[grp.peer].server == s));
                prop_assert!(d.sends.iter().all(|sl| flx.devices[sl.peer].server == s));
            }
        }
        for d in &flx.devices {
            prop_assert_eq!(d.masks.len(), k);
            for (l, m) in d.masks.iter().enumerate() {
                prop_assert!(m.valid_owned as usize <= d.n_owned);
                prop_assert_eq!(m.recv.len(), d.halo.len());
                prop_assert_eq!(m.send.len(), d.sends.len());
                for (gi, grp) in d.halo.iter().enumerate() {
                    prop_assert!(m.recv[gi] as usize <= grp.rows.len());
                }
                for (si, sl) in d.sends.iter().enumerate() {
                    prop_assert!(m.send[si] as usize <= sl.rows.len());
                    // The prefix sent is exactly the prefix the receiver expects.
                    let p = &flx.devices[sl.peer];
                    let gi = p.halo.iter().position(|grp| grp.peer == d.rank).unwrap();
                    let recv: Vec<u32> = p.recv_rows(l, gi).map(|r| p.global_ids[r as usize]).collect();
                    let sent: Vec<u32> = d.send_rows(l, si).iter().map(|&r| d.global_ids[r as usize]).collect();
                    prop_assert_eq!(recv, sent.clone());
                    // Rows sent before layer l >= 1 are valid outputs of layer l - 1 at the sender.
                    if l > 0 {
                        let valid = d.valid_owned(l - 1).end;
                        prop_assert!(d.send_rows(l, si).iter().all(|&r| r < valid));
                    }
                }
                // Exactness: every valid output row has its whole in-neighbourhood locally,
                // and each of those inputs is exact (input bitmap) at this layer.
                let inputs = d.input_bitmap(l);
                prop_assert_eq!(inputs.len(), d.n_local());
                for i in d.valid_output_rows(l) {
                    prop_assert!((i as usize) < d.n_owned);
                    let v = d.global_ids[i as usize];
                    prop_assert!(usize::from(d.level[i as usize]) + l < k);
                    let mut back: Vec<u32> = d.row(i).iter().map(|&x| d.global_ids[x as usize]).collect();
                    back.sort_unstable();
                    prop_assert_eq!(&back[..], g.neighbors(v));
                    for &x in d.row(i) {
                        prop_assert!(inputs[x as usize], "row {} reads inexact input {} at layer {}", i, x, l);
                        if l > 0 {
                            // The input is a valid output of layer l - 1 on its owner.
                            let gid = d.global_ids[x as usize];
                            let owner = if (x as usize) < d.n_owned { d } else {
                                &flx.devices[d.halo.iter().find(|grp| grp.rows.contains(&x)).unwrap().peer]
                            };
                            let at = owner.local_of(gid).unwrap();
                            prop_assert!(at < owner.valid_owned(l - 1).end);
                        }
                    }
                }
                // Rows outside the mask are exactly the deeper levels.
                for i in d.valid_owned(l).end as usize..d.n_owned {
                    prop_assert!(usize::from(d.level[i]) + l >= k);
                }
            }
        }
        // Reshape: inner rows first, identical to the FB plan's owned rows.
        prop_assert!(plan.reshape_is_identity_prefix());
        for r in 0..c.layout.num_ranks() {
            let map = plan.reshape_map(r);
            prop_assert_eq!(map, (0..plan.fb.devices[r].n_owned as u32).collect::<Vec<_>>());
        }
        // The last masked layer outputs exactly the inner vertices: with k = L, every vertex
        // exactly once over all servers.
        let mut last: Vec<u32> = flx.devices.iter()
            .flat_map(|d| d.valid_output_rows(k - 1).into_iter().map(|r| d.global_ids[r as usize]))
            .collect();
        last.sort_unstable();
        prop_assert_eq!(last, (0..g.num_vertices() as u32).collect::<Vec<_>>());
        if k == layers {
            for l in 0..layers {
                prop_assert_eq!(plan.forward_exchange_bytes(l, &ModelDims { layers, features: 2, hidden: 3, classes: 2, input_copy: InputCopy::None, attention: None, link_embedding_values: 0, relations: 0 }).inter_server, 0);
            }
        }
        // Nesting: the plan for k is the restriction of the plan for k + 1.
        let bigger = cx.flx_plan(k + 1).unwrap();
        for (a, b) in flx.devices.iter().zip(&bigger.devices) {
            let owned_b: BTreeSet<u32> = b.global_ids[..b.n_owned].iter().copied().collect();
            prop_assert!(a.global_ids[..a.n_owned].iter().all(|v| owned_b.contains(v)));
            let held_b: BTreeSet<u32> = b.global_ids.iter().copied().collect();
            prop_assert!(a.global_ids.iter().all(|v| held_b.contains(v)));
        }
    }

    #[test]
    fn memory_model_monotone_and_choose_k(
        c in case(),
        layers in 1usize..=3,
        f in 1usize..=16,
        h in 1usize..=16,
        pick in 0usize..=3,
    ) {
        let dims = ModelDims { layers, features: f, hidden: h, classes: 3, input_copy: InputCopy::None, attention: None, link_embedding_values: 0, relations: 0 };
        let cx = ctx(&c);
        let est: Vec<_> = (0..=layers).map(|k| cx.preload_plan(k, layers).unwrap().estimate(&dims)).collect();
        // Only the floor choose_k stops on is monotone in k (masked layers cost their valid
        // prefix, so totals may dip).
        for w in est.windows(2) {
            for (a, b) in w[0].devices.iter().zip(&w[1].devices) {
                prop_assert!(a.features <= b.features && a.metadata <= b.metadata, "rank {}: {:?} vs {:?}", a.rank, a, b);
            }
        }
        for e in &est {
            for t in &e.devices {
                prop_assert_eq!(t.total, t.features + t.activations + t.backward_scratch
                    + t.halo_buffers + t.graph + t.metadata + t.params);
                // The floor a planner prunes static plans with never exceeds a real one.
                let owned = c.layout.range(t.rank).len() as u64;
                prop_assert!(owned_rows_floor(&dims, owned) <= t.total, "rank {}: floor {} > {}",
                    t.rank, owned_rows_floor(&dims, owned), t.total);
            }
        }
        // Budget exactly at some k's estimate: choose_k must return the largest fitting k.
        let target = pick.min(layers);
        let budget = est[target].max_bytes;
        let want = (0..=layers).rev().find(|&k| est[k].max_bytes <= budget).unwrap();
        let choice = choose_k(c.graph.view(), &c.layout, &dims, budget).unwrap();
        prop_assert_eq!(choice.k, want);
        prop_assert_eq!(&choice.estimates[want], &est[want]);
        prop_assert!(!choice.reason.is_empty());
        if est[0].max_bytes > 0 {
            let err = choose_k(c.graph.view(), &c.layout, &dims, est[0].max_bytes - 1).unwrap_err();
            let is_budget = matches!(err, MaskingError::BudgetTooSmall { .. });
            prop_assert!(is_budget);
        }
    }
}
