//! What a run reports ([`ParallelReport`] and its parts), filled from fabric counters.

use grandis_fabric::{Counters, LinkClass, Phase};
use grandis_trainer::TrainReport;
use serde::Serialize;

use crate::fetch::SETUP_EPOCH;
use crate::worker::{self, EVAL_EPOCH_BIT};
use crate::Mode;

/// Bytes of one epoch by link class (payload bytes put on the wire, summed over ranks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ClassBytes {
    pub intra_server: u64,
    pub inter_server: u64,
}

/// Mean seconds per training epoch, averaged over ranks and over epochs (the first, warm-up
/// epoch left out when there are several).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TimeSplit {
    /// Wall time of the training step.
    pub epoch_s: f64,
    /// Outside any fabric call: the backend's work and packing of halo buffers.
    pub compute_s: f64,
    /// Halo exchange calls minus the time blocked on inter-server peers.
    pub intra_comm_s: f64,
    /// Time blocked receiving halo rows/gradients from other servers (emulated link time).
    pub inter_comm_s: f64,
    /// Fetching replicated vertices' features from their home servers, for the plans built
    /// inside the epoch (per-iteration modes, FLX-EAS resampling).
    pub fetch_s: f64,
    /// Weight-gradient all-reduce calls.
    pub all_reduce_s: f64,
    /// Loss all-reduce and other small collectives.
    pub other_s: f64,
}

/// Measured memory of one rank next to the memory model's estimate.
#[derive(Debug, Clone, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    /// Peak live bytes of backend buffers, indices and graphs (the metered backend).
    pub measured_peak_bytes: u64,
    /// Live bytes after setup, before the first epoch.
    pub setup_bytes: u64,
    /// `grandis_masking::memory` estimate for this rank.
    pub model_bytes: u64,
}

/// Everything a parallel run reports.
#[derive(Debug, Clone, Serialize)]
pub struct ParallelReport {
    pub mode: Mode,
    pub servers: usize,
    pub devices: usize,
    pub partition: String,
    pub threads_per_rank: usize,
    pub preload_hops: usize,
    /// Why this k (budget and estimates), or "fixed by --preload-hops" / "FB mode".
    pub k_reason: String,
    /// `(k, worst-device bytes)` of the estimates computed for the choice.
    pub k_estimates: Vec<(usize, u64)>,
    /// Vertices replicated by FLX preloading over all servers (per-step plans: mean per step).
    pub replicated_vertices: usize,
    /// Feature and gradient halo traffic per epoch (forward + backward phases).
    pub halo_bytes_per_epoch: ClassBytes,
    pub forward_bytes_per_epoch: ClassBytes,
    pub backward_bytes_per_epoch: ClassBytes,
    /// The masking plan's prediction of `halo_bytes_per_epoch`.
    pub predicted_halo_bytes_per_epoch: ClassBytes,
    /// Weight-gradient all-reduce traffic per epoch.
    pub all_reduce_bytes_per_epoch: ClassBytes,
    /// Input features of replicated vertices fetched from their home server, per epoch, for
    /// plans that change during the run (every co-batch or mini-batch step, FLX-EAS
    /// resampling; the first of them, built before the first epoch, included). Inter-server
    /// only: rows whose home is a device of the same server are read from its host memory.
    pub fetch_bytes_per_epoch: ClassBytes,
    /// The same, once per run, for a plan built before the first epoch that serves the whole
    /// run: the features FLX preloads (FLX-EAS sampled once too).
    pub setup_fetch_bytes: ClassBytes,
    pub time: TimeSplit,
    pub memory: Vec<RankMemory>,
    /// The sampler's name ("exact", "eas(h=1,f=15,degree)", "sage(25,10,5)", "saint(...)").
    pub sampling: String,
    /// CoB co-batch size / MB mini-batch size.
    pub batch_size: Option<usize>,
    pub iterations_per_epoch: usize,
    /// Labelled loss rows per epoch (sum over steps).
    pub targets_per_epoch: u64,
    /// Edges of the one-hop graphs the ranks hold, summed over the steps of an epoch.
    pub sampled_edges: u64,
    /// Rows computed at each layer, summed over ranks and the steps of an epoch.
    pub computed_vertices_per_layer: Vec<u64>,
    pub computed_vertex_layers: u64,
    /// Edges aggregated at each layer per epoch.
    pub aggregated_edges_per_layer: Vec<u64>,
    /// Boundary ratio β of every server (§5.3.2), mean over the steps.
    pub beta: Vec<f64>,
    #[serde(skip)]
    pub train: TrainReport,
    /// Final logits (dropout off) in ORIGINAL vertex order, `n x classes`, when requested.
    #[serde(skip)]
    pub logits: Option<Vec<f32>>,
    /// Fabric counters summed over ranks (training and evaluation epochs).
    #[serde(skip)]
    pub counters: Counters,
}

