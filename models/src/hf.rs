//! Hugging Face GPT-2 weights in and out. GPT-2's `Conv1D` keeps its weight as `[in, out]`, as
//! Burn's `Linear` does, so no weight is transposed; the names differ (`transformer.h.0.…` for
//! `blocks.0.…`, LayerNorm `weight`/`bias` for `gamma`/`beta`), and the tied `lm_head.weight` and
//! the attention-mask buffers (`attn.bias`, `attn.masked_bias`) are not parameters.
//!
//! Import ([`import_gpt2`]) makes a [`Checkpoint`] of the file, so loading it is the distributed
//! checkpoint's loading: each rank reads the tensors that overlap its pieces and keeps its pieces,
//! in any layout. The vocabulary and the context may differ from the model's: missing embedding
//! rows load as zeros (a vocabulary padded for tensor parallelism), extra ones are dropped (a
//! shorter context, as nanoGPT's `crop_block_size`). Export ([`export_gpt2`]) streams a
//! distributed checkpoint's weights into one safetensors file with GPT-2's names, one tensor in
//! memory at a time, on no rank at all.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::Error;
use wildfire_checkpoint::dcp::{
    Checkpoint, FORMAT, Metadata, PieceMeta, Reader, TensorMeta, box_dims, copy_box, write_streamed,
};

/// The Hugging Face GPT-2 name of a Wildfire GPT parameter path.
pub fn hf_name(path: &str) -> String {
    let path = match (path.strip_suffix(".gamma"), path.strip_suffix(".beta")) {
        (Some(p), _) => format!("{p}.weight"),
        (_, Some(p)) => format!("{p}.bias"),
        _ => path.to_string(),
    };
    match path.as_str() {
        "wte" | "wpe" => format!("transformer.{path}.weight"),
        _ => match path.strip_prefix("blocks.") {
            Some(rest) => format!("transformer.h.{rest}"),
            None => format!("transformer.{path}"),
        },
    }
}

/// The Wildfire path of a Hugging Face GPT-2 tensor name (with or without the `transformer.`
/// prefix); `None` for what is not a parameter here (the tied head, the mask buffers).
pub fn wildfire_path(name: &str) -> Option<String> {
    let name = name.strip_prefix("transformer.").unwrap_or(name);
    if name == "lm_head.weight" || name.ends_with(".attn.bias") || name.ends_with(".masked_bias") {
        return None;
    }
    let name = match name {
        "wte.weight" => return Some("wte".into()),
        "wpe.weight" => return Some("wpe".into()),
        _ => match name.strip_prefix("h.") {
            Some(rest) => format!("blocks.{rest}"),
            None => name.to_string(),
        },
    };
    let layer_norm = name.contains(".ln_") || name.starts_with("ln_");
    Some(
        match (
            layer_norm,
            name.strip_suffix(".weight"),
            name.strip_suffix(".bias"),
        ) {
            (true, Some(p), _) => format!("{p}.gamma"),
            (true, _, Some(p)) => format!("{p}.beta"),
            _ => name,
        },
    )
}

/// A Hugging Face GPT-2 safetensors file (F32) as a checkpoint to load a GPT from
/// ([`Checkpoint::load_model`]; it holds no optimizer state).
pub fn import_gpt2(file: &Path) -> Result<Checkpoint, Error> {
    let invalid = |reason: String| Error::Invalid {
        path: file.to_path_buf(),
        reason,
    };
    let (handle, _, header) = wildfire_checkpoint::dcp::open_safetensors(file)?;
    let len = handle
        .metadata()
        .map_err(|source| Error::io(file, source))?
        .len();
    let name = file
        .file_name()
        .ok_or_else(|| invalid("not a file".into()))?
        .to_string_lossy()
        .into_owned();
    let mut tensors = BTreeMap::new();
    for (key, entry) in &header {
        let Some(path) = wildfire_path(key) else {
            continue;
        };
        if entry.dtype != "F32" {
            return Err(invalid(format!(
                "{key} is {}; convert the file to F32 (the master weights' type)",
                entry.dtype
            )));
        }
        tensors.insert(
            format!("model/{path}"),
            TensorMeta {
                shape: entry.shape.clone(),
                dtype: "F32".into(),
                pieces: vec![PieceMeta {
                    file: name.clone(),
                    start: vec![0; entry.shape.len()],
                    end: entry.shape.clone(),
                    crc32: None,
                    chunks: None,
                    key: Some(key.clone()),
                }],
                rows_padded: path == "wte" || path == "wpe",
            },
        );
    }
    if !tensors.contains_key("model/wte") {
        return Err(invalid(
            "no token embedding (transformer.wte.weight): not a GPT-2 file".into(),
        ));
    }
    let dir = file
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    Ok(Checkpoint::new(
        dir,
        Metadata {
            format: FORMAT.into(),
            step: 0,
            mesh: wildfire_parallel::DeviceMesh::single(),
            files: [(name, len)].into_iter().collect(),
            tensors,
            optimizer_steps: BTreeMap::new(),
        },
    ))
}

