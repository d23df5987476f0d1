//! [`JobArgs`]: the one set of command-line flags that describes a job. `grandis train`,
//! `grandis cluster up` and `grandis submit` flatten it and turn it into the same typed
//! [`JobSpec`] ([`JobArgs::spec`]); every default is the spec's ([`grandis_wire::defaults`]).

use anyhow::bail;
use grandis_wire::{
    defaults, InterTransport, JobSpec, Mode, ModelKind, PartitionMethod, PredictSpec, Priority,
    Sampling,
};

/// Flags of a job (model, optimiser, distribution, sampling).
#[derive(clap::Args, Debug, Clone)]
pub struct JobArgs {
    /// Execution mode: single (one process, the exact reference; `train` only), fb, flx, cob
    /// (cooperative batching), mb (per-GPU mini-batches), cluster (GraphTheta cluster batches:
    /// unions of small METIS clusters, neighbours inside the batch) or auto (the servers measure their
    /// compute and links, and the planner runs the plan predicted fastest that fits
    /// --device-memory: see `grandis plan`). Default: single for `train`, flx for `cluster up`
    /// and `submit`.
    #[arg(long)]
    pub mode: Option<Mode>,
    /// Model: sage, gcn, ressage, gat (attention, PyG GATConv semantics; see --heads), mlp
    /// (features only, no graph; single mode only), or on a typed dataset rgcn (PyG RGCNConv),
    /// heterosage (SAGEConv per relation, summed: PyG's to_hetero) or rgat (GATConv per
    /// relation without self-loops, summed: the MLPerf GNN model; see --heads).
    #[arg(long, default_value_t = defaults::MODEL)]
    pub model: ModelKind,
    /// Number of graph convolutions.
    #[arg(long, default_value_t = defaults::LAYERS)]
    pub layers: u32,
    /// Hidden width (gat, rgat: of all heads together, so --hidden 64 --heads 8 is 8 heads of
    /// 8).
    #[arg(long, default_value_t = defaults::HIDDEN)]
    pub hidden: u32,
    /// gat, rgat: attention heads of each hidden layer, concatenated; must divide --hidden.
    #[arg(long, default_value_t = defaults::HEADS)]
    pub heads: u32,
    /// gat, rgat: attention heads of the last layer, averaged.
    #[arg(long, default_value_t = defaults::OUTPUT_HEADS)]
    pub output_heads: u32,
    /// Training epochs.
    #[arg(long, default_value_t = defaults::EPOCHS)]
    pub epochs: u32,
    /// Dropout probability.
    #[arg(long, default_value_t = defaults::DROPOUT)]
    pub dropout: f64,
    /// Adam learning rate.
    #[arg(long, default_value_t = defaults::LR)]
    pub lr: f64,
    /// Weight decay (an L2 penalty with Adam, decoupled with --adamw).
    #[arg(long, default_value_t = defaults::WEIGHT_DECAY)]
    pub weight_decay: f64,
    /// Use AdamW (decoupled weight decay).
    #[arg(long)]
    pub adamw: bool,
    /// Normalisation between layers: layernorm or none.
    #[arg(long, default_value = "none", value_parser = ["layernorm", "none"])]
    pub norm: String,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    pub grad_clip: Option<f64>,
    /// Seed of the weight init, the dropout masks and the samplers.
    #[arg(long, default_value_t = defaults::SEED)]
    pub seed: u64,
    /// Servers (fb/flx/cob/mb/auto).
    #[arg(long, default_value_t = defaults::SERVERS)]
    pub servers: u32,
    /// Devices per server.
    #[arg(long, default_value_t = defaults::DEVICES)]
    pub devices: u32,
    /// Partitioning: metis, spring, random or bytegnn.
    #[arg(long, default_value_t = defaults::PARTITION)]
    pub partition: PartitionMethod,
    /// What carries traffic between servers: quic (the daemons' data plane; the in-process
    /// fabric in `grandis train`) or nccl (CUDA ranks each on its own GPU, e.g. InfiniBand
    /// clusters). Inside a server CUDA ranks use NCCL, or device copies when they share a GPU.
    #[arg(long, default_value_t = InterTransport::Quic)]
    pub inter_transport: InterTransport,
    /// Seed of the partitioner.
    #[arg(long, default_value_t = 0)]
    pub partition_seed: u64,
    /// Use a partition directory written by `grandis partition` from the dataset (a path on
    /// every server for cluster jobs) instead of partitioning it now with --partition.
    #[arg(long)]
    pub partition_dir: Option<String>,
    /// flx: preloaded hops k (default: the largest k that fits --device-memory).
    #[arg(long)]
    pub preload_hops: Option<u32>,
    /// Per-device memory budget, bytes or with a unit ("64MiB", "16GiB"). flx: the largest k
    /// that fits; auto: the plans that fit; every mode: a plan the memory model prices above
    /// it is out of memory (default: what the device has).
    #[arg(long, value_parser = grandis_wire::spec::parse_bytes)]
    pub device_memory: Option<u64>,
    /// flx/cob/mb: dependency sampling: none, eas (expansion-aware), fanout (GraphSAGE) or
    /// saint (GraphSAINT, cob only).
    #[arg(long, default_value = "none", value_parser = ["none", "eas", "fanout", "saint"])]
    pub sampling: String,
    /// eas: external vertices at most this many hops from the server.
    #[arg(long, default_value_t = defaults::EAS_HOPS)]
    pub eas_hops: u32,
    /// eas: at most this many external in-neighbours per vertex.
    #[arg(long, default_value_t = defaults::EAS_FANOUT)]
    pub eas_fanout: u32,
    /// eas: degree (the paper's priority) or uniform (the published artifact).
    #[arg(long, default_value_t = defaults::EAS_PRIORITY)]
    pub eas_priority: Priority,
    /// fanout: per-hop fanouts from the targets, one per layer (e.g. 25,10,5) or one for
    /// every layer; with --mode mb alone it means --sampling fanout.
    #[arg(long, value_delimiter = ',')]
    pub fanouts: Option<Vec<u32>>,
    /// fanout, on a typed dataset: one relation's own fanouts, NAME=F1,F2,... (its name or
    /// src__name__dst; repeat the flag per relation): a vertex draws that relation's
    /// in-neighbours on their own, and --fanouts of every relation not named.
    #[arg(long = "relation-fanouts", value_name = "NAME=F1,F2,...", value_parser = parse_relation_fanouts)]
    pub relation_fanouts: Vec<(String, Vec<u32>)>,
    /// saint: random-walk length (0 = the node sampler); the budget is the batch size.
    #[arg(long, default_value_t = defaults::SAINT_WALK_LENGTH)]
    pub saint_walk_length: u32,
    /// flx with sampling: draw a new sample every N epochs (default: sample once).
    #[arg(long)]
    pub resample_every: Option<u64>,
    /// fb/flx: SANCUS staleness, BOUND,MAX_SKIPS (e.g. 0.05,4): a layer's boundary rows go to
    /// another server only when they moved by more than BOUND (relative norm) since last
    /// sent, and at least every MAX_SKIPS + 1 epochs; in between the receiver reuses them.
    #[arg(long, value_name = "BOUND,MAX_SKIPS")]
    pub staleness: Option<grandis_wire::Staleness>,
    /// cob/mb: DGS feature sampling, the fraction of feature columns fetched for vertices
    /// from other servers (the most important, from the first layer's weights).
    #[arg(long, value_name = "FRACTION")]
    pub remote_features: Option<f64>,
    /// auto: choose a sampled plan over the fastest exact one only when it is predicted this
    /// many times faster (1 = no preference) [default: 1.2].
    #[arg(long)]
    pub exact_preference: Option<f64>,
    /// Write the checkpoint every N epochs too, not only after the last (`train` needs
    /// --checkpoint PATH; for cluster jobs the coordinator keeps the latest, and a retry
    /// resumes from it).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub checkpoint_every: Option<u32>,
    /// Measure train / val accuracy after every N-th epoch (0: only after the last; the
    /// last epoch's evaluation is always the final train / val / test one). Evaluation is
    /// exact, so on billion-edge graphs it costs more than an epoch: evaluate rarely there.
    #[arg(long, default_value_t = defaults::EVAL_EVERY)]
    pub eval_every: u32,
    /// No evaluation at all (accuracies absent): score the trained checkpoint with
    /// `grandis predict`, which works layer-wise on graphs of any size.
    #[arg(long, conflicts_with = "eval_every")]
    pub no_eval: bool,
    /// Cluster jobs (`cluster up`, `submit`): times the job goes back to the queue after
    /// losing a server (or the coordinator) before it fails; each retry resumes from the
    /// last checkpoint (--checkpoint-every), else starts over.
    #[arg(long, default_value_t = defaults::MAX_RETRIES, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub max_retries: u32,
    /// Cluster jobs: a retry may run on fewer servers than --servers when not all are up (a
    /// new partition, the same model); without it, a retry waits for all of them.
    #[arg(long)]
    pub elastic: bool,
    /// Target vertices per iteration: per server for cob (and auto when it picks CoB; the
    /// default there is the largest that fits) and cluster (8 clusters of a eighth of it), per
    /// device for mb, GraphSAINT's budget. With --task link: supervision edges per device
    /// (mb) or per server (cob).
    #[arg(long, visible_alias = "cobatch-size")]
    pub batch_size: Option<u32>,
    /// After training, predict every vertex by layer-wise inference across the ranks
    /// (distributed modes): each rank R writes `predictions.R.npy` (int64 class ids),
    /// `vertices.R.npy` (the dataset's id of each row) and, with --predict-embeddings,
    /// `embeddings.R.npy` to this directory (a path on every server for cluster jobs).
    #[arg(long)]
    pub predict_dir: Option<String>,
    /// With --predict-dir: write the logits (f32, rows x classes) instead of class ids.
    #[arg(long, requires = "predict_dir")]
    pub predict_logits: bool,
    /// With --predict-dir: also write the vertex embeddings (the last layer's input).
    #[arg(long, requires = "predict_dir")]
    pub predict_embeddings: bool,
    /// With --predict-dir: memory one block of vertices may use on a rank, bytes or with a
    /// unit (default: half of --device-memory).
    #[arg(long, requires = "predict_dir", value_parser = grandis_wire::spec::parse_bytes)]
    pub predict_block_memory: Option<u64>,
    /// What the model is trained for: node (classification) or link (prediction: the dot
    /// product of the ends' embeddings, on the dataset's link split from `grandis data
    /// split-edges`; modes single, fb, flx and cluster, mb and cob with batches of supervision
    /// edges, and auto, each exact or (mb, cob, auto) with --sampling fanout).
    #[arg(long, default_value_t = grandis_wire::Task::Node)]
    pub task: grandis_wire::Task,
    /// --task link: negatives per supervision edge each epoch (the destination corrupted)
    /// [default: 1].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub negatives: Option<u32>,
    /// --task link: columns of the embedding the last layer outputs [default: --hidden].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub out_dim: Option<u32>,
    /// --task link: how a pair is scored from its ends' embeddings: dot (their dot product)
    /// or mlp (an MLP on their Hadamard product: Linear(d, d), ReLU, Linear(d, 1), trained
    /// with the model) [default: dot].
    #[arg(long)]
    pub decoder: Option<grandis_wire::LinkDecoder>,
    /// Learnable node embeddings: this many columns per vertex, the model's input after the
    /// dataset's features (all of it on a featureless graph), trained with a sparse Adam and
    /// kept in checkpoints; in every mode (outside single each rank keeps its own vertices'
    /// rows), with --model ressage in mode single only so far [default: 0, none].
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=4096))]
    pub embedding_dim: Option<u32>,
    /// rgcn: each relation's weight a combination of this many shared bases (basis
    /// decomposition, PyG's num_bases) [default: a full weight per relation].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub num_bases: Option<u32>,
}

