//! The load half: a [`Checkpoint`] opened from its metadata, each rank reading the pieces that
//! overlap its own in the model's layout.

use std::any::Any;
use std::collections::BTreeMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::{Module, Param, ParamId};
use burn::optim::SimpleOptimizer;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamWState, AdaptiveMomentumState};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use wildfire_parallel::{
    DTensor, DistributedBackend, ModulePath, ParamMapper, ParamVisitor, dtensor, from_dtensor,
    map_params, visit_params,
};

use super::{FORMAT, Metadata, PieceMeta, box_dims, copy_box, model_key, moment_key};
use crate::Error;
use crate::checkpoint::ParamRecords;

/// A distributed checkpoint opened for loading: its metadata, checked against its files.
pub struct Checkpoint {
    pub(crate) dir: PathBuf,
    pub(crate) meta: Metadata,
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
            error: None,
        };
        let model = map_params(model, &mut loader);
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
            records: ParamRecords::new(),
            error: None,
        };
        visit_params(model, &mut loader);
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
        let fits = meta.shape == shape
            || (meta.rows_padded
                && meta.shape.len() == shape.len()
                && meta.shape[1..] == shape[1..]);
        if !fits {
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
            let piece_shape: Vec<usize> = box_dims(&piece.start, &piece.end);
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
        // Rows past the checkpoint's (a padded vocabulary) stay zero.
        let needed: usize = local_box
            .iter()
            .enumerate()
            .map(|(d, (r, _))| match d {
                0 => r.end.min(meta.shape[0]).saturating_sub(r.start),
                _ => r.len(),
            })
            .product();
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

/// The data files and their safetensors headers, opened on first use; pieces are read with
/// positioned reads (no mapping: the file's pages never count in the process's resident set).
#[derive(Default)]
pub(crate) struct Reader {
    files: BTreeMap<String, (fs::File, u64, BTreeMap<String, HeaderEntry>)>,
}

/// A safetensors file opened for positioned reads: the file, where its data starts, and its
/// header's tensors (name → entry).
pub(crate) fn open_safetensors(
    path: &Path,
) -> Result<(fs::File, u64, BTreeMap<String, HeaderEntry>), Error> {
    use std::io::Read;
    let io = |source| Error::io(path, source);
    let invalid = |reason: String| Error::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let mut word = [0u8; 8];
    file.read_exact(&mut word).map_err(io)?;
    let n = u64::from_le_bytes(word);
    if n > len.saturating_sub(8) || n > 100 << 20 {
        return Err(invalid(format!(
            "not a safetensors file (header of {n} bytes)"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(io)?;
    let mut header: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| invalid(format!("not a safetensors file ({e})")))?;
    header.remove("__metadata__");
    let entries = header
        .into_iter()
        .map(|(name, entry)| match serde_json::from_value(entry) {
            Ok(entry) => Ok((name, entry)),
            Err(e) => Err(invalid(format!("{name}: bad header entry ({e})"))),
        })
        .collect::<Result<_, _>>()?;
    Ok((file, 8 + n, entries))
}

/// One tensor's entry in a safetensors header.
#[derive(serde::Deserialize)]
pub(crate) struct HeaderEntry {
    pub(crate) dtype: String,
    pub(crate) shape: Vec<usize>,
    data_offsets: [u64; 2],
}

impl Reader {
    /// The values of `piece` of tensor `name`, checked against its CRC-32.
    pub(crate) fn piece(
        &mut self,
        dir: &Path,
        name: &str,
        piece: &PieceMeta,
    ) -> Result<Vec<f32>, Error> {
        use std::io::{Read, Seek, SeekFrom};
        let path = dir.join(&piece.file);
        let invalid = |reason: String| Error::Invalid {
            path: path.clone(),
            reason: format!("{name}: {reason}"),
        };
        let io = |source| Error::io(&path, source);
        if !self.files.contains_key(&piece.file) {
            let (file, data_start, header) = open_safetensors(&path)?;
            self.files
                .insert(piece.file.clone(), (file, data_start, header));
        }
        let (file, data_start, header) = &self.files[&piece.file];
        let entry = header
            .get(piece.key.as_deref().unwrap_or(name))
            .ok_or_else(|| invalid("missing from the file".into()))?;
        let dims: Vec<usize> = box_dims(&piece.start, &piece.end);
        let [begin, end] = entry.data_offsets;
        let count: usize = dims.iter().product();
        if entry.dtype != "F32"
            || entry.shape != dims
            || end.checked_sub(begin) != Some(4 * count as u64)
        {
            return Err(invalid(format!(
                "{} {:?} in the file, the metadata says F32 {dims:?}",
                entry.dtype, entry.shape
            )));
        }
        let mut values = vec![0f32; count];
        let mut reader = file;
        reader
            .seek(SeekFrom::Start(data_start + begin))
            .map_err(io)?;
        reader
            .read_exact(bytemuck::cast_slice_mut(&mut values))
            .map_err(io)?;
        if piece
            .crc32
            .is_some_and(|crc| crc32fast::hash(bytemuck::cast_slice(&values)) != crc)
        {
            return Err(invalid(
                "checksum mismatch: the file is corrupt; resume from an earlier checkpoint".into(),
            ));
        }
        if cfg!(target_endian = "big") {
            for v in &mut values {
                *v = f32::from_le_bytes(v.to_ne_bytes());
            }
        }
        Ok(values)
    }
}

struct ModelLoader<'a> {
    checkpoint: &'a Checkpoint,
    reader: Reader,
    error: Option<Error>,
}

impl<B> ParamMapper<B> for ModelLoader<'_>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
{
    fn map<const D: usize>(
        &mut self,
        path: &ModulePath,
        param: Param<Tensor<B, D>>,
    ) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if self.error.is_some() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let t = dtensor(&tensor.clone().inner());
        let name = model_key(&path.name());
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
    records: ParamRecords<AdaptorRecord<X, B>>,
    error: Option<Error>,
}

impl<B, X> OptimizerLoader<'_, B, X>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    X: SimpleOptimizer<B::InnerBackend>,
{
    fn load<const D: usize>(
        &mut self,
        path: String,
        id: ParamId,
        param: &Tensor<B, D>,
    ) -> Result<(), Error> {
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

impl<B, X> ParamVisitor<B> for OptimizerLoader<'_, B, X>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    X: SimpleOptimizer<B::InnerBackend>,
{
    fn visit<const D: usize>(&mut self, path: &ModulePath, param: &Param<Tensor<B, D>>) {
        if self.error.is_none()
            && let Err(e) = self.load::<D>(path.name(), param.id, &param.val())
        {
            self.error = Some(e);
        }
    }
}
