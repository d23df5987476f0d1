//! Finding the driver and devices: whether `libcuda` can be opened (cudarc panics without
//! it, so every entry point checks first), how many devices there are and what they are, a
//! device's primary context and memory, and the kernels compiled once per process.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::kernels;
use crate::error::{EngineError, Result};

/// The backend's name in its errors.
pub(super) const BACKEND: &str = "cuda";

pub(super) fn dev_err(context: impl std::fmt::Display, e: impl std::fmt::Display) -> EngineError {
    EngineError::Device {
        backend: BACKEND,
        message: format!("{context}: {e}"),
    }
}

/// Runs `f`, turning a panic inside cudarc (a library or symbol it could not load) into an
/// error instead of tearing down the caller.
pub(super) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    grandis_telemetry::panic::catch_quietly(AssertUnwindSafe(f)).unwrap_or_else(|message| {
        Err(EngineError::Device {
            backend: BACKEND,
            message: format!("{what}: the CUDA libraries failed: {message}"),
        })
    })
}

/// Whether the CUDA driver library (`libcuda.so`) can be opened. Every other entry point
/// checks this first: without it cudarc panics on the first driver call.
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names and closes it again.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

pub(super) fn no_driver_error(what: &str) -> EngineError {
    EngineError::Device {
        backend: BACKEND,
        message: format!(
            "CUDA driver library not found: {what} needs an NVIDIA driver (libcuda.so); \
             use the CPU backend on machines without a GPU"
        ),
    }
}

/// Number of CUDA devices the driver reports, or a clean error when there is no driver.
pub fn device_count() -> Result<usize> {
    if !driver_library_present() {
        return Err(no_driver_error("listing CUDA devices"));
    }
    guarded("listing CUDA devices", || {
        let n = CudaContext::device_count().map_err(|e| dev_err("cuDeviceGetCount", e))?;
        Ok(n.max(0) as usize)
    })
}

/// Fails with a clear message unless the driver reports device `ordinal` (call inside
/// [`guarded`], after checking [`driver_library_present`]).
pub(super) fn check_ordinal(ordinal: usize) -> Result<()> {
    let count = CudaContext::device_count()
        .map_err(|e| dev_err("initialising the CUDA driver", e))?
        .max(0) as usize;
    if ordinal >= count {
        return Err(EngineError::Device {
            backend: BACKEND,
            message: format!(
                "device cuda:{ordinal} does not exist: the driver reports {count} device(s)"
            ),
        });
    }
    Ok(())
}

/// The primary context of an existing device `ordinal` (see [`check_ordinal`]).
pub(super) fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    CudaContext::new(ordinal)
        .map_err(|e| dev_err(format!("creating a context on cuda:{ordinal}"), e))
}

/// Buffers come from the device's default stream-ordered pool (`cuMemAllocAsync`), which by
/// default hands freed memory back to the driver at every synchronization: each epoch would
/// then map its activations afresh (page-table work plus the zeroing the driver does for new
/// memory). Keeping freed memory in the pool makes an epoch's allocations reuse the last
/// epoch's. What the pool holds never exceeds the peak of live buffers, which is what the
/// memory model budgets.
pub(super) fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::{result, sys};
    let mut threshold = u64::MAX;
    // SAFETY: the device comes from a live context; the attribute takes a u64.
    unsafe {
        result::device::get_default_mem_pool(ctx.cu_device()).and_then(|pool| {
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        })
    }
    .map_err(|e| dev_err("setting the memory pool's release threshold", e))
}

/// Free and total bytes of the device behind `ctx`.
pub(super) fn memory_of(ctx: &CudaContext) -> Result<(u64, u64)> {
    let (free, total) = ctx.mem_get_info().map_err(|e| dev_err("cuMemGetInfo", e))?;
    Ok((free as u64, total as u64))
}

/// Free and total memory of device `ordinal` in bytes (opens its primary context), or a
/// clean error when there is no driver or no such device.
pub fn device_memory(ordinal: usize) -> Result<(u64, u64)> {
    let what = format!("querying the memory of cuda:{ordinal}");
    if !driver_library_present() {
        return Err(no_driver_error(&what));
    }
    guarded(&what, || {
        check_ordinal(ordinal)?;
        memory_of(&*context(ordinal)?)
    })
}

/// What `grandis train --device cuda:N` prints: the device's name, its memory and the CUDA
/// versions found (the driver's and NVRTC's), or the clean error of a missing driver,
/// device or library.
pub fn describe_device(ordinal: usize) -> Result<String> {
    let what = format!("--device cuda:{ordinal}");
    if !driver_library_present() {
        return Err(no_driver_error(&what));
    }
    guarded(&what, || {
        check_ordinal(ordinal)?;
        let ctx = context(ordinal)?;
        let (free, total) = memory_of(&ctx)?;
        let name = ctx.name().unwrap_or_else(|_| "unknown device".into());
        let mut driver = 0i32;
        // SAFETY: writes one int; the driver library is loaded (a context exists).
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
            .result()
            .map_err(|e| dev_err("cuDriverGetVersion", e))?;
        // SAFETY: only tries to dlopen the library by its usual names.
        let nvrtc = if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            let (mut major, mut minor) = (0i32, 0i32);
            // SAFETY: writes two ints; the library is present.
            unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
            format!("NVRTC {major}.{minor}")
        } else {
            "NVRTC not found".into()
        };
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        Ok(format!(
            "cuda:{ordinal}: {name}, {:.1} GiB ({:.1} GiB free), driver CUDA {}.{}, {nvrtc}",
            gib(total),
            gib(free),
            driver / 1000,
            (driver % 1000) / 10
        ))
    })
}

/// PTX of [`kernels::SOURCE`], compiled once per process (PTX does not depend on the
/// context; each backend loads it into its own).
pub(super) static PTX: OnceLock<std::result::Result<Ptx, String>> = OnceLock::new();

pub(super) fn compiled_ptx() -> Result<Ptx> {
    let r = PTX.get_or_init(|| {
        let opts = CompileOptions {
            // No FMA contraction and IEEE div/sqrt: the kernels then round exactly like the
            // CPU backend's Rust loops (which never contract).
            fmad: Some(false),
            prec_div: Some(true),
            prec_sqrt: Some(true),
            ftz: Some(false),
            name: Some("grandis_kernels.cu".into()),
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(kernels::SOURCE, opts).map_err(|e| e.to_string())
    });
    r.clone()
        .map_err(|e| dev_err("compiling the CUDA kernels with NVRTC", e))
}
