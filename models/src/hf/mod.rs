//! Hugging Face GPT-2 weights in and out. GPT-2's `Conv1D` keeps its weight as `[in, out]`, as
//! Burn's `Linear` does, so no weight is transposed; the names differ (`transformer.h.0.…` for
//! `blocks.0.…`, LayerNorm `weight`/`bias` for `gamma`/`beta`), and the tied `lm_head.weight` and
//! the attention-mask buffers (`attn.bias`, `attn.masked_bias`) are not parameters. The fused
//! q/k/v projection's columns are in another order: Hugging Face keeps `[Q | K | V]` (each head's
//! columns inside each part), Wildfire keeps them by head, `[q₀ k₀ v₀ | q₁ k₁ v₁ | …]` (so tensor
//! parallelism gives a rank whole heads), so `c_attn`'s weight and bias are reordered both ways
//! ([`hf_column`]). The tests compare against files and logits `transformers` wrote.
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

mod llama;

pub use llama::{export_llama, hf_llama_name, import_llama, llama_path};

use crate::Error;
use crate::gpt::{Gelu, GptConfig};
use wildfire_checkpoint::dcp::{
    Checkpoint, FORMAT, HeaderEntry, Metadata, PieceMeta, Reader, TensorMeta, box_dims, copy_box,
    write_streamed,
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

/// Where Wildfire's column `j` of the fused q/k/v projection (`3·d` columns, `n_head` heads,
/// by head: `[q₀ k₀ v₀ | q₁ k₁ v₁ | …]`) is in Hugging Face's (`[Q | K | V]`).
pub fn hf_column(j: usize, d: usize, n_head: usize) -> usize {
    let hd = d / n_head;
    let (head, rest) = (j / (3 * hd), j % (3 * hd));
    let (part, c) = (rest / hd, rest % hd);
    part * d + head * hd + c
}

/// Whether a Wildfire parameter path is a fused q/k/v projection (`….attn.c_attn.weight|bias`).
fn is_qkv(path: &str) -> bool {
    path.ends_with("attn.c_attn.weight") || path.ends_with("attn.c_attn.bias")
}

/// A piece of an imported file: the box `start..end` of tensor `key` in `file`, found at `at` of
/// the stored tensor (`None`: it is the stored tensor), stored transposed or not; no checksums.
fn imported_piece(
    file: &str,
    key: &str,
    [start, end]: [Vec<usize>; 2],
    at: Option<Vec<usize>>,
    transposed: bool,
) -> PieceMeta {
    PieceMeta {
        file: file.to_string(),
        start,
        end,
        crc32: None,
        chunks: None,
        key: Some(key.to_string()),
        at,
        transposed,
    }
}

/// The length and header of an imported safetensors file.
fn open_imported(file: &Path) -> Result<(u64, BTreeMap<String, HeaderEntry>), Error> {
    let (handle, _, header) = wildfire_checkpoint::dcp::open_safetensors(file)?;
    let len = handle
        .metadata()
        .map_err(|source| Error::io(file, source))?
        .len();
    Ok((len, header))
}

/// A weight `key` of an imported `file` in a dtype Wildfire reads: F32, or BF16 / F16 (widened
/// to f32 as read); another is an error naming the tensor.
fn check_dtype(file: &Path, key: &str, entry: &HeaderEntry) -> Result<(), Error> {
    if matches!(entry.dtype.as_str(), "F32" | "BF16" | "F16") {
        return Ok(());
    }
    Err(Error::Invalid {
        path: file.to_path_buf(),
        reason: format!(
            "{key} is {}; Wildfire reads F32, BF16 and F16 weights (widened to f32, the master \
             weights' type)",
            entry.dtype
        ),
    })
}

/// The checkpoint of imported `tensors` stored in `files` (name → length) of `dir`: step 0, one
/// device, no optimizer state.
fn imported_checkpoint(
    dir: PathBuf,
    files: BTreeMap<String, u64>,
    tensors: BTreeMap<String, TensorMeta>,
) -> Checkpoint {
    Checkpoint::new(
        dir,
        Metadata {
            format: FORMAT.into(),
            step: 0,
            mesh: wildfire_parallel::DeviceMesh::single(),
            files,
            tensors,
            optimizer_steps: BTreeMap::new(),
        },
    )
}

/// The pieces of a Hugging Face tensor of `shape` stored as `key` in `file`: one covering it
/// whole, or for the fused q/k/v projection one per head and part — Wildfire's columns of
/// (head, part) are a box of Hugging Face's tensor elsewhere in its last dim.
fn import_pieces(
    path: &str,
    key: &str,
    file: &str,
    shape: &[usize],
    n_head: usize,
) -> Vec<PieceMeta> {
    let piece = |start, end, at| imported_piece(file, key, [start, end], at, false);
    let last = shape.len().saturating_sub(1);
    if !is_qkv(path) || n_head == 0 || !shape[last].is_multiple_of(3 * n_head) {
        return vec![piece(vec![0; shape.len()], shape.to_vec(), None)];
    }
    let d = shape[last] / 3;
    let hd = d / n_head;
    (0..3 * n_head)
        .map(|block| {
            let j = block * hd;
            let mut start = vec![0; shape.len()];
            let mut end = shape.to_vec();
            let mut at = vec![0; shape.len()];
            (start[last], end[last], at[last]) = (j, j + hd, hf_column(j, d, n_head));
            piece(start, end, Some(at))
        })
        .collect()
}

/// A Hugging Face GPT-2 safetensors file (or a directory's `model.safetensors`; F32, or BF16 / F16 widened to f32 as read) of a model
/// with `n_head` heads as a checkpoint to load a GPT from ([`Checkpoint::load_model`]; it holds
/// no optimizer state).
pub fn import_gpt2(file: &Path, n_head: usize) -> Result<Checkpoint, Error> {
    let file = &weights_file(file);
    let invalid = |reason: String| Error::Invalid {
        path: file.to_path_buf(),
        reason,
    };
    let (len, header) = open_imported(file)?;
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
        check_dtype(file, key, entry)?;
        tensors.insert(
            format!("model/{path}"),
            TensorMeta {
                shape: entry.shape.clone(),
                dtype: "F32".into(),
                pieces: import_pieces(&path, key, &name, &entry.shape, n_head),
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
    let files = [(name, len)].into_iter().collect();
    Ok(imported_checkpoint(dir, files, tensors))
}

/// The end-of-text tokens of the Hugging Face model directory `init_from`, where `transformers`'
/// `generate` finds them: `generation_config.json`'s `eos_token_id`, else `config.json`'s (one
/// id, a list of ids, or `null`). A file given instead of a directory, or a directory with
/// neither file, names none. An unreadable file, or an `eos_token_id` that is not ids, is an
/// error naming the file.
pub fn eos_tokens(init_from: &Path) -> Result<Vec<u32>, Error> {
    if !init_from.is_dir() {
        return Ok(Vec::new());
    }
    for name in ["generation_config.json", "config.json"] {
        let path = init_from.join(name);
        if !path.is_file() {
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(|source| Error::io(&path, source))?;
        let invalid = |reason: String| Error::Invalid {
            path: path.clone(),
            reason,
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(format!("not JSON: {e}")))?;
        let id = |v: &serde_json::Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
        let bad = || invalid("eos_token_id is not a token id or a list of them".into());
        match json.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => continue,
            Some(serde_json::Value::Array(ids)) => {
                return ids.iter().map(|v| id(v).ok_or_else(bad)).collect();
            }
            Some(v) => return Ok(vec![id(v).ok_or_else(bad)?]),
        }
    }
    Ok(Vec::new())
}

/// A Hugging Face `config.json`, read and checked to be of one `model_type`; errors name the
/// file.
pub(crate) struct HfConfig {
    path: PathBuf,
    /// The file's JSON.
    pub json: serde_json::Value,
}

impl HfConfig {
    /// The configuration at `path`, which must be of one of `model_types`.
    pub(crate) fn read(path: &Path, model_types: &[&str]) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::io(path, source))?;
        let file = Self {
            path: path.to_path_buf(),
            json: serde_json::Value::Null,
        };
        let json =
            serde_json::from_str(&text).map_err(|e| file.invalid(format!("not JSON: {e}")))?;
        let file = Self { json, ..file };
        let found = file.json.get("model_type").and_then(|v| v.as_str());
        if !found.is_some_and(|t| model_types.contains(&t)) {
            return Err(file.invalid(format!(
                "model_type {found:?}; this reads {model_types:?} configurations"
            )));
        }
        Ok(file)
    }

    /// The file's `model_type` (checked when read).
    pub(crate) fn model_type(&self) -> &str {
        self.json
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
    }

    /// An error about the file.
    pub(crate) fn invalid(&self, reason: String) -> Error {
        Error::Invalid {
            path: self.path.clone(),
            reason,
        }
    }

    /// The integer under `key`.
    pub(crate) fn int(&self, key: &str) -> Result<usize, Error> {
        self.json
            .get(key)
            .and_then(serde_json::Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| self.invalid(format!("no integer {key}")))
    }
}

/// The GPT shape a Hugging Face GPT-2 `config.json` gives: its layers, heads, width, vocabulary
/// and GELU (`activation_function`), with a `block_size` context (default: its `n_positions`,
/// which it may not exceed). Another model type, activation or a width the heads do not divide
/// is an error naming it.
pub fn gpt2_config(path: &Path, block_size: Option<usize>) -> Result<GptConfig, Error> {
    let file = HfConfig::read(path, &["gpt2"])?;
    let (json, invalid, int) = (&file.json, |r| file.invalid(r), |k| file.int(k));
    let act = json
        .get("activation_function")
        .and_then(|v| v.as_str())
        .unwrap_or("gelu_new");
    let gelu = Gelu::from_hf(act)
        .ok_or_else(|| invalid(format!("activation_function {act:?}: not a GELU")))?;
    let positions = int("n_positions")?;
    let block_size = block_size.unwrap_or(positions);
    if block_size > positions {
        return Err(invalid(format!(
            "a context of {block_size} past n_positions {positions}"
        )));
    }
    let config = GptConfig {
        vocab_size: int("vocab_size")?,
        block_size,
        n_layer: int("n_layer")?,
        n_head: int("n_head")?,
        n_embd: int("n_embd")?,
        init_seed: 1337,
        dropout: 0.0,
        vocab_used: None,
        gelu,
    };
    config.validate().map_err(|e| invalid(e.to_string()))?;
    Ok(config)
}

/// The weights file of `path`: the file itself, or a directory's `model.safetensors`.
pub fn weights_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("model.safetensors")
    } else {
        path.to_path_buf()
    }
}

