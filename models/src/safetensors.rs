//! Model weights as a safetensors file (the format every framework reads), named by module path
//! (`blocks.0.attn.c_attn.weight`), written atomically; and loading them back by name.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use wildfire_parallel::ModulePath;

use crate::io::FileError;

struct Collect {
    path: ModulePath,
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
}

impl<B: Backend> ModuleVisitor<B> for Collect {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        let shape = value.dims().to_vec();
        let data = value
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 data");
        self.tensors.push((self.path.name(), shape, data));
    }
}

/// The parameters of `module` by path, in visiting order.
pub fn named_parameters<B: Backend, M: Module<B>>(
    module: &M,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut c = Collect {
        path: ModulePath::default(),
        tensors: Vec::new(),
    };
    module.visit(&mut c);
    c.tensors
}

/// Every parameter of `module` (f32) as the bytes of a safetensors file. Distributed parameters
/// are gathered to full values, so every rank must call it (the collectives are matched).
pub fn to_bytes<B: Backend, M: Module<B>>(module: &M) -> Vec<u8> {
    encode(&named_parameters(module))
}

/// Write `bytes` to `path` atomically ([`crate::io::write_atomic`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FileError> {
    crate::io::write_atomic(path, bytes).map_err(|source| FileError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Write every parameter of `module` (f32) to `path` as safetensors, atomically.
pub fn save<B: Backend, M: Module<B>>(module: &M, path: &Path) -> Result<(), FileError> {
    write_atomic(path, &to_bytes(module))
}

/// Tensors by name: (shape, values).
pub type NamedTensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Read a safetensors file of f32 tensors.
pub fn read(path: &Path) -> Result<NamedTensors, FileError> {
    let name = path.display().to_string();
    let bad = |reason: String| FileError::Invalid {
        path: name.clone().into(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|source| FileError::Io {
        path: name.clone().into(),
        source,
    })?;
    let n = u64::from_le_bytes(
        bytes
            .get(..8)
            .ok_or_else(|| bad("shorter than a safetensors header".into()))?
            .try_into()
            .expect("8 bytes"),
    ) as usize;
    // Checked: a corrupt length (up to 2⁶⁴ − 1) must be an error, not an overflow.
    let body_start = n
        .checked_add(8)
        .filter(|&end| end <= bytes.len())
        .ok_or_else(|| bad(format!("truncated header (it claims {n} bytes)")))?;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..body_start])
        .map_err(|e| bad(format!("corrupt header: {e}")))?;
    let body = &bytes[body_start..];
    let mut out = BTreeMap::new();
    for (key, entry) in header
        .as_object()
        .ok_or_else(|| bad("header is not an object".into()))?
    {
        if key == "__metadata__" {
            continue;
        }
        let dtype = entry["dtype"].as_str().unwrap_or("");
        if dtype != "F32" {
            return Err(bad(format!("tensor {key} is {dtype}; only F32 is read")));
        }
        let shape: Vec<usize> = entry["shape"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64().map(|v| v as usize))
                    .collect()
            })
            .unwrap_or_default();
        let offsets: Vec<usize> = entry["data_offsets"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64().map(|v| v as usize))
                    .collect()
            })
            .unwrap_or_default();
        let [start, end] = offsets[..] else {
            return Err(bad(format!("tensor {key} has no data_offsets")));
        };
        let raw = body.get(start..end).ok_or_else(|| {
            bad(format!(
                "tensor {key} runs past the end of the file (truncated?)"
            ))
        })?;
        let bytes_of_shape = shape
            .iter()
            .try_fold(4usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| bad(format!("tensor {key}: shape {shape:?} overflows")))?;
        if raw.len() != bytes_of_shape {
            return Err(bad(format!(
                "tensor {key}: {} bytes for shape {shape:?}",
                raw.len()
            )));
        }
        let values = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        out.insert(key.clone(), (shape, values));
    }
    Ok(out)
}

struct Load {
    path: ModulePath,
    tensors: NamedTensors,
    error: Option<String>,
}

