//! Typed binary array files: a 64-byte header followed by a little-endian payload.
//!
//! Header layout (all little-endian):
//! `0..8` magic `GRNDSARR`, `8..12` format version, `12..16` dtype code, `16..24` rows,
//! `24..32` columns, `32..40` xxh3-64 of the payload, `40..64` reserved (zero).
//! The payload starts at byte 64, so a page-aligned mmap keeps it 8-byte aligned.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use xxhash_rust::xxh3::Xxh3;

use crate::error::{Result, StoreError};

pub const MAGIC: [u8; 8] = *b"GRNDSARR";
pub const ARRAY_FORMAT_VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 64;

/// Element types an array file can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    U64 = 1,
    U32 = 2,
    F32 = 3,
    I32 = 4,
}

impl DType {
    fn from_code(code: u32) -> Option<DType> {
        match code {
            1 => Some(DType::U64),
            2 => Some(DType::U32),
            3 => Some(DType::F32),
            4 => Some(DType::I32),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::U64 => "u64",
            DType::U32 => "u32",
            DType::F32 => "f32",
            DType::I32 => "i32",
        }
    }
}

/// A plain-old-data element type with a fixed dtype code.
pub trait Element: bytemuck::Pod {
    const DTYPE: DType;
}
impl Element for u64 {
    const DTYPE: DType = DType::U64;
}
impl Element for u32 {
    const DTYPE: DType = DType::U32;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}

/// What a finished writer reports; the dataset manifest records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ArraySummary {
    pub rows: u64,
    pub cols: u64,
    pub checksum: u64,
}

/// Streams elements into an array file, hashing as it goes, and writes the header last.
pub struct ArrayWriter<T: Element> {
    path: PathBuf,
    out: BufWriter<File>,
    hasher: Xxh3,
    len: u64,
    _marker: PhantomData<T>,
}

impl<T: Element> ArrayWriter<T> {
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::create(&path).map_err(|e| StoreError::io(&path, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&[0u8; HEADER_BYTES])
            .map_err(|e| StoreError::io(&path, e))?;
        Ok(ArrayWriter {
            path,
            out,
            hasher: Xxh3::new(),
            len: 0,
            _marker: PhantomData,
        })
    }

    pub fn push(&mut self, values: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        self.hasher.update(bytes);
        self.out
            .write_all(bytes)
            .map_err(|e| StoreError::io(&self.path, e))?;
        self.len += values.len() as u64;
        Ok(())
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writes the header for a `len / cols` × `cols` array and flushes to disk.
    pub fn finish(mut self, cols: u64) -> Result<ArraySummary> {
        let cols = cols.max(1);
        if !self.len.is_multiple_of(cols) {
            return Err(StoreError::invalid(
                &self.path,
                format!("{} elements do not fill rows of {} columns", self.len, cols),
            ));
        }
        let summary = ArraySummary {
            rows: self.len / cols,
            cols,
            checksum: self.hasher.digest(),
        };
        let header = encode_header(T::DTYPE, &summary);
        let path = self.path.clone();
        let io = |e| StoreError::io(&path, e);
        self.out.flush().map_err(io)?;
        let mut file = self.out.into_inner().map_err(|e| io(e.into_error()))?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header).map_err(io)?;
        file.sync_all().map_err(io)?;
        Ok(summary)
    }
}

/// Writes a whole slice as one array file.
pub fn write_array<T: Element>(
    path: impl AsRef<Path>,
    values: &[T],
    cols: u64,
) -> Result<ArraySummary> {
    let mut writer = ArrayWriter::<T>::create(path)?;
    writer.push(values)?;
    writer.finish(cols)
}

