//! Gathering rows of a large row-major `f32` file by positioned reads.
//!
//! Layer-wise inference reads, for every block of vertices, the rows of their neighbours
//! from a feature or embedding file larger than memory. Reading them through a mapping would
//! put every page the gather touches (and, with the kernel's fault-around, up to 64 KiB
//! around it) into the process's resident set until it is released; positioned reads leave
//! the file's pages in the page cache only, so the process holds just the rows it asked
//! for. Ids arrive sorted, so nearby rows are read in one request ([`MAX_GAP_BYTES`]) and a
//! dense gather becomes a sequential scan.
//!
//! Mini-batch training gathers a step's rows the same way, from a reader opened
//! [`RowReader::scattered`]: the kernel reads no ahead of a request, and how far apart rows
//! may be and still share one depends on where the rows are. From the page cache a gap is a
//! wasted copy, so only rows on the same or the next page share a request; from the disk a
//! request is bound by the device's IOPS, and reading a 64 KiB gap costs less than a second
//! request (on our VMs: 12k random 4 KiB reads/s, 775 MB/s sequential). A gather samples
//! which of its pages are cached ([`RESIDENCY_SAMPLE`], `mincore`) and picks the gap: on a
//! 5M-vertex graph whose features did not fit the memory left to them, 64 KiB gaps halved
//! the epoch (12.7 s vs 25.9 s); with every page cached, page gaps were 20 % faster.
//! [`RowReader::prefetch`] asks the kernel to read the next step's pages while this one
//! computes.

use crate::error::{Result, StoreError};
use rayon::prelude::*;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Rows closer than this are read in one request (the gap is read and dropped).
pub const MAX_GAP_BYTES: u64 = 64 << 10;
/// The largest single request.
const MAX_READ_BYTES: u64 = 4 << 20;
/// The unit a gather from the page cache coalesces by.
const PAGE_BYTES: u64 = crate::array::PAGE_BYTES as u64;
/// Threads of the pool that scattered gathers from the disk read on ([`io_pool`]).
const IO_THREADS: usize = 32;

