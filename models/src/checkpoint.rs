//! Checkpoints on disk: a directory per saved step (`root/step-00000100/`) holding named files,
//! built under a temporary name and renamed into place, then `root/latest` moved to name it, so
//! a crash at any point leaves the previous checkpoint whole and `latest` pointing at it.
//!
//! What goes into a step directory is the caller's: the GPT driver writes `model.safetensors`
//! ([`crate::safetensors`]), `optimizer.bin` ([`encode_records`]) and `state.json`.

use burn::module::ParamId;
use burn::prelude::Backend;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder, RecorderError};
use std::fs;
use std::path::{Path, PathBuf};

use crate::io::FileError;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.to_path_buf(),
        source,
    }
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
    pub fn save(&self, step: usize, files: &[(&str, &[u8])]) -> Result<PathBuf, FileError> {
        let name = format!("step-{step:08}");
        let tmp = self.root.join(format!(".{name}.tmp"));
        let dir = self.root.join(&name);
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
        }
        fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        for (file, bytes) in files {
            let path = tmp.join(file);
            crate::io::write_atomic(&path, bytes).map_err(io_err(&path))?;
        }
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }
        fs::rename(&tmp, &dir).map_err(io_err(&dir))?;
        let latest = self.root.join("latest");
        crate::io::write_atomic(&latest, name.as_bytes()).map_err(io_err(&latest))?;
        Ok(dir)
    }

    /// The directory of the latest checkpoint.
    pub fn latest(&self) -> Result<PathBuf, FileError> {
        let name =
            fs::read_to_string(self.root.join("latest")).map_err(|e| FileError::Invalid {
                path: self.root.clone(),
                reason: format!("no checkpoint here ({e}); pass the directory given to --save"),
            })?;
        let dir = self.root.join(name.trim());
        if !dir.is_dir() {
            return Err(FileError::Invalid {
                path: self.root.clone(),
                reason: format!("`latest` names {}, which is missing", dir.display()),
            });
        }
        Ok(dir)
    }
}

/// Per-parameter records (Burn's optimizer records are maps keyed by parameter).
pub type ParamRecords<R> = hashbrown::HashMap<ParamId, R>;

type Recs = BinBytesRecorder<FullPrecisionSettings>;

const RECORDS_MAGIC: &[u8; 8] = b"WFOPTv1\n";

/// Encode per-parameter records (an optimizer's state) one parameter at a time, in
/// parameter-id order. Gathering a sharded moment is a collective: every rank must walk the
/// entries in the same order, which a `HashMap`'s iteration order (seeded per process) does not
/// give.
pub fn encode_records<B: Backend, R: Record<B>>(
    records: ParamRecords<R>,
) -> Result<Vec<u8>, RecorderError> {
    let mut entries: Vec<_> = records.into_iter().collect();
    entries.sort_by_key(|(id, _)| id.to_string());
    let mut out = RECORDS_MAGIC.to_vec();
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (id, r) in entries {
        let one: ParamRecords<R> = [(id, r)].into_iter().collect();
        let bytes = Recs::new().record(one, ())?;
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(&bytes);
    }
    Ok(out)
}

/// The inverse of [`encode_records`]; a truncated or foreign file is an error, never a panic.
pub fn decode_records<B: Backend, R: Record<B>>(
    bytes: &[u8],
    device: &B::Device,
) -> Result<ParamRecords<R>, String> {
    let body = bytes
        .strip_prefix(&RECORDS_MAGIC[..])
        .ok_or("not a wildfire optimizer state (bad magic)")?;
    let word = |at: usize| -> Result<usize, String> {
        at.checked_add(8)
            .and_then(|end| body.get(at..end))
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| "truncated".to_string())
    };
    let count = word(0)?;
    let mut at = 8;
    let mut out = ParamRecords::new();
    for _ in 0..count {
        let len = word(at)?;
        let chunk = (at + 8)
            .checked_add(len)
            .and_then(|end| body.get(at + 8..end))
            .ok_or("truncated")?;
        let one: ParamRecords<R> = Recs::new()
            .load(chunk.to_vec(), device)
            .map_err(|e| e.to_string())?;
        out.extend(one);
        at += 8 + len;
    }
    if at != body.len() {
        return Err("trailing bytes".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_names_the_last_save_and_a_resave_replaces_it() {
        let root = std::env::temp_dir().join(format!("wildfire-ckpt-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let dir = CheckpointDir::new(&root);
        assert!(matches!(dir.latest(), Err(FileError::Invalid { .. })));
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

    #[test]
    fn corrupt_records_are_errors() {
        type B = burn::backend::Flex;
        let device = Default::default();
        let decode = |bytes: &[u8]| decode_records::<B, u32>(bytes, &device).map(|_| ());
        assert_eq!(
            decode(b"garbage").unwrap_err(),
            "not a wildfire optimizer state (bad magic)"
        );
        let mut huge = RECORDS_MAGIC.to_vec();
        huge.extend_from_slice(&1u64.to_le_bytes());
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(decode(&huge).unwrap_err(), "truncated");
        let empty = encode_records::<B, u32>(ParamRecords::new()).unwrap();
        assert!(decode(&empty).is_ok());
        let mut trailing = empty.clone();
        trailing.push(0);
        assert_eq!(decode(&trailing).unwrap_err(), "trailing bytes");
    }
}
