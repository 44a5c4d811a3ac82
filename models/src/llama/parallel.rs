//! Llama laid out over a mesh: Megatron tensor parallelism as torchtitan shards Llama (q, k, v,
//! gate and up column-wise; o and down row-wise; the token table and the head
//! vocabulary-parallel, so the cross-entropy is loss-parallel), then the data-parallel strategy.

use super::{Llama, LlamaConfig, LlamaStage};
use crate::Error;
use crate::parallelize::{ParallelConfig, init_stages, lay_out_stage};
use std::ops::Range;
use wildfire_parallel::pipeline::Schedule;
use wildfire_parallel::{
    DeviceMesh, DistributedBackend, ExpertPlan, TpPlan, TpStyle, expert_parallel, fully_shard,
    planned_layouts_with_experts, tensor_parallel,
};

/// Whether tensor parallelism of degree `tp` replicates the key/value projections: `tp` is a
/// multiple of the key/value heads larger than their count (Megatron's and vLLM's rule). Each
/// rank then computes every key/value head and its attention reads the one its query heads
/// share; the projections' gradients are summed over the ranks.
pub fn kv_replicated(n_kv_head: usize, tp: usize) -> bool {
    n_kv_head > 0 && tp > n_kv_head && tp.is_multiple_of(n_kv_head)
}

/// The plan of [`llama_tp_plan`] at degree `tp` (without the tables' rule unless `tables`: a
/// middle pipeline stage holds none), `None` without tensor parallelism. A tp that neither
/// divides the key/value heads nor is a multiple of them (no whole key/value head per rank, nor
/// one group per rank) is refused, naming the degrees that work.
fn tp_plan(
    n_head: usize,
    n_kv_head: usize,
    tp: usize,
    tables: bool,
    mlps: Mlps,
) -> Result<Option<TpPlan>, Error> {
    if tp <= 1 {
        return Ok(None);
    }
    let fits = |t: usize| n_kv_head.is_multiple_of(t) || kv_replicated(n_kv_head, t);
    if !fits(tp) {
        let degrees: Vec<String> = (2..=n_head)
            .filter(|&t| n_head.is_multiple_of(t) && fits(t))
            .map(|t| t.to_string())
            .collect();
        return Err(Error::Config(format!(
            "tp {tp} neither divides the {n_kv_head} key/value heads (split over tp) nor is a \
             multiple of them (replicated over tp); choose tp among [{}]",
            degrees.join(", ")
        )));
    }
    let blocks = llama_block_tp_plan(n_head, n_kv_head, tp, mlps);
    Ok(Some(if tables { with_tables(blocks) } else { blocks }))
}

/// Which MLPs the blocks a plan covers have: dense ones, mixtures of experts (a rule that
/// matches no parameter is refused, so each family's rules go in only where it is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mlps {
    /// Some block has a dense SwiGLU.
    pub dense: bool,
    /// Some block has a mixture of experts.
    pub moe: bool,
    /// Some mixture of experts has shared experts.
    pub shared: bool,
}

impl Mlps {
    /// The MLPs of `config`'s blocks `blocks`.
    pub fn of(config: &LlamaConfig, blocks: Range<usize>) -> Self {
        let mut mlps = Self {
            dense: false,
            moe: false,
            shared: false,
        };
        for l in blocks {
            match config.moe_at(l) {
                Some(m) => {
                    mlps.moe = true;
                    mlps.shared |= m.config.shared_experts > 0;
                }
                None => mlps.dense = true,
            }
        }
        mlps
    }

    /// The MLPs of `layers`.
    fn in_layers<B: burn::prelude::Backend>(layers: &[super::LlamaBlock<B>]) -> Self {
        Self {
            dense: layers.iter().any(|l| l.mlp.is_some()),
            moe: layers.iter().any(|l| l.moe.is_some()),
            shared: layers
                .iter()
                .any(|l| l.moe.as_ref().is_some_and(|m| !m.shared.is_empty())),
        }
    }
}

/// The stacked expert weights of a Llama's mixtures of experts: split over the expert axis
/// ([`wildfire_parallel::expert_parallel`]).
pub fn llama_expert_plan() -> ExpertPlan {
    ExpertPlan::new().with("layers.*.moe.experts.gate_proj|up_proj|down_proj")
}

fn with_tables(plan: TpPlan) -> TpPlan {
    plan.with("embed_tokens|lm_head", TpStyle::VocabParallel)
}

/// Llama's tensor-parallel plan (see the module docs) for a model of `n_head` query and
/// `n_kv_head` key/value heads at degree `tp`: the key/value heads split over tp when it
/// divides them (each rank then holds whole key/value heads and the query heads they serve),
/// replicated when tp is a multiple of them ([`kv_replicated`]: only the query heads split, which
/// tp must divide), refused otherwise.
/// `mlps` says which MLP rules go in: the dense SwiGLU's, and a mixture of experts' (every
/// expert split as the dense MLP is, the router replicated).
pub fn llama_tp_plan(n_head: usize, n_kv_head: usize, tp: usize, mlps: Mlps) -> TpPlan {
    with_tables(llama_block_tp_plan(n_head, n_kv_head, tp, mlps))
}

