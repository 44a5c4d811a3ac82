//! The save half: a [`Snapshot`] holding this rank's pieces, written by a
//! [`CheckpointWriter`] in the background; rank 0 commits.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::module::{Module, Param};
use burn::optim::record::AdaptorRecord;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use wildfire_parallel::{
    DTensor, DeviceMesh, DistributedBackend, ModulePath, StateCodec, TryParamVisitor, dtensor,
    try_visit_params,
};

use super::{
    FORMAT, Metadata, PieceMeta, RankIndex, TensorMeta, box_dims, copy_box, model_key, rank_file,
    state_key,
};
use crate::Error;
use crate::{CheckpointDir, ParamRecords};

/// Reads a piece's values (on the writer thread).
type ReadPiece = Box<dyn FnOnce() -> Vec<f32> + Send>;

/// What a piece's read holds: its device buffer, or an offloaded parameter's host copy.
enum Held<P> {
    Device(P),
    Host(burn::tensor::TensorData),
}

/// A piece: where it lies, and a hold on the rank's buffer that reads its values out.
struct HostPiece {
    name: String,
    shape: Vec<usize>,
    start: Vec<usize>,
    end: Vec<usize>,
    read: ReadPiece,
}

/// This rank's pieces of a model and its optimizer state: what a save holds on to while the files
/// are written in the background. It holds each piece's buffer itself, not a copy: Burn's tensors
/// are values (an update writes into a buffer only when nothing else holds it, and makes a new
/// one otherwise), so training goes on while the writer thread reads the held buffers out — the
/// step's path pays for the references, not for a copy.
pub struct Snapshot {
    rank: usize,
    mesh: Option<DeviceMesh>,
    pieces: Vec<HostPiece>,
    times: BTreeMap<String, usize>,
}

impl Snapshot {
    /// Hold this rank's owned pieces of `model`'s parameters and, when given, of the state
    /// tensors of `optimizer` (any optimizer with a [`StateCodec`]: AdamW, Adafactor, …).
    /// Nothing is communicated or copied.
    pub fn take<B, M, X>(
        model: &M,
        optimizer: Option<ParamRecords<AdaptorRecord<X, B>>>,
    ) -> Result<Self, Error>
    where
        B: AutodiffBackend,
        B::InnerBackend: DistributedBackend,
        M: Module<B>,
        X: StateCodec<B::InnerBackend>,
    {
        Self::take_named(model, optimizer, &|path| Some(path.to_string()))
    }

