//! Megatron-style tensor parallelism over the `tp` mesh axis, applied after the model is built:
//! a plan maps module paths (as Burn's module visitor reports them, `*` for one path segment,
//! `a|b` for alternatives in a segment) to a style for the `Linear` layers there.
//!
//! - `Colwise`: weight `[d_in, d_out]` split on `d_out` (`Shard(1)`), bias `Shard(0)`: the input
//!   stays replicated, the output comes out sharded on its last dim (the identity forward whose
//!   conjugate backward is an all-reduce — Megatron's `f`).
//! - `Rowwise`: weight split on `d_in` (`Shard(0)`), bias replicated (added once): the input is
//!   sharded on its last dim, the output is a partial sum reduced by the next op that needs the
//!   full value (Megatron's `g`: all-reduce forward, identity backward).
//!
//! The propagation rules do the rest, also for stock burn-nn `MultiHeadAttention` (heads split
//! when the head count divides) and `PositionWiseFeedForward`.

use crate::data_parallel::{DistributedBackend, dtensor, redistribute};
use crate::error::Error;
use crate::mesh::DeviceMesh;
use crate::params::{
    Mapped, ModulePath, ParamVisitor, TryParamMapper, map_value, try_map_params, visit_params,
};
use crate::placement::Placement;
use burn::module::{Module, Param};
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// How one `Linear` is split over the tensor-parallel axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TpStyle {
    /// Split the output features.
    Colwise,
    /// Split the input features.
    Rowwise,
    /// An embedding table `[vocab, d]` split on the vocabulary (`Shard(0)`): each rank looks up
    /// its range (a partial sum, zeros elsewhere); used transposed as a tied output projection,
    /// the logits come out split on the vocabulary and the cross-entropy stays loss-parallel.
    VocabParallel,
    /// Megatron sequence parallelism for the norms (and the dropout and residual stream around
    /// them): their parameters stay whole, and the rank computes them on `1/tp` of the sequence —
    /// partial sums meeting a residual add are reduce-scattered over the sequence instead of
    /// all-reduced, column-parallel layers all-gather their input (see
    /// `RankPolicy::sequence_parallel`, which a plan with this style sets).
    SequenceParallel,
}

/// A tensor-parallel plan: `(module path pattern, style)` pairs, the attention modules' head
/// counts (checked against the tp degree before anything changes), and sequence parallelism's
/// memory/communication trade.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpPlan {
    /// The rules, in order.
    pub rules: Vec<(String, TpStyle)>,
    /// `(module path pattern, head count)`: attention modules whose heads the column split must
    /// keep whole (a weight width that divides by tp does not mean the heads do).
    #[serde(default)]
    pub heads: Vec<(String, usize)>,
    /// With `SequenceParallel`: keep each sequence-sharded activation's all-gather for backward
    /// (2 all-gathers + 2 reduce-scatters per block each way, more memory) instead of gathering
    /// again for the weight gradients (Megatron-LM's default: 4 + 2 in backward). See
    /// `RankPolicy::keep_sequence_gathers`.
    #[serde(default)]
    pub keep_sequence_gathers: bool,
}

impl TpPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a rule.
    pub fn with(mut self, pattern: impl Into<String>, style: TpStyle) -> Self {
        self.rules.push((pattern.into(), style));
        self
    }

    /// Declare the head count of the attention modules at `pattern`: the plan is refused
    /// ([`Error::PlanHeads`]) unless tp divides it.
    pub fn with_heads(mut self, pattern: impl Into<String>, heads: usize) -> Self {
        self.heads.push((pattern.into(), heads));
        self
    }

    /// Megatron's split of a stock burn-nn `MultiHeadAttention` at `pattern` (e.g.
    /// `encoder.layers.*.mha`) with `heads` heads: `query`, `key` and `value` column-wise (whole
    /// heads per rank), `output` row-wise, the head count checked.
    pub fn with_multi_head_attention(self, pattern: &str, heads: usize) -> Self {
        self.with(format!("{pattern}.query|key|value"), TpStyle::Colwise)
            .with(format!("{pattern}.output"), TpStyle::Rowwise)
            .with_heads(pattern, heads)
    }

    /// Sequence parallelism keeps its gathers for backward (see the field).
    pub fn with_keep_sequence_gathers(mut self, keep: bool) -> Self {
        self.keep_sequence_gathers = keep;
        self
    }
}

pub(crate) fn matches(pattern: &str, path: &str) -> bool {
    let (p, q): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), path.split('.').collect());
    p.len() == q.len()
        && p.iter()
            .zip(&q)
            .all(|(a, b)| *a == "*" || a.split('|').any(|alt| alt == *b))
}

/// Parameters of the model by (module path, field name) with shapes.
pub(crate) struct Scan {
    pub(crate) params: Vec<(String, String, Vec<usize>)>,
}

impl<B: DistributedBackend> ParamVisitor<B> for Scan {
    fn visit<const D: usize>(&mut self, path: &ModulePath, param: &Param<Tensor<B, D>>) {
        let (module, field) = path.split_last();
        self.params
            .push((module, field, param.val().dims().to_vec()));
    }
}