/// `NAME=F1,F2,...`: one relation's fanouts (`--relation-fanouts`).
fn parse_relation_fanouts(s: &str) -> Result<(String, Vec<u32>), String> {
    let form = "expected NAME=F1,F2,... (a relation and its fanouts, e.g. cites=15,10)";
    let (name, list) = s.split_once('=').ok_or_else(|| format!("{s:?}: {form}"))?;
    let fanouts = list
        .split(',')
        .map(|f| f.trim().parse::<u32>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| format!("{s:?}: {form}"))?;
    if name.trim().is_empty() {
        return Err(format!("{s:?}: {form}"));
    }
    Ok((name.trim().to_string(), fanouts))
}

impl JobArgs {
    /// The job these flags describe, on `dataset`, in `--mode` or `default_mode`. Checked
    /// ([`JobSpec::validate`]); a message names the flag.
    pub fn spec(&self, dataset: String, default_mode: Mode) -> anyhow::Result<JobSpec> {
        let mode = self.mode.unwrap_or(default_mode);
        let method = match (self.sampling.as_str(), mode) {
            // MB is the per-GPU GraphSAGE baseline: --fanouts alone means fanout sampling.
            ("none", Mode::Mb) if self.fanouts.is_some() => "fanout",
            (m, _) => m,
        };
        let sampling = match method {
            "none" => Sampling::None,
            "eas" => Sampling::Eas {
                hops: self.eas_hops,
                fanout: self.eas_fanout,
                priority: self.eas_priority,
            },
            "fanout" => match &self.fanouts {
                Some(f) => Sampling::Fanout {
                    fanouts: f.clone(),
                    relation_fanouts: self.relation_fanouts.iter().cloned().collect(),
                },
                None => bail!("--sampling fanout needs --fanouts F1,F2,... (one per layer)"),
            },
            "saint" => Sampling::Saint {
                walk_length: self.saint_walk_length,
            },
            other => bail!(
                "unknown --sampling '{other}' (expected {})",
                Sampling::EXPECTED
            ),
        };
        let spec = JobSpec {
            name: None,
            dataset,
            model: self.model,
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            output_heads: self.output_heads,
            dropout: self.dropout,
            lr: self.lr,
            weight_decay: self.weight_decay,
            adamw: self.adamw,
            grad_clip: self.grad_clip,
            layer_norm: self.norm == "layernorm",
            mode,
            preload_hops: self.preload_hops,
            // Only the modes that batch read it; elsewhere it is ignored, not an error.
            batch_size: self
                .batch_size
                .filter(|_| mode.is_mini_batch() || mode == Mode::Auto),
            sampling,
            resample_every: self.resample_every,
            exact_preference: self.exact_preference,
            checkpoint_every: self.checkpoint_every,
            max_retries: self.max_retries,
            elastic: self.elastic,
            epochs: self.epochs,
            eval_every: self.eval_every,
            evaluate: !self.no_eval,
            seed: self.seed,
            servers: self.servers,
            devices: self.devices,
            partition: self.partition,
            inter_transport: self.inter_transport,
            partition_seed: self.partition_seed,
            partition_dir: self.partition_dir.clone(),
            device_memory: self.device_memory,
            predict: self.predict_dir.clone().map(|dir| PredictSpec {
                dir,
                logits: self.predict_logits,
                embeddings: self.predict_embeddings,
                block_memory: self.predict_block_memory,
            }),
            staleness: self.staleness,
            remote_features: self.remote_features,
            task: self.task,
            link: match (self.negatives, self.out_dim, self.decoder) {
                (None, None, None) => None,
                (negatives, out_dim, decoder) => Some(grandis_wire::LinkSpec {
                    negatives: negatives.unwrap_or(grandis_wire::LinkSpec::default().negatives),
                    out_dim,
                    decoder: decoder.unwrap_or_default(),
                }),
            },
            embedding_dim: self.embedding_dim.unwrap_or(0),
            num_bases: self.num_bases,
        };
        Ok(spec)
    }
}

