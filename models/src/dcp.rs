//! Distributed checkpoints: every rank writes only its own pieces of the parameters and of the
//! optimizer state, in parallel and with no collective; one metadata file records every
//! tensor's global shape and where each piece lies. Loading reshards: a checkpoint written on one
//! mesh and strategy loads onto another, each rank reading (memory-mapped) only the pieces that
//! overlap its own, each piece checked against its CRC-32.
//!
//! On disk, the checkpoint of step `N` under `root` (see [`CheckpointDir`]):
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
//! [`Snapshot`] copies this rank's pieces to host memory (the only part on the training step's
//! path), then a [`CheckpointWriter`] writes them on a background thread. Rank 0's thread then
//! waits for every rank's index, writes `metadata.json`, renames the staging directory into place
//! and moves `latest` last: a rank that dies mid-save leaves the previous checkpoint the latest.

use std::any::Any;
use std::collections::BTreeMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::SimpleOptimizer;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamWState, AdaptiveMomentumState};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use serde::{Deserialize, Serialize};
use wildfire_parallel::{
    DTensor, DeviceMesh, DistributedBackend, ModulePath, dtensor, from_dtensor,
};

use crate::Error;
use crate::checkpoint::{CheckpointDir, ParamRecords};

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
    /// CRC-32 of its bytes (little-endian f32, row-major).
    pub crc32: u32,
}

/// A tensor of the checkpoint: its global shape and its pieces.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TensorMeta {
    /// Global shape.
    pub shape: Vec<usize>,
    /// Element type on disk (always `F32`: master weights and optimizer state).
    pub dtype: String,
    /// The pieces, which together cover the tensor once.
    pub pieces: Vec<PieceMeta>,
}

/// What one rank wrote: merged into [`Metadata`] by the commit.
#[derive(Serialize, Deserialize, Clone, Debug)]
struct RankIndex {
    format: String,
    step: usize,
    rank: usize,
    file: String,
    bytes: u64,
    tensors: BTreeMap<String, (Vec<usize>, PieceMeta)>,
    times: BTreeMap<String, usize>,
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
    /// Every tensor by name (`model/<path>`, `optim/<path>/moment_1`, `optim/<path>/moment_2`).
    pub tensors: BTreeMap<String, TensorMeta>,
    /// AdamW's step count per parameter path.
    pub optimizer_steps: BTreeMap<String, usize>,
}

fn model_key(path: &str) -> String {
    format!("model/{path}")
}

fn moment_key(path: &str, which: u8) -> String {
    format!("optim/{path}/moment_{which}")
}

fn rank_file(rank: usize, ext: &str) -> String {
    format!("rank-{rank:05}.{ext}")
}

/// A piece copied to host memory.
struct HostPiece {
    name: String,
    shape: Vec<usize>,
    start: Vec<usize>,
    end: Vec<usize>,
    data: Vec<f32>,
}

/// This rank's pieces of a model and its optimizer state, copied to host memory: what a save
/// holds on to while the files are written in the background.
pub struct Snapshot {
    rank: usize,
    mesh: Option<DeviceMesh>,
    pieces: Vec<HostPiece>,
    times: BTreeMap<String, usize>,
    error: Option<String>,
}

impl Snapshot {
    /// Copy this rank's owned pieces of `model`'s parameters and, when given, of the AdamW
    /// moments in `optimizer` (Burn's `AdamW` or any optimizer whose state is `AdamWState`) to
    /// host memory. Nothing is communicated.
    pub fn take<B, M, X>(
        model: &M,
        optimizer: Option<ParamRecords<AdaptorRecord<X, B>>>,
    ) -> Result<Self, Error>
    where
        B: AutodiffBackend,
        B::InnerBackend: DistributedBackend,
        M: Module<B>,
        X: SimpleOptimizer<B::InnerBackend>,
    {
        let mut visitor = SnapshotVisitor::<B, X> {
            path: ModulePath::default(),
            records: optimizer,
            snapshot: Snapshot {
                rank: 0,
                mesh: None,
                pieces: Vec::new(),
                times: BTreeMap::new(),
                error: None,
            },
        };
        model.visit(&mut visitor);
        let snapshot = visitor.snapshot;
        match &snapshot.error {
            Some(reason) => Err(Error::Invalid {
                path: PathBuf::new(),
                reason: reason.clone(),
            }),
            None => Ok(snapshot),
        }
    }