/// Writes an array file whose elements arrive in several sequential streams, one per range
/// of positions ("bucket"): a relabelling that scans its input once sends each element to
/// its bucket, and every bucket fills in order. Memory: one small buffer per bucket. The
/// checksum is computed by reading the file back at the end (sequentially, not mapped).
pub struct RangeWriter<T: Element> {
    path: PathBuf,
    file: File,
    /// Bucket `b` covers elements `starts[b]..starts[b + 1]`.
    starts: Vec<u64>,
    /// Next element each bucket writes, and what it has buffered.
    next: Vec<u64>,
    buffers: Vec<Vec<T>>,
    buffer_elems: usize,
}

/// Most bytes a [`RangeWriter`] bucket buffers before writing.
const RANGE_BUFFER_BYTES: usize = 256 << 10;

impl<T: Element> RangeWriter<T> {
    /// `starts`: bucket boundaries in elements, ascending, from 0 to the array's length.
    pub fn create(path: impl AsRef<Path>, starts: &[u64]) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let invalid = |m: String| StoreError::invalid(&path, m);
        if starts.first() != Some(&0) || starts.windows(2).any(|w| w[1] < w[0]) {
            return Err(invalid(format!(
                "internal error: bucket starts must ascend from 0, got {} entries",
                starts.len()
            )));
        }
        let len = *starts.last().expect("checked non-empty");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| StoreError::io(&path, e))?;
        file.set_len(HEADER_BYTES as u64 + len * std::mem::size_of::<T>() as u64)
            .map_err(|e| StoreError::io(&path, e))?;
        let buckets = starts.len() - 1;
        // About 256 MiB of buffers at most, whatever the number of buckets.
        let buffer_bytes = ((256usize << 20) / buckets.max(1)).clamp(4 << 10, RANGE_BUFFER_BYTES);
        Ok(RangeWriter {
            buffer_elems: (buffer_bytes / std::mem::size_of::<T>()).max(1),
            path,
            file,
            starts: starts.to_vec(),
            next: starts[..buckets].to_vec(),
            buffers: (0..buckets).map(|_| Vec::new()).collect(),
        })
    }

    /// Appends `values` to bucket `b`.
    pub fn push(&mut self, b: usize, values: &[T]) -> Result<()> {
        let buffered = self.buffers[b].len() as u64;
        if self.next[b] + buffered + values.len() as u64 > self.starts[b + 1] {
            return Err(StoreError::invalid(
                &self.path,
                format!("internal error: bucket {b} overflows its range"),
            ));
        }
        let cap = self.buffer_elems;
        if self.buffers[b].len() + values.len() > cap {
            self.flush(b)?;
        }
        if values.len() >= cap {
            self.write_at(self.next[b], values)?;
            self.next[b] += values.len() as u64;
        } else {
            self.buffers[b].extend_from_slice(values);
        }
        Ok(())
    }

    fn flush(&mut self, b: usize) -> Result<()> {
        self.write_at(self.next[b], &self.buffers[b])?;
        self.next[b] += self.buffers[b].len() as u64;
        self.buffers[b].clear();
        Ok(())
    }

    fn write_at(&self, element: u64, values: &[T]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let at = HEADER_BYTES as u64 + element * std::mem::size_of::<T>() as u64;
        self.file
            .write_all_at(bytemuck::cast_slice(values), at)
            .map_err(|e| StoreError::io(&self.path, e))
    }

    /// Checks that every bucket is full, hashes the payload and writes the header for
    /// `len / cols` rows of `cols`.
    pub fn finish(mut self, cols: u64) -> Result<ArraySummary> {
        use std::io::Read;
        for b in 0..self.buffers.len() {
            self.flush(b)?;
            if self.next[b] != self.starts[b + 1] {
                return Err(StoreError::invalid(
                    &self.path,
                    format!(
                        "internal error: bucket {b} got {} of {} elements",
                        self.next[b] - self.starts[b],
                        self.starts[b + 1] - self.starts[b]
                    ),
                ));
            }
        }
        let len = *self.starts.last().expect("non-empty");
        let cols = cols.max(1);
        if !len.is_multiple_of(cols) {
            return Err(StoreError::invalid(
                &self.path,
                format!("{len} elements do not fill rows of {cols} columns"),
            ));
        }
        let path = self.path.clone();
        let io = |e| StoreError::io(&path, e);
        let mut hasher = Xxh3::new();
        self.file
            .seek(SeekFrom::Start(HEADER_BYTES as u64))
            .map_err(io)?;
        let mut chunk = vec![0u8; 4 << 20];
        loop {
            let k = (&self.file).read(&mut chunk).map_err(io)?;
            if k == 0 {
                break;
            }
            hasher.update(&chunk[..k]);
        }
        let summary = ArraySummary {
            rows: len / cols,
            cols,
            checksum: hasher.digest(),
        };
        self.file.seek(SeekFrom::Start(0)).map_err(io)?;
        self.file
            .write_all(&encode_header(T::DTYPE, &summary))
            .map_err(io)?;
        self.file.sync_all().map_err(io)?;
        Ok(summary)
    }
}

