//! The CUDA backend ([`CudaBackend`]): device buffers from cudarc, GEMM through cuBLAS, and
//! every other operation as a custom kernel compiled at start-up with NVRTC
//! ([`kernels::SOURCE`]).
//!
//! cudarc is built with `dynamic-loading`: the crate compiles and links without any CUDA
//! installation, and `libcuda` / `libnvrtc` / `libcublas` are opened at run time. cudarc
//! panics when a library is missing, so [`CudaBackend::new`] first checks that each library
//! can be opened and returns an [`EngineError::Device`] naming the missing one, and it runs
//! the first driver calls under `catch_unwind` as a second line of defence.
//!
//! Aggregation uses our own CSR kernel rather than cuSPARSE SpMM: the backend contract
//! (explicit `dst`/`src`/`self` scale vectors, the halo-rows rule of the transposed graph,
//! results equal to the CPU backend) maps onto one small kernel that follows the CPU loop
//! operation by operation, while cuSPARSE would need the scales folded into per-edge values
//! (an extra `E`-sized array per graph) and sums in an order of its own choosing.
//!
//! All work is queued on one stream per backend ([`CudaBackend::stream`]); cudarc's per-buffer
//! event tracking is switched off because a single in-order stream needs none. Code that adds
//! work of its own on these buffers (NCCL collectives, for instance) must use the same stream
//! or synchronise with it.
//!
//! Small scratch buffers (per-chunk partial sums of reductions, per-row loss terms, the
//! grouping of a scatter index) are allocated inside the operations that need them; they are
//! `O(rows / 4096 * cols)`, `O(selected rows)` and `O(index length)` respectively.

#[cfg(all(test, target_os = "linux"))]
mod emulated;
pub mod kernels;
pub mod nccl;

