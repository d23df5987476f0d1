//! [`ParallelOptions`]: what a run needs beyond the model and the optimiser, made from the
//! job spec by one pure function ([`ParallelOptions::for_job`]) plus what the machine decides
//! (where ranks compute, threads, emulated links).

use std::path::PathBuf;

use grandis_fabric::LinkModel;
use grandis_wire::{JobSpec, Mode, Sampling};

use crate::compute::{cores_per_rank, Compute};

/// What the ranks write after training.
#[derive(Debug, Clone, PartialEq)]
pub struct InferOptions {
    /// Where every rank writes its files (created if missing).
    pub dir: PathBuf,
    pub kind: grandis_trainer::layerwise::Predictions,
    /// Also write `embeddings.r.npy`.
    pub embeddings: bool,
    /// Bytes one block may use on a rank; None = half the rank's memory budget.
    pub block_budget: Option<u64>,
}

impl InferOptions {
    /// The file of `what` ("predictions", "embeddings", "vertices") of global rank `rank`.
    pub fn file(&self, what: &str, rank: usize) -> PathBuf {
        self.dir.join(format!("{what}.{rank}.npy"))
    }
}

/// Options of a parallel run beyond the model and optimiser.
#[derive(Debug, Clone)]
pub struct ParallelOptions {
    /// fb, flx, cob, mb, cluster, or auto (the planner's choice when the run starts, [`crate::auto`]);
    /// single is the trainer's, not a parallel mode.
    pub mode: Mode,
    /// Where the ranks compute (CPU threads by default).
    pub compute: Compute,
    /// FLX: force k instead of choosing it from the memory budget.
    pub preload_hops: Option<usize>,
    /// Per-device memory budget in bytes; None = what the device has
    /// ([`default_device_memory`](crate::default_device_memory) on CPU, free memory on CUDA).
    pub device_memory: Option<u64>,
    pub intra: LinkModel,
    pub inter: LinkModel,
    /// Rayon threads of each rank's CPU backend; None = cores / ranks, at least 1.
    pub threads_per_rank: Option<usize>,
    /// Return the final logits of every vertex (tests).
    pub collect_logits: bool,
    /// Dependency sampling (FLX: EAS; CoB: any; MB: none, EAS or fanout).
    pub sampling: Sampling,
    /// CoB: co-batch size per server; MB: mini-batch size per device; auto: the co-batch size
    /// if it comes to CoB (None = the largest that fits).
    pub batch_size: Option<usize>,
    /// FLX with sampling: draw a new sample every N epochs (None or 0: sample once).
    pub resample_every: Option<u64>,
    /// FB / FLX: SANCUS's staleness-bounded halo exchange between servers ([`crate::stale`]).
    pub staleness: Option<grandis_wire::Staleness>,
    /// CoB / MB: DGS's fraction of feature columns fetched for other servers' vertices
    /// ([`crate::fetch`]).
    pub remote_features: Option<f64>,
    /// Where rank 0 writes checkpoints (weights are replicated, so one file serves every
    /// rank), how often, and whether the run resumes from it.
    pub checkpoint: grandis_trainer::CheckpointOptions,
    /// Threads building per-step plans (mb, cob, SAINT); None: on CPU ranks half the cores (at
    /// most 8), on CUDA ranks every core but one per local rank (at most 32).
    /// Steps are pure functions of their index, so any count gives the same run.
    pub plan_threads: Option<usize>,
    /// After training, layer-wise inference over every vertex across the ranks.
    pub infer: Option<InferOptions>,
    /// auto: a sampled plan must be predicted this many times faster than the fastest exact
    /// one to be chosen.
    pub exact_preference: f64,
    /// What this server measured when the job started (a daemon's ranks): auto plans with
    /// it. None: a run of every rank in one process measures when it needs to.
    pub measured: Option<grandis_wire::ServerRates>,
    /// Every server of a daemon's job runs on this machine (`grandis cluster up`): their ranks
    /// share its cores, as auto's plan prices them.
    pub servers_share_machine: bool,
    /// What carries traffic between servers (the job's `inter_transport`).
    pub inter_transport: grandis_wire::InterTransport,
    /// Replaces the automatic choice of the transport inside a server
    /// ([`crate::links::select`]); tests and benchmarks use it to run the device transports'
    /// code paths on CPU ranks.
    pub intra_transport: Option<crate::links::IntraTransport>,
}

impl Default for ParallelOptions {
    fn default() -> Self {
        ParallelOptions {
            mode: Mode::Fb,
            compute: Compute::Cpu,
            preload_hops: None,
            device_memory: None,
            intra: LinkModel::unlimited(),
            inter: LinkModel::unlimited(),
            threads_per_rank: None,
            collect_logits: false,
            sampling: Sampling::None,
            batch_size: None,
            resample_every: None,
            staleness: None,
            remote_features: None,
            checkpoint: grandis_trainer::CheckpointOptions::default(),
            plan_threads: None,
            infer: None,
            exact_preference: grandis_wire::defaults::EXACT_PREFERENCE,
            measured: None,
            servers_share_machine: false,
            inter_transport: grandis_wire::InterTransport::Quic,
            intra_transport: None,
        }
    }
}

impl ParallelOptions {
    /// The endpoints of every rank of `layout` in this process, over links emulated as
    /// `intra` and `inter`.
    pub fn in_process_endpoints(
        &self,
        layout: &grandis_masking::Layout,
    ) -> anyhow::Result<Vec<grandis_fabric::Endpoint>> {
        Ok(grandis_fabric::Fabric::new(grandis_fabric::FabricConfig {
            servers: layout.servers(),
            devices: layout.devices(),
            intra: self.intra,
            inter: self.inter,
            ..grandis_fabric::FabricConfig::default()
        })?
        .into_endpoints())
    }