fn encode_header(dtype: DType, summary: &ArraySummary) -> [u8; HEADER_BYTES] {
    let mut header = [0u8; HEADER_BYTES];
    header[0..8].copy_from_slice(&MAGIC);
    header[8..12].copy_from_slice(&ARRAY_FORMAT_VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&(dtype as u32).to_le_bytes());
    header[16..24].copy_from_slice(&summary.rows.to_le_bytes());
    header[24..32].copy_from_slice(&summary.cols.to_le_bytes());
    header[32..40].copy_from_slice(&summary.checksum.to_le_bytes());
    header
}

/// Bytes per chunk of [`MappedArray::scan_chunks`].
pub const SCAN_CHUNK_BYTES: usize = 64 << 20;
/// The smallest Linux page: the unit in which [`MappedArray::scan_chunks`] releases pages and
/// the page cache reads (`rows.rs` coalesces cached reads by it).
pub(crate) const PAGE_BYTES: usize = 4096;

/// Drops the pages of a read-only file mapping that lie wholly inside `bytes` from this
/// process's resident set; they stay in the page cache and a later read faults them back in.
pub fn release_pages(map: &memmap2::Mmap, bytes: std::ops::Range<usize>) {
    let start = bytes.start.div_ceil(PAGE_BYTES) * PAGE_BYTES;
    let end = bytes.end.min(map.len()) / PAGE_BYTES * PAGE_BYTES;
    if end > start {
        // SAFETY: callers map files read-only and nobody writes them while mapped;
        // MADV_DONTNEED only drops resident pages, which a later read faults back in from
        // the file, so no slice handed out sees other data.
        let _ = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
    }
}

/// A memory-mapped array file whose header has been checked (magic, version, dtype, size).
/// The payload checksum is only checked by [`MappedArray::verify_checksum`], because hashing
/// gigabytes on every open would defeat the point of mapping.
pub struct MappedArray<T: Element> {
    path: PathBuf,
    map: Option<Mmap>,
    summary: ArraySummary,
    _marker: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for MappedArray<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedArray")
            .field("path", &self.path)
            .field("summary", &self.summary)
            .finish()
    }
}