/// `mode auto` without `--device-memory`: the budget the planner decides with is what this
/// machine's devices have, shared by every rank of the job (`grandis train` runs them all
/// here; `cluster up`'s daemons all run here and must make the same decision, so the job
/// carries it).
pub fn fill_auto_budget(
    spec: &mut JobSpec,
    compute: &grandis_parallel::Compute,
) -> anyhow::Result<()> {
    if spec.mode == grandis_wire::Mode::Auto && spec.device_memory.is_none() {
        let (servers, devices) = (spec.servers as usize, spec.devices as usize);
        spec.device_memory = Some(grandis_parallel::default_budget(compute, servers, devices)?.0);
    }
    Ok(())
}

/// [`JobSpec::validate`] with every field named as its flag (`--eas-fanout`, `--layers`).
pub fn validate_as_flags(spec: &JobSpec) -> anyhow::Result<()> {
    let Err(e) = spec.validate() else {
        return Ok(());
    };
    let lines: Vec<String> = e
        .fields()
        .iter()
        .map(|f| {
            let name = f.field.rsplit('.').next().unwrap_or(&f.field);
            let flag = match f.field.as_str() {
                "predict" | "predict.dir" => "predict-dir".to_string(),
                p if p.starts_with("predict.") => p.replace(['.', '_'], "-"),
                p if p.starts_with("staleness") => "staleness".to_string(),
                "link" => "negatives / --out-dim / --decoder".to_string(),
                _ => match name {
                    "fanout" => "eas-fanout".to_string(),
                    "hops" => "eas-hops".to_string(),
                    "walk_length" => "saint-walk-length".to_string(),
                    "layer_norm" => "norm".to_string(),
                    other => other.replace('_', "-"),
                },
            };
            format!("--{flag}: {}", f.message)
        })
        .collect();
    bail!("{}", lines.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        job: JobArgs,
    }

    fn spec(argv: &[&str], default_mode: Mode) -> anyhow::Result<JobSpec> {
        let mut all = vec!["grandis"];
        all.extend_from_slice(argv);
        Cli::try_parse_from(all)?.job.spec("d".into(), default_mode)
    }

    #[test]
    fn no_flags_is_the_default_job() {
        let s = spec(&[], Mode::Flx).unwrap();
        assert_eq!(
            s,
            JobSpec {
                dataset: "d".into(),
                ..JobSpec::default()
            }
        );
    }

    #[test]
    fn flags_map_to_the_spec() {
        let s = spec(
            &[
                "--mode",
                "cob",
                "--cobatch-size",
                "64",
                "--sampling",
                "fanout",
                "--fanouts",
                "5",
            ],
            Mode::Single,
        )
        .unwrap();
        assert_eq!(s.mode, Mode::Cob);
        assert_eq!(s.batch_size, Some(64));
        assert_eq!(
            s.sampling,
            Sampling::Fanout {
                fanouts: vec![5],
                relation_fanouts: Default::default()
            }
        );
        // --fanouts alone with mb is fanout sampling.
        let s = spec(&["--mode", "mb", "--fanouts", "10,5"], Mode::Single).unwrap();
        assert_eq!(
            s.sampling,
            Sampling::Fanout {
                fanouts: vec![10, 5],
                relation_fanouts: Default::default()
            }
        );
        // One relation's own fanouts; a malformed one is refused naming the flag's form.
        let s = spec(
            &[
                "--mode",
                "mb",
                "--fanouts",
                "10,5",
                "--relation-fanouts",
                "cites=15,10",
                "--relation-fanouts",
                "writes=3",
            ],
            Mode::Single,
        )
        .unwrap();
        let Sampling::Fanout {
            relation_fanouts, ..
        } = &s.sampling
        else {
            panic!("{:?}", s.sampling)
        };
        assert_eq!(relation_fanouts["cites"], vec![15, 10]);
        assert_eq!(relation_fanouts["writes"], vec![3]);
        let e = spec(
            &[
                "--mode",
                "mb",
                "--fanouts",
                "10,5",
                "--relation-fanouts",
                "cites",
            ],
            Mode::Single,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("NAME=F1,F2"), "{e}");
        let s = spec(
            &[
                "--mode",
                "flx",
                "--sampling",
                "eas",
                "--eas-fanout",
                "4",
                "--eas-priority",
                "uniform",
            ],
            Mode::Single,
        )
        .unwrap();
        assert_eq!(
            s.sampling,
            Sampling::Eas {
                hops: 1,
                fanout: 4,
                priority: Priority::Uniform
            }
        );
        let e = spec(&["--mode", "fast"], Mode::Single)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown 'fast' (expected single, fb, flx, cob, mb, cluster or auto)"),
            "{e}"
        );
        let e = spec(&["--sampling", "fanout"], Mode::Flx)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs --fanouts"), "{e}");
        let s = spec(
            &["--layers", "3", "--sampling", "fanout", "--fanouts", "1,2"],
            Mode::Cob,
        )
        .unwrap();
        let e = validate_as_flags(&s).unwrap_err().to_string();
        assert_eq!(e, "--fanouts: expected 1 value or 3 (= layers), got 2");
    }
}
