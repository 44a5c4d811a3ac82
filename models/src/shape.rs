//! The shape of the model a run builds — a preset, the flags over it and, when it starts from a
//! Hugging Face directory, that directory's `config.json` ([`ModelFlags::resolve`]) — and the
//! Hugging Face weights of either family in and out ([`ModelConfig::import_hf`],
//! [`ModelConfig::export_hf`]).

use crate::gpt::{Gelu, GptConfig};
use crate::llama::{LlamaConfig, LlamaMoe};
use crate::moe::{BalanceScope, MoeConfig, RouterScore};
use crate::{Error, ModelConfig, Preset, hf};
use serde::{Deserialize, Serialize};
use std::path::Path;
use wildfire_checkpoint::dcp::Checkpoint;

/// The model flags of a run: a preset and the values that override it (clap flags under
/// "Model", flattened into a binary's own flags as `ParallelConfig` is; serde for the run's
/// stored configuration).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct ModelFlags {
    /// Model preset: GPT-2 (tiny, small, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b) or
    /// Llama-3 (llama-tiny, llama-moe-tiny, llama3-1b, llama3-3b, llama3-8b).
    #[arg(long, default_value = "tiny", help_heading = "Model")]
    pub preset: Preset,
    /// Transformer blocks (overrides the preset).
    #[arg(long, help_heading = "Model")]
    pub n_layer: Option<usize>,
    /// Attention heads (overrides the preset).
    #[arg(long, help_heading = "Model")]
    pub n_head: Option<usize>,
    /// Model width (overrides the preset; a Llama's SwiGLU width keeps the preset's ratio).
    #[arg(long, help_heading = "Model")]
    pub n_embd: Option<usize>,
    /// A GPT's GELU: erf (the presets') or tanh (GPT-2's `gelu_new`); a Hugging Face directory
    /// given to `--init-from` names its own.
    #[serde(default)]
    #[arg(long, value_enum, default_value_t = Gelu::Erf, help_heading = "Model")]
    pub gelu: Gelu,
    /// Key/value heads of a Llama (grouped-query attention; overrides the preset).
    #[serde(default)]
    #[arg(long, help_heading = "Model")]
    pub n_kv_head: Option<usize>,
    /// Context length (overrides the preset).
    #[arg(long, help_heading = "Model")]
    pub block_size: Option<usize>,
    /// Dropout probability while training (embeddings, attention, residual branches; 0 for
    /// pretraining; the GPT family's).
    #[serde(default)]
    #[arg(long, default_value_t = 0.0, help_heading = "Model")]
    pub dropout: f64,
    /// The mixture of experts of a Llama (flags under "Mixture of experts").
    #[serde(default)]
    #[command(flatten)]
    pub moe: MoeFlags,
}

/// A Llama's mixture-of-experts flags: `--experts E` makes every `--moe-every`-th block's MLP a
/// mixture of `E` SwiGLU experts (or overrides a MoE preset's count); the others refine it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct MoeFlags {
    /// Routed experts per mixture-of-experts block (a Llama's; overrides the preset's).
    #[arg(long, help_heading = "Mixture of experts")]
    pub experts: Option<usize>,
    /// Experts each token goes to (default: the preset's, else 2).
    #[arg(long, help_heading = "Mixture of experts")]
    pub top_k: Option<usize>,
    /// Every N-th block is a mixture of experts (blocks N−1, 2N−1, …); 1: every block.
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_every: Option<usize>,
    /// Each expert's SwiGLU width (default: the dense MLP's).
    #[arg(long, help_heading = "Mixture of experts")]
    pub expert_hidden: Option<usize>,
    /// GShard's capacity factor (tokens past an expert's capacity are dropped); 0: dropless
    /// (the default).
    #[arg(long, help_heading = "Mixture of experts")]
    pub capacity_factor: Option<f64>,
    /// Shared experts every token goes through (DeepSeek-MoE).
    #[arg(long, help_heading = "Mixture of experts")]
    pub shared_experts: Option<usize>,
    /// Router scores: softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3).
    #[arg(long, value_enum, help_heading = "Mixture of experts")]
    pub router: Option<RouterScore>,
    /// The load-balancing loss's coefficient (default 0.01).
    #[arg(long, help_heading = "Mixture of experts")]
    pub aux_loss_coef: Option<f64>,
    /// The router z-loss's coefficient (default 0.001).
    #[arg(long, help_heading = "Mixture of experts")]
    pub z_loss_coef: Option<f64>,
    /// Over which tokens the load-balancing loss counts each expert's share: the rank's
    /// micro-batch, or every data-parallel rank's together (global).
    #[serde(default)]
    #[arg(long, value_enum, help_heading = "Mixture of experts")]
    pub aux_loss_scope: Option<BalanceScope>,
}

impl MoeFlags {
    /// Whether any flag is given.
    fn any(&self) -> bool {
        *self != Self::default()
    }

