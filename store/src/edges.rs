//! The one place where raw edge lists become CSR rows: [`EdgeListBuilder`] checks ids,
//! symmetrizes, applies the self-loop policy, sorts by (destination, source) and removes
//! duplicates. Every importer and the synthesizer go through it.
//!
//! Edges are held as 8-byte keys. A builder given a scratch directory ([`EdgeListBuilder::spill_to`])
//! holds at most a fixed number of them: when the buffer is full it is sorted, deduplicated and
//! written to a *run* file, and [`SortedEdges`] merges the runs while streaming the rows out. So
//! a graph of billions of edges is built with a bounded buffer plus the O(V) row offsets, and 8
//! bytes per edge of scratch disk that is deleted when the [`SortedEdges`] is dropped.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::csr::{CsrGraph, MAX_VERTICES};

/// What to do with edges from a vertex to itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SelfLoops {
    /// Give every vertex exactly one self-loop.
    Add,
    /// Drop all self-loops.
    Remove,
    /// Keep the self-loops the input has (deduplicated like any edge).
    #[default]
    Keep,
}

/// How raw edges become the stored graph. Duplicate edges are always removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EdgeOptions {
    /// Add the reverse of every edge.
    pub symmetrize: bool,
    pub self_loops: SelfLoops,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EdgeError {
    #[error("vertex id {id} is out of range: the graph has {num_vertices} vertices")]
    OutOfRange { id: u64, num_vertices: u64 },
    #[error("vertex id {id} exceeds the supported maximum of {max} vertices (ids are u32)")]
    TooLarge { id: u64, max: u64 },
    /// Reading or writing a run file in the scratch directory failed (disk full, say).
    #[error("edge scratch file {path}: {message}")]
    Scratch { path: PathBuf, message: String },
}

impl EdgeError {
    fn scratch(path: &Path, e: std::io::Error) -> Self {
        EdgeError::Scratch {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    }
}

/// Bytes of edge keys a spilling builder holds before it writes a run: 1 GiB (128M directed
/// edges). Larger buffers mean fewer runs but not less I/O; this keeps a billion-edge build
/// under a few GiB with the generator's or importer's own state.
pub const DEFAULT_RUN_BYTES: usize = 1 << 30;

/// Collects edges and turns them into sorted, deduplicated CSR rows.
///
/// Memory: 8 bytes per (possibly symmetrized) edge while collecting, which is at most twice
/// the 4 bytes per edge of the stored graph; with [`spill_to`](Self::spill_to), at most the
/// run size.
pub struct EdgeListBuilder {
    options: EdgeOptions,
    /// `(dst << 32) | src`: sorting these groups edges by destination, then source.
    keys: Vec<u64>,
    max_id: Option<u32>,
    spill: Option<Spill>,
}

/// Where a spilling builder writes its runs.
struct Spill {
    dir: tempfile::TempDir,
    max_keys: usize,
    runs: Vec<PathBuf>,
}

impl EdgeListBuilder {
    pub fn new(options: EdgeOptions) -> Self {
        EdgeListBuilder {
            options,
            keys: Vec::new(),
            max_id: None,
            spill: None,
        }
    }

    /// `edges` is the expected number of input edges (before symmetrization).
    pub fn with_capacity(options: EdgeOptions, edges: usize) -> Self {
        Self::new(options).expect_edges(edges)
    }

    /// Reserves room for `edges` input edges (before symmetrization), at most a run's worth
    /// when spilling.
    pub fn expect_edges(mut self, edges: usize) -> Self {
        let factor = if self.options.symmetrize { 2 } else { 1 };
        let mut keys = edges.saturating_mul(factor);
        if let Some(s) = &self.spill {
            keys = keys.min(s.max_keys);
        }
        self.keys.reserve(keys.saturating_sub(self.keys.len()));
        self
    }

    /// Holds at most `run_bytes` of keys in memory; beyond that, sorted runs go to a fresh
    /// directory inside `scratch` (put it on the output's file system: it needs 8 bytes per
    /// edge). The directory is removed when the [`SortedEdges`] (or this builder) is dropped.
    pub fn spill_to(mut self, scratch: &Path, run_bytes: usize) -> Result<Self, EdgeError> {
        let dir = tempfile::Builder::new()
            .prefix(".edges-")
            .tempdir_in(scratch)
            .map_err(|e| EdgeError::scratch(scratch, e))?;
        let max_keys = (run_bytes / 8).max(1);
        if self.keys.capacity() > max_keys {
            self.keys.shrink_to(max_keys);
        }
        self.spill = Some(Spill {
            dir,
            max_keys,
            runs: Vec::new(),
        });
        Ok(self)
    }

