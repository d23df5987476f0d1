//! [`ParallelOptions`]: what a run needs beyond the model and the optimiser: the job spec as
//! it is (the knobs derived from it, such as a mode's batch size, by one method each) and what
//! the machine decides ([`Machine`]: where ranks compute, threads, emulated links).

use std::path::PathBuf;

use grandis_fabric::LinkModel;
use grandis_wire::{JobSpec, Mode};

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

/// A parallel run's options: the job as it was submitted (the one [`JobSpec`], validated
/// where it entered: the CLI, the coordinator's REST API) and what this machine decides on
/// its own. The job's model and optimiser fields are not read here: the model comes as a
/// [`grandis_models::ModelConfig`] and the optimiser as [`grandis_trainer::TrainOptions`],
/// made from the same spec by their own crates.
#[derive(Debug, Clone)]
pub struct ParallelOptions {
    /// What to train and how to distribute it: `mode` (fb, flx, cob, mb, cluster, or auto,
    /// the planner's choice when the run starts, [`crate::auto`], which rewrites the mode and
    /// its knobs here; single is the trainer's, not a parallel mode), `sampling`,
    /// `preload_hops`, `batch_size`, `resample_every`, `device_memory`, `staleness`,
    /// `remote_features`, `inter_transport`, `exact_preference` and `predict`.
    pub job: JobSpec,
    pub machine: Machine,
}

/// What a machine decides about a run, beyond the job: where its ranks compute, with how
/// many threads, over which links, and where rank 0 writes checkpoints.
#[derive(Debug, Clone)]
pub struct Machine {
    /// Where the ranks compute (CPU threads by default).
    pub compute: Compute,
    /// Links emulated between the ranks of one process (unlimited by default).
    pub intra: LinkModel,
    pub inter: LinkModel,
    /// Rayon threads of each rank's CPU backend; None = cores / ranks, at least 1.
    pub threads_per_rank: Option<usize>,
    /// Threads building per-step plans (mb, cob, SAINT); None: on CPU ranks half the cores (at
    /// most 8), on CUDA ranks every core but one per local rank (at most 32).
    /// Steps are pure functions of their index, so any count gives the same run.
    pub plan_threads: Option<usize>,
    /// Return the final logits of every vertex (tests).
    pub collect_logits: bool,
    /// Where rank 0 writes checkpoints (weights are replicated, so one file serves every
    /// rank), how often, and whether the run resumes from it.
    pub checkpoint: grandis_trainer::CheckpointOptions,
    /// What this server measured when the job started (a daemon's ranks): auto plans with
    /// it. None: a run of every rank in one process measures when it needs to.
    pub measured: Option<grandis_wire::ServerRates>,
    /// Every server of a daemon's job runs on this machine (`grandis cluster up`): their ranks
    /// share its cores, as auto's plan prices them.
    pub servers_share_machine: bool,
    /// Replaces the automatic choice of the transport inside a server
    /// ([`crate::links::select`]); tests and benchmarks use it to run the device transports'
    /// code paths on CPU ranks.
    pub intra_transport: Option<crate::links::IntraTransport>,
}

impl Default for Machine {
    fn default() -> Self {
        Machine {
            compute: Compute::Cpu,
            intra: LinkModel::unlimited(),
            inter: LinkModel::unlimited(),
            threads_per_rank: None,
            plan_threads: None,
            collect_logits: false,
            checkpoint: grandis_trainer::CheckpointOptions::default(),
            measured: None,
            servers_share_machine: false,
            intra_transport: None,
        }
    }
}

impl Default for ParallelOptions {
    /// FB (the exact baseline every mode is held to) on CPU ranks; the job's other fields
    /// their [`JobSpec`] defaults.
    fn default() -> Self {
        ParallelOptions {
            job: JobSpec {
                mode: Mode::Fb,
                ..JobSpec::default()
            },
            machine: Machine::default(),
        }
    }
}

impl ParallelOptions {
    /// FLX: the preloaded hops the job fixes (None: the largest that fits the budget).
    pub fn preload_hops(&self) -> Option<usize> {
        self.job.preload_hops.map(|k| k as usize)
    }

