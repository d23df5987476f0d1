//! Compute engine of grandis: the [`backend::Backend`] trait (dense GEMM, block CSR
//! aggregation with explicit global normalisation, element-wise ops, LayerNorm, dropout with
//! counter-based masks, cross-entropy over a row subset, Adam/AdamW), its reference CPU
//! implementation ([`cpu::CpuBackend`], rayon + `matrixmultiply`), helpers that build the
//! normalisation vectors of a whole graph ([`norm`]), and, behind the `cuda` feature, the CUDA
//! backend. Every operation has a hand-derived backward that the tests check against finite
//! differences; the design goal is that any partitioning of a graph over devices reproduces
//! the single-process numbers exactly (see the `backend` module doc).

pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
pub mod norm;
pub mod profile;

pub use backend::{
    attention_keep, dropout_keep, dropout_threshold, AdamStep, Attention, AttentionDropout,
    Backend, BlockGraph, DropoutKey, EngineError, PreparedGraph, Result,
};
pub use cpu::CpuBackend;
pub use host::{HostAllocator, HostBuffer, PlainAllocator};
pub use profile::{OpClass, OpProfile, OpTimes};
