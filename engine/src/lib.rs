//! Compute engine of grandis: the [`backend::Backend`] trait (dense GEMM, block CSR
//! aggregation with explicit global normalisation, element-wise ops, LayerNorm, dropout with
//! counter-based masks, cross-entropy over a row subset, Adam/AdamW), its reference CPU
//! implementation ([`cpu::CpuBackend`], rayon + `matrixmultiply`), helpers that build the
//! normalisation vectors of a whole graph ([`norm`]), and, behind the `cuda` feature, the CUDA
//! backend (without it, [`cuda`] holds the same names, each an error saying so, so callers
//! need no `cfg`). Every operation has a hand-derived backward that the tests check against
//! finite differences; the design goal is that any partitioning of a graph over devices
//! reproduces the single-process numbers exactly (see the `backend` module doc).
//!
//! Modules, bottom up: `error` (the error type, shared checks), `block` (graph blocks on the
//! host), `args` (dropout keys, attention and Adam parameters), `host` (host buffers),
//! `kernels` (what a backend implements), `backend` (the checked operations every backend
//! gets), then the backends `cpu` and `cuda`, and `norm` / `profile` beside them.

pub mod args;
pub mod backend;
pub mod block;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
/// Without the `cuda` feature: the same names, each constructor an error saying so.
#[cfg(not(feature = "cuda"))]
#[path = "cuda_absent.rs"]
pub mod cuda;
pub mod error;
pub mod host;
pub mod kernels;
pub mod norm;
pub mod profile;

pub use args::{
    attention_keep, attention_row_stream, dropout_keep, dropout_threshold, mix64, AdamStep,
    Attention, AttentionDropout, DropoutKey,
};
pub use backend::Backend;
pub use block::{BlockGraph, PreparedGraph, ScaledCsr};
pub use cpu::CpuBackend;
pub use error::{shape_err, EngineError, Result, NOT_BUILT_WITH_CUDA};
pub use host::{HostAllocator, HostBuffer, PlainAllocator};
pub use kernels::{GemmShape, Kernels};
pub use profile::{OpClass, OpProfile, OpTimes};