/// Payload bytes of `phase` per training epoch by link class, from fabric counters summed over
/// ranks (evaluation epochs and the setup before the first epoch left out), over `epochs`
/// training epochs.
pub(crate) fn class_bytes_per_epoch(
    counters: &Counters,
    phase: Phase,
    epochs: usize,
) -> ClassBytes {
    class_bytes(counters, phase, is_training_epoch).per_epoch(epochs)
}

/// Whether a tag epoch is a training epoch (not the setup before it, not an evaluation).
fn is_training_epoch(epoch: u32) -> bool {
    epoch & EVAL_EPOCH_BIT == 0 && epoch != SETUP_EPOCH
}

impl ClassBytes {
    /// Both classes divided by `epochs` (at least 1).
    fn per_epoch(self, epochs: usize) -> ClassBytes {
        let e = epochs.max(1) as u64;
        ClassBytes {
            intra_server: self.intra_server / e,
            inter_server: self.inter_server / e,
        }
    }
}

/// Feature-fetch bytes by link class: (per training epoch, once at setup). The plan built
/// before the first epoch is setup when it serves the whole run; when plans change during the
/// run (`first_plan_recurs`) it is the first of the plans the epochs pay for, and its bytes are
/// spread over the `epochs` with theirs.
pub(crate) fn fetch_bytes(
    counters: &Counters,
    epochs: usize,
    first_plan_recurs: bool,
) -> (ClassBytes, ClassBytes) {
    let setup = class_bytes(counters, Phase::Fetch, |e| e == SETUP_EPOCH);
    let in_epochs = class_bytes(counters, Phase::Fetch, is_training_epoch);
    if !first_plan_recurs {
        return (in_epochs.per_epoch(epochs), setup);
    }
    let all = ClassBytes {
        intra_server: in_epochs.intra_server + setup.intra_server,
        inter_server: in_epochs.inter_server + setup.inter_server,
    };
    (all.per_epoch(epochs), ClassBytes::default())
}

/// Payload bytes sent under `phase` in the tag epochs that `keep` selects, by link class.
fn class_bytes(counters: &Counters, phase: Phase, keep: impl Fn(u32) -> bool) -> ClassBytes {
    let total = |class: LinkClass| -> u64 {
        counters
            .epochs
            .iter()
            .filter(|e| keep(e.epoch))
            .flat_map(|e| e.links.iter())
            .filter(|r| r.phase == phase && r.class == class)
            .map(|r| r.bytes_sent)
            .sum()
    };
    ClassBytes {
        intra_server: total(LinkClass::IntraServer),
        inter_server: total(LinkClass::InterServer),
    }
}

/// Mean time split of the training epochs, from each rank's step wall times and counters.
pub(crate) fn time_split(results: &[worker::RankResult], epochs: usize) -> TimeSplit {
    let mut t = TimeSplit::default();
    let mut count = 0.0;
    // The first epoch warms caches and allocators; leave it out when there are others.
    let first = if epochs > 1 { 2 } else { 1 };
    for r in results {
        for e in first..=epochs {
            let wall = r.step_seconds[e - 1];
            let Some(c) = r.counters.epoch(e as u32) else {
                continue;
            };
            let calls = |phase: Phase| -> f64 {
                c.calls
                    .iter()
                    .filter(|x| x.phase == phase)
                    .map(|x| x.seconds)
                    .sum()
            };
            let exchange = calls(Phase::Forward) + calls(Phase::Backward);
            let inter_wait: f64 = c
                .links
                .iter()
                .filter(|x| {
                    x.class == LinkClass::InterServer
                        && matches!(x.phase, Phase::Forward | Phase::Backward)
                })
                .map(|x| x.wait_seconds)
                .sum();
            let all_reduce = calls(Phase::AllReduce);
            let fetch = calls(Phase::Fetch);
            // The loss all-reduce runs after the timed step; it is reported but not part of it.
            let other = calls(Phase::Other);
            t.epoch_s += wall;
            t.inter_comm_s += inter_wait.min(exchange);
            t.intra_comm_s += (exchange - inter_wait).max(0.0);
            t.all_reduce_s += all_reduce;
            t.fetch_s += fetch;
            t.other_s += other;
            t.compute_s += (wall - exchange - all_reduce - fetch).max(0.0);
            count += 1.0;
        }
    }
    if count > 0.0 {
        for x in [
            &mut t.epoch_s,
            &mut t.compute_s,
            &mut t.intra_comm_s,
            &mut t.inter_comm_s,
            &mut t.all_reduce_s,
            &mut t.fetch_s,
            &mut t.other_s,
        ] {
            *x /= count;
        }
    }
    t
}

pub(crate) fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}
