//! [`RunSummary`]: what one run reports, the one definition that `grandis train --json`
//! prints, each daemon writes as its job report and sends to the coordinator, and
//! `grandis cluster up` reads back. Its keys are documented here, once.
//!
//! Traffic and memory figures are those of the ranks that the reporting process ran: every
//! rank for `grandis train`, one server's ranks for a daemon (`cluster up` sums them over the
//! servers). Losses, accuracies and the sampling counters are cluster-wide everywhere (the
//! loss is all-reduced and the servers' sampling counts are added up after the last epoch).

use serde::{Deserialize, Serialize};

use crate::links::LinkBytes;
use crate::spec::{JobSpec, Mode};

/// Everything one run reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunSummary {
    /// The job as it ran (its `mode` as asked: `auto` stays `auto`, see [`Execution::mode`]).
    pub job: JobSpec,
    /// Where the ranks computed: `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    pub num_parameters: usize,
    /// Epoch number of the first entry of `losses` (after `--resume`, not 1).
    pub first_epoch: usize,
    /// Training loss of every epoch.
    pub losses: Vec<f64>,
    /// Wall seconds of every epoch.
    pub epoch_seconds: Vec<f64>,
    /// Absent (NaN) when no epoch trained.
    #[serde(with = "crate::nan")]
    pub final_loss: f64,
    /// Accuracies: absent (NaN) for an empty split or a run that did not evaluate.
    #[serde(with = "crate::nan")]
    pub train_acc: f64,
    #[serde(with = "crate::nan")]
    pub val_acc: f64,
    #[serde(with = "crate::nan")]
    pub test_acc: f64,
    #[serde(with = "crate::nan")]
    pub median_epoch_s: f64,
    /// Peak resident memory of the reporting process.
    pub peak_rss_bytes: u64,
    /// How the run was laid out and what it moved; its keys are the summary's own (flattened).
    #[serde(flatten)]
    pub execution: Execution,
    /// One server's part of a cluster job (daemon reports only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerTraffic>,
    /// Link prediction's scores of the final model (task link; absent when it did not
    /// evaluate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<LinkSummary>,
}

/// The final link-prediction scores on the validation and test edges.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkSummary {
    pub val: LinkScores,
    pub test: LinkScores,
}

/// Ranking scores of held-out positives against their negatives, as OGB's evaluators compute
/// them: `auc`, the probability that a positive outscores a negative (ties count half);
/// `mrr`, the mean reciprocal rank of each positive among its own negatives (ties ranked
/// half-way); `hits`, for K = 10, 50 and 100, the fraction of positives scored above the K-th
/// highest negative (1 when there are fewer than K negatives). NaN (absent) for an empty
/// part.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkScores {
    #[serde(with = "crate::nan")]
    pub auc: f64,
    #[serde(with = "crate::nan")]
    pub mrr: f64,
    #[serde(with = "crate::nan")]
    pub hits_at_10: f64,
    #[serde(with = "crate::nan")]
    pub hits_at_50: f64,
    #[serde(with = "crate::nan")]
    pub hits_at_100: f64,
}