/// Write the weights of `checkpoint` (a GPT of shape `config`) as one safetensors file with
/// GPT-2's names and column order at `out` (atomically), tensor by tensor: each is assembled
/// from its pieces (their checksums checked) and written before the next is read. A padded
/// vocabulary ([`GptConfig::vocab_used`]) is written without its padding rows: the file has the
/// tokens that exist, as `transformers` expects (GPT-2's 50,257).
pub fn export_gpt2(checkpoint: &Checkpoint, out: &Path, config: &GptConfig) -> Result<(), Error> {
    let n_head = config.n_head;
    let used = config.vocab_used;
    export_with(checkpoint, out, |path, shape, mut full| {
        if let (Some(used), "wte") = (used, path) {
            let width = shape.get(1).copied().unwrap_or(1);
            full.truncate(used * width);
            return (hf_name(path), vec![used, width], full);
        }
        if !is_qkv(path) {
            return (hf_name(path), shape.to_vec(), full);
        }
        // Back into Hugging Face's `[Q | K | V]` order, row by row.
        let cols = *shape.last().expect("a qkv tensor has a last dim");
        let mut hf = vec![0f32; full.len()];
        for (src, dst) in full.chunks(cols).zip(hf.chunks_mut(cols)) {
            for (j, &v) in src.iter().enumerate() {
                dst[hf_column(j, cols / 3, n_head)] = v;
            }
        }
        (hf_name(path), shape.to_vec(), hf)
    })
}

