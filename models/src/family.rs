//! The model families a run can train — GPT-2 ([`crate::gpt`]) and Llama-3 ([`crate::llama`]) —
//! behind one shape type ([`ModelConfig`]) and one preset name ([`Preset`]).

use crate::Error;
use crate::gpt::GptConfig;
use crate::llama::LlamaConfig;
use serde::{Deserialize, Serialize};
use std::str::FromStr;

/// Model presets: each family's tiny one for CPUs and tests, the CPU benchmark shape, GPT-2's
/// four sizes and Llama-3's 1B, 3B and 8B.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Preset {
    /// GPT, 4 layers, 4 heads, width 128, context 128: trains in minutes on a CPU.
    Tiny,
    /// GPT, 4 layers, 4 heads, width 256, context 256 (the CPU benchmark shape).
    Small,
    /// GPT-2 small: 12 layers, 12 heads, width 768, context 1024.
    Gpt2_124m,
    /// GPT-2 medium: 24 layers, 16 heads, width 1024.
    Gpt2_350m,
    /// GPT-2 large: 36 layers, 20 heads, width 1280.
    Gpt2_774m,
    /// GPT-2 XL: 48 layers, 25 heads, width 1600.
    Gpt2_1_5b,
    /// Llama, 4 layers, 4 query heads over 2 key/value heads, width 128, context 128
    /// ([`LlamaConfig::tiny`]).
    LlamaTiny,
    /// The tiny Llama with a mixture of 8 SwiGLU experts (width 192, top-2, softmax
    /// renormalised, dropless) in every other block ([`LlamaConfig::tiny_moe`]).
    LlamaMoeTiny,
    /// Llama-3.2-1B's shape, context 2048.
    Llama3_2_1b,
    /// Llama-3.2-3B's shape, context 2048.
    Llama3_2_3b,
    /// Llama-3-8B's shape, context 2048.
    Llama3_8b,
}

/// Every preset with its names (the first is the one printed).
const NAMES: [(Preset, &[&str]); 11] = [
    (Preset::Tiny, &["tiny", "gpt-tiny"]),
    (Preset::Small, &["small", "gpt-small"]),
    (Preset::Gpt2_124m, &["gpt2-124m", "gpt2"]),
    (Preset::Gpt2_350m, &["gpt2-350m", "gpt2-medium"]),
    (Preset::Gpt2_774m, &["gpt2-774m", "gpt2-large"]),
    (Preset::Gpt2_1_5b, &["gpt2-1.5b", "gpt2-xl"]),
    (Preset::LlamaTiny, &["llama-tiny", "llama3-tiny"]),
    (Preset::LlamaMoeTiny, &["llama-moe-tiny"]),
    (Preset::Llama3_2_1b, &["llama3-1b", "llama3.2-1b"]),
    (Preset::Llama3_2_3b, &["llama3-3b", "llama3.2-3b"]),
    (Preset::Llama3_8b, &["llama3-8b"]),
];

impl FromStr for Preset {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        NAMES
            .iter()
            .find(|(_, names)| names.contains(&s))
            .map(|(p, _)| *p)
            .ok_or_else(|| Error::UnknownPreset(s.to_string()))
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (_, names) = NAMES
            .iter()
            .find(|(p, _)| p == self)
            .expect("every preset is named");
        f.write_str(names[0])
    }
}

impl Preset {
    /// The preset's shape for a vocabulary of `vocab_size` tokens.
    pub fn model(self, vocab_size: usize) -> ModelConfig {
        match self.gpt(vocab_size) {
            Some(gpt) => ModelConfig::Gpt(gpt),
            None => ModelConfig::Llama(self.llama(vocab_size).expect("a Llama preset")),
        }
    }

