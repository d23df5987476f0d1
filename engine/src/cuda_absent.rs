//! The `cuda` module of a build without the `cuda` feature: the names of the real one
//! (`cuda/mod.rs`), so the CLI and the runtimes hold one code path and no `cfg` of their own.
//! Nothing here can be made: opening a backend, a pinned allocator or an NCCL communicator,
//! counting or describing devices are errors saying the build has no CUDA
//! ([`crate::error::NOT_BUILT_WITH_CUDA`]), and no value of its types can be made, so code
//! written for them compiles and never runs.

use crate::block::{BlockGraph, ScaledCsr};
use crate::error::{EngineError, Result, NOT_BUILT_WITH_CUDA};
use crate::host::{HostAllocator, HostBuffer};
use crate::kernels::Kernels;
use crate::profile::{OpProfile, OpTimes};

/// The error of every CUDA entry point of this build.
fn not_built() -> EngineError {
    EngineError::Device {
        backend: "cuda",
        message: NOT_BUILT_WITH_CUDA.to_string(),
    }
}

/// Whether `libcuda` can be opened: never, in a build without CUDA.
pub fn driver_library_present() -> bool {
    false
}

pub fn device_count() -> Result<usize> {
    Err(not_built())
}

pub fn device_memory(_ordinal: usize) -> Result<(u64, u64)> {
    Err(not_built())
}

pub fn describe_device(_ordinal: usize) -> Result<String> {
    Err(not_built())
}

/// No CUDA device to test on.
pub fn device_for_tests() -> Option<CudaBackend> {
    None
}

/// No value: what the types below hold, so none of them can be made. Private, so code outside
/// the engine sees ordinary types (the compiler's unreachable-code lints would otherwise fire
/// on every caller that opens a backend and goes on using it).
enum Never {}

/// A CUDA backend: none can exist in this build.
pub struct CudaBackend(Never);
/// A device buffer: none can exist in this build.
pub struct CudaBuf(Never);
/// A device index: none can exist in this build.
pub struct CudaIndex(Never);
/// An uploaded graph: none can exist in this build.
pub struct CudaGraph(Never);

impl CudaBackend {
    pub fn new(_ordinal: usize) -> Result<CudaBackend> {
        Err(not_built())
    }

    pub fn ordinal(&self) -> usize {
        match self.0 {}
    }

    pub fn device_name(&self) -> &str {
        match self.0 {}
    }
}

/// Page-locked host memory: none can be had in this build.
pub struct PinnedAllocator(Never);

impl PinnedAllocator {
    pub fn new(_ordinal: usize) -> Result<PinnedAllocator> {
        Err(not_built())
    }
}

impl HostAllocator for PinnedAllocator {
    fn alloc(&self, _len: usize) -> Result<HostBuffer> {
        match self.0 {}
    }
}

/// NCCL: no communicator can be joined in this build.
pub mod nccl {
    use std::ops::Range;
    use std::time::Duration;

    use super::{not_built, CudaBackend, CudaBuf, Never};
    use crate::error::Result;

    pub const NCCL_ID_BYTES: usize = 128;

    pub fn nccl_present() -> bool {
        false
    }

    pub fn nccl_unique_id() -> Result<Vec<u8>> {
        Err(not_built())
    }

    pub fn nccl_group_start() -> Result<()> {
        Err(not_built())
    }

    pub fn nccl_group_end() -> Result<()> {
        Err(not_built())
    }

    /// A communicator member: none can exist in this build.
    pub struct NcclComm(Never);

    impl NcclComm {
        pub fn join(
            backend: &CudaBackend,
            _id: &[u8],
            _rank: usize,
            _size: usize,
            _timeout: Duration,
        ) -> Result<NcclComm> {
            match backend.0 {}
        }
        pub fn send(&mut self, _: &CudaBuf, _: Range<usize>, _: usize) -> Result<()> {
            match self.0 {}
        }
        pub fn recv(&mut self, _: &mut CudaBuf, _: usize, _: usize) -> Result<()> {
            match self.0 {}
        }
        pub fn reduce(&mut self, _: &mut CudaBuf, _: usize, _: usize) -> Result<()> {
            match self.0 {}
        }
        pub fn broadcast(&mut self, _: &mut CudaBuf, _: usize, _: usize) -> Result<()> {
            match self.0 {}
        }
        pub fn all_reduce(&mut self, _: &mut CudaBuf, _: usize) -> Result<()> {
            match self.0 {}
        }
        pub fn wait(&mut self) -> Result<()> {
            match self.0 {}
        }
    }
}

impl OpProfile for CudaBackend {
    fn set_op_timing(&self, _on: bool) {
        match self.0 {}
    }
    fn op_times(&self) -> OpTimes {
        match self.0 {}
    }
    fn other_op_times(&self) -> Vec<(&'static str, f64)> {
        match self.0 {}
    }
    fn reset_op_times(&self) {
        match self.0 {}
    }
}

/// Implements the listed kernels of a backend that cannot exist: each body matches on the
/// value none can make.
macro_rules! uncallable {
    ($($(#[$a:meta])* fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty;)*) => {
        $(
            fn $name(&self $(, _: $ty)*) -> $ret {
                match self.0 {}
            }
        )*
    };
}

/// Every kernel of a backend that cannot exist.
impl Kernels for CudaBackend {
    type Buf = CudaBuf;
    type Index = CudaIndex;
    type Graph = CudaGraph;

    fn name(&self) -> String {
        match self.0 {}
    }
    fn alloc(&self, _: usize) -> Result<CudaBuf> {
        match self.0 {}
    }
    fn upload(&self, _: &[f32]) -> Result<CudaBuf> {
        match self.0 {}
    }
    fn upload_index(&self, _: &[u32]) -> Result<CudaIndex> {
        match self.0 {}
    }
    fn upload_block(&self, _: &BlockGraph, _: &ScaledCsr) -> Result<CudaGraph> {
        match self.0 {}
    }

    crate::kernel_list!(uncallable);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_says_the_build_has_no_cuda() {
        let says = |e: EngineError| {
            let text = e.to_string();
            assert!(text.contains("built without CUDA"), "{text}");
        };
        says(CudaBackend::new(0).err().unwrap());
        says(PinnedAllocator::new(0).err().unwrap());
        says(device_count().unwrap_err());
        says(describe_device(0).unwrap_err());
        says(device_memory(0).unwrap_err());
        says(nccl::nccl_unique_id().unwrap_err());
        assert!(!driver_library_present() && !nccl::nccl_present());
        assert!(device_for_tests().is_none());
    }
}
