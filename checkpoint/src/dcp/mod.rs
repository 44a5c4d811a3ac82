//! Distributed checkpoints: every rank writes only its own pieces of the parameters and of the
//! optimizer state, in parallel and with no collective; one metadata file records every
//! tensor's global shape and where each piece lies. Loading reshards: a checkpoint written on one
//! mesh and strategy loads onto another, each rank reading (memory-mapped) only the pieces that
//! overlap its own, each piece checked against its CRC-32.
//!
//! On disk, the checkpoint of step `N` under `root` (see [`crate::CheckpointDir`]):
//!
//! ```text
//! root/step-0000000N/
//!   metadata.json            format, step, the saving mesh, files and their sizes, and per
//!                            tensor its shape and pieces (file, box, CRC-32), AdamW's step counts
//!   rank-00000.safetensors   rank 0's pieces, named like the tensors:
//!                            model/<path>, optim/<path>/moment_1, optim/<path>/moment_2
//!   rank-00000.json          rank 0's index (merged into metadata.json by the commit)
//!   …                        one pair per rank
//!   state.json               the caller's run state (written by rank 0)
//! root/latest                names the newest complete step directory
//! ```
//!
//! A piece is saved by the one rank that owns it ([`wildfire_parallel::Layout::owns_piece`]),
//! without its padding, so every element is on disk once. The save is in two halves: a
//! [`Snapshot`] takes a hold on this rank's pieces (the only part on the training step's path: no
//! copy, the tensors being values), then a [`CheckpointWriter`] reads them out and writes them on
//! a background thread. Rank 0's thread then
//! waits for every rank's index, writes `metadata.json`, renames the staging directory into place
//! and moves `latest` last: a rank that dies mid-save leaves the previous checkpoint the latest.

use crate::Error;
use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use wildfire_parallel::{DeviceMesh, for_each_row};

mod load;
mod memory;
mod save;

pub use load::{HeaderEntry, Reader, open_safetensors, transpose};

pub use load::{Checkpoint, MemoryFiles};
pub use memory::{MemoryCheckpoints, RankFiles};
pub use save::{CheckpointWriter, SaveReport, Snapshot};

/// The format tag of `metadata.json` and the rank indexes.
pub const FORMAT: &str = "wildfire-dcp/1";

/// One saved piece of a tensor: the box of global indices it holds, where it is, its checksum.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct PieceMeta {
    /// The file (in the step directory) holding it, under the tensor's name.
    pub file: String,
    /// First global index per dimension.
    pub start: Vec<usize>,
    /// One past the last global index per dimension.
    pub end: Vec<usize>,
    /// CRC-32 of its bytes (little-endian f32, row-major), for checkpoints written before
    /// [`PieceMeta::chunks`]; `None` otherwise and for a file written elsewhere (an imported
    /// Hugging Face file).
    #[serde(default)]
    pub crc32: Option<u32>,
    /// CRC-32s of its bytes in chunks (the last one shorter): a rank that needs part of the piece
    /// reads and checks only the chunks holding it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<Chunks>,
    /// Its name in the file, when not the tensor's (an imported file's own names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Where the piece starts inside the tensor stored in the file, when it is a box of a larger
    /// stored tensor (an imported file whose columns the model keeps in another order); `None`:
    /// the stored tensor is the piece.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Vec<usize>>,
    /// The stored tensor holds the piece transposed: a 2-D weight an imported file keeps as
    /// `[out, in]` (PyTorch's `nn.Linear`) for a model that keeps `[in, out]` (Burn's `Linear`);
    /// `start`, `end` and `at` are in the model's order.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transposed: bool,
}

/// A piece's checksums, one per chunk of its bytes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Chunks {
    /// The chunk size in bytes (a multiple of 4).
    pub bytes: u64,
    /// CRC-32 of each chunk, in order.
    pub crc32: Vec<u32>,
}

/// The checksum chunk of a save: 1 MiB (PyTorch DCP checks nothing; a 124M-parameter model's
/// state has about 1,500 of them).
pub const CHUNK_BYTES: usize = 1 << 20;

/// A tensor of the checkpoint: its global shape and its pieces.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TensorMeta {
    /// Global shape.
    pub shape: Vec<usize>,
    /// Element type on disk (always `F32`: master weights and optimizer state).
    pub dtype: String,
    /// The pieces, which together cover the tensor once.
    pub pieces: Vec<PieceMeta>,
    /// The model's tensor may have another number of rows (dim 0) than `shape`: rows it has
    /// beyond these load as zeros (a vocabulary padded for tensor parallelism), rows it lacks are
    /// dropped (a shorter context).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rows_padded: bool,
}

/// What one rank wrote: merged into [`Metadata`] by the commit.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(crate) struct RankIndex {
    pub(crate) format: String,
    pub(crate) step: usize,
    pub(crate) rank: usize,
    pub(crate) file: String,
    pub(crate) bytes: u64,
    pub(crate) tensors: BTreeMap<String, (Vec<usize>, PieceMeta)>,
    pub(crate) times: BTreeMap<String, usize>,
}

/// `metadata.json`: everything a loader needs to find any element of any tensor.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Metadata {
    /// [`FORMAT`].
    pub format: String,
    /// The step the checkpoint was taken after.
    pub step: usize,
    /// The mesh it was written on (loading does not need the same one).
    pub mesh: DeviceMesh,
    /// Every data file and its size in bytes (a shorter file is truncated).
    pub files: BTreeMap<String, u64>,
    /// Every tensor by name (`model/<path>`, `optim/<path>/<state>` per
    /// [`wildfire_parallel::StateSpec`] of the optimizer).
    pub tensors: BTreeMap<String, TensorMeta>,
    /// The optimizer's step count per parameter path.
    pub optimizer_steps: BTreeMap<String, usize>,
}