    /// [`Snapshot::take`] with each parameter saved under `name(path)` (its module path in
    /// `model`), or left out where that is `None`: a pipeline stage saves its blocks under the
    /// whole model's names, and a copy of a tied parameter not at all.
    pub fn take_named<B, M, X>(
        model: &M,
        optimizer: Option<ParamRecords<AdaptorRecord<X, B>>>,
        name: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, Error>
    where
        B: AutodiffBackend,
        B::InnerBackend: DistributedBackend,
        M: Module<B>,
        X: StateCodec<B::InnerBackend>,
    {
        let mut visitor = SnapshotVisitor::<B, X> {
            name,
            records: optimizer,
            snapshot: Snapshot {
                rank: 0,
                mesh: None,
                pieces: Vec::new(),
                times: BTreeMap::new(),
            },
        };
        try_visit_params(model, &mut visitor).map_err(|reason| Error::Invalid {
            path: PathBuf::new(),
            reason,
        })?;
        Ok(visitor.snapshot)
    }

    /// Add `other`'s pieces (another module of the same rank: a pipeline rank's chunks).
    pub fn merge(&mut self, other: Snapshot) {
        if self.mesh.is_none() {
            self.rank = other.rank;
            self.mesh = other.mesh;
        }
        self.pieces.extend(other.pieces);
        self.times.extend(other.times);
    }

    /// The bytes of tensor data it holds.
    pub fn bytes(&self) -> usize {
        self.pieces
            .iter()
            .map(|p| 4 * box_dims(&p.start, &p.end).iter().product::<usize>())
            .sum()
    }

    fn add<Inner: Backend>(&mut self, name: String, t: &DTensor<Inner>) -> Result<(), String> {
        let mesh = t.device().mesh();
        let rank = t.device().rank();
        self.rank = rank;
        self.mesh.get_or_insert_with(|| mesh.clone());
        let layout = t.layout();
        if layout.has_partial() {
            return Err(format!(
                "{name} holds partial sums ({layout}); save after the optimizer step"
            ));
        }
        if !layout.owns_piece(mesh, rank) {
            return Ok(());
        }
        let shape = t.global_shape().to_vec();
        let local_box = layout.local_box(&shape, mesh, rank);
        if local_box.iter().any(|(range, _)| range.is_empty()) {
            return Ok(()); // only padding here
        }
        let extents: Vec<usize> = local_box.iter().map(|(_, e)| *e).collect();
        let lens: Vec<usize> = local_box.iter().map(|(r, _)| r.len()).collect();
        // An offloaded parameter's piece is read from its host copy, not uploaded to be read.
        let held = match t.host_data() {
            Some(data) => Held::Host(data),
            // `into_local` waits for a value still in flight (an optimizer's deferred result).
            None => Held::Device(t.clone().into_local()),
        };
        let read: ReadPiece = Box::new(move || {
            let data = match held {
                Held::Host(data) => data,
                Held::Device(local) => wildfire_parallel::internal::read_local::<Inner>(local),
            };
            let values = data.convert::<f32>().into_vec::<f32>().expect("f32 data");
            if lens == extents {
                values
            } else {
                // Without the padding rows.
                let at = vec![0; lens.len()];
                let mut out = vec![0.0; lens.iter().product()];
                copy_box(&values, &extents, &at, &mut out, &lens, &at, &lens);
                out
            }
        });
        self.pieces.push(HostPiece {
            name,
            shape,
            start: local_box.iter().map(|(r, _)| r.start).collect(),
            end: local_box.iter().map(|(r, _)| r.end).collect(),
            read,
        });
        Ok(())
    }

    /// Encode and write this rank's files into `staging`, a checksum per `chunk` bytes of each
    /// piece; returns its index.
    fn write(
        self,
        staging: &Path,
        step: usize,
        chunk: usize,
        keep: Option<&mut super::RankFiles>,
    ) -> Result<RankIndex, Error> {
        let file = rank_file(self.rank, "safetensors");
        let path = staging.join(&file);
        let io = |source| Error::Io {
            path: path.clone(),
            source,
        };
        // Each piece read out of its held buffer, checksummed and written before the next one.
        let names: Vec<(String, Vec<usize>)> = self
            .pieces
            .iter()
            .map(|p| (p.name.clone(), box_dims(&p.start, &p.end)))
            .collect();
        let mut reads: Vec<Option<ReadPiece>> = Vec::with_capacity(self.pieces.len());
        let mut crcs = vec![Vec::new(); names.len()];
        let mut pieces = Vec::with_capacity(self.pieces.len());
        for p in self.pieces {
            reads.push(Some(p.read));
            pieces.push((p.name, p.shape, p.start, p.end));
        }
        // Kept in memory too: the file's bytes copied as they are written (no read-back).
        let mut copy = keep.is_some().then(Vec::new);
        let bytes = super::write_streamed(
            &path,
            &names,
            |i| Ok(reads[i].take().expect("each piece is read once")()),
            |i, bytes| crcs[i] = bytes.chunks(chunk).map(crc32fast::hash).collect(),
            copy.as_mut(),
        )
        .map_err(io)?;
        let mut keep = keep;
        if let (Some(keep), Some(copy)) = (keep.as_mut(), copy) {
            keep.push((file.clone(), copy.into()));
        }
        let tensors = pieces
            .into_iter()
            .zip(crcs)
            .map(|((name, shape, start, end), crc)| {
                let meta = PieceMeta {
                    file: file.clone(),
                    start,
                    end,
                    crc32: None,
                    chunks: Some(super::Chunks {
                        bytes: chunk as u64,
                        crc32: crc,
                    }),
                    key: None,
                    at: None,
                    transposed: false,
                };
                (name, (shape, meta))
            })
            .collect();
        let index = RankIndex {
            format: FORMAT.into(),
            step,
            rank: self.rank,
            file,
            bytes,
            tensors,
            times: self.times,
        };
        // The index last: its presence says this rank's data is complete.
        let index_path = staging.join(rank_file(self.rank, "json"));
        let json = serde_json::to_vec_pretty(&index).expect("the index serialises");
        crate::io::write_atomic(&index_path, &json).map_err(|source| Error::Io {
            path: index_path,
            source,
        })?;
        if let Some(keep) = keep {
            keep.push((rank_file(self.rank, "json"), json.into()));
        }
        Ok(index)
    }
}

struct SnapshotVisitor<'a, B: AutodiffBackend, X: StateCodec<B::InnerBackend>> {
    name: &'a dyn Fn(&str) -> Option<String>,
    records: Option<ParamRecords<AdaptorRecord<X, B>>>,
    snapshot: Snapshot,
}

impl<B, X> TryParamVisitor<B> for SnapshotVisitor<'_, B, X>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    X: StateCodec<B::InnerBackend>,
{
    type Error = String;

