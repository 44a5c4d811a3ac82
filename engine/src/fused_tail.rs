//! The fused optimizer tail on `Autodiff<Distributed<X>>`: one [`FusedOps::fused_unscale_all`]
//! over every gradient of the step (unscale, `Σg²`, non-finite flag; on CubeCL backends a pass
//! per gradient writing partial sums into one buffer, then one fold into `[flag, Σg²]` on the
//! device), then per parameter one [`FusedOps::fused_adamw`] launch
//! (moments and parameter in one pass), predicated on a device-resident skip flag and scaled by a
//! device-resident clipping coefficient. On a backend that batches ([`FusedOps::adamw_batch`] >
//! 1: CubeCL on a GPU) the parameters' steps are queued and run many per launch
//! ([`FusedOps::fused_adamw_many`], [`FusedAdamWConfig::multi_tensor`]), each step handing back
//! its parameter, moments and compute-dtype copy as deferred values that the queue's run fills.
//!
//! Every kernel runs on the rank's local pieces (a shard under FSDP, a slice under TP), so the
//! tail works on any layout. The mesh-wide agreement on `[found_inf, Σ‖g‖²]` is one all-reduce
//! of 16 bytes, as in [`crate::unscale_check_clip`] (each element counted once whatever its
//! layout). On a backend without kernels (Flex) the same calls run the Burn-op defaults.
//!
//! [`FusedAdamW`] keeps Burn's AdamW record ([`AdamWState`]), so checkpoints are interchangeable
//! with `burn::optim::AdamW`'s.
//!
//! Its moments may be kept in bf16 ([`MomentDtype::Bf16`], half the state's bytes: 4 per
//! parameter instead of 8). Each step widens them to f32, runs the same f32 update, and rounds
//! the new moments to the nearest bf16 (ties to even) — the arithmetic of PyTorch's AdamW on
//! bf16 state tensors, without stochastic rounding. The parameters (the f32 master weights) and
//! the update are f32 either way, and a checkpoint stores the moments in the dtype they have:
//! a run resumes across moment dtypes (the first step widens whatever it loaded).

use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamWState, AdaptiveMomentumState, GradientsParams, SimpleOptimizer};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use wildfire_kernels::{AdamWStep, FusedOps};
use wildfire_parallel::{
    DTensor, Distributed, EncodedState, Error, Group, ReduceOp, StateCodec, StateSpec, dtensor,
};

use crate::grad_check::GradCheck;

/// AdamW hyper-parameters (PyTorch / Burn defaults but the weight decay, which GPT training sets).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FusedAdamWConfig {
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub epsilon: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The dtype the two moments are kept in between steps.
    #[serde(default)]
    pub moments: MomentDtype,
    /// Many parameters' steps per launch where the backend batches them
    /// ([`FusedOps::adamw_batch`] > 1: a GPU), as PyTorch's `foreach`/`fused`; the same numbers
    /// bit for bit. Off: a launch per parameter.
    #[serde(default = "multi_tensor_default")]
    pub multi_tensor: bool,
}

fn multi_tensor_default() -> bool {
    true
}

impl Default for FusedAdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            weight_decay: 1e-4,
            moments: MomentDtype::F32,
            multi_tensor: true,
        }
    }
}

impl FusedAdamWConfig {
    /// The kernel's arguments for step `time` (1-based) at learning rate `lr`.
    pub fn step(&self, lr: f64, time: usize) -> AdamWStep {
        AdamWStep {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            step: time as u32,
        }
    }
}

/// The dtype AdamW's moments are kept in between steps (the update itself is f32); the
/// driver's `--optim-state`.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum MomentDtype {
    /// 4 bytes per moment element (8 per parameter).
    #[default]
    F32,
    /// 2 bytes per moment element (4 per parameter), rounded to nearest each step.
    Bf16,
    /// 8-bit codes per moment element and an f32 scale per block of 2,048 ([`crate::QuantAdamW`]:
    /// 2 bytes per parameter and the scales), f32 moments for tensors under 4,096 elements.
    Int8,
}

impl MomentDtype {
    /// The Burn dtype of moments kept as floats (`Int8`: the f32 of the small tensors).
    pub fn float_dtype(self) -> burn::tensor::FloatDType {
        match self {
            MomentDtype::F32 | MomentDtype::Int8 => burn::tensor::FloatDType::F32,
            MomentDtype::Bf16 => burn::tensor::FloatDType::BF16,
        }
    }

