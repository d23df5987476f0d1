//! What a run reports ([`ParallelReport`] and its parts), filled from fabric counters.

use anyhow::Context;
use grandis_fabric::{Counters, LinkClass, Phase};
use grandis_trainer::{TrainOptions, TrainReport};
use grandis_wire::{
    Execution, InferenceSummary, JobSpec, LinkBytes, RankMemory, RunSummary, TimeSplit,
};

use crate::decide::Decision;
use crate::fetch::SETUP_EPOCH;
use crate::link_task::{DECODER_LAYER, GATHER_LAYER};
use crate::run::Ran;
use crate::worker::{self, EVAL_EPOCH_BIT};
use crate::{ParallelOptions, PartitionedGraph};

/// Everything a parallel run reports: how it ran and what it moved (the summary's
/// [`Execution`]), rank 0's training figures, and what tests read beside them.
#[derive(Debug, Clone)]
pub struct ParallelReport {
    pub execution: Execution,
    pub train: TrainReport,
    /// Final logits (dropout off) in ORIGINAL vertex order, `n x classes`, when requested.
    pub logits: Option<Vec<f32>>,
    /// Fabric counters summed over ranks (training, evaluation and inference epochs).
    pub counters: Counters,
}

impl ParallelReport {
    /// The run's [`RunSummary`] (`job`: the spec it ran; `device`: where the ranks computed).
    pub fn summary(&self, job: &JobSpec, device: String) -> RunSummary {
        RunSummary {
            execution: self.execution.clone(),
            // The training figures, as a single-process run reports them.
            ..self.train.summary(job, device)
        }
    }
}

impl ParallelReport {
    /// The report of a run that only predicted ([`crate::infer::predict_only`]): no epoch,
    /// no plan; the inference and its traffic.
    pub(crate) fn predicted_only(
        popts: &ParallelOptions,
        part: &PartitionedGraph,
        threads_per_rank: usize,
        num_parameters: usize,
        epochs_done: usize,
        ranks: Vec<(crate::infer::RankInference, Counters)>,
    ) -> ParallelReport {
        let counters = Counters::sum(ranks.iter().map(|(_, c)| c));
        let inference = popts
            .infer()
            .as_ref()
            .map(|o| inference_summary(o, ranks.iter().map(|(r, _)| r)));
        ParallelReport {
            execution: Execution {
                mode: popts.job.mode,
                servers: part.layout.servers(),
                devices: part.layout.devices(),
                partition: part.source.clone(),
                threads_per_rank,
                transport: "fabric (inference only)".into(),
                preload_reason: "no training: the checkpoint holds every epoch".into(),
                inference,
                ..Execution::default()
            },
            train: TrainReport {
                epochs: Vec::new(),
                final_loss: f64::NAN,
                train_acc: f64::NAN,
                val_acc: f64::NAN,
                test_acc: f64::NAN,
                median_epoch_s: f64::NAN,
                first_epoch: epochs_done + 1,
                num_parameters,
                link: None,
            },
            logits: None,
            counters,
        }
    }
}

