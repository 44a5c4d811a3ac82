//! The GPT-2 family: pre-LayerNorm blocks, causal self-attention, GELU MLP, learned positions,
//! input and output embeddings tied, GPT-2 initialisation (nanoGPT / llm.c conventions).

use crate::Error;
use crate::init::{LayoutFn, Place, Values};
use crate::lm::CausalLm;
use burn::module::Param;
use burn::nn::{LayerNorm, LayerNormConfig, Linear};
use burn::prelude::*;
use burn::tensor::activation;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use wildfire_kernels::hooks::{ForwardHooks, Inference};
use wildfire_kernels::{FusedOps, ops};
use wildfire_parallel::DistributedBackend;

mod block;

pub use crate::lm::{PADDED_LOGIT, TokenSampler, cross_entropy};
use crate::lm::{dense, table_logits};
use crate::stage::PipelineStage;

crate::stage::stage_inits!(GptConfig, GptStage);
pub use crate::stage::{StageInput, generate_staged, stage_param_name, stage_pass};
use block::layer_norm;
pub use block::{Block, CausalSelfAttention, LN_EPSILON, MlpBlock};

/// The shape of a GPT model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Vocabulary size (GPT-2 BPE: 50257, often padded to 50304; bytes: 256).
    pub vocab_size: usize,
    /// Context length (learned positions).
    pub block_size: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Model width.
    pub n_embd: usize,
    /// Seed of the initial weights (drawn on the host, so every backend and rank agrees).
    pub init_seed: u64,
    /// Dropout probability (embeddings, attention probabilities, residual branches) while
    /// training; 0 for pretraining, as GPT-2 reproductions use.
    #[serde(default)]
    pub dropout: f64,
    /// The tokens that exist when `vocab_size` is padded (GPT-2 BPE: 50257 of 50304): the
    /// padded ones are masked out of the logits (their logit [`PADDED_LOGIT`]), so they are
    /// never predicted or sampled and take nothing of the loss's normaliser — llm.c's
    /// `Vp`/`V`. `None`: every token exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_used: Option<usize>,
    /// The MLP's GELU: the exact one (the built-in presets) or GPT-2's tanh approximation
    /// (`gelu_new`, what a Hugging Face GPT-2 configuration names).
    #[serde(default)]
    pub gelu: Gelu,
}

/// Which GELU an MLP applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Gelu {
    /// `x·Φ(x)`, with the error function (PyTorch's `gelu`).
    #[default]
    Erf,
    /// `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`: GPT-2's original (`gelu_new`,
    /// `gelu_pytorch_tanh`).
    Tanh,
}

impl Gelu {
    /// The GELU a Hugging Face `activation_function` names; `None` for another activation.
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "gelu" | "gelu_python" => Some(Self::Erf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Some(Self::Tanh),
            _ => None,
        }
    }
}

impl GptConfig {
    /// Check the shape.
    pub fn validate(&self) -> Result<(), Error> {
        for (what, v) in [
            ("vocab_size", self.vocab_size),
            ("block_size", self.block_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
        ] {
            if v == 0 {
                return Err(Error::Zero { what });
            }
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::Dropout(self.dropout));
        }
        if self
            .vocab_used
            .is_some_and(|used| used == 0 || used > self.vocab_size)
        {
            return Err(Error::Zero {
                what: "vocab_used (at most vocab_size): the tokens that exist",
            });
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(Error::Heads {
                n_embd: self.n_embd,
                n_head: self.n_head,
            });
        }
        Ok(())
    }