    /// Checks an id coming from untrusted input and narrows it to `u32`.
    pub fn check_id(id: i64) -> Result<u32, EdgeError> {
        if id < 0 || id as u64 >= MAX_VERTICES {
            return Err(EdgeError::TooLarge {
                id: id as u64,
                max: MAX_VERTICES,
            });
        }
        Ok(id as u32)
    }

    pub fn push(&mut self, src: u32, dst: u32) -> Result<(), EdgeError> {
        if src as u64 >= MAX_VERTICES || dst as u64 >= MAX_VERTICES {
            return Err(EdgeError::TooLarge {
                id: src.max(dst) as u64,
                max: MAX_VERTICES,
            });
        }
        self.max_id = Some(self.max_id.map_or(src.max(dst), |m| m.max(src).max(dst)));
        if src == dst {
            if self.options.self_loops == SelfLoops::Keep {
                self.push_key(key(src, dst))?;
            }
            return Ok(());
        }
        self.push_key(key(src, dst))?;
        if self.options.symmetrize {
            self.push_key(key(dst, src))?;
        }
        Ok(())
    }

    #[inline]
    fn push_key(&mut self, k: u64) -> Result<(), EdgeError> {
        if let Some(s) = &self.spill {
            if self.keys.len() >= s.max_keys {
                self.write_run()?;
            }
        }
        self.keys.push(k);
        Ok(())
    }

    /// Sorts and deduplicates the buffer and writes it as the next run.
    fn write_run(&mut self) -> Result<(), EdgeError> {
        let Some(spill) = &mut self.spill else {
            return Ok(());
        };
        self.keys.par_sort_unstable();
        self.keys.dedup();
        let path = spill
            .dir
            .path()
            .join(format!("run-{:04}", spill.runs.len()));
        let io = |e| EdgeError::scratch(&path, e);
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&path).map_err(io)?);
        for chunk in self.keys.chunks(1 << 16) {
            out.write_all(bytemuck::cast_slice(chunk)).map_err(io)?;
        }
        out.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_data()
            .map_err(io)?;
        tracing::debug!(
            run = spill.runs.len(),
            keys = self.keys.len(),
            "edge run written"
        );
        spill.runs.push(path);
        self.keys.clear();
        Ok(())
    }

    /// Number of vertices implied by the largest id seen so far.
    pub fn implied_vertices(&self) -> u64 {
        self.max_id.map_or(0, |m| m as u64 + 1)
    }

    /// Sorts and deduplicates. `num_vertices` defaults to one past the largest id seen;
    /// when given, every id must be below it.
    pub fn finish(mut self, num_vertices: Option<u64>) -> Result<SortedEdges, EdgeError> {
        let implied = self.implied_vertices();
        let n = match num_vertices {
            Some(n) if implied > n => {
                return Err(EdgeError::OutOfRange {
                    id: implied - 1,
                    num_vertices: n,
                })
            }
            Some(n) if n > MAX_VERTICES => {
                return Err(EdgeError::TooLarge {
                    id: n - 1,
                    max: MAX_VERTICES,
                })
            }
            Some(n) => n,
            None => implied,
        };
        if self.options.self_loops == SelfLoops::Add {
            match &self.spill {
                None => self.keys.reserve(n as usize),
                Some(s) => self.keys.reserve((n as usize).min(s.max_keys)),
            }
            for v in 0..n as u32 {
                self.push_key(key(v, v))?;
            }
        }
        if self.spill.as_ref().is_some_and(|s| !s.runs.is_empty()) {
            // The last buffer becomes a run too, so the merge sees only files.
            self.write_run()?;
            let spill = self.spill.take().expect("checked above");
            return Ok(SortedEdges {
                num_vertices: n,
                keys: Keys::Runs {
                    paths: spill.runs,
                    _dir: spill.dir,
                },
            });
        }
        self.keys.par_sort_unstable();
        self.keys.dedup();
        self.keys.shrink_to_fit();
        Ok(SortedEdges {
            num_vertices: n,
            keys: Keys::Memory(std::mem::take(&mut self.keys)),
        })
    }
}

fn key(src: u32, dst: u32) -> u64 {
    ((dst as u64) << 32) | src as u64
}

/// Edges sorted by (destination, source) without duplicates: CSR rows in all but layout.
pub struct SortedEdges {
    num_vertices: u64,
    keys: Keys,
}

enum Keys {
    Memory(Vec<u64>),
    /// Sorted, deduplicated run files, merged on the fly (duplicates across runs dropped).
    Runs {
        paths: Vec<PathBuf>,
        /// Removes the runs on drop.
        _dir: tempfile::TempDir,
    },
}

