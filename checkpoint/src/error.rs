//! The one error type of the checkpoint crate.

use std::path::PathBuf;

/// A checkpoint or weights file that cannot be written or read. Every message says what to do.
#[derive(thiserror::Error, Debug)]
pub enum Error {
    /// The file or directory is not there.
    #[error("{} not found: check the path (a checkpoint's step directory, or its root for the latest)", path.display())]
    Missing {
        /// The path that was asked for.
        path: PathBuf,
    },
    /// A file that is corrupt, truncated, or of another model or run.
    #[error("{}: {reason}", path.display())]
    Invalid {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// Reading or writing a file failed (a full disk, a permission).
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps an I/O error with the path it happened on; a missing file becomes [`Error::Missing`].
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        match source.kind() {
            std::io::ErrorKind::NotFound => Self::Missing { path: path.into() },
            _ => Self::Io {
                path: path.into(),
                source,
            },
        }
    }
}
