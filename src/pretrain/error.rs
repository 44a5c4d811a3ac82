//! The one error type of a pretraining run.

use std::path::{Path, PathBuf};

/// A run that cannot start or cannot go on; each message says what to do.
#[derive(thiserror::Error, Debug)]
pub enum PretrainError {
    /// The model, its data or its parallelisation (`wildfire_models`).
    #[error(transparent)]
    Models(wildfire_models::Error),
    /// The parallel layer: a mesh, a collective, a rank that failed, a launcher variable.
    #[error(transparent)]
    Parallel(#[from] wildfire_parallel::Error),
    /// Training cannot go on (the loss or gradients stayed non-finite).
    #[error(transparent)]
    Training(wildfire_engine::Error),
    /// A bad option value (the models crate's own `Config` errors included).
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

/// A file error of the models crate is the run's own `Io` or `Checkpoint`, so a caller matches
/// one variant for every file the run reads or writes.
impl From<wildfire_models::Error> for PretrainError {
    fn from(e: wildfire_models::Error) -> Self {
        use wildfire_models::Error as M;
        match e {
            M::Io { path, source } => PretrainError::Io { path, source },
            M::Invalid { path, reason } => PretrainError::Checkpoint { path, reason },
            M::Parallel(e) => PretrainError::Parallel(e),
            M::Config(reason) => PretrainError::Config(reason),
            M::Checkpoint(e) => e.into(),
            e => PretrainError::Models(e),
        }
    }
}

/// A checkpoint error is the run's `Io` or `Checkpoint`, as the models crate's file errors.
impl From<wildfire_checkpoint::Error> for PretrainError {
    fn from(e: wildfire_checkpoint::Error) -> Self {
        use wildfire_checkpoint::Error as C;
        match e {
            C::Io { path, source } => PretrainError::Io { path, source },
            C::Invalid { path, reason } => PretrainError::Checkpoint { path, reason },
            C::Missing { path } => PretrainError::Checkpoint {
                path,
                reason: "not found: name a step directory, or the root for its latest step".into(),
            },
        }
    }
}

/// The engine's parallel errors are the run's `Parallel`.
impl From<wildfire_engine::Error> for PretrainError {
    fn from(e: wildfire_engine::Error) -> Self {
        match e {
            wildfire_engine::Error::Parallel(e) => PretrainError::Parallel(e),
            e => PretrainError::Training(e),
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