pub(crate) fn model_key(path: &str) -> String {
    format!("model/{path}")
}

/// The name of state tensor `name` ([`wildfire_parallel::StateSpec::name`]) of parameter `path`.
pub(crate) fn state_key(path: &str, name: &str) -> String {
    format!("optim/{path}/{name}")
}

pub(crate) fn rank_file(rank: usize, ext: &str) -> String {
    format!("rank-{rank:05}.{ext}")
}

/// `state` as the JSON file `name` that rank 0 adds beside its pieces (the `files` of
/// [`CheckpointWriter::save`]: a run's step, configuration, scaler); nothing on the other ranks.
pub fn state_file<T: Serialize>(rank: usize, name: &str, state: &T) -> Vec<(String, Vec<u8>)> {
    if rank != 0 {
        return Vec::new();
    }
    let json = serde_json::to_vec_pretty(state).expect("a run state serialises to JSON");
    vec![(name.to_string(), json)]
}

/// The JSON file `name` of the checkpoint directory `dir` ([`state_file`]): missing, an I/O
/// error; unreadable as `T`, [`Error::Invalid`] naming the file.
pub fn read_state_file<T: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> Result<T, Error> {
    let path = dir.join(name);
    let bytes = std::fs::read(&path).map_err(|source| Error::io(&path, source))?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Invalid {
        path,
        reason: format!("{name} is corrupt: {e}"),
    })
}

/// Write a safetensors file of F32 tensors at `path` atomically, streaming: the header from the
/// names and shapes, then each tensor's values as `next(i)` gives them (one tensor in memory at
/// a time), each also passed to `seen(i, bytes)` (for a checksum); with `copy`, the file's bytes
/// are also left there (a checkpoint kept in memory, without reading the file back). Returns the
/// file's length.
pub fn write_streamed(
    path: &std::path::Path,
    tensors: &[(String, Vec<usize>)],
    mut next: impl FnMut(usize) -> std::io::Result<Vec<f32>>,
    mut seen: impl FnMut(usize, &[u8]),
    mut copy: Option<&mut Vec<u8>>,
) -> std::io::Result<u64> {
    use std::io::Write;
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|(name, shape)| {
            let bytes = 4 * shape.iter().product::<usize>();
            offset += bytes;
            let info = safetensors::tensor::TensorInfo {
                dtype: safetensors::Dtype::F32,
                shape: shape.clone(),
                data_offsets: (offset - bytes, offset),
            };
            (name.clone(), info)
        })
        .collect();
    let meta = safetensors::tensor::Metadata::new(None, infos).map_err(std::io::Error::other)?;
    let mut header = serde_json::to_vec(&meta).map_err(std::io::Error::other)?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let word = (header.len() as u64).to_le_bytes();
    if let Some(copy) = copy.as_deref_mut() {
        copy.clear();
        copy.reserve_exact(8 + header.len() + offset);
        copy.extend_from_slice(&word);
        copy.extend_from_slice(&header);
    }
    crate::io::write_atomic_with(path, |file| {
        file.write_all(&word)?;
        file.write_all(&header)?;
        for i in 0..tensors.len() {
            let values = next(i)?;
            let bytes = le_bytes(&values);
            seen(i, &bytes);
            if let Some(copy) = copy.as_deref_mut() {
                copy.extend_from_slice(&bytes);
            }
            file.write_all(&bytes)?;
        }
        Ok(())
    })?;
    Ok(8 + header.len() as u64 + offset as u64)
}

/// `values` as little-endian bytes (borrowed on a little-endian machine).
pub fn le_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(values))
    } else {
        std::borrow::Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Copy the box `size` from `src` (row-major, shape `src_shape`, box at `src_at`) to `dst`
/// (shape `dst_shape`, box at `dst_at`), a contiguous run per innermost row.
pub fn copy_box(
    src: &[f32],
    src_shape: &[usize],
    src_at: &[usize],
    dst: &mut [f32],
    dst_shape: &[usize],
    dst_at: &[usize],
    size: &[usize],
) {
    let flat = |shape: &[usize], at: &[usize], row: &[usize]| {
        (0..size.len()).fold(0, |flat, i| {
            flat * shape[i] + at[i] + row.get(i).copied().unwrap_or(0)
        })
    };
    for_each_row(size, |row| {
        let (so, doff) = (flat(src_shape, src_at, row), flat(dst_shape, dst_at, row));
        let run = size.last().copied().unwrap_or(1);
        dst[doff..doff + run].copy_from_slice(&src[so..so + run]);
    });
}

/// The size of the box `start..end` per dimension.
pub fn box_dims(start: &[usize], end: &[usize]) -> Vec<usize> {
    start.iter().zip(end).map(|(s, e)| e - s).collect()
}

#[cfg(test)]
mod tests {
    use super::copy_box;

    #[test]
    fn copy_box_moves_a_sub_box() {
        // a 3×4 source, its [1..3, 1..3] box into a 2×3 destination at [0, 1]
        let src: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let mut dst = vec![0.0; 6];
        copy_box(&src, &[3, 4], &[1, 1], &mut dst, &[2, 3], &[0, 1], &[2, 2]);
        assert_eq!(dst, vec![0.0, 5.0, 6.0, 0.0, 9.0, 10.0]);
        let mut scalar = vec![0.0];
        copy_box(&[7.0], &[], &[], &mut scalar, &[], &[], &[]);
        assert_eq!(scalar, vec![7.0]);
    }
}