impl<B: Backend> ModuleMapper<B> for Load {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let name = self.path.name();
        let shape = tensor.dims().to_vec();
        let tensor = match self.tensors.remove(&name) {
            Some((s, values)) if s == shape => {
                let fresh = Tensor::<B, D>::from_data(TensorData::new(values, s), &tensor.device());
                if tensor.is_require_grad() {
                    fresh.require_grad()
                } else {
                    fresh
                }
            }
            Some((s, _)) => {
                self.error.get_or_insert(format!("{name} has shape {s:?} in the file, {shape:?} in the model; load it into a model of the same shape"));
                tensor
            }
            None => {
                self.error
                    .get_or_insert(format!("{name} is missing from the file"));
                tensor
            }
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Load the parameters of `module` from `path` by name (ids, devices and `require_grad` kept).
pub fn load<B: Backend, M: Module<B>>(module: M, path: &Path) -> Result<M, FileError> {
    let tensors = read(path)?;
    let mut loader = Load {
        path: ModulePath::default(),
        tensors,
        error: None,
    };
    let module = module.map(&mut loader);
    let mismatch = |reason| FileError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    if let Some(e) = loader.error {
        return Err(mismatch(e));
    }
    if let Some(extra) = loader.tensors.keys().next() {
        return Err(mismatch(format!(
            "the file has {extra}, which this model does not"
        )));
    }
    Ok(module)
}

struct Renumber(u64);

impl<B: Backend> ModuleMapper<B> for Renumber {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (_, tensor, mapper) = param.consume();
        self.0 += 1;
        Param::from_mapped_value(ParamId::from(self.0), tensor, mapper)
    }
}

/// Give the parameters ids 1, 2, 3, … in visiting order, so the same model built twice (or on
/// every rank) has the same ids — optimizer state saved by id then matches on resume.
pub fn deterministic_ids<B: Backend, M: Module<B>>(module: M) -> M {
    module.map(&mut Renumber(0))
}

/// What a sharded checkpoint holds, written by rank 0 next to the per-rank files.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
pub struct ShardManifest {
    /// The mesh the shards were written on.
    pub mesh: wildfire_parallel::DeviceMesh,
    /// Every parameter by path: its global shape and layout.
    pub tensors: BTreeMap<String, ShardEntry>,
}

/// One parameter of a sharded checkpoint.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
pub struct ShardEntry {
    /// Global shape.
    pub shape: Vec<usize>,
    /// Placement on each mesh axis.
    pub layout: wildfire_parallel::Layout,
}

struct CollectLocal {
    path: ModulePath,
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    entries: BTreeMap<String, ShardEntry>,
    mesh: Option<wildfire_parallel::DeviceMesh>,
    rank: usize,
}

impl<B: wildfire_parallel::DistributedBackend> ModuleVisitor<B> for CollectLocal {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = wildfire_parallel::dtensor(&param.val());
        self.mesh.get_or_insert_with(|| t.device().mesh().clone());
        self.rank = t.device().rank();
        let local = Tensor::<B::Inner, D>::from_primitive(burn::tensor::TensorPrimitive::Float(
            t.local().clone(),
        ));
        let shape = local.dims().to_vec();
        let data = local
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 data");
        let name = self.path.name();
        self.entries.insert(
            name.clone(),
            ShardEntry {
                shape: t.global_shape().to_vec(),
                layout: t.layout().clone(),
            },
        );
        self.tensors.push((name, shape, data));
    }
}