    fn try_visit<const D: usize>(
        &mut self,
        path: &ModulePath,
        param: &Param<Tensor<B, D>>,
    ) -> Result<(), String> {
        let Some(path) = (self.name)(&path.name()) else {
            return Ok(());
        };
        let t = dtensor(&param.val().inner());
        self.snapshot.add(model_key(&path), &t)?;
        let Some(record) = self.records.as_mut().and_then(|r| r.remove(&param.id)) else {
            return Ok(());
        };
        let shape = t.global_shape().to_vec();
        let specs = X::state_specs(&shape);
        let state = X::encode::<D>(record.into_state::<D>()).map_err(|e| format!("{path}: {e}"))?;
        if state.tensors.len() != specs.len() {
            return Err(format!(
                "{path}: the optimizer encoded {} state tensors, its specs name {}",
                state.tensors.len(),
                specs.len()
            ));
        }
        self.snapshot.times.insert(path.clone(), state.steps);
        for (spec, tensor) in specs.iter().zip(&state.tensors) {
            // A spec this parameter does not keep is not stored.
            let Some(tensor) = tensor else { continue };
            let t = <B::InnerBackend as DistributedBackend>::dtensor(tensor);
            let want = spec.shape.of(&shape);
            if t.global_shape().to_vec() != want {
                return Err(format!(
                    "{path}: state tensor {} is {:?}, its spec says {want:?}",
                    spec.name,
                    t.global_shape()
                ));
            }
            self.snapshot.add(state_key(&path, &spec.name), &t)?;
        }
        Ok(())
    }
}

/// What a background save reports when it is done.
#[derive(Clone, Debug)]
pub struct SaveReport {
    /// The step.
    pub step: usize,
    /// The committed directory (rank 0), `None` on other ranks.
    pub dir: Option<PathBuf>,
    /// Time spent encoding and writing this rank's files.
    pub write_time: Duration,
    /// Bytes this rank wrote.
    pub bytes: u64,
}

/// Writes [`Snapshot`]s in the background, one save in flight at a time.
pub struct CheckpointWriter {
    dir: CheckpointDir,
    rank: usize,
    world_size: usize,
    commit_timeout: Duration,
    chunk_bytes: usize,
    pending: Option<JoinHandle<Result<SaveReport, Error>>>,
    /// Every save finished so far.
    done: Vec<SaveReport>,
    /// Where this rank also keeps its files of each checkpoint, and its buddy a copy.
    memory: Option<std::sync::Arc<super::MemoryCheckpoints>>,
}

impl CheckpointWriter {
    /// The writer of rank `rank` of `world_size` under `root`. Rank 0 removes the staging
    /// directories of saves that never completed (a crashed run); call it on every rank before
    /// training, so no rank has started a save yet.
    pub fn new(root: impl Into<PathBuf>, rank: usize, world_size: usize) -> Result<Self, Error> {
        let dir = CheckpointDir::new(root);
        if rank == 0 {
            dir.clear_staging()?;
        }
        Ok(Self {
            dir,
            rank,
            world_size,
            commit_timeout: Duration::from_secs(600),
            chunk_bytes: super::CHUNK_BYTES,
            pending: None,
            done: Vec::new(),
            memory: None,
        })
    }

    /// Also keep each save's files in host memory, in `store` (this rank's own, and a copy on
    /// its buddy: [`super::MemoryCheckpoints`]), for a restart that reads no file.
    pub fn with_memory(mut self, store: std::sync::Arc<super::MemoryCheckpoints>) -> Self {
        self.memory = Some(store);
        self
    }

    /// How long rank 0 waits for the other ranks' files before giving the save up (the previous
    /// checkpoint stays the latest). Default 10 minutes.
    pub fn with_commit_timeout(mut self, timeout: Duration) -> Self {
        self.commit_timeout = timeout;
        self
    }

