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
//!
//! The backend by job, lowest first: `driver` (is there a driver, which devices, a device's
//! context and memory, the kernels compiled once), `launch` (grid and block of each kind of
//! kernel), `pinned` (page-locked host rows), this module (the buffer, index and graph types,
//! opening a backend, uploading graphs, the launch helpers the operations share) and `ops`
//! (the [`Kernels`](crate::Kernels): the launches, on arguments `Backend` has checked);
//! `kernels` holds the CUDA C source, `nccl` the collectives.

mod driver;
#[cfg(all(test, target_os = "linux"))]
mod emulated;
pub mod kernels;
mod launch;
pub mod nccl;
mod ops;
mod pinned;

pub use driver::{describe_device, device_count, device_memory, driver_library_present};
pub use pinned::{PinnedAllocator, PinnedRows};

use driver::*;
use launch::*;

use crate::args::Attention;
use crate::error::{shape_err, EngineError, Result};
use crate::profile::{aggregate_bytes, OpClass, OpProfile, OpTimes};
use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DeviceRepr, PushKernelArg,
    ValidAsZeroBits,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

// SAFETY: the memory is owned by `mem` (which is Send + Sync) and `ptr` only points into it;
// shared access hands out `&[f32]`, exclusive access `&mut [f32]`, as a `Vec` would.
unsafe impl Send for PinnedRows {}
unsafe impl Sync for PinnedRows {}

/// A device `f32` buffer. Holds at least one element on the device (CUDA has no zero-byte
/// allocations); [`Kernels::len`](crate::Kernels::len) reports the logical length.
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

/// The attention kernels' shared arguments, in their order: `heads, f, concat, slope,
/// has_drop, ids, stream, thr, scale`.
struct AttnArgs<'a> {
    heads: u64,
    head_dim: u64,
    concat: i32,
    slope: f32,
    self_loops: i32,
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
            self_loops: att.self_loops as i32,
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
            .arg(&self.self_loops)
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
        // No columns never reaches here: `Backend` returns before the kernel for `d == 0`.
        if g.n_rows == 0 {
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
        let (kernel, cfg) = csr_kernel(op, g.n_rows, d)?;
        let (has_src, has_self) = (g.src.is_some() as i32, g.self_.is_some() as i32);
        // Absent scale vectors are never read (flag 0); any valid pointer stands in.
        let src = g.src.as_ref().unwrap_or(&g.dst);
        let slf = g.self_.as_ref().unwrap_or(&g.dst);
        let (n_rows, d64) = (g.n_rows as u64, d as u64);
        let f = self.func(kernel)?;
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
