//! Optimizer state as named tensors, each with its layout rule: what sharding, the distributed
//! checkpoint and the Learner need to know of an optimizer, without knowing which one it is.
//!
//! An optimizer implements [`StateCodec`]: the state tensors a parameter of a given shape keeps
//! ([`StateSpec`]: a name, a [`StateShape`] relating it to the parameter), and its state taken
//! apart into a step count and those tensors ([`EncodedState`]) and put back together. AdamW
//! keeps two tensors shaped like the parameter; Adafactor a row and a column statistic per
//! matrix, the column statistic reduced over the rows (so under FSDP's row sharding it is
//! replicated: each shard's partial sums are all-reduced by the step's own ops).
//!
//! [`state_layout`] is the one rule for where a state tensor lives on a rank; a checkpoint
//! loader builds the state in it, from whatever layout saved it.

use burn::optim::{AdamW, AdamWState, AdaptiveMomentumState, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::fsdp::optimizer_state_layout;
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;

/// Elements per block of an 8-bit optimizer state (one f32 scale each; Dettmers et al.'s 2,048).
pub const QUANT_BLOCK: usize = 2048;

/// Tensors with fewer elements keep an 8-bit optimizer's state in f32 (bitsandbytes'
/// `min_8bit_size`).
pub const MIN_QUANT_SIZE: usize = 4096;

/// How a state tensor's shape follows its parameter's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateShape {
    /// The parameter's shape, laid out like the parameter's optimizer state (AdamW's moments).
    Param,
    /// The parameter's shape with `dims` reduced to size 1 (kept, as Burn's `sum_dim` keeps
    /// them): a statistic over those dims (Adafactor's row statistic of an `n × m` matrix is
    /// `n × 1`, its column statistic `1 × m`). A mesh axis that splits a reduced dim leaves the
    /// statistic replicated over that axis.
    Reduced(Vec<usize>),
    /// One value per block of this many consecutive elements of the parameter's row-major
    /// flattening (the last block may be short): a 1-D `[⌈numel / size⌉]` tensor, replicated
    /// (an 8-bit optimizer's block scales).
    Blocks(usize),
}

impl StateShape {
    /// The state tensor's global shape for a parameter of `param` shape.
    pub fn of(&self, param: &[usize]) -> Vec<usize> {
        match self {
            StateShape::Param => param.to_vec(),
            StateShape::Reduced(dims) => (0..param.len())
                .map(|d| if dims.contains(&d) { 1 } else { param[d] })
                .collect(),
            StateShape::Blocks(size) => vec![param.iter().product::<usize>().div_ceil(*size)],
        }
    }
}

/// One state tensor a parameter keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSpec {
    /// Its name: the checkpoint stores it as `optim/<parameter path>/<name>`.
    pub name: String,
    /// Its shape, relative to the parameter's.
    pub shape: StateShape,
}

impl StateSpec {
    /// A state tensor `name` shaped `shape`.
    pub fn new(name: impl Into<String>, shape: StateShape) -> Self {
        Self {
            name: name.into(),
            shape,
        }
    }
}

/// A parameter's optimizer state taken apart: its step count and its tensors, in the order of
/// [`StateCodec::state_specs`].
pub struct EncodedState<B: Backend> {
    /// The optimizer steps this parameter has taken.
    pub steps: usize,
    /// The state tensors (each any rank; `Distributed`'s are distributed tensors); `None` for a
    /// spec this parameter does not keep (Muon keeps a momentum for a hidden matrix, AdamW's
    /// moments for a table: its specs name both, each parameter fills in one kind). A
    /// checkpoint stores only the present ones, and a loader gives `None` for a spec the
    /// checkpoint does not hold.
    pub tensors: Vec<Option<FloatTensor<B>>>,
}

impl<B: Backend> EncodedState<B> {
    /// A state that keeps every spec's tensor.
    pub fn all(steps: usize, tensors: Vec<FloatTensor<B>>) -> Self {
        Self {
            steps,
            tensors: tensors.into_iter().map(Some).collect(),
        }
    }