    /// The bytes of tensor data it holds.
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.data.len() * 4).sum()
    }

    fn add<Inner: burn::tensor::backend::Backend, const D: usize>(
        &mut self,
        name: String,
        t: &DTensor<Inner>,
    ) {
        let mesh = t.device().mesh();
        let rank = t.device().rank();
        self.rank = rank;
        self.mesh.get_or_insert_with(|| mesh.clone());
        let layout = t.layout();
        if layout.has_partial() {
            self.error.get_or_insert(format!(
                "{name} holds partial sums ({layout}); save after the optimizer step"
            ));
            return;
        }
        if !layout.owns_piece(mesh, rank) {
            return;
        }
        let shape = t.global_shape().to_vec();
        let local_box = layout.local_box(&shape, mesh, rank);
        if local_box.iter().any(|(range, _)| range.is_empty()) {
            return; // only padding here
        }
        let local = Tensor::<Inner, D>::from_primitive(TensorPrimitive::Float(t.local().clone()));
        let values = local
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 data");
        let extents: Vec<usize> = local_box.iter().map(|(_, e)| *e).collect();
        let lens: Vec<usize> = local_box.iter().map(|(r, _)| r.len()).collect();
        let data = if lens == extents {
            values
        } else {
            let mut out = vec![0.0; lens.iter().product()];
            copy_box(&values, &extents, &[0; D], &mut out, &lens, &[0; D], &lens);
            out
        };
        self.pieces.push(HostPiece {
            name,
            shape,
            start: local_box.iter().map(|(r, _)| r.start).collect(),
            end: local_box.iter().map(|(r, _)| r.end).collect(),
            data,
        });
    }

    /// Encode and write this rank's files into `staging`; returns its index.
    fn write(self, staging: &Path, step: usize) -> Result<RankIndex, Error> {
        let file = rank_file(self.rank, "safetensors");
        let mut tensors = BTreeMap::new();
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = self
            .pieces
            .into_iter()
            .map(|p| {
                let raw: Vec<u8> = p.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                let meta = PieceMeta {
                    file: file.clone(),
                    start: p.start.clone(),
                    end: p.end.clone(),
                    crc32: crc32fast::hash(&raw),
                };
                tensors.insert(p.name.clone(), (p.shape, meta));
                let dims = p.start.iter().zip(&p.end).map(|(s, e)| e - s).collect();
                (p.name, dims, raw)
            })
            .collect();
        let views = bytes.iter().map(|(name, dims, raw)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, dims.clone(), raw)
                    .expect("a piece's bytes match its box");
            (name.clone(), view)
        });
        let path = staging.join(&file);
        let encoded = safetensors::serialize(views, None).map_err(|e| Error::Invalid {
            path: path.clone(),
            reason: format!("could not encode the pieces: {e}"),
        })?;
        crate::io::write_atomic(&path, &encoded).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let index = RankIndex {
            format: FORMAT.into(),
            step,
            rank: self.rank,
            file,
            bytes: encoded.len() as u64,
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
        Ok(index)
    }
}

struct SnapshotVisitor<B: AutodiffBackend, X: SimpleOptimizer<B::InnerBackend>> {
    path: ModulePath,
    records: Option<ParamRecords<AdaptorRecord<X, B>>>,
    snapshot: Snapshot,
}