impl<T: Element> MappedArray<T> {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| StoreError::io(&path, e))?;
        let actual = file.metadata().map_err(|e| StoreError::io(&path, e))?.len();
        if actual < HEADER_BYTES as u64 {
            return Err(StoreError::Truncated {
                path,
                expected: HEADER_BYTES as u64,
                actual,
            });
        }
        // SAFETY: the file is opened read-only; grandis never modifies a finished dataset in
        // place (writers build a new directory and rename it), so the mapping stays valid.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| StoreError::io(&path, e))?;
        let header = &map[..HEADER_BYTES];
        if header[0..8] != MAGIC {
            return Err(StoreError::BadMagic { path });
        }
        let u32_at = |o: usize| u32::from_le_bytes(header[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(header[o..o + 8].try_into().unwrap());
        let version = u32_at(8);
        if version != ARRAY_FORMAT_VERSION {
            return Err(StoreError::BadVersion {
                path,
                found: version,
                supported: ARRAY_FORMAT_VERSION,
            });
        }
        let dtype_code = u32_at(12);
        match DType::from_code(dtype_code) {
            Some(d) if d == T::DTYPE => {}
            Some(d) => {
                return Err(StoreError::invalid(
                    &path,
                    format!("holds {} elements, expected {}", d.name(), T::DTYPE.name()),
                ))
            }
            None => {
                return Err(StoreError::invalid(
                    &path,
                    format!("unknown dtype code {dtype_code}"),
                ))
            }
        }
        let summary = ArraySummary {
            rows: u64_at(16),
            cols: u64_at(24),
            checksum: u64_at(32),
        };
        // Writers always record at least one column; 0 columns would let a 64-byte file
        // claim any number of rows (found by the `store_array` fuzz target).
        if summary.cols == 0 {
            return Err(StoreError::invalid(
                &path,
                format!(
                    "header says {} rows of 0 columns (every array has at least one column)",
                    summary.rows
                ),
            ));
        }
        let expected = summary
            .rows
            .checked_mul(summary.cols)
            .and_then(|n| n.checked_mul(std::mem::size_of::<T>() as u64))
            .and_then(|n| n.checked_add(HEADER_BYTES as u64))
            .ok_or_else(|| StoreError::invalid(&path, "header sizes overflow"))?;
        if expected != actual {
            return Err(StoreError::Truncated {
                path,
                expected,
                actual,
            });
        }
        // A zero-length payload maps fine, but keep `None` so as_slice need not special-case.
        let map = if summary.rows * summary.cols == 0 {
            None
        } else {
            Some(map)
        };
        Ok(MappedArray {
            path,
            map,
            summary,
            _marker: PhantomData,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn summary(&self) -> ArraySummary {
        self.summary
    }

    pub fn as_slice(&self) -> &[T] {
        match &self.map {
            Some(map) => bytemuck::cast_slice(&map[HEADER_BYTES..]),
            None => &[],
        }
    }

    /// Calls `f` on the elements in order, in chunks of about [`SCAN_CHUNK_BYTES`], and drops
    /// each chunk's pages from this process's resident set once `f` is done with it (they
    /// stay in the page cache): a scan of a file larger than memory keeps RSS bounded.
    /// Stops at the first error.
    pub fn scan_chunks<E>(
        &self,
        mut f: impl FnMut(usize, &[T]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let all = self.as_slice();
        let per_chunk = (SCAN_CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
        for (i, chunk) in all.chunks(per_chunk).enumerate() {
            f(i * per_chunk, chunk)?;
            // From the previous chunk's start: the page it shares with this one (partly
            // read then, so kept) goes now; earlier pages went already.
            self.release(i.saturating_sub(1) * per_chunk..i * per_chunk + chunk.len());
        }
        Ok(())
    }

    /// Keeps this array's pages resident (`mlock`: read in now, never evicted while mapped):
    /// for an array read at scattered places all the time, whose eviction would turn each
    /// read into a disk request. Fails past `RLIMIT_MEMLOCK`.
    pub fn lock_resident(&self) -> std::io::Result<()> {
        match &self.map {
            Some(map) => map.lock(),
            None => Ok(()),
        }
    }

    /// Drops the pages that lie wholly inside elements `range` from this process's resident
    /// set (they stay in the page cache; a later read faults them back in). For sequential
    /// passes over arrays larger than memory: release what is behind the cursor.
    pub fn release(&self, range: std::ops::Range<usize>) {
        if let Some(map) = &self.map {
            let size = std::mem::size_of::<T>();
            release_pages(
                map,
                HEADER_BYTES + range.start * size..HEADER_BYTES + range.end * size,
            );
        }
    }

    pub fn verify_checksum(&self) -> Result<()> {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        self.scan_chunks(|_, chunk| {
            hasher.update(bytemuck::cast_slice(chunk));
            Ok::<_, std::convert::Infallible>(())
        })
        .unwrap_or_else(|never| match never {});
        let computed = hasher.digest();
        if computed != self.summary.checksum {
            return Err(StoreError::Checksum {
                path: self.path.clone(),
                stored: self.summary.checksum,
                computed,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzz crash `store_array/crash-c28018ec`: a header of 4.7e15 rows of 0 columns and no
    /// payload opened fine, and a consumer trusting `rows` would have allocated for it.
    #[test]
    fn a_header_with_zero_columns_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.f32");
        let crash = "47524e445341525201000000030000002800000015f91000000000000000000082d0a73f\
                     52a71140672380be1033150589bf26caccbe79f5ffffffffffffffff";
        let bytes: Vec<u8> = (0..crash.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&crash[i..i + 2], 16).unwrap())
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        let err = MappedArray::<f32>::open(&path).expect_err("refused");
        assert!(err.to_string().contains("0 columns"), "{err}");
    }

    /// Buckets filled in interleaved order (and pushes larger than a buffer) give the file
    /// a sequential writer gives; a bucket left short or overfilled is an error.
    #[test]
    fn range_writer_matches_the_sequential_writer() {
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<u32> = (0..200_000).map(|i| i * 7 + 1).collect();
        let starts = [0u64, 10, 10, 150_000, 200_000];
        let expected = write_array(dir.path().join("seq"), &values, 2).unwrap();
        let mut w = RangeWriter::<u32>::create(dir.path().join("ranges"), &starts).unwrap();
        let mut next: Vec<u64> = starts[..4].to_vec();
        let mut step = 0u64;
        while (0..4).any(|b| next[b] < starts[b + 1]) {
            for b in (0..4).rev() {
                let take = (step * 977 % 90_000 + 1).min(starts[b + 1] - next[b]);
                w.push(b, &values[next[b] as usize..(next[b] + take) as usize])
                    .unwrap();
                next[b] += take;
                step += 1;
            }
        }
        let summary = w.finish(2).unwrap();
        assert_eq!(summary, expected);
        assert_eq!(
            std::fs::read(dir.path().join("ranges")).unwrap(),
            std::fs::read(dir.path().join("seq")).unwrap()
        );

        let mut short = RangeWriter::<u32>::create(dir.path().join("short"), &starts).unwrap();
        assert!(short.push(1, &[1]).is_err(), "bucket 1 is empty");
        short.push(0, &values[..9]).unwrap();
        let err = short.finish(1).unwrap_err().to_string();
        assert!(err.contains("bucket 0 got 9 of 10"), "{err}");
    }

    #[test]
    fn round_trip_and_corruption_detection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.f32");
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
        let summary = write_array(&path, &values, 3).unwrap();
        assert_eq!((summary.rows, summary.cols), (4, 3));
        let mapped = MappedArray::<f32>::open(&path).unwrap();
        assert_eq!(mapped.as_slice(), &values[..]);
        mapped.verify_checksum().unwrap();

        assert!(matches!(
            MappedArray::<u32>::open(&path),
            Err(StoreError::Invalid { .. })
        ));

        let mut bytes = std::fs::read(&path).unwrap();
        bytes[HEADER_BYTES + 1] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let err = MappedArray::<f32>::open(&path)
            .unwrap()
            .verify_checksum()
            .unwrap_err();
        assert!(err.to_string().contains("checksum mismatch"), "{err}");

        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let err = MappedArray::<f32>::open(&path).err().unwrap();
        assert!(err.to_string().contains("truncated"), "{err}");

        std::fs::write(
            &path,
            b"not an array file at all, definitely not one, no sir, not at all",
        )
        .unwrap();
        assert!(matches!(
            MappedArray::<f32>::open(&path),
            Err(StoreError::BadMagic { .. })
        ));
    }

    #[test]
    fn empty_array_maps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.u32");
        write_array::<u32>(&path, &[], 1).unwrap();
        let mapped = MappedArray::<u32>::open(&path).unwrap();
        assert!(mapped.as_slice().is_empty());
        mapped.verify_checksum().unwrap();
    }
}