    /// Bytes per moment element (`Int8`: of a block-quantised tensor, scales aside).
    pub fn bytes(self) -> usize {
        match self {
            MomentDtype::F32 => 4,
            MomentDtype::Bf16 => 2,
            MomentDtype::Int8 => 1,
        }
    }
}

/// The device-resident inputs of the next AdamW launch: the clipping coefficient and the skip
/// flag (`[1]` each, on the rank's inner device), set by [`fused_unscale_check`] and shared
/// with the optimizer.
#[derive(Clone)]
pub struct TailInputs<X: Backend> {
    inner: Arc<Mutex<Option<ScaleAndSkip<X>>>>,
    /// The same two values as the host computed them (the optimizer offloaded to the host
    /// reads these, not the device's copies: no device read per parameter).
    on_host: Arc<Mutex<Option<(f32, f32)>>>,
    /// The parameters' steps queued for one multi-tensor launch ([`AdamWBatch`]).
    batch: Arc<Mutex<AdamWBatch<X>>>,
}

/// AdamW steps queued for [`FusedOps::fused_adamw_many`] on a backend that runs many parameters
/// per launch ([`FusedOps::adamw_batch`] > 1: CubeCL on a GPU, where a launch per parameter was
/// 149 launches a GPT-2 step, each a host submission and a kernel boundary): each step hands
/// back values [deferred](DTensor::deferred_like) until the batch runs — when it holds a
/// launch's worth, at the first use of any of its results, or at the step's end
/// ([`TailInputs::finish`]).
struct AdamWBatch<X: Backend> {
    pending: Vec<(wildfire_kernels::AdamWEntry<X>, Arc<AdamWSlot<X>>)>,
    /// The step's clipping coefficient and skip flag, shared by the queued steps.
    inputs: Option<ScaleAndSkip<X>>,
}

/// One queued step's results, each taken once by the value that resolves it: the parameter,
/// the two moments, the parameter's copy in the compute dtype.
type AdamWSlot<X> =
    Mutex<[Option<<X as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive>; 4]>;

impl<X: Backend> Default for AdamWBatch<X> {
    fn default() -> Self {
        Self {
            pending: Vec::new(),
            inputs: None,
        }
    }
}

impl<X: FusedOps> TailInputs<X> {
    /// Runs the queued AdamW steps (none queued: nothing). The engine calls it after the
    /// optimizer step; any use of a queued step's result does too.
    pub fn finish(&self) {
        run_batch(&self.batch);
    }
}

/// Runs `batch`'s queued steps in [`FusedOps::fused_adamw_many`] and fills their slots.
fn run_batch<X: FusedOps>(batch: &Mutex<AdamWBatch<X>>) {
    let (pending, inputs) = {
        let mut b = batch.lock().unwrap_or_else(|e| e.into_inner());
        (std::mem::take(&mut b.pending), b.inputs.take())
    };
    if pending.is_empty() {
        return;
    }
    let (scale, skip) = inputs.expect("queued steps have their step's inputs");
    let (entries, slots): (Vec<_>, Vec<_>) = pending.into_iter().unzip();
    let results = X::fused_adamw_many(entries, scale, skip);
    for ((state, copy), slot) in results.into_iter().zip(slots) {
        *slot.lock().unwrap() = [Some(state.param), Some(state.m), Some(state.v), copy];
    }
}

/// Result `k` of a queued step (see [`AdamWSlot`]), running the batch first if it has not run.
fn take_result<X: FusedOps>(
    batch: &Mutex<AdamWBatch<X>>,
    slot: &AdamWSlot<X>,
    k: usize,
) -> X::FloatTensorPrimitive {
    if slot.lock().unwrap()[k].is_none() {
        run_batch(batch);
    }
    slot.lock().unwrap()[k]
        .take()
        .expect("a queued AdamW result is taken once, after its batch ran")
}

/// The clipping coefficient and the skip flag, `[1]` each.
type ScaleAndSkip<X> = (
    <X as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
    <X as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
);

/// [`FusedAdamW`] as a Burn optimizer over `Autodiff<Distributed<X>>`.
pub type FusedAdamWOptimizer<X, M> =
    OptimizerAdaptor<FusedAdamW<X>, M, burn::backend::Autodiff<Distributed<X>>>;