    /// The flags over `preset` (a MoE preset's settings, or none): `None` when neither the
    /// preset nor `--experts` makes one; a refinement without `--experts` on a dense model is
    /// refused.
    fn over(&self, preset: Option<LlamaMoe>, ffn_hidden: usize) -> Result<Option<LlamaMoe>, Error> {
        let mut moe = match (preset, self.experts) {
            (Some(moe), _) => moe,
            (None, Some(_)) => LlamaMoe {
                config: MoeConfig::default(),
                every: 1,
                expert_hidden: ffn_hidden,
            },
            (None, None) if self.any() => {
                return Err(Error::Config(
                    "a mixture-of-experts flag without --experts on a dense preset: add \
                     --experts E"
                        .into(),
                ));
            }
            (None, None) => return Ok(None),
        };
        let c = &mut moe.config;
        c.experts = self.experts.unwrap_or(c.experts);
        c.top_k = self.top_k.unwrap_or(c.top_k);
        c.shared_experts = self.shared_experts.unwrap_or(c.shared_experts);
        c.score = self.router.unwrap_or(c.score);
        c.aux_loss_coef = self.aux_loss_coef.unwrap_or(c.aux_loss_coef);
        c.z_loss_coef = self.z_loss_coef.unwrap_or(c.z_loss_coef);
        c.balance = self.aux_loss_scope.unwrap_or(c.balance);
        if let Some(f) = self.capacity_factor {
            c.capacity_factor = (f != 0.0).then_some(f);
        }
        moe.every = self.moe_every.unwrap_or(moe.every);
        moe.expert_hidden = self.expert_hidden.unwrap_or(moe.expert_hidden);
        Ok(Some(moe))
    }
}

impl Default for ModelFlags {
    /// The tiny GPT preset, nothing overridden (what the flags give when none is passed).
    fn default() -> Self {
        Self {
            preset: Preset::Tiny,
            n_layer: None,
            n_head: None,
            n_embd: None,
            gelu: Gelu::Erf,
            n_kv_head: None,
            block_size: None,
            dropout: 0.0,
            moe: MoeFlags::default(),
        }
    }
}

/// A vocabulary of `used` tokens padded past 256 to a multiple of 64, as nanoGPT pads GPT-2's
/// 50,257 to 50,304 (the padded entries are masked out of the logits).
pub fn padded_vocab(used: usize) -> usize {
    if used > 256 {
        used.div_ceil(64) * 64
    } else {
        used
    }
}

impl ModelFlags {
    /// The model shape for data of `vocab` tokens ([`padded_vocab`]): the preset's with the flags
    /// over it — or, for a model started from the Hugging Face directory `init_from`, its
    /// `config.json`'s, with `block_size` (default: the preset's context, at most the file's
    /// positions). A flag of the other family is refused, naming it.
    pub fn resolve(&self, vocab: usize, init_from: Option<&Path>) -> Result<ModelConfig, Error> {
        let used = vocab;
        let vocab = padded_vocab(used);
        let flag = |name: &str, given: bool, family: &str| {
            if given {
                Err(Error::Config(format!(
                    "--{name} is a flag of the {family} family, not of --preset {}",
                    self.preset
                )))
            } else {
                Ok(())
            }
        };
        let hf_config = init_from
            .map(|p| p.join("config.json"))
            .filter(|f| f.is_file());
        let mut model = self.preset.model(vocab);
        match &mut model {
            ModelConfig::Gpt(c) => {
                flag("n-kv-head", self.n_kv_head.is_some(), "Llama")?;
                flag("experts", self.moe.any(), "Llama")?;
                // The tokens that exist: the data's, or a Hugging Face model's vocabulary.
                let mut real = used;
                if let Some(file) = hf_config {
                    let hf = hf::gpt2_config(&file, self.block_size)?;
                    real = real.max(hf.vocab_size);
                    *c = GptConfig {
                        init_seed: c.init_seed,
                        ..hf
                    };
                } else {
                    c.n_layer = self.n_layer.unwrap_or(c.n_layer);
                    c.n_head = self.n_head.unwrap_or(c.n_head);
                    c.n_embd = self.n_embd.unwrap_or(c.n_embd);
                    c.block_size = self.block_size.unwrap_or(c.block_size);
                    c.gelu = self.gelu;
                }
                c.vocab_size = padded_vocab(real);
                c.vocab_used = (c.vocab_size > real).then_some(real);
                c.dropout = self.dropout;
            }
            ModelConfig::Llama(c) => {
                flag("dropout", self.dropout != 0.0, "GPT")?;
                flag("gelu", self.gelu != Gelu::Erf, "GPT")?;
                if let Some(file) = hf_config {
                    let block = self.block_size.unwrap_or(c.block_size);
                    let hf = LlamaConfig::from_hf_config(&file, block)?;
                    if used > hf.vocab_size {
                        return Err(Error::Config(format!(
                            "the data's tokens reach {used}, the vocabulary of {} {}: use the \
                             tokenizer the model was trained with",
                            file.display(),
                            hf.vocab_size
                        )));
                    }
                    *c = LlamaConfig {
                        init_seed: c.init_seed,
                        ..hf
                    };
                } else {
                    c.vocab_used = (vocab > used).then_some(used);
                    c.n_layer = self.n_layer.unwrap_or(c.n_layer);
                    c.n_head = self.n_head.unwrap_or(c.n_head);
                    c.n_kv_head = self.n_kv_head.unwrap_or(c.n_kv_head.min(c.n_head));
                    if let Some(d) = self.n_embd {
                        c.ffn_hidden = c.ffn_hidden * d / c.d_model;
                        c.d_model = d;
                    }
                    c.block_size = self.block_size.unwrap_or(c.block_size);
                }
                c.moe = self.moe.over(c.moe.take(), c.ffn_hidden)?;
            }
        }
        model.validate()?;
        Ok(model)
    }
}

