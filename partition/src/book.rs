//! The partition book: which (server, device) owns which vertex, and the mapping between the
//! original ids and the relabelled ones in which every part is a contiguous range.

use std::ops::Range;
use std::path::{Path, PathBuf};

use grandis_store::{array::ArraySummary, Dataset, MappedArray};

use crate::quality::Quality;
use crate::{PartitionError, PartitionMethod, Result};

pub const BOOK_FILE: &str = "partition.json";
pub const NEW_TO_OLD_FILE: &str = "new_to_old.u32";
pub const OLD_TO_NEW_FILE: &str = "old_to_new.u32";
pub const DATASET_DIR: &str = "dataset";
pub const BOOK_FORMAT: &str = "grandis-partition";
pub const BOOK_VERSION: u32 = 1;

/// Where the partitioned dataset came from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SourceInfo {
    pub path: PathBuf,
    pub name: String,
    /// The source manifest's per-file summaries (rows, columns, checksum).
    pub files: std::collections::BTreeMap<String, ArraySummary>,
}

/// Contents of `partition.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BookMeta {
    pub format: String,
    pub version: u32,
    pub method: PartitionMethod,
    pub servers: u32,
    pub devices: u32,
    pub seed: u64,
    /// The balance factor (recorded for every method; SPRING and ByteGNN read it).
    pub balance_factor: f64,
    /// ByteGNN's block radius (ByteGNN partitions only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_hops: Option<u32>,
    pub num_vertices: u64,
    /// Half-open new-id ranges `[start, end)` of every device part, server-major:
    /// entry `s * devices + d` belongs to device `d` of server `s`.
    pub ranges: Vec<[u64; 2]>,
    pub report: crate::PartitionReport,
    pub source: SourceInfo,
}

/// A partition directory opened for reading. Vertex arguments are *new* ids unless the method
/// says otherwise; methods taking a vertex panic when it is out of range, like slice indexing.
pub struct PartitionBook {
    dir: PathBuf,
    meta: BookMeta,
    /// Device-part boundaries (servers * devices + 1 entries, ascending).
    starts: Vec<u64>,
    new_to_old: MappedArray<u32>,
    old_to_new: MappedArray<u32>,
}

