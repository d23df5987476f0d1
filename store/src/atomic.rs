//! Outputs that appear whole or not at all: build in a hidden sibling, then rename.

use std::path::{Path, PathBuf};

use crate::error::{Result, StoreError};

fn hidden_sibling(target: &Path, tag: &str) -> Result<PathBuf> {
    let name = target
        .file_name()
        .ok_or_else(|| StoreError::invalid(target, "output path has no final component"))?
        .to_string_lossy()
        .into_owned();
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    Ok(parent.join(format!(".{name}.{tag}-{}-{nanos}", std::process::id())))
}

/// Removes what writers of `target` that died mid-write (killed, out of power) left behind:
/// hidden `tmp` and `old` siblings whose writer process no longer exists. Siblings of live
/// processes are another writer's work in progress and stay.
fn sweep_stale_siblings(target: &Path) {
    let (Some(name), Some(parent)) = (target.file_name(), target.parent()) else {
        return;
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let prefix = format!(".{}.", name.to_string_lossy());
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = file.strip_prefix(&prefix) else {
            continue;
        };
        let Some(pid) = ["tmp-", "old-"]
            .iter()
            .find_map(|tag| rest.strip_prefix(tag))
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !process_alive(pid) {
            let path = entry.path();
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            if removed.is_ok() {
                tracing::info!("removed {}, left by a writer that died", path.display());
            }
        }
    }
}

/// Whether a process with this id exists (Linux: `/proc/PID`). Elsewhere, assumed alive, so
/// nothing is ever removed by mistake.
fn process_alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    let proc = Path::new("/proc");
    !proc.join("self").exists() || proc.join(pid.to_string()).exists()
}

/// A directory under construction. It becomes visible at `target` only on [`commit`];
/// dropping it uncommitted (an error, a panic) removes everything written so far.
///
/// [`commit`]: AtomicDir::commit
pub struct AtomicDir {
    staging: PathBuf,
    target: PathBuf,
    overwrite: bool,
    committed: bool,
}

impl AtomicDir {
    /// Refuses an existing `target` unless `overwrite`; the old one is only replaced at commit.
    pub fn create(target: impl AsRef<Path>, overwrite: bool) -> Result<AtomicDir> {
        let target = target.as_ref().to_path_buf();
        if target.exists() && !overwrite {
            return Err(StoreError::invalid(
                &target,
                "already exists (pass --force to replace it)",
            ));
        }
        if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| StoreError::io(parent, e))?;
        }
        sweep_stale_siblings(&target);
        let staging = hidden_sibling(&target, "tmp")?;
        std::fs::create_dir(&staging).map_err(|e| StoreError::io(&staging, e))?;
        Ok(AtomicDir {
            staging,
            target,
            overwrite,
            committed: false,
        })
    }

    /// Where to write the contents.
    pub fn path(&self) -> &Path {
        &self.staging
    }

    pub fn target(&self) -> &Path {
        &self.target
    }

    pub fn commit(mut self) -> Result<PathBuf> {
        let io = |p: &Path, e| StoreError::io(p, e);
        if self.target.exists() {
            if !self.overwrite {
                return Err(StoreError::invalid(&self.target, "appeared while writing"));
            }
            let old = hidden_sibling(&self.target, "old")?;
            std::fs::rename(&self.target, &old).map_err(|e| io(&self.target, e))?;
            std::fs::rename(&self.staging, &self.target).map_err(|e| io(&self.target, e))?;
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(&self.staging, &self.target).map_err(|e| io(&self.target, e))?;
        }
        self.committed = true;
        Ok(self.target.clone())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Writes a file through a temporary sibling and a rename, so readers never see half of it.
pub fn write_file_atomic(target: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    write_file_atomic_with(target, |file| {
        use std::io::Write;
        file.write_all(bytes)
    })
}

/// Like [`write_file_atomic`], with the contents produced by `write`.
pub fn write_file_atomic_with(
    target: impl AsRef<Path>,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> Result<()> {
    use std::io::Write;
    let target = target.as_ref();
    if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| StoreError::io(parent, e))?;
    }
    sweep_stale_siblings(target);
    let staging = hidden_sibling(target, "tmp")?;
    let result = (|| {
        let file = std::fs::File::create(&staging)?;
        let mut out = std::io::BufWriter::new(file);
        write(&mut out)?;
        out.flush()?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&staging, target)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&staging);
        return Err(StoreError::io(target, e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftovers_of_dead_writers_are_swept_and_live_ones_kept() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("ckpt.safetensors");
        // Process ids never exceed 2^22 on Linux: 999999999 is a writer that died.
        let dead = root.path().join(".ckpt.safetensors.tmp-999999999-12");
        let dead_dir = root.path().join(".ckpt.safetensors.old-999999999-3");
        let live = root
            .path()
            .join(format!(".ckpt.safetensors.tmp-{}-5", std::process::id()));
        let other = root.path().join(".other.tmp-999999999-1");
        std::fs::write(&dead, b"half").unwrap();
        std::fs::create_dir(&dead_dir).unwrap();
        std::fs::write(&live, b"mine").unwrap();
        std::fs::write(&other, b"not ours").unwrap();
        write_file_atomic(&target, b"whole").unwrap();
        assert!(!dead.exists() && !dead_dir.exists());
        assert!(live.exists() && other.exists());
        assert_eq!(std::fs::read(&target).unwrap(), b"whole");
    }

    #[test]
    fn uncommitted_directory_leaves_nothing() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("out");
        {
            let dir = AtomicDir::create(&target, false).unwrap();
            std::fs::write(dir.path().join("x"), b"1").unwrap();
        }
        assert!(!target.exists());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }

    #[test]
    fn commit_and_overwrite() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("out");
        let dir = AtomicDir::create(&target, false).unwrap();
        std::fs::write(dir.path().join("x"), b"1").unwrap();
        dir.commit().unwrap();
        assert!(AtomicDir::create(&target, false).is_err());
        let dir = AtomicDir::create(&target, true).unwrap();
        std::fs::write(dir.path().join("y"), b"2").unwrap();
        dir.commit().unwrap();
        assert!(target.join("y").exists() && !target.join("x").exists());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    }

    #[test]
    fn atomic_file_write() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("f.bin");
        write_file_atomic(&target, b"hello").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"hello");
        let err = write_file_atomic_with(&target, |_| Err(std::io::Error::other("boom")));
        assert!(err.is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"hello");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    }
}
