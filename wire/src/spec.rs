//! The job description users submit: what to train, how, and on how many servers.
//!
//! Two ways in. Users hand a JSON or TOML document to [`JobSpec::from_json_str`] /
//! [`JobSpec::from_toml_str`]: the document is first parsed into a generic value and then read
//! field by field, so that *every* problem is reported at once and each message names its
//! field ("epochs: must be ≥ 1, got -3") — serde's derived errors cannot do that (they stop at
//! the first problem and do not name the field). Programs exchange already-valid specs through
//! the derived serde impls (the daemon protocol does); they should still call
//! [`JobSpec::validate`] on what they receive. The types are here, the reading in `read`, the
//! checks in `validate`.

use std::fmt;

use serde::{Deserialize, Serialize};

mod bytes;
pub mod defaults;
mod kinds;
mod read;
mod validate;

pub use bytes::parse_bytes;
pub use kinds::{
    InterTransport, LinkDecoder, Mode, ModelKind, PartitionMethod, Priority, Task, UnknownName,
};

/// The longest job name, given or derived from the dataset path, in bytes.
pub const NAME_MAX_BYTES: usize = 200;
/// The longest dataset path a spec may give, in bytes (Linux's PATH_MAX).
pub const PATH_MAX_BYTES: usize = 4096;

/// Which edges are dropped, if any.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "method", rename_all = "lowercase")]
pub enum Sampling {
    /// Every dependency is kept (exact training).
    #[default]
    None,
    /// Expansion-aware sampling (§5.3): only the inter-server boundary is sampled, up to `hops`
    /// hops away from the server's inner vertices and `fanout` external neighbours per vertex.
    Eas {
        hops: u32,
        fanout: u32,
        #[serde(default)]
        priority: Priority,
    },
    /// GraphSAGE layer-wise neighbour sampling: `fanouts[i]` sources per vertex at hop `i + 1`
    /// from the targets (the last layer's first, as in `--fanouts 25,10,5`); one value means
    /// the same fanout at every layer.
    Fanout {
        fanouts: Vec<u32>,
        /// On a typed dataset, the fanouts of the relations named here (by name, or as
        /// `src__name__dst`), as `fanouts` is read: a vertex draws each relation's in-neighbours
        /// on their own, its listed fanout of them, and `fanouts` of every relation not listed
        /// (DGL's per-edge-type fanouts). Empty: one draw over all in-neighbours.
        #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
        relation_fanouts: std::collections::BTreeMap<String, Vec<u32>>,
    },
    /// GraphSAINT subgraph sampling per server per iteration, with a budget of the batch size:
    /// random walks of `walk_length` steps from `batch_size / (walk_length + 1)` roots, or the
    /// node sampler when `walk_length` is 0.
    Saint { walk_length: u32 },
}

/// Why a job of `task` cannot train in mode `mode` with `sampling`, if it cannot: the one
/// rule spec validation, the planner and the runner share. Link prediction trains in the
/// exact modes (single, fb, flx without sampling, and auto, which then chooses among fb and
/// flx) and in modes mb and cob, whose batches are seeded by supervision edges (PyG's
/// `LinkNeighborLoader`), exact or with fanout sampling; cluster batches and the other
/// samplers (EAS trims at a server's boundary, SAINT samples subgraphs) do not take edge
/// seeds yet.
pub fn task_conflict(task: Task, mode: Mode, sampling: &Sampling) -> Option<String> {
    match (task, mode, sampling) {
        (Task::Node, _, _) => None,
        (Task::Link, Mode::Single | Mode::Fb | Mode::Flx | Mode::Auto, Sampling::None) => None,
        (Task::Link, Mode::Mb | Mode::Cob, Sampling::None | Sampling::Fanout { .. }) => None,
        // Auto then plans the exact modes and mb and cob with that fanout.
        (Task::Link, Mode::Auto, Sampling::Fanout { .. }) => None,
        (Task::Link, Mode::Cluster, Sampling::None) => None,
        (Task::Link, _, _) => Some(format!(
            "link prediction trains in modes single, fb, flx, cluster and auto without \
             sampling, and in modes mb, cob and auto with fanout sampling (mb and cob also \
             without), so far; not mode '{mode}' with sampling '{}'",
            sampling.method()
        )),
    }
}

impl Sampling {
    /// Why mode `mode` cannot train with this sampling, if it cannot: the one rule every
    /// front end (spec validation) and the planner share.
    pub fn conflict_with(&self, mode: Mode) -> Option<String> {
        match (mode, self) {
            (_, Sampling::None) => None,
            (Mode::Single | Mode::Fb, s) => Some(format!(
                "mode '{mode}' trains on the exact graph; sampling '{}' needs mode flx, cob or mb",
                s.method()
            )),
            (Mode::Flx, Sampling::Saint { .. }) => Some(
                "GraphSAINT samples a subgraph per iteration, which FLX (full batch) has not: \
                 use mode cob with sampling saint"
                    .into(),
            ),
            (Mode::Mb, Sampling::Saint { .. }) => {
                Some("GraphSAINT is server-wise here: use mode cob with sampling saint".into())
            }
            (Mode::Cluster, s) => Some(format!(
                "mode 'cluster' samples by clusters: its batches are their own sampling, so \
                 sampling '{}' does not apply",
                s.method()
            )),
            _ => None,
        }
    }