use crate::backend::{
    check_attention, dropout_threshold, need, shape_err, AdamStep, Attention, Backend, BlockGraph,
    DropoutKey, EngineError, PreparedGraph, Result, ScaledCsr,
};
use crate::host::HostBuffer;
use crate::profile::{aggregate_bytes, OpClass, OpProfile, OpTimes};
use cudarc::cublas::{sys as cublas_sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

const BACKEND: &str = "cuda";

/// Threads per block of the element-wise kernels.
const ELEM_THREADS: u32 = 256;
/// Upper bound on the grid of grid-stride kernels (each thread loops over the rest).
const MAX_BLOCKS: u64 = 1 << 20;
/// Upper bound on `gridDim.y` (a hardware limit is 65535).
const MAX_GRID_Y: u64 = 65_535;

fn dev_err(context: impl std::fmt::Display, e: impl std::fmt::Display) -> EngineError {
    EngineError::Device {
        backend: BACKEND,
        message: format!("{context}: {e}"),
    }
}

/// `rows * cols` without overflow (a shape error otherwise).
fn elems(op: &'static str, rows: usize, cols: usize) -> Result<usize> {
    rows.checked_mul(cols)
        .ok_or_else(|| shape_err(op, format!("{rows} x {cols} overflows the address space")))
}

/// Runs `f`, turning a panic inside cudarc (a library or symbol it could not load) into an
/// error instead of tearing down the caller.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
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

fn no_driver_error(what: &str) -> EngineError {
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
fn check_ordinal(ordinal: usize) -> Result<()> {
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
fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    CudaContext::new(ordinal)
        .map_err(|e| dev_err(format!("creating a context on cuda:{ordinal}"), e))
}

/// Page-locked host memory of `f32` (see [`crate::host`]): portable, so every context of the
/// process copies from it at full speed.
#[derive(Debug)]
pub struct PinnedRows {
    mem: cudarc::driver::PinnedHostSlice<f32>,
    /// `mem`'s pointer, read once: the slice's own accessors wait on an event first.
    ptr: *mut f32,
}

// SAFETY: the memory is owned by `mem` (which is Send + Sync) and `ptr` only points into it;
// shared access hands out `&[f32]`, exclusive access `&mut [f32]`, as a `Vec` would.
unsafe impl Send for PinnedRows {}
unsafe impl Sync for PinnedRows {}

impl PinnedRows {
    pub(crate) fn len(&self) -> usize {
        self.mem.len()
    }

    pub(crate) fn as_slice(&self) -> &[f32] {
        // SAFETY: `ptr` points at `len` floats owned by `mem`, alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.mem.len()) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as above, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.mem.len()) }
    }
}

/// Allocates page-locked host buffers for the ranks of device `ordinal`'s process.
pub struct PinnedAllocator {
    ctx: Arc<CudaContext>,
}

impl PinnedAllocator {
    /// Fails (with the message [`CudaBackend::new`] would give) where there is no driver or no
    /// such device.
    pub fn new(ordinal: usize) -> Result<PinnedAllocator> {
        let what = format!("page-locked memory for cuda:{ordinal}");
        if !driver_library_present() {
            return Err(no_driver_error(&what));
        }
        guarded(&what, || {
            check_ordinal(ordinal)?;
            Ok(PinnedAllocator {
                ctx: context(ordinal)?,
            })
        })
    }
}

impl crate::host::HostAllocator for PinnedAllocator {
    fn alloc(&self, capacity: usize) -> Result<crate::host::HostBuffer> {
        // SAFETY: the memory is uninitialised; HostBuffer hands out only the elements its
        // users set (`set_len` documents that they write every element).
        let mut mem = unsafe {
            self.ctx.alloc_pinned_with_flags::<f32>(
                capacity.max(1),
                cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(|e| {
            dev_err(
                format!("allocating {capacity} floats of page-locked memory"),
                e,
            )
        })?;
        let ptr = mem
            .as_mut_ptr()
            .map_err(|e| dev_err("page-locked memory", e))?;
        Ok(crate::host::HostBuffer::pinned(PinnedRows { mem, ptr }))
    }
}

/// Buffers come from the device's default stream-ordered pool (`cuMemAllocAsync`), which by
/// default hands freed memory back to the driver at every synchronization: each epoch would
/// then map its activations afresh (page-table work plus the zeroing the driver does for new
/// memory). Keeping freed memory in the pool makes an epoch's allocations reuse the last
/// epoch's. What the pool holds never exceeds the peak of live buffers, which is what the
/// memory model budgets.
fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
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
fn memory_of(ctx: &CudaContext) -> Result<(u64, u64)> {
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

/// `cuda:0` for the tests that need a GPU, or `None` (with a message saying why the test
/// skips) on a machine without a driver or device. `GRANDIS_REQUIRE_GPU=1` (set by
/// `scripts/gpu-check.sh`) turns such a skip into a panic, so a GPU machine cannot pass by
/// skipping.
pub fn device_for_tests() -> Option<CudaBackend> {
    let require = std::env::var("GRANDIS_REQUIRE_GPU").is_ok_and(|v| v == "1");
    if !driver_library_present() {
        assert!(!require, "GRANDIS_REQUIRE_GPU=1 but no CUDA driver library");
        eprintln!("skipped: no CUDA driver library (libcuda.so) on this machine");
        return None;
    }
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(!require, "GRANDIS_REQUIRE_GPU=1 but cuda:0 failed: {e}");
            eprintln!("skipped: cuda:0 unavailable: {e}");
            None
        }
    }
}

/// PTX of [`kernels::SOURCE`], compiled once per process (PTX does not depend on the
/// context; each backend loads it into its own).
static PTX: OnceLock<std::result::Result<Ptx, String>> = OnceLock::new();

fn compiled_ptx() -> Result<Ptx> {
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

/// A device `f32` buffer. Holds at least one element on the device (CUDA has no zero-byte
/// allocations); [`Backend::len`] reports the logical length.
pub struct CudaBuf {
    data: CudaSlice<f32>,
    len: usize,
}

impl CudaBuf {
    /// The underlying device slice (its first `len` elements are the buffer), for code that
    /// queues its own work on [`CudaBackend::stream`] (e.g. NCCL collectives).
    pub fn slice(&self) -> &CudaSlice<f32> {
        &self.data
    }

    pub fn slice_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.data
    }
}

/// Positions of an index buffer grouped by target row, for a deterministic scatter-add.
struct ScatterPlan {
    targets: CudaSlice<u32>,
    offsets: CudaSlice<u64>,
    positions: CudaSlice<u32>,
    n_groups: usize,
}

/// A device `u32` buffer. Keeps a host copy: the backend validates ids against buffer sizes
/// on the host (as the CPU backend does) without a device round trip, and builds the
/// scatter grouping from it.
pub struct CudaIndex {
    data: CudaSlice<u32>,
    host: Vec<u32>,
    max: Option<u32>,
    scatter: Mutex<Option<Arc<ScatterPlan>>>,
}

impl CudaIndex {
    pub fn slice(&self) -> &CudaSlice<u32> {
        &self.data
    }

    /// The host copy of the ids.
    pub fn host(&self) -> &[u32] {
        &self.host
    }
}

/// One direction of an uploaded graph: `out[v] = dst[v] * sum_u src[u] * x[u] + self[v] x[v]`.
struct DevCsr {
    n_rows: usize,
    n_edges: usize,
    offsets: CudaSlice<u64>,
    indices: CudaSlice<u32>,
    dst: CudaSlice<f32>,
    src: Option<CudaSlice<f32>>,
    self_: Option<CudaSlice<f32>>,
}

/// An uploaded [`BlockGraph`]: forward CSR and its transpose, with their scale vectors.
pub struct CudaGraph {
    fwd: DevCsr,
    bwd: DevCsr,
    n_dst: usize,
    n_src: usize,
    n_edges: usize,
}

/// The CUDA backend: one device, one stream, one cuBLAS handle.
pub struct CudaBackend {
    ordinal: usize,
    device_name: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    clock: OpClock,
}

/// The event pairs recorded around operations while timing is on ([`OpProfile`]).
#[derive(Default)]
struct OpClock {
    on: AtomicBool,
    spans: Mutex<Vec<(OpClass, CudaEvent, CudaEvent)>>,
    aggregate_bytes: AtomicU64,
}

fn elem_cfg(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(ELEM_THREADS as u64).clamp(1, MAX_BLOCKS);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (ELEM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row, 8 warps per block.
fn warp_rows_cfg(op: &'static str, rows: u64) -> Result<LaunchConfig> {
    let blocks = rows.div_ceil(8);
    if blocks > i32::MAX as u64 {
        return Err(shape_err(op, format!("{rows} rows exceed the CUDA grid")));
    }
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Column-reduction kernels: threads over columns, `gridDim.y` over row chunks.
fn col_chunks_cfg(cols: u64, n_chunks: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            cols.div_ceil(128) as u32,
            n_chunks.clamp(1, MAX_GRID_Y) as u32,
            1,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch shape of `csr_aggregate`: the threads of a row stride over its columns (up to 128
/// per row for wide rows, fewer, rounded to a power of two, for narrow ones), 256 threads per
/// block, `blockDim.y` rows per block.
fn csr_cfg(op: &'static str, n_rows: usize, d: usize) -> Result<LaunchConfig> {
    let bx: u32 = if d >= 32 {
        (d.div_ceil(32) * 32).min(128) as u32
    } else {
        (d as u32).next_power_of_two()
    };
    let by = (256 / bx).max(1);
    let blocks = (n_rows as u64).div_ceil(by as u64);
    if blocks > i32::MAX as u64 {
        return Err(shape_err(op, format!("{n_rows} rows exceed the CUDA grid")));
    }
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (bx, by, 1),
        shared_mem_bytes: 0,
    })
}

/// `sumsq_partials`: one block of 256 threads per chunk (grid-stride beyond the cap).
fn sumsq_cfg(n_chunks: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n_chunks.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Adam bias corrections exactly as the CPU backend computes them (f64 `powf`, then f32).
fn adam_bias_corrections(s: &AdamStep) -> (f32, f32) {
    let bc1 = (1.0 - (s.beta1 as f64).powf(s.step as f64)) as f32;
    let bc2 = (1.0 - (s.beta2 as f64).powf(s.step as f64)) as f32;
    (bc1, bc2)
}

/// The attention kernels' shared arguments, in their order: `heads, f, concat, slope,
/// has_drop, ids, stream, thr, scale`.
struct AttnArgs<'a> {
    heads: u64,
    head_dim: u64,
    concat: i32,
    slope: f32,
    has_drop: i32,
    ids: &'a CudaSlice<u32>,
    stream: u64,
    thr: u32,
    scale: f32,
}

impl<'a> AttnArgs<'a> {
    /// `unused_ids` stands in for the global ids when nothing is dropped (never read then).
    fn new(att: &Attention<'a, CudaIndex>, unused_ids: &'a CudaSlice<u32>) -> AttnArgs<'a> {
        let d = att.dropout.as_ref();
        let (stream, thr, scale) = d.map_or((0, 0, 1.0), |d| d.mask_constants());
        AttnArgs {
            heads: att.heads as u64,
            head_dim: att.head_dim as u64,
            concat: att.concat as i32,
            slope: att.negative_slope,
            has_drop: d.is_some() as i32,
            ids: d.map_or(unused_ids, |d| &d.global_ids.data),
            stream,
            thr,
            scale,
        }
    }

    fn push<'b>(&'b self, b: &mut cudarc::driver::LaunchArgs<'b>) {
        b.arg(&self.heads)
            .arg(&self.head_dim)
            .arg(&self.concat)
            .arg(&self.slope)
            .arg(&self.has_drop)
            .arg(self.ids)
            .arg(&self.stream)
            .arg(&self.thr)
            .arg(&self.scale);
    }
}

/// Groups the positions of `ids` by target: `(targets, offsets, positions)` with the
/// positions of `targets[g]` at `positions[offsets[g]..offsets[g + 1]]`, ascending (the order
/// in which the CPU loop adds them).
fn scatter_groups(ids: &[u32]) -> (Vec<u32>, Vec<u64>, Vec<u32>) {
    let mut pairs: Vec<(u32, u32)> = ids
        .iter()
        .enumerate()
        .map(|(i, &t)| (t, i as u32))
        .collect();
    // Sorting (target, position) pairs keeps each target's positions ascending.
    pairs.sort_unstable();
    let positions: Vec<u32> = pairs.iter().map(|&(_, p)| p).collect();
    let mut targets = Vec::new();
    let mut offsets = vec![0u64];
    for (i, &(t, _)) in pairs.iter().enumerate() {
        if targets.last() != Some(&t) {
            if i > 0 {
                offsets.push(i as u64);
            }
            targets.push(t);
        }
    }
    if !targets.is_empty() {
        offsets.push(pairs.len() as u64);
    }
    (targets, offsets, positions)
}

impl CudaBackend {
    /// Opens device `ordinal`: checks that the driver, NVRTC and cuBLAS libraries exist,
    /// creates a context and a stream, compiles (first call in the process) and loads the
    /// kernels. Every failure is an [`EngineError::Device`] that says what is missing.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let what = format!("--device cuda:{ordinal}");
        if !driver_library_present() {
            return Err(no_driver_error(&what));
        }
        guarded(&what, || Self::open(ordinal))
    }

    fn open(ordinal: usize) -> Result<CudaBackend> {
        check_ordinal(ordinal)?;
        // SAFETY: only tries to dlopen the libraries by their usual names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(EngineError::Device {
                backend: BACKEND,
                message: "NVRTC library (libnvrtc.so) not found: the CUDA backend compiles its \
                          kernels at start-up and needs the CUDA runtime compiler"
                    .into(),
            });
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(EngineError::Device {
                backend: BACKEND,
                message: "cuBLAS library (libcublas.so) not found: the CUDA backend needs it \
                          for dense matrix products"
                    .into(),
            });
        }
        let ctx = context(ordinal)?;
        keep_freed_memory(&ctx)?;
        // SAFETY: every buffer of this backend is created and used on the one stream below,
        // which orders all accesses; the per-buffer events would only add overhead.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| dev_err("creating a CUDA stream", e))?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown device".into());
        let ptx = compiled_ptx()?;
        let module = ctx.load_module(ptx).map_err(|e| {
            dev_err(
                "loading the compiled kernels (an NVRTC newer than the driver produces PTX \
                 the driver cannot load)",
                e,
            )
        })?;
        let mut funcs = HashMap::new();
        for &name in kernels::NAMES {
            let f = module
                .load_function(name)
                .map_err(|e| dev_err(format!("kernel {name}"), e))?;
            funcs.insert(name, f);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| dev_err("creating cuBLAS", e))?;
        // Plain FP32 products (no TF32 tensor-core rounding), so GEMMs match the CPU backend
        // to f32 rounding.
        // SAFETY: the handle is valid for the lifetime of `blas`.
        unsafe {
            cublas_sys::cublasSetMathMode(
                *blas.handle(),
                cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
            )
        }
        .result()
        .map_err(|e| dev_err("cublasSetMathMode", e))?;
        tracing::info!("CUDA backend on cuda:{ordinal} ({device_name})");
        Ok(CudaBackend {
            ordinal,
            device_name,
            ctx,
            stream,
            blas,
            funcs,
            clock: OpClock::default(),
        })
    }

    /// Uploads a validated block and its transpose.
    fn upload_block(&self, g: &BlockGraph, t: &ScaledCsr) -> Result<CudaGraph> {
        let fwd = self.upload_csr(
            &g.offsets,
            &g.indices,
            &g.dst_scale,
            g.src_scale.as_deref(),
            g.self_scale.as_deref(),
        )?;
        let bwd = self.upload_csr(
            &t.offsets,
            &t.indices,
            &t.dst,
            t.src.as_deref(),
            t.self_.as_deref(),
        )?;
        tracing::debug!(
            "cuda:{}: uploaded graph block {}x{} with {} edges",
            self.ordinal,
            g.n_dst,
            g.n_src,
            g.indices.len()
        );
        Ok(CudaGraph {
            fwd,
            bwd,
            n_dst: g.n_dst,
            n_src: g.n_src,
            n_edges: g.indices.len(),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every operation of this backend is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Runs `f` (which queues work on the stream) between two recorded events when timing is
    /// on; the events are read by [`OpProfile::op_times`].
    fn timed<R>(&self, class: OpClass, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if !self.clock.on.load(Ordering::Relaxed) {
            return f();
        }
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .stream
            .record_event(flags)
            .map_err(|e| dev_err("recording a timing event", e))?;
        let r = f()?;
        let end = self
            .stream
            .record_event(flags)
            .map_err(|e| dev_err("recording a timing event", e))?;
        if let Ok(mut spans) = self.clock.spans.lock() {
            spans.push((class, start, end));
        }
        Ok(r)
    }

    fn func(&self, name: &'static str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| dev_err("kernel table", format!("kernel {name} was not loaded")))
    }

    /// Device copy of `host`; an empty slice becomes a one-element zero buffer.
    fn to_dev<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        what: &str,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        let r = if host.is_empty() {
            self.stream.alloc_zeros::<T>(1)
        } else {
            self.stream.clone_htod(host)
        };
        r.map_err(|e| {
            dev_err(
                format!(
                    "cuda:{}: uploading {what} ({} bytes)",
                    self.ordinal,
                    std::mem::size_of_val(host)
                ),
                e,
            )
        })
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        what: &str,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(len.max(1)).map_err(|e| {
            dev_err(
                format!(
                    "cuda:{}: allocating {what} ({} bytes)",
                    self.ordinal,
                    len * std::mem::size_of::<T>()
                ),
                e,
            )
        })
    }

    fn sync(&self, op: &str) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| dev_err(format!("cuda:{}: {op}", self.ordinal), e))
    }

    fn upload_csr(
        &self,
        offsets: &[u64],
        indices: &[u32],
        dst: &[f32],
        src: Option<&[f32]>,
        self_: Option<&[f32]>,
    ) -> Result<DevCsr> {
        Ok(DevCsr {
            n_rows: offsets.len() - 1,
            n_edges: indices.len(),
            offsets: self.to_dev("graph offsets", offsets)?,
            indices: self.to_dev("graph indices", indices)?,
            dst: self.to_dev("graph scales", dst)?,
            src: src.map(|s| self.to_dev("graph scales", s)).transpose()?,
            self_: self_.map(|s| self.to_dev("graph scales", s)).transpose()?,
        })
    }

    fn run_csr(
        &self,
        op: &'static str,
        g: &DevCsr,
        x: &CudaBuf,
        d: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        if g.n_rows == 0 || d == 0 {
            return Ok(());
        }
        if self.clock.on.load(Ordering::Relaxed) {
            self.clock
                .aggregate_bytes
                .fetch_add(aggregate_bytes(g.n_edges, g.n_rows, d), Ordering::Relaxed);
        }
        self.timed(OpClass::Aggregate, || self.launch_csr(op, g, x, d, out))
    }

    fn launch_csr(
        &self,
        op: &'static str,
        g: &DevCsr,
        x: &CudaBuf,
        d: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let cfg = csr_cfg(op, g.n_rows, d)?;
        let (has_src, has_self) = (g.src.is_some() as i32, g.self_.is_some() as i32);
        // Absent scale vectors are never read (flag 0); any valid pointer stands in.
        let src = g.src.as_ref().unwrap_or(&g.dst);
        let slf = g.self_.as_ref().unwrap_or(&g.dst);
        let (n_rows, d64) = (g.n_rows as u64, d as u64);
        let f = self.func("csr_aggregate")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&g.offsets)
            .arg(&g.indices)
            .arg(&g.dst)
            .arg(src)
            .arg(&has_src)
            .arg(slf)
            .arg(&has_self)
            .arg(&x.data)
            .arg(&n_rows)
            .arg(&d64)
            .arg(&mut out.data);
        // SAFETY: offsets has n_rows + 1 entries, indices are < n_src (validated at upload),
        // x has n_src * d elements and out n_rows * d (checked by the callers).
        unsafe { b.launch(cfg) }.map_err(|e| dev_err(op, e))?;
        Ok(())
    }

    /// The grouping of `idx` by target row (built on first use, then cached in the index).
    fn scatter_plan(&self, idx: &CudaIndex) -> Result<Arc<ScatterPlan>> {
        let mut slot = idx
            .scatter
            .lock()
            .map_err(|_| dev_err("scatter_add_rows", "index lock poisoned"))?;
        if let Some(p) = slot.as_ref() {
            return Ok(p.clone());
        }
        if idx.host.len() > u32::MAX as usize {
            return Err(shape_err(
                "scatter_add_rows",
                format!(
                    "index has {} entries, at most 2^32 - 1 supported",
                    idx.host.len()
                ),
            ));
        }
        let (targets, offsets, positions) = scatter_groups(&idx.host);
        let plan = Arc::new(ScatterPlan {
            n_groups: targets.len(),
            targets: self.to_dev("scatter targets", &targets)?,
            offsets: self.to_dev("scatter offsets", &offsets)?,
            positions: self.to_dev("scatter positions", &positions)?,
        });
        *slot = Some(plan.clone());
        Ok(plan)
    }

    /// Reduces f64 per-chunk partials (downloaded) in chunk order.
    fn ordered_host_sum(&self, op: &str, part: &CudaSlice<f64>, n: usize) -> Result<f64> {
        if n == 0 {
            self.sync(op)?;
            return Ok(0.0);
        }
        let mut host = vec![0.0f64; n];
        self.stream
            .memcpy_dtoh(&part.slice(0..n), &mut host)
            .map_err(|e| dev_err(op, e))?;
        self.sync(op)?;
        let mut total = 0.0f64;
        for v in host {
            total += v;
        }
        Ok(total)
    }

    /// `out[j] = beta * out[j] + sum_ch part[ch * stride + offset + j]`.
    #[allow(clippy::too_many_arguments)]
    fn finish_partials(
        &self,
        op: &'static str,
        part: &CudaSlice<f64>,
        n_chunks: u64,
        stride: u64,
        offset: u64,
        cols: u64,
        beta: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let f = self.func("partials_finish")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(part)
            .arg(&n_chunks)
            .arg(&stride)
            .arg(&offset)
            .arg(&cols)
            .arg(&beta)
            .arg(&mut out.data);
        // SAFETY: part has n_chunks * stride elements covering offset + cols; out has cols.
        unsafe { b.launch(elem_cfg(cols)) }.map_err(|e| dev_err(op, e))?;
        Ok(())
    }
}