impl<X: Backend> TailInputs<X> {
    /// The clipping coefficient and the skip flag of the coming step, if the fused tail set them.
    pub(crate) fn current(&self) -> Option<ScaleAndSkip<X>> {
        self.inner.lock().unwrap().clone()
    }

    /// The clipping coefficient and the skip flag (1 or 0) of the coming step, as the host
    /// computed them, if the fused tail set them.
    pub(crate) fn current_on_host(&self) -> Option<(f32, f32)> {
        *self.on_host.lock().unwrap()
    }
}

impl<X: Backend> Default for TailInputs<X> {
    fn default() -> Self {
        Self {
            inner: Arc::new(Mutex::new(None)),
            on_host: Arc::new(Mutex::new(None)),
            batch: Arc::new(Mutex::new(AdamWBatch::default())),
        }
    }
}

impl<X: Backend> std::fmt::Debug for TailInputs<X> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TailInputs")
    }
}

/// AdamW through [`FusedOps::fused_adamw`] (use it as `FusedAdamW::optimizer`, alone or inside
/// `FsdpOptimizer`).
#[derive(Clone, Debug)]
pub struct FusedAdamW<X: Backend> {
    config: FusedAdamWConfig,
    inputs: TailInputs<X>,
}

impl<X: FusedOps> FusedAdamW<X> {
    /// The Burn optimizer and the handle [`fused_unscale_check`] fills before each step.
    pub fn optimizer<M>(config: FusedAdamWConfig) -> (FusedAdamWOptimizer<X, M>, TailInputs<X>)
    where
        M: AutodiffModule<burn::backend::Autodiff<Distributed<X>>>,
    {
        with_tail_inputs(|inputs| Self { config, inputs })
    }
}

fn wrap<X: Backend, const D: usize>(t: DTensor<X>) -> Tensor<Distributed<X>, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `t` on `layout` (a local slice where `t` is replicated there; nothing where it is already).
pub(crate) fn on_layout<X: Backend>(
    t: DTensor<X>,
    layout: &wildfire_parallel::Layout,
) -> DTensor<X> {
    if t.layout() == layout {
        t
    } else {
        t.redistribute(layout)
            .unwrap_or_else(|e| wildfire_parallel::internal::raise(e))
    }
}

/// A step's parameter and gradient pieces, the parameter on the gradient's layout: under
/// ZeRO-1/2 the gradient is this rank's shard of a replicated parameter, so the parameter is
/// sliced to it (a local slice, no communication) and the optimizer's state lives — and stays —
/// sharded; `FsdpOptimizer` gathers the updated shards afterwards, as with Burn's own optimizers.
pub(crate) fn on_grad_layout<X: Backend, const D: usize>(
    tensor: &Tensor<Distributed<X>, D>,
    grad: &Tensor<Distributed<X>, D>,
) -> (DTensor<X>, DTensor<X>) {
    let g = dtensor(grad).clone();
    (on_layout(dtensor(tensor).clone(), g.layout()), g)
}

/// Burn's adaptor of a per-tensor step over `Autodiff<Distributed<X>>`.
pub(crate) type TailAdaptor<O, M, X> =
    OptimizerAdaptor<O, M, burn::backend::Autodiff<Distributed<X>>>;

/// The Burn optimizer of a step `make` builds around fresh tail inputs, and those inputs (the
/// handle [`fused_unscale_check`] fills before each step).
pub(crate) fn with_tail_inputs<X, O, M>(
    make: impl FnOnce(TailInputs<X>) -> O,
) -> (TailAdaptor<O, M, X>, TailInputs<X>)
where
    X: Backend,
    O: SimpleOptimizer<Distributed<X>>,
    M: AutodiffModule<burn::backend::Autodiff<Distributed<X>>>,
{
    let inputs = TailInputs::default();
    (OptimizerAdaptor::from(make(inputs.clone())), inputs)
}

/// `t`'s piece on `like`'s layout, widened to f32 (the kernel's moments), `t` consumed (its
/// piece unshared where it already has the layout and dtype).
fn piece<X: Backend, const D: usize>(
    t: Tensor<Distributed<X>, D>,
    like: &DTensor<X>,
) -> X::FloatTensorPrimitive {
    // A moment on another layout than the step's (a resumed state) is brought there.
    let local = on_layout(unwrap(t), like.layout()).into_local();
    X::float_cast(local, burn::tensor::FloatDType::F32)
}

