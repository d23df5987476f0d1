//! Where a step's time goes: each backend can time its operations by class (aggregation,
//! GEMM, everything else by name) for `grandis bench train`. The CPU backend always keeps
//! wall-clock timers; the CUDA backend records CUDA events around each operation only while
//! [`OpProfile::set_op_timing`] is on, and sums them (which waits for the device) when read.

/// Time spent per operation class since the last [`OpProfile::reset_op_times`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTimes {
    pub aggregate_s: f64,
    pub gemm_s: f64,
    pub other_s: f64,
    /// Bytes the aggregation kernels gathered (source rows read, with repetition, and their
    /// ids) plus wrote: what an aggregation must move at least once.
    pub aggregate_bytes: u64,
}

/// The class an operation is timed under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpClass {
    Aggregate,
    Gemm,
    Other(&'static str),
}

/// Bytes one CSR aggregation over `edges` edges into `rows` rows of width `d` moves: each
/// edge reads a source row and its id, each output row is written once.
pub fn aggregate_bytes(edges: usize, rows: usize, d: usize) -> u64 {
    (edges * (d * 4 + 4) + rows * d * 4) as u64
}

/// Per-operation timers of a backend.
pub trait OpProfile {
    /// Turns timing on or off (a no-op where it is always on).
    fn set_op_timing(&self, on: bool);
    fn reset_op_times(&self);
    /// Totals since the last reset (the CUDA backend waits for its stream first).
    fn op_times(&self) -> OpTimes;
    /// Seconds per operation name of the "other" class, largest first.
    fn other_op_times(&self) -> Vec<(&'static str, f64)>;
}
