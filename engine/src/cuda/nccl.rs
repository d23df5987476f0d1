//! NCCL communicators whose operations run on a [`CudaBackend`]'s stream, on its buffers.
//!
//! Written on cudarc's raw bindings rather than its `Comm`: that one panics when an abort
//! fails and hides the handle that [`NcclComm::wait`]'s watchdog needs. Every operation is
//! queued on the backend's stream (so it is ordered with the kernels around it); `wait` polls
//! the stream and the communicator's asynchronous error, and aborts the communicator when a
//! peer fails or the timeout passes, so a lost peer is an error, not a hang. The library is
//! loaded at run time (`libnccl.so.2`, e.g. from the `nvidia-nccl-cu13` wheel on
//! `LD_LIBRARY_PATH`); its absence is an error that says so.

use std::ffi::{c_int, c_void, CStr};
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use cudarc::nccl::{result, sys};

use super::{dev_err, CudaBackend, CudaBuf, BACKEND};
use crate::error::{EngineError, Result};

type NcclResult = std::result::Result<result::NcclStatus, result::NcclError>;
const F32: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
const SUM: sys::ncclRedOp_t = sys::ncclRedOp_t::ncclSum;

/// Bytes of an NCCL unique id.
pub const NCCL_ID_BYTES: usize = 128;

/// Whether the NCCL library can be loaded.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { sys::is_culib_present() }
}

fn need_nccl() -> Result<()> {
    if nccl_present() {
        return Ok(());
    }
    Err(EngineError::Device {
        backend: BACKEND,
        message: "NCCL library (libnccl.so.2) not found: CUDA ranks on distinct GPUs exchange \
                  over NCCL; install it (e.g. the nvidia-nccl-cu13 wheel) and put its lib \
                  directory on LD_LIBRARY_PATH"
            .into(),
    })
}

fn nccl_err(what: impl std::fmt::Display, code: sys::ncclResult_t) -> EngineError {
    // SAFETY: ncclGetErrorString returns a static C string for every code.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(code)) };
    dev_err(format!("NCCL {what}"), text.to_string_lossy())
}

fn check(what: &str, r: NcclResult) -> Result<()> {
    r.map(|_| ()).map_err(|e| nccl_err(what, e.0))
}

/// A new communicator id (`ncclGetUniqueId`), to be sent to every member.
pub fn nccl_unique_id() -> Result<Vec<u8>> {
    need_nccl()?;
    let id = result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e.0))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// `ncclGroupStart` (per thread: the rank's).
pub fn nccl_group_start() -> Result<()> {
    check("ncclGroupStart", result::group_start())
}

/// `ncclGroupEnd`.
pub fn nccl_group_end() -> Result<()> {
    check("ncclGroupEnd", result::group_end())
}

/// One member of an NCCL communicator, bound to a backend's device and stream.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    timeout: Duration,
}