/// A distributed tensor's value (the inverse of `wrap`).
fn unwrap<X: Backend, const D: usize>(t: Tensor<Distributed<X>, D>) -> DTensor<X> {
    t.into_primitive().tensor()
}

impl<X: Backend> TailInputs<X> {
    /// The clipping coefficient and the skip flag of the coming step on `device`: the fused
    /// tail's, or 1 and 0 where it set none (a pipeline stage clips before its step).
    pub(crate) fn scale_and_skip(&self, device: &X::Device) -> ScaleAndSkip<X> {
        self.current().unwrap_or_else(|| {
            (
                X::float_from_data(TensorData::new(vec![1.0f32], [1]), device),
                X::float_from_data(TensorData::new(vec![0.0f32], [1]), device),
            )
        })
    }
}

/// One fused AdamW step of `tensor` (see [`FusedAdamW`]): on the gradient's layout, from
/// `state` (or zero moments), the new moments kept in `config.moments`' float dtype. The
/// parameter and the moments are taken by value and nothing else holds their pieces while the
/// kernel runs, so an in-place kernel (Flex's) writes them without copying.
pub(crate) fn adamw_step<X: FusedOps, const D: usize>(
    config: &FusedAdamWConfig,
    inputs: &TailInputs<X>,
    lr: f64,
    tensor: Tensor<Distributed<X>, D>,
    grad: Tensor<Distributed<X>, D>,
    state: Option<AdamWState<Distributed<X>, D>>,
) -> (Tensor<Distributed<X>, D>, AdamWState<Distributed<X>, D>) {
    let g = unwrap(grad);
    // In hand: last step's multi-tensor launch handed the parameter back deferred.
    let p = on_layout(unwrap(tensor), g.layout()).ready();
    let device = p.device().inner().clone();
    let local_shape = p.local_shape();
    let dtype = burn::tensor::FloatDType::F32;
    let (time, m, v) = match state {
        Some(s) => (
            s.momentum.time + 1,
            piece(s.momentum.moment_1, &p),
            piece(s.momentum.moment_2, &p),
        ),
        None => (
            1,
            X::float_zeros(local_shape.clone(), &device, dtype),
            X::float_zeros(local_shape, &device, dtype),
        ),
    };
    let (scale, skip) = inputs.scale_and_skip(&device);
    // A parameter the forward used in the precision policy's compute dtype (its value keeps the
    // cast): the kernel writes the new value's copy too, so the next forward casts nothing.
    let copy = p.cast_copy_dtype().filter(|&c| c != p.local_dtype().into());
    let (grad, step) = (g.into_local(), config.step(lr, time));
    if config.multi_tensor && X::adamw_batch(p.local()) > 1 {
        return queued_step(
            config,
            inputs,
            p,
            [grad, m, v],
            (scale, skip),
            step,
            copy,
            time,
        );
    }
    let (mut moments, mut cast) = (None, None);
    let param = p.map_local(|param| {
        let operands = [param, grad, m, v, scale, skip];
        let out = match copy {
            Some(dtype) => {
                let (out, copy) = X::fused_adamw_with_copy(operands, step, dtype);
                cast = Some(copy);
                out
            }
            None => {
                let [param, grad, m, v, scale, skip] = operands;
                X::fused_adamw(param, grad, m, v, scale, skip, step)
            }
        };
        moments = Some((out.m, out.v));
        out.param
    });
    let (m, v) = moments.expect("the step ran");
    let keep = |t| X::float_cast(t, config.moments.float_dtype());
    let state = AdamWState {
        momentum: AdaptiveMomentumState {
            time,
            moment_1: wrap(param.with_local(keep(m))),
            moment_2: wrap(param.with_local(keep(v))),
            max_moment_2: None,
        },
    };
    let param = match cast {
        Some(copy) => param.with_cast_copy(copy),
        None => param,
    };
    (wrap(param), state)
}