fn encode(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    let mut header = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let end = offset + data.len() * 4;
        let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
        header.push_str(&format!(
            ",\"{name}\":{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            dims.join(",")
        ));
        offset = end;
    }
    header.push('}');
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut bytes = Vec::with_capacity(8 + header.len() + offset);
    bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for (_, _, data) in tensors {
        for v in data {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    bytes
}

/// A sharded state dict: each rank writes only its local pieces to `dir/rank-NNNNN.safetensors`
/// (no communication, no full copy anywhere) and rank 0 writes `dir/manifest.json` (the mesh,
/// every parameter's global shape and layout). Loading needs the same mesh.
pub fn save_sharded<B: wildfire_parallel::DistributedBackend, M: Module<B>>(
    module: &M,
    dir: &Path,
) -> Result<(), FileError> {
    let mut c = CollectLocal {
        path: ModulePath::default(),
        tensors: Vec::new(),
        entries: BTreeMap::new(),
        mesh: None,
        rank: 0,
    };
    module.visit(&mut c);
    std::fs::create_dir_all(dir).map_err(|source| FileError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    write_atomic(
        &dir.join(format!("rank-{:05}.safetensors", c.rank)),
        &encode(&c.tensors),
    )?;
    if c.rank == 0 {
        let manifest = ShardManifest {
            mesh: c.mesh.unwrap_or_else(wildfire_parallel::DeviceMesh::single),
            tensors: c.entries,
        };
        write_atomic(
            &dir.join("manifest.json"),
            serde_json::to_string_pretty(&manifest)
                .expect("manifest")
                .as_bytes(),
        )?;
    }
    Ok(())
}

struct LoadLocal {
    path: ModulePath,
    manifest: ShardManifest,
    tensors: NamedTensors,
    error: Option<String>,
}

impl<B: wildfire_parallel::DistributedBackend> ModuleMapper<B> for LoadLocal {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let name = self.path.name();
        let shape = tensor.dims().to_vec();
        let (Some(entry), Some((local_shape, values))) =
            (self.manifest.tensors.get(&name), self.tensors.remove(&name))
        else {
            self.error
                .get_or_insert(format!("{name} is missing from the sharded checkpoint"));
            return Param::from_mapped_value(id, tensor, mapper);
        };
        if entry.shape != shape {
            self.error.get_or_insert(format!(
                "{name} has shape {:?} in the checkpoint, {shape:?} in the model",
                entry.shape
            ));
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let device = wildfire_parallel::dtensor(&tensor).device().clone();
        let local =
            Tensor::<B::Inner, D>::from_data(TensorData::new(values, local_shape), device.inner());
        match wildfire_parallel::DTensor::from_local_padded(
            local.into_primitive().tensor(),
            entry.layout.clone(),
            &entry.shape,
            &device,
        ) {
            Ok(t) => {
                let out = wildfire_parallel::from_dtensor::<B, D>(t);
                let out = if tensor.is_require_grad() {
                    out.require_grad()
                } else {
                    out
                };
                Param::from_mapped_value(id, out, mapper)
            }
            Err(e) => {
                self.error.get_or_insert(format!("{name}: {e}"));
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
    }
}

/// Load a checkpoint written by [`save_sharded`] on the same mesh: each rank reads its own file.
pub fn load_sharded<B: wildfire_parallel::DistributedBackend, M: Module<B>>(
    module: M,
    dir: &Path,
) -> Result<M, FileError> {
    let manifest_path = dir.join("manifest.json");
    let mismatch = |reason: String| FileError::Invalid {
        path: dir.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(&manifest_path).map_err(|source| FileError::Io {
        path: manifest_path.to_path_buf(),
        source,
    })?;
    let manifest: ShardManifest = serde_json::from_str(&text)
        .map_err(|e| mismatch(format!("manifest.json is corrupt: {e}")))?;
    let mut first = FirstDevice(None);
    module.visit(&mut first);
    let (mesh, rank) = first
        .0
        .ok_or_else(|| mismatch("the model has no parameters".into()))?;
    if mesh != manifest.mesh {
        return Err(mismatch(format!(
            "written on mesh {}, this run has mesh {mesh}; load the full checkpoint (model.safetensors) instead",
            manifest.mesh
        )));
    }
    let tensors = read(&dir.join(format!("rank-{rank:05}.safetensors")))?;
    let mut loader = LoadLocal {
        path: ModulePath::default(),
        manifest,
        tensors,
        error: None,
    };
    let module = module.map(&mut loader);
    match loader.error {
        Some(e) => Err(mismatch(e)),
        None => Ok(module),
    }
}

struct FirstDevice(Option<(wildfire_parallel::DeviceMesh, usize)>);

impl<B: wildfire_parallel::DistributedBackend> ModuleVisitor<B> for FirstDevice {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.0.is_none() {
            let t = wildfire_parallel::dtensor(&param.val());
            self.0 = Some((t.device().mesh().clone(), t.device().rank()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header length or a shape near 2⁶⁴ is a typed error (it overflowed the offset
    /// arithmetic, a panic in debug builds).
    #[test]
    fn corrupt_lengths_are_typed_errors() {
        let dir = std::env::temp_dir().join(format!("wildfire-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.safetensors");
        let mut bytes = u64::MAX.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        std::fs::write(&path, &bytes).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("truncated header"), "{err}");
        let header = format!(
            "{{\"w\":{{\"dtype\":\"F32\",\"shape\":[{},4],\"data_offsets\":[0,0]}}}}",
            u64::MAX
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("overflows"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
