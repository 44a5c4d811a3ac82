//! Checkpoints on disk: a directory per saved step (`root/step-00000100/`) holding named files,
//! built under a temporary name and renamed into place, then `root/latest` moved to name it, so
//! a crash at any point leaves the previous checkpoint whole and `latest` pointing at it.
//!
//! What goes into a step directory is the caller's: the distributed checkpoint ([`crate::dcp`])
//! writes every rank's pieces and the metadata, the GPT driver adds `state.json`.

use burn::module::ParamId;
use std::fs;
use std::path::{Path, PathBuf};

use crate::Error;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn step_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// The checkpoints of one run, under `root`.
#[derive(Clone, Debug)]
pub struct CheckpointDir {
    root: PathBuf,
}

impl CheckpointDir {
    /// The checkpoints under `root` (created on the first save).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Write `files` (name, bytes) as the checkpoint of `step` and make it the latest; returns
    /// its directory. Each file is synced, the directory renamed into place, `latest` moved last
    /// (each step atomic).
    pub fn save(&self, step: usize, files: &[(&str, &[u8])]) -> Result<PathBuf, Error> {
        let tmp = self.staging(step);
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
        }
        fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        for (file, bytes) in files {
            let path = tmp.join(file);
            crate::io::write_atomic(&path, bytes).map_err(io_err(&path))?;
        }
        self.commit(step)
    }

    /// The directory the checkpoint of `step` is built in before [`CheckpointDir::commit`].
    pub fn staging(&self, step: usize) -> PathBuf {
        self.root.join(format!(".{}.tmp", step_name(step)))
    }

    /// Rename the staging directory of `step` into place and move `latest` to it; returns the
    /// step's directory.
    pub fn commit(&self, step: usize) -> Result<PathBuf, Error> {
        let name = step_name(step);
        let (tmp, dir) = (self.staging(step), self.root.join(&name));
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }
        fs::rename(&tmp, &dir).map_err(io_err(&dir))?;
        let latest = self.root.join("latest");
        crate::io::write_atomic(&latest, name.as_bytes()).map_err(io_err(&latest))?;
        Ok(dir)
    }

    /// Remove the staging directories of saves that never committed (a run that crashed).
    pub fn clear_staging(&self) -> Result<(), Error> {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return Ok(()); // nothing saved yet
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(".step-") && name.ends_with(".tmp") {
                let path = entry.path();
                fs::remove_dir_all(&path).map_err(io_err(&path))?;
            }
        }
        Ok(())
    }

    /// The directory of the latest checkpoint.
    pub fn latest(&self) -> Result<PathBuf, Error> {
        let name = fs::read_to_string(self.root.join("latest")).map_err(|e| Error::Invalid {
            path: self.root.clone(),
            reason: format!("no checkpoint here ({e}); pass the directory given to --save"),
        })?;
        let dir = self.root.join(name.trim());
        if !dir.is_dir() {
            return Err(Error::Invalid {
                path: self.root.clone(),
                reason: format!("`latest` names {}, which is missing", dir.display()),
            });
        }
        Ok(dir)
    }

    /// The directory of the checkpoint of `step`, which must have been committed.
    pub fn at(&self, step: usize) -> Result<PathBuf, Error> {
        let dir = self.root.join(step_name(step));
        if !dir.is_dir() {
            return Err(Error::Invalid {
                path: self.root.clone(),
                reason: format!(
                    "no checkpoint of step {step} here ({} is missing)",
                    dir.display()
                ),
            });
        }
        Ok(dir)
    }
}

/// Per-parameter records (Burn's optimizer records are maps keyed by parameter).
pub type ParamRecords<R> = hashbrown::HashMap<ParamId, R>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_names_the_last_save_and_a_resave_replaces_it() {
        let root = std::env::temp_dir().join(format!("wildfire-ckpt-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let dir = CheckpointDir::new(&root);
        assert!(matches!(dir.latest(), Err(Error::Invalid { .. })));
        dir.save(1, &[("a", b"one")]).unwrap();
        let two = dir.save(2, &[("a", b"two")]).unwrap();
        assert_eq!(dir.latest().unwrap(), two);
        dir.save(2, &[("a", b"again")]).unwrap();
        assert_eq!(fs::read(two.join("a")).unwrap(), b"again");
        let names: Vec<_> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.contains("tmp")), "{names:?}");
        fs::remove_dir_all(&root).unwrap();
    }
}