    /// Every spec's tensor (`names`, in spec order), or an error naming the first one missing
    /// (`what`: the optimizer) — a checkpoint whose state is of another optimizer.
    pub fn require(self, what: &str, names: &[&str]) -> Result<Vec<FloatTensor<B>>, String> {
        if self.tensors.len() != names.len() {
            return Err(format!(
                "{what} keeps {} state tensors ({}), the checkpoint gave {}",
                names.len(),
                names.join(", "),
                self.tensors.len()
            ));
        }
        self.tensors
            .into_iter()
            .zip(names)
            .map(|(t, name)| {
                t.ok_or_else(|| format!("{what}'s state tensor {name} is not in the checkpoint"))
            })
            .collect()
    }
}

/// An optimizer whose per-parameter state is a step count and named tensors.
pub trait StateCodec<B: Backend>: SimpleOptimizer<B> {
    /// The state tensors a parameter of global shape `shape` keeps.
    fn state_specs(shape: &[usize]) -> Vec<StateSpec>;

    /// `state` as its step count and tensors; an error for a state the codec cannot express
    /// (an AMSGrad maximum, say).
    fn encode<const D: usize>(state: Self::State<D>) -> Result<EncodedState<B>, String>;

    /// The state of a parameter of rank `D` from its step count and tensors.
    fn decode<const D: usize>(state: EncodedState<B>) -> Result<Self::State<D>, String>;
}

/// Where state tensor `shape` of `param` lives on this rank: the parameter's optimizer-state
/// layout ([`crate::optimizer_state_layout`]: model-axis splits kept, dim 0 split over the
/// optimizer's shard axes), with its splits of reduced dims replicated (and a block statistic
/// replicated whole).
pub fn state_layout<B: Backend>(param: &DTensor<B>, shape: &StateShape) -> Layout {
    let layout = optimizer_state_layout(param);
    match shape {
        StateShape::Param => layout,
        StateShape::Reduced(dims) => Layout::new(layout.placements().iter().map(|&p| match p {
            Placement::Shard(d) if dims.contains(&d) => Placement::Replicate,
            p => p,
        })),
        StateShape::Blocks(_) => blocks_layout(&layout),
    }
}

/// The layout of a statistic per block of a tensor kept on `layout` (8-bit moments' scales):
/// whole on every rank of the tensor's shard axes, its other placements kept.
pub fn blocks_layout(layout: &Layout) -> Layout {
    Layout::new(layout.placements().iter().map(|&p| match p {
        Placement::Shard(_) => Placement::Replicate,
        p => p,
    }))
}

fn float<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// AdamW's moments, `moment_1` and `moment_2`, shaped like the parameter: the specs of every
/// optimizer keeping AdamW's record (Burn's, Wildfire's fused one).
pub fn adamw_specs() -> Vec<StateSpec> {
    vec![
        StateSpec::new("moment_1", StateShape::Param),
        StateSpec::new("moment_2", StateShape::Param),
    ]
}

/// AdamW's record as two tensors (no AMSGrad maximum).
pub fn encode_adamw<B: Backend, const D: usize>(
    state: AdamWState<B, D>,
) -> Result<EncodedState<B>, String> {
    let m = state.momentum;
    if m.max_moment_2.is_some() {
        return Err("AMSGrad's maximum second moment is not part of the saved state".into());
    }
    Ok(EncodedState::all(
        m.time,
        vec![float(m.moment_1), float(m.moment_2)],
    ))
}

/// AdamW's record from its two tensors.
pub fn decode_adamw<B: Backend, const D: usize>(
    state: EncodedState<B>,
) -> Result<AdamWState<B, D>, String> {
    let time = state.steps;
    let [moment_1, moment_2]: [FloatTensor<B>; 2] = state
        .require("AdamW", &["moment_1", "moment_2"])?
        .try_into()
        .map_err(|_| "counted".to_string())?;
    Ok(AdamWState {
        momentum: AdaptiveMomentumState {
            time,
            moment_1: tensor(moment_1),
            moment_2: tensor(moment_2),
            max_moment_2: None,
        },
    })
}

impl<B: Backend> StateCodec<B> for AdamW {
    fn state_specs(_shape: &[usize]) -> Vec<StateSpec> {
        adamw_specs()
    }

    fn encode<const D: usize>(state: Self::State<D>) -> Result<EncodedState<B>, String> {
        encode_adamw(state)
    }

    fn decode<const D: usize>(state: EncodedState<B>) -> Result<Self::State<D>, String> {
        decode_adamw(state)
    }
}