/// Keys handed to the stream's callback at a time.
const STREAM_CHUNK: usize = 1 << 16;

impl SortedEdges {
    pub fn num_vertices(&self) -> u64 {
        self.num_vertices
    }

    /// Streams the source ids in row order, in chunks, to `on_sources`, and returns the row
    /// offsets (length `num_vertices + 1`; the last is the number of edges). One pass; memory
    /// is the offsets plus a chunk (and a read buffer per run).
    pub fn stream_csr<E: From<EdgeError>>(
        &self,
        mut on_sources: impl FnMut(&[u32]) -> Result<(), E>,
    ) -> Result<Vec<u64>, E> {
        let n = self.num_vertices as usize;
        let mut offsets = vec![0u64; n + 1];
        let mut sources = Vec::with_capacity(STREAM_CHUNK);
        self.for_each_key_chunk(|keys| {
            sources.clear();
            for &k in keys {
                offsets[(k >> 32) as usize + 1] += 1;
                sources.push(k as u32);
            }
            on_sources(&sources)
        })?;
        for i in 0..n {
            offsets[i + 1] += offsets[i];
        }
        Ok(offsets)
    }

    /// The sorted, deduplicated keys in order, a chunk at a time.
    fn for_each_key_chunk<E: From<EdgeError>>(
        &self,
        mut f: impl FnMut(&[u64]) -> Result<(), E>,
    ) -> Result<(), E> {
        match &self.keys {
            Keys::Memory(keys) => {
                for chunk in keys.chunks(STREAM_CHUNK) {
                    f(chunk)?;
                }
                Ok(())
            }
            Keys::Runs { paths, .. } => merge_runs(paths, f),
        }
    }

    pub fn into_csr(self) -> Result<CsrGraph, EdgeError> {
        let edges = match &self.keys {
            Keys::Memory(keys) => keys.len(),
            Keys::Runs { .. } => 0,
        };
        let mut indices = Vec::with_capacity(edges);
        let offsets = self.stream_csr(|s| {
            indices.extend_from_slice(s);
            Ok::<_, EdgeError>(())
        })?;
        Ok(CsrGraph { offsets, indices })
    }
}

/// One run file read sequentially through a buffer.
struct RunReader {
    path: PathBuf,
    file: BufReader<File>,
    buf: Vec<u64>,
    pos: usize,
}

impl RunReader {
    fn open(path: &Path) -> Result<RunReader, EdgeError> {
        let file = File::open(path).map_err(|e| EdgeError::scratch(path, e))?;
        Ok(RunReader {
            path: path.to_path_buf(),
            file: BufReader::with_capacity(1 << 20, file),
            buf: Vec::with_capacity(1 << 17),
            pos: 0,
        })
    }

    /// The next key, or `None` at the end of the run.
    fn next(&mut self) -> Result<Option<u64>, EdgeError> {
        if self.pos == self.buf.len() {
            self.buf.resize(self.buf.capacity(), 0);
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.buf);
            let mut filled = 0;
            while filled < bytes.len() {
                match self.file.read(&mut bytes[filled..]) {
                    Ok(0) => break,
                    Ok(k) => filled += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(EdgeError::scratch(&self.path, e)),
                }
            }
            if filled % 8 != 0 {
                return Err(EdgeError::Scratch {
                    path: self.path.clone(),
                    message: "truncated run (not a whole number of keys)".into(),
                });
            }
            self.buf.truncate(filled / 8);
            self.pos = 0;
            if self.buf.is_empty() {
                return Ok(None);
            }
        }
        self.pos += 1;
        Ok(Some(self.buf[self.pos - 1]))
    }
}

/// K-way merge of sorted runs into `f`, dropping keys equal to the previous one.
fn merge_runs<E: From<EdgeError>>(
    paths: &[PathBuf],
    mut f: impl FnMut(&[u64]) -> Result<(), E>,
) -> Result<(), E> {
    let mut readers = paths
        .iter()
        .map(|p| RunReader::open(p))
        .collect::<Result<Vec<_>, _>>()?;
    let mut heap = BinaryHeap::with_capacity(readers.len());
    for (i, r) in readers.iter_mut().enumerate() {
        if let Some(k) = r.next()? {
            heap.push(Reverse((k, i)));
        }
    }
    let mut out = Vec::with_capacity(STREAM_CHUNK);
    let mut last = None;
    while let Some(Reverse((k, i))) = heap.pop() {
        if last != Some(k) {
            out.push(k);
            last = Some(k);
            if out.len() == STREAM_CHUNK {
                f(&out)?;
                out.clear();
            }
        }
        if let Some(next) = readers[i].next()? {
            heap.push(Reverse((next, i)));
        }
    }
    if !out.is_empty() {
        f(&out)?;
    }
    Ok(())
}