    /// The method's name with the paper's defaults for its parameters ([`defaults`]).
    pub fn with_defaults(method: &str) -> Option<Sampling> {
        Some(match method {
            "none" => Sampling::None,
            "eas" => Sampling::Eas {
                hops: defaults::EAS_HOPS,
                fanout: defaults::EAS_FANOUT,
                priority: defaults::EAS_PRIORITY,
            },
            "fanout" => Sampling::Fanout {
                fanouts: vec![defaults::FANOUT],
                relation_fanouts: Default::default(),
            },
            "saint" => Sampling::Saint {
                walk_length: defaults::SAINT_WALK_LENGTH,
            },
            _ => return None,
        })
    }

    /// Accepted method names, for error messages.
    pub const EXPECTED: &'static str = "none, eas, fanout or saint";

    pub fn method(&self) -> &'static str {
        match self {
            Sampling::None => "none",
            Sampling::Eas { .. } => "eas",
            Sampling::Fanout { .. } => "fanout",
            Sampling::Saint { .. } => "saint",
        }
    }

    pub fn is_none(&self) -> bool {
        matches!(self, Sampling::None)
    }

    /// Layer-wise fanouts, one per layer (hop 1 first): one value is repeated `layers` times.
    pub fn fanouts_per_layer(fanouts: &[u32], layers: usize) -> Vec<usize> {
        match fanouts {
            [one] => vec![*one as usize; layers],
            many => many.iter().map(|&f| f as usize).collect(),
        }
    }
}

impl Default for Mode {
    fn default() -> Mode {
        defaults::MODE
    }
}

/// A training job: the one description of a job on its way from a front end (`grandis train`,
/// `cluster up`, `submit`, a REST body) to the ranks. Absent fields take [`defaults`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobSpec {
    /// Optional display name.
    pub name: Option<String>,
    /// Dataset directory, as a path on every server (datasets live on the servers, not on the
    /// coordinator; a server that lacks it fails the job naming itself). Required.
    pub dataset: String,
    /// Architecture (default sage).
    pub model: ModelKind,
    /// Number of graph convolutions (default 2).
    pub layers: u32,
    /// Hidden width (default 64); with gat, all heads together (8 heads of 8 = 64).
    pub hidden: u32,
    /// gat: attention heads of each hidden layer, concatenated; must divide `hidden`
    /// (default 8). Other models ignore it.
    pub heads: u32,
    /// gat: attention heads of the last layer, averaged (default 1). Other models ignore it.
    pub output_heads: u32,
    /// Dropout probability in [0, 1) (default 0.5).
    pub dropout: f64,
    /// Adam learning rate (default 0.01).
    pub lr: f64,
    /// Weight decay (default 5e-4): an L2 penalty with Adam, decoupled with `adamw`.
    pub weight_decay: f64,
    /// AdamW (decoupled weight decay) instead of Adam (default false).
    pub adamw: bool,
    /// Clip the global gradient norm to this value (default: no clipping).
    pub grad_clip: Option<f64>,
    /// LayerNorm between layers (default false).
    pub layer_norm: bool,
    /// Distribution mode (default flx: the largest preloading k that fits each daemon's memory).
    pub mode: Mode,
    /// Hops preloaded per server (flx/cob/auto); absent = chosen by the memory model.
    pub preload_hops: Option<u32>,
    /// Target vertices per batch (mb: per device, cob: per server, saint: the budget; a link
    /// job's: supervision edges); absent = [`defaults::BATCH_SIZE`] (saint:
    /// [`defaults::SAINT_ROOTS`] × (walk_length + 1)).
    pub batch_size: Option<u32>,
    /// Sampling (default none).
    pub sampling: Sampling,
    /// flx with sampling: draw a new sample every N epochs; absent = sample once.
    pub resample_every: Option<u64>,
    /// auto: a sampled plan is chosen over the fastest exact one only when predicted this
    /// many times faster (1 = no preference); absent = [`defaults::EXACT_PREFERENCE`].
    pub exact_preference: Option<f64>,
    /// Write a checkpoint (weights, Adam state, epoch) every N epochs and after the last; a
    /// job run again (a retry, `--resume`) continues from it. Absent = only `grandis train
    /// --checkpoint` writes one, at the end.
    pub checkpoint_every: Option<u32>,
    /// Cluster jobs: how many times the job goes back to the queue when one of its servers is
    /// lost (or the coordinator restarts) before it fails (default 2). A retry continues from
    /// the last checkpoint the coordinator holds (see `checkpoint_every`), else from scratch.
    pub max_retries: u32,
    /// Cluster jobs: a retry may run on fewer servers than `servers` when not all of them are
    /// up (a new partition, the same model and checkpoint); default false: wait for them.
    pub elastic: bool,
    /// Epochs (default 100).
    pub epochs: u32,
    /// Measure train / val accuracy (dropout off) after every N-th epoch and train / val /
    /// test after the last (default 1); 0 = after the last only. Evaluation is exact: on a
    /// billion-edge graph one costs more than an epoch.
    pub eval_every: u32,
    /// false = no evaluation at all: the accuracies are absent (score the checkpoint with
    /// `grandis predict`, layer-wise). Default true.
    pub evaluate: bool,
    /// Seed of weights, dropout and samplers (default 0).
    pub seed: u64,
    /// Servers (distinct daemon labels) the job needs (default 1).
    pub servers: u32,
    /// Devices per server (default 1).
    pub devices: u32,
    /// Partitioning method (default metis).
    pub partition: PartitionMethod,
    /// What carries traffic between servers: quic (default) or nccl (CUDA ranks on an
    /// InfiniBand cluster). Inside a server, CUDA ranks always use NCCL, or device copies
    /// when they share a GPU.
    pub inter_transport: InterTransport,
    /// Seed of the partitioner (default 0).
    pub partition_seed: u64,
    /// A partition directory written by `grandis partition` from `dataset`, as a path on
    /// every server: the run uses it (its method, servers and devices must match) instead of
    /// partitioning `dataset` itself, which for a billion-edge graph takes longer than
    /// training and, in every daemon, memory the run needs.
    pub partition_dir: Option<String>,
    /// Memory budget per device in bytes; absent = what the device reports.
    pub device_memory: Option<u64>,
    /// After training, predict every vertex by layer-wise inference across the job's ranks
    /// (distributed modes); absent = no predictions.
    pub predict: Option<PredictSpec>,
    /// fb / flx: SANCUS's staleness-bounded halo exchange between servers; absent = exact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness: Option<Staleness>,
    /// cob / mb: DGS's feature-level sampling of vertices fetched from other servers: the
    /// fraction of feature columns sent (the most important ones); absent = every column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_features: Option<f64>,
    /// What the model is trained for (default node classification).
    #[serde(default, skip_serializing_if = "Task::is_node")]
    pub task: Task,
    /// Link prediction's options (task link only); absent = their defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<LinkSpec>,
    /// Columns of a learnable embedding per vertex, the model's input beside the dataset's
    /// features (all of it on a featureless graph), trained with a sparse Adam (DGL's
    /// `SparseAdam`) and kept in checkpoints; 0 (default) = none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub embedding_dim: u32,
    /// rgcn: each relation's weight a combination of this many shared bases (Schlichtkrull et
    /// al.'s basis decomposition, PyG's `num_bases`); absent (default) = a full weight per
    /// relation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_bases: Option<u32>,
}