    /// Number of parameters (the tied embedding counted once).
    pub fn num_params(&self) -> usize {
        let (v, t, d, l) = (self.vocab_size, self.block_size, self.n_embd, self.n_layer);
        let block =
            2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d);
        v * d + t * d + l * block + 2 * d
    }

    /// Training FLOPs per token for a sequence of `seq` tokens: 6N + 12·L·d·T (PaLM appendix B;
    /// N without the position embedding).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let n = (self.num_params() - self.block_size * self.n_embd) as f64;
        6.0 * n + 12.0 * (self.n_layer * self.n_embd * seq) as f64
    }

    /// Build the model on `device`, with GPT-2's initialisation: weights N(0, 0.02), residual
    /// output projections N(0, 0.02/√(2L)), biases 0, LayerNorm 1 and 0.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Result<Gpt<B>, Error> {
        Ok(self
            .init_stage(device, 0..self.n_layer, true, true)?
            .into_gpt())
    }

    /// Build the model already laid out over `device`'s mesh, each parameter in the layout
    /// `layouts` gives it (called once with every parameter's path and shape, in construction
    /// order), each rank drawing only its own pieces — the same values [`GptConfig::init`] gives
    /// there, and no rank ever holds a whole parameter its layout splits. See
    /// [`crate::parallelize::init_gpt`], which lays it out as `parallelize_gpt` would.
    pub fn init_in_layouts<B: DistributedBackend>(
        &self,
        device: &B::Device,
        layouts: impl LayoutFn,
    ) -> Result<Gpt<B>, Error> {
        let whole = self.init_stage_in_layouts(device, 0..self.n_layer, true, true, layouts)?;
        Ok(whole.into_gpt())
    }

    /// Blocks `blocks` of the model (the embeddings when `first`, the head when `last`), their
    /// parameters made by `place`. Every parameter's values have their own stream, numbered as
    /// in the whole model (each block's four projections, then the token and the position
    /// table), so a stage holds exactly the whole model's values.
    fn build<B: Backend>(
        &self,
        place: &mut impl Place<B>,
        device: &B::Device,
        range: Range<usize>,
        first: bool,
        last: bool,
    ) -> GptStage<B> {
        let d = self.n_embd;
        let proj_std = 0.02 / ((2 * self.n_layer) as f32).sqrt();
        let normal = |count: usize, std: f32| Values::Normal {
            stream: self.init_seed ^ (count as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            std,
        };
        let mut make_linear = |path: &str, d_in: usize, d_out: usize, values: Values| Linear {
            weight: Param::from_tensor(place.tensor(
                &format!("{path}.weight"),
                [d_in, d_out],
                values,
            )),
            bias: Some(Param::from_tensor(place.tensor(
                &format!("{path}.bias"),
                [d_out],
                Values::Constant(0.0),
            ))),
        };
        let layer_norm = || {
            LayerNormConfig::new(d)
                .with_epsilon(LN_EPSILON)
                .init(device)
        };
        let mut blocks = Vec::with_capacity(range.len());
        for l in range.clone() {
            // Stage-local paths (`blocks.0` is the stage's first block): the parallel plans
            // match them by pattern.
            let i = l - range.start;
            let c_attn = make_linear(
                &format!("blocks.{i}.attn.c_attn"),
                d,
                3 * d,
                normal(4 * l + 1, 0.02),
            );
            let c_proj = make_linear(
                &format!("blocks.{i}.attn.c_proj"),
                d,
                d,
                normal(4 * l + 2, proj_std),
            );
            let c_fc = make_linear(
                &format!("blocks.{i}.mlp.c_fc"),
                d,
                4 * d,
                normal(4 * l + 3, 0.02),
            );
            let mlp_proj = make_linear(
                &format!("blocks.{i}.mlp.c_proj"),
                4 * d,
                d,
                normal(4 * l + 4, proj_std),
            );
            blocks.push(Block {
                ln_1: layer_norm(),
                attn: CausalSelfAttention {
                    c_attn,
                    c_proj,
                    n_head: self.n_head,
                },
                ln_2: layer_norm(),
                mlp: MlpBlock {
                    c_fc,
                    c_proj: mlp_proj,
                    gelu: self.gelu,
                },
                dropout: self.dropout,
            });
        }
        let tables = 4 * self.n_layer;
        let wte = (first || last).then(|| {
            Param::from_tensor(place.tensor("wte", [self.vocab_size, d], normal(tables + 1, 0.02)))
        });
        let wpe = first.then(|| {
            Param::from_tensor(place.tensor("wpe", [self.block_size, d], normal(tables + 2, 0.02)))
        });
        let stage = GptStage {
            wte,
            wpe,
            blocks,
            ln_f: last.then(layer_norm),
            first_block: range.start,
            n_layer: self.n_layer,
            dropout: self.dropout,
            vocab_used: self.vocab_used.unwrap_or(self.vocab_size),
        };
        stage.with_model_ids()
    }
}