/// How a run was laid out (mode, servers, devices, partition, preloading, transports) and
/// what it moved and computed (traffic, memory, sampling statistics): what a distributed run
/// reports beyond the training figures, the part of [`RunSummary`] the parallel runner fills.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Execution {
    /// The mode that ran: `single`, `fb`, `flx`, `cob` or `mb` (`auto` resolved).
    pub mode: Mode,
    /// `auto`'s plan: the candidate chosen, why, and its prediction (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<crate::plan::PlanSummary>,
    /// Servers × devices of the run (1 × 1 for `single`).
    pub servers: usize,
    pub devices: usize,
    /// Where the partition came from ("metis (seed 0)", a partition directory).
    pub partition: String,
    pub threads_per_rank: usize,
    /// What carried the ranks' halo rows and gradients inside and between servers ("fabric
    /// inside servers, quic between", "nccl inside servers, nccl between", ...; empty for
    /// `single`).
    #[serde(default)]
    pub transport: String,
    /// Preloaded hops k, why this k, and `(k, worst-device bytes)` of the estimates behind it.
    pub preload_hops: usize,
    pub preload_reason: String,
    pub preload_estimates: Vec<(usize, u64)>,
    /// Vertices replicated by FLX preloading over all servers (per-step plans: mean per step).
    pub replicated_vertices: usize,
    /// Feature and gradient halo payload bytes per epoch (forward + backward).
    pub halo_bytes_per_epoch: LinkBytes,
    pub forward_bytes_per_epoch: LinkBytes,
    pub backward_bytes_per_epoch: LinkBytes,
    /// The masking plan's prediction of `halo_bytes_per_epoch`, for the whole cluster.
    pub predicted_halo_bytes_per_epoch: LinkBytes,
    /// Weight-gradient all-reduce payload bytes per epoch.
    pub all_reduce_bytes_per_epoch: LinkBytes,
    /// Features of replicated vertices fetched from their home server per epoch, for plans
    /// that change during the run (inter-server only).
    pub fetch_bytes_per_epoch: LinkBytes,
    /// The same, once, for a plan that serves the whole run (what FLX preloads).
    pub setup_fetch_bytes: LinkBytes,
    /// Link prediction: what the ranks all-reduce each step for the decoder — in the
    /// full-batch modes the output embeddings (so that each rank scores its share of the
    /// pairs) and their gradient, in cob the co-batches' targets' embeddings and their
    /// gradient, and in every mode the MLP decoder's gradient (zero for other tasks).
    #[serde(default)]
    pub link_embedding_bytes_per_epoch: LinkBytes,
    /// Learnable node embeddings (`embedding_dim`): the rows ranks ask of their home ranks
    /// each step (the ids asked, the rows, their gradients going back), and the whole table
    /// gathered for a checkpoint (zero without them). Their halo rows travel in
    /// `halo_bytes_per_epoch`, as the layer-0 input's columns.
    #[serde(default)]
    pub node_embedding_bytes_per_epoch: LinkBytes,
    pub time_split: TimeSplit,
    pub memory: Vec<RankMemory>,
    /// The sampler that ran ("exact", "eas(h=1,f=15,degree)", "sage(25,10,5)", "saint(...)").
    pub sampling: String,
    /// CoB co-batch size / MB mini-batch size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<usize>,
    pub iterations_per_epoch: usize,
    /// Labelled loss rows per epoch (sum over steps).
    pub targets_per_epoch: u64,
    /// Edges of the one-hop graphs the ranks hold, summed over the steps of an epoch.
    pub sampled_edges: u64,
    /// Of those, edges whose two ends are homed on different servers (the sampling locality
    /// a partition gives: ByteGNN's partitioning aims to keep it low).
    pub inter_server_sampled_edges: u64,
    /// Rows computed at each layer, summed over ranks and the steps of an epoch.
    pub computed_vertices_per_layer: Vec<u64>,
    pub computed_vertex_layers: u64,
    /// Edges aggregated at each layer per epoch.
    pub aggregated_edges_per_layer: Vec<u64>,
    /// Boundary ratio β of every server (§5.3.2), mean over the steps.
    pub beta: Vec<f64>,
    /// Layer-wise inference after training (jobs with `predict`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inference: Option<InferenceSummary>,
    /// What SANCUS's staleness bound skipped (jobs with `staleness`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staleness: Option<StaleSummary>,
}

