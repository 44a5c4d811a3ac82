//! What a model's pipeline stage is, whatever the family ([`PipelineStage`]: the GPT's
//! [`crate::gpt::GptStage`], the Llama's [`crate::llama::LlamaStage`]): its input, its forward
//! with the trainer's hooks, the whole model's names and ids of its parameters, the tied token
//! table the first and the last stage both hold; and the stages outside training —
//! forward-only passes through a rank's stages ([`stage_pass`] for [`StagePasses::forward`])
//! and text generated through them ([`generate_staged`]).

use crate::Error;
use crate::lm::{KvCache, TokenSampler, generate_cached, ids};
use burn::module::{AutodiffModule, Module, ParamId};
use burn::prelude::*;
use wildfire_kernels::FusedOps;
use wildfire_kernels::hooks::{ForwardHooks, Inference};
use wildfire_parallel::Distributed;
use wildfire_parallel::pipeline::StagePasses;

/// A stage's input: token ids on the first stage, the previous stage's hidden states elsewhere.
#[derive(Clone, Debug)]
pub enum StageInput<B: Backend> {
    /// `[b, t]` token ids.
    Tokens(Tensor<B, 2, Int>),
    /// `[b, t, d]` hidden states.
    Hidden(Tensor<B, 3>),
}

/// One pipeline stage of a language model: a run of consecutive blocks, the token table on the
/// first stage, the final norm and the output head on the last. Where the head is tied to the
/// token table, the first and the last stage each hold a copy of it (Megatron's layout); the
/// pipeline step sums the two copies' gradients ([`PipelineStage::tied_table`]), so both take
/// the same update and stay equal. Parameters carry the whole model's ids (gathers order by
/// them) and are saved under the whole model's names ([`PipelineStage::model_name`]).
pub trait PipelineStage<B: FusedOps>: Module<B> {
    /// The path of the token table (the tied parameter's, on the last stage too).
    const TABLE: &'static str;

    /// The stage's output with the trainer's hooks: the logits `[b, t, vocab]` on the last
    /// stage, hidden states `[b, t, d]` elsewhere.
    ///
    /// # Panics
    /// When `input` is token ids on a stage that is not the first, or hidden states on the
    /// first.
    fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        input: StageInput<B>,
        hooks: &H,
    ) -> Tensor<B, 3>;

    /// Whether the stage holds the embeddings (the pipeline's first stage).
    fn is_first(&self) -> bool;

    /// The model's index of the stage's first block.
    fn first_block(&self) -> usize;

    /// The tied token table's copy this stage holds (first and last stage), or none.
    fn tied_table(&self) -> Vec<ParamId>;

    /// The last stage's copy of the tied table (it equals the first's: gathers and saves leave
    /// it out); `None` on the first stage and the middle ones.
    fn tied_copy(&self) -> Option<ParamId> {
        (!self.is_first())
            .then(|| self.tied_table().pop())
            .flatten()
    }

    /// The whole model's name of the parameter at `path` in this stage (the stage's block `i`
    /// is the model's `first_block + i`): checkpoints of a pipelined run hold the whole model
    /// under its own names, so any layout, pipelined or not, resumes from them.
    fn model_name(&self, path: &str) -> String {
        stage_param_name(self.first_block(), path)
    }

    /// [`PipelineStage::model_name`] for saving: `None` for the last stage's copy of the tied
    /// table (the first stage saves it).
    fn saved_name(&self, path: &str) -> Option<String> {
        let tied_copy = !self.is_first() && path == Self::TABLE && !self.tied_table().is_empty();
        (!tied_copy).then(|| self.model_name(path))
    }
}

/// A stage a training loop takes: a [`PipelineStage`] on `Autodiff<Distributed<B>>` whose inner
/// module (forward-only passes: evaluation, generation) is one too.
pub trait TrainableStage<B: FusedOps>:
    PipelineStage<Ad<B>> + AutodiffModule<Ad<B>, InnerModule: PipelineStage<Distributed<B>>> + 'static
{
}

