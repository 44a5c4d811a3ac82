//! The load half: a [`Checkpoint`] opened from its metadata, each rank reading the pieces that
//! overlap its own in the model's layout.

use std::collections::BTreeMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::{Module, Param, ParamId};
use burn::optim::record::AdaptorRecord;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use wildfire_parallel::{
    DTensor, DistDevice, DistributedBackend, EncodedState, Layout, Mapped, ModulePath, StateCodec,
    TryParamMapper, TryParamVisitor, dtensor, from_dtensor, map_value, state_layout,
    try_map_params, try_visit_params,
};

use super::{FORMAT, Metadata, PieceMeta, box_dims, copy_box, model_key, state_key};
use crate::Error;
use crate::ParamRecords;

/// A distributed checkpoint opened for loading: its metadata, checked against its files.
pub struct Checkpoint {
    pub(crate) dir: PathBuf,
    pub(crate) meta: Metadata,
    /// Bytes of tensor data read by every load so far (all ranks sharing this value).
    bytes_read: std::sync::atomic::AtomicU64,
    /// The files held in host memory ([`Checkpoint::in_memory`]): read from here, never from
    /// `dir`.
    memory: Option<Arc<MemoryFiles>>,
}

/// A checkpoint's files held in host memory, by file name ([`super::MemoryCheckpoints`]).
pub type MemoryFiles = BTreeMap<String, Arc<Vec<u8>>>;

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
        Ok(Self::new(dir, meta))
    }

    /// A checkpoint of `meta` in `dir`, unchecked (an import builds the metadata of files
    /// written elsewhere: [`PieceMeta::key`] names each piece in its file).
    pub fn new(dir: PathBuf, meta: Metadata) -> Self {
        Self {
            dir,
            meta,
            bytes_read: Default::default(),
            memory: None,
        }
    }

    /// The checkpoint whose files are `files`, held in host memory (`label` names it in
    /// errors): its metadata read and every data file's size checked as [`Checkpoint::open`]
    /// checks them on disk; loads read no file.
    pub fn in_memory(label: PathBuf, files: Arc<MemoryFiles>) -> Result<Self, Error> {
        let invalid = |name: &str, reason: String| Error::Invalid {
            path: label.join(name),
            reason,
        };
        let bytes = files
            .get("metadata.json")
            .ok_or_else(|| invalid("metadata.json", "not held in memory".into()))?;
        let meta: Metadata = serde_json::from_slice(bytes).map_err(|e| {
            invalid(
                "metadata.json",
                format!("not a Wildfire distributed checkpoint's metadata ({e})"),
            )
        })?;
        for (file, &size) in &meta.files {
            let len = files.get(file).map(|b| b.len() as u64);
            if len != Some(size) {
                return Err(invalid(
                    file,
                    format!("{len:?} bytes held in memory, the checkpoint recorded {size}"),
                ));
            }
        }
        Ok(Self {
            memory: Some(files),
            ..Self::new(label, meta)
        })
    }

    /// Whether the files are held in host memory.
    pub fn is_in_memory(&self) -> bool {
        self.memory.is_some()
    }

    /// A reader of this checkpoint's files (from memory when it is held there).
    fn reader(&self) -> Reader {
        Reader {
            memory: self.memory.clone(),
            ..Reader::default()
        }
    }

    /// Bytes of tensor data read from the files so far, by every load from this value (ranks as
    /// threads sharing one `Checkpoint` add up): a rank reads the checksum chunks that hold
    /// the elements it needs, not whole pieces.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn count(&self, reader: &Reader) {
        self.bytes_read
            .fetch_add(reader.bytes_read, std::sync::atomic::Ordering::Relaxed);
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
        self.load_model_named(model, &|path| path.to_string())
    }

    /// [`Checkpoint::load_model`] with each parameter read from the tensor `name(path)` (a
    /// pipeline stage's blocks under the whole model's names).
    pub fn load_model_named<B, M>(
        &self,
        model: M,
        name: &dyn Fn(&str) -> String,
    ) -> Result<M, Error>
    where
        B: AutodiffBackend,
        B::InnerBackend: DistributedBackend,
        M: Module<B>,
    {
        let mut loader = ModelLoader {
            name,
            checkpoint: self,
            reader: self.reader(),
        };
        let model = try_map_params(model, &mut loader);
        self.count(&loader.reader);
        model
    }

    /// The optimizer state of every parameter of `model` (already laid out, and its rank's
    /// sharding policy set), each state tensor in the layout the optimizer keeps it in
    /// ([`wildfire_parallel::state_layout`]): a record for `Optimizer::load_record`.
    pub fn load_optimizer<B, M, X>(
        &self,
        model: &M,
    ) -> Result<ParamRecords<AdaptorRecord<X, B>>, Error>
    where
        B: AutodiffBackend,
        B::InnerBackend: DistributedBackend,
        M: Module<B>,
        X: StateCodec<B::InnerBackend>,
    {
        self.load_optimizer_named(model, &|path| path.to_string())
    }

    /// [`Checkpoint::load_optimizer`] with each parameter's state read under `name(path)`.
    pub fn load_optimizer_named<B, M, X>(
        &self,
        model: &M,
        name: &dyn Fn(&str) -> String,
    ) -> Result<ParamRecords<AdaptorRecord<X, B>>, Error>
    where
        B: AutodiffBackend,
        B::InnerBackend: DistributedBackend,
        M: Module<B>,
        X: StateCodec<B::InnerBackend>,
    {
        let mut loader = OptimizerLoader::<B, X> {
            name,
            checkpoint: self,
            reader: self.reader(),
            records: ParamRecords::new(),
        };
        let loaded = try_visit_params(model, &mut loader);
        self.count(&loader.reader);
        loaded.map(|()| loader.records)
    }

    /// This rank's piece of tensor `name` (global `shape`) in `layout` on `device`: the padded
    /// local values.
    fn read_local<Inner: Backend>(
        &self,
        reader: &mut Reader,
        name: &str,
        shape: &[usize],
        device: &DistDevice<Inner>,
        layout: &Layout,
    ) -> Result<DTensor<Inner>, Error> {
        let invalid = |reason: String| Error::Invalid {
            path: self.dir.clone(),
            reason: format!("{name}: {reason}"),
        };
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
        let local_box = layout.local_box(shape, device.mesh(), device.rank());
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
            let size: Vec<usize> = overlap.iter().map(Range::len).collect();
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
            // Only the overlap's bytes (and the rest of their checksum chunks) are read.
            if piece.transposed {
                let data = reader.read_box(&self.dir, name, piece, &src_at, &size)?;
                copy_box(
                    &data,
                    &size,
                    &vec![0; size.len()],
                    &mut values,
                    &extents,
                    &dst_at,
                    &size,
                );
            } else {
                // Straight into this rank's piece: no buffer of the box, no second copy.
                let into = Dest {
                    values: &mut values,
                    shape: &extents,
                    at: &dst_at,
                };
                reader.read_box_into(&self.dir, name, piece, into, &src_at, &size)?;
            }
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
        let local = Inner::float_from_data(TensorData::new(values, extents), device.inner());
        DTensor::from_local_padded(local, layout.clone(), shape, device)
            .map_err(|e| invalid(e.to_string()))
    }
}