impl PartitionBook {
    /// Opens `dir` (written by [`crate::partition_dataset`]) and checks that the ranges are
    /// contiguous and cover every vertex and that both id maps have one entry per vertex.
    pub fn open(dir: impl AsRef<Path>) -> Result<PartitionBook> {
        let dir = dir.as_ref().to_path_buf();
        let path = dir.join(BOOK_FILE);
        let invalid = |message: String| PartitionError::Invalid {
            path: path.clone(),
            message,
        };
        let bytes = std::fs::read(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound && !dir.exists() {
                PartitionError::Invalid {
                    path: dir.clone(),
                    message: "no such partition directory".into(),
                }
            } else {
                PartitionError::Io {
                    path: path.clone(),
                    source: e,
                }
            }
        })?;
        let meta: BookMeta = serde_json::from_slice(&bytes)
            .map_err(|e| invalid(format!("not a valid partition book: {e}")))?;
        if meta.format != BOOK_FORMAT {
            return Err(invalid(format!(
                "format is {:?}, expected {BOOK_FORMAT:?}",
                meta.format
            )));
        }
        if meta.version != BOOK_VERSION {
            return Err(invalid(format!(
                "version {} is not supported (this build reads version {BOOK_VERSION})",
                meta.version
            )));
        }
        let parts = meta.servers as usize * meta.devices as usize;
        if parts == 0 || meta.ranges.len() != parts {
            return Err(invalid(format!(
                "{} ranges for {} servers x {} devices",
                meta.ranges.len(),
                meta.servers,
                meta.devices
            )));
        }
        let mut starts = Vec::with_capacity(parts + 1);
        let mut next = 0u64;
        for (i, r) in meta.ranges.iter().enumerate() {
            if r[0] != next || r[1] < r[0] {
                return Err(invalid(format!(
                    "range {i} is [{}, {}), expected it to start at {next}",
                    r[0], r[1]
                )));
            }
            starts.push(r[0]);
            next = r[1];
        }
        starts.push(next);
        if next != meta.num_vertices {
            return Err(invalid(format!(
                "ranges cover {next} vertices, the book has {}",
                meta.num_vertices
            )));
        }
        let new_to_old = MappedArray::<u32>::open(dir.join(NEW_TO_OLD_FILE))?;
        let old_to_new = MappedArray::<u32>::open(dir.join(OLD_TO_NEW_FILE))?;
        for a in [&new_to_old, &old_to_new] {
            if a.summary().rows != meta.num_vertices {
                return Err(PartitionError::Invalid {
                    path: a.path().to_path_buf(),
                    message: format!(
                        "has {} entries for {} vertices",
                        a.summary().rows,
                        meta.num_vertices
                    ),
                });
            }
        }
        Ok(PartitionBook {
            dir,
            meta,
            starts,
            new_to_old,
            old_to_new,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads both id maps whole: their checksums, and that they are inverse permutations of
    /// every vertex (a flipped id would train a vertex on another's features).
    pub fn verify(&self) -> Result<()> {
        self.new_to_old.verify_checksum()?;
        self.old_to_new.verify_checksum()?;
        let (fwd, back) = (self.new_to_old.as_slice(), self.old_to_new.as_slice());
        let bad = fwd
            .iter()
            .enumerate()
            .find(|&(v, &old)| back.get(old as usize) != Some(&(v as u32)));
        if let Some((v, &old)) = bad {
            return Err(PartitionError::Invalid {
                path: self.new_to_old.path().to_path_buf(),
                message: format!(
                    "new id {v} maps to original id {old}, which {OLD_TO_NEW_FILE} does not \
                     map back to it"
                ),
            });
        }
        Ok(())
    }

    /// [`PartitionBook::verify`] unless every file's current version is in the record at
    /// `record` (see [`grandis_store::verified`]).
    pub fn verify_once(&self, record: &Path) -> Result<grandis_store::Verification> {
        let files = [
            self.dir.join(BOOK_FILE),
            self.new_to_old.path().to_path_buf(),
            self.old_to_new.path().to_path_buf(),
        ];
        grandis_store::verified::verify_once(record, &files, || self.verify())
    }
    /// Everything recorded in `partition.json` (method, seed, quality report, source).
    pub fn meta(&self) -> &BookMeta {
        &self.meta
    }
    pub fn num_servers(&self) -> u32 {
        self.meta.servers
    }
    /// Devices per server.
    pub fn num_devices(&self) -> u32 {
        self.meta.devices
    }
    pub fn num_vertices(&self) -> u64 {
        self.meta.num_vertices
    }

    fn check(&self, v: u32) {
        assert!(
            (v as u64) < self.meta.num_vertices,
            "vertex {v} out of range ({} vertices)",
            self.meta.num_vertices
        );
    }

    /// The device part (server-major index `s * devices + d`) that owns new id `v`.
    pub fn part_of(&self, v: u32) -> u32 {
        self.check(v);
        // starts[p] <= v < starts[p + 1]; empty parts share a start, so take the last.
        (self.starts.partition_point(|&s| s <= v as u64) - 1) as u32
    }
    /// Server owning new id `v`.
    pub fn server_of(&self, v: u32) -> u32 {
        self.part_of(v) / self.meta.devices
    }
    /// Device (within its server, `0..devices`) owning new id `v`.
    pub fn device_of(&self, v: u32) -> u32 {
        self.part_of(v) % self.meta.devices
    }
    /// New ids owned by `device` of `server`.
    pub fn range(&self, server: u32, device: u32) -> Range<u32> {
        assert!(server < self.meta.servers && device < self.meta.devices);
        let p = (server * self.meta.devices + device) as usize;
        self.starts[p] as u32..self.starts[p + 1] as u32
    }
    /// New ids owned by `server` (all its devices, contiguous).
    pub fn server_range(&self, server: u32) -> Range<u32> {
        assert!(server < self.meta.servers);
        let d = self.meta.devices as usize;
        let s = server as usize;
        self.starts[s * d] as u32..self.starts[(s + 1) * d] as u32
    }
    /// Original id of new id `v`.
    pub fn to_original(&self, v: u32) -> u32 {
        self.new_to_old.as_slice()[v as usize]
    }
    /// New id of original id `orig`.
    pub fn to_new(&self, orig: u32) -> u32 {
        self.old_to_new.as_slice()[orig as usize]
    }
    pub fn new_to_old(&self) -> &[u32] {
        self.new_to_old.as_slice()
    }
    pub fn old_to_new(&self) -> &[u32] {
        self.old_to_new.as_slice()
    }
    /// The quality report written at partitioning time.
    pub fn quality(&self) -> &Quality {
        &self.meta.report.quality
    }
    /// Opens the relabelled dataset (graph, features, labels and splits in new ids).
    pub fn dataset(&self) -> Result<Dataset> {
        Ok(Dataset::open(self.dir.join(DATASET_DIR))?)
    }
}