impl Ran {
    /// The report of this run: the ranks' counters, times and memory, what the decision chose
    /// and the steps computed (per epoch), and rank 0's training figures.
    pub(crate) fn report(
        self,
        decision: &Decision<'_>,
        popts: &ParallelOptions,
        plan: Option<grandis_wire::PlanSummary>,
        part: &PartitionedGraph,
        classes: usize,
        opts: &TrainOptions,
    ) -> anyhow::Result<ParallelReport> {
        let Ran {
            results,
            stats: rs,
            threads_per_rank,
            transports,
        } = self;
        // Epochs trained in this run (fewer than `opts.epochs` after a resume): the per-epoch
        // figures divide by them.
        let epochs = results.first().map_or(0, |r| r.epochs.len()).max(1);
        let r0 = results.first().context("no rank ran")?;
        let counters = Counters::sum(results.iter().map(|r| &r.counters));
        let phase_bytes = |phase: Phase| class_bytes_per_epoch(&counters, phase, epochs);
        let fwd = phase_bytes(Phase::Forward);
        let bwd = phase_bytes(Phase::Backward);
        let (fetch_bytes_per_epoch, setup_fetch_bytes) =
            fetch_bytes(&counters, epochs, decision.first_plan_recurs(epochs));
        let logits = popts.machine.collect_logits.then(|| {
            let mut all = vec![f32::NAN; part.new_to_old.len() * classes];
            for r in &results {
                for (o, row) in &r.logits {
                    let o = *o as usize;
                    all[o * classes..(o + 1) * classes].copy_from_slice(row);
                }
            }
            all
        });
        let memory = results
            .iter()
            .map(|r| RankMemory {
                rank: r.rank,
                measured_peak_bytes: r.peak_bytes,
                setup_bytes: r.setup_bytes,
                model_bytes: rs.model_peak.get(r.rank).copied().unwrap_or(0),
            })
            .collect();
        let per_ep = |x: u64| x / epochs as u64;
        let steps_n = rs.steps.max(1) as f64;
        let stats = r0.epochs.clone();
        let train = TrainReport {
            final_loss: stats.last().map_or(f64::NAN, |s| s.loss),
            train_acc: r0.final_acc[0],
            val_acc: r0.final_acc[1],
            test_acc: r0.final_acc[2],
            median_epoch_s: grandis_telemetry::median(
                &stats.iter().map(|s| s.seconds).collect::<Vec<_>>(),
            ),
            first_epoch: stats.first().map_or(opts.epochs + 1, |s| s.epoch),
            num_parameters: r0.num_parameters,
            epochs: stats,
            link: r0.link.clone(),
        };
        let computed: Vec<u64> = rs.computed_per_layer.iter().map(|&x| per_ep(x)).collect();
        let choice = &decision.choice;
        Ok(ParallelReport {
            execution: Execution {
                mode: popts.job.mode,
                plan,
                servers: part.layout.servers(),
                devices: part.layout.devices(),
                partition: part.source.clone(),
                threads_per_rank,
                transport: transports.describe(),
                preload_hops: choice.k,
                preload_reason: choice.reason.clone(),
                preload_estimates: choice
                    .estimates
                    .iter()
                    .map(|e| (e.k, e.max_bytes))
                    .collect(),
                // Static plans: the FLX plan's; per-step plans: the mean over steps.
                replicated_vertices: if decision.is_static() {
                    decision.replicated_vertices
                } else {
                    (rs.replicated as f64 / steps_n).round() as usize
                },
                halo_bytes_per_epoch: LinkBytes {
                    intra_server: fwd.intra_server + bwd.intra_server,
                    inter_server: fwd.inter_server + bwd.inter_server,
                },
                forward_bytes_per_epoch: fwd,
                backward_bytes_per_epoch: bwd,
                predicted_halo_bytes_per_epoch: decision.predicted,
                all_reduce_bytes_per_epoch: phase_bytes(Phase::AllReduce),
                link_embedding_bytes_per_epoch: per_epoch(
                    tag_bytes(
                        &counters,
                        |phase, layer| {
                            phase == Phase::Other
                                && (layer == GATHER_LAYER || layer == DECODER_LAYER)
                        },
                        is_training_epoch,
                    ),
                    epochs,
                ),
                node_embedding_bytes_per_epoch: per_epoch(
                    tag_bytes(
                        &counters,
                        |phase, layer| {
                            phase == Phase::Other
                                && crate::embedding_shard::is_embedding_layer(layer)
                        },
                        is_training_epoch,
                    ),
                    epochs,
                ),
                fetch_bytes_per_epoch,
                setup_fetch_bytes,
                time_split: TimeSplit {
                    plan_build_s: rs.build_seconds / epochs as f64,
                    plan_inputs_s: rs.inputs_seconds / epochs as f64,
                    ..time_split(&results)
                },
                memory,
                sampling: decision.sampling.clone(),
                batch_size: popts
                    .batch_size()
                    .filter(|_| popts.job.mode.is_mini_batch()),
                iterations_per_epoch: decision.schedule.iterations(),
                targets_per_epoch: per_ep(rs.targets),
                sampled_edges: per_ep(rs.sampled_edges),
                inter_server_sampled_edges: per_ep(rs.inter_server_sampled_edges),
                computed_vertex_layers: computed.iter().sum(),
                computed_vertices_per_layer: computed,
                aggregated_edges_per_layer: rs
                    .aggregated_edges_per_layer
                    .iter()
                    .map(|&x| per_ep(x))
                    .collect(),
                beta: rs.beta_sum.iter().map(|b| b / steps_n).collect(),
                inference: popts.infer().as_ref().map(|o| {
                    inference_summary(o, results.iter().filter_map(|r| r.inference.as_ref()))
                }),
                staleness: popts.job.staleness.map(|_| grandis_wire::StaleSummary {
                    sends: results.iter().map(|r| r.stale.sent).sum(),
                    skips: results.iter().map(|r| r.stale.skipped).sum(),
                    saved_bytes_per_epoch: per_ep(
                        results.iter().map(|r| r.stale.saved_bytes).sum(),
                    ),
                }),
            },
            train,
            logits,
            counters,
        })
    }
}

/// The ranks' inference reports as one summary.
fn inference_summary<'r>(
    opts: &crate::options::InferOptions,
    ranks: impl Iterator<Item = &'r crate::infer::RankInference>,
) -> InferenceSummary {
    let mut sum = InferenceSummary {
        dir: opts.dir.display().to_string(),
        ..InferenceSummary::default()
    };
    for r in ranks {
        sum.absorb(&InferenceSummary {
            dir: String::new(),
            ranks: vec![r.rank],
            vertices: r.vertices as u64,
            halo_rows: r.halo_rows_received,
            bytes: LinkBytes {
                intra_server: r.bytes_intra_server,
                inter_server: r.bytes_inter_server,
            },
            stage_seconds: r.stage_seconds.clone(),
            exchange_seconds: r.exchange_seconds,
            seconds: r.seconds,
        });
    }
    sum
}