/// The data files and their safetensors headers, opened on first use; pieces are read with
/// positioned reads (no mapping: the file's pages never count in the process's resident set).
#[derive(Default)]
pub struct Reader {
    files: BTreeMap<String, (Source, u64, BTreeMap<String, HeaderEntry>)>,
    /// Bytes of tensor data read so far.
    pub(crate) bytes_read: u64,
    /// Files held in memory: read from here instead of the directory.
    memory: Option<Arc<MemoryFiles>>,
}

/// Where a data file's bytes are: a file opened for positioned reads, or memory.
enum Source {
    File(fs::File),
    Memory(Arc<Vec<u8>>),
}

impl Source {
    /// `len` bytes at `offset`: read from the file, or borrowed from memory (no copy).
    fn read_at(&self, offset: u64, len: usize) -> std::io::Result<std::borrow::Cow<'_, [u8]>> {
        use std::os::unix::fs::FileExt;
        match self {
            Source::File(file) => {
                let mut buf = vec![0u8; len];
                file.read_exact_at(&mut buf, offset)?;
                Ok(buf.into())
            }
            Source::Memory(bytes) => usize::try_from(offset)
                .ok()
                .and_then(|at| bytes.get(at..at.checked_add(len)?))
                .map(Into::into)
                .ok_or_else(|| std::io::ErrorKind::UnexpectedEof.into()),
        }
    }
}