impl Execution {
    /// Adds another server's part of the same run: its traffic and staleness counts summed,
    /// its ranks' memory and inference added; the cluster-wide figures (sampling counts, β,
    /// the plan) are every server's alike and stay.
    pub fn add_server(&mut self, other: &Execution) {
        for (sum, add) in [
            (&mut self.halo_bytes_per_epoch, &other.halo_bytes_per_epoch),
            (
                &mut self.forward_bytes_per_epoch,
                &other.forward_bytes_per_epoch,
            ),
            (
                &mut self.backward_bytes_per_epoch,
                &other.backward_bytes_per_epoch,
            ),
            (
                &mut self.all_reduce_bytes_per_epoch,
                &other.all_reduce_bytes_per_epoch,
            ),
            (
                &mut self.fetch_bytes_per_epoch,
                &other.fetch_bytes_per_epoch,
            ),
            (&mut self.setup_fetch_bytes, &other.setup_fetch_bytes),
            (
                &mut self.link_embedding_bytes_per_epoch,
                &other.link_embedding_bytes_per_epoch,
            ),
            (
                &mut self.node_embedding_bytes_per_epoch,
                &other.node_embedding_bytes_per_epoch,
            ),
        ] {
            sum.add(add);
        }
        self.memory.extend(other.memory.iter().cloned());
        if let Some(add) = &other.staleness {
            let sum = self.staleness.get_or_insert_with(StaleSummary::default);
            sum.sends += add.sends;
            sum.skips += add.skips;
            sum.saved_bytes_per_epoch += add.saved_bytes_per_epoch;
        }
        match (&mut self.inference, &other.inference) {
            (Some(sum), Some(add)) => sum.absorb(add),
            (None, Some(add)) => self.inference = Some(add.clone()),
            _ => {}
        }
    }
}

/// What the staleness-bounded exchange did on the reporting ranks (summed over their epochs;
/// `cluster up` sums the servers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StaleSummary {
    /// Boundary-row sends between servers (one per layer, sending rank and peer) made and
    /// skipped over the run.
    pub sends: u64,
    pub skips: u64,
    /// Inter-server halo payload bytes per epoch not sent because of skips (the rows and their
    /// gradients): `halo_bytes_per_epoch` plus this is the plan's prediction.
    pub saved_bytes_per_epoch: u64,
}

/// What layer-wise inference after training did on the reporting ranks (a daemon's: its
/// server's; `cluster up` sums the servers).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct InferenceSummary {
    /// Where the files are (`predictions.R.npy`, `vertices.R.npy`, `embeddings.R.npy`).
    pub dir: String,
    /// The global ranks whose files were written.
    pub ranks: Vec<usize>,
    /// Vertices predicted.
    pub vertices: u64,
    /// Rows received from other ranks per stage that reads neighbours (the halos), summed.
    pub halo_rows: u64,
    /// Bytes sent between ranks (halo rows and the requests for them).
    pub bytes: LinkBytes,
    /// Wall seconds of each stage, its exchange included (the slowest rank's).
    pub stage_seconds: Vec<f64>,
    /// Of those, seconds exchanging halo rows (the slowest rank's total).
    pub exchange_seconds: f64,
    /// Wall seconds of the whole pass (the slowest rank's).
    pub seconds: f64,
}

impl InferenceSummary {
    /// Adds another set of ranks' figures (another server's).
    pub fn absorb(&mut self, other: &InferenceSummary) {
        self.ranks.extend(&other.ranks);
        self.ranks.sort_unstable();
        self.vertices += other.vertices;
        self.halo_rows += other.halo_rows;
        self.bytes.add(&other.bytes);
        for (i, &s) in other.stage_seconds.iter().enumerate() {
            match self.stage_seconds.get_mut(i) {
                Some(t) => *t = t.max(s),
                None => self.stage_seconds.push(s),
            }
        }
        self.seconds = self.seconds.max(other.seconds);
        self.exchange_seconds = self.exchange_seconds.max(other.exchange_seconds);
    }
}

/// Mean seconds per training epoch, averaged over ranks and over epochs (the first, warm-up
/// epoch left out when there are several).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeSplit {
    /// Wall time of the training epoch: its steps (the last one's weight-gradient all-reduce
    /// also sums the epoch's loss).
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
    /// Small collectives (the feature fetch's id exchanges, a link task's gathers).
    pub other_s: f64,
    /// Per-step modes (mb, cob, resampled FLX-EAS): blocked waiting for the host's step
    /// producer to sample and plan the next step. Large when the host side is the bottleneck.
    #[serde(default)]
    pub plan_wait_s: f64,
    /// Per-step modes: switching to the next step's plans (freeing the last step's buffers,
    /// uploading graphs, index lists and gathered features to the device), `fetch_s` excluded.
    #[serde(default)]
    pub plan_load_s: f64,
    /// Per-step modes: host seconds the step producers spent building one epoch's steps
    /// (sampling, plans and, where they prepare them, the steps' inputs), summed over the
    /// producer threads (overlapped with training: not part of `epoch_s`).
    #[serde(default)]
    pub plan_build_s: f64,
    /// Of `plan_build_s`, the seconds spent reading the steps' feature rows for the ranks; the
    /// rest is sampling, plans and staging the steps' graphs.
    #[serde(default)]
    pub plan_inputs_s: f64,
}