/// What each parameter becomes: (index in visiting order) → tensor dim split on the tp axis.
pub(crate) fn assign(
    plan: &TpPlan,
    params: &[(String, String, Vec<usize>)],
    tp: usize,
) -> Result<Vec<Option<usize>>, Error> {
    // Head counts, on every module (a prefix of a parameter's module path) the pattern names.
    let modules: std::collections::BTreeSet<String> = params
        .iter()
        .flat_map(|(module, _, _)| {
            let parts: Vec<&str> = module.split('.').collect();
            (1..=parts.len()).map(move |n| parts[..n].join("."))
        })
        .collect();
    for (pattern, heads) in &plan.heads {
        let Some(module) = modules.iter().find(|m| matches(pattern, m)) else {
            return Err(Error::PlanNoMatch(pattern.clone()));
        };
        if !heads.is_multiple_of(tp) {
            return Err(Error::PlanHeads {
                module: module.clone(),
                heads: *heads,
                tp,
            });
        }
    }
    let mut out = vec![None; params.len()];
    let mut used = vec![false; plan.rules.len()];
    for (i, (module, field, shape)) in params.iter().enumerate() {
        let mut chosen: Option<(usize, TpStyle)> = None;
        let full = if module.is_empty() {
            field.clone()
        } else {
            format!("{module}.{field}")
        };
        for (r, (pattern, style)) in plan.rules.iter().enumerate() {
            if matches(pattern, module)
                || (*style == TpStyle::VocabParallel && matches(pattern, &full))
            {
                if let Some((first, _)) = chosen {
                    return Err(Error::PlanConflict {
                        module: module.clone(),
                        first: plan.rules[first].0.clone(),
                        second: pattern.clone(),
                    });
                }
                chosen = Some((r, *style));
            }
        }
        let Some((r, style)) = chosen else { continue };
        used[r] = true;
        let dim = match (style, field.as_str(), shape.len()) {
            (TpStyle::Colwise, "weight", 2) => Some(1),
            (TpStyle::Colwise, "bias", 1) => Some(0),
            (TpStyle::Rowwise, "weight", 2) => Some(0),
            // Stacked expert weights `[E, d_in, d_out]`: each expert split as a linear layer.
            (TpStyle::Colwise, "weight", 3) => Some(2),
            (TpStyle::Rowwise, "weight", 3) => Some(1),
            (TpStyle::VocabParallel, _, 2) => Some(0),
            _ => None,
        };
        if let Some(d) = dim
            && !shape[d].is_multiple_of(tp)
        {
            return Err(Error::PlanIndivisible {
                param: format!("{module}.{field}"),
                shape: shape.clone(),
                dim: d,
                size: shape[d],
                tp,
            });
        }
        out[i] = dim;
    }
    if let Some(r) = used.iter().position(|u| !u) {
        return Err(Error::PlanNoMatch(plan.rules[r].0.clone()));
    }
    Ok(out)
}

struct Apply {
    axis: usize,
    splits: Vec<Option<usize>>,
    next: usize,
    ctx: Option<std::sync::Arc<crate::device::RankContext>>,
}

impl<B: DistributedBackend> TryParamMapper<B> for Apply {
    type Error = Error;

    fn try_map<const D: usize>(
        &mut self,
        _path: &ModulePath,
        param: Param<Tensor<B, D>>,
    ) -> Mapped<B, D, Error> {
        let split = self.splits.get(self.next).copied().flatten();
        self.next += 1;
        map_value(param, |tensor| {
            let t = dtensor(tensor);
            self.ctx.get_or_insert_with(|| t.device().context().clone());
            let Some(dim) = split else {
                return Ok(tensor.clone());
            };
            // Replicate -> Shard is a local slice: every rank keeps its columns / rows.
            let target = t.layout().clone().with(self.axis, Placement::Shard(dim));
            redistribute(tensor.clone(), &target)
        })
    }
}

/// Split the `Linear` layers that `plan` names over the `tp` axis of `mesh`. The plan is checked
/// whole (patterns that match nothing, two styles on one layer, sizes that do not divide) before
/// any parameter changes. Apply before `replicate` / `fully_shard`.
pub fn tensor_parallel<B: DistributedBackend, M: Module<B>>(
    module: M,
    mesh: &DeviceMesh,
    plan: &TpPlan,
) -> Result<M, Error> {
    let axis = mesh
        .axis_index("tp")
        .map_err(|_| Error::NoTpAxis(mesh.to_string()))?;
    let mut scan = Scan { params: Vec::new() };
    visit_params(&module, &mut scan);
    let splits = assign(plan, &scan.params, mesh.axis_size(axis))?;
    let mut apply = Apply {
        axis,
        splits,
        next: 0,
        ctx: None,
    };
    let module = try_map_params(module, &mut apply)?;
    if plan
        .rules
        .iter()
        .any(|(_, s)| *s == TpStyle::SequenceParallel)
        && let Some(ctx) = apply.ctx
    {
        ctx.update_policy(|p| {
            p.sequence_parallel = Some(axis);
            p.keep_sequence_gathers = plan.keep_sequence_gathers;
        });
    }
    Ok(module)
}