impl<B: FusedOps, S> TrainableStage<B> for S where
    S: PipelineStage<Ad<B>>
        + AutodiffModule<Ad<B>, InnerModule: PipelineStage<Distributed<B>>>
        + 'static
{
}

type Ad<B> = burn::backend::Autodiff<Distributed<B>>;

/// Refuse a stage of blocks `blocks` of a model of `n_layer` that cannot be one: the first stage
/// starts at block 0, the last ends at the last block, and a middle stage holds at least one.
pub(crate) fn check_stage(
    n_layer: usize,
    blocks: &std::ops::Range<usize>,
    first: bool,
    last: bool,
) -> Result<(), Error> {
    let fits = blocks.end <= n_layer
        && (!first || blocks.start == 0)
        && (!last || blocks.end == n_layer)
        && (first || last || !blocks.is_empty());
    if fits {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "a pipeline stage of blocks {blocks:?} (first: {first}, last: {last}) in a model of \
             {n_layer} blocks: the first stage starts at block 0, the last ends at the last \
             block, and a middle stage holds at least one"
        )))
    }
}

/// `module` with the parameter ids `ids`, in visiting order (a stage takes the ids its
/// parameters have in the whole model: gathers order by them).
pub(crate) fn with_ids<B: Backend, M: Module<B>>(module: M, ids: Vec<u64>) -> M {
    struct Ids(std::vec::IntoIter<u64>);
    impl<B: Backend> burn::module::ModuleMapper<B> for Ids {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            let (_, tensor, mapper) = param.consume();
            let id = self.0.next().expect("an id per parameter");
            burn::module::Param::from_mapped_value(ParamId::from(id), tensor, mapper)
        }
    }
    module.map(&mut Ids(ids.into_iter()))
}

/// A model configuration's `init_stage_in_layouts` and `init_stage`, for a configuration with
/// `validate`, `n_layer` and `build(place, device, blocks, first, last)` building a stage.
macro_rules! stage_inits {
    ($config:ident, $stage:ident) => {
        impl $config {
            #[doc = concat!("One pipeline stage of the model — blocks `blocks`, the token table \
                when `first`, the final norm and the head when `last` — with exactly the values \
                and parameter ids those parameters have in the whole model (the last stage's \
                copy of a tied table, when it is not also the first, gets an id of its own), laid \
                out as `layouts` says. No rank builds a parameter its stages do not hold: [`",
                stringify!($stage), "`].")]
            pub fn init_stage_in_layouts<B: wildfire_parallel::DistributedBackend>(
                &self,
                device: &B::Device,
                blocks: std::ops::Range<usize>,
                first: bool,
                last: bool,
                layouts: impl crate::init::LayoutFn,
            ) -> Result<$stage<B>, crate::Error> {
                self.validate()?;
                crate::stage::check_stage(self.n_layer, &blocks, first, last)?;
                crate::init::build_in_layouts(
                    device,
                    layouts,
                    |shapes| {
                        self.build(shapes, device, blocks.clone(), first, last);
                    },
                    |pieces| self.build(pieces, device, blocks.clone(), first, last),
                )
            }

            /// `init_stage_in_layouts` on a plain backend: every value of the stage's
            /// parameters.
            pub fn init_stage<B: Backend>(
                &self,
                device: &B::Device,
                blocks: std::ops::Range<usize>,
                first: bool,
                last: bool,
            ) -> Result<$stage<B>, crate::Error> {
                self.validate()?;
                crate::stage::check_stage(self.n_layer, &blocks, first, last)?;
                let mut whole = crate::init::Whole(device);
                Ok(self.build(&mut whole, device, blocks, first, last))
            }
        }
    };
}
pub(crate) use stage_inits;

/// `blocks.{i}.…` (a GPT's) or `layers.{i}.…` (a Llama's) of a stage whose first block is the
/// model's `first_block`, as the model names it: `blocks.{first_block + i}.…`; other paths
/// unchanged ([`PipelineStage::model_name`] without a stage at hand).
pub fn stage_param_name(first_block: usize, path: &str) -> String {
    let Some((prefix, rest)) = ["blocks.", "layers."]
        .iter()
        .find_map(|p| path.strip_prefix(p).map(|rest| (p, rest)))
    else {
        return path.to_string();
    };
    let (index, tail) = rest.split_once('.').unwrap_or((rest, ""));
    match index.parse::<usize>() {
        Ok(i) if tail.is_empty() => format!("{prefix}{}", first_block + i),
        Ok(i) => format!("{prefix}{}.{tail}", first_block + i),
        Err(_) => path.to_string(),
    }
}

