//! The one error type of a pretraining run.

use std::path::{Path, PathBuf};
use wildfire_models::data::DataError;
use wildfire_models::gpt::ModelError;
use wildfire_models::io::FileError;
use wildfire_models::parallelize::ParallelizeError;
use wildfire_parallel::{DistError, LaunchEnvError, LaunchError};

/// A run that cannot start or cannot go on; each message says what to do.
#[derive(thiserror::Error, Debug)]
pub enum PretrainError {
    /// Data problem.
    #[error(transparent)]
    Data(#[from] DataError),
    /// Model shape problem.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Parallelisation problem.
    #[error(transparent)]
    Parallelize(#[from] ParallelizeError),
    /// Distributed problem.
    #[error(transparent)]
    Dist(#[from] DistError),
    /// A rank failed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// A launcher variable that cannot be used.
    #[error(transparent)]
    LaunchEnv(#[from] LaunchEnvError),
    /// A bad option value.
    #[error("{0}")]
    Config(String),
    /// A checkpoint that cannot be used.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// Where.
        path: PathBuf,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// File output failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

impl From<FileError> for PretrainError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::Io { path, source } => PretrainError::Io { path, source },
            FileError::Invalid { path, reason } => PretrainError::Checkpoint { path, reason },
        }
    }
}

/// An I/O error on `path` as a [`PretrainError`].
pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PretrainError + '_ {
    move |source| PretrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}