fn is_zero(x: &u32) -> bool {
    *x == 0
}

/// Link prediction (`task = "link"`): the encoder is the job's model, whose last layer
/// outputs `out_dim` columns per vertex (its embedding); a pair's score is the dot product of
/// its ends' embeddings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LinkSpec {
    /// Negatives per supervision edge each epoch: `(u, w)` for a positive `(u, v)`, `w`
    /// uniform over the vertices (the destination corrupted), seeded by (seed, epoch, edge)
    /// (default 1).
    pub negatives: u32,
    /// Columns of the embedding the last layer outputs; absent = `hidden`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_dim: Option<u32>,
    /// How a pair is scored from its ends' embeddings (default `dot`).
    #[serde(skip_serializing_if = "LinkDecoder::is_dot")]
    pub decoder: LinkDecoder,
}

impl Default for LinkSpec {
    fn default() -> Self {
        LinkSpec {
            negatives: 1,
            out_dim: None,
            decoder: LinkDecoder::Dot,
        }
    }
}

/// SANCUS's bounded embedding staleness (the "variation gap" bound, with an epoch bound on
/// top): an owner re-sends a layer's boundary rows to another server only when they have moved
/// by more than `bound` (relative: `‖H − H_sent‖ / ‖H_sent‖`, Frobenius) since it last sent
/// them, and at least every `max_skips + 1` epochs; the receiver computes with the rows it last
/// received in between.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Staleness {
    /// Relative variation below which a send is skipped (≥ 0; 0 skips only unchanged rows).
    pub bound: f64,
    /// Skips in a row at most (≥ 1).
    pub max_skips: u32,
}

impl std::str::FromStr for Staleness {
    type Err = String;

    /// `BOUND,MAX_SKIPS`, e.g. `0.05,4`.
    fn from_str(s: &str) -> Result<Staleness, String> {
        let (bound, skips) = s
            .split_once(',')
            .ok_or_else(|| format!("expected BOUND,MAX_SKIPS (e.g. 0.05,4), got '{s}'"))?;
        let bound: f64 = bound
            .trim()
            .parse()
            .map_err(|_| format!("the bound '{bound}' is not a number"))?;
        let max_skips: u32 = skips
            .trim()
            .parse()
            .map_err(|_| format!("max skips '{skips}' is not a whole number"))?;
        let st = Staleness { bound, max_skips };
        st.check()?;
        Ok(st)
    }
}

impl Staleness {
    /// The ranges a usable bound has.
    pub fn check(&self) -> Result<(), String> {
        if !(self.bound.is_finite() && self.bound >= 0.0) {
            return Err(format!(
                "the bound must be a finite number ≥ 0, got {}",
                self.bound
            ));
        }
        if self.max_skips < 1 {
            return Err("max skips must be ≥ 1 (0 would never skip: leave staleness out)".into());
        }
        Ok(())
    }
}

