//! The samplers of a job's `sampling` ([`grandis_wire::Sampling`], the one description of
//! which edges are dropped): the one place that turns the spec's values into sampler objects.

use grandis_wire::Sampling;

use crate::error::Result;
use crate::{Eas, Exact, Fanout, Saint, SaintKind, Sampler};

/// The dependency sampler of `sampling` for a model of `layers` layers, seeded with the
/// training seed; None for GraphSAINT, which samples the targets too ([`saint_sampler`]).
pub fn dependency_sampler(
    sampling: &Sampling,
    layers: usize,
    seed: u64,
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
        Sampling::Fanout { fanouts } => Some(Box::new(Fanout::new(
            Sampling::fanouts_per_layer(fanouts, layers),
            seed,
        )?)),
        Sampling::Saint { .. } => None,
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
