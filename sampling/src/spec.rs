//! The samplers of a job's `sampling` ([`grandis_wire::Sampling`], the one description of
//! which edges are dropped): the one place that turns the spec's values into sampler objects.

use std::collections::BTreeMap;

use grandis_wire::Sampling;

use crate::error::{Result, SamplingError};
use crate::{Eas, Exact, Fanout, RelationFanouts, Saint, SaintKind, Sampler};

/// A typed graph as a sampler reads it: the dataset's types and relations, and the original
/// id of every vertex of the plans (their types are the original ids').
#[derive(Clone, Copy)]
pub struct TypedGraph<'a> {
    pub types: &'a grandis_store::Types,
    pub new_to_old: &'a [u32],
}

/// The dependency sampler of `sampling` for a model of `layers` layers, seeded with the
/// training seed; None for GraphSAINT, which samples the targets too ([`saint_sampler`]).
/// `typed`: the graph's types when it has some, which per-relation fanouts need.
pub fn dependency_sampler(
    sampling: &Sampling,
    layers: usize,
    seed: u64,
    typed: Option<TypedGraph<'_>>,
) -> Result<Option<Box<dyn Sampler>>> {
    Ok(match sampling {
        Sampling::None => Some(Box::new(Exact)),
        Sampling::Eas {
            hops,
            fanout,
            priority,
        } => Some(Box::new(Eas::new(
            *hops as usize,
            *fanout as usize,
            *priority,
            seed,
        )?)),
        Sampling::Fanout {
            fanouts,
            relation_fanouts,
        } => {
            let sampler = Fanout::new(Sampling::fanouts_per_layer(fanouts, layers), seed)?;
            if relation_fanouts.is_empty() {
                Some(Box::new(sampler))
            } else {
                let Some(typed) = typed else {
                    return Err(SamplingError::Config(
                        "relation_fanouts: the dataset has no types, so no relations to give \
                         fanouts of"
                            .into(),
                    ));
                };
                let table = relation_table(fanouts, relation_fanouts, layers, typed)?;
                Some(Box::new(sampler.with_relations(table)?))
            }
        }
        Sampling::Saint { .. } => None,
    })
}

/// Every relation's fanouts per hop: the listed ones' own (each key resolved to one
/// relation), `fanouts` for the rest.
fn relation_table(
    fanouts: &[u32],
    listed: &BTreeMap<String, Vec<u32>>,
    layers: usize,
    typed: TypedGraph<'_>,
) -> Result<RelationFanouts> {
    let types = typed.types;
    let t = types.num_types();
    let mut per_relation =
        vec![Sampling::fanouts_per_layer(fanouts, layers); types.num_relations()];
    for (name, list) in listed {
        let r = types
            .find_relation(name)
            .map_err(|e| SamplingError::Config(format!("relation_fanouts: {e}")))?;
        per_relation[r] = Sampling::fanouts_per_layer(list, layers);
    }
    let mut table = vec![vec![0usize; t * t]; layers];
    for (r, lists) in per_relation.iter().enumerate() {
        let (src, dst) = types.ends(r);
        for (hop, &f) in lists.iter().enumerate() {
            table[hop][dst * t + src] = f;
        }
    }
    Ok(RelationFanouts {
        vertex_types: typed
            .new_to_old
            .iter()
            .map(|&old| types.type_of(old) as u16)
            .collect(),
        types: t,
        fanouts: table,
    })
}

/// The GraphSAINT sampler of `sampling` for a per-server budget of `budget` vertices: the node
/// sampler (walk length 0) or random walks from `budget / (walk_length + 1)` roots. None when
/// `sampling` is not GraphSAINT.
pub fn saint_sampler(sampling: &Sampling, budget: usize, seed: u64) -> Option<Saint> {
    let Sampling::Saint { walk_length } = sampling else {
        return None;
    };
    let length = *walk_length as usize;
    Some(Saint {
        kind: if length == 0 {
            SaintKind::Node { budget }
        } else {
            SaintKind::RandomWalk {
                roots: (budget / (length + 1)).max(1),
                length,
            }
        },
        seed,
    })
}