/// Layer-wise inference over every vertex after training, across the job's ranks: each rank
/// computes its own vertices one layer at a time and writes them to `dir` as `.npy`
/// (`predictions.R.npy`, `vertices.R.npy` — the dataset's id of each row —, and
/// `embeddings.R.npy`, for global rank R), so no process ever holds a whole layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PredictSpec {
    /// Output directory, as a path on every server (created if missing). Required.
    pub dir: String,
    /// Write the logits (f32, rows x classes) instead of class ids (int64) (default false).
    #[serde(default)]
    pub logits: bool,
    /// Also write the vertex embeddings (the last layer's input) (default false).
    #[serde(default)]
    pub embeddings: bool,
    /// Bytes one block of vertices may use on a rank; absent = half the device budget.
    #[serde(default)]
    pub block_memory: Option<u64>,
}

impl Default for JobSpec {
    fn default() -> Self {
        JobSpec {
            name: None,
            dataset: String::new(),
            model: defaults::MODEL,
            layers: defaults::LAYERS,
            hidden: defaults::HIDDEN,
            heads: defaults::HEADS,
            output_heads: defaults::OUTPUT_HEADS,
            dropout: defaults::DROPOUT,
            lr: defaults::LR,
            weight_decay: defaults::WEIGHT_DECAY,
            adamw: false,
            grad_clip: None,
            layer_norm: false,
            mode: defaults::MODE,
            preload_hops: None,
            batch_size: None,
            sampling: Sampling::None,
            resample_every: None,
            exact_preference: None,
            checkpoint_every: None,
            max_retries: defaults::MAX_RETRIES,
            elastic: false,
            epochs: defaults::EPOCHS,
            eval_every: defaults::EVAL_EVERY,
            evaluate: true,
            seed: defaults::SEED,
            servers: defaults::SERVERS,
            devices: defaults::DEVICES,
            partition: defaults::PARTITION,
            inter_transport: InterTransport::Quic,
            partition_seed: 0,
            partition_dir: None,
            device_memory: None,
            predict: None,
            staleness: None,
            remote_features: None,
            task: Task::Node,
            link: None,
            embedding_dim: 0,
            num_bases: None,
        }
    }
}

/// One problem with one field.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldError {
    /// Dotted path of the field (`epochs`, `sampling.fanout`).
    pub field: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Why a job document was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The text is not well-formed JSON/TOML (the message carries line and column).
    #[error("malformed {format}: {message}")]
    Syntax {
        format: &'static str,
        message: String,
    },
    /// Well-formed, but some fields are wrong (all of them are listed).
    #[error("{}", join_errors(.0))]
    Invalid(Vec<FieldError>),
}

impl SpecError {
    /// The field errors (empty for a syntax error).
    pub fn fields(&self) -> &[FieldError] {
        match self {
            SpecError::Syntax { .. } => &[],
            SpecError::Invalid(v) => v,
        }
    }
}

