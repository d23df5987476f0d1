//! The CUDA device of a single-process command (`train --mode single`, `predict`, `bench
//! train`): its backend opened, or the devices listed, or the clean error of a build or a
//! machine without CUDA. The device grammar itself is `grandis_parallel::Compute`.

use anyhow::{bail, Context};
use grandis_engine::cuda::CudaBackend;
use grandis_parallel::Compute;

/// `--device` and `--cuda-devices`: where the ranks of a run compute (`train`, `cluster up`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DeviceArgs {
    /// Compute device: cpu, cuda:N (every rank on GPU N, sharing it), or cuda (device index d
    /// of a server on ordinal d, see --cuda-devices; ordinal 0 for `train --mode single`).
    /// CUDA needs a build with `--features cuda`.
    #[arg(long, default_value = "cpu")]
    pub device: Compute,
    /// With --device cuda: the CUDA ordinals of a server's ranks, device index d on the d-th
    /// (cycled), e.g. 0,1,2,3. Default: device index d on ordinal d.
    #[arg(long, value_delimiter = ',')]
    pub cuda_devices: Option<Vec<usize>>,
}

impl DeviceArgs {
    /// Where the ranks compute: `--device`, refined by `--cuda-devices`.
    pub fn compute(&self) -> anyhow::Result<Compute> {
        self.device
            .clone()
            .with_ordinals(self.cuda_devices.as_deref())
            .context("--cuda-devices")
    }
}

/// The CUDA ordinal a single-process command runs on: none for `cpu`, N for `cuda:N`, and
/// ordinal 0 (the one rank's device index) for plain `cuda`.
pub fn single_ordinal(device: &Compute) -> Option<usize> {
    device.ordinal(0, 1)
}

/// The backend of [`single_ordinal`], opened (None on the CPU): before the dataset is read,
/// so a missing GPU fails fast.
pub fn single_backend(device: &Compute) -> anyhow::Result<Option<CudaBackend>> {
    single_ordinal(device).map(cuda_backend).transpose()
}

/// Opens the CUDA backend of `cuda:N`; a clean error when this binary has no CUDA
/// support or the machine has no driver/device.
pub fn cuda_backend(ordinal: usize) -> anyhow::Result<CudaBackend> {
    eprintln!("{}", grandis_engine::cuda::describe_device(ordinal)?);
    Ok(CudaBackend::new(ordinal)?)
}

/// Prints one line per CUDA device the driver reports (`--device cuda` of the parallel
/// modes), or fails with the clean error of a build or machine without CUDA.
pub fn describe_cuda() -> anyhow::Result<()> {
    let n = grandis_engine::cuda::device_count()?;
    if n == 0 {
        bail!("--device cuda: the driver reports no CUDA device");
    }
    for ordinal in 0..n {
        eprintln!("{}", grandis_engine::cuda::describe_device(ordinal)?);
    }
    Ok(())
}
