//! Llama laid out over a mesh: Megatron tensor parallelism as torchtitan shards Llama (q, k, v,
//! gate and up column-wise; o and down row-wise; the token table and the head
//! vocabulary-parallel, so the cross-entropy is loss-parallel), then the data-parallel strategy.

use super::{Llama, LlamaConfig};
use crate::Error;
use crate::parallelize::ParallelConfig;
use wildfire_parallel::{
    DeviceMesh, DistributedBackend, TpPlan, TpStyle, fully_shard, planned_layouts, tensor_parallel,
};

/// Llama's tensor-parallel plan (see the module docs) for a model of `n_kv_head` key/value
/// heads: the plan is refused unless tp divides them (each rank then holds whole key/value heads
/// and the query heads they serve).
pub fn llama_tp_plan(n_kv_head: usize) -> TpPlan {
    TpPlan::new()
        .with("layers.*.self_attn.q_proj|k_proj|v_proj", TpStyle::Colwise)
        .with("layers.*.self_attn.o_proj", TpStyle::Rowwise)
        .with("layers.*.mlp.gate_proj|up_proj", TpStyle::Colwise)
        .with("layers.*.mlp.down_proj", TpStyle::Rowwise)
        .with("embed_tokens|lm_head", TpStyle::VocabParallel)
        .with_heads("layers.*.self_attn", n_kv_head)
}

/// `plan` with sequence parallelism over the norms when `parallel.sp`.
fn with_sp(plan: TpPlan, parallel: &ParallelConfig) -> TpPlan {
    if !parallel.sp {
        return plan;
    }
    plan.with(
        "layers.*.input_layernorm|post_attention_layernorm",
        TpStyle::SequenceParallel,
    )
    .with("norm", TpStyle::SequenceParallel)
    .with_keep_sequence_gathers(parallel.sp_keep_gathers)
}

/// Build the Llama already laid out as [`parallelize_llama`] lays it out on `device`'s mesh,
/// each rank drawing only its pieces; `parallelize_llama` then changes no layout.
pub fn init_llama<B: DistributedBackend>(
    config: &LlamaConfig,
    device: &B::Device,
    parallel: &ParallelConfig,
) -> Result<Llama<B>, Error> {
    parallel.check_available()?;
    let plan = (parallel.tp > 1).then(|| llama_tp_plan(config.n_kv_head));
    config.init_in_layouts(device, |params, mesh| {
        planned_layouts(params, mesh, plan.as_ref(), parallel.fsdp)
    })
}

/// Lay `model` out over `mesh`: tensor parallel (with sequence parallelism when asked), then
/// FSDP / DDP as `parallel.fsdp` says.
pub fn parallelize_llama<B: DistributedBackend>(
    model: Llama<B>,
    mesh: &DeviceMesh,
    parallel: &ParallelConfig,
) -> Result<Llama<B>, Error> {
    parallel.check_available()?;
    let model = if parallel.tp > 1 {
        let kv = model.layers.first().map_or(1, |l| l.self_attn.n_kv_head);
        tensor_parallel(model, mesh, &with_sp(llama_tp_plan(kv), parallel))?
    } else {
        model
    };
    Ok(fully_shard(model, mesh, parallel.fsdp)?)
}