impl OpProfile for CudaBackend {
    fn set_op_timing(&self, on: bool) {
        self.clock.on.store(on, Ordering::Relaxed);
    }

    fn reset_op_times(&self) {
        if let Ok(mut spans) = self.clock.spans.lock() {
            spans.clear();
        }
        self.clock.aggregate_bytes.store(0, Ordering::Relaxed);
    }

    fn op_times(&self) -> OpTimes {
        let mut t = OpTimes {
            aggregate_bytes: self.clock.aggregate_bytes.load(Ordering::Relaxed),
            ..OpTimes::default()
        };
        for (class, seconds) in self.span_seconds() {
            match class {
                OpClass::Aggregate => t.aggregate_s += seconds,
                OpClass::Gemm => t.gemm_s += seconds,
                OpClass::Other(_) => t.other_s += seconds,
            }
        }
        t
    }

    fn other_op_times(&self) -> Vec<(&'static str, f64)> {
        let mut by_name: std::collections::BTreeMap<&'static str, f64> = Default::default();
        for (class, seconds) in self.span_seconds() {
            if let OpClass::Other(name) = class {
                *by_name.entry(name).or_default() += seconds;
            }
        }
        let mut v: Vec<_> = by_name.into_iter().collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }
}

impl CudaBackend {
    /// Seconds between each recorded event pair (waits for the events).
    fn span_seconds(&self) -> Vec<(OpClass, f64)> {
        let Ok(spans) = self.clock.spans.lock() else {
            return Vec::new();
        };
        spans
            .iter()
            .map(|(class, start, end)| {
                let ms = start.elapsed_ms(end).unwrap_or(f32::NAN);
                (*class, ms as f64 * 1e-3)
            })
            .collect()
    }
}