/// A forward-only pass's stage runner over a rank's `chunks` (in chunk order): the first stage
/// reads the token ids `idx`, the others the hidden states [`StagePasses::forward`] hands them.
pub fn stage_pass<B: FusedOps, S: PipelineStage<B>>(
    chunks: &[S],
    idx: Tensor<B, 2, Int>,
) -> impl FnMut(usize, Option<Tensor<B, 3>>) -> Tensor<B, 3> + '_ {
    stage_pass_with(chunks, |_| &Inference, idx)
}

/// [`stage_pass`] with chunk `c`'s forward through `hooks(c)`.
fn stage_pass_with<'h, B: FusedOps, S: PipelineStage<B>, H: ForwardHooks<'h, B> + 'h>(
    chunks: &'h [S],
    hooks: impl Fn(usize) -> &'h H + 'h,
    idx: Tensor<B, 2, Int>,
) -> impl FnMut(usize, Option<Tensor<B, 3>>) -> Tensor<B, 3> + 'h {
    let mut idx = Some(idx);
    move |c, hidden| {
        let input = match hidden {
            Some(hidden) => StageInput::Hidden(hidden),
            None => StageInput::Tokens(idx.take().expect("one first stage")),
        };
        chunks[c].forward_with(input, hooks(c))
    }
}

/// `prompt` continued by `new_tokens` tokens generated through the stages: per token, a
/// forward-only pass through the stages in order, each chunk of stages through a key/value cache
/// of its own layers ([`KvCache`]; the new tokens of the context, or the last `block_size`
/// tokens past it, as [`CausalLm::sample`](crate::CausalLm::sample) feeds them); the rank of the
/// last stage picks the next token from the last position's logits with `sampler` (seeded as one
/// device seeds it, so the text is one device's) and sends it to every other member of its
/// pipeline group. Every rank of the group takes part; each has the tokens at the end.
pub fn generate_staged<X: FusedOps, S: PipelineStage<Distributed<X>>>(
    chunks: &[S],
    passes: &StagePasses<X>,
    prompt: &[u32],
    new_tokens: usize,
    block_size: usize,
    mut sampler: TokenSampler,
) -> Result<Vec<u32>, Error> {
    let device = passes.device();
    let p2p = device.context().comm().point_to_point()?;
    let members = passes.members();
    // The last stage (stage p·V − 1) is on the last pipeline rank.
    let last = *members.last().expect("a pipeline rank");
    let caches: Vec<KvCache<Distributed<X>>> = chunks
        .iter()
        .map(|_| KvCache::new().last_logits())
        .collect();
    let stop = sampler.stop_tokens().to_vec();
    generate_cached(prompt, new_tokens, block_size, &stop, |feed, fresh| {
        if fresh {
            caches.iter().for_each(KvCache::clear);
        }
        let pass = stage_pass_with(chunks, |c| &caches[c], ids(feed, device));
        Ok(match passes.forward(pass)? {
            Some(logits) => {
                let logits = logits.into_data().convert::<f32>();
                let token = sampler.pick(&logits.to_vec::<f32>().expect("f32 logits"));
                for &member in members.iter().filter(|&&m| m != device.rank()) {
                    p2p.send(member, TensorData::new(vec![i64::from(token)], [1]))?;
                }
                token
            }
            None => {
                let data = p2p.recv(last)?;
                let token = data.to_vec::<i64>().ok().and_then(|v| v.first().copied());
                let token = token.ok_or_else(|| wildfire_parallel::Error::Mismatch {
                    op: wildfire_parallel::CollectiveKind::Recv,
                    group: wildfire_parallel::PIPELINE_AXIS.into(),
                    detail: "a generated token that is not one integer".into(),
                })?;
                token as u32
            }
        })
    })
}
