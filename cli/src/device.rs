//! The CUDA device of a single-process command (`train --mode single`, `predict`, `bench
//! train`): its backend opened, or the devices listed, or the clean error of a build or a
//! machine without CUDA. The device grammar itself is `grandis_parallel::Compute`.

use anyhow::bail;

/// Opens the CUDA backend of `cuda:N`; a clean error when this binary has no CUDA
/// support or the machine has no driver/device.
#[cfg(feature = "cuda")]
pub fn cuda_backend(ordinal: usize) -> anyhow::Result<grandis_engine::cuda::CudaBackend> {
    eprintln!("{}", grandis_engine::cuda::describe_device(ordinal)?);
    Ok(grandis_engine::cuda::CudaBackend::new(ordinal)?)
}

#[cfg(not(feature = "cuda"))]
pub fn cuda_backend(_ordinal: usize) -> anyhow::Result<std::convert::Infallible> {
    bail!(grandis_parallel::NOT_BUILT_WITH_CUDA)
}

/// Prints one line per CUDA device the driver reports (`--device cuda` of the parallel
/// modes), or fails with the clean error of a build or machine without CUDA.
#[cfg(feature = "cuda")]
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

#[cfg(not(feature = "cuda"))]
pub fn describe_cuda() -> anyhow::Result<()> {
    bail!(grandis_parallel::NOT_BUILT_WITH_CUDA)
}
