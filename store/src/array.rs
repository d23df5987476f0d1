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
/// The unit in which [`MappedArray::scan_chunks`] releases pages (the smallest Linux page).
const PAGE_BYTES: usize = 4096;

/// A memory-mapped array file whose header has been checked (magic, version, dtype, size).
/// The payload checksum is only checked by [`MappedArray::verify_checksum`], because hashing
/// gigabytes on every open would defeat the point of mapping.
pub struct MappedArray<T: Element> {
    path: PathBuf,
    map: Option<Mmap>,
    summary: ArraySummary,
    _marker: PhantomData<T>,
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
        let mut released = 0usize;
        for (i, chunk) in all.chunks(per_chunk).enumerate() {
            f(i * per_chunk, chunk)?;
            if let Some(map) = &self.map {
                // Whole pages only: the last, partly read page goes with the next chunk.
                let end = HEADER_BYTES + (i * per_chunk + chunk.len()) * std::mem::size_of::<T>();
                let end = end / PAGE_BYTES * PAGE_BYTES;
                if end > released {
                    // SAFETY: the mapping is a read-only view of a file nobody writes (see
                    // `open`); MADV_DONTNEED only drops resident pages, which a later read
                    // faults back in from the file, so no slice handed out sees other data.
                    let _ = unsafe {
                        map.unchecked_advise_range(
                            memmap2::UncheckedAdvice::DontNeed,
                            released,
                            end - released,
                        )
                    };
                    released = end;
                }
            }
        }
        Ok(())
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
        let err = MappedArray::<f32>::open(&path).err().expect("refused");
        assert!(err.to_string().contains("0 columns"), "{err}");
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