fn check_index_range(op: &'static str, what: &str, idx: &CudaIndex, limit: usize) -> Result<()> {
    match idx.max {
        Some(m) if m as usize >= limit => Err(shape_err(
            op,
            format!("{what} {m} out of range (must be < {limit})"),
        )),
        _ => Ok(()),
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Index = CudaIndex;
    type Graph = CudaGraph;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn alloc(&self, len: usize) -> Result<CudaBuf> {
        Ok(CudaBuf {
            data: self.zeros("a buffer", len)?,
            len,
        })
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn upload(&self, host: &[f32]) -> Result<CudaBuf> {
        Ok(CudaBuf {
            data: self.to_dev("a buffer", host)?,
            len: host.len(),
        })
    }

    fn upload_host(&self, host: HostBuffer) -> Result<(CudaBuf, HostBuffer)> {
        let buf = self.upload(host.as_slice())?;
        if host.is_pinned() {
            // From page-locked memory the copy is still running when the call returns (from
            // pageable memory the driver has staged the data by then): the buffer goes back
            // to its owner, who refills it, only once the copy is done.
            self.stream
                .synchronize()
                .map_err(|e| dev_err(format!("cuda:{}: uploading a step", self.ordinal), e))?;
        }
        Ok((buf, host))
    }

    fn upload_into(&self, buf: &mut CudaBuf, offset: usize, host: &[f32]) -> Result<()> {
        need("upload_into", "buffer", buf.len, offset + host.len())?;
        if host.is_empty() {
            return Ok(());
        }
        let mut view = buf.data.slice_mut(offset..offset + host.len());
        self.stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| dev_err("upload_into", e))
    }

    fn download(&self, buf: &CudaBuf, offset: usize, out: &mut [f32]) -> Result<()> {
        need("download", "buffer", buf.len, offset + out.len())?;
        if !out.is_empty() {
            let view = buf.data.slice(offset..offset + out.len());
            self.stream
                .memcpy_dtoh(&view, out)
                .map_err(|e| dev_err("download", e))?;
        }
        self.sync("download")
    }

    fn upload_index(&self, host: &[u32]) -> Result<CudaIndex> {
        Ok(CudaIndex {
            data: self.to_dev("an index", host)?,
            host: host.to_vec(),
            max: host.iter().copied().max(),
            scatter: Mutex::new(None),
        })
    }

    fn index_len(&self, idx: &CudaIndex) -> usize {
        idx.host.len()
    }

    fn fill(&self, buf: &mut CudaBuf, len: usize, value: f32) -> Result<()> {
        self.timed(OpClass::Other("fill"), || {
            need("fill", "buffer", buf.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("fill_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut buf.data).arg(&n).arg(&value);
            // SAFETY: buf has at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("fill", e))?;
            Ok(())
        })
    }

    fn copy_range(
        &self,
        src: &CudaBuf,
        src_at: usize,
        dst: &mut CudaBuf,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.timed(OpClass::Other("copy"), || {
            need("copy", "src", src.len, src_at.saturating_add(len))?;
            need("copy", "dst", dst.len, dst_at.saturating_add(len))?;
            if len == 0 {
                return Ok(());
            }
            // On this stream: a buffer from a rank on another stream is complete here because
            // its sender synchronised before handing it over (the same-device transport); one on
            // another device is copied through unified addressing.
            let s = src.data.slice(src_at..src_at + len);
            let mut d = dst.data.slice_mut(dst_at..dst_at + len);
            self.stream
                .memcpy_dtod(&s, &mut d)
                .map_err(|e| dev_err("copy", e))
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.sync("synchronize")
    }

    fn gather_rows(
        &self,
        src: &CudaBuf,
        cols: usize,
        idx: &CudaIndex,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("gather_rows"), || {
            let n = elems("gather_rows", idx.host.len(), cols)?;
            need("gather_rows", "out", out.len, n)?;
            if let Some(m) = idx.max {
                if (m as usize + 1) * cols > src.len {
                    return Err(shape_err(
                        "gather_rows",
                        format!("row {m} is outside src ({} elements)", src.len),
                    ));
                }
            }
            if n == 0 {
                return Ok(());
            }
            let (n, cols) = (n as u64, cols as u64);
            let f = self.func("gather_rows")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&src.data)
                .arg(&idx.data)
                .arg(&mut out.data)
                .arg(&n)
                .arg(&cols);
            // SAFETY: every idx row is inside src (checked above), out has n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("gather_rows", e))?;
            Ok(())
        })
    }

    fn scatter_add_rows(
        &self,
        src: &CudaBuf,
        cols: usize,
        idx: &CudaIndex,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("scatter_add_rows"), || {
            let n = elems("scatter_add_rows", idx.host.len(), cols)?;
            need("scatter_add_rows", "src", src.len, n)?;
            if let Some(m) = idx.max {
                if (m as usize + 1) * cols > out.len {
                    return Err(shape_err(
                        "scatter_add_rows",
                        format!("row {m} is outside out ({} elements)", out.len),
                    ));
                }
            }
            if n == 0 {
                return Ok(());
            }
            let plan = self.scatter_plan(idx)?;
            let (n_groups, cols) = (plan.n_groups as u64, cols as u64);
            let f = self.func("scatter_add_grouped")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&src.data)
                .arg(&plan.targets)
                .arg(&plan.offsets)
                .arg(&plan.positions)
                .arg(&mut out.data)
                .arg(&n_groups)
                .arg(&cols);
            // SAFETY: the plan's targets are idx values (inside out), positions < idx.len()
            // (inside src); each output element is written by exactly one thread.
            unsafe { b.launch(elem_cfg(n_groups * cols)) }
                .map_err(|e| dev_err("scatter_add_rows", e))?;
            Ok(())
        })
    }

    fn gemm(
        &self,
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &CudaBuf,
        b: &CudaBuf,
        beta: f32,
        c: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Gemm, || {
            need("gemm", "A", a.len, elems("gemm", m, k)?)?;
            need("gemm", "B", b.len, elems("gemm", k, n)?)?;
            let mn = elems("gemm", m, n)?;
            need("gemm", "C", c.len, mn)?;
            if m == 0 || n == 0 {
                return Ok(());
            }
            if k == 0 {
                // cuBLAS rejects a leading dimension of 0; C = beta * C (beta = 0 clears NaN).
                return if beta == 0.0 {
                    self.fill(c, mn, 0.0)
                } else {
                    self.scale(c, beta, mn)
                };
            }
            let dims = [m, n, k];
            if dims.iter().any(|&x| x > i32::MAX as usize) {
                return Err(shape_err(
                    "gemm",
                    format!("{m} x {n} x {k} exceeds cuBLAS's 32-bit dimensions"),
                ));
            }
            let (mi, ni, ki) = (m as i32, n as i32, k as i32);
            // Row-major C (m x n) is column-major C^T (n x m): compute C^T = op(B)^T op(A)^T,
            // where each row-major operand read column-major is already its transpose.
            use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
            let (op_b, ldb) = if trans_b {
                (CUBLAS_OP_T, ki)
            } else {
                (CUBLAS_OP_N, ni)
            };
            let (op_a, lda) = if trans_a {
                (CUBLAS_OP_T, mi)
            } else {
                (CUBLAS_OP_N, ki)
            };
            let cfg = GemmConfig {
                transa: op_b,
                transb: op_a,
                m: ni,
                n: mi,
                k: ki,
                alpha,
                lda: ldb,
                ldb: lda,
                beta,
                ldc: ni,
            };
            // SAFETY: A, B and C hold at least m*k, k*n and m*n elements (checked above) and the
            // leading dimensions describe exactly those dense matrices.
            unsafe { self.blas.gemm(cfg, &b.data, &a.data, &mut c.data) }
                .map_err(|e| dev_err(format!("gemm {m}x{n}x{k} (cuBLAS)"), e))
        })
    }

    fn add_bias(&self, x: &mut CudaBuf, bias: &CudaBuf, rows: usize, cols: usize) -> Result<()> {
        self.timed(OpClass::Other("add_bias"), || {
            let n = elems("add_bias", rows, cols)?;
            need("add_bias", "x", x.len, n)?;
            need("add_bias", "bias", bias.len, cols)?;
            if n == 0 {
                return Ok(());
            }
            let (n, cols) = (n as u64, cols as u64);
            let f = self.func("add_bias")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut x.data).arg(&bias.data).arg(&n).arg(&cols);
            // SAFETY: x has n elements, bias cols.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("add_bias", e))?;
            Ok(())
        })
    }

    fn col_sum(
        &self,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        beta: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("col_sum"), || {
            need("col_sum", "x", x.len, elems("col_sum", rows, cols)?)?;
            need("col_sum", "out", out.len, cols)?;
            if cols == 0 {
                return Ok(());
            }
            let (rows64, cols64) = (rows as u64, cols as u64);
            let n_chunks = rows64.div_ceil(kernels::RED_CHUNK);
            let part = self.zeros::<f64>("column partial sums", (n_chunks * cols64) as usize)?;
            let mut part = part;
            if n_chunks > 0 {
                let chunk = kernels::RED_CHUNK;
                let f = self.func("col_partials")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&x.data)
                    .arg(&rows64)
                    .arg(&cols64)
                    .arg(&chunk)
                    .arg(&n_chunks)
                    .arg(&mut part);
                // SAFETY: x has rows*cols elements, part n_chunks*cols.
                unsafe { b.launch(col_chunks_cfg(cols64, n_chunks)) }
                    .map_err(|e| dev_err("col_sum", e))?;
            }
            self.finish_partials("col_sum", &part, n_chunks, cols64, 0, cols64, beta, out)
        })
    }

    fn upload_graph(&self, g: &BlockGraph) -> Result<CudaGraph> {
        g.validate()?;
        self.upload_block(g, &crate::backend::transpose(g))
    }

    fn upload_prepared(&self, g: &PreparedGraph) -> Result<CudaGraph> {
        self.upload_block(g.graph(), g.transpose())
    }

    fn graph_dims(&self, g: &CudaGraph) -> (usize, usize, usize) {
        (g.n_dst, g.n_src, g.n_edges)
    }

    fn aggregate(&self, g: &CudaGraph, x: &CudaBuf, d: usize, out: &mut CudaBuf) -> Result<()> {
        need("aggregate", "x", x.len, elems("aggregate", g.n_src, d)?)?;
        need("aggregate", "out", out.len, elems("aggregate", g.n_dst, d)?)?;
        self.run_csr("aggregate", &g.fwd, x, d, out)
    }

    fn aggregate_backward(
        &self,
        g: &CudaGraph,
        grad_out: &CudaBuf,
        d: usize,
        grad_x: &mut CudaBuf,
    ) -> Result<()> {
        let op = "aggregate_backward";
        need(op, "grad_out", grad_out.len, elems(op, g.n_dst, d)?)?;
        need(op, "grad_x", grad_x.len, elems(op, g.n_src, d)?)?;
        self.run_csr(op, &g.bwd, grad_out, d, grad_x)
    }

    fn attention_aggregate(
        &self,
        g: &CudaGraph,
        x: &CudaBuf,
        scores: &CudaBuf,
        att: &Attention<'_, CudaIndex>,
        out: &mut CudaBuf,
        lse: &mut CudaBuf,
    ) -> Result<()> {
        let op = "attention_aggregate";
        check_attention(self, op, g, att, x, scores, lse, out, None)?;
        if g.n_dst == 0 {
            return Ok(());
        }
        let a = AttnArgs::new(att, &g.fwd.indices);
        let n_dst = g.n_dst as u64;
        self.timed(OpClass::Aggregate, || {
            let f = self.func("gat_fwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&g.fwd.offsets)
                .arg(&g.fwd.indices)
                .arg(&x.data)
                .arg(&scores.data);
            a.push(&mut b);
            b.arg(&n_dst).arg(&mut out.data).arg(&mut lse.data);
            // SAFETY: the graph is validated (ids < n_src), and check_attention checked every
            // buffer against n_dst, n_src, heads and head_dim.
            unsafe { b.launch(elem_cfg(n_dst)) }.map_err(|e| dev_err(op, e))?;
            Ok(())
        })
    }

    fn attention_aggregate_backward(
        &self,
        g: &CudaGraph,
        x: &CudaBuf,
        scores: &CudaBuf,
        lse: &CudaBuf,
        att: &Attention<'_, CudaIndex>,
        grad_out: &CudaBuf,
        grad_x: &mut CudaBuf,
        grad_scores: &mut CudaBuf,
        scratch: &mut CudaBuf,
    ) -> Result<()> {
        let op = "attention_aggregate_backward";
        let grads = Some((&*grad_x, &*grad_scores, &*scratch));
        check_attention(self, op, g, att, x, scores, lse, grad_out, grads)?;
        let a = AttnArgs::new(att, &g.fwd.indices);
        let (n_dst, n_src) = (g.n_dst as u64, g.n_src as u64);
        self.timed(OpClass::Aggregate, || {
            if n_dst > 0 {
                let f = self.func("gat_bwd_dst")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&g.fwd.offsets)
                    .arg(&g.fwd.indices)
                    .arg(&x.data)
                    .arg(&scores.data)
                    .arg(&lse.data)
                    .arg(&grad_out.data);
                a.push(&mut b);
                b.arg(&n_dst)
                    .arg(&mut grad_scores.data)
                    .arg(&mut scratch.data);
                // SAFETY: as in attention_aggregate; grad_scores and scratch checked above.
                unsafe { b.launch(elem_cfg(n_dst)) }.map_err(|e| dev_err(op, e))?;
            }
            if n_src > 0 {
                let f = self.func("gat_bwd_src")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&g.bwd.offsets)
                    .arg(&g.bwd.indices)
                    .arg(&x.data)
                    .arg(&scores.data)
                    .arg(&lse.data)
                    .arg(&grad_out.data)
                    .arg(&scratch.data);
                a.push(&mut b);
                b.arg(&n_dst)
                    .arg(&n_src)
                    .arg(&mut grad_x.data)
                    .arg(&mut grad_scores.data);
                // SAFETY: the transposed rows list destinations < n_dst; buffers checked above.
                unsafe { b.launch(elem_cfg(n_src)) }.map_err(|e| dev_err(op, e))?;
            }
            Ok(())
        })
    }

    fn relu(&self, x: &CudaBuf, out: &mut CudaBuf, len: usize) -> Result<()> {
        self.timed(OpClass::Other("relu"), || {
            need("relu", "x", x.len, len)?;
            need("relu", "out", out.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("relu_fwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data).arg(&mut out.data).arg(&n);
            // SAFETY: both buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("relu", e))?;
            Ok(())
        })
    }

    fn relu_backward(&self, y: &CudaBuf, grad: &mut CudaBuf, len: usize) -> Result<()> {
        self.timed(OpClass::Other("relu_backward"), || {
            need("relu_backward", "y", y.len, len)?;
            need("relu_backward", "grad", grad.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("relu_bwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&y.data).arg(&mut grad.data).arg(&n);
            // SAFETY: both buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("relu_backward", e))?;
            Ok(())
        })
    }

    fn dropout(
        &self,
        x: &CudaBuf,
        out: &mut CudaBuf,
        rows: usize,
        cols: usize,
        global_ids: &CudaIndex,
        p: f32,
        key: DropoutKey,
    ) -> Result<()> {
        self.timed(OpClass::Other("dropout"), || {
            let n = elems("dropout", rows, cols)?;
            need("dropout", "x", x.len, n)?;
            need("dropout", "out", out.len, n)?;
            need("dropout", "global_ids", global_ids.host.len(), rows)?;
            if !(0.0..1.0).contains(&p) {
                return Err(shape_err(
                    "dropout",
                    format!("p must be in [0, 1), got {p}"),
                ));
            }
            if n == 0 {
                return Ok(());
            }
            let stream = key.stream();
            let thr = dropout_threshold(p);
            let scale = 1.0f32 / (1.0 - p);
            let p_zero = (p == 0.0) as i32;
            let (rows, cols) = (rows as u64, cols as u64);
            let f = self.func("dropout_fwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data)
                .arg(&mut out.data)
                .arg(&rows)
                .arg(&cols)
                .arg(&global_ids.data)
                .arg(&stream)
                .arg(&thr)
                .arg(&scale)
                .arg(&p_zero);
            // SAFETY: x and out have rows*cols elements, global_ids at least rows.
            unsafe { b.launch(elem_cfg(rows * cols)) }.map_err(|e| dev_err("dropout", e))?;
            Ok(())
        })
    }

    fn dropout_backward(
        &self,
        grad: &mut CudaBuf,
        rows: usize,
        cols: usize,
        global_ids: &CudaIndex,
        p: f32,
        key: DropoutKey,
    ) -> Result<()> {
        self.timed(OpClass::Other("dropout_backward"), || {
            let op = "dropout_backward";
            let n = elems(op, rows, cols)?;
            need(op, "grad", grad.len, n)?;
            need(op, "global_ids", global_ids.host.len(), rows)?;
            if !(0.0..1.0).contains(&p) {
                return Err(shape_err(op, format!("p must be in [0, 1), got {p}")));
            }
            if n == 0 || p == 0.0 {
                return Ok(());
            }
            let stream = key.stream();
            let thr = dropout_threshold(p);
            let scale = 1.0f32 / (1.0 - p);
            let (rows, cols) = (rows as u64, cols as u64);
            let f = self.func("dropout_bwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut grad.data)
                .arg(&rows)
                .arg(&cols)
                .arg(&global_ids.data)
                .arg(&stream)
                .arg(&thr)
                .arg(&scale);
            // SAFETY: grad has rows*cols elements, global_ids at least rows.
            unsafe { b.launch(elem_cfg(rows * cols)) }.map_err(|e| dev_err(op, e))?;
            Ok(())
        })
    }

    fn axpy(&self, alpha: f32, x: &CudaBuf, y: &mut CudaBuf, len: usize) -> Result<()> {
        self.timed(OpClass::Other("axpy"), || {
            need("axpy", "x", x.len, len)?;
            need("axpy", "y", y.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("axpy_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data).arg(&mut y.data).arg(&n).arg(&alpha);
            // SAFETY: both buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("axpy", e))?;
            Ok(())
        })
    }

    fn scale(&self, x: &mut CudaBuf, alpha: f32, len: usize) -> Result<()> {
        self.timed(OpClass::Other("scale"), || {
            need("scale", "x", x.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("scale_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut x.data).arg(&n).arg(&alpha);
            // SAFETY: x has at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("scale", e))?;
            Ok(())
        })
    }

    fn layer_norm(
        &self,
        x: &CudaBuf,
        gamma: &CudaBuf,
        beta: &CudaBuf,
        rows: usize,
        cols: usize,
        eps: f32,
        out: &mut CudaBuf,
        mean: &mut CudaBuf,
        rstd: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("layer_norm"), || {
            let op = "layer_norm";
            let n = elems(op, rows, cols)?;
            need(op, "x", x.len, n)?;
            need(op, "out", out.len, n)?;
            need(op, "gamma", gamma.len, cols)?;
            need(op, "beta", beta.len, cols)?;
            need(op, "mean", mean.len, rows)?;
            need(op, "rstd", rstd.len, rows)?;
            if n == 0 {
                return Ok(());
            }
            let (rows, cols) = (rows as u64, cols as u64);
            let cfg = warp_rows_cfg(op, rows)?;
            let f = self.func("layer_norm_fwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data)
                .arg(&gamma.data)
                .arg(&beta.data)
                .arg(&rows)
                .arg(&cols)
                .arg(&eps)
                .arg(&mut out.data)
                .arg(&mut mean.data)
                .arg(&mut rstd.data);
            // SAFETY: sizes checked above.
            unsafe { b.launch(cfg) }.map_err(|e| dev_err(op, e))?;
            Ok(())
        })
    }

    fn layer_norm_backward(
        &self,
        grad_out: &CudaBuf,
        x: &CudaBuf,
        gamma: &CudaBuf,
        mean: &CudaBuf,
        rstd: &CudaBuf,
        rows: usize,
        cols: usize,
        grad_x: &mut CudaBuf,
        grad_gamma: &mut CudaBuf,
        grad_beta: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("layer_norm_backward"), || {
            let op = "layer_norm_backward";
            let n = elems(op, rows, cols)?;
            need(op, "grad_out", grad_out.len, n)?;
            need(op, "x", x.len, n)?;
            need(op, "grad_x", grad_x.len, n)?;
            need(op, "gamma", gamma.len, cols)?;
            need(op, "grad_gamma", grad_gamma.len, cols)?;
            need(op, "grad_beta", grad_beta.len, cols)?;
            need(op, "mean", mean.len, rows)?;
            need(op, "rstd", rstd.len, rows)?;
            if cols == 0 {
                return Ok(());
            }
            let (rows64, cols64) = (rows as u64, cols as u64);
            let n_chunks = rows64.div_ceil(kernels::RED_CHUNK);
            let mut part =
                self.zeros::<f64>("LayerNorm partial sums", (n_chunks * 2 * cols64) as usize)?;
            if rows > 0 {
                let cfg = warp_rows_cfg(op, rows64)?;
                let f = self.func("layer_norm_bwd_x")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&grad_out.data)
                    .arg(&x.data)
                    .arg(&gamma.data)
                    .arg(&mean.data)
                    .arg(&rstd.data)
                    .arg(&rows64)
                    .arg(&cols64)
                    .arg(&mut grad_x.data);
                // SAFETY: sizes checked above.
                unsafe { b.launch(cfg) }.map_err(|e| dev_err(op, e))?;

                let chunk = kernels::RED_CHUNK;
                let f = self.func("layer_norm_param_partials")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&grad_out.data)
                    .arg(&x.data)
                    .arg(&mean.data)
                    .arg(&rstd.data)
                    .arg(&rows64)
                    .arg(&cols64)
                    .arg(&chunk)
                    .arg(&n_chunks)
                    .arg(&mut part);
                // SAFETY: part has n_chunks * 2 * cols elements.
                unsafe { b.launch(col_chunks_cfg(cols64, n_chunks)) }
                    .map_err(|e| dev_err(op, e))?;
            }
            let stride = 2 * cols64;
            self.finish_partials(op, &part, n_chunks, stride, 0, cols64, 1.0, grad_gamma)?;
            self.finish_partials(op, &part, n_chunks, stride, cols64, cols64, 1.0, grad_beta)
        })
    }

    fn cross_entropy(
        &self,
        logits: &CudaBuf,
        n: usize,
        classes: usize,
        rows: &CudaIndex,
        labels: &CudaIndex,
        normalizer: f32,
        grad: &mut CudaBuf,
    ) -> Result<f64> {
        self.timed(OpClass::Other("cross_entropy"), || {
            let op = "cross_entropy";
            let total = elems(op, n, classes)?;
            need(op, "logits", logits.len, total)?;
            need(op, "grad", grad.len, total)?;
            if rows.host.len() != labels.host.len() {
                return Err(shape_err(
                    op,
                    format!("{} rows but {} labels", rows.host.len(), labels.host.len()),
                ));
            }
            check_index_range(op, "row", rows, n)?;
            if let Some(l) = labels.max {
                if l as usize >= classes {
                    return Err(shape_err(
                        op,
                        format!("label {l} out of range ({classes} classes)"),
                    ));
                }
            }
            if normalizer.is_nan() || normalizer <= 0.0 {
                return Err(shape_err(
                    op,
                    format!("normalizer must be positive, got {normalizer}"),
                ));
            }
            if total > 0 {
                let mut view = grad.data.slice_mut(0..total);
                self.stream
                    .memset_zeros(&mut view)
                    .map_err(|e| dev_err(op, e))?;
            }
            let n_sel = rows.host.len();
            if n_sel == 0 {
                self.sync(op)?;
                return Ok(0.0);
            }
            let mut terms = self.zeros::<f64>("per-row loss terms", n_sel)?;
            let inv = 1.0f32 / normalizer;
            let (classes64, n_sel64) = (classes as u64, n_sel as u64);
            let cfg = warp_rows_cfg(op, n_sel64)?;
            let f = self.func("xent_rows")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&logits.data)
                .arg(&classes64)
                .arg(&rows.data)
                .arg(&labels.data)
                .arg(&n_sel64)
                .arg(&inv)
                .arg(&mut grad.data)
                .arg(&mut terms);
            // SAFETY: rows < n and labels < classes (checked above); terms has n_sel entries.
            unsafe { b.launch(cfg) }.map_err(|e| dev_err(op, e))?;
            // Loss terms are added on the host in row order, as the CPU backend does.
            self.ordered_host_sum(op, &terms, n_sel)
        })
    }

    fn sum_squares(&self, x: &CudaBuf, len: usize) -> Result<f64> {
        self.timed(OpClass::Other("sum_squares"), || {
            need("sum_squares", "x", x.len, len)?;
            let n = len as u64;
            let n_chunks = n.div_ceil(kernels::ELEM_CHUNK);
            if n_chunks == 0 {
                self.sync("sum_squares")?;
                return Ok(0.0);
            }
            let mut part = self.zeros::<f64>("sum_squares partials", n_chunks as usize)?;
            let chunk = kernels::ELEM_CHUNK;
            let cfg = sumsq_cfg(n_chunks);
            let f = self.func("sumsq_partials")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data)
                .arg(&n)
                .arg(&chunk)
                .arg(&n_chunks)
                .arg(&mut part);
            // SAFETY: x has n elements, part n_chunks.
            unsafe { b.launch(cfg) }.map_err(|e| dev_err("sum_squares", e))?;
            self.ordered_host_sum("sum_squares", &part, n_chunks as usize)
        })
    }

    fn adam_step(
        &self,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        len: usize,
        s: &AdamStep,
    ) -> Result<()> {
        self.timed(OpClass::Other("adam_step"), || {
            for (what, have) in [
                ("param", param.len),
                ("grad", grad.len),
                ("m", m.len),
                ("v", v.len),
            ] {
                need("adam_step", what, have, len)?;
            }
            if s.step == 0 {
                return Err(shape_err("adam_step", "step counter must start at 1"));
            }
            if len == 0 {
                return Ok(());
            }
            let (bc1, bc2) = adam_bias_corrections(s);
            let decoupled = s.decoupled as i32;
            let n = len as u64;
            let f = self.func("adam_step")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut param.data)
                .arg(&grad.data)
                .arg(&mut m.data)
                .arg(&mut v.data)
                .arg(&n)
                .arg(&s.lr)
                .arg(&s.beta1)
                .arg(&s.beta2)
                .arg(&s.eps)
                .arg(&s.weight_decay)
                .arg(&decoupled)
                .arg(&s.grad_scale)
                .arg(&bc1)
                .arg(&bc2);
            // SAFETY: all four buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("adam_step", e))?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_are_all_defined_in_the_source() {
        for name in kernels::NAMES {
            let decl = format!("__global__ void {name}(");
            assert!(
                kernels::SOURCE.contains(&decl),
                "kernel {name} listed in NAMES but not defined in SOURCE"
            );
        }
        let defined = kernels::SOURCE.matches("__global__ void").count();
        assert_eq!(
            defined,
            kernels::NAMES.len(),
            "every kernel must be listed in NAMES"
        );
    }

    #[test]
    fn new_without_driver_is_a_clean_error() {
        if driver_library_present() {
            eprintln!("skipping: a CUDA driver is present on this machine");
            return;
        }
        let err = match CudaBackend::new(0) {
            Ok(_) => panic!("CudaBackend::new succeeded without a driver library"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("CUDA driver library not found") && err.contains("cuda:0"),
            "unexpected error: {err}"
        );
        let err = device_count().unwrap_err().to_string();
        assert!(err.contains("CUDA driver library not found"), "{err}");
    }

    #[test]
    fn guarded_turns_panics_into_errors() {
        let r: Result<()> = guarded("probe", || panic!("symbol cuFoo not found"));
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("probe") && msg.contains("cuFoo"), "{msg}");
    }
}