/// [`adamw_step`] on a backend that batches ([`AdamWBatch`]): the step queued, its parameter,
/// moments and copy handed back deferred; the batch runs once it holds a launch's worth.
#[allow(clippy::too_many_arguments)]
fn queued_step<X: FusedOps, const D: usize>(
    config: &FusedAdamWConfig,
    inputs: &TailInputs<X>,
    p: DTensor<X>,
    [grad, m, v]: [X::FloatTensorPrimitive; 3],
    scale_skip: ScaleAndSkip<X>,
    step: AdamWStep,
    copy: Option<burn::tensor::FloatDType>,
    time: usize,
) -> (Tensor<Distributed<X>, D>, AdamWState<Distributed<X>, D>) {
    let dtype = p.local_dtype();
    let param = p.clone().into_local();
    let batch_size = X::adamw_batch(&param);
    let slot: Arc<AdamWSlot<X>> = Arc::new(Mutex::new([None, None, None, None]));
    let full = {
        let mut b = inputs.batch.lock().unwrap_or_else(|e| e.into_inner());
        if b.inputs.is_none() {
            b.inputs = Some(scale_skip);
        }
        let entry = wildfire_kernels::AdamWEntry {
            operands: [param, grad, m, v],
            step,
            copy,
        };
        b.pending.push((entry, slot.clone()));
        b.pending.len() >= batch_size
    };
    if full {
        run_batch(&inputs.batch);
    }
    let result = |k: usize| {
        let (batch, slot) = (inputs.batch.clone(), slot.clone());
        Box::new(move || take_result(&batch, &slot, k)) as wildfire_parallel::DeferredPiece<X>
    };
    let moments = config.moments.float_dtype();
    let moment = |k: usize| {
        let take = result(k);
        let keep = Box::new(move || X::float_cast(take(), moments));
        wrap(p.deferred_like(moments.into(), keep))
    };
    let state = AdamWState {
        momentum: AdaptiveMomentumState {
            time,
            moment_1: moment(1),
            moment_2: moment(2),
            max_moment_2: None,
        },
    };
    let mut param = p.deferred_like(dtype, result(0));
    if let Some(c) = copy {
        param = param.with_deferred_cast_copy(c, result(3));
    }
    (wrap(param), state)
}

impl<X: FusedOps> SimpleOptimizer<Distributed<X>> for FusedAdamW<X> {
    type State<const D: usize> = AdamWState<Distributed<X>, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<Distributed<X>, D>,
        grad: Tensor<Distributed<X>, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<Distributed<X>, D>, Option<Self::State<D>>) {
        let (tensor, state) = adamw_step(&self.config, &self.inputs, lr, tensor, grad, state);
        (tensor, Some(state))
    }

    fn to_device<const D: usize>(
        mut state: Self::State<D>,
        device: &burn::tensor::Device<Distributed<X>>,
    ) -> Self::State<D> {
        state.momentum = state.momentum.to_device(device);
        state
    }
}

impl<X: FusedOps> StateCodec<Distributed<X>> for FusedAdamW<X> {
    fn state_specs(_shape: &[usize]) -> Vec<StateSpec> {
        wildfire_parallel::adamw_specs()
    }

    fn encode<const D: usize>(
        state: Self::State<D>,
    ) -> Result<EncodedState<Distributed<X>>, String> {
        wildfire_parallel::encode_adamw(state)
    }

    fn decode<const D: usize>(
        state: EncodedState<Distributed<X>>,
    ) -> Result<Self::State<D>, String> {
        wildfire_parallel::decode_adamw(state)
    }
}

/// Registers a gradient's unscaled local piece back under its parameter (its layout kept).
type Register<X> = Box<dyn FnOnce(&mut GradientsParams, burn::tensor::ops::FloatTensor<X>)>;

/// Collects every gradient's local piece and copy count for one
/// [`FusedOps::fused_unscale_all`] over the whole step (the three vectors in visiting order).
struct Unscale<'a, X: Backend> {
    grads: &'a mut GradientsParams,
    /// Each gradient's local piece.
    locals: Vec<burn::tensor::ops::FloatTensor<X>>,
    /// Each gradient's number of copies over the mesh.
    copies: Vec<usize>,
    /// Each gradient's registration of its unscaled piece.
    registers: Vec<Register<X>>,
    ctx: Option<Arc<wildfire_parallel::RankContext>>,
}

