//! The Llama's pipeline stages ([`LlamaStage`]): a run of consecutive blocks, the token table
//! on the first stage, the final norm and the head on the last (a copy of the token table when
//! the head is tied). The whole model is the one stage that holds everything.

use super::block::{self, LlamaBlock};
use super::{Llama, LlamaConfig, Rope};
use crate::lm::table_logits;
use crate::stage::{PipelineStage, StageInput};
use burn::module::{Param, ParamId};
use burn::nn::RmsNorm;
use burn::prelude::*;
use wildfire_kernels::FusedOps;
use wildfire_kernels::hooks::ForwardHooks;

/// One pipeline stage of a Llama ([`LlamaConfig::init_stage`]; see the module docs).
#[derive(Module, Debug)]
pub struct LlamaStage<B: Backend> {
    /// Token table `[vocab, d]` (first stage; the last stage's copy when the head is tied).
    pub embed_tokens: Option<Param<Tensor<B, 2>>>,
    /// The stage's blocks.
    pub layers: Vec<LlamaBlock<B>>,
    /// Final RMSNorm (last stage).
    pub norm: Option<RmsNorm<B>>,
    /// The untied output head `[vocab, d]` (last stage).
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    /// The rotary embedding.
    #[module(skip)]
    pub rope: Rope,
    /// Whether this is the first stage (it embeds the tokens).
    pub first: bool,
    /// Whether the head is the token table (`tie_word_embeddings`).
    pub tied: bool,
    /// The model's index of the stage's first block (the recomputation streams are numbered by
    /// block).
    pub first_block: usize,
    /// Blocks in the whole model.
    pub n_layer: usize,
    /// The tokens that exist (logits past them masked).
    pub vocab_used: usize,
}

crate::stage::stage_inits!(LlamaConfig, LlamaStage);

impl<B: Backend> LlamaStage<B> {
    /// Whether the stage holds the final norm and the head.
    pub fn is_last(&self) -> bool {
        self.norm.is_some()
    }

    /// The whole model, from a stage that is both the first and the last.
    ///
    /// # Panics
    /// On a stage that is not the whole model.
    pub fn into_llama(self) -> Llama<B> {
        assert!(
            self.first && self.is_last() && self.layers.len() == self.n_layer,
            "only a stage that holds every block, the token table and the head is a whole Llama"
        );
        Llama {
            embed_tokens: self
                .embed_tokens
                .expect("the first stage holds the token table"),
            layers: self.layers,
            norm: self.norm.expect("the last stage holds the final norm"),
            lm_head: self.lm_head,
            rope: self.rope,
            vocab_used: self.vocab_used,
        }
    }

    /// The ids the stage's parameters have in the whole model (1, 2, 3, … in the whole model's
    /// visiting order: `embed_tokens`, the blocks, `norm`, `lm_head`; a tied table's copy on a
    /// last stage that is not the first one past the last), `per_block` holding each block's
    /// parameter tensors.
    pub(super) fn with_model_ids(self, per_block: &[u64]) -> Self {
        let before = |l: usize| per_block[..l].iter().sum::<u64>();
        let norm = 2 + before(self.n_layer);
        let mut ids = Vec::new();
        if self.embed_tokens.is_some() {
            ids.push(if self.first { 1 } else { norm + 1 });
        }
        let start = 2 + before(self.first_block);
        ids.extend(start..2 + before(self.first_block + self.layers.len()));
        if self.is_last() {
            ids.push(norm);
        }
        if self.lm_head.is_some() {
            ids.push(norm + 1);
        }
        crate::stage::with_ids(self, ids)
    }
}

/// `layers`, the model's blocks `first..` of `n_layer`, through the hooks, with the rotary
/// tables at the rank's positions of `x`'s sequence.
pub(super) fn run_layers<'a, B: FusedOps, H: ForwardHooks<'a, B>>(
    layers: &[LlamaBlock<B>],
    rope: &Rope,
    first: usize,
    n_layer: usize,
    mut x: Tensor<B, 3>,
    hooks: &H,
) -> Tensor<B, 3> {
    let Some(block) = layers.first() else {
        return x;
    };
    let [_, t, d] = x.dims();
    // The rank's positions: `0..t`, its chunks of the sequence under context parallelism, or
    // after a generation's cached ones.
    let device = x.device();
    let positions = hooks.positions(&device, t);
    let tables = rope.tables_at::<B>(&positions, d / block.self_attn.n_head, &device);
    for (i, block) in layers.iter().enumerate() {
        let (layer, tables) = (first + i, tables.clone());
        x = hooks.block(layer, n_layer, block, x, move |block, x, hooks| {
            block.forward_with(layer, x, &tables, hooks)
        });
    }
    x
}

/// The final norm and the head (the token table when tied), padded columns masked.
pub(super) fn head<B: FusedOps>(
    norm: &RmsNorm<B>,
    table: &Param<Tensor<B, 2>>,
    x: Tensor<B, 3>,
    used: usize,
) -> Tensor<B, 3> {
    table_logits(block::rms_norm(norm, x), table.val(), used)
}

impl<B: FusedOps> PipelineStage<B> for LlamaStage<B> {
    const TABLE: &'static str = "embed_tokens";

    fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        input: StageInput<B>,
        hooks: &H,
    ) -> Tensor<B, 3> {
        let x = match (input, self.first, &self.embed_tokens) {
            (StageInput::Tokens(idx), true, Some(table)) => {
                wildfire_kernels::ops::embedding(table.val(), idx)
            }
            (StageInput::Hidden(x), false, _) => x,
            (StageInput::Tokens(_), ..) => panic!("token ids go to the first stage"),
            (StageInput::Hidden(_), ..) => panic!("the first stage takes token ids"),
        };
        let x = run_layers(
            &self.layers,
            &self.rope,
            self.first_block,
            self.n_layer,
            x,
            hooks,
        );
        match (
            &self.norm,
            self.lm_head.as_ref().or(self.embed_tokens.as_ref()),
        ) {
            (Some(norm), Some(table)) => head(norm, table, hooks.head_input(x), self.vocab_used),
            _ => x,
        }
    }

    fn is_first(&self) -> bool {
        self.first
    }

    fn first_block(&self) -> usize {
        self.first_block
    }

    /// With a tied head, the token table on the first stage and its copy on the last.
    fn tied_table(&self) -> Vec<ParamId> {
        match &self.embed_tokens {
            Some(table) if self.tied => vec![table.id],
            _ => Vec::new(),
        }
    }
}
