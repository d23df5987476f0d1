//! Verifying files once per file version (a dataset, a partition directory). A checksum pass
//! reads every byte of a dataset (tens of GB for a billion edges), so a daemon that trains
//! many jobs on one dataset keeps a record of the file versions it verified: a file's path,
//! size, modification time and inode. A file whose version is in the record is not read
//! again; one that changed in any of those (rewritten, replaced, touched) is. A file
//! rewritten in place with its size, time and inode restored would escape: the record is a
//! cache of verification, not a signature.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, MANIFEST};
use crate::error::{Result, StoreError};

/// Versions a record keeps (the most recent): a daemon's datasets, with room to spare.
const RECORD_LIMIT: usize = 4096;

/// One file as it was when verified.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct FileVersion {
    path: PathBuf,
    size: u64,
    modified_ns: u128,
    inode: u64,
}

impl FileVersion {
    fn of(path: &Path) -> Result<FileVersion> {
        let meta = std::fs::metadata(path).map_err(|e| StoreError::io(path, e))?;
        let modified_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(&meta);
        #[cfg(not(unix))]
        let inode = 0;
        Ok(FileVersion {
            path: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
            size: meta.len(),
            modified_ns,
            inode,
        })
    }
}

/// What [`Dataset::verify_once`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verification {
    /// Every file was read and its checksum and contents checked (and is now recorded).
    Verified,
    /// Every file's version was in the record: nothing was read.
    Remembered,
}

/// Runs `verify` unless every one of `files` is in the record at `record` (a JSON file the
/// caller owns, created when missing) at its current version, and records their versions
/// after a pass. The versions are taken before verifying, so a file changed meanwhile is
/// verified again next time; a damaged record is verified over (and rewritten), never
/// trusted; a failed verification records nothing.
pub fn verify_once<E: From<StoreError>>(
    record: &Path,
    files: &[PathBuf],
    verify: impl FnOnce() -> std::result::Result<(), E>,
) -> std::result::Result<Verification, E> {
    let versions = files
        .iter()
        .map(|p| FileVersion::of(p))
        .collect::<Result<Vec<_>>>()?;
    let mut known: Vec<FileVersion> = std::fs::read(record)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    if versions.iter().all(|v| known.contains(v)) {
        return Ok(Verification::Remembered);
    }
    verify()?;
    known.retain(|k| !versions.iter().any(|v| v.path == k.path));
    known.extend(versions);
    if known.len() > RECORD_LIMIT {
        known.drain(..known.len() - RECORD_LIMIT);
    }
    let bytes = serde_json::to_vec_pretty(&known)
        .map_err(|e| StoreError::invalid(record, format!("writing the record: {e}")))?;
    crate::write_file_atomic(record, &bytes)?;
    Ok(Verification::Verified)
}

impl Dataset {
    /// Checks the dataset's structure (every use: it guards every index into the graph),
    /// then the rest of [`Dataset::verify`] (checksums, finite features) unless every file's
    /// current version is in the record at `record` ([`verify_once`]).
    pub fn verify_once(&self, record: &Path) -> Result<Verification> {
        self.check_structure()?;
        let mut files = vec![self.dir().join(MANIFEST)];
        files.extend(self.array_paths());
        verify_once(record, &files, || {
            self.verify_checksums()?;
            self.check_finite_features()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EdgeOptions, InMemoryDataset, Split};

    fn write(dir: &Path) -> Dataset {
        let graph = crate::graph_from_edges(
            40,
            (0..40u32).map(|v| (v, (v * 7 + 1) % 40)),
            EdgeOptions {
                symmetrize: true,
                ..Default::default()
            },
        )
        .unwrap();
        InMemoryDataset {
            name: "v".into(),
            graph,
            features: (0..160).map(|i| i as f32).collect(),
            feature_dim: 4,
            labels: (0..40).map(|v| v % 3).collect(),
            num_classes: 3,
            split: Split {
                train: (0..20).collect(),
                val: (20..30).collect(),
                test: (30..40).collect(),
            },
            types: None,
        }
        .write(dir, false)
        .unwrap()
    }

    /// A dataset is verified once per file version: the second use reads nothing, a flipped
    /// byte (a new version of the file) is verified again and refused by its checksum, and a
    /// damaged record is verified over.
    #[test]
    fn verified_once_per_file_version_and_flips_are_caught() {
        let root = tempfile::tempdir().unwrap();
        let record = root.path().join("verified.json");
        let ds = write(&root.path().join("d"));
        assert_eq!(ds.verify_once(&record).unwrap(), Verification::Verified);
        assert_eq!(ds.verify_once(&record).unwrap(), Verification::Remembered);
        drop(ds);

        // Flip one feature byte (the structure stays valid: only the checksum can tell).
        let features = root.path().join("d").join("features.f32");
        let mut bytes = std::fs::read(&features).unwrap();
        let at = bytes.len() - 3;
        bytes[at] ^= 0x01;
        std::fs::write(&features, &bytes).unwrap();
        let ds = Dataset::open(root.path().join("d")).unwrap();
        let err = ds.verify_once(&record).unwrap_err().to_string();
        assert!(
            err.contains("features.f32") && err.contains("checksum mismatch"),
            "{err}"
        );
        // Still refused next time: a failed verification records nothing.
        assert!(ds.verify_once(&record).is_err());
        drop(ds);

        bytes[at] ^= 0x01;
        std::fs::write(&features, &bytes).unwrap();
        std::fs::write(&record, b"{ not json").unwrap();
        let ds = Dataset::open(root.path().join("d")).unwrap();
        assert_eq!(ds.verify_once(&record).unwrap(), Verification::Verified);
        assert_eq!(ds.verify_once(&record).unwrap(), Verification::Remembered);
    }
}
