use std::path::PathBuf;

/// Everything that can go wrong while reading or writing a dataset directory.
/// Every variant names the file it is about, so that a user can act on the message alone.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a grandis array file (bad magic bytes)")]
    BadMagic { path: PathBuf },
    #[error(
        "{path}: format version {found} is not supported (this build reads version {supported})"
    )]
    BadVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("{path}: truncated: expected {expected} bytes, file has {actual}")]
    Truncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("{path}: checksum mismatch (stored {stored:016x}, computed {computed:016x}); the file is corrupt")]
    Checksum {
        path: PathBuf,
        stored: u64,
        computed: u64,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl StoreError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StoreError::Io {
            path: path.into(),
            source,
        }
    }
    pub fn invalid(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        StoreError::Invalid {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Streaming a graph out of an [`EdgeListBuilder`](crate::EdgeListBuilder) can only fail on
/// its scratch files; the other variants never reach a writer but keep their message.
impl From<crate::edges::EdgeError> for StoreError {
    fn from(e: crate::edges::EdgeError) -> Self {
        match e {
            crate::edges::EdgeError::Scratch { path, message } => {
                StoreError::Invalid { path, message }
            }
            other => StoreError::Invalid {
                path: PathBuf::from("edge list"),
                message: other.to_string(),
            },
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;