impl<B, X> ModuleVisitor<B> for SnapshotVisitor<B, X>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    X: SimpleOptimizer<B::InnerBackend>,
{
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let path = self.path.name();
        let t = dtensor(&param.val().inner());
        self.snapshot.add::<_, D>(model_key(&path), &t);
        let Some(record) = self.records.as_mut().and_then(|r| r.remove(&param.id)) else {
            return;
        };
        let state: Box<dyn Any> = Box::new(record.into_state::<D>());
        match state.downcast::<AdamWState<B::InnerBackend, D>>() {
            Ok(state) => {
                let m = state.momentum;
                self.snapshot.times.insert(path.clone(), m.time);
                self.snapshot
                    .add::<_, D>(moment_key(&path, 1), &dtensor(&m.moment_1));
                self.snapshot
                    .add::<_, D>(moment_key(&path, 2), &dtensor(&m.moment_2));
                if m.max_moment_2.is_some() {
                    self.snapshot.error.get_or_insert(
                        "AMSGrad's max moment is not saved by the distributed checkpoint".into(),
                    );
                }
            }
            Err(_) => {
                self.snapshot.error.get_or_insert(format!(
                    "{path}: the optimizer state is not AdamW's; the distributed checkpoint saves \
                     AdamW (Burn's or Wildfire's fused one)"
                ));
            }
        }
    }
}

/// Copy the box `size` from `src` (row-major, shape `src_shape`, box at `src_at`) to `dst`
/// (shape `dst_shape`, box at `dst_at`), a contiguous run per innermost row.
fn copy_box(
    src: &[f32],
    src_shape: &[usize],
    src_at: &[usize],
    dst: &mut [f32],
    dst_shape: &[usize],
    dst_at: &[usize],
    size: &[usize],
) {
    let d = size.len();
    if d == 0 {
        dst[0] = src[0];
        return;
    }
    if size.contains(&0) {
        return;
    }
    let strides = |shape: &[usize]| {
        let mut s = vec![1; d];
        for i in (0..d.saturating_sub(1)).rev() {
            s[i] = s[i + 1] * shape[i + 1];
        }
        s
    };
    let (ss, ds) = (strides(src_shape), strides(dst_shape));
    let run = size[d - 1];
    let rows: usize = size[..d - 1].iter().product();
    let mut idx = vec![0; d - 1];
    for _ in 0..rows {
        let so: usize = (0..d)
            .map(|i| (src_at[i] + idx.get(i).copied().unwrap_or(0)) * ss[i])
            .sum();
        let doff: usize = (0..d)
            .map(|i| (dst_at[i] + idx.get(i).copied().unwrap_or(0)) * ds[i])
            .sum();
        dst[doff..doff + run].copy_from_slice(&src[so..so + run]);
        for i in (0..d - 1).rev() {
            idx[i] += 1;
            if idx[i] < size[i] {
                break;
            }
            idx[i] = 0;
        }
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
    pending: Option<JoinHandle<Result<SaveReport, Error>>>,
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
            pending: None,
        })
    }

    /// How long rank 0 waits for the other ranks' files before giving the save up (the previous
    /// checkpoint stays the latest). Default 10 minutes.
    pub fn with_commit_timeout(mut self, timeout: Duration) -> Self {
        self.commit_timeout = timeout;
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
        let (dir, rank, world, timeout) = (
            self.dir.clone(),
            self.rank,
            self.world_size,
            self.commit_timeout,
        );
        let mesh = snapshot.mesh.clone().unwrap_or_else(DeviceMesh::single);
        self.pending = Some(std::thread::spawn(move || {
            let started = Instant::now();
            fs::create_dir_all(&staging).map_err(|source| Error::Io {
                path: staging.clone(),
                source,
            })?;
            let index = snapshot.write(&staging, step)?;
            let write_time = started.elapsed();
            let committed = if rank == 0 {
                for (name, bytes) in &files {
                    let path = staging.join(name);
                    crate::io::write_atomic(&path, bytes)
                        .map_err(|source| Error::Io { path, source })?;
                }
                Some(commit(&dir, &staging, step, world, mesh, timeout)?)
            } else {
                None
            };
            Ok(SaveReport {
                step,
                dir: committed,
                write_time,
                bytes: index.bytes,
            })
        }));
        Ok(previous)
    }

    /// Wait for the save in flight, if any; its report, or its error.
    pub fn wait(&mut self) -> Result<Option<SaveReport>, Error> {
        match self.pending.take() {
            None => Ok(None),
            Some(handle) => match handle.join() {
                Ok(result) => result.map(Some),
                Err(_) => Err(Error::Invalid {
                    path: self.dir.root().to_path_buf(),
                    reason: "the checkpoint writer thread panicked".into(),
                }),
            },
        }
    }
}

