//! What the planner predicts and chooses (`grandis plan`, `mode = "auto"`): the rates a
//! prediction is made with ([`PlanRates`]), a plan's predicted epoch ([`Prediction`]), and
//! the choice a run reports next to what it measured ([`PlanSummary`]).

use serde::{Deserialize, Serialize};

use crate::links::LinkBytes;
use crate::rates::{ComputeRate, LinkRate};

/// The rates a prediction uses: one device's compute, the two link classes, and how many
/// ranks share one device's compute (CPU ranks on fewer cores than they have threads).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanRates {
    pub compute: ComputeRate,
    pub intra: LinkRate,
    pub inter: LinkRate,
    /// Compute time multiplier: 1 for dedicated devices; ranks × threads / cores when the
    /// ranks share a machine's cores.
    pub contention: f64,
    /// Compute time multiplier from calibration: a real training step of the job's model
    /// over what the two kernel rates alone account for (the element-wise work, the loss,
    /// the optimiser, kernel shapes); 1 when not calibrated.
    pub calibration: f64,
    /// [`Self::calibration`] split by kernel class (CPU ranks): what the sample's dense
    /// products and its aggregations each took over what their rate accounts for. None when
    /// not calibrated by kernel: `calibration` for both.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_calibration: Option<KernelCalibration>,
    /// The cores CPU ranks share with the host's plan builders (in-process runs on one
    /// machine); None when the ranks have devices of their own.
    pub shared_cores: Option<usize>,
    /// Ranks computing at once on one machine and sharing its caches (CPU ranks: those per
    /// machine, at most its cores over their threads; 1 for devices, and when absent): each
    /// keeps that share of the caches, so an aggregation's cached rate ends at that share of
    /// the calibrated cached size (the uncached rate, far beyond any cache, stays).
    pub cache_sharers: f64,
}

/// A calibration split by kernel class ([`PlanRates::kernel_calibration`]). The rest of a step
/// (element-wise work, the loss, the optimiser) is shared between the two in proportion to
/// their measured seconds, so together they reproduce the sample's step: a plan whose mix of
/// dense products and aggregation differs from the sample's (a mini-batch multiplies every
/// sampled row but aggregates few edges per row) is priced by each kernel's own measure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KernelCalibration {
    /// Time multiplier of the dense products.
    pub dense: f64,
    /// Time multiplier of the aggregations.
    pub aggregation: f64,
}

impl PlanRates {
    /// Time multipliers of the dense products and the aggregations:
    /// [`Self::kernel_calibration`], else [`Self::calibration`] for both.
    pub fn kernel_factors(&self) -> KernelCalibration {
        let all = self.calibration.max(f64::MIN_POSITIVE);
        match self.kernel_calibration {
            Some(k) => KernelCalibration {
                dense: k.dense.max(f64::MIN_POSITIVE),
                aggregation: k.aggregation.max(f64::MIN_POSITIVE),
            },
            None => KernelCalibration {
                dense: all,
                aggregation: all,
            },
        }
    }
}

/// A plan's predicted epoch, its parts (seconds, as the run summary splits them) and bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Prediction {
    pub epoch_s: f64,
    pub compute_s: f64,
    pub intra_s: f64,
    pub inter_s: f64,
    pub fetch_s: f64,
    pub all_reduce_s: f64,
    /// Once, before the first epoch (static plans' replicated features).
    pub setup_fetch_s: f64,
    /// Halo bytes per epoch (forward + backward) by link class.
    pub halo_bytes: LinkBytes,
    /// Fetched feature bytes per epoch.
    pub fetch_bytes: LinkBytes,
    /// Fetched once, before the first epoch.
    pub setup_fetch_bytes: u64,
    /// Learnable node embeddings' asks, rows and gradients per epoch by link class (the run
    /// summary's `node_embedding_bytes_per_epoch`; zero without them).
    pub node_embedding_bytes: LinkBytes,
    /// Rows computed per epoch over all layers and ranks (forward).
    pub computed_vertex_layers: u64,
    /// The memory model's worst rank.
    pub peak_bytes: u64,
}

/// One candidate the planner considered, as a run summary lists it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CandidateSummary {
    /// `fb`, `flx k=2`, `flx-eas h=1 f=15`, `cob 1024 sage(10,5)`, ...
    pub name: String,
    /// Predicted seconds per epoch (absent when not counted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch_s: Option<f64>,
    /// The memory model's worst rank (absent when not counted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    pub fits: bool,
    /// Why it was not counted or cannot run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// What `mode = "auto"` chose and what it predicted, for the run summary.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanSummary {
    /// The chosen candidate's name.
    pub chosen: String,
    pub why: String,
    /// The chosen plan's prediction (compare `epoch_s` with the run's median epoch).
    pub prediction: Prediction,
    pub rates: PlanRates,
    /// Every candidate considered, in the planner's order.
    pub candidates: Vec<CandidateSummary>,
    /// A sampled plan had to be predicted this many times faster than the fastest exact one.
    pub exact_preference: f64,
    /// Seconds the planning took (counting and calibration; the measurement is the servers').
    pub seconds: f64,
}