    /// The GPT shape of a GPT preset; `None` for a Llama preset.
    pub fn gpt(self, vocab_size: usize) -> Option<GptConfig> {
        let (n_layer, n_head, n_embd, block_size) = match self {
            Preset::Tiny => (4, 4, 128, 128),
            Preset::Small => (4, 4, 256, 256),
            Preset::Gpt2_124m => (12, 12, 768, 1024),
            Preset::Gpt2_350m => (24, 16, 1024, 1024),
            Preset::Gpt2_774m => (36, 20, 1280, 1024),
            Preset::Gpt2_1_5b => (48, 25, 1600, 1024),
            _ => return None,
        };
        Some(GptConfig {
            vocab_size,
            block_size,
            n_layer,
            n_head,
            n_embd,
            init_seed: 1337,
            dropout: 0.0,
            vocab_used: None,
            gelu: crate::gpt::Gelu::Erf,
        })
    }

    /// The Llama shape of a Llama preset; `None` for a GPT preset.
    pub fn llama(self, vocab_size: usize) -> Option<LlamaConfig> {
        let config = match self {
            Preset::LlamaTiny => LlamaConfig::tiny(vocab_size),
            Preset::LlamaMoeTiny => LlamaConfig::tiny_moe(vocab_size),
            Preset::Llama3_2_1b => LlamaConfig::llama3_2_1b(2048),
            Preset::Llama3_2_3b => LlamaConfig::llama3_2_3b(2048),
            Preset::Llama3_8b => LlamaConfig::llama3_8b(2048),
            _ => return None,
        };
        Some(LlamaConfig {
            vocab_size,
            init_seed: 1337,
            ..config
        })
    }
}

/// The shape of the model a run trains. Stored untagged, so a checkpoint's GPT shape from
/// before Llama existed still reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelConfig {
    /// A GPT-2 family model.
    Gpt(GptConfig),
    /// A Llama-3 family model.
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// The context length trained on.
    pub fn block_size(&self) -> usize {
        match self {
            Self::Gpt(c) => c.block_size,
            Self::Llama(c) => c.block_size,
        }
    }

    /// The same model with `n_layer` blocks (the block pattern as it was: a Llama's experts
    /// still every `--moe-every` blocks).
    pub fn with_n_layer(mut self, n_layer: usize) -> Self {
        match &mut self {
            Self::Gpt(c) => c.n_layer = n_layer,
            Self::Llama(c) => c.n_layer = n_layer,
        }
        self
    }

    /// Transformer blocks.
    pub fn n_layer(&self) -> usize {
        match self {
            Self::Gpt(c) => c.n_layer,
            Self::Llama(c) => c.n_layer,
        }
    }

    /// Width.
    pub fn d_model(&self) -> usize {
        match self {
            Self::Gpt(c) => c.n_embd,
            Self::Llama(c) => c.d_model,
        }
    }

    /// Attention (query) heads.
    pub fn n_head(&self) -> usize {
        match self {
            Self::Gpt(c) => c.n_head,
            Self::Llama(c) => c.n_head,
        }
    }

    /// Rows of the token table.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt(c) => c.vocab_size,
            Self::Llama(c) => c.vocab_size,
        }
    }

    /// Parameters (a tied table counted once).
    pub fn num_params(&self) -> usize {
        match self {
            Self::Gpt(c) => c.num_params(),
            Self::Llama(c) => c.num_params(),
        }
    }

    /// Training FLOPs per token for sequences of `seq` tokens.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        match self {
            Self::Gpt(c) => c.flops_per_token(seq),
            Self::Llama(c) => c.flops_per_token(seq),
        }
    }

    /// Check the shape.
    pub fn validate(&self) -> Result<(), Error> {
        match self {
            Self::Gpt(c) => c.validate(),
            Self::Llama(c) => c.validate(),
        }
    }

    /// The mixture-of-experts blocks (by index) and their routed experts; none for a dense
    /// model.
    pub fn moe_blocks(&self) -> (Vec<usize>, usize) {
        match self {
            Self::Llama(c) => match &c.moe {
                Some(m) => (
                    (0..c.n_layer).filter(|&l| m.is_moe(l)).collect(),
                    m.config.experts,
                ),
                None => (Vec::new(), 0),
            },
            Self::Gpt(_) => (Vec::new(), 0),
        }
    }

    /// The GPT shape, if a GPT.
    pub fn gpt(&self) -> Option<&GptConfig> {
        match self {
            Self::Gpt(c) => Some(c),
            Self::Llama(_) => None,
        }
    }
}