/// The header of a safetensors file held in memory: where its data starts, and its tensors.
fn memory_safetensors(
    path: &Path,
    bytes: &[u8],
) -> Result<(u64, BTreeMap<String, HeaderEntry>), Error> {
    let invalid = |reason: String| Error::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let n = bytes
        .get(..8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .ok_or_else(|| invalid("not a safetensors file (shorter than 8 bytes)".into()))?;
    let header = usize::try_from(n)
        .ok()
        .and_then(|n| bytes.get(8..n.checked_add(8)?))
        .ok_or_else(|| invalid(format!("not a safetensors file (header of {n} bytes)")))?;
    Ok((8 + n, parse_header(path, header)?))
}

/// A safetensors header's tensors (name → entry), its `__metadata__` left out.
fn parse_header(path: &Path, header: &[u8]) -> Result<BTreeMap<String, HeaderEntry>, Error> {
    let invalid = |reason: String| Error::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let mut header: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| invalid(format!("not a safetensors file ({e})")))?;
    header.remove("__metadata__");
    header
        .into_iter()
        .map(|(name, entry)| match serde_json::from_value(entry) {
            Ok(entry) => Ok((name, entry)),
            Err(e) => Err(invalid(format!("{name}: bad header entry ({e})"))),
        })
        .collect()
}

/// A safetensors file opened for positioned reads: the file, where its data starts, and its
/// header's tensors (name → entry).
pub fn open_safetensors(
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
    Ok((file, 8 + n, parse_header(path, &header)?))
}

/// One tensor's entry in a safetensors header.
#[derive(serde::Deserialize)]
pub struct HeaderEntry {
    /// Its element type (`F32`, `BF16`, …).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
    data_offsets: [u64; 2],
}

impl Reader {
    /// The values of `piece` of tensor `name`, whole, checked against its checksums.
    pub fn piece(&mut self, dir: &Path, name: &str, piece: &PieceMeta) -> Result<Vec<f32>, Error> {
        let size = box_dims(&piece.start, &piece.end);
        self.read_box(dir, name, piece, &vec![0; size.len()], &size)
    }

    /// The box `size` at `at` (in the piece's own indices) of `piece` of tensor `name`, row-major:
    /// reads only the checksum chunks that hold its bytes (every byte it reads is checked), or,
    /// for a piece without checksums (an imported file), only its bytes.
    pub fn read_box(
        &mut self,
        dir: &Path,
        name: &str,
        piece: &PieceMeta,
        at: &[usize],
        size: &[usize],
    ) -> Result<Vec<f32>, Error> {
        if piece.transposed {
            // Read as stored (row runs of the stored rows), then transposed.
            let Some((stored, at, size)) = stored_transposed(piece, at, size) else {
                return Err(Error::Invalid {
                    path: dir.join(&piece.file),
                    reason: format!("{name}: a transposed piece that is not a matrix"),
                });
            };
            let values = self.read_box(dir, name, &stored, &at, &size)?;
            return Ok(transpose(&values, size[0], size[1]));
        }
        let mut out = vec![0f32; size.iter().product()];
        let into = Dest {
            values: &mut out,
            shape: size,
            at: &vec![0; size.len()],
        };
        self.read_box_into(dir, name, piece, into, at, size)?;
        Ok(out)
    }