impl<B, X> ModuleVisitor<B> for Unscale<'_, X>
where
    B: AutodiffBackend<InnerBackend = Distributed<X>>,
    X: FusedOps,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(grad) = self.grads.remove::<Distributed<X>, D>(param.id) else {
            return;
        };
        let t = dtensor(&grad).clone();
        self.ctx.get_or_insert_with(|| t.device().context().clone());
        self.copies.push(crate::grad_check::copies(&t));
        self.locals.push(t.local().clone());
        let id = param.id;
        self.registers
            .push(Box::new(move |grads: &mut GradientsParams, out| {
                grads.register::<Distributed<X>, D>(id, wrap::<X, D>(t.with_local(out)));
            }));
    }
}

/// The fused counterpart of [`crate::unscale_check_clip`] (`loss`: this rank's loss, still on the
/// device — read with the flag and `Σ‖g‖²` in the step's one host read, returned beside the
/// check; a NaN or infinite loss counts as an overflow in the same all-reduce): unscale every gradient by
/// `inv_scale` and measure `[found_inf, Σ‖g‖²]` with one kernel pass per gradient (combined on
/// the device, then one 16-byte all-reduce over the mesh), and set `inputs` to the clipping
/// coefficient (`max_norm / norm` when above, else 1) and the skip flag for the next
/// [`FusedAdamW`] step. The gradients are not rescaled here: the AdamW kernel applies the
/// coefficient as it reads them.
pub fn fused_unscale_check<B, X, M>(
    model: &M,
    grads: &mut GradientsParams,
    inv_scale: f32,
    max_norm: Option<f32>,
    inputs: &TailInputs<X>,
    loss: Tensor<X, 1>,
) -> Result<(GradCheck, f32), Error>
where
    B: AutodiffBackend<InnerBackend = Distributed<X>>,
    X: FusedOps,
    M: AutodiffModule<B>,
{
    let mut v = Unscale::<X> {
        grads,
        locals: Vec::new(),
        copies: Vec::new(),
        registers: Vec::new(),
        ctx: None,
    };
    model.visit(&mut v);
    let Unscale {
        grads,
        locals,
        copies,
        registers,
        ctx,
    } = v;
    let loss = loss.cast(burn::tensor::DType::F32);
    let (false, Some(ctx)) = (locals.is_empty(), ctx) else {
        let loss: f32 = loss.into_scalar().elem();
        let check = GradCheck {
            norm: 0.0,
            found_inf: !loss.is_finite(),
            clip_factor: 1.0,
        };
        return Ok((check, loss));
    };
    let (outputs, stats) = X::fused_unscale_all(locals, &copies, f64::from(inv_scale));
    for (register, out) in registers.into_iter().zip(outputs) {
        register(grads, out);
    }
    // `[flag, Σg²]`
    let stats = Tensor::<X, 1>::from_primitive(TensorPrimitive::Float(stats));
    let device = stats.device();
    // The step's one read, 12 bytes: the flag, Σg² and the loss (the agreement over the mesh
    // needs the host communicator).
    ctx.count_host_read();
    let local: Vec<f32> = Tensor::cat(vec![stats, loss], 0)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32");
    let loss_not_finite = !local[2].is_finite();
    let (found_inf, total) = if ctx.world_size() > 1 {
        let flag = if loss_not_finite {
            1.0
        } else {
            f64::from(local[0])
        };
        let data = TensorData::new(vec![flag, f64::from(local[1])], [2]);
        let out = ctx
            .comm()
            .all_reduce(Group::World, data, ReduceOp::Sum)?
            .to_vec::<f64>()
            .expect("f64");
        (out[0] > 0.0 || !out[1].is_finite(), out[1])
    } else {
        (
            loss_not_finite || local[0] > 0.0 || !local[1].is_finite(),
            f64::from(local[1]),
        )
    };
    let norm = if found_inf {
        f32::INFINITY
    } else {
        total.sqrt() as f32
    };
    let clip_factor = match max_norm {
        Some(max) if !found_inf && norm > max => max / (norm + 1e-6),
        _ => 1.0,
    };
    let scalar = |x: f32| {
        Tensor::<X, 1>::from_data(TensorData::new(vec![x], [1]), &device)
            .into_primitive()
            .tensor()
    };
    let skip = if found_inf { 1.0 } else { 0.0 };
    *inputs.inner.lock().unwrap() = Some((scalar(clip_factor), scalar(skip)));
    *inputs.on_host.lock().unwrap() = Some((clip_factor, skip));
    let check = GradCheck {
        norm,
        found_inf,
        clip_factor,
    };
    Ok((check, local[2]))
}