/// Measured memory of one rank next to the memory model's estimate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankMemory {
    pub rank: usize,
    /// Peak live bytes of backend buffers, indices and graphs (the metered backend).
    pub measured_peak_bytes: u64,
    /// Live bytes after setup, before the first epoch.
    pub setup_bytes: u64,
    /// `grandis_masking::memory` estimate for this rank.
    pub model_bytes: u64,
}

/// One server's traffic in a cluster job, as its daemon measured it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerTraffic {
    /// This server's label and index, and every server of the job in index order.
    pub label: String,
    pub index: usize,
    pub servers: Vec<String>,
    /// Inter-server payload bytes this server's ranks sent and received (fabric counters).
    pub inter_server_payload_sent: u64,
    pub inter_server_payload_received: u64,
    /// What the QUIC node really wrote and read.
    pub wire: WireStats,
    /// The rates this server measured when the job started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rates: Option<crate::ServerRates>,
}

/// Bytes and frames actually written to and read from a node's QUIC data streams.
///
/// `bytes_sent = streams_opened × PREAMBLE_BYTES + frames_sent × FRAME_OVERHEAD +
/// payload_bytes_sent` (`grandis-quic`'s framing), and `payload_bytes_sent` is what the fabric
/// counts as inter-server bytes sent by the server's ranks. Sent bytes are counted once QUIC
/// has taken them; received bytes before the envelope is handed to a rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireStats {
    /// Data streams opened (one per ordered remote pair that was used or closed).
    pub streams_opened: u64,
    /// Frames written.
    pub frames_sent: u64,
    /// Payload bytes inside the frames written.
    pub payload_bytes_sent: u64,
    /// All bytes written to data streams: preambles, frame heads, payloads.
    pub bytes_sent: u64,
    /// Data streams accepted from peers.
    pub streams_accepted: u64,
    /// Frames read and decoded.
    pub frames_received: u64,
    /// Payload bytes inside the frames read.
    pub payload_bytes_received: u64,
    /// All bytes read from data streams.
    pub bytes_received: u64,
}

impl RunSummary {
    /// The cluster-wide summary of a cluster job from its servers' reports (in server-index
    /// order): the leader's losses, accuracies and sampling counters, every per-server traffic
    /// figure summed over the servers, every rank's memory. None without reports.
    pub fn of_cluster(reports: &[RunSummary]) -> Option<RunSummary> {
        let (first, rest) = reports.split_first()?;
        let mut all = RunSummary {
            server: None,
            ..first.clone()
        };
        for r in rest {
            all.execution.add_server(&r.execution);
            all.peak_rss_bytes = all.peak_rss_bytes.max(r.peak_rss_bytes);
        }
        Some(all)
    }

