//! The engine's error type and the argument checks every operation shares.

use thiserror::Error;

/// Errors raised by backends.
#[derive(Debug, Error)]
pub enum EngineError {
    /// Arguments whose sizes do not fit together (names the operation and the sizes).
    #[error("{op}: {message}")]
    Shape { op: &'static str, message: String },
    /// A graph block that is not well-formed (offsets, ids or scale vectors).
    #[error("invalid graph block: {0}")]
    Graph(String),
    /// Anything the device or its driver reported (CUDA errors, out of memory, ...).
    #[error("backend {backend}: {message}")]
    Device {
        backend: &'static str,
        message: String,
    },
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// Helper for shape errors: `Err(shape("gemm", format!(..)))`.
pub fn shape_err(op: &'static str, message: impl Into<String>) -> EngineError {
    EngineError::Shape {
        op,
        message: message.into(),
    }
}

/// Checks that a buffer argument `what` of `op` holds at least `want` elements (buffers may
/// be longer than an operation uses). [`crate::Backend`]'s checks are written with this.
pub(crate) fn need(op: &'static str, what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        Err(shape_err(
            op,
            format!("{what} has {have} elements, needs at least {want}"),
        ))
    } else {
        Ok(())
    }
}

/// `rows * cols` elements, or a shape error naming `op` when the product overflows.
pub(crate) fn elems(op: &'static str, rows: usize, cols: usize) -> Result<usize> {
    rows.checked_mul(cols)
        .ok_or_else(|| shape_err(op, format!("{rows} x {cols} overflows the address space")))
}

/// What every entry point of a build without the `cuda` feature says when asked for CUDA.
pub const NOT_BUILT_WITH_CUDA: &str =
    "this grandis was built without CUDA support; rebuild with `--features cuda`";
