//! Where a rank computes: the device grammar ([`Compute`]), the CUDA ordinal of each device
//! index of a server, the rank's CUDA backend (or the error of a build without CUDA), and the
//! cores each rank's CPU backend gets.

use anyhow::Context;
use grandis_fabric::Endpoint;
use serde::Serialize;

/// Whether this build has the CUDA backend (the `cuda` feature): configurations that name a
/// CUDA device are refused up front without it.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// What every front end says when asked for CUDA in a build without it.
pub use grandis_engine::NOT_BUILT_WITH_CUDA;
/// Where each rank computes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compute {
    /// A CPU backend per rank (its own rayon pool of `threads_per_rank`).
    #[default]
    Cpu,
    /// A CUDA backend per rank: the rank with device index `d` inside its server runs on
    /// `ordinals[d % ordinals.len()]`, or on ordinal `d % (devices the driver reports)` when no
    /// list is given. Ranks that share an ordinal each get their own stream on it.
    Cuda { ordinals: Option<Vec<usize>> },
}

impl Compute {
    /// Parses `cpu`, `cuda` (rank d on device d) or `cuda:N` (every rank on device N).
    pub fn parse(s: &str) -> anyhow::Result<Compute> {
        match s {
            "cpu" => Ok(Compute::Cpu),
            "cuda" => Ok(Compute::Cuda { ordinals: None }),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Compute::Cuda {
                    ordinals: Some(vec![n]),
                }),
                _ => anyhow::bail!(
                    "invalid --device '{s}' (expected cpu, cuda or cuda:N, e.g. cuda:0)"
                ),
            },
        }
    }

    /// This device refined by an explicit list of CUDA ordinals (device index d on the d-th,
    /// cycled), which only plain `cuda` takes: `--device` with `--cuda-devices`, or a
    /// daemon's `device` with `cuda_devices`.
    pub fn with_ordinals(self, ordinals: Option<&[usize]>) -> anyhow::Result<Compute> {
        match (self, ordinals) {
            (compute, None) => Ok(compute),
            (Compute::Cuda { ordinals: None }, Some(list)) if !list.is_empty() => {
                Ok(Compute::Cuda {
                    ordinals: Some(list.to_vec()),
                })
            }
            (compute, Some(_)) => anyhow::bail!(
                "a list of CUDA devices needs device cuda (not {}) and at least one ordinal",
                compute.name()
            ),
        }
    }

    /// The device as `--device` names it (`cpu`, `cuda`, `cuda:N`, or `cuda:A,B,...` for a
    /// list).
    pub fn name(&self) -> String {
        match self {
            Compute::Cpu => "cpu".into(),
            Compute::Cuda { ordinals: None } => "cuda".into(),
            Compute::Cuda {
                ordinals: Some(list),
            } => format!(
                "cuda:{}",
                list.iter()
                    .map(|o| o.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }

    /// The CUDA ordinal of the rank with device index `device` inside its server, given the
    /// number of devices the driver reports.
    pub fn ordinal(&self, device: usize, available: usize) -> Option<usize> {
        match self {
            Compute::Cpu => None,
            Compute::Cuda {
                ordinals: Some(list),
            } if !list.is_empty() => Some(list[device % list.len()]),
            Compute::Cuda { .. } => Some(device % available.max(1)),
        }
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self, Compute::Cuda { .. })
    }
}

/// [`Compute::parse`], so front ends take the device as a typed flag or key.
impl std::str::FromStr for Compute {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Compute> {
        Compute::parse(s)
    }
}

impl std::fmt::Display for Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// This machine's cores shared by `ranks` ranks (at least one each).
pub fn cores_per_rank(ranks: usize) -> usize {
    (std::thread::available_parallelism().map_or(1, |c| c.get()) / ranks.max(1)).max(1)
}

/// The CUDA ordinal of every device index of a server (empty on CPU): what picks the
/// transport inside a server.
pub(crate) fn rank_ordinals(compute: &Compute, devices: usize) -> anyhow::Result<Vec<usize>> {
    if !compute.is_cuda() {
        return Ok(Vec::new());
    }
    let available = grandis_engine::cuda::device_count()?;
    Ok((0..devices)
        .filter_map(|d| compute.ordinal(d, available))
        .collect())
}

/// The CUDA backend of the rank behind `ep`: its device index inside the server picks the
/// ordinal ([`Compute::ordinal`]). In a build without CUDA, the error saying so.
pub(crate) fn cuda_rank_backend(
    compute: &Compute,
    ep: &Endpoint,
) -> anyhow::Result<grandis_engine::cuda::CudaBackend> {
    let available = grandis_engine::cuda::device_count()?;
    let ordinal = compute.ordinal(ep.device(), available).unwrap_or(0);
    grandis_engine::cuda::CudaBackend::new(ordinal)
        .with_context(|| format!("rank {} on cuda:{ordinal}", ep.rank()))
}
