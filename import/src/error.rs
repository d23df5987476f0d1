//! [`ImportError`]: what can go wrong in an import or an export, each naming its file.

use std::path::PathBuf;

/// Everything that can go wrong in an import; every variant names the offending file.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: required file is missing ({what})")]
    Missing { path: PathBuf, what: String },
    #[error("{path}: line {line}: {message}")]
    Line {
        path: PathBuf,
        line: u64,
        message: String,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error(transparent)]
    Npy(#[from] grandis_npy::NpyError),
    #[error(transparent)]
    Store(#[from] grandis_store::StoreError),
}

impl ImportError {
    pub(crate) fn invalid(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        ImportError::Invalid {
            path: path.into(),
            message: message.into(),
        }
    }
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ImportError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = ImportError> = std::result::Result<T, E>;
