//! Errors of sampling and batching; each names the parameter or input that is wrong.

use grandis_masking::MaskingError;

#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    #[error("invalid sampler configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Masking(#[from] MaskingError),
}

pub type Result<T, E = SamplingError> = std::result::Result<T, E>;