/// Write the weights of `checkpoint` as one safetensors file with GPT-2's names at `out`
/// (atomically), tensor by tensor: each is assembled from its pieces (their checksums checked)
/// and written before the next is read.
pub fn export_gpt2(checkpoint: &Checkpoint, out: &Path) -> Result<(), Error> {
    let weights: Vec<(&String, &TensorMeta)> = checkpoint
        .metadata()
        .tensors
        .iter()
        .filter(|(name, _)| name.starts_with("model/"))
        .collect();
    let names: Vec<(String, Vec<usize>)> = weights
        .iter()
        .map(|(name, t)| (hf_name(&name["model/".len()..]), t.shape.clone()))
        .collect();
    let mut reader = Reader::default();
    let assemble = |i: usize| -> std::io::Result<Vec<f32>> {
        let (name, t) = weights[i];
        let mut full = vec![0f32; t.shape.iter().product()];
        for piece in &t.pieces {
            let values = reader
                .piece(checkpoint.dir(), name, piece)
                .map_err(std::io::Error::other)?;
            let size: Vec<usize> = box_dims(&piece.start, &piece.end);
            copy_box(
                &values,
                &size,
                &vec![0; size.len()],
                &mut full,
                &t.shape,
                &piece.start,
                &size,
            );
        }
        Ok(full)
    };
    write_streamed(out, &names, assemble, |_, _| {}).map_err(|source| Error::Io {
        path: out.to_path_buf(),
        source,
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::GptConfig;
    use crate::parallelize::{FsdpStrategy, ParallelConfig, parallelize_gpt};
    use burn::backend::{Autodiff, Flex};
    use std::fs;
    use wildfire_parallel::{Distributed, LaunchOptions, launch_ranks};

    type Dist = Autodiff<Distributed<Flex>>;

    /// A GPT-2 file as Hugging Face lays it out (names and shapes written out from `GPT2Model`:
    /// Conv1D weights `[in, out]`, the mask buffer `attn.bias`), each tensor distinct values.
    fn hf_file(dir: &Path, d: usize, layers: usize, vocab: usize, context: usize) -> PathBuf {
        let mut tensors: Vec<(String, Vec<usize>)> = vec![
            ("transformer.wte.weight".into(), vec![vocab, d]),
            ("transformer.wpe.weight".into(), vec![context, d]),
            ("transformer.ln_f.weight".into(), vec![d]),
            ("transformer.ln_f.bias".into(), vec![d]),
        ];
        for l in 0..layers {
            let h = |s: &str| format!("transformer.h.{l}.{s}");
            tensors.extend([
                (h("ln_1.weight"), vec![d]),
                (h("ln_1.bias"), vec![d]),
                (h("attn.bias"), vec![1, 1, context, context]),
                (h("attn.c_attn.weight"), vec![d, 3 * d]),
                (h("attn.c_attn.bias"), vec![3 * d]),
                (h("attn.c_proj.weight"), vec![d, d]),
                (h("attn.c_proj.bias"), vec![d]),
                (h("ln_2.weight"), vec![d]),
                (h("ln_2.bias"), vec![d]),
                (h("mlp.c_fc.weight"), vec![d, 4 * d]),
                (h("mlp.c_fc.bias"), vec![4 * d]),
                (h("mlp.c_proj.weight"), vec![4 * d, d]),
                (h("mlp.c_proj.bias"), vec![d]),
            ]);
        }
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .enumerate()
            .map(|(i, (_, shape))| {
                let n: usize = shape.iter().product();
                (0..n)
                    .flat_map(|j| ((i * 1000 + j) as f32 * 1e-3).to_le_bytes())
                    .collect()
            })
            .collect();
        let views = tensors.iter().zip(&data).map(|((name, shape), bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap();
            (name.clone(), view)
        });
        let path = dir.join("model.safetensors");
        safetensors::serialize_to_file(views, None, &path).unwrap();
        path
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("wildfire-hf-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn names_map_both_ways() {
        for path in [
            "wte",
            "wpe",
            "ln_f.gamma",
            "ln_f.beta",
            "blocks.3.ln_1.gamma",
            "blocks.3.attn.c_attn.weight",
            "blocks.3.mlp.c_proj.bias",
        ] {
            assert_eq!(wildfire_path(&hf_name(path)).as_deref(), Some(path));
        }
        assert_eq!(hf_name("blocks.0.ln_2.beta"), "transformer.h.0.ln_2.bias");
        assert_eq!(
            wildfire_path("h.0.attn.c_proj.weight").unwrap(),
            "blocks.0.attn.c_proj.weight"
        );
        assert_eq!(wildfire_path("transformer.h.0.attn.bias"), None);
        assert_eq!(wildfire_path("lm_head.weight"), None);
    }

    /// A GPT-2 file loads into the GPT on one rank and on a tp 2 × dp 2 FullShard mesh: every
    /// parameter holds the file's tensor (the vocabulary padded with zero rows, the context
    /// cropped); exporting the loaded weights (through a distributed checkpoint) gives the
    /// file's tensors back bitwise, with the same names.
    #[test]
    fn gpt2_files_load_sharded_and_export_back() {
        let dir = scratch("import");
        let (d, layers, vocab, context) = (8, 2, 50, 16);
        let file = hf_file(&dir, d, layers, vocab, context);
        let config = GptConfig {
            vocab_size: 52,
            block_size: 8,
            n_layer: layers,
            n_head: 2,
            n_embd: d,
            init_seed: 1,
            dropout: 0.0,
        };
        let original = wildfire_checkpoint::safetensors::read(&file).unwrap();
        for (dp, tp, fsdp) in [
            (1, 1, FsdpStrategy::NoShard),
            (2, 2, FsdpStrategy::FullShard),
        ] {
            let parallel = ParallelConfig {
                dp,
                tp,
                fsdp,
                ..ParallelConfig::default()
            };
            let mesh = parallel.mesh().unwrap();
            let save = dir.join(format!("dcp-{dp}-{tp}"));
            let out = launch_ranks::<Flex, _, _>(
                &mesh,
                &Default::default(),
                &LaunchOptions::default(),
                |device| {
                    let model =
                        crate::parallelize::init_gpt::<Dist>(&config, &device, &parallel).unwrap();
                    let model = parallelize_gpt(model, &mesh, &parallel).unwrap();
                    let model = import_gpt2(&file).unwrap().load_model(model).unwrap();
                    let mut writer = wildfire_checkpoint::dcp::CheckpointWriter::new(
                        &save,
                        device.rank(),
                        mesh.world_size(),
                    )
                    .unwrap();
                    device
                        .context()
                        .comm()
                        .barrier(wildfire_parallel::Group::World)
                        .unwrap();
                    let snapshot =
                        wildfire_checkpoint::dcp::Snapshot::take::<Dist, _, burn::optim::AdamW>(
                            &model, None,
                        )
                        .unwrap();
                    writer.save(snapshot, 1, Vec::new()).unwrap();
                    writer.wait().unwrap();
                    wildfire_checkpoint::safetensors::named_parameters(&model)
                },
            )
            .unwrap();
            for (path, shape, values) in &out[0] {
                let (hf_shape, hf_values) = &original[&hf_name(path)];
                match path.as_str() {
                    "wte" => {
                        assert_eq!(shape, &vec![52, d]);
                        assert_eq!(&values[..vocab * d], &hf_values[..]);
                        assert!(values[vocab * d..].iter().all(|v| *v == 0.0));
                    }
                    "wpe" => assert_eq!(&values[..], &hf_values[..8 * d]),
                    _ => assert_eq!((shape, values), (hf_shape, hf_values), "{path}"),
                }
            }
            let exported = dir.join(format!("export-{dp}-{tp}.safetensors"));
            let checkpoint = Checkpoint::open(save.join("step-00000001")).unwrap();
            export_gpt2(&checkpoint, &exported).unwrap();
            let back = wildfire_checkpoint::safetensors::read(&exported).unwrap();
            assert_eq!(back.len(), 4 + 12 * layers);
            for (name, (shape, values)) in &back {
                match name.as_str() {
                    "transformer.wte.weight" | "transformer.wpe.weight" => {
                        assert_eq!(shape[1], d)
                    }
                    _ => assert_eq!(
                        (shape, values),
                        (&original[name].0, &original[name].1),
                        "{name}"
                    ),
                }
            }
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