    /// The one-line human summary every front end prints.
    pub fn line(&self) -> String {
        let mut s = match &self.link {
            // Link prediction has no accuracies: its scores follow.
            Some(_) => format!(
                "final loss {:.4}  median epoch {:.3}s",
                self.final_loss, self.median_epoch_s
            ),
            None => format!(
                "final loss {:.4}  train {}  val {}  test {}  median epoch {:.3}s",
                self.final_loss,
                accuracy(self.train_acc),
                accuracy(self.val_acc),
                accuracy(self.test_acc),
                self.median_epoch_s
            ),
        };
        if self.execution.mode.is_distributed() {
            let t = &self.execution.time_split;
            if t.plan_wait_s + t.plan_load_s + t.plan_build_s > 0.0 {
                s.push_str(&format!(
                    "  (steps: waiting for plans {:.3}s, loading {:.3}s; the host built them in \
                     {:.3}s, {:.3}s of it reading their inputs)",
                    t.plan_wait_s, t.plan_load_s, t.plan_build_s, t.plan_inputs_s
                ));
            }
            s.push_str(&format!(
                "  (compute {:.3}s, intra {:.3}s, inter {:.3}s, fetch {:.3}s, all-reduce \
                 {:.3}s)  k = {}  halo bytes/epoch inter {} intra {}  fetched bytes inter/epoch \
                 {} (setup {})",
                t.compute_s,
                t.intra_comm_s,
                t.inter_comm_s,
                t.fetch_s,
                t.all_reduce_s,
                self.execution.preload_hops,
                self.execution.halo_bytes_per_epoch.inter_server,
                self.execution.halo_bytes_per_epoch.intra_server,
                self.execution.fetch_bytes_per_epoch.inter_server,
                self.execution.setup_fetch_bytes.inter_server
            ));
        }
        if let Some(l) = &self.link {
            for (name, sc) in [("val", &l.val), ("test", &l.test)] {
                s.push_str(&format!(
                    "  {name} auc {:.4} mrr {:.4} hits@10/50/100 {:.4}/{:.4}/{:.4}",
                    sc.auc, sc.mrr, sc.hits_at_10, sc.hits_at_50, sc.hits_at_100
                ));
            }
        }
        if let Some(p) = &self.execution.plan {
            s.push_str(&format!(
                "  auto chose {}: predicted {:.3}s per epoch ({})",
                p.chosen, p.prediction.epoch_s, p.why
            ));
        }
        if let Some(i) = &self.execution.inference {
            s.push_str(&format!(
                "  predicted {} vertices into {} in {:.3}s (exchange {:.3}s, halo bytes inter {} \
                 intra {})",
                i.vertices,
                i.dir,
                i.seconds,
                i.exchange_seconds,
                i.bytes.inter_server,
                i.bytes.intra_server
            ));
        }
        s
    }
}

/// An accuracy as every front end prints it: four decimals, `-` when absent (not evaluated).
pub fn accuracy(acc: f64) -> String {
    if acc.is_nan() {
        "-".into()
    } else {
        format!("{acc:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_round_trips_and_old_readers_may_omit_fields() {
        let s = RunSummary {
            job: JobSpec {
                dataset: "d".into(),
                ..JobSpec::default()
            },
            losses: vec![1.0, 0.5],
            final_loss: f64::NAN,
            execution: Execution {
                mode: Mode::Cob,
                batch_size: Some(64),
                halo_bytes_per_epoch: LinkBytes {
                    intra_server: 3,
                    inter_server: 4,
                },
                beta: vec![0.1 + 0.2, 1.0 / 3.0],
                sampled_edges: u64::MAX,
                ..Execution::default()
            },
            server: Some(ServerTraffic {
                label: "a".into(),
                servers: vec!["a".into()],
                ..ServerTraffic::default()
            }),
            ..RunSummary::default()
        };
        let v = serde_json::to_value(&s).unwrap();
        // The execution's keys are the summary's own: no "execution" object.
        assert_eq!(v["halo_bytes_per_epoch"]["inter_server"], 4);
        assert_eq!(v["mode"], "cob");
        assert_eq!(v["servers"], 0);
        assert!(v.get("execution").is_none());
        assert!(v["final_loss"].is_null(), "NaN is written as null");
        // Through the flattened part too, every value comes back bit for bit.
        let back = serde_json::from_str::<RunSummary>(&v.to_string()).unwrap();
        assert_eq!(back.execution, s.execution);
        assert!(back.final_loss.is_nan());
        assert_eq!(
            RunSummary {
                final_loss: 0.0,
                ..back
            },
            RunSummary {
                final_loss: 0.0,
                ..s.clone()
            }
        );
        let partial: RunSummary = serde_json::from_str(r#"{"final_loss": 0.25}"#).unwrap();
        assert_eq!(partial.final_loss, 0.25);
        assert!(s.line().contains("halo bytes/epoch inter 4 intra 3"));
        let cluster = RunSummary::of_cluster(&[s.clone(), s.clone()]).unwrap();
        assert_eq!(cluster.execution.halo_bytes_per_epoch.inter_server, 8);
        assert_eq!(cluster.losses, s.losses);
        assert!(cluster.server.is_none());
        assert!(RunSummary::of_cluster(&[]).is_none());
    }
}