    /// Threads of each CPU rank when `local_ranks` ranks run in this process:
    /// `threads_per_rank`, else [`cores_per_rank`].
    pub fn rank_threads(&self, local_ranks: usize) -> usize {
        self.threads_per_rank
            .unwrap_or_else(|| cores_per_rank(local_ranks))
    }

    /// The options of a job: the one mapping from a spec to a run, used by `grandis train` and
    /// by every daemon alike (so a cluster job equals `grandis train` with the same spec).
    /// Pure: the machine's part (compute, threads, links) keeps its defaults.
    pub fn for_job(spec: &JobSpec) -> ParallelOptions {
        ParallelOptions {
            mode: spec.mode,
            preload_hops: spec.preload_hops.map(|k| k as usize),
            device_memory: spec.device_memory,
            sampling: spec.sampling.clone(),
            batch_size: match spec.mode {
                Mode::Cob | Mode::Mb | Mode::Cluster => Some(spec.batch_size_or_default() as usize),
                // auto: absent = the largest co-batch that fits, if it comes to CoB.
                Mode::Auto => spec.batch_size.map(|b| b as usize),
                _ => None,
            },
            resample_every: spec.resample_every,
            staleness: spec.staleness,
            remote_features: spec.remote_features,
            inter_transport: spec.inter_transport,
            exact_preference: spec
                .exact_preference
                .unwrap_or(grandis_wire::defaults::EXACT_PREFERENCE),
            infer: spec.predict.as_ref().map(|p| InferOptions {
                dir: p.dir.clone().into(),
                kind: match p.logits {
                    true => grandis_trainer::layerwise::Predictions::Logits,
                    false => grandis_trainer::layerwise::Predictions::ClassIds,
                },
                embeddings: p.embeddings,
                block_budget: p.block_memory,
            }),
            ..ParallelOptions::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_wire::Priority;

    #[test]
    fn a_job_maps_to_its_options() {
        let base = JobSpec {
            dataset: "d".into(),
            layers: 3,
            seed: 7,
            ..JobSpec::default()
        };
        // FLX-EAS with resampling and a budget.
        let eas = Sampling::Eas {
            hops: 2,
            fanout: 4,
            priority: Priority::Degree,
        };
        let o = ParallelOptions::for_job(&JobSpec {
            mode: Mode::Flx,
            sampling: eas.clone(),
            resample_every: Some(3),
            device_memory: Some(1 << 20),
            preload_hops: Some(2),
            ..base.clone()
        });
        assert_eq!(o.sampling, eas);
        assert_eq!(
            (
                o.resample_every,
                o.device_memory,
                o.batch_size,
                o.preload_hops
            ),
            (Some(3), Some(1 << 20), None, Some(2))
        );
        // cob and mb take the spec's batch size, or its documented default.
        let o = ParallelOptions::for_job(&JobSpec {
            mode: Mode::Cob,
            batch_size: Some(64),
            ..base.clone()
        });
        assert_eq!(o.batch_size, Some(64));
        let o = ParallelOptions::for_job(&JobSpec {
            mode: Mode::Mb,
            ..base.clone()
        });
        assert_eq!(
            o.batch_size,
            Some(grandis_wire::defaults::BATCH_SIZE as usize)
        );
        // GraphSAINT without a batch size: the default roots' worth.
        let o = ParallelOptions::for_job(&JobSpec {
            mode: Mode::Cob,
            sampling: Sampling::Saint { walk_length: 2 },
            ..base.clone()
        });
        assert_eq!(o.batch_size, Some(9000));
        // auto: only an explicit co-batch size (absent = the largest that fits).
        let o = ParallelOptions::for_job(&JobSpec {
            mode: Mode::Auto,
            ..base
        });
        assert_eq!((o.mode, o.batch_size), (Mode::Auto, None));
    }

    #[test]
    fn compute_parses_and_maps_device_indices_to_ordinals() {
        assert_eq!(Compute::parse("cpu").unwrap(), Compute::Cpu);
        let auto = Compute::parse("cuda").unwrap();
        assert_eq!(auto, Compute::Cuda { ordinals: None });
        // Device index d on ordinal d, wrapped at the number of devices present.
        assert_eq!(
            (0..5).map(|d| auto.ordinal(d, 4)).collect::<Vec<_>>(),
            [Some(0), Some(1), Some(2), Some(3), Some(0)]
        );
        // cuda:N: every rank on N (several ranks share one GPU).
        let one = Compute::parse("cuda:1").unwrap();
        assert_eq!(one.ordinal(0, 2), Some(1));
        assert_eq!(one.ordinal(3, 2), Some(1));
        let list = Compute::Cuda {
            ordinals: Some(vec![2, 3]),
        };
        assert_eq!(
            (0..3).map(|d| list.ordinal(d, 8)).collect::<Vec<_>>(),
            [Some(2), Some(3), Some(2)]
        );
        assert_eq!(Compute::Cpu.ordinal(0, 8), None);
        for bad in ["gpu", "cuda:", "cuda:x", "CUDA", ""] {
            let err = Compute::parse(bad).unwrap_err().to_string();
            assert!(err.contains("expected cpu, cuda or cuda:N"), "{bad}: {err}");
        }
    }
}