/// Rank 0: wait for every rank's index, merge them into `metadata.json`, rename the staging
/// directory into place and move `latest`.
fn commit(
    dir: &CheckpointDir,
    staging: &Path,
    step: usize,
    world: usize,
    mesh: DeviceMesh,
    timeout: Duration,
) -> Result<PathBuf, Error> {
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
                })
                .pieces
                .push(piece);
        }
    }
    let path = staging.join("metadata.json");
    let json = serde_json::to_vec_pretty(&meta).expect("the metadata serialises");
    crate::io::write_atomic(&path, &json).map_err(|source| Error::Io { path, source })?;
    dir.commit(step)
}

/// A distributed checkpoint opened for loading: its metadata, checked against its files.
pub struct Checkpoint {
    dir: PathBuf,
    meta: Metadata,
}

impl Checkpoint {
    /// Open the checkpoint in step directory `dir`: reads `metadata.json` and checks that every
    /// data file is there with its recorded size (a missing or truncated file is refused here,
    /// before anything is loaded).
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, Error> {
        let dir = dir.into();
        let path = dir.join("metadata.json");
        let bytes = fs::read(&path).map_err(|source| Error::io(&path, source))?;
        let meta: Metadata = serde_json::from_slice(&bytes).map_err(|e| Error::Invalid {
            path: path.clone(),
            reason: format!("not a Wildfire distributed checkpoint's metadata ({e})"),
        })?;
        if meta.format != FORMAT {
            return Err(Error::Invalid {
                path,
                reason: format!("format {:?}, this build reads {FORMAT:?}", meta.format),
            });
        }
        for (file, &size) in &meta.files {
            let path = dir.join(file);
            let len = fs::metadata(&path)
                .map_err(|source| Error::io(&path, source))?
                .len();
            if len != size {
                return Err(Error::Invalid {
                    path,
                    reason: format!(
                        "{len} bytes, the checkpoint recorded {size}: the file is truncated or \
                         was replaced"
                    ),
                });
            }
        }
        Ok(Self { dir, meta })
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.meta
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Load every parameter of `model` (already laid out over its mesh) from the checkpoint, in
    /// the model's own layout: each rank reads only the pieces that overlap its own.
    pub fn load_model<B, M>(&self, model: M) -> Result<M, Error>
    where
        B: AutodiffBackend,
        B::InnerBackend: DistributedBackend,
        M: Module<B>,
    {
        let mut loader = ModelLoader {
            checkpoint: self,
            reader: Reader::default(),
            path: ModulePath::default(),
            error: None,
        };
        let model = model.map(&mut loader);
        match loader.error {
            Some(e) => Err(e),
            None => Ok(model),
        }
    }

    /// The AdamW state of every parameter of `model` (already laid out, and its rank's sharding
    /// policy set), each moment in the layout the optimizer keeps it in
    /// ([`wildfire_parallel::optimizer_state_layout`]): a record for `Optimizer::load_record`.
    pub fn load_optimizer<B, M, X>(
        &self,
        model: &M,
    ) -> Result<ParamRecords<AdaptorRecord<X, B>>, Error>
    where
        B: AutodiffBackend,
        B::InnerBackend: DistributedBackend,
        M: Module<B>,
        X: SimpleOptimizer<B::InnerBackend>,
    {
        let mut loader = OptimizerLoader::<B, X> {
            checkpoint: self,
            reader: Reader::default(),
            path: ModulePath::default(),
            records: ParamRecords::new(),
            error: None,
        };
        model.visit(&mut loader);
        match loader.error {
            Some(e) => Err(e),
            None => Ok(loader.records),
        }
    }

    /// This rank's piece of tensor `name` in `layout`: the padded local values.
    fn read_local<Inner: burn::tensor::backend::Backend, const D: usize>(
        &self,
        reader: &mut Reader,
        name: &str,
        like: &DTensor<Inner>,
        layout: &wildfire_parallel::Layout,
    ) -> Result<DTensor<Inner>, Error> {
        let invalid = |reason: String| Error::Invalid {
            path: self.dir.clone(),
            reason: format!("{name}: {reason}"),
        };
        let shape = like.global_shape().to_vec();
        let meta = self.meta.tensors.get(name).ok_or_else(|| {
            invalid("not in the checkpoint (a checkpoint of another model?)".into())
        })?;
        if meta.shape != shape {
            return Err(invalid(format!(
                "shape {:?} in the checkpoint, {shape:?} in the model",
                meta.shape
            )));
        }
        let device = like.device();
        let local_box = layout.local_box(&shape, device.mesh(), device.rank());
        let extents: Vec<usize> = local_box.iter().map(|(_, e)| *e).collect();
        let mut values = vec![0.0f32; extents.iter().product()];
        let mut covered = 0usize;
        for piece in &meta.pieces {
            let overlap: Option<Vec<Range<usize>>> = (0..shape.len())
                .map(|d| {
                    let (s, e) = (
                        piece.start[d].max(local_box[d].0.start),
                        piece.end[d].min(local_box[d].0.end),
                    );
                    (s < e).then_some(s..e)
                })
                .collect();
            let Some(overlap) = overlap else { continue };
            let data = reader.piece(&self.dir, name, piece)?;
            let size: Vec<usize> = overlap.iter().map(Range::len).collect();
            let piece_shape: Vec<usize> = piece
                .start
                .iter()
                .zip(&piece.end)
                .map(|(s, e)| e - s)
                .collect();
            let src_at: Vec<usize> = overlap
                .iter()
                .zip(&piece.start)
                .map(|(o, s)| o.start - s)
                .collect();
            let dst_at: Vec<usize> = overlap
                .iter()
                .zip(&local_box)
                .map(|(o, (b, _))| o.start - b.start)
                .collect();
            copy_box(
                &data,
                &piece_shape,
                &src_at,
                &mut values,
                &extents,
                &dst_at,
                &size,
            );
            covered += size.iter().product::<usize>();
        }
        let needed: usize = local_box.iter().map(|(r, _)| r.len()).product();
        if covered != needed {
            return Err(invalid(format!(
                "the pieces cover {covered} of the {needed} elements this rank needs"
            )));
        }
        let local = Tensor::<Inner, D>::from_data(TensorData::new(values, extents), device.inner());
        DTensor::from_local_padded(
            local.into_primitive().tensor(),
            layout.clone(),
            &shape,
            device,
        )
        .map_err(|e| invalid(e.to_string()))
    }
}

/// Memory-mapped data files and their parsed headers, opened on first use.
#[derive(Default)]
struct Reader {
    files: BTreeMap<String, (memmap2::Mmap, usize, safetensors::tensor::Metadata)>,
}

impl Reader {
    /// The values of `piece` of tensor `name`, checked against its CRC-32.
    fn piece(&mut self, dir: &Path, name: &str, piece: &PieceMeta) -> Result<Vec<f32>, Error> {
        let path = dir.join(&piece.file);
        let invalid = |reason: String| Error::Invalid {
            path: path.clone(),
            reason: format!("{name}: {reason}"),
        };
        if !self.files.contains_key(&piece.file) {
            let file = fs::File::open(&path).map_err(|source| Error::io(&path, source))?;
            // SAFETY: the checkpoint's files are written once (atomically) and not modified while
            // a run reads them; a change underneath is caught by the checksums.
            let map =
                unsafe { memmap2::Mmap::map(&file) }.map_err(|source| Error::io(&path, source))?;
            let (n, header) = safetensors::SafeTensors::read_metadata(&map)
                .map_err(|e| invalid(format!("not a safetensors file ({e})")))?;
            self.files.insert(piece.file.clone(), (map, n, header));
        }
        let (map, n, header) = &self.files[&piece.file];
        let info = header
            .info(name)
            .ok_or_else(|| invalid("missing from the file".into()))?;
        let dims: Vec<usize> = piece
            .start
            .iter()
            .zip(&piece.end)
            .map(|(s, e)| e - s)
            .collect();
        if info.dtype != safetensors::Dtype::F32 || info.shape != dims {
            return Err(invalid(format!(
                "{:?} {:?} in the file, the metadata says F32 {dims:?}",
                info.dtype, info.shape
            )));
        }
        let begin = 8 + n + info.data_offsets.0;
        let bytes = &map[begin..8 + n + info.data_offsets.1];
        if crc32fast::hash(bytes) != piece.crc32 {
            return Err(invalid(
                "checksum mismatch: the file is corrupt; resume from an earlier checkpoint".into(),
            ));
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

struct ModelLoader<'a> {
    checkpoint: &'a Checkpoint,
    reader: Reader,
    path: ModulePath,
    error: Option<Error>,
}

impl<B> ModuleMapper<B> for ModelLoader<'_>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
{
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if self.error.is_some() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let t = dtensor(&tensor.clone().inner());
        let name = model_key(&self.path.name());
        match self
            .checkpoint
            .read_local::<_, D>(&mut self.reader, &name, &t, t.layout())
        {
            Ok(loaded) => {
                let out = Tensor::from_inner(from_dtensor::<B::InnerBackend, D>(loaded));
                let out = if tensor.is_require_grad() {
                    out.require_grad()
                } else {
                    out
                };
                Param::from_mapped_value(id, out, mapper)
            }
            Err(e) => {
                self.error = Some(e);
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
    }
}

struct OptimizerLoader<'a, B: AutodiffBackend, X: SimpleOptimizer<B::InnerBackend>> {
    checkpoint: &'a Checkpoint,
    reader: Reader,
    path: ModulePath,
    records: ParamRecords<AdaptorRecord<X, B>>,
    error: Option<Error>,
}

impl<B, X> OptimizerLoader<'_, B, X>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    X: SimpleOptimizer<B::InnerBackend>,
{
    fn load<const D: usize>(&mut self, id: ParamId, param: &Tensor<B, D>) -> Result<(), Error> {
        let path = self.path.name();
        let Some(&time) = self.checkpoint.meta.optimizer_steps.get(&path) else {
            return Ok(()); // never stepped (no gradient yet)
        };
        let t = dtensor(&param.clone().inner());
        let layout = wildfire_parallel::optimizer_state_layout(&t);
        let mut moment = |which| -> Result<Tensor<B::InnerBackend, D>, Error> {
            let name = moment_key(&path, which);
            let local = self
                .checkpoint
                .read_local::<_, D>(&mut self.reader, &name, &t, &layout)?;
            Ok(from_dtensor::<B::InnerBackend, D>(local))
        };
        let (moment_1, moment_2) = (moment(1)?, moment(2)?);
        let state = AdamWState {
            momentum: AdaptiveMomentumState {
                time,
                moment_1,
                moment_2,
                max_moment_2: None,
            },
        };
        let state: Box<dyn Any> = Box::new(state);
        let state = state.downcast::<X::State<D>>().map_err(|_| Error::Invalid {
            path: self.checkpoint.dir.clone(),
            reason: format!(
                "{path}: the checkpoint holds AdamW state, this run's optimizer keeps another kind"
            ),
        })?;
        self.records
            .insert(id, AdaptorRecord::from_state::<D>(*state));
        Ok(())
    }
}

impl<B, X> ModuleVisitor<B> for OptimizerLoader<'_, B, X>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    X: SimpleOptimizer<B::InnerBackend>,
{
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.error.is_none()
            && let Err(e) = self.load::<D>(param.id, &param.val())
        {
            self.error = Some(e);
        }
    }
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