    /// [`Reader::read_box`] written into the box `size` at `into.at` of `into.values` (shape
    /// `into.shape`, row-major) instead of a buffer of its own. Not for a transposed piece.
    fn read_box_into(
        &mut self,
        dir: &Path,
        name: &str,
        piece: &PieceMeta,
        into: Dest<'_>,
        at: &[usize],
        size: &[usize],
    ) -> Result<(), Error> {
        if piece.transposed {
            return Err(Error::Invalid {
                path: dir.join(&piece.file),
                reason: format!("{name}: a transposed piece is read by read_box"),
            });
        }
        let path = dir.join(&piece.file);
        let invalid = |reason: String| Error::Invalid {
            path: path.clone(),
            reason: format!("{name}: {reason}"),
        };
        let io = |source| Error::io(&path, source);
        if !self.files.contains_key(&piece.file) {
            let opened = match self.memory.as_ref() {
                Some(memory) => {
                    let bytes = memory.get(&piece.file).ok_or_else(|| Error::Invalid {
                        path: path.clone(),
                        reason: "not held in memory".into(),
                    })?;
                    let (data_start, header) = memory_safetensors(&path, bytes)?;
                    (Source::Memory(bytes.clone()), data_start, header)
                }
                None => {
                    let (file, data_start, header) = open_safetensors(&path)?;
                    (Source::File(file), data_start, header)
                }
            };
            self.files.insert(piece.file.clone(), opened);
        }
        let (file, data_start, header) = &self.files[&piece.file];
        let entry = header
            .get(piece.key.as_deref().unwrap_or(name))
            .ok_or_else(|| invalid("missing from the file".into()))?;
        // The piece's box inside the stored tensor: the whole of it, or a box at `piece.at`.
        let piece_dims: Vec<usize> = box_dims(&piece.start, &piece.end);
        let (dims, offset) = match &piece.at {
            Some(at) => (entry.shape.clone(), at.clone()),
            None => (piece_dims.clone(), vec![0; piece_dims.len()]),
        };
        let [begin, end] = entry.data_offsets;
        let count: usize = dims.iter().product();
        let fits = offset.len() == dims.len()
            && piece_dims.len() == dims.len()
            && (0..dims.len()).all(|d| offset[d] + piece_dims[d] <= dims[d]);
        // Bytes per element: f32, or (an imported file) bf16 / f16, widened to f32 as read.
        let width = match entry.dtype.as_str() {
            "F32" => Some(4),
            "BF16" | "F16" if piece.chunks.is_none() && piece.crc32.is_none() => Some(2),
            _ => None,
        };
        let Some(width) = width.filter(|&w| {
            entry.shape == dims && fits && end.checked_sub(begin) == Some((w * count) as u64)
        }) else {
            return Err(invalid(format!(
                "{} {:?} in the file, the metadata says F32 (or an imported BF16 / F16) \
                 {piece_dims:?} at {offset:?} of {dims:?}",
                entry.dtype, entry.shape
            )));
        };
        let piece_bytes = width * count;
        // The unit of reading: a checksum chunk, the whole piece (one checksum), or one value.
        let (granule, checks): (usize, Vec<u32>) = match (&piece.chunks, piece.crc32) {
            (Some(chunks), _) => {
                let granule = chunks.bytes as usize;
                if granule == 0
                    || !granule.is_multiple_of(4)
                    || chunks.crc32.len() != piece_bytes.div_ceil(granule)
                {
                    return Err(invalid(format!(
                        "{} checksums of {granule}-byte chunks for {piece_bytes} bytes",
                        chunks.crc32.len()
                    )));
                }
                (granule, chunks.crc32.clone())
            }
            (None, Some(crc)) => (piece_bytes.max(4), vec![crc]),
            (None, None) => (width, Vec::new()),
        };
        // The box's runs (one per row along the last dim): where in the piece, where in `out`.
        let run = size.last().copied().unwrap_or(1);
        let fits_into = into.shape.len() == size.len()
            && into.at.len() == size.len()
            && (0..size.len()).all(|d| into.at[d] + size[d] <= into.shape[d])
            && into.values.len() == into.shape.iter().product::<usize>();
        if !fits_into {
            return Err(invalid(format!(
                "a box {size:?} does not fit at {:?} of {:?}",
                into.at, into.shape
            )));
        }
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let origin = vec![0; size.len()];
        wildfire_parallel::for_each_row(size, |row| {
            let flat = |shape: &[usize], at: &[usize], base: &[usize]| {
                (0..size.len()).fold(0, |flat, d| {
                    flat * shape[d] + base[d] + at[d] + row.get(d).copied().unwrap_or(0)
                })
            };
            runs.push((flat(&dims, at, &offset), flat(into.shape, into.at, &origin)));
        });
        let out = into.values;
        // Spans of whole granules covering consecutive runs, each read at once (at most
        // `SPAN_BYTES` of them, or one run's granules), checked, and copied out of.
        const SPAN_BYTES: usize = 16 << 20;
        let granules = |from: usize| (width * from / granule, (width * (from + run) - 1) / granule);
        let mut i = 0;
        while i < runs.len() {
            let (first, mut last) = granules(runs[i].0);
            let mut j = i + 1;
            while j < runs.len() {
                let (g0, g1) = granules(runs[j].0);
                if g0 > last + 1 || (g1 + 1 - first) * granule > SPAN_BYTES.max(granule) {
                    break;
                }
                last = last.max(g1);
                j += 1;
            }
            let (lo, hi) = (first * granule, ((last + 1) * granule).min(piece_bytes));
            let bytes = file
                .read_at(data_start + begin + lo as u64, hi - lo)
                .map_err(io)?;
            self.bytes_read += (hi - lo) as u64;
            for (k, chunk) in bytes.chunks(granule).enumerate() {
                if let Some(&crc) = checks.get(first + k)
                    && crc32fast::hash(chunk) != crc
                {
                    return Err(invalid(format!(
                        "checksum mismatch in bytes {}..{}: the file is corrupt; resume from an \
                         earlier checkpoint",
                        lo + k * granule,
                        lo + k * granule + chunk.len()
                    )));
                }
            }
            for &(from, to) in &runs[i..j] {
                let at = width * from - lo;
                let src = &bytes[at..at + width * run];
                let dst = &mut out[to..to + run];
                match entry.dtype.as_str() {
                    "BF16" => decode(src, dst, |b| burn::tensor::bf16::from_le_bytes(b).to_f32()),
                    "F16" => decode(src, dst, |b| burn::tensor::f16::from_le_bytes(b).to_f32()),
                    _ => decode(src, dst, f32::from_le_bytes),
                }
            }
            i = j;
        }
        Ok(())
    }
}