// SAFETY: the handle is only used through `&mut self` (one thread at a time); NCCL allows a
// communicator to move between threads between calls.
unsafe impl Send for NcclComm {}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.abort();
    }
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `size` on `backend`'s device and stream
    /// (`ncclCommInitRank`: returns once every member has joined). `timeout` bounds every
    /// later [`Self::wait`].
    pub fn join(
        backend: &CudaBackend,
        id: &[u8],
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<NcclComm> {
        need_nccl()?;
        if id.len() != NCCL_ID_BYTES {
            return Err(dev_err(
                "NCCL communicator id",
                format!("{} bytes, expected {NCCL_ID_BYTES}", id.len()),
            ));
        }
        let mut internal = [0 as std::ffi::c_char; NCCL_ID_BYTES];
        for (c, &b) in internal.iter_mut().zip(id) {
            *c = b as std::ffi::c_char;
        }
        let ctx = backend.context().clone();
        ctx.bind_to_thread()
            .map_err(|e| dev_err("binding the device for NCCL", e))?;
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL before it is read; the id is a full unique id.
        let comm = unsafe {
            check(
                "ncclCommInitRank",
                result::comm_init_rank(
                    comm.as_mut_ptr(),
                    size as c_int,
                    sys::ncclUniqueId { internal },
                    rank as c_int,
                ),
            )?;
            comm.assume_init()
        };
        Ok(NcclComm {
            comm,
            ctx,
            stream: backend.stream().clone(),
            timeout,
        })
    }

    fn live(&self, what: &str) -> Result<sys::ncclComm_t> {
        if self.comm.is_null() {
            return Err(dev_err(
                format!("NCCL {what}"),
                "the communicator was aborted after an earlier failure",
            ));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("binding the device for NCCL", e))?;
        Ok(self.comm)
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    fn ptr(&self, buf: &CudaBuf, at: usize) -> *mut c_void {
        let (base, _sync) = buf.slice().device_ptr(&self.stream);
        (base + at as u64 * 4) as *mut c_void
    }

    fn span(what: &str, buf: &CudaBuf, end: usize) -> Result<()> {
        if end > buf.len {
            return Err(dev_err(
                format!("NCCL {what}"),
                format!("{end} values of a buffer of {}", buf.len),
            ));
        }
        Ok(())
    }

    /// Checks that `buf` holds `end` values and queues `call` (given the device address of
    /// `buf[at]`, the communicator and the stream) on the backend's stream.
    ///
    /// SAFETY (for the callers' `unsafe` calls): the address range lies inside the buffer, which
    /// outlives the queued operation (the transports wait before they drop it), and in-place
    /// collectives are allowed by NCCL.
    fn enqueue(
        &mut self,
        what: &str,
        buf: &CudaBuf,
        at: usize,
        end: usize,
        call: impl FnOnce(*mut c_void, sys::ncclComm_t, sys::cudaStream_t) -> NcclResult,
    ) -> Result<()> {
        Self::span(what, buf, end)?;
        let comm = self.live(what)?;
        let ptr = self.ptr(buf, at);
        check(what, call(ptr, comm, self.cu_stream()))
    }

    /// `ncclSend` of `buf[range]` to `peer`.
    pub fn send(&mut self, buf: &CudaBuf, range: Range<usize>, peer: usize) -> Result<()> {
        let n = range.len();
        self.enqueue(
            "ncclSend",
            buf,
            range.start,
            range.end,
            |p, comm, stream| {
                // SAFETY: see `enqueue`.
                unsafe { result::send(p, n, F32, peer as c_int, comm, stream) }
            },
        )
    }

    /// `ncclRecv` of `len` values from `peer` into `buf[..len]`.
    pub fn recv(&mut self, buf: &mut CudaBuf, len: usize, peer: usize) -> Result<()> {
        self.enqueue("ncclRecv", buf, 0, len, |p, comm, stream| {
            // SAFETY: see `enqueue`.
            unsafe { result::recv(p, len, F32, peer as c_int, comm, stream) }
        })
    }

    /// In-place `ncclReduce` (sum) of `buf[..len]` to `root`.
    pub fn reduce(&mut self, buf: &mut CudaBuf, len: usize, root: usize) -> Result<()> {
        self.enqueue("ncclReduce", buf, 0, len, |p, comm, stream| {
            // SAFETY: see `enqueue`.
            unsafe { result::reduce(p, p, len, F32, SUM, root as c_int, comm, stream) }
        })
    }

    /// In-place `ncclBroadcast` of `root`'s `buf[..len]`.
    pub fn broadcast(&mut self, buf: &mut CudaBuf, len: usize, root: usize) -> Result<()> {
        self.enqueue("ncclBroadcast", buf, 0, len, |p, comm, stream| {
            // SAFETY: see `enqueue`.
            unsafe { result::broadcast(p, p, len, F32, root as c_int, comm, stream) }
        })
    }

    /// In-place `ncclAllReduce` (sum) of `buf[..len]`.
    pub fn all_reduce(&mut self, buf: &mut CudaBuf, len: usize) -> Result<()> {
        self.enqueue("ncclAllReduce", buf, 0, len, |p, comm, stream| {
            // SAFETY: see `enqueue`.
            unsafe { result::all_reduce(p, p, len, F32, SUM, comm, stream) }
        })
    }

    /// Waits until everything queued on the stream has finished. A communicator that reports
    /// an error, or work that has not finished within the timeout (a peer that is gone never
    /// sends), aborts the communicator and fails.
    pub fn wait(&mut self) -> Result<()> {
        let comm = self.live("wait")?;
        let start = Instant::now();
        let mut pause = Duration::from_micros(5);
        loop {
            // SAFETY: the stream is alive (held by `self`).
            let state = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
            match state {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(dev_err("waiting for NCCL", format!("{e:?}"))),
            }
            let mut failed = sys::ncclResult_t::ncclSuccess;
            // SAFETY: the communicator is live; `failed` is written by NCCL.
            unsafe { sys::ncclCommGetAsyncError(comm, &mut failed) };
            if !matches!(
                failed,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            ) {
                self.abort();
                return Err(nccl_err("communicator failed (a peer is gone?)", failed));
            }
            if start.elapsed() > self.timeout {
                self.abort();
                return Err(dev_err(
                    "NCCL",
                    format!(
                        "an operation did not finish within {:?}: a peer is gone or stalled; \
                         the communicator was aborted",
                        self.timeout
                    ),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Aborts the communicator (idempotent): its pending operations end.
    fn abort(&mut self) {
        if self.comm.is_null() {
            return;
        }
        // SAFETY: the handle is live and dropped from here on.
        let _ = unsafe { result::comm_abort(self.comm) };
        self.comm = std::ptr::null_mut();
    }
}
