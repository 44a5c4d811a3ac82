//! Hugging Face `LlamaForCausalLM` weights in: one `model.safetensors`, or a directory as
//! Hugging Face writes it for large models (`model.safetensors.index.json` naming the shard of
//! each tensor). Names map one to one (`model.layers.0.self_attn.q_proj.weight` is
//! `layers.0.self_attn.q_proj.weight`, a norm's `weight` Burn's `gamma`); PyTorch's `nn.Linear`
//! keeps its weight `[out, in]` where Burn's `Linear` keeps `[in, out]`, so each projection is
//! read transposed (`PieceMeta::transposed`), box by box, by the distributed checkpoint's loader:
//! each rank reads only what overlaps its pieces, in any layout. Export ([`export_llama`])
//! writes a distributed checkpoint's weights back under Hugging Face's names and orientation.
//!
//! A Mixtral (`MixtralForCausalLM`, `model_type` "mixtral") reads the same way: its attention
//! and norms are the Llama's, and each expert's matrices (`block_sparse_moe.experts.{e}.w1`,
//! `w3`, `w2`, as the Hub's files and `transformers` save them) are the slices of Wildfire's
//! stacked expert weights, read transposed box by box, so a rank reads only its experts'.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::Error;
use wildfire_checkpoint::dcp::{Checkpoint, PieceMeta, TensorMeta};

/// Mixtral's names of each expert's matrices (`block_sparse_moe.experts.{e}.w1`, …) beside the
/// stacked Wildfire weights they are slices of (`moe.experts.gate_proj`, …).
const MIXTRAL_EXPERTS: [(&str, &str); 3] =
    [("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")];

/// A Mixtral (`MixtralForCausalLM`) mixture-of-experts tensor: the router
/// (`block_sparse_moe.gate`, `[E, d]`) is Wildfire's `moe.router` (transposed, `[d, E]`), expert
/// `e`'s `w1`, `w3`, `w2` (`[ffn, d]`, `[ffn, d]`, `[d, ffn]`) are slice `e` of the stacked
/// `moe.experts.gate_proj`, `up_proj` (`[E, d, ffn]`) and `down_proj` (`[E, ffn, d]`), each
/// transposed: the Wildfire path, and the expert for a slice.
fn mixtral_path(layer: &str, tail: &str) -> Option<(String, Option<usize>)> {
    let moe = tail.strip_prefix("block_sparse_moe.")?;
    if moe == "gate.weight" {
        return Some((format!("layers.{layer}.moe.router.weight"), None));
    }
    let (e, w) = moe.strip_prefix("experts.")?.split_once('.')?;
    let e = e.parse::<usize>().ok()?;
    let w = w.strip_suffix(".weight")?;
    let (proj, _) = MIXTRAL_EXPERTS.iter().find(|(_, hf)| *hf == w)?;
    Some((format!("layers.{layer}.moe.experts.{proj}.weight"), Some(e)))
}

/// The Wildfire path of one expert's matrix in a Hugging Face Mixtral (always stored
/// transposed) and the expert (its slice of the stacked weight); `None` for any other name
/// (the router is a whole tensor: [`llama_path`] maps it).
pub fn llama_expert_path(name: &str) -> Option<(String, usize)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    match mixtral_path(layer, tail)? {
        (path, Some(e)) => Some((path, e)),
        (_, None) => None,
    }
}