/// Where [`Reader::read_box_into`] writes: the box at `at` of `values`, a row-major `shape`.
struct Dest<'a> {
    values: &'a mut [f32],
    shape: &'a [usize],
    at: &'a [usize],
}

/// A piece stored transposed, as stored: the piece with its box's dims reversed, and the box
/// `size` at `at` reversed likewise; `None` unless it is a matrix — or a matrix with leading
/// dims of one (one expert's `[1, in, out]` of a stacked `[E, in, out]` weight, stored as a
/// matrix `[out, in]` of its own), which the stored matrix leaves out.
fn stored_transposed(
    piece: &PieceMeta,
    at: &[usize],
    size: &[usize],
) -> Option<(PieceMeta, Vec<usize>, Vec<usize>)> {
    let n = piece.start.len();
    let lead = n.checked_sub(2)?;
    let single = (0..lead).all(|d| piece.end[d] == piece.start[d] + 1 && size[d] == 1);
    if piece.end.len() != n || at.len() != n || size.len() != n || !single {
        return None;
    }
    if piece.at.as_ref().is_some_and(|a| a.len() != 2) {
        return None;
    }
    let rev = |v: &[usize]| v[v.len() - 2..].iter().rev().copied().collect::<Vec<_>>();
    let stored = PieceMeta {
        start: rev(&piece.start),
        end: rev(&piece.end),
        at: piece.at.as_deref().map(rev),
        transposed: false,
        ..piece.clone()
    };
    Some((stored, rev(at), rev(size)))
}