/// A GPT language model.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    /// Token embedding `[vocab, d]`, also the output projection (tied).
    pub wte: Param<Tensor<B, 2>>,
    /// Position embedding `[block, d]`.
    pub wpe: Param<Tensor<B, 2>>,
    /// The blocks.
    pub blocks: Vec<Block<B>>,
    /// Final LayerNorm.
    pub ln_f: LayerNorm<B>,
    /// Dropout probability while training (after the embeddings).
    pub dropout: f64,
    /// The tokens that exist ([`GptConfig::vocab_used`]): logits past them are masked.
    pub vocab_used: usize,
}

/// One pipeline stage of a GPT ([`GptConfig::init_stage`]): a run of consecutive blocks, with the
/// token and position embeddings on the first stage and the final norm and the tied output
/// projection on the last. The first and the last stage each hold a copy of the tied token
/// table (Megatron's layout); the pipeline step sums the two copies' gradients, so both take
/// the same update and stay equal. A stage that is both (one stage) is the whole model.
#[derive(Module, Debug)]
pub struct GptStage<B: Backend> {
    /// Token embedding (first stage) and output projection (last stage).
    pub wte: Option<Param<Tensor<B, 2>>>,
    /// Position embedding (first stage).
    pub wpe: Option<Param<Tensor<B, 2>>>,
    /// The stage's blocks.
    pub blocks: Vec<Block<B>>,
    /// Final LayerNorm (last stage).
    pub ln_f: Option<LayerNorm<B>>,
    /// The model's index of the stage's first block (for the recomputation and dropout
    /// streams, which are numbered by block).
    pub first_block: usize,
    /// Blocks in the whole model.
    pub n_layer: usize,
    /// Dropout probability while training (after the embeddings).
    pub dropout: f64,
    /// The tokens that exist ([`GptConfig::vocab_used`]): logits past them are masked.
    pub vocab_used: usize,
}

impl<B: Backend> GptStage<B> {
    /// Whether the stage holds the final norm and the output projection.
    pub fn is_last(&self) -> bool {
        self.ln_f.is_some()
    }

    /// The whole model, from a stage that is both the first and the last.
    ///
    /// # Panics
    /// On a stage that is not the whole model.
    pub fn into_gpt(self) -> Gpt<B> {
        assert!(
            self.wpe.is_some() && self.is_last() && self.blocks.len() == self.n_layer,
            "only a stage that holds every block, the embeddings and the head is a whole GPT"
        );
        Gpt {
            wte: self.wte.expect("the first stage holds the token table"),
            wpe: self.wpe.expect("the first stage holds the position table"),
            blocks: self.blocks,
            ln_f: self.ln_f.expect("the last stage holds the final norm"),
            dropout: self.dropout,
            vocab_used: self.vocab_used,
        }
    }

    /// The ids the stage's parameters have in the whole model (`deterministic_ids`' numbering:
    /// 1, 2, 3, … in the whole model's visiting order: `wte`, `wpe`, the blocks, `ln_f`).
    fn with_model_ids(self) -> Self {
        let per_block = self.blocks.first().map_or(0, |b| b.num_params_tensors()) as u64;
        let (start, layers) = (self.first_block as u64, self.n_layer as u64);
        let head = 3 + per_block * layers;
        let mut ids = Vec::new();
        if self.wte.is_some() {
            // The last stage's copy of the tied table, unless it is also the first: one past
            // the whole model's last id.
            ids.push(if self.wpe.is_some() { 1 } else { head + 2 });
        }
        if self.wpe.is_some() {
            ids.push(2);
        }
        let blocks = 3 + per_block * start;
        ids.extend(blocks..blocks + per_block * self.blocks.len() as u64);
        if self.is_last() {
            ids.extend([head, head + 1]);
        }
        crate::stage::with_ids(self, ids)
    }
}

