//! Page-locked host memory for the rows a step uploads ([`crate::host`]).

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::driver::{
    check_ordinal, context, dev_err, driver_library_present, guarded, no_driver_error,
};
use crate::error::Result;

/// Page-locked host memory of `f32` (see [`crate::host`]): portable, so every context of the
/// process copies from it at full speed.
#[derive(Debug)]
pub struct PinnedRows {
    mem: cudarc::driver::PinnedHostSlice<f32>,
    /// `mem`'s pointer, read once: the slice's own accessors wait on an event first.
    ptr: *mut f32,
}

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
    /// Fails (with the message [`CudaBackend::new`](super::CudaBackend::new) would give) where there is no driver or no
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