/// Write the weights of `checkpoint` as one safetensors file at `out` (atomically), tensor by
/// tensor in the checkpoint's order: each is assembled from its pieces (their checksums
/// checked), turned by `convert(path, shape, values)` into its name, shape and values in the
/// file, and written before the next is read — one tensor in memory at a time.
pub(crate) fn export_with(
    checkpoint: &Checkpoint,
    out: &Path,
    convert: impl Fn(&str, &[usize], Vec<f32>) -> (String, Vec<usize>, Vec<f32>),
) -> Result<(), Error> {
    export_parts(checkpoint, out, |path, shape, values| {
        vec![convert(path, shape, values)]
    })
}

/// [`export_with`] where a tensor may become several (a stacked expert weight: one tensor per
/// expert); `convert` is called with empty values first, for the names and shapes, and must
/// give the same list then. One Wildfire tensor in memory at a time.
pub(crate) fn export_parts(
    checkpoint: &Checkpoint,
    out: &Path,
    convert: impl Fn(&str, &[usize], Vec<f32>) -> Vec<(String, Vec<usize>, Vec<f32>)>,
) -> Result<(), Error> {
    let weights: Vec<(&String, &TensorMeta)> = checkpoint
        .metadata()
        .tensors
        .iter()
        .filter(|(name, _)| name.starts_with("model/"))
        .collect();
    // Names and shapes first (the header), from empty values; each output's source tensor.
    let (mut names, mut sources) = (Vec::new(), Vec::new());
    for (t, (name, meta)) in weights.iter().enumerate() {
        let parts = convert(&name["model/".len()..], &meta.shape, Vec::new());
        for (p, (name, shape, _)) in parts.into_iter().enumerate() {
            names.push((name, shape));
            sources.push((t, p));
        }
    }
    let mut reader = Reader::default();
    // The converted parts of the last tensor read (outputs come in order).
    let mut last: Option<(usize, Vec<Vec<f32>>)> = None;
    let assemble = |i: usize| -> std::io::Result<Vec<f32>> {
        let (t, p) = sources[i];
        if last.as_ref().is_none_or(|(at, _)| *at != t) {
            let (name, meta) = weights[t];
            let mut full = vec![0f32; meta.shape.iter().product()];
            for piece in &meta.pieces {
                let values = reader
                    .piece(checkpoint.dir(), name, piece)
                    .map_err(std::io::Error::other)?;
                let size: Vec<usize> = box_dims(&piece.start, &piece.end);
                copy_box(
                    &values,
                    &size,
                    &vec![0; size.len()],
                    &mut full,
                    &meta.shape,
                    &piece.start,
                    &size,
                );
            }
            let parts = convert(&name["model/".len()..], &meta.shape, full);
            last = Some((t, parts.into_iter().map(|(_, _, v)| v).collect()));
        }
        let (_, parts) = last.as_mut().expect("read above");
        Ok(std::mem::take(&mut parts[p]))
    };
    write_streamed(out, &names, assemble, |_, _| {}, None).map_err(|source| Error::Io {
        path: out.to_path_buf(),
        source,
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CausalLm;
    use crate::gpt::GptConfig;
    use crate::parallelize::{FsdpStrategy, ParallelConfig, parallelize_gpt};
    use burn::backend::{Autodiff, Flex};
    use std::fs;
    use wildfire_parallel::{Distributed, LaunchOptions, launch_ranks};

    type Dist = Autodiff<Distributed<Flex>>;

    /// `f` on every rank of `parallel`'s mesh, ranks as threads; the results in rank order.
    fn ranks<T: Send>(
        parallel: &ParallelConfig,
        f: impl Fn(wildfire_parallel::DistDevice<Flex>) -> T + Sync,
    ) -> Vec<T> {
        let mesh = parallel.mesh().unwrap();
        launch_ranks::<Flex, _, _>(&mesh, &Default::default(), &LaunchOptions::default(), f)
            .unwrap()
    }

    /// On one rank: the GPT of `config`, laid out as `parallel` says, loaded from the Hugging
    /// Face `file`, and saved as the distributed checkpoint of step 1 under `save`.
    fn import_and_save(
        device: &wildfire_parallel::DistDevice<Flex>,
        config: &GptConfig,
        parallel: &ParallelConfig,
        file: &Path,
        save: &Path,
    ) -> crate::gpt::Gpt<Dist> {
        let model = crate::parallelize::init_gpt::<Dist>(config, device, parallel).unwrap();
        let model = parallelize_gpt(model, device.mesh(), parallel).unwrap();
        let model = import_gpt2(file, config.n_head)
            .unwrap()
            .load_model(model)
            .unwrap();
        let world = device.mesh().world_size();
        let mut writer =
            wildfire_checkpoint::dcp::CheckpointWriter::new(save, device.rank(), world).unwrap();
        let comm = device.context().comm();
        comm.barrier(wildfire_parallel::Group::World).unwrap();
        let snapshot =
            wildfire_checkpoint::dcp::Snapshot::take::<Dist, _, burn::optim::AdamW>(&model, None)
                .unwrap();
        writer.save(snapshot, 1, Vec::new()).unwrap();
        writer.wait().unwrap();
        model
    }

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

    /// The end-of-text ids come from `generation_config.json` first, else `config.json` (one
    /// id, a list, or `null`: none); a file, or a directory without them, names none; ids that
    /// are not ids are an error naming the file.
    #[test]
    fn end_of_text_ids_are_read_where_transformers_reads_them() {
        let dir = scratch("eos");
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(super::eos_tokens(&dir).unwrap(), Vec::<u32>::new());
        let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
        write(
            "config.json",
            r#"{"model_type": "llama", "eos_token_id": 7}"#,
        );
        assert_eq!(super::eos_tokens(&dir).unwrap(), [7]);
        assert!(
            super::eos_tokens(&dir.join("config.json"))
                .unwrap()
                .is_empty()
        );
        write(
            "generation_config.json",
            r#"{"eos_token_id": [128001, 128009]}"#,
        );
        assert_eq!(super::eos_tokens(&dir).unwrap(), [128001, 128009]);
        write("generation_config.json", r#"{"eos_token_id": null}"#);
        assert_eq!(super::eos_tokens(&dir).unwrap(), [7]);
        write("config.json", r#"{"model_type": "gpt2"}"#);
        assert!(super::eos_tokens(&dir).unwrap().is_empty());
        write("generation_config.json", r#"{"eos_token_id": "</s>"}"#);
        let err = super::eos_tokens(&dir).unwrap_err().to_string();
        assert!(err.contains("generation_config.json"), "{err}");
        write("generation_config.json", r#"{"eos_token_id": [1, -2]}"#);
        assert!(super::eos_tokens(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
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
            vocab_used: None,
            gelu: crate::gpt::Gelu::Erf,
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
            let save = dir.join(format!("dcp-{dp}-{tp}"));
            let out = ranks(&parallel, |device| {
                let model = import_and_save(&device, &config, &parallel, &file, &save);
                wildfire_checkpoint::safetensors::named_parameters(&model)
            });
            for (path, shape, values) in &out[0] {
                let (hf_shape, hf_values) = &original[&hf_name(path)];
                match path.as_str() {
                    "wte" => {
                        assert_eq!(shape, &vec![52, d]);
                        assert_eq!(&values[..vocab * d], &hf_values[..]);
                        assert!(values[vocab * d..].iter().all(|v| *v == 0.0));
                    }
                    "wpe" => assert_eq!(&values[..], &hf_values[..8 * d]),
                    // By head here, `[Q | K | V]` in the file.
                    _ if is_qkv(path) => {
                        assert_eq!(shape, hf_shape, "{path}");
                        for (row, hf_row) in values.chunks(3 * d).zip(hf_values.chunks(3 * d)) {
                            for (j, v) in row.iter().enumerate() {
                                assert_eq!(*v, hf_row[hf_column(j, d, 2)], "{path} column {j}");
                            }
                        }
                    }
                    _ => assert_eq!((shape, values), (hf_shape, hf_values), "{path}"),
                }
            }
            let exported = dir.join(format!("export-{dp}-{tp}.safetensors"));
            let checkpoint = Checkpoint::open(save.join("step-00000001")).unwrap();
            export_gpt2(&checkpoint, &exported, &config).unwrap();
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

    /// The tiny GPT-2 `transformers` wrote (`tools/gpt2_reference.py`) and its reference values.
    struct Gpt2Fixture {
        dir: PathBuf,
        /// `reference.safetensors`: f32 tensors by name (the tokens widened).
        reference: BTreeMap<String, Vec<f32>>,
        /// The `[2, t]` reference tokens, row-major.
        tokens: Vec<i64>,
        config: GptConfig,
    }

    impl Gpt2Fixture {
        fn load() -> Self {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gpt2_tiny");
            let (reference, tokens) = widened_reference(&dir.join("reference.safetensors"));
            let config = GptConfig {
                vocab_size: 256,
                block_size: 32,
                n_layer: 2,
                n_head: 4,
                n_embd: 64,
                init_seed: 1,
                dropout: 0.0,
                vocab_used: None,
                gelu: crate::gpt::Gelu::Erf,
            };
            Self {
                dir,
                reference,
                tokens,
                config,
            }
        }

        /// The reference values under `key`.
        fn floats(&self, key: &str) -> Vec<f32> {
            self.reference[key].clone()
        }

        /// Positions `range` of both rows of the tokens, on `device`.
        fn ids(
            &self,
            range: std::ops::Range<usize>,
            device: &wildfire_parallel::DistDevice<Flex>,
        ) -> burn::tensor::Tensor<Dist, 2, burn::tensor::Int> {
            let t = self.tokens.len() / 2;
            let rows: Vec<i64> = self
                .tokens
                .chunks(t)
                .flat_map(|row| row[range.clone()].to_vec())
                .collect();
            let data = burn::tensor::TensorData::new(rows, [2, range.len()]);
            burn::tensor::Tensor::from_data(data, device)
        }

        /// The largest difference between `logits` and the reference under `key`.
        fn logits_off(&self, logits: &[f32], key: &str) -> f32 {
            crate::largest_difference(logits, &self.reference[key])
        }
    }

    /// The tiny GPT-2 `transformers` wrote (4 heads, every parameter perturbed, the exact GELU):
    /// imported, Wildfire's logits on the reference tokens are within 1e-4 of
    /// `GPT2LMHeadModel`'s and its loss within 1e-5 — at world size 1 and laid out dp 2 × tp 2
    /// under FSDP — and exported back, every tensor is bitwise the file's, under its name.
    #[test]
    fn a_transformers_gpt2_gives_its_logits_and_exports_bitwise() {
        let fixture = Gpt2Fixture::load();
        let file = fixture.dir.join("model.safetensors");
        let t = fixture.tokens.len() / 2;
        let want_loss = fixture.floats("loss")[0];
        let dir = scratch("transformers");
        for (dp, tp, fsdp) in [
            (1, 1, FsdpStrategy::NoShard),
            (2, 2, FsdpStrategy::FullShard),
        ] {
            let parallel = ParallelConfig::layout(dp, tp, fsdp, None);
            let save = dir.join(format!("dcp-{dp}-{tp}"));
            let out = ranks(&parallel, |device| {
                let model = import_and_save(&device, &fixture.config, &parallel, &file, &save);
                let logits = model.forward(fixture.ids(0..t, &device)).into_data();
                // transformers' loss: each position predicts the next token.
                let (x, y) = (fixture.ids(0..t - 1, &device), fixture.ids(1..t, &device));
                let loss = model.loss(x, y).into_scalar();
                (logits.convert::<f32>().to_vec::<f32>().unwrap(), loss)
            });
            for (rank, (logits, loss)) in out.iter().enumerate() {
                let worst = fixture.logits_off(logits, "logits");
                assert!(
                    worst <= 1e-4,
                    "dp {dp} tp {tp} rank {rank}: logits off by {worst}"
                );
                assert!(
                    (loss - want_loss).abs() <= 1e-5 * want_loss,
                    "dp {dp} tp {tp} rank {rank}: loss {loss} vs {want_loss}"
                );
            }
            let exported = dir.join(format!("export-{dp}-{tp}.safetensors"));
            let checkpoint = Checkpoint::open(save.join("step-00000001")).unwrap();
            export_gpt2(&checkpoint, &exported, &fixture.config).unwrap();
            let original = wildfire_checkpoint::safetensors::read(&file).unwrap();
            let back = wildfire_checkpoint::safetensors::read(&exported).unwrap();
            assert_eq!(back.len(), original.len());
            for (name, tensor) in &original {
                assert_eq!(back.get(name), Some(tensor), "{name}");
            }
        }
    }

    /// A safetensors file's tensors widened to f32 (F32 as they are, BF16 by its bits).
    fn widened(path: &Path) -> wildfire_checkpoint::safetensors::NamedTensors {
        let bytes = fs::read(path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        file.tensors()
            .into_iter()
            .map(|(name, view)| {
                let values = match view.dtype() {
                    safetensors::Dtype::F32 => view
                        .data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                    safetensors::Dtype::BF16 => view
                        .data()
                        .chunks_exact(2)
                        .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                        .collect(),
                    other => panic!("{name}: {other:?}"),
                };
                (name, (view.shape().to_vec(), values))
            })
            .collect()
    }

    /// A GPT-2 with the real 50,257-token vocabulary, as `transformers` saves it in bf16
    /// (`tests/fixtures/gpt2_vocab`, 2 heads): Wildfire pads the vocabulary to 50,304, and the
    /// padded columns stay out of everything — the log-sum-exp over all 50,304 of Wildfire's
    /// logits is `transformers`' over its 50,257 (within 1e-4), the logits at 64 columns (the
    /// vocabulary's last 16 among them) within 1e-4, the loss within 1e-5 — at world size 1 and
    /// dp 2 × tp 2 FullShard (the padded table vocabulary-parallel); exported back, the file has
    /// 50,257 rows again and every tensor equals the bf16 file's, widened.
    #[test]
    fn a_transformers_gpt2_with_the_real_vocabulary_masks_its_padding() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gpt2_vocab");
        let reference = widened_reference(&dir.join("reference.safetensors"));
        let mut config = gpt2_config(&dir.join("config.json"), None).unwrap();
        assert_eq!(config.vocab_size, 50_257);
        config.vocab_size = crate::shape::padded_vocab(50_257);
        config.vocab_used = Some(50_257);
        let file = dir.join("model.safetensors");
        let (tokens, t) = (&reference.1, reference.1.len() / 2);
        let cols: Vec<usize> = reference.0["cols"].iter().map(|&c| c as usize).collect();
        let scratch = scratch("vocab");
        for (dp, tp, fsdp) in [
            (1, 1, FsdpStrategy::NoShard),
            (2, 2, FsdpStrategy::FullShard),
        ] {
            let parallel = ParallelConfig::layout(dp, tp, fsdp, None);
            let save = scratch.join(format!("dcp-{dp}-{tp}"));
            let out = ranks(&parallel, |device| {
                let model = import_and_save(&device, &config, &parallel, &file, &save);
                let ids = |range: std::ops::Range<usize>| {
                    let rows: Vec<i64> = tokens
                        .chunks(t)
                        .flat_map(|row| row[range.clone()].to_vec())
                        .collect();
                    let n = range.len();
                    burn::tensor::Tensor::<Dist, 2, burn::tensor::Int>::from_data(
                        burn::tensor::TensorData::new(rows, [2, n]),
                        &device,
                    )
                };
                let logits = model.forward(ids(0..t)).into_data();
                let loss = model.loss(ids(0..t - 1), ids(1..t)).into_scalar();
                (logits.convert::<f32>().to_vec::<f32>().unwrap(), loss)
            });
            for (rank, (logits, loss)) in out.iter().enumerate() {
                let what = format!("dp {dp} tp {tp} rank {rank}");
                assert_eq!(logits.len(), 2 * t * 50_304, "{what}");
                for (p, row) in logits.chunks(50_304).enumerate() {
                    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    let lse = max
                        + row
                            .iter()
                            .map(|v| ((v - max) as f64).exp())
                            .sum::<f64>()
                            .ln() as f32;
                    let want = reference.0["lse"][p];
                    assert!(
                        (lse - want).abs() <= 1e-4,
                        "{what} position {p}: lse {lse} vs {want}"
                    );
                    for (i, &c) in cols.iter().enumerate() {
                        let want = reference.0["logits_at"][p * cols.len() + i];
                        assert!(
                            (row[c] - want).abs() <= 1e-4,
                            "{what} position {p} column {c}"
                        );
                    }
                    assert!(
                        row[50_257..].iter().all(|&v| v < max - 30.0),
                        "{what}: a padded column competes"
                    );
                }
                let want = reference.0["loss"][0];
                assert!(
                    (loss - want).abs() <= 1e-5 * want,
                    "{what}: loss {loss} vs {want}"
                );
            }
            let exported = scratch.join(format!("export-{dp}-{tp}.safetensors"));
            let checkpoint = Checkpoint::open(save.join("step-00000001")).unwrap();
            export_gpt2(&checkpoint, &exported, &config).unwrap();
            let original = widened(&file);
            let back = wildfire_checkpoint::safetensors::read(&exported).unwrap();
            assert_eq!(back["transformer.wte.weight"].0, [50_257, 2]);
            assert_eq!(back.len(), original.len());
            for (name, tensor) in &original {
                assert_eq!(back.get(name), Some(tensor), "{name}");
            }
        }
        fs::remove_dir_all(&scratch).unwrap();
    }

    /// `reference.safetensors` of a fixture: its f32 tensors (i64 ones widened) by name, and the
    /// `tokens` as ids.
    fn widened_reference(path: &Path) -> (BTreeMap<String, Vec<f32>>, Vec<i64>) {
        let bytes = fs::read(path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut floats = BTreeMap::new();
        let mut tokens = Vec::new();
        for (name, view) in file.tensors() {
            if view.dtype() == safetensors::Dtype::I64 {
                let ids: Vec<i64> = view
                    .data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                if name == "tokens" {
                    tokens = ids.clone();
                }
                floats.insert(name, ids.iter().map(|&i| i as f32).collect());
            } else {
                let values = view.data().chunks_exact(4);
                let values = values.map(|c| f32::from_le_bytes(c.try_into().unwrap()));
                floats.insert(name, values.collect());
            }
        }
        (floats, tokens)
    }

    /// The same GPT-2 stored in f16, as Hugging Face ships larger models: imported (widened to
    /// f32 as read), its logits are within 1e-4 of `transformers`' logits of the same rounded
    /// weights (bf16: `a_transformers_gpt2_with_the_real_vocabulary_masks_its_padding`).
    #[test]
    fn f16_files_load_widened() {
        let fixture = Gpt2Fixture::load();
        let t = fixture.tokens.len() / 2;
        let parallel = ParallelConfig::default();
        let name = "f16";
        let file = fixture.dir.join(format!("model-{name}.safetensors"));
        let logits = ranks(&parallel, |device| {
            let model =
                crate::parallelize::init_gpt::<Dist>(&fixture.config, &device, &parallel).unwrap();
            let model = import_gpt2(&file, 4).unwrap().load_model(model).unwrap();
            let logits = model.forward(fixture.ids(0..t, &device)).into_data();
            logits.convert::<f32>().to_vec::<f32>().unwrap()
        });
        let worst = fixture.logits_off(&logits[0], &format!("logits_{name}"));
        assert!(worst <= 1e-4, "{name}: logits off by {worst}");
    }

    /// GPT-2's own tanh GELU: the same weights with `Gelu::Tanh` give `transformers`' logits under
    /// `activation_function: "gelu_new"` within 1e-4 (the exact GELU's are 3e-4 away: the test
    /// tells them apart); the directory's `config.json` reads as the fixture's shape, its GELU
    /// the file's.
    #[test]
    fn the_tanh_gelu_gives_gpt2s_own_logits() {
        let fixture = Gpt2Fixture::load();
        let t = fixture.tokens.len() / 2;
        let parallel = ParallelConfig::default();
        let tanh = GptConfig {
            gelu: crate::gpt::Gelu::Tanh,
            ..fixture.config.clone()
        };
        let logits = ranks(&parallel, |device| {
            let model = crate::parallelize::init_gpt::<Dist>(&tanh, &device, &parallel).unwrap();
            let model = import_gpt2(&fixture.dir, 4)
                .unwrap()
                .load_model(model)
                .unwrap();
            let logits = model.forward(fixture.ids(0..t, &device)).into_data();
            logits.convert::<f32>().to_vec::<f32>().unwrap()
        });
        let worst = fixture.logits_off(&logits[0], "logits_tanh");
        assert!(worst <= 1e-4, "tanh: logits off by {worst}");
        assert!(fixture.logits_off(&logits[0], "logits") > 2e-4);
        let read = gpt2_config(&fixture.dir.join("config.json"), None).unwrap();
        assert_eq!(
            read,
            GptConfig {
                init_seed: 1337,
                ..fixture.config.clone()
            }
        );
        assert!(gpt2_config(&fixture.dir.join("config.json"), Some(33)).is_err());
    }
}