    /// The size of the chunks each piece's checksums cover (default [`super::CHUNK_BYTES`]; rounded
    /// up to a multiple of 4 bytes): the smallest unit a resharding load reads.
    pub fn with_chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = bytes.max(1).next_multiple_of(4);
        self
    }

    /// Write `snapshot` as this rank's part of the checkpoint of `step` on a background thread;
    /// rank 0 also writes `files` (e.g. the run state) and commits once every rank's part is
    /// there. Waits for the previous save first and returns its report (or its error).
    pub fn save(
        &mut self,
        snapshot: Snapshot,
        step: usize,
        files: Vec<(String, Vec<u8>)>,
    ) -> Result<Option<SaveReport>, Error> {
        let previous = self.wait()?;
        let staging = self.dir.staging(step);
        let (dir, rank, world, timeout, chunk) = (
            self.dir.clone(),
            self.rank,
            self.world_size,
            self.commit_timeout,
            self.chunk_bytes,
        );
        let mesh = snapshot.mesh.clone().unwrap_or_else(DeviceMesh::single);
        let memory = self.memory.clone();
        self.pending = Some(std::thread::spawn(move || {
            let started = Instant::now();
            fs::create_dir_all(&staging).map_err(|source| Error::Io {
                path: staging.clone(),
                source,
            })?;
            let mut kept = memory.as_ref().map(|_| super::RankFiles::new());
            let index = snapshot.write(&staging, step, chunk, kept.as_mut())?;
            let write_time = started.elapsed();
            let committed = if rank == 0 {
                for (name, bytes) in &files {
                    let path = staging.join(name);
                    crate::io::write_atomic(&path, bytes)
                        .map_err(|source| Error::Io { path, source })?;
                }
                let (committed, metadata) = commit(&dir, &staging, step, world, mesh, timeout)?;
                if let Some(kept) = kept.as_mut() {
                    kept.extend(files.into_iter().map(|(name, bytes)| (name, bytes.into())));
                    kept.push(("metadata.json".into(), metadata.into()));
                }
                Some(committed)
            } else {
                None
            };
            if let (Some(store), Some(kept)) = (memory, kept) {
                store.put(step, world, rank, kept);
            }
            Ok(SaveReport {
                step,
                dir: committed,
                write_time,
                bytes: index.bytes,
            })
        }));
        Ok(previous)
    }

    /// Wait for the save in flight, if any; its report (logged, and kept in
    /// [`CheckpointWriter::reports`]), or its error.
    pub fn wait(&mut self) -> Result<Option<SaveReport>, Error> {
        let Some(handle) = self.pending.take() else {
            return Ok(None);
        };
        let report = handle.join().map_err(|_| Error::Invalid {
            path: self.dir.root().to_path_buf(),
            reason: "the checkpoint writer thread panicked".into(),
        })??;
        if let Some(dir) = &report.dir {
            tracing::info!(
                "saved checkpoint {} ({} bytes from rank 0, written in {:.1} ms in the background)",
                dir.display(),
                report.bytes,
                report.write_time.as_secs_f64() * 1e3
            );
        }
        self.done.push(report.clone());
        Ok(Some(report))
    }

    /// The reports of the saves finished so far, oldest first.
    pub fn reports(&self) -> &[SaveReport] {
        &self.done
    }
}

/// A writer dropped with a save in flight (its rank failed, or stopped early) waits for that
/// write to end: a rank of this process never leaves a save half-written behind it, so a restart
/// in the same process (`--max-restarts`) finds the save committed, or its staging directory
/// whole and removable. A failed write is logged; the previous checkpoint stays the latest.
impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        if self.pending.is_some()
            && let Err(e) = self.wait()
        {
            tracing::warn!("checkpoint write in flight when its writer was dropped: {e}");
        }
    }
}

/// Rank 0: wait for every rank's index, merge them into `metadata.json`, rename the staging
/// directory into place and move `latest`. Returns the step's directory and the metadata's
/// bytes.
fn commit(
    dir: &CheckpointDir,
    staging: &Path,
    step: usize,
    world: usize,
    mesh: DeviceMesh,
    timeout: Duration,
) -> Result<(PathBuf, Vec<u8>), Error> {
    let started = Instant::now();
    let mut indexes = Vec::with_capacity(world);
    for rank in 0..world {
        let path = staging.join(rank_file(rank, "json"));
        let index: RankIndex = loop {
            match fs::read(&path) {
                Ok(bytes) => {
                    break serde_json::from_slice(&bytes).map_err(|e| Error::Invalid {
                        path: path.clone(),
                        reason: format!("a rank's index is corrupt: {e}"),
                    })?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    if started.elapsed() > timeout {
                        return Err(Error::Invalid {
                            path: staging.to_path_buf(),
                            reason: format!(
                                "rank {rank} did not finish its part of the step-{step} checkpoint \
                                 within {timeout:?}; the previous checkpoint stays the latest"
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(source) => return Err(Error::Io { path, source }),
            }
        };
        if index.step != step || index.format != FORMAT {
            return Err(Error::Invalid {
                path,
                reason: format!(
                    "the index is of step {} ({}), expected step {step} ({FORMAT})",
                    index.step, index.format
                ),
            });
        }
        indexes.push(index);
    }
    let mut meta = Metadata {
        format: FORMAT.into(),
        step,
        mesh,
        files: BTreeMap::new(),
        tensors: BTreeMap::new(),
        optimizer_steps: BTreeMap::new(),
    };
    for index in indexes {
        meta.files.insert(index.file, index.bytes);
        meta.optimizer_steps.extend(index.times);
        for (name, (shape, piece)) in index.tensors {
            meta.tensors
                .entry(name)
                .or_insert_with(|| TensorMeta {
                    shape,
                    dtype: "F32".into(),
                    pieces: Vec::new(),
                    rows_padded: false,
                })
                .pieces
                .push(piece);
        }
    }
    let path = staging.join("metadata.json");
    let json = serde_json::to_vec_pretty(&meta).expect("the metadata serialises");
    crate::io::write_atomic(&path, &json).map_err(|source| Error::Io { path, source })?;
    Ok((dir.commit(step)?, json))
}
