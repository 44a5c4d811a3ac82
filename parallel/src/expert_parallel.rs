//! [`expert_parallel`]: a mixture of experts' stacked expert weights split over the mesh's expert
//! axis ([`EXPERT_AXIS`]), as torchtitan and DeepSpeed-MoE lay them out.
//!
//! An expert layer keeps its experts' weights stacked, `[E, ..]` (dim 0 the expert). Over the
//! expert axis, of `ep` members, they are `Shard(0)`: member `j` holds experts
//! `j·E/ep .. (j+1)·E/ep`, and the routed rows come to it over an all-to-all
//! ([`FusedOps::expert_dispatch`](wildfire_kernels::FusedOps::expert_dispatch)). The rest of
//! the model keeps its layout: over the data axes, FSDP shards the other parameters over every
//! data-sharding rank (the expert axis included) and each expert's rows nested inside its
//! member's share, over the remaining data ranks, where they divide ([`crate::fully_shard`]).
//!
//! Gradients: an expert weight's gradient is born `Shard(0)` on the expert axis — its member's
//! experts saw every member's rows — and is reduced over the other data axes only, averaged there
//! like every data-parallel gradient (the dispatch's backward keeps the scale: see
//! `backend/experts.rs`). The rank's policy records the expert weights' shapes
//! ([`crate::RankPolicy::expert_shapes`]): the gradient and optimizer-state layouts keep their
//! expert split.

use crate::data_parallel::{DistributedBackend, try_map_dtensors};
use crate::error::Error;
use crate::mesh::{DeviceMesh, EXPERT_AXIS};
use crate::placement::{Layout, Placement};
use burn::module::Module;
use serde::{Deserialize, Serialize};

/// Which parameters are stacked expert weights: those of the modules matching a pattern (the
/// syntax of [`crate::TpPlan`]'s: `.`-separated segments, `*` any one segment, `a|b` either).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertPlan {
    patterns: Vec<String>,
}

impl ExpertPlan {
    /// No expert weights.
    pub fn new() -> Self {
        Self::default()
    }

    /// This plan with the parameters of the modules matching `pattern` as stacked expert
    /// weights (dim 0 the expert).
    pub fn with(mut self, pattern: &str) -> Self {
        self.patterns.push(pattern.to_string());
        self
    }

    /// Whether the plan names no module.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// Whether the parameter at `path` (`module.field`) is a stacked expert weight.
    pub fn covers(&self, path: &str) -> bool {
        let module = path.rsplit_once('.').map_or("", |(m, _)| m);
        self.patterns
            .iter()
            .any(|p| crate::tensor_parallel::matches(p, module))
    }
}

/// `layout` with a stacked expert weight of global `shape` split over the expert axis
/// (`Shard(0)`); the experts must divide over it.
pub(crate) fn split_experts(
    layout: Layout,
    path: &str,
    shape: &[usize],
    mesh: &DeviceMesh,
) -> Result<Layout, Error> {
    let Some((axis, size)) = mesh.expert_axis() else {
        return Ok(layout);
    };
    let experts = shape.first().copied().unwrap_or(0);
    if shape.len() < 2 || !experts.is_multiple_of(size) {
        return Err(Error::InvalidLayout {
            shape: shape.to_vec(),
            mesh: mesh.to_string(),
            reason: format!(
                "the expert weight '{path}' stacks {experts} experts, which the {size} members \
                 of the expert axis '{EXPERT_AXIS}' do not divide: choose ep a factor of the \
                 experts"
            ),
        });
    }
    Ok(layout.with(axis, Placement::Shard(0)))
}

/// Split the stacked expert weights `plan` names over the expert axis of `mesh` (`Shard(0)`,
/// each member its experts) and record their shapes in the rank's policy. Apply after
/// [`crate::tensor_parallel`] and before [`crate::fully_shard`], which then shards them only
/// within their member's share. Without an expert axis, only the shapes are recorded. An
/// expert count the axis does not divide is an [`Error::InvalidLayout`] before any parameter
/// moves.
pub fn expert_parallel<B: DistributedBackend, M: Module<B>>(
    module: M,
    mesh: &DeviceMesh,
    plan: &ExpertPlan,
) -> Result<M, Error> {
    // Check every expert weight before anything moves.
    let mut scan = crate::tensor_parallel::Scan { params: Vec::new() };
    crate::params::visit_params(&module, &mut scan);
    for (module_path, field, shape) in &scan.params {
        let path = format!("{module_path}.{field}");
        if plan.covers(&path) {
            split_experts(Layout::replicated(mesh), &path, shape, mesh)?;
        }
    }
    let mut shapes = std::collections::BTreeSet::new();
    let mut ctx = None;
    let module = try_map_dtensors(module, |path, mut t| {
        ctx.get_or_insert_with(|| t.device().context().clone());
        if !plan.covers(path) {
            return Ok(t);
        }
        let shape = t.global_shape().to_vec();
        shapes.insert(shape.clone());
        let target = split_experts(t.layout().clone(), path, &shape, mesh)?;
        if let Some((axis, _)) = mesh.expert_axis() {
            // Every member starts from member 0's experts (as `replicate` does), then keeps
            // its own: a local slice.
            t = t.adopt_from_first(axis)?;
        }
        t.redistribute(&target)
    })?;
    if let Some(ctx) = ctx {
        ctx.update_policy(|p| p.expert_shapes = shapes);
    }
    Ok(module)
}
