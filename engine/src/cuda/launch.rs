//! Launch shapes: the grid and block of each kind of kernel, within the hardware's limits.

use cudarc::driver::LaunchConfig;

use crate::error::{shape_err, Result};

/// Threads per block of the element-wise kernels.
pub(super) const ELEM_THREADS: u32 = 256;

/// Upper bound on the grid of grid-stride kernels (each thread loops over the rest).
pub(super) const MAX_BLOCKS: u64 = 1 << 20;

/// Upper bound on `gridDim.y` (a hardware limit is 65535).
pub(super) const MAX_GRID_Y: u64 = 65_535;

pub(super) fn elem_cfg(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(ELEM_THREADS as u64).clamp(1, MAX_BLOCKS);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (ELEM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row, 8 warps per block.
pub(super) fn warp_rows_cfg(op: &'static str, rows: u64) -> Result<LaunchConfig> {
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
pub(super) fn col_chunks_cfg(cols: u64, n_chunks: u64) -> LaunchConfig {
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
pub(super) fn csr_cfg(op: &'static str, n_rows: usize, d: usize) -> Result<LaunchConfig> {
    let (bx, by) = row_threads(d);
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

/// Threads per row (up to 128 over `d` columns, a power of two for narrow rows) and rows per
/// block (256 threads in all).
fn row_threads(d: usize) -> (u32, u32) {
    let bx: u32 = if d >= 32 {
        (d.div_ceil(32) * 32).min(128) as u32
    } else {
        (d.max(1) as u32).next_power_of_two()
    };
    (bx, (256 / bx).max(1))
}

/// Launch shape of the row-wise kernels (`ROW_STRIDE` in the source: add_bias, dropout,
/// gather and scatter of rows): [`csr_cfg`]'s threads per row and rows per block, the grid
/// capped at [`MAX_BLOCKS`] (each block strides over the rest).
pub(super) fn rows_cfg(rows: u64, cols: u64) -> LaunchConfig {
    let (bx, by) = row_threads(cols as usize);
    LaunchConfig {
        grid_dim: (rows.div_ceil(by as u64).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (bx, by, 1),
        shared_mem_bytes: 0,
    }
}

/// The aggregation kernel for `d` columns and its launch shape: `csr_aggregate4` (a float4
/// per thread) when `d` is a multiple of 4, else `csr_aggregate`; the same sums either way.
pub(super) fn csr_kernel(
    op: &'static str,
    n_rows: usize,
    d: usize,
) -> Result<(&'static str, LaunchConfig)> {
    Ok(if d.is_multiple_of(4) {
        ("csr_aggregate4", csr_cfg(op, n_rows, d / 4)?)
    } else {
        ("csr_aggregate", csr_cfg(op, n_rows, d)?)
    })
}

/// `sumsq_partials`: one block of 256 threads per chunk (grid-stride beyond the cap).
pub(super) fn sumsq_cfg(n_chunks: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n_chunks.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