/// Builds a graph from `(src, dst)` pairs with the given options (convenience for tests
/// and small graphs; importers stream through [`EdgeListBuilder`] directly).
pub fn graph_from_edges(
    num_vertices: u64,
    edges: impl IntoIterator<Item = (u32, u32)>,
    options: EdgeOptions,
) -> Result<CsrGraph, EdgeError> {
    let mut builder = EdgeListBuilder::new(options);
    for (src, dst) in edges {
        builder.push(src, dst)?;
    }
    builder.finish(Some(num_vertices))?.into_csr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_sorted_deduplicated_rows() {
        let g = crate::graph_from_edges(
            4,
            [(1, 0), (2, 0), (1, 0), (3, 3), (0, 2)],
            EdgeOptions::default(),
        )
        .unwrap();
        assert_eq!(g.offsets, vec![0, 2, 2, 3, 4]);
        assert_eq!(g.indices, vec![1, 2, 0, 3]);
    }

    #[test]
    fn symmetrize_and_self_loop_options() {
        let opts = EdgeOptions {
            symmetrize: true,
            self_loops: SelfLoops::Remove,
        };
        let g = crate::graph_from_edges(3, [(0, 1), (1, 1), (1, 2)], opts).unwrap();
        assert!(g.view().is_symmetric());
        assert_eq!(g.view().num_edges(), 4);
        let opts = EdgeOptions {
            symmetrize: true,
            self_loops: SelfLoops::Add,
        };
        let g = crate::graph_from_edges(3, [(0, 1), (1, 1)], opts).unwrap();
        assert_eq!(g.view().num_edges(), 2 + 3);
        assert!(g.view().has_edge(2, 2));
    }

    #[test]
    fn out_of_range_ids_are_rejected() {
        let err = crate::graph_from_edges(2, [(0, 5)], EdgeOptions::default()).unwrap_err();
        assert_eq!(
            err,
            EdgeError::OutOfRange {
                id: 5,
                num_vertices: 2
            }
        );
        assert!(EdgeListBuilder::check_id(-1).is_err());
        assert!(EdgeListBuilder::check_id(u32::MAX as i64).is_err());
    }

    /// Runs of a few keys (so many runs, duplicates across them, self-loops added through the
    /// spill path) give exactly the in-memory result, and the scratch files go away.
    #[test]
    fn spilled_runs_merge_to_the_in_memory_result() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let edges: Vec<(u32, u32)> = (0..5_000)
            .map(|_| (rng.gen_range(0..300), rng.gen_range(0..300)))
            .collect();
        for self_loops in [SelfLoops::Add, SelfLoops::Remove, SelfLoops::Keep] {
            let options = EdgeOptions {
                symmetrize: true,
                self_loops,
            };
            let expected = crate::graph_from_edges(300, edges.iter().copied(), options).unwrap();
            let scratch = tempfile::tempdir().unwrap();
            let mut b = EdgeListBuilder::new(options)
                .spill_to(scratch.path(), 8 * 97)
                .unwrap()
                .expect_edges(edges.len());
            for &(s, d) in &edges {
                b.push(s, d).unwrap();
            }
            let sorted = b.finish(Some(300)).unwrap();
            assert!(matches!(&sorted.keys, Keys::Runs { paths, .. } if paths.len() > 50));
            let mut streamed = Vec::new();
            let offsets = sorted
                .stream_csr(|s| {
                    streamed.extend_from_slice(s);
                    Ok::<_, EdgeError>(())
                })
                .unwrap();
            assert_eq!(offsets, expected.offsets);
            assert_eq!(streamed, expected.indices);
            assert_eq!(sorted.into_csr().unwrap(), expected);
            assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
        }
    }

    /// A builder that never fills its buffer keeps everything in memory (no files).
    #[test]
    fn small_spilling_builds_stay_in_memory() {
        let scratch = tempfile::tempdir().unwrap();
        let mut b = EdgeListBuilder::new(EdgeOptions::default())
            .spill_to(scratch.path(), 1 << 20)
            .unwrap();
        b.push(0, 1).unwrap();
        let sorted = b.finish(None).unwrap();
        assert!(matches!(sorted.keys, Keys::Memory(_)));
        assert_eq!(sorted.into_csr().unwrap().indices, vec![0]);
    }

    #[test]
    fn a_missing_scratch_directory_is_named() {
        let err = EdgeListBuilder::new(EdgeOptions::default())
            .spill_to(Path::new("/nonexistent/scratch"), 1 << 20)
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent/scratch"), "{err}");
    }
}
