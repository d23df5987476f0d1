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
    let bx: u32 = if d >= 32 {
        (d.div_ceil(32) * 32).min(128) as u32
    } else {
        (d as u32).next_power_of_two()
    };
    let by = (256 / bx).max(1);
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

/// `sumsq_partials`: one block of 256 threads per chunk (grid-stride beyond the cap).
pub(super) fn sumsq_cfg(n_chunks: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n_chunks.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