/// The pool scattered gathers read on when their pages are not cached: such a read waits on
/// the device, so a pool sized to the cores keeps too few requests in flight (4 ranks on a
/// 2-core pool had 2), and the device answers more requests per second the more it is given.
/// None if it cannot be started (the gather then reads on the current pool).
fn io_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(IO_THREADS)
            .thread_name(|i| format!("grandis-io-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Rows a scattered gather checks for residency before choosing its gap.
pub const RESIDENCY_SAMPLE: usize = 64;

/// Rows of `cols` `f32` values stored back to back from byte `offset` of a file.
#[derive(Debug)]
pub struct RowReader {
    path: PathBuf,
    file: File,
    offset: u64,
    cols: usize,
    rows: u64,
    /// Which pages are cached ([`RowReader::scattered`] readers).
    residency: Option<Residency>,
}

/// A mapping of a file that is never read, only asked which pages are cached, and what
/// gathers found so far.
#[derive(Debug)]
struct Residency {
    map: memmap2::Mmap,
    /// Pages the gathers sampled, and how many of them were cached.
    sampled: AtomicU64,
    cached: AtomicU64,
}

impl RowReader {
    /// Opens `path` whose `rows x cols` payload starts at byte `offset`; the file must be
    /// exactly that long.
    pub fn open(path: &Path, offset: u64, rows: u64, cols: usize) -> Result<RowReader> {
        let io = |e| StoreError::io(path, e);
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let expected = offset + rows * cols as u64 * 4;
        if len != expected {
            return Err(StoreError::invalid(
                path,
                format!("holds {len} bytes, expected {expected} ({rows} rows of {cols} f32 from byte {offset})"),
            ));
        }
        Ok(RowReader {
            path: path.to_path_buf(),
            file,
            offset,
            cols,
            rows,
            residency: None,
        })
    }

    /// For gathers of a small, scattered fraction of the rows (mini-batch steps): the
    /// kernel is told not to read ahead on this file (readahead on a file that is not cached
    /// reads up to the device's `read_ahead_kb`, 8 MiB on our VMs, per 256-byte row), and each
    /// gather picks its gap by where its rows are (see the module doc). Other readers of the
    /// same file keep their own readahead.
    pub fn scattered(mut self) -> RowReader {
        self.advise(0, 0, libc::POSIX_FADV_RANDOM);
        // SAFETY: the mapping is only passed to mincore, never read, so what the file holds
        // (or a concurrent truncation) cannot reach safe code through it.
        self.residency = unsafe { memmap2::Mmap::map(&self.file) }
            .ok()
            .map(|map| Residency {
                map,
                sampled: AtomicU64::new(0),
                cached: AtomicU64::new(0),
            });
        self
    }

    /// (cached, sampled): of the pages this scattered reader's gathers sampled so far, how
    /// many were in the page cache. What tells whether prefetching lands before the gathers
    /// come (or is evicted first). None for dense readers.
    pub fn cached_pages(&self) -> Option<(u64, u64)> {
        self.residency.as_ref().map(|r| {
            (
                r.cached.load(Ordering::Relaxed),
                r.sampled.load(Ordering::Relaxed),
            )
        })
    }

    /// Asks the kernel to start reading the pages of rows `ids` (ascending) into the page
    /// cache and returns without waiting: what a gather of them soon after then finds
    /// cached. Rows are grouped into requests as a gather would group them. Advice only;
    /// rows past the end are ignored.
    pub fn prefetch(&self, ids: &[u32]) {
        let row_bytes = self.row_bytes();
        let ids: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&v| (v as u64) < self.rows)
            .collect();
        let gap = self.gap_for(&ids, false);
        let mut i = 0;
        while i < ids.len() {
            let j = self.request_end(&ids, i, gap);
            let (first, last) = (ids[i] as u64, ids[j - 1] as u64);
            self.advise(
                self.offset + first * row_bytes,
                (last + 1 - first) * row_bytes,
                libc::POSIX_FADV_WILLNEED,
            );
            i = j;
        }
    }

    /// The widest gap between rows that share a request, for a gather of `ids`: a dense
    /// reader's [`MAX_GAP_BYTES`]; a scattered reader's depends on whether the sampled rows'
    /// pages are in the page cache (nearly all: [`PAGE_BYTES`]); a gather's (`record`) sample
    /// adds to [`RowReader::cached_pages`].
    fn gap_for(&self, ids: &[u32], record: bool) -> u64 {
        let Some(residency) = &self.residency else {
            return MAX_GAP_BYTES;
        };
        let map = &residency.map;
        let row_bytes = self.row_bytes();
        let step = ids.len().div_ceil(RESIDENCY_SAMPLE).max(1);
        let (mut sampled, mut cached) = (0usize, 0usize);
        for &v in ids.iter().step_by(step) {
            let page = (self.offset + v as u64 * row_bytes) / PAGE_BYTES * PAGE_BYTES;
            if page >= map.len() as u64 {
                continue;
            }
            let mut resident = 0u8;
            // SAFETY: the address is a page of our live mapping and the vector has the one
            // byte one page needs; mincore reads page tables, not the mapped memory.
            let ok = unsafe {
                libc::mincore(
                    map.as_ptr().add(page as usize) as *mut libc::c_void,
                    PAGE_BYTES as usize,
                    &mut resident,
                )
            } == 0;
            sampled += 1;
            cached += usize::from(ok && resident & 1 == 1);
        }
        if record {
            residency
                .sampled
                .fetch_add(sampled as u64, Ordering::Relaxed);
            residency.cached.fetch_add(cached as u64, Ordering::Relaxed);
        }
        if cached * 8 >= sampled * 7 {
            PAGE_BYTES
        } else {
            MAX_GAP_BYTES
        }
    }

    /// The end of the request that starts at `ids[i]`: the following rows while each is at
    /// most `gap` bytes past the previous one and the request stays bounded.
    fn request_end(&self, ids: &[u32], i: usize, gap: u64) -> usize {
        let row_bytes = self.row_bytes();
        let first = ids[i] as u64;
        let mut j = i + 1;
        while j < ids.len() {
            let (prev, next) = (ids[j - 1] as u64, ids[j] as u64);
            let close = next >= prev && next.saturating_sub(prev + 1) * row_bytes <= gap;
            if !close || (next + 1 - first) * row_bytes > MAX_READ_BYTES {
                break;
            }
            j += 1;
        }
        j
    }

    fn advise(&self, offset: u64, len: u64, advice: libc::c_int) {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor is ours and open; posix_fadvise reads nothing from memory.
        // Advice only: a kernel that ignores it reads more or later, never wrongly.
        let _ = unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                advice,
            )
        };
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn row_bytes(&self) -> u64 {
        self.cols as u64 * 4
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Copies row `ids[i]` into `out[i * cols..]`. `ids` should be ascending (each maximal
    /// ascending run is coalesced); they are read in parallel on the current rayon pool, or,
    /// for a scattered reader whose rows are not cached, on the I/O pool ([`io_pool`]).
    pub fn gather(&self, ids: &[u32], out: &mut [f32]) -> Result<()> {
        let cols = self.cols;
        assert_eq!(out.len(), ids.len() * cols, "gather output size");
        if cols == 0 || ids.is_empty() {
            return Ok(());
        }
        if let Some(&bad) = ids.iter().find(|&&v| v as u64 >= self.rows) {
            return Err(StoreError::invalid(
                &self.path,
                format!("row {bad} is beyond its {} rows", self.rows),
            ));
        }
        let gap = self.gap_for(ids, true);
        let read = |out: &mut [f32]| {
            let per_task = ids.len().div_ceil(rayon::current_num_threads() * 4).max(64);
            ids.par_chunks(per_task)
                .zip(out.par_chunks_mut(per_task * cols))
                .try_for_each(|(ids, out)| self.gather_run(ids, out, gap))
        };
        // Reads that go to the disk wait on it, not on a core: more of them in flight.
        let from_disk = self.residency.is_some() && gap == MAX_GAP_BYTES;
        match io_pool().filter(|_| from_disk) {
            Some(pool) => pool.install(|| read(out)),
            None => read(out),
        }
    }

    fn gather_run(&self, ids: &[u32], out: &mut [f32], gap: u64) -> Result<()> {
        let row_bytes = self.row_bytes();
        let mut buf: Vec<f32> = Vec::new();
        let mut i = 0;
        while i < ids.len() {
            let j = self.request_end(ids, i, gap);
            let first = ids[i] as u64;
            let last = ids[j - 1] as u64;
            let span = (last - first + 1) as usize * self.cols;
            buf.resize(span, 0.0);
            self.file
                .read_exact_at(
                    bytemuck::cast_slice_mut(&mut buf[..]),
                    self.offset + first * row_bytes,
                )
                .map_err(|e| StoreError::io(&self.path, e))?;
            for (k, &v) in ids[i..j].iter().enumerate() {
                let at = (v as u64 - first) as usize * self.cols;
                out[(i + k) * self.cols..(i + k + 1) * self.cols]
                    .copy_from_slice(&buf[at..at + self.cols]);
            }
            i = j;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sparse, dense, repeated and unsorted ids all give the rows they name, for dense and
    /// scattered readers, with or without prefetching; a row past the end is an error naming
    /// the file.
    #[test]
    fn gather_returns_the_named_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.bin");
        let (rows, cols) = (50_000u64, 3usize);
        let values: Vec<f32> = (0..rows as usize * cols).map(|i| i as f32).collect();
        let mut bytes = vec![7u8; 16];
        bytes.extend_from_slice(bytemuck::cast_slice(&values));
        std::fs::write(&path, bytes).unwrap();
        let dense = RowReader::open(&path, 16, rows, cols).unwrap();
        let scattered = RowReader::open(&path, 16, rows, cols).unwrap().scattered();
        let cases: Vec<Vec<u32>> = vec![
            vec![0, 1, 2, 49_999],
            (0..50_000).step_by(7).collect(),
            (0..50_000).step_by(9_000).collect(),
            (0..50_000).step_by(400).collect(),
            vec![5, 5, 3, 40_000, 2],
        ];
        for r in [&dense, &scattered] {
            for ids in &cases {
                // Advice never changes what a gather reads (ids past the end are skipped).
                r.prefetch(&[ids.as_slice(), &[60_000]].concat());
                let mut out = vec![0.0; ids.len() * cols];
                r.gather(ids, &mut out).unwrap();
                for (i, &v) in ids.iter().enumerate() {
                    for c in 0..cols {
                        assert_eq!(out[i * cols + c], (v as usize * cols + c) as f32);
                    }
                }
            }
            let err = r.gather(&[50_000], &mut [0.0; 3]).unwrap_err();
            assert!(err.to_string().contains("rows.bin"), "{err}");
        }
        assert!(RowReader::open(&path, 20, rows, cols).is_err());
    }
}