/// [`llama_tp_plan`] for the blocks alone (a middle pipeline stage, without the tables).
fn llama_block_tp_plan(n_head: usize, n_kv_head: usize, tp: usize, mlps: Mlps) -> TpPlan {
    let (columns, heads) = if kv_replicated(n_kv_head, tp) {
        ("layers.*.self_attn.q_proj", n_head)
    } else {
        ("layers.*.self_attn.q_proj|k_proj|v_proj", n_kv_head)
    };
    let mut plan = TpPlan::new()
        .with(columns, TpStyle::Colwise)
        .with("layers.*.self_attn.o_proj", TpStyle::Rowwise);
    if mlps.dense {
        plan = plan
            .with("layers.*.mlp.gate_proj|up_proj", TpStyle::Colwise)
            .with("layers.*.mlp.down_proj", TpStyle::Rowwise);
    }
    if mlps.moe {
        // Every expert (routed and shared) split as the dense MLP is (Megatron's expert tensor
        // parallelism); the router replicated: every tp rank routes the same tokens the same
        // way.
        plan = plan
            .with("layers.*.moe.experts.gate_proj|up_proj", TpStyle::Colwise)
            .with("layers.*.moe.experts.down_proj", TpStyle::Rowwise);
    }
    if mlps.shared {
        plan = plan
            .with("layers.*.moe.shared.*.gate_proj|up_proj", TpStyle::Colwise)
            .with("layers.*.moe.shared.*.down_proj", TpStyle::Rowwise);
    }
    plan.with_heads("layers.*.self_attn", heads)
}

/// `plan` with sequence parallelism over the blocks' norms and, with `final_norm`, the final
/// norm (the whole model, or the last pipeline stage) when `parallel.sp`.
fn with_sp(plan: TpPlan, parallel: &ParallelConfig, final_norm: bool) -> TpPlan {
    if !parallel.sp {
        return plan;
    }
    let plan = plan.with(
        "layers.*.input_layernorm|post_attention_layernorm",
        TpStyle::SequenceParallel,
    );
    let plan = if final_norm {
        plan.with("norm", TpStyle::SequenceParallel)
    } else {
        plan
    };
    plan.with_keep_sequence_gathers(parallel.sp_keep_gathers)
}

/// Build the Llama already laid out as [`parallelize_llama`] lays it out on `device`'s mesh,
/// each rank drawing only its pieces; `parallelize_llama` then changes no layout.
pub fn init_llama<B: DistributedBackend>(
    config: &LlamaConfig,
    device: &B::Device,
    parallel: &ParallelConfig,
) -> Result<Llama<B>, Error> {
    parallel.check_available()?;
    let mlps = Mlps::of(config, 0..config.n_layer);
    let plan = tp_plan(config.n_head, config.n_kv_head, parallel.tp, true, mlps)?;
    config.init_in_layouts(device, |params, mesh| {
        llama_layouts(params, mesh, plan.as_ref(), parallel)
    })
}

/// The layouts [`parallelize_llama`] gives the parameters `params` (paths and shapes) on
/// `mesh`: tensor parallel as `plan` says, the experts split over the expert axis, then the
/// data-parallel strategy.
fn llama_layouts(
    params: &[(String, Vec<usize>)],
    mesh: &DeviceMesh,
    plan: Option<&TpPlan>,
    parallel: &ParallelConfig,
) -> Result<Vec<wildfire_parallel::Layout>, wildfire_parallel::Error> {
    planned_layouts_with_experts(params, mesh, plan, &llama_expert_plan(), parallel.fsdp)
}

/// Lay `model` out over `mesh`: tensor parallel (with sequence parallelism when asked), then
/// FSDP / DDP as `parallel.fsdp` says.
pub fn parallelize_llama<B: DistributedBackend>(
    model: Llama<B>,
    mesh: &DeviceMesh,
    parallel: &ParallelConfig,
) -> Result<Llama<B>, Error> {
    parallel.check_available()?;
    let (h, kv) = model
        .layers
        .first()
        .map_or((1, 1), |l| (l.self_attn.n_head, l.self_attn.n_kv_head));
    let mlps = Mlps::in_layers(&model.layers);
    let model = match tp_plan(h, kv, parallel.tp, true, mlps)? {
        Some(plan) => tensor_parallel(model, mesh, &with_sp(plan, parallel, true))?,
        None => model,
    };
    parallel.lay_out_context(&model)?;
    let model = expert_parallel(model, mesh, &llama_expert_plan())?;
    Ok(fully_shard(model, mesh, parallel.fsdp)?)
}

/// One pipeline stage of the Llama (blocks `blocks`; the token table when `first`, the norm and
/// head when `last`), laid out as [`parallelize_llama`] lays out the whole model (tensor
/// parallel, then the data-parallel strategy), each rank drawing only its pieces.
pub fn init_llama_stage<B: DistributedBackend>(
    config: &LlamaConfig,
    device: &B::Device,
    parallel: &ParallelConfig,
    blocks: Range<usize>,
    first: bool,
    last: bool,
) -> Result<LlamaStage<B>, Error> {
    parallel.check_available()?;
    // The vocabulary-parallel tables only where the stage holds them.
    let mlps = Mlps::of(config, blocks.clone());
    let plan = tp_plan(
        config.n_head,
        config.n_kv_head,
        parallel.tp,
        first || last,
        mlps,
    )?;
    let stage = config.init_stage_in_layouts(device, blocks, first, last, |params, mesh| {
        llama_layouts(params, mesh, plan.as_ref(), parallel)
    })?;
    let plan = plan.map(|plan| with_sp(plan, parallel, last));
    lay_out_stage(stage, device, plan.as_ref(), &llama_expert_plan(), parallel)
}

/// The stages of `schedule` that the rank of `device` holds, in chunk order, each with its stage
/// number: a `StagePlan::balanced` split of the blocks, each stage laid out by
/// [`init_llama_stage`] (the rank draws only its pieces).
pub fn init_llama_stages<B: DistributedBackend>(
    config: &LlamaConfig,
    device: &B::Device,
    parallel: &ParallelConfig,
    schedule: &Schedule,
) -> Result<Vec<(usize, LlamaStage<B>)>, Error> {
    init_stages::<B, _>(config.n_layer, device, schedule, |blocks, first, last| {
        init_llama_stage(config, device, parallel, blocks, first, last)
    })
}