fn join_errors(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

const FIELDS: &[&str] = &[
    "name",
    "dataset",
    "model",
    "layers",
    "hidden",
    "heads",
    "output_heads",
    "dropout",
    "lr",
    "weight_decay",
    "adamw",
    "grad_clip",
    "layer_norm",
    "mode",
    "preload_hops",
    "batch_size",
    "sampling",
    "resample_every",
    "exact_preference",
    "checkpoint_every",
    "max_retries",
    "elastic",
    "epochs",
    "eval_every",
    "evaluate",
    "seed",
    "servers",
    "devices",
    "partition",
    "inter_transport",
    "partition_seed",
    "partition_dir",
    "device_memory",
    "predict",
    "staleness",
    "remote_features",
    "task",
    "link",
    "embedding_dim",
    "num_bases",
];

impl JobSpec {
    /// The batch size the job trains with: `batch_size`, else the documented default
    /// ([`defaults::BATCH_SIZE`]; GraphSAINT: [`defaults::SAINT_ROOTS`] roots' worth).
    pub fn batch_size_or_default(&self) -> u32 {
        match (self.batch_size, &self.sampling) {
            (Some(b), _) => b,
            (None, Sampling::Saint { walk_length }) => {
                defaults::SAINT_ROOTS.saturating_mul(walk_length + 1)
            }
            (None, _) => defaults::BATCH_SIZE,
        }
    }

    /// The job's display name: its `name`, or the dataset's last path component cut to
    /// [`NAME_MAX_BYTES`] (at a character boundary), the most a given name may hold.
    pub fn display_name(&self) -> String {
        if let Some(n) = &self.name {
            return n.clone();
        }
        let last = self
            .dataset
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(&self.dataset);
        let mut end = last.len().min(NAME_MAX_BYTES);
        while !last.is_char_boundary(end) {
            end -= 1;
        }
        last[..end].to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(json: &str) -> Vec<String> {
        match JobSpec::from_json_str(json) {
            Ok(s) => panic!("accepted {json}: {s:?}"),
            Err(e) => {
                assert!(!e.fields().is_empty(), "{e}");
                e.fields().iter().map(|f| f.to_string()).collect()
            }
        }
    }

    /// `json` is refused with a message on `field` that says `says`.
    fn refused(json: &str, field: &str, says: &str) {
        let e = errors(json);
        let prefix = format!("{field}: ");
        assert!(
            e.iter().any(|m| m.starts_with(&prefix) && m.contains(says)),
            "{json}: {e:?}"
        );
    }

    #[test]
    fn modes_refuse_samplers_they_cannot_run_and_clusters_refuse_single() {
        for (doc, want) in [
            (
                r#"{"dataset": "d", "mode": "flx", "sampling": "saint"}"#,
                "use mode cob",
            ),
            (
                r#"{"dataset": "d", "mode": "mb", "sampling": "saint"}"#,
                "use mode cob",
            ),
            (
                r#"{"dataset": "d", "mode": "fb", "sampling": "eas"}"#,
                "needs mode flx, cob or mb",
            ),
            (
                r#"{"dataset": "d", "mode": "single", "layers": 1, "sampling": {"method": "fanout", "fanouts": [3]}}"#,
                "needs mode flx, cob or mb",
            ),
        ] {
            refused(doc, "sampling", want);
        }
        for ok in [
            r#"{"dataset": "d", "mode": "cob", "sampling": "saint"}"#,
            r#"{"dataset": "d", "mode": "flx", "sampling": "eas"}"#,
            r#"{"dataset": "d", "mode": "auto", "sampling": "saint", "device_memory": "1GiB"}"#,
        ] {
            JobSpec::from_json_str(ok)
                .unwrap()
                .check_cluster_job()
                .unwrap();
        }
        let single = JobSpec::from_json_str(r#"{"dataset": "d", "mode": "single"}"#).unwrap();
        let e = single.check_cluster_job().unwrap_err();
        assert_eq!(e.fields().len(), 1, "{e}");
        assert!(e.to_string().contains("single-process trainer"), "{e}");
    }

    #[test]
    fn link_prediction_trains_in_the_exact_modes_mb_cob_cluster_and_auto() {
        for ok in [
            r#"{"dataset": "d", "task": "link", "mode": "fb"}"#,
            r#"{"dataset": "d", "task": "link", "mode": "mb", "batch_size": 64}"#,
            r#"{"dataset": "d", "task": "link", "mode": "cob", "batch_size": 64}"#,
            r#"{"dataset": "d", "task": "link", "mode": "mb", "batch_size": 64, "sampling": {"method": "fanout", "fanouts": [10, 5]}}"#,
            r#"{"dataset": "d", "task": "link", "mode": "flx", "preload_hops": 1}"#,
            r#"{"dataset": "d", "task": "link", "mode": "auto", "device_memory": "1GiB"}"#,
            r#"{"dataset": "d", "task": "link", "mode": "auto", "device_memory": "1GiB", "sampling": {"method": "fanout", "fanouts": [10, 5]}}"#,
            r#"{"dataset": "d", "task": "link", "mode": "cluster", "batch_size": 8}"#,
        ] {
            JobSpec::from_json_str(ok)
                .unwrap()
                .check_cluster_job()
                .unwrap();
        }
        for doc in [
            r#"{"dataset": "d", "task": "link", "mode": "cob", "batch_size": 8, "sampling": "saint"}"#,
            r#"{"dataset": "d", "task": "link", "mode": "flx", "sampling": "eas"}"#,
            r#"{"dataset": "d", "task": "link", "mode": "auto", "sampling": "eas"}"#,
            r#"{"dataset": "d", "task": "link", "mode": "mb", "batch_size": 8, "sampling": "eas"}"#,
        ] {
            refused(doc, "task", "single, fb, flx, cluster and auto");
        }
        let mlp = JobSpec::from_json_str(
            r#"{"dataset": "d", "task": "link", "mode": "fb", "link": {"decoder": "mlp"}}"#,
        )
        .unwrap();
        assert_eq!(mlp.link.unwrap().decoder, LinkDecoder::Mlp);
        refused(
            r#"{"dataset": "d", "task": "link", "link": {"decoder": "bilinear"}}"#,
            "link.decoder",
            "dot or mlp",
        );
    }

    #[test]
    fn exact_preference_is_auto_s_and_at_least_one() {
        for (doc, want) in [
            (
                r#"{"dataset": "d", "mode": "cob", "exact_preference": 1.5}"#,
                "only used by mode auto (mode is 'cob')",
            ),
            (
                r#"{"dataset": "d", "mode": "auto", "device_memory": "1GiB", "exact_preference": 0.5}"#,
                "must be a number ≥ 1",
            ),
            (
                r#"{"dataset": "d", "mode": "auto", "device_memory": "1GiB", "exact_preference": "fast"}"#,
                "expected a number",
            ),
        ] {
            refused(doc, "exact_preference", want);
        }
        let ok = JobSpec::from_json_str(
            r#"{"dataset": "d", "mode": "auto", "device_memory": "1GiB", "exact_preference": 1}"#,
        )
        .unwrap();
        assert_eq!(ok.exact_preference, Some(1.0));
    }

    #[test]
    fn control_characters_in_names_and_paths_are_refused() {
        let e =
            errors(r#"{"dataset": "d\u001b[2J", "name": "x\n2026-11-23T00:00:00Z INFO forged"}"#);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e.iter().all(|m| m.contains("control characters")), "{e:?}");
        JobSpec::from_json_str(r#"{"dataset": "/data/ünï cödé", "name": "a b"}"#).unwrap();
    }

    #[test]
    fn defaults_fill_missing_fields() {
        let s = JobSpec::from_json_str(r#"{"dataset": "/data/cora"}"#).unwrap();
        assert_eq!(
            s,
            JobSpec {
                dataset: "/data/cora".into(),
                ..JobSpec::default()
            }
        );
        assert_eq!(s.display_name(), "cora");
    }

    /// A derived name is capped as a given one is, and a dataset path longer than any a
    /// server opens is refused (a 100 KB path made a 100 KB job name and log lines).
    #[test]
    fn names_and_paths_are_bounded() {
        let long = "é".repeat(300);
        let s = JobSpec::from_json_str(&format!(r#"{{"dataset": "/data/{long}"}}"#)).unwrap();
        let name = s.display_name();
        assert!(
            name.len() <= NAME_MAX_BYTES && name.len() >= NAME_MAX_BYTES - 1,
            "{name}"
        );
        assert!(long.starts_with(&name));
        let huge = "d".repeat(100_000);
        let e = errors(&format!(r#"{{"dataset": "{huge}"}}"#));
        assert!(
            e.iter()
                .any(|m| m.contains("dataset") && m.contains("at most 4096 bytes")),
            "{e:?}"
        );
    }

    #[test]
    fn relation_fanouts_parse_and_are_checked_per_relation() {
        let spec = JobSpec::from_json_str(
            r#"{"dataset": "d", "layers": 2, "sampling": {"method": "fanout",
                "fanouts": [10, 5], "relation_fanouts": {"cites": [15, 10], "writes": 3}}}"#,
        )
        .unwrap();
        let Sampling::Fanout {
            fanouts,
            relation_fanouts,
        } = &spec.sampling
        else {
            panic!("{:?}", spec.sampling)
        };
        assert_eq!(fanouts, &[10, 5]);
        assert_eq!(relation_fanouts["cites"], vec![15, 10]);
        assert_eq!(relation_fanouts["writes"], vec![3]);
        // The spec round-trips, and one without relation fanouts writes none.
        let again: JobSpec = serde_json::from_str(&serde_json::to_string(&spec).unwrap()).unwrap();
        assert_eq!(again, spec);
        let plain = serde_json::to_string(&Sampling::with_defaults("fanout").unwrap()).unwrap();
        assert!(!plain.contains("relation_fanouts"), "{plain}");
        assert_eq!(
            errors(
                r#"{"dataset": "d", "layers": 2, "sampling": {"method": "fanout",
                    "fanouts": [10, 5], "relation_fanouts": {"cites": [1, 2, 3]}}}"#
            ),
            ["sampling.relation_fanouts.cites: expected 1 value or 2 (= layers), got 3"]
        );
        assert!(errors(
            r#"{"dataset": "d", "sampling": {"method": "fanout", "fanouts": [5],
                "relation_fanouts": {"cites": [0]}}}"#
        )[0]
        .starts_with("sampling.relation_fanouts.cites: "));
        assert!(errors(
            r#"{"dataset": "d", "sampling": {"method": "fanout", "fanouts": [5],
                "relation_fanouts": [3]}}"#
        )[0]
        .starts_with("sampling.relation_fanouts: expected an object"));
        // One number stands for a list of one, checked as every integer field is.
        assert_eq!(
            errors(r#"{"dataset": "d", "sampling": {"method": "fanout", "fanouts": 0}}"#),
            ["sampling.fanouts: must be ≥ 1, got 0"]
        );
        assert_eq!(
            errors(
                r#"{"dataset": "d", "sampling": {"method": "fanout", "fanouts": [5],
                    "relation_fanouts": {"cites": 1.5}}}"#
            ),
            ["sampling.relation_fanouts.cites: expected an integer, got the number 1.5"]
        );
    }

    #[test]
    fn messages_name_the_field() {
        assert_eq!(
            errors(r#"{"dataset": "d", "epochs": -3}"#),
            ["epochs: must be ≥ 1, got -3"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "model": "foo"}"#),
            ["model: unknown model 'foo' (expected sage, gcn, ressage, mlp, gat, rgcn, heterosage or rgat)"]
        );
        assert_eq!(
            errors(r#"{"dataset": ""}"#),
            ["dataset: must not be empty (the dataset directory, as a path on every server)"]
        );
        assert!(errors(r#"{}"#)[0].starts_with("dataset: required"));
        assert!(errors(r#"{"dataset": "d", "lr": "fast"}"#)[0]
            .starts_with("lr: expected a number, got the string \"fast\""));
        assert!(errors(r#"{"dataset": "d", "epoch": 3}"#)[0]
            .starts_with("epoch: unknown field (expected one of: name, dataset"));
        assert_eq!(
            errors(r#"{"dataset": "d", "dropout": 1.5}"#),
            ["dropout: must be in [0, 1), got 1.5"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "seed": -1}"#),
            ["seed: must be ≥ 0, got -1"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "layers": 2.5}"#),
            ["layers: expected an integer, got the number 2.5"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "eval_every": -1}"#),
            ["eval_every: must be ≥ 0, got -1"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "evaluate": false, "eval_every": 5}"#),
            ["eval_every: has no effect with evaluate = false (the run does not evaluate); drop one"]
        );
        let s = JobSpec::from_toml_str("dataset = \"d\"\neval_every = 0\n").unwrap();
        assert_eq!((s.eval_every, s.evaluate), (0, true));
        let s = JobSpec::from_json_str(r#"{"dataset": "d", "evaluate": false}"#).unwrap();
        assert_eq!((s.eval_every, s.evaluate), (defaults::EVAL_EVERY, false));
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let e =
            errors(r#"{"dataset": 3, "model": "x", "epochs": 0, "mode": "y", "partition": "z"}"#);
        let fields: Vec<&str> = e.iter().map(|m| m.split(':').next().unwrap()).collect();
        assert_eq!(fields, ["dataset", "model", "mode", "epochs", "partition"]);
    }

    #[test]
    fn cross_field_rules() {
        assert_eq!(
            errors(r#"{"dataset": "d", "mode": "single", "servers": 2}"#),
            ["servers: mode 'single' runs on one device of one server; got servers = 2, devices = 1"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "mode": "flx", "layers": 2, "preload_hops": 3}"#),
            ["preload_hops: must be ≤ layers (2), got 3"]
        );
        assert!(
            errors(r#"{"dataset": "d", "mode": "fb", "batch_size": 64}"#)[0]
                .starts_with("batch_size: only used by the mini-batch modes")
        );
        assert_eq!(
            errors(
                r#"{"dataset": "d", "layers": 3, "sampling": {"method": "fanout", "fanouts": [10, 5]}}"#
            ),
            ["sampling.fanouts: expected 1 value or 3 (= layers), got 2"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "model": "gat", "hidden": 60, "heads": 8}"#),
            ["heads: must divide hidden (60) for gat: the heads split the hidden width, got 8"]
        );
        // Staleness bounds the full-batch halo exchange; remote features sample per-step
        // fetches: the runner relies on these rules holding (it does not check them again).
        for mode in ["cob", "mb", "cluster", "auto"] {
            let e = errors(&format!(
                r#"{{"dataset": "d", "mode": "{mode}", "staleness": {{"bound": 0.1, "max_skips": 2}}}}"#
            ));
            assert!(
                e[0].starts_with("staleness: bounds the full-batch halo exchange"),
                "{mode}: {e:?}"
            );
        }
        for mode in ["fb", "flx", "auto", "single"] {
            let e = errors(&format!(
                r#"{{"dataset": "d", "mode": "{mode}", "remote_features": 0.5}}"#
            ));
            // The message starts with this text (not only contains it).
            assert!(
                e.iter()
                    .any(|m| m.starts_with("remote_features: samples the features fetched")),
                "{mode}: {e:?}"
            );
        }
        // Other models ignore heads.
        assert!(JobSpec::from_json_str(r#"{"dataset": "d", "hidden": 60, "heads": 8}"#).is_ok());
        let s = JobSpec::from_json_str(
            r#"{"dataset": "d", "model": "gat", "heads": 4, "output_heads": 6}"#,
        )
        .unwrap();
        assert_eq!((s.model, s.heads, s.output_heads), (ModelKind::Gat, 4, 6));
        let s =
            JobSpec::from_json_str(r#"{"dataset": "d", "model": "rgcn", "num_bases": 3}"#).unwrap();
        assert_eq!((s.model, s.num_bases), (ModelKind::Rgcn, Some(3)));
        assert_eq!(
            errors(r#"{"dataset": "d", "model": "sage", "num_bases": 3}"#),
            ["num_bases: decomposes rgcn's relation weights; model sage has none"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "model": "rgcn", "num_bases": 0}"#),
            ["num_bases: must be ≥ 1, got 0"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "model": "gat", "output_heads": 0}"#),
            ["output_heads: must be ≥ 1, got 0"]
        );
    }

    #[test]
    fn sampling_forms() {
        let s = JobSpec::from_json_str(r#"{"dataset": "d", "sampling": "eas"}"#).unwrap();
        assert_eq!(
            s.sampling,
            Sampling::Eas {
                hops: 1,
                fanout: 15,
                priority: Priority::Degree
            }
        );
        let s = JobSpec::from_json_str(
            r#"{"dataset": "d", "sampling": {"method": "eas", "fanout": 5}}"#,
        )
        .unwrap();
        assert_eq!(
            s.sampling,
            Sampling::Eas {
                hops: 1,
                fanout: 5,
                priority: Priority::Degree
            }
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "sampling": {"method": "eas", "fanouts": 5}}"#),
            ["sampling.fanouts: unknown field (expected one of: method, hops, fanout, priority)"]
        );
        // GraphSAINT's roots are its budget: they become the batch size, or must agree with it.
        let s = JobSpec::from_json_str(
            r#"{"dataset": "d", "mode": "cob", "sampling": {"method": "saint", "roots": 10}}"#,
        )
        .unwrap();
        assert_eq!(s.sampling, Sampling::Saint { walk_length: 2 });
        assert_eq!(s.batch_size, Some(30));
        assert_eq!(
            errors(
                r#"{"dataset": "d", "mode": "cob", "batch_size": 90, "sampling": {"method": "saint", "roots": 10}}"#
            ),
            ["sampling.roots: 10 disagrees with batch_size 90: GraphSAINT draws batch_size / (walk_length + 1) = 30 roots per server; drop one of them"]
        );
        let s = JobSpec::from_json_str(r#"{"dataset": "d", "mode": "cob", "sampling": "saint"}"#)
            .unwrap();
        assert_eq!(s.batch_size_or_default(), 9000);
        assert_eq!(
            errors(r#"{"dataset": "d", "sampling": "everything"}"#),
            ["sampling: unknown sampling method 'everything' (expected none, eas, fanout or saint)"]
        );
        assert_eq!(
            errors(r#"{"dataset": "d", "sampling": {"hops": 2}}"#),
            ["sampling.method: required (none, eas, fanout or saint)"]
        );
    }

    #[test]
    fn seed_system_options() {
        let s = JobSpec::from_toml_str(
            "dataset = \"d\"\nmode = \"fb\"\n[staleness]\nbound = 0.05\nmax_skips = 4\n",
        )
        .unwrap();
        assert_eq!(
            s.staleness,
            Some(Staleness {
                bound: 0.05,
                max_skips: 4
            })
        );
        let back = JobSpec::from_json_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s, "round trip");
        let s = JobSpec::from_json_str(r#"{"dataset": "d", "mode": "mb", "remote_features": 0.4}"#)
            .unwrap();
        assert_eq!(s.remote_features, Some(0.4));
        for (doc, field, says) in [
            (
                r#"{"dataset": "d", "mode": "cob", "staleness": {"bound": 0.1, "max_skips": 2}}"#,
                "staleness",
                "modes fb and flx",
            ),
            (
                r#"{"dataset": "d", "mode": "fb", "staleness": {"bound": -1, "max_skips": 2}}"#,
                "staleness",
                "≥ 0",
            ),
            (
                r#"{"dataset": "d", "mode": "fb", "staleness": {"bound": 0.1}}"#,
                "staleness.max_skips",
                "required",
            ),
            (
                r#"{"dataset": "d", "mode": "fb", "staleness": {"bound": 0.1, "max_skips": 2, "x": 1}}"#,
                "staleness.x",
                "unknown field",
            ),
            (
                r#"{"dataset": "d", "mode": "fb", "inter_transport": "nccl", "staleness": {"bound": 0.1, "max_skips": 2}}"#,
                "staleness",
                "quic",
            ),
            (
                r#"{"dataset": "d", "mode": "flx", "remote_features": 0.5}"#,
                "remote_features",
                "cob, mb and cluster",
            ),
            (
                r#"{"dataset": "d", "mode": "mb", "remote_features": 1.5}"#,
                "remote_features",
                "(0, 1]",
            ),
        ] {
            let e = JobSpec::from_json_str(doc).unwrap_err();
            let f = e
                .fields()
                .iter()
                .find(|f| f.field == field)
                .unwrap_or_else(|| panic!("{doc}: no error on {field}: {e}"));
            assert!(f.message.contains(says), "{doc}: {}", f.message);
        }
        assert_eq!(
            "0.05,4".parse::<Staleness>().unwrap(),
            Staleness {
                bound: 0.05,
                max_skips: 4
            }
        );
        for bad in ["0.05", "x,4", "0.1,0", "0.1,-2"] {
            assert!(bad.parse::<Staleness>().is_err(), "{bad}");
        }
    }

    #[test]
    fn toml_documents() {
        let s = JobSpec::from_toml_str(
            r#"
            name = "reddit-flx"
            dataset = "/data/reddit"
            model = "ressage"
            layers = 28
            mode = "flx"
            preload_hops = 2
            servers = 4
            devices = 4
            device_memory = "48GiB"

            [sampling]
            method = "eas"
            hops = 1
            fanout = 15
            "#,
        )
        .unwrap();
        assert_eq!(s.model, ModelKind::ResSage);
        assert_eq!(s.device_memory, Some(48 << 30));
        assert_eq!(
            s.sampling,
            Sampling::Eas {
                hops: 1,
                fanout: 15,
                priority: Priority::Degree
            }
        );
        match JobSpec::from_toml_str("dataset = ") {
            Err(SpecError::Syntax { format, message }) => {
                assert_eq!(format, "TOML");
                assert!(message.contains("line 1"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        match JobSpec::from_json_str("{\"dataset\": ") {
            Err(e @ SpecError::Syntax { .. }) => {
                assert!(e.to_string().starts_with("malformed JSON: "), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            JobSpec::from_toml_str("dataset = \"d\"\nepochs = -3")
                .unwrap_err()
                .to_string(),
            "epochs: must be ≥ 1, got -3"
        );
    }

    #[test]
    fn serde_round_trip_is_lossless() {
        let s = JobSpec {
            dataset: "/d".into(),
            sampling: Sampling::Fanout {
                fanouts: vec![10, 5, 5],
                relation_fanouts: Default::default(),
            },
            layers: 3,
            seed: u64::MAX,
            device_memory: Some(1 << 34),
            mode: Mode::Cob,
            predict: Some(PredictSpec {
                dir: "/out".into(),
                logits: true,
                embeddings: true,
                block_memory: Some(1 << 30),
            }),
            ..JobSpec::default()
        };
        // Without evaluation too (the serializer writes the default eval_every beside it).
        let quiet = JobSpec {
            evaluate: false,
            ..s.clone()
        };
        for s in [s, quiet] {
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(serde_json::from_str::<JobSpec>(&json).unwrap(), s);
            // The user-facing reader accepts what the serializer writes.
            assert_eq!(JobSpec::from_json_str(&json).unwrap(), s);
        }
    }

    #[test]
    fn byte_units() {
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert_eq!(parse_bytes("16 GB").unwrap(), 16_000_000_000);
        assert_eq!(parse_bytes("1.5KiB").unwrap(), 1536);
        assert!(parse_bytes("12 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("0").is_err());
    }
}