    /// CoB: co-batch size per server; MB: mini-batch size per device (the job's, or its
    /// documented default); auto: the co-batch size if it comes to CoB (None = the largest
    /// that fits); other modes none.
    pub fn batch_size(&self) -> Option<usize> {
        match self.job.mode {
            Mode::Cob | Mode::Mb | Mode::Cluster => Some(self.job.batch_size_or_default() as usize),
            Mode::Auto => self.job.batch_size.map(|b| b as usize),
            _ => None,
        }
    }

    /// auto: how many times faster than the fastest exact plan a sampled one must be
    /// predicted to be chosen.
    pub fn exact_preference(&self) -> f64 {
        self.job
            .exact_preference
            .unwrap_or(grandis_wire::defaults::EXACT_PREFERENCE)
    }

    /// What the ranks write after training (the job's `predict`).
    pub fn infer(&self) -> Option<InferOptions> {
        self.job.predict.as_ref().map(|p| InferOptions {
            dir: p.dir.clone().into(),
            kind: match p.logits {
                true => grandis_trainer::layerwise::Predictions::Logits,
                false => grandis_trainer::layerwise::Predictions::ClassIds,
            },
            embeddings: p.embeddings,
            block_budget: p.block_memory,
        })
    }

    /// The endpoints of every rank of `layout` in this process, over links emulated as the
    /// machine's `intra` and `inter`.
    pub fn in_process_endpoints(
        &self,
        layout: &grandis_masking::Layout,
    ) -> anyhow::Result<Vec<grandis_fabric::Endpoint>> {
        Ok(grandis_fabric::Fabric::new(grandis_fabric::FabricConfig {
            servers: layout.servers(),
            devices: layout.devices(),
            intra: self.machine.intra,
            inter: self.machine.inter,
            ..grandis_fabric::FabricConfig::default()
        })?
        .into_endpoints())
    }

    /// Threads of each CPU rank when `local_ranks` ranks run in this process:
    /// `threads_per_rank`, else [`cores_per_rank`].
    pub fn rank_threads(&self, local_ranks: usize) -> usize {
        self.machine
            .threads_per_rank
            .unwrap_or_else(|| cores_per_rank(local_ranks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_wire::{Priority, Sampling};

    #[test]
    fn a_job_maps_to_its_options() {
        let on_this_machine = |job| ParallelOptions {
            job,
            machine: Machine::default(),
        };
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
        let o = on_this_machine(JobSpec {
            mode: Mode::Flx,
            sampling: eas.clone(),
            resample_every: Some(3),
            device_memory: Some(1 << 20),
            preload_hops: Some(2),
            ..base.clone()
        });
        assert_eq!(o.job.sampling, eas);
        assert_eq!(
            (
                o.job.resample_every,
                o.job.device_memory,
                o.batch_size(),
                o.preload_hops()
            ),
            (Some(3), Some(1 << 20), None, Some(2))
        );
        // cob and mb take the spec's batch size, or its documented default.
        let o = on_this_machine(JobSpec {
            mode: Mode::Cob,
            batch_size: Some(64),
            ..base.clone()
        });
        assert_eq!(o.batch_size(), Some(64));
        let o = on_this_machine(JobSpec {
            mode: Mode::Mb,
            ..base.clone()
        });
        assert_eq!(
            o.batch_size(),
            Some(grandis_wire::defaults::BATCH_SIZE as usize)
        );
        // GraphSAINT without a batch size: the default roots' worth.
        let o = on_this_machine(JobSpec {
            mode: Mode::Cob,
            sampling: Sampling::Saint { walk_length: 2 },
            ..base.clone()
        });
        assert_eq!(o.batch_size(), Some(9000));
        // auto: only an explicit co-batch size (absent = the largest that fits).
        let o = on_this_machine(JobSpec {
            mode: Mode::Auto,
            ..base
        });
        assert_eq!((o.job.mode, o.batch_size()), (Mode::Auto, None));
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