/// The row-major `[cols, rows]` transpose of the row-major `[rows, cols]` `values`.
pub fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for (i, row) in values.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (j, &v) in row.iter().enumerate() {
            out[j * rows + i] = v;
        }
    }
    out
}

/// `dst` from the little-endian elements of `src`, `N` bytes each, through `f`.
fn decode<const N: usize>(src: &[u8], dst: &mut [f32], f: impl Fn([u8; N]) -> f32) {
    for (v, b) in dst.iter_mut().zip(src.chunks_exact(N)) {
        *v = f(b.try_into().expect("N bytes"));
    }
}

struct ModelLoader<'a> {
    name: &'a dyn Fn(&str) -> String,
    checkpoint: &'a Checkpoint,
    reader: Reader,
}

impl<B> TryParamMapper<B> for ModelLoader<'_>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
{
    type Error = Error;

    fn try_map<const D: usize>(
        &mut self,
        path: &ModulePath,
        param: Param<Tensor<B, D>>,
    ) -> Mapped<B, D, Error> {
        let name = model_key(&(self.name)(&path.name()));
        map_value(param, |tensor| {
            let t = dtensor(&tensor.clone().inner());
            let loaded = self.checkpoint.read_local(
                &mut self.reader,
                &name,
                &t.global_shape().to_vec(),
                t.device(),
                t.layout(),
            )?;
            let out = Tensor::from_inner(from_dtensor::<B::InnerBackend, D>(loaded));
            Ok(if tensor.is_require_grad() {
                out.require_grad()
            } else {
                out
            })
        })
    }
}

struct OptimizerLoader<'a, B: AutodiffBackend, X: StateCodec<B::InnerBackend>> {
    name: &'a dyn Fn(&str) -> String,
    checkpoint: &'a Checkpoint,
    reader: Reader,
    records: ParamRecords<AdaptorRecord<X, B>>,
}

impl<B, X> OptimizerLoader<'_, B, X>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    X: StateCodec<B::InnerBackend>,
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
        let shape = t.global_shape().to_vec();
        // A spec the checkpoint holds no tensor for is `None`: the codec decides whether the
        // parameter needs it (Muon's parameters keep one kind of state each).
        let tensors = X::state_specs(&shape)
            .iter()
            .map(|spec| {
                let key = state_key(&path, &spec.name);
                if !self.checkpoint.meta.tensors.contains_key(&key) {
                    return Ok(None);
                }
                let local = self.checkpoint.read_local(
                    &mut self.reader,
                    &key,
                    &spec.shape.of(&shape),
                    t.device(),
                    &state_layout(&t, &spec.shape),
                )?;
                Ok(Some(<B::InnerBackend as DistributedBackend>::from_dtensor(
                    local,
                )))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let state = X::decode::<D>(EncodedState {
            steps: time,
            tensors,
        })
        .map_err(|e| Error::Invalid {
            path: self.checkpoint.dir.clone(),
            reason: format!("{path}: {e}"),
        })?;
        self.records
            .insert(id, AdaptorRecord::from_state::<D>(state));
        Ok(())
    }
}

impl<B, X> TryParamVisitor<B> for OptimizerLoader<'_, B, X>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    X: StateCodec<B::InnerBackend>,
{
    type Error = Error;

    fn try_visit<const D: usize>(
        &mut self,
        path: &ModulePath,
        param: &Param<Tensor<B, D>>,
    ) -> Result<(), Error> {
        self.load::<D>((self.name)(&path.name()), param.id, &param.val())
    }
}