/// Payload bytes of `phase` per training epoch by link class, from fabric counters summed over
/// ranks (evaluation epochs and the setup before the first epoch left out), over `epochs`
/// training epochs.
fn class_bytes_per_epoch(counters: &Counters, phase: Phase, epochs: usize) -> LinkBytes {
    per_epoch(class_bytes(counters, phase, is_training_epoch), epochs)
}

/// Whether a tag epoch is a training epoch (not the setup before it, not an evaluation).
fn is_training_epoch(epoch: u32) -> bool {
    epoch & (EVAL_EPOCH_BIT | crate::infer::INFER_EPOCH | grandis_fabric::PROBE_EPOCH) == 0
        && epoch != SETUP_EPOCH
}

/// Both classes divided by `epochs` (at least 1).
fn per_epoch(b: LinkBytes, epochs: usize) -> LinkBytes {
    let e = epochs.max(1) as u64;
    LinkBytes {
        intra_server: b.intra_server / e,
        inter_server: b.inter_server / e,
    }
}

/// Feature-fetch bytes by link class: (per training epoch, once at setup). The plan built
/// before the first epoch is setup when it serves the whole run; when plans change during the
/// run (`first_plan_recurs`) it is the first of the plans the epochs pay for, and its bytes are
/// spread over the `epochs` with theirs.
fn fetch_bytes(
    counters: &Counters,
    epochs: usize,
    first_plan_recurs: bool,
) -> (LinkBytes, LinkBytes) {
    let setup = class_bytes(counters, Phase::Fetch, |e| e == SETUP_EPOCH);
    let in_epochs = class_bytes(counters, Phase::Fetch, is_training_epoch);
    if !first_plan_recurs {
        return (per_epoch(in_epochs, epochs), setup);
    }
    let all = LinkBytes {
        intra_server: in_epochs.intra_server + setup.intra_server,
        inter_server: in_epochs.inter_server + setup.inter_server,
    };
    (per_epoch(all, epochs), LinkBytes::default())
}

/// Payload bytes sent under `phase` in the tag epochs that `keep` selects, by link class.
fn class_bytes(counters: &Counters, phase: Phase, keep: impl Fn(u32) -> bool) -> LinkBytes {
    tag_bytes(counters, |p, _| p == phase, keep)
}

/// Payload bytes sent under the (phase, layer) of a tag that `tag` selects, in the tag epochs
/// that `keep` selects, by link class.
fn tag_bytes(
    counters: &Counters,
    tag: impl Fn(Phase, u32) -> bool,
    keep: impl Fn(u32) -> bool,
) -> LinkBytes {
    let total = |class: LinkClass| -> u64 {
        counters
            .epochs
            .iter()
            .filter(|e| keep(e.epoch))
            .flat_map(|e| e.links.iter())
            .filter(|r| tag(r.phase, r.layer) && r.class == class)
            .map(|r| r.bytes_sent)
            .sum()
    };
    LinkBytes {
        intra_server: total(LinkClass::IntraServer),
        inter_server: total(LinkClass::InterServer),
    }
}

/// Mean time split of the training epochs, from each rank's step wall times and counters.
fn time_split(results: &[worker::RankResult]) -> TimeSplit {
    let mut t = TimeSplit::default();
    let mut count = 0.0;
    for r in results {
        // The first epoch trained warms caches and allocators; leave it out when there are
        // others.
        let skip = usize::from(r.epochs.len() > 1);
        for (stats, times) in r.epochs.iter().zip(&r.epoch_times).skip(skip) {
            let wall = times.wall_s;
            let Some(c) = r.counters.epoch(stats.epoch as u32) else {
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
            // Small collectives (the fetch's id exchanges, inside the switch to a step's plans).
            let other = calls(Phase::Other);
            t.epoch_s += wall;
            t.inter_comm_s += inter_wait.min(exchange);
            t.intra_comm_s += (exchange - inter_wait).max(0.0);
            t.all_reduce_s += all_reduce;
            t.fetch_s += fetch;
            t.other_s += other;
            // The fetch runs inside the switch to a step's plans.
            let load = (times.plan_load_s - fetch).max(0.0);
            t.plan_wait_s += times.plan_wait_s;
            t.plan_load_s += load;
            t.compute_s +=
                (wall - exchange - all_reduce - fetch - times.plan_wait_s - load).max(0.0);
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
            &mut t.plan_wait_s,
            &mut t.plan_load_s,
        ] {
            *x /= count;
        }
    }
    t
}
