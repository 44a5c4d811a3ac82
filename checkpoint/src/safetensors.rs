//! Model weights as a safetensors file (the format every framework reads), named by module path
//! (`blocks.0.attn.c_attn.weight`), written atomically; and loading them back by name.

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use wildfire_parallel::{
    Mapped, ModulePath, ParamVisitor, TryParamMapper, map_value, try_map_params, visit_params,
};

use crate::Error;

struct Collect {
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
}

impl<B: Backend> ParamVisitor<B> for Collect {
    fn visit<const D: usize>(&mut self, path: &ModulePath, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        let shape = value.dims().to_vec();
        let data = value
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 data");
        self.tensors.push((path.name(), shape, data));
    }
}

/// The parameters of `module` by path, in visiting order.
pub fn named_parameters<B: Backend, M: Module<B>>(
    module: &M,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut c = Collect {
        tensors: Vec::new(),
    };
    visit_params(module, &mut c);
    c.tensors
}

/// Every parameter of `module` (f32) as the bytes of a safetensors file. Distributed parameters
/// are gathered to full values, so every rank must call it (the collectives are matched).
pub fn to_bytes<B: Backend, M: Module<B>>(module: &M) -> Vec<u8> {
    encode(&named_parameters(module))
}

/// Write `bytes` to `path` atomically ([`crate::io::write_atomic`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    crate::io::write_atomic(path, bytes).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Write every parameter of `module` (f32) to `path` as safetensors, atomically.
pub fn save<B: Backend, M: Module<B>>(module: &M, path: &Path) -> Result<(), Error> {
    write_atomic(path, &to_bytes(module))
}

/// Tensors by name: (shape, values).
pub type NamedTensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Read a safetensors file of f32 tensors (the `safetensors` crate checks the header, the
/// offsets and the length; a corrupt or truncated file is [`Error::Invalid`]).
pub fn read(path: &Path) -> Result<NamedTensors, Error> {
    let bad = |reason: String| Error::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|source| Error::io(path, source))?;
    let file = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a safetensors file, or truncated ({e})")))?;
    let mut out = BTreeMap::new();
    for (key, view) in file.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(bad(format!(
                "tensor {key} is {:?}; only F32 is read",
                view.dtype()
            )));
        }
        let values = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        out.insert(key, (view.shape().to_vec(), values));
    }
    Ok(out)
}

struct Load {
    tensors: NamedTensors,
}

impl<B: Backend> TryParamMapper<B> for Load {
    type Error = String;

    fn try_map<const D: usize>(
        &mut self,
        path: &ModulePath,
        param: Param<Tensor<B, D>>,
    ) -> Mapped<B, D, String> {
        let name = path.name();
        map_value(param, |tensor| {
            let shape = tensor.dims().to_vec();
            match self.tensors.remove(&name) {
                Some((s, values)) if s == shape => {
                    let fresh =
                        Tensor::<B, D>::from_data(TensorData::new(values, s), &tensor.device());
                    Ok(if tensor.is_require_grad() {
                        fresh.require_grad()
                    } else {
                        fresh
                    })
                }
                Some((s, _)) => Err(format!(
                    "{name} has shape {s:?} in the file, {shape:?} in the model; load it into a model of the same shape"
                )),
                None => Err(format!("{name} is missing from the file")),
            }
        })
    }
}

/// Load the parameters of `module` from `path` by name (ids, devices and `require_grad` kept).
pub fn load<B: Backend, M: Module<B>>(module: M, path: &Path) -> Result<M, Error> {
    let tensors = read(path)?;
    let mut loader = Load { tensors };
    let mismatch = |reason| Error::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let module = try_map_params(module, &mut loader).map_err(mismatch)?;
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

fn encode(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, data)| data.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors.iter().zip(&bytes).map(|((name, shape, _), raw)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), raw)
                .expect("the bytes match the shape");
        (name.clone(), view)
    });
    safetensors::serialize(views, None).expect("F32 tensors encode")
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
        assert!(err.contains("not a safetensors file"), "{err}");
        let header = format!(
            "{{\"w\":{{\"dtype\":\"F32\",\"shape\":[{},4],\"data_offsets\":[0,0]}}}}",
            u64::MAX
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("not a safetensors file"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
