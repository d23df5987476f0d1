//! Errors of plan building; each names the input and what is wrong with it.

/// Everything that can go wrong while building plans.
#[derive(Debug, thiserror::Error)]
pub enum MaskingError {
    #[error("invalid layout: {0}")]
    Layout(String),
    #[error("the graph has {graph} vertices but the layout's ranges cover {layout}")]
    VertexCountMismatch { graph: usize, layout: u64 },
    #[error(
        "{split} split: vertex id {id} is out of range (the graph has {num_vertices} vertices)"
    )]
    SplitOutOfRange {
        split: &'static str,
        id: u32,
        num_vertices: usize,
    },
    #[error("k = {k} preloaded hops is invalid: {reason}")]
    InvalidK { k: usize, reason: String },
    #[error("invalid extraction spec: {0}")]
    Spec(String),
    #[error("invalid model dimensions: {0}")]
    Dims(String),
    #[error(
        "memory budget of {budget} bytes is too small even for plain FB (k = 0): \
         device rank {rank} needs {needed} bytes"
    )]
    BudgetTooSmall {
        budget: u64,
        needed: u64,
        rank: usize,
    },
    /// A broken invariant of the builder itself, never the caller's input.
    #[error("internal plan inconsistency: {0}")]
    Internal(String),
}

pub type Result<T, E = MaskingError> = std::result::Result<T, E>;