/// The Wildfire path of a Hugging Face Llama tensor name and whether it is stored transposed;
/// `None` for a buffer that is not a parameter (`rotary_emb.inv_freq` in older files).
pub fn llama_path(name: &str) -> Option<Result<(String, bool), String>> {
    if name.ends_with("rotary_emb.inv_freq") {
        return None;
    }
    if name == "lm_head.weight" {
        return Some(Ok(("lm_head".into(), false)));
    }
    let Some(rest) = name.strip_prefix("model.") else {
        return Some(Err(format!("{name}: not a LlamaForCausalLM tensor")));
    };
    if rest == "embed_tokens.weight" {
        return Some(Ok(("embed_tokens".into(), false)));
    }
    if rest == "norm.weight" {
        return Some(Ok(("norm.gamma".into(), false)));
    }
    let known = |tail: &str| {
        ["input_layernorm.weight", "post_attention_layernorm.weight"].contains(&tail)
            || [
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
            ]
            .iter()
            .chain(&["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
            .any(|p| tail == format!("{p}.weight"))
    };
    let layer = rest.strip_prefix("layers.").and_then(|r| r.split_once('.'));
    // A Mixtral's router: a whole matrix, transposed.
    if let Some((i, tail)) = layer
        && let Some((path, None)) = mixtral_path(i, tail)
    {
        return Some(Ok((path, true)));
    }
    Some(match layer {
        Some((i, tail)) if i.parse::<usize>().is_ok() && known(tail) => {
            match tail.strip_suffix("layernorm.weight") {
                Some(norm) => Ok((format!("layers.{i}.{norm}layernorm.gamma"), false)),
                None => Ok((format!("layers.{i}.{tail}"), true)),
            }
        }
        _ => Err(format!(
            "{name}: not a tensor of Wildfire's Llama (biases and other extras are not part of it)"
        )),
    })
}

/// The Hugging Face name of a Wildfire Llama parameter path, and whether the file stores it
/// transposed (the inverse of [`llama_path`]).
pub fn hf_llama_name(path: &str) -> (String, bool) {
    match path {
        "lm_head" => ("lm_head.weight".into(), false),
        "embed_tokens" => ("model.embed_tokens.weight".into(), false),
        _ => match path.strip_suffix(".gamma") {
            Some(norm) => (format!("model.{norm}.weight"), false),
            None => (format!("model.{path}"), path.ends_with("_proj.weight")),
        },
    }
}

/// The Hugging Face (Mixtral) names of a mixture of experts' parameter `path`: the router's,
/// or a stacked expert weight's one per expert (`[E, in, out]` → expert `e`'s `[out, in]`);
/// `None` for any other path.
fn mixtral_names(path: &str, experts: usize) -> Option<Vec<String>> {
    let rest = path.strip_prefix("layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let prefix = format!("model.layers.{layer}.block_sparse_moe");
    if tail == "moe.router.weight" {
        return Some(vec![format!("{prefix}.gate.weight")]);
    }
    let proj = tail.strip_prefix("moe.experts.")?.strip_suffix(".weight")?;
    let (_, w) = MIXTRAL_EXPERTS.iter().find(|(ours, _)| *ours == proj)?;
    Some(
        (0..experts)
            .map(|e| format!("{prefix}.experts.{e}.{w}.weight"))
            .collect(),
    )
}

/// Write the weights of a Llama `checkpoint` as one safetensors file at `out` (atomically) with
/// Hugging Face's names, each projection transposed back to `[out, in]`, one tensor in memory
/// at a time; a mixture of experts under Mixtral's names (the router `block_sparse_moe.gate`,
/// each expert's three matrices on their own, as [`import_llama`] reads them).
pub fn export_llama(checkpoint: &Checkpoint, out: &Path) -> Result<(), Error> {
    super::export_parts(checkpoint, out, |path, shape, values| {
        let transpose =
            |values: &[f32], r: usize, c: usize| wildfire_checkpoint::dcp::transpose(values, r, c);
        if let Some(names) = mixtral_names(path, shape[0]) {
            let (r, c) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            let each = r * c;
            return names
                .into_iter()
                .enumerate()
                .map(|(e, name)| {
                    let own = values.get(e * each..(e + 1) * each).unwrap_or(&[]);
                    let own = if own.is_empty() {
                        Vec::new()
                    } else {
                        transpose(own, r, c)
                    };
                    (name, vec![c, r], own)
                })
                .collect();
        }
        let (name, transposed) = hf_llama_name(path);
        if !transposed {
            return vec![(name, shape.to_vec(), values)];
        }
        let (r, c) = (shape[0], shape[1]);
        let t = transpose(&values, r, c);
        vec![(name, vec![c, r], t)]
    })
}

/// The safetensors files of `path`: the file itself, or in a directory its index's shards
/// (`model.safetensors.index.json`) or its one `model.safetensors`.
fn weight_files(path: &Path) -> Result<(PathBuf, Vec<String>), Error> {
    let invalid = |reason: String| Error::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    if !path.is_dir() {
        let name = path
            .file_name()
            .ok_or_else(|| invalid("not a file".into()))?
            .to_string_lossy()
            .into_owned();
        let dir = path
            .parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        return Ok((dir, vec![name]));
    }
    let index = path.join("model.safetensors.index.json");
    if !index.exists() {
        return Ok((path.to_path_buf(), vec!["model.safetensors".into()]));
    }
    let text = std::fs::read_to_string(&index).map_err(|source| Error::io(&index, source))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Invalid {
        path: index.clone(),
        reason: format!("not JSON: {e}"),
    })?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Invalid {
            path: index.clone(),
            reason: "no weight_map".into(),
        })?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    files.sort();
    files.dedup();
    if let Some(bad) = files.iter().find(|f| f.contains('/') || f.contains("..")) {
        return Err(Error::Invalid {
            path: index,
            reason: format!("a shard named {bad:?} outside the directory"),
        });
    }
    Ok((path.to_path_buf(), files))
}

/// Hugging Face Llama weights (a `model.safetensors` file, or a directory with one or with
/// sharded files and their index; F32, or BF16 / F16 widened to f32 as read) as a checkpoint to
/// load a [`crate::llama::Llama`] from ([`Checkpoint::load_model`]; no optimizer state). A
/// tensor of another dtype or name is a typed error naming it.
pub fn import_llama(path: &Path) -> Result<Checkpoint, Error> {
    let (dir, names) = weight_files(path)?;
    let mut files = BTreeMap::new();
    let mut tensors = BTreeMap::new();
    // A Mixtral's experts, per stacked weight: (expert, its `[in, out]`, its piece).
    let mut experts: BTreeMap<String, Vec<(usize, Vec<usize>, PieceMeta)>> = BTreeMap::new();
    for name in names {
        let file = dir.join(&name);
        let invalid = |reason: String| Error::Invalid {
            path: file.clone(),
            reason,
        };
        let (len, header) = super::open_imported(&file)?;
        files.insert(name.clone(), len);
        for (key, entry) in &header {
            if let Some((path, e)) = llama_expert_path(key) {
                super::check_dtype(&file, key, entry)?;
                if entry.shape.len() != 2 {
                    return Err(invalid(format!(
                        "{key} of shape {:?} is not a matrix",
                        entry.shape
                    )));
                }
                let shape: Vec<usize> = entry.shape.iter().rev().copied().collect();
                let (start, end) = (vec![e, 0, 0], vec![e + 1, shape[0], shape[1]]);
                let piece = super::imported_piece(&name, key, [start, end], None, true);
                experts.entry(path).or_default().push((e, shape, piece));
                continue;
            }
            let Some(mapped) = llama_path(key) else {
                continue;
            };
            let (path, transposed) = mapped.map_err(&invalid)?;
            super::check_dtype(&file, key, entry)?;
            let mut shape = entry.shape.clone();
            if transposed {
                if shape.len() != 2 {
                    return Err(invalid(format!("{key} of shape {shape:?} is not a matrix")));
                }
                shape.reverse();
            }
            let whole = [vec![0; shape.len()], shape.clone()];
            let piece = super::imported_piece(&name, key, whole, None, transposed);
            let rows_padded = path == "embed_tokens" || path == "lm_head";
            let meta = TensorMeta {
                shape,
                dtype: "F32".into(),
                pieces: vec![piece],
                rows_padded,
            };
            if tensors.insert(format!("model/{path}"), meta).is_some() {
                return Err(invalid(format!("{key} is stored twice")));
            }
        }
    }
    // Each stacked expert weight from its experts' matrices: every expert 0..E once, of one
    // shape.
    for (stacked, mut slices) in experts {
        slices.sort_by_key(|(e, _, _)| *e);
        let n = slices.len();
        let shape = slices[0].1.clone();
        let complete = slices
            .iter()
            .enumerate()
            .all(|(i, (e, s, _))| *e == i && *s == shape);
        if !complete {
            let found: Vec<usize> = slices.iter().map(|(e, _, _)| *e).collect();
            return Err(Error::Invalid {
                path: path.to_path_buf(),
                reason: format!(
                    "the experts of {stacked}: found {found:?}, each of shape {shape:?} expected \
                     (experts 0 to {} once each, of one shape)",
                    n - 1
                ),
            });
        }
        let meta = TensorMeta {
            shape: vec![n, shape[0], shape[1]],
            dtype: "F32".into(),
            pieces: slices.into_iter().map(|(_, _, p)| p).collect(),
            rows_padded: false,
        };
        tensors.insert(format!("model/{stacked}"), meta);
    }
    if !tensors.contains_key("model/embed_tokens") {
        return Err(Error::Invalid {
            path: path.to_path_buf(),
            reason: "no token table (model.embed_tokens.weight): not a Llama file".into(),
        });
    }
    Ok(super::imported_checkpoint(dir, files, tensors))
}