impl ModelConfig {
    /// Hugging Face weights of this family (a GPT-2 file, or a Llama file or sharded
    /// directory) as a checkpoint under this crate's names, each rank reading its pieces.
    pub fn import_hf(&self, path: &Path) -> Result<Checkpoint, Error> {
        self.hf_importable()?;
        match self {
            ModelConfig::Gpt(c) => hf::import_gpt2(path, c.n_head),
            ModelConfig::Llama(_) => hf::import_llama(path),
        }
    }

    /// `checkpoint`'s weights as one Hugging Face safetensors file under this family's names
    /// (a mixture of experts: Mixtral's).
    pub fn export_hf(&self, checkpoint: &Checkpoint, out: &Path) -> Result<(), Error> {
        self.hf_importable()?;
        match self {
            ModelConfig::Gpt(c) => hf::export_gpt2(checkpoint, out, c),
            ModelConfig::Llama(_) => hf::export_llama(checkpoint, out),
        }
    }

    /// Whether Hugging Face files map this model (import and export): a dense one, or a
    /// mixture of experts shaped as Mixtral's (OLMoE's and Qwen-MoE's `mlp.experts`, with
    /// their query/key norms and shared-expert gates, are not mapped).
    pub fn hf_importable(&self) -> Result<(), Error> {
        match self {
            ModelConfig::Llama(c) => c.moe.as_ref().map_or(Ok(()), mixtral_shaped),
            ModelConfig::Gpt(_) => Ok(()),
        }
    }
}

/// A mixture of experts Mixtral's files can fill: every block one, no shared experts, a top-k
/// softmax renormalised.
fn mixtral_shaped(m: &crate::llama::LlamaMoe) -> Result<(), Error> {
    let c = &m.config;
    if m.every == 1 && c.shared_experts == 0 && c.normalize && c.score == RouterScore::Softmax {
        return Ok(());
    }
    Err(Error::Config(format!(
        "Hugging Face weights of a mixture of experts are read as Mixtral's (every block a \
         mixture, no shared experts, a renormalised top-k softmax); this one has every \
         {}, {} shared experts, {:?} scores{}",
        m.every,
        c.shared_experts,
        c.score,
        if c.normalize {
            ""
        } else {
            ", not renormalised"
        }
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(preset: Preset) -> ModelFlags {
        ModelFlags {
            preset,
            ..ModelFlags::default()
        }
    }

    #[test]
    fn the_vocabulary_is_padded_and_the_padding_masked() {
        assert_eq!(padded_vocab(65), 65);
        assert_eq!(padded_vocab(50_257), 50_304);
        let Ok(ModelConfig::Gpt(c)) = flags(Preset::Tiny).resolve(50_257, None) else {
            panic!("a GPT");
        };
        assert_eq!((c.vocab_size, c.vocab_used), (50_304, Some(50_257)));
    }

    #[test]
    fn flags_override_the_preset_and_the_other_familys_are_refused() {
        let f = ModelFlags {
            n_layer: Some(2),
            n_embd: Some(64),
            n_kv_head: Some(1),
            ..flags(Preset::LlamaTiny)
        };
        let Ok(ModelConfig::Llama(c)) = f.resolve(256, None) else {
            panic!("a Llama");
        };
        let tiny = LlamaConfig::tiny(256);
        assert_eq!((c.n_layer, c.d_model, c.n_kv_head), (2, 64, 1));
        assert_eq!(c.ffn_hidden, tiny.ffn_hidden * 64 / tiny.d_model);
        let gpt = ModelFlags {
            n_kv_head: Some(1),
            ..flags(Preset::Tiny)
        };
        let err = gpt.resolve(256, None).unwrap_err().to_string();
        assert!(
            err.contains("--n-kv-head") && err.contains("Llama"),
            "{err}"
        );
        let llama = ModelFlags {
            dropout: 0.1,
            ..flags(Preset::LlamaTiny)
        };
        assert!(
            llama
                .resolve(256, None)
                .unwrap_err()
                .to_string()
                .contains("--dropout")
        );
    }
}
