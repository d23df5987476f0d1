//! Per-relation fanouts on a typed graph: a vertex draws each relation's in-neighbours on
//! their own, that relation's fanout of them (all when it has fewer), and the default fanout
//! of the relations not named; draws repeat for a round and change between rounds; a name no
//! relation has is refused with the relations listed, and so is a dataset without types.

use std::collections::BTreeMap;

use grandis_masking::{Edges, PlanContext};
use grandis_sampling::{dependency_sampler, Sampler, TypedGraph};
use grandis_store::{CsrGraph, EdgeOptions, Relation, TypeSchema, Types, VertexType};
use grandis_wire::Sampling;

/// Types a = {0, 1}, b = 2..14, c = 14..22; relations b -> a (from_b), c -> a (from_c) and
/// a -> b (to_b). Every b and c vertex points at both a vertices; vertex 0 at every b.
fn typed() -> (CsrGraph, Types) {
    let vt = |name: &str, count| VertexType::new(name, count, 1);
    let schema = TypeSchema {
        vertex_types: vec![vt("a", 2), vt("b", 12), vt("c", 8)],
        relations: vec![
            Relation::new("b", "from_b", "a"),
            Relation::new("c", "from_c", "a"),
            Relation::new("a", "to_b", "b"),
        ],
        target: "a".into(),
    };
    let types = Types::new(schema, 22, 1).unwrap();
    let edges = (2..22u32)
        .flat_map(|u| [(u, 0), (u, 1)])
        .chain((2..14u32).map(|v| (0, v)));
    let g = grandis_store::graph_from_edges(22, edges, EdgeOptions::default()).unwrap();
    (g, types)
}

use grandis_masking::testing::one_device as ctx;

fn sampler(
    fanouts: Vec<u32>,
    listed: &[(&str, Vec<u32>)],
    types: Option<&Types>,
    new_to_old: &[u32],
) -> Result<Box<dyn Sampler>, String> {
    let sampling = Sampling::Fanout {
        fanouts: fanouts.clone(),
        relation_fanouts: listed
            .iter()
            .map(|(n, l)| (n.to_string(), l.clone()))
            .collect::<BTreeMap<_, _>>(),
    };
    let typed = types.map(|types| TypedGraph { types, new_to_old });
    dependency_sampler(&sampling, fanouts.len(), 11, typed)
        .map(|s| s.expect("fanout sampling has a dependency sampler"))
        .map_err(|e| e.to_string())
}

/// The sources vertex `v` keeps in round `round` of a one-layer sample of `targets`.
fn kept(s: &dyn Sampler, c: &PlanContext<'_>, v: u32, round: u64) -> Vec<u32> {
    let spec = s.spec(c, 0, vec![v], 1, round).unwrap();
    let Edges::Sampled(e) = &spec.edges else {
        panic!("fanout sampling keeps a sample")
    };
    e.kept_sources(v)
}

#[test]
fn each_relation_draws_its_own_fanout() {
    let (g, types) = typed();
    let c = ctx(&g);
    let ids: Vec<u32> = (0..22).collect();
    let s = sampler(vec![3], &[("from_c", vec![5])], Some(&types), &ids).unwrap();
    let mut seen_b = std::collections::BTreeSet::new();
    for round in 0..40 {
        let got = kept(s.as_ref(), &c, 0, round);
        let b = got.iter().filter(|&&u| (2..14).contains(&u)).count();
        let cc = got.iter().filter(|&&u| (14..22).contains(&u)).count();
        // from_b takes the default 3 of its 12, from_c its own 5 of 8.
        assert_eq!((b, cc, got.len()), (3, 5, 8), "round {round}: {got:?}");
        assert_eq!(got, kept(s.as_ref(), &c, 0, round), "round {round} repeats");
        seen_b.extend(got.into_iter().filter(|u| (2..14).contains(u)));
    }
    assert_eq!(
        seen_b.len(),
        12,
        "every b in-neighbour is drawn in some round"
    );
    // A fanout above a relation's in-degree keeps all of it; the key form names it too.
    let s = sampler(vec![1], &[("b__from_b__a", vec![50])], Some(&types), &ids).unwrap();
    let got = kept(s.as_ref(), &c, 1, 0);
    assert_eq!(got.iter().filter(|&&u| (2..14).contains(&u)).count(), 12);
    assert_eq!(got.iter().filter(|&&u| (14..22).contains(&u)).count(), 1);
    // The types are the original ids': relabelled, the same vertices keep the same counts.
    let new_to_old: Vec<u32> = (0..22).rev().collect();
    let g2 = grandis_store::graph_from_edges(
        22,
        (0..22u32).flat_map(|v| {
            let old = 21 - v;
            g.view()
                .neighbors(old)
                .iter()
                .map(move |&u| (21 - u, v))
                .collect::<Vec<_>>()
        }),
        EdgeOptions::default(),
    )
    .unwrap();
    let c2 = ctx(&g2);
    let s = sampler(vec![3], &[("from_c", vec![5])], Some(&types), &new_to_old).unwrap();
    let got = kept(s.as_ref(), &c2, 21, 0);
    let b = got.iter().filter(|&&u| (8..20).contains(&u)).count();
    let cc = got.iter().filter(|&&u| u < 8).count();
    assert_eq!((b, cc), (3, 5), "{got:?}");
}

#[test]
fn unknown_relations_and_untyped_datasets_are_refused() {
    let (g, types) = typed();
    let ids: Vec<u32> = (0..22).collect();
    let e = sampler(vec![3], &[("cites", vec![5])], Some(&types), &ids)
        .err()
        .expect("an unknown relation is refused");
    assert!(e.contains("cites") && e.contains("c__from_c__a"), "{e}");
    let e = sampler(vec![3], &[("from_c", vec![5])], None, &ids)
        .err()
        .expect("relation fanouts without types are refused");
    assert!(e.contains("no types"), "{e}");
    // Without relation fanouts an untyped graph samples as ever.
    let s = sampler(vec![3], &[], None, &ids).unwrap();
    assert_eq!(kept(s.as_ref(), &ctx(&g), 0, 0).len(), 3);
}
