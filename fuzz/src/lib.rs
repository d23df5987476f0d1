//! What the fuzz targets share: a scratch directory per fuzzing process (in memory where the
//! machine has `/dev/shm`), because the parsers under test read files, as they do in use.

use std::path::PathBuf;
use std::sync::OnceLock;

/// This process's scratch directory, created once.
pub fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("grandis-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("creating the fuzz scratch directory");
        dir
    })
}

/// Writes `bytes` to `name` in the scratch directory and returns its path.
pub fn file(name: &str, bytes: &[u8]) -> PathBuf {
    let path = scratch().join(name);
    std::fs::write(&path, bytes).expect("writing a fuzz input file");
    path
}