/// The embeddings: token plus position, dropout (site `(n_layer, 0)`) while training.
fn embed<'a, B: FusedOps, H: ForwardHooks<'a, B>>(
    wte: &Param<Tensor<B, 2>>,
    wpe: &Param<Tensor<B, 2>>,
    idx: Tensor<B, 2, Int>,
    n_layer: usize,
    dropout: f64,
    hooks: &H,
) -> Tensor<B, 3> {
    let [_, t] = idx.dims();
    let device = idx.device();
    // The rank's positions: `0..t`, its chunks of the sequence under context parallelism, or
    // after a generation's cached ones.
    let positions: Vec<i64> = hooks
        .positions(&device, t)
        .into_iter()
        .map(|p| p as i64)
        .collect();
    let pos = Tensor::<B, 2, Int>::from_data(TensorData::new(positions, [1, t]), &device);
    let tok = ops::embedding(wte.val(), idx);
    let pos = ops::embedding(wpe.val(), pos);
    hooks.dropout(n_layer, 0, tok + pos, dropout)
}

/// `blocks`, the model's blocks `first..` of `n_layer`, through the hooks.
fn run_blocks<'a, B: FusedOps, H: ForwardHooks<'a, B>>(
    blocks: &[Block<B>],
    first: usize,
    n_layer: usize,
    mut x: Tensor<B, 3>,
    hooks: &H,
) -> Tensor<B, 3> {
    for (i, block) in blocks.iter().enumerate() {
        let layer = first + i;
        x = hooks.block(layer, n_layer, block, x, move |block, x, hooks| {
            block.forward_with(layer, x, hooks)
        });
    }
    x
}

/// The final norm and the tied output projection: logits = ln_f(x) · wteᵀ, padded columns
/// masked ([`table_logits`]).
fn head<B: FusedOps>(
    ln_f: &LayerNorm<B>,
    wte: &Param<Tensor<B, 2>>,
    x: Tensor<B, 3>,
    used: usize,
) -> Tensor<B, 3> {
    table_logits(layer_norm(ln_f, x), wte.val(), used)
}

impl<B: FusedOps> PipelineStage<B> for GptStage<B> {
    const TABLE: &'static str = "wte";

    fn is_first(&self) -> bool {
        self.wpe.is_some()
    }

    fn first_block(&self) -> usize {
        self.first_block
    }

    fn tied_table(&self) -> Vec<burn::module::ParamId> {
        self.wte.as_ref().map(|p| p.id).into_iter().collect()
    }

    fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        input: StageInput<B>,
        hooks: &H,
    ) -> Tensor<B, 3> {
        let x = match (input, &self.wte, &self.wpe) {
            (StageInput::Tokens(idx), Some(wte), Some(wpe)) => {
                embed(wte, wpe, idx, self.n_layer, self.dropout, hooks)
            }
            (StageInput::Hidden(x), _, None) => x,
            (StageInput::Tokens(_), ..) => panic!("token ids go to the first stage"),
            (StageInput::Hidden(_), ..) => panic!("the first stage takes token ids"),
        };
        let x = run_blocks(&self.blocks, self.first_block, self.n_layer, x, hooks);
        match (&self.ln_f, &self.wte) {
            (Some(ln_f), Some(wte)) => head(ln_f, wte, hooks.head_input(x), self.vocab_used),
            _ => x,
        }
    }
}

impl<B: FusedOps> CausalLm<B> for Gpt<B> {
    fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        idx: Tensor<B, 2, Int>,
        hooks: &H,
    ) -> Tensor<B, 3> {
        let n = self.blocks.len();
        let x = embed(&self.wte, &self.wpe, idx, n, self.dropout, hooks);
        let x = run_blocks(&self.blocks, 0, n, x, hooks);
        head(&self.ln_f, &self.wte, hooks.head_input(x), self.vocab_used)
    }
}

impl<B: FusedOps> Gpt<B> {
    /// The context length.
    pub fn block_size(&self) -> usize {
        self.wpe.dims()[0]
    }

    /// Continue `prompt` by `new_tokens` tokens, sampling with `temperature` (0: greedy) among
    /// the `top_k` most likely (0: all), seeded, so a sample is reproducible. For a nucleus
    /// cut, build a [`TokenSampler`] and call [`CausalLm::sample`].
    pub fn generate(
        &self,
        prompt: &[u32],
        new_tokens: usize,
        temperature: f32,
        top_k: usize,
        seed: u64,
        device: &B::Device,
    ) -> Vec<u32> {
        let sampler = TokenSampler::new(temperature, top_k, seed);
        self.sample(prompt, new_tokens, self.block_size(), sampler, device)
    }
}

#[cfg(test)]
mod tests;
