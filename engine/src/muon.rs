//! Muon (Jordan et al., 2024; at scale: Liu et al., 2025, "Muon is Scalable for LLM Training")
//! as PyTorch's `torch.optim.Muon` defines it, for the hidden matrices of a model, with AdamW for
//! its tables (token and position embeddings, the output head) and its vectors (norms, biases):
//! the split the Muon write-up prescribes.
//!
//! Per hidden matrix `θ` with gradient `G` (hyper-parameters in [`MuonConfig`]):
//!
//! ```text
//! B ← μB + (1 − μ)G                         (the momentum buffer, PyTorch's `lerp`)
//! U = (1 − μ)G + μB   (Nesterov; else U = B)
//! O = NS₅(U)          X ← U / max(‖U‖_F, ε); five times: A = XXᵀ, X ← aX + (bA + cA²)X
//!                     (on the wide orientation: a tall matrix is transposed first and after)
//! θ ← θ(1 − lr·λ) − lr·s·O,   s = √max(1, fan_out/fan_in)       (PyTorch's "original")
//!                          or s = 0.2·√max(fan_in, fan_out)     ("match_rms_adamw")
//! ```
//!
//! A stacked `[E, n, m]` weight (a mixture's experts) is `E` matrices: each is orthogonalised on
//! its own. Burn's linear weights are `[fan_in, fan_out]` (PyTorch's `[out, in]` transposed), so
//! the "original" ratio reads the last dim over the one before; `NS₅(Uᵀ) = NS₅(U)ᵀ`, so the
//! update itself does not depend on the orientation.
//!
//! **Sharded (ZeRO, FSDP, TP):** Newton–Schulz needs the whole matrix. Each rank all-gathers the
//! momentum-corrected update `U` of every matrix — Moonlight's "Distributed Muon" (Liu et al.,
//! 2025, §2.3) — and the state (the buffer `B`) stays sharded like AdamW's moments. Who then runs
//! the iteration is [`MuonSplit`]:
//!
//! - `Owner` (the default): **per owner rank**, each matrix orthogonalised by one rank, as
//!   Dion's distributed Muon (microsoft/dion) splits the matrices among ranks. The hidden matrices, in the module's order, are taken `n` at
//!   a time for the `n` members of the first data-parallel axis; in each round the `n` gathers
//!   run back to back and member `j` keeps the whole `U` of the round's `j`-th matrix, the
//!   members run their iterations side by side, then member `j` broadcasts its result and
//!   every member keeps its own piece. Each rank runs `1/n` of the iterations and holds at most
//!   one whole update and one whole result at a time; the cost is one parameter-sized broadcast
//!   per matrix. (An all-to-all to the owners and back would move half the bytes; the gather
//!   and broadcast keep every layout's shard pieces as they are.) Tensor-parallel peers of an
//!   owner still compute the same matrix: the split is along the data axis only.
//! - `Every`: every rank runs every matrix's iteration and keeps its piece (no broadcast).
//!
//! The two give the same numbers bit for bit: each iteration runs on the same whole matrix with
//! the same ops. The iteration runs in f32 (PyTorch's runs in bf16).
//!
//! Differences from `burn::optim::Muon` (Burn 0.21), which is why this is not it: Burn's
//! momentum is SGD's (`B ← μB + G`, Nesterov `G + μB`), not PyTorch's interpolation; its
//! "original" ratio reads `[fan_in, fan_out]` as PyTorch's `[out, in]`; it refuses anything but a
//! matrix, so the tables and vectors need a second optimizer; and on `Distributed` its
//! iteration would run on the shards.
//!
//! [`MuonOptimizer`] is the module-level optimizer: it is told which parameters are tables (by
//! their path, when it is built) and steps those and every vector with AdamW. Its record is Burn's
//! adaptor record of the per-tensor [`Muon`] step, whose state is a [`StateCodec`]: `momentum`
//! for a Muon parameter, AdamW's `moment_1` and `moment_2` for the rest (each parameter keeps one
//! kind; the checkpoint stores what it keeps).

use std::collections::HashSet;
use std::sync::Arc;

use crate::fused_tail::{on_grad_layout, on_layout};
use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::adaptor::GradAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{
    AdamW, AdamWConfig, AdamWState, GradientsParams, LearningRate, MultiGradientsParams, Optimizer,
    SimpleOptimizer,
};
use burn::prelude::*;
use burn::record::Record;
use burn::tensor::TensorPrimitive;
use serde::{Deserialize, Serialize};
use wildfire_parallel::{
    DTensor, Distributed, EncodedState, Layout, ModulePath, ParamVisitor, StateCodec, StateShape,
    StateSpec, dtensor, visit_params,
};

/// How Muon scales its learning rate per matrix (PyTorch's `adjust_lr_fn`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MuonLr {
    /// `√max(1, fan_out/fan_in)` (Keller Jordan's): the learning rate is Muon's own.
    #[default]
    Original,
    /// `0.2·√max(fan_in, fan_out)` (Moonlight's): the update's RMS matches AdamW's, so one
    /// learning rate and weight decay serve both halves of the model.
    MatchRmsAdamw,
}

/// Which ranks run a sharded matrix's Newton–Schulz iteration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum MuonSplit {
    /// Every rank, on every matrix (Moonlight's distributed Muon): one all-gather per matrix.
    Every,
    /// One owner rank per matrix along the first data axis, in turn, `n` matrices at a time
    /// for `n` ranks: each rank orthogonalises one matrix of the round and broadcasts it (an
    /// all-gather and a broadcast per matrix, `1/n` of the iterations per rank). The same
    /// numbers as [`MuonSplit::Every`], bit for bit.
    #[default]
    Owner,
}

/// Muon's hyper-parameters (PyTorch's defaults), and those of the AdamW that steps the tables and
/// vectors.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MuonConfig {
    /// `μ`.
    pub momentum: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Newton–Schulz iterations.
    pub ns_steps: usize,
    /// The quintic's coefficients `(a, b, c)`.
    pub ns_coefficients: (f64, f64, f64),
    /// The floor of the Frobenius norm the iteration divides by.
    pub epsilon: f64,
    /// Decoupled weight decay `λ` (scaled by the unadjusted learning rate), both halves.
    pub weight_decay: f64,
    /// The per-matrix learning-rate scale.
    pub adjust_lr: MuonLr,
    /// The AdamW half: `β₁`.
    pub adamw_beta1: f64,
    /// The AdamW half: `β₂`.
    pub adamw_beta2: f64,
    /// The AdamW half: `ε`.
    pub adamw_epsilon: f64,
    /// Which ranks orthogonalise a sharded matrix.
    #[serde(default)]
    pub split: MuonSplit,
}

impl Default for MuonConfig {
    fn default() -> Self {
        Self {
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            ns_coefficients: (3.4445, -4.7750, 2.0315),
            epsilon: 1e-7,
            weight_decay: 0.1,
            adjust_lr: MuonLr::Original,
            adamw_beta1: 0.9,
            adamw_beta2: 0.999,
            adamw_epsilon: 1e-8,
            split: MuonSplit::Owner,
        }
    }
}

impl MuonConfig {
    /// The per-tensor step.
    pub fn build(&self) -> Muon {
        let adamw = AdamWConfig::new()
            .with_beta_1(self.adamw_beta1 as f32)
            .with_beta_2(self.adamw_beta2 as f32)
            .with_epsilon(self.adamw_epsilon as f32)
            .with_weight_decay(self.weight_decay as f32);
        Muon {
            config: *self,
            adamw: adamw.build(),
        }
    }

    /// The optimizer for `model`: the parameters at a path `is_table` accepts (and every vector)
    /// step with AdamW, the other matrices with Muon. An error if `model` has no matrix for Muon.
    pub fn init<X: Backend, M: AutodiffModule<Ad<X>>>(
        &self,
        model: &M,
        is_table: impl Fn(&str) -> bool,
    ) -> Result<MuonOptimizer<X, M>, String> {
        let mut scan = Scan {
            is_table,
            tables: HashSet::new(),
            matrices: 0,
        };
        visit_params(model, &mut scan);
        if scan.matrices == 0 {
            return Err(
                "Muon orthogonalises hidden matrices, and this model has none outside its \
                 tables: train it with AdamW"
                    .into(),
            );
        }
        Ok(MuonOptimizer {
            step: self.build(),
            records: Default::default(),
            tables: Arc::new(scan.tables),
            module: std::marker::PhantomData,
        })
    }
}

type Ad<X> = burn::backend::Autodiff<Distributed<X>>;

/// A tensor on `Distributed<X>`.
type Dist<X, const D: usize> = Tensor<Distributed<X>, D>;

/// The tables a model's paths name, and a count of the matrices left for Muon.
struct Scan<F> {
    is_table: F,
    tables: HashSet<ParamId>,
    matrices: usize,
}

impl<B: Backend, F: Fn(&str) -> bool> ParamVisitor<B> for Scan<F> {
    fn visit<const D: usize>(&mut self, path: &ModulePath, param: &Param<Tensor<B, D>>) {
        if (self.is_table)(&path.name()) {
            self.tables.insert(param.id);
        } else if D >= 2 {
            self.matrices += 1;
        }
    }
}

/// The per-tensor step: [`Muon::muon_step`] for a hidden matrix, [`Muon::adamw_step`] for a
/// table or a vector. As a plain `SimpleOptimizer` (Burn's adaptor, which cannot tell a table
/// from a hidden matrix) it steps every matrix with Muon and every vector with AdamW.
#[derive(Clone)]
pub struct Muon {
    config: MuonConfig,
    adamw: AdamW,
}

impl std::fmt::Debug for Muon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Muon")
            .field("config", &self.config)
            .finish()
    }
}

/// One parameter's state: Muon's momentum buffer, or AdamW's (the other `None`).
#[derive(Record, Clone)]
pub struct MuonState<B: Backend, const D: usize> {
    /// Steps taken.
    pub time: usize,
    /// The momentum buffer `B` of a Muon parameter.
    pub momentum: Option<Tensor<B, D>>,
    /// AdamW's state of a table or a vector.
    pub adamw: Option<AdamWState<B, D>>,
}

fn wrap<X: Backend, const D: usize>(t: DTensor<X>) -> Tensor<Distributed<X>, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// The quintic Newton–Schulz iteration on each `[n, m]` matrix of `g` (PyTorch's
/// `_zeropower_via_newtonschulz`, per matrix of a stack).
pub fn newton_schulz<B: Backend, const D: usize>(
    g: Tensor<B, D>,
    steps: usize,
    (a, b, c): (f64, f64, f64),
    epsilon: f64,
) -> Tensor<B, D> {
    let dims = g.dims();
    let tall = dims[D - 2] > dims[D - 1];
    let x = if tall { g.transpose() } else { g };
    let norm = x
        .clone()
        .square()
        .sum_dim(D - 1)
        .sum_dim(D - 2)
        .sqrt()
        .clamp_min(epsilon);
    let mut x = x.div(norm);
    for _ in 0..steps {
        let gram = x.clone().matmul(x.clone().transpose());
        let update = gram.clone().mul_scalar(b) + gram.clone().matmul(gram).mul_scalar(c);
        x = x.clone().mul_scalar(a) + update.matmul(x);
    }
    if tall { x.transpose() } else { x }
}

impl Muon {
    /// The learning rate of a `[.., fan_in, fan_out]` matrix.
    pub fn adjusted_lr(&self, lr: f64, dims: &[usize]) -> f64 {
        let d = dims.len();
        let (fan_in, fan_out) = (dims[d - 2] as f64, dims[d - 1] as f64);
        match self.config.adjust_lr {
            MuonLr::Original => lr * (fan_out / fan_in).max(1.0).sqrt(),
            MuonLr::MatchRmsAdamw => lr * 0.2 * fan_in.max(fan_out).sqrt(),
        }
    }

    /// Muon's step of a hidden matrix (rank 2, or a stack of matrices): the whole update
    /// orthogonalised on this rank ([`MuonSplit::Every`]).
    pub fn muon_step<X: Backend, const D: usize>(
        &self,
        lr: f64,
        pair: [Dist<X, D>; 2],
        state: Option<MuonState<Distributed<X>, D>>,
    ) -> (Dist<X, D>, MuonState<Distributed<X>, D>) {
        let (half, state) = self.muon_begin(pair, state);
        let whole = on_layout(half.update.clone(), &replicated(&half.update));
        let ortho = on_layout(self.orthogonalise(whole), half.update.layout());
        (self.muon_finish(lr, half, ortho), state)
    }

    /// The first half of Muon's step: the new momentum buffer (the state) and the
    /// momentum-corrected update `U`, on the gradient's layout.
    fn muon_begin<X: Backend, const D: usize>(
        &self,
        [tensor, grad]: [Dist<X, D>; 2],
        state: Option<MuonState<Distributed<X>, D>>,
    ) -> (MuonHalf<X>, MuonState<Distributed<X>, D>) {
        assert!(D >= 2, "Muon steps matrices");
        let c = &self.config;
        let dims = grad.dims().to_vec();
        // On the gradient's layout (a shard under ZeRO), where the buffer lives.
        let (p, g) = on_grad_layout(&tensor, &grad);
        let layout = g.layout().clone();
        let time = state.as_ref().map_or(0, |s| s.time) + 1;
        assert!(
            state.as_ref().is_none_or(|s| s.momentum.is_some()),
            "a hidden matrix's Muon state holds AdamW's moments"
        );
        let old = state
            .and_then(|s| s.momentum)
            .map(|b| wrap::<X, D>(on_layout(dtensor(&b).clone(), &layout)));
        let fresh = grad.clone().mul_scalar(1.0 - c.momentum);
        let buffer = match old {
            Some(b) => b.mul_scalar(c.momentum) + fresh,
            None => fresh,
        };
        let update = if c.nesterov {
            grad.mul_scalar(1.0 - c.momentum) + buffer.clone().mul_scalar(c.momentum)
        } else {
            buffer.clone()
        };
        let half = MuonHalf {
            p,
            update: dtensor(&update).clone(),
            dims,
        };
        let state = MuonState {
            time,
            momentum: Some(buffer),
            adamw: None,
        };
        (half, state)
    }

    /// `NS₅` of a whole (replicated) update, on this rank (counted in the rank's
    /// [`OpCounters::work`](wildfire_parallel::OpCounters) as [`NEWTON_SCHULZ`], per matrix).
    fn orthogonalise<X: Backend>(&self, whole: DTensor<X>) -> DTensor<X> {
        let c = &self.config;
        let dims = whole.global_shape().num_dims();
        whole
            .device()
            .context()
            .count_work(NEWTON_SCHULZ, stacked(&whole));
        let local = whole.local().clone();
        let ortho = match dims {
            2 => ns_local::<X, 2>(local, c),
            3 => ns_local::<X, 3>(local, c),
            4 => ns_local::<X, 4>(local, c),
            d => panic!("Muon orthogonalises matrices and stacks of them, not rank {d}"),
        };
        whole.with_local(ortho)
    }

    /// The second half: `θ(1 − lr·λ) − lr·s·O`, with `ortho` on the update's layout.
    fn muon_finish<X: Backend, const D: usize>(
        &self,
        lr: f64,
        half: MuonHalf<X>,
        ortho: DTensor<X>,
    ) -> Dist<X, D> {
        let c = &self.config;
        let p = wrap::<X, D>(half.p);
        let p = if c.weight_decay > 0.0 {
            p.mul_scalar(1.0 - lr * c.weight_decay)
        } else {
            p
        };
        p - wrap::<X, D>(ortho).mul_scalar(self.adjusted_lr(lr, &half.dims))
    }

    /// AdamW's step of a table or a vector (`tensor`, `grad`).
    pub fn adamw_step<X: Backend, const D: usize>(
        &self,
        lr: f64,
        [tensor, grad]: [Dist<X, D>; 2],
        state: Option<MuonState<Distributed<X>, D>>,
    ) -> (Dist<X, D>, MuonState<Distributed<X>, D>) {
        assert!(
            state.as_ref().is_none_or(|s| s.adamw.is_some()),
            "a table's or vector's Muon state holds a momentum buffer"
        );
        let old = state.and_then(|s| s.adamw);
        let (p, adamw) = self.adamw.step(lr, tensor, grad, old);
        let adamw = adamw.expect("AdamW keeps a state");
        let state = MuonState {
            time: adamw.momentum.time,
            momentum: None,
            adamw: Some(adamw),
        };
        (p, state)
    }
}

/// A hidden matrix's step between its halves ([`Muon::muon_begin`]): the parameter and the
/// momentum-corrected update on the gradient's layout, and the matrix's dims.
struct MuonHalf<X: Backend> {
    p: DTensor<X>,
    update: DTensor<X>,
    dims: Vec<usize>,
}

/// `t`'s layout replicated over the whole mesh.
fn replicated<X: Backend>(t: &DTensor<X>) -> Layout {
    Layout::replicated(t.device().mesh())
}

/// [`newton_schulz`] on a local piece of rank `D`.
fn ns_local<X: Backend, const D: usize>(
    local: X::FloatTensorPrimitive,
    c: &MuonConfig,
) -> X::FloatTensorPrimitive {
    let t = Tensor::<X, D>::from_primitive(TensorPrimitive::Float(local));
    newton_schulz(t, c.ns_steps, c.ns_coefficients, c.epsilon)
        .into_primitive()
        .tensor()
}

impl<X: Backend> SimpleOptimizer<Distributed<X>> for Muon {
    type State<const D: usize> = MuonState<Distributed<X>, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Dist<X, D>,
        grad: Dist<X, D>,
        state: Option<Self::State<D>>,
    ) -> (Dist<X, D>, Option<Self::State<D>>) {
        let (p, state) = if D >= 2 {
            self.muon_step(lr, [tensor, grad], state)
        } else {
            self.adamw_step(lr, [tensor, grad], state)
        };
        (p, Some(state))
    }

    fn to_device<const D: usize>(
        state: Self::State<D>,
        device: &burn::tensor::Device<Distributed<X>>,
    ) -> Self::State<D> {
        MuonState {
            time: state.time,
            momentum: state.momentum.map(|m| m.to_device(device)),
            adamw: state.adamw.map(|mut a| {
                a.momentum = a.momentum.to_device(device);
                a
            }),
        }
    }
}

fn float<B: Backend, const D: usize>(t: Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
    t.into_primitive().tensor()
}

impl<X: Backend> StateCodec<Distributed<X>> for Muon {
    /// `momentum` (a Muon parameter's) and `adamw_moment_1`, `adamw_moment_2` (a table's or a
    /// vector's), all shaped like the parameter; each parameter keeps one kind. The AdamW half's
    /// names are not AdamW's, so a plain AdamW checkpoint is not taken for Muon's state (its
    /// hidden matrices would start without their buffers): resuming one with Muon is refused.
    fn state_specs(_shape: &[usize]) -> Vec<StateSpec> {
        ["momentum", "adamw_moment_1", "adamw_moment_2"]
            .into_iter()
            .map(|name| StateSpec::new(name, StateShape::Param))
            .collect()
    }

    fn encode<const D: usize>(
        state: Self::State<D>,
    ) -> Result<EncodedState<Distributed<X>>, String> {
        match (state.momentum, state.adamw) {
            (Some(m), None) => Ok(EncodedState {
                steps: state.time,
                tensors: vec![Some(float(m)), None, None],
            }),
            (None, Some(adamw)) => {
                let moments = wildfire_parallel::encode_adamw(adamw)?;
                let mut tensors = vec![None];
                tensors.extend(moments.tensors);
                Ok(EncodedState {
                    steps: moments.steps,
                    tensors,
                })
            }
            _ => Err("a Muon state keeps either a momentum buffer or AdamW's moments".into()),
        }
    }

    fn decode<const D: usize>(
        state: EncodedState<Distributed<X>>,
    ) -> Result<Self::State<D>, String> {
        let steps = state.steps;
        let mut tensors = state.tensors.into_iter();
        let momentum = tensors.next().flatten();
        let moments: Vec<_> = tensors.collect();
        match (momentum, moments.iter().any(Option::is_some)) {
            (Some(m), false) => Ok(MuonState {
                time: steps,
                momentum: Some(Tensor::from_primitive(TensorPrimitive::Float(m))),
                adamw: None,
            }),
            (None, true) => {
                let adamw = wildfire_parallel::decode_adamw(EncodedState {
                    steps,
                    tensors: moments,
                })?;
                Ok(MuonState {
                    time: steps,
                    momentum: None,
                    adamw: Some(adamw),
                })
            }
            (Some(_), true) => {
                Err("the checkpoint holds both a Muon buffer and AdamW's moments".into())
            }
            (None, false) => Err(
                "Muon's state (a momentum buffer, or AdamW's moments) is not in the checkpoint"
                    .into(),
            ),
        }
    }
}

/// Muon for `M`'s hidden matrices, AdamW for its tables and vectors ([`MuonConfig::init`]).
#[derive(Clone)]
pub struct MuonOptimizer<X: Backend, M> {
    step: Muon,
    records: hashbrown::HashMap<ParamId, AdaptorRecord<Muon, Ad<X>>>,
    tables: Arc<HashSet<ParamId>>,
    module: std::marker::PhantomData<M>,
}

impl<X: Backend, M> MuonOptimizer<X, M> {
    /// Whether the parameter `id` steps with AdamW (a table; vectors always do).
    pub fn is_table(&self, id: &ParamId) -> bool {
        self.tables.contains(id)
    }

    fn step_with(&mut self, lr: LearningRate, module: M, mut grads: GradAdaptor) -> M
    where
        M: AutodiffModule<Ad<X>>,
    {
        let mut halves = (self.step.config.split == MuonSplit::Owner).then(Vec::new);
        let module = module.map(&mut Stepper {
            optim: self,
            grads: &mut grads,
            lr,
            halves: halves.as_mut(),
        });
        let Some(halves) = halves.filter(|h| !h.is_empty()) else {
            return module;
        };
        let mut done = self.orthogonalise_by_owners(halves);
        module.map(&mut Finisher {
            step: &self.step,
            done: &mut done,
            lr,
        })
    }

    /// Every matrix's update orthogonalised by its owner rank and broadcast back, in rounds of
    /// one matrix per member of the first data axis's group (every rank, every matrix, without
    /// one): each member's piece of the result, by parameter.
    fn orthogonalise_by_owners(
        &self,
        halves: Vec<(ParamId, MuonHalf<X>)>,
    ) -> hashbrown::HashMap<ParamId, (MuonHalf<X>, DTensor<X>)> {
        let device = halves[0].1.update.device().clone();
        let mesh = device.mesh();
        let axis = (0..mesh.axes().len()).find(|&a| {
            mesh.axis(a).kind == wildfire_parallel::AxisKind::Data && mesh.axis_size(a) > 1
        });
        let (size, me) = match axis {
            Some(a) => (mesh.axis_size(a), mesh.coords(device.rank())[a]),
            None => (1, 0),
        };
        let mut done = hashbrown::HashMap::new();
        let mut halves = halves.into_iter().peekable();
        while halves.peek().is_some() {
            let round: Vec<_> = halves.by_ref().take(size).collect();
            // The round's gathers, back to back; each member keeps the one it owns.
            let mut mine = None;
            for (j, (_, half)) in round.iter().enumerate() {
                let whole = on_layout(half.update.clone(), &replicated(&half.update));
                if j == me {
                    mine = Some(whole);
                }
            }
            // The members' iterations run side by side.
            let mut mine = mine.map(|whole| self.step.orthogonalise(whole));
            // Each result broadcast by its owner; every member keeps its piece.
            for (j, (id, half)) in round.into_iter().enumerate() {
                let whole = match mine.take_if(|_| j == me) {
                    Some(ortho) => ortho,
                    None => receive_buffer(&half.update),
                };
                let whole = match axis {
                    Some(a) => whole
                        .broadcast_on(a, j)
                        .unwrap_or_else(|e| wildfire_parallel::internal::raise(e)),
                    None => whole,
                };
                let ortho = on_layout(whole, half.update.layout());
                done.insert(id, (half, ortho));
            }
        }
        done
    }
}

/// The name under which a rank counts its Newton–Schulz iterations, one per matrix
/// ([`wildfire_parallel::RankContext::count_work`]).
pub const NEWTON_SCHULZ: &str = "muon newton-schulz";

/// How many matrices `whole` stacks (`[.., n, m]`).
fn stacked<X: Backend>(whole: &DTensor<X>) -> u64 {
    let shape = whole.global_shape();
    let dims = shape.as_slice();
    dims[..dims.len() - 2].iter().product::<usize>() as u64
}

/// A replicated value of `update`'s global shape and dtype: the receive buffer of a broadcast.
fn receive_buffer<X: Backend>(update: &DTensor<X>) -> DTensor<X> {
    let device = update.device();
    let shape = update.global_shape();
    let dtype = update.local_dtype();
    let zeros = X::float_zeros(shape.clone(), device.inner(), dtype.into());
    DTensor::from_local(zeros, replicated(update), device)
        .unwrap_or_else(|e| wildfire_parallel::internal::raise(e))
}

impl<X: Backend, M: AutodiffModule<Ad<X>>> Optimizer<M, Ad<X>> for MuonOptimizer<X, M> {
    type Record = hashbrown::HashMap<ParamId, AdaptorRecord<Muon, Ad<X>>>;

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        self.step_with(lr, module, grads.into())
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        self.step_with(lr, module, grads.into())
    }

    fn to_record(&self) -> Self::Record {
        self.records.clone()
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        self.records = record;
        self
    }
}

/// Burn's adaptor mapper, told which step each parameter takes.
struct Stepper<'a, X: Backend, M> {
    optim: &'a mut MuonOptimizer<X, M>,
    grads: &'a mut GradAdaptor,
    lr: LearningRate,
    /// Under [`MuonSplit::Owner`]: where a hidden matrix's first half goes (its parameter is
    /// left as it is until [`Finisher`]).
    halves: Option<&'a mut Vec<(ParamId, MuonHalf<X>)>>,
}

/// The second half of each hidden matrix's step ([`MuonSplit::Owner`]).
struct Finisher<'a, X: Backend> {
    step: &'a Muon,
    done: &'a mut hashbrown::HashMap<ParamId, (MuonHalf<X>, DTensor<X>)>,
    lr: LearningRate,
}

impl<X: Backend> ModuleMapper<Ad<X>> for Finisher<'_, X> {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<Ad<X>, D>>,
    ) -> Param<Tensor<Ad<X>, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some((half, ortho)) = self.done.remove(&id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let p = self.step.muon_finish::<X, D>(self.lr, half, ortho);
        Param::from_mapped_value(id, stepped(p, tensor.is_require_grad()), mapper)
    }
}

/// A stepped parameter as a leaf of the autodiff graph, tracked when it was.
fn stepped<X: Backend, const D: usize>(p: Dist<X, D>, require_grad: bool) -> Tensor<Ad<X>, D> {
    let p = Tensor::from_inner(p);
    if require_grad { p.require_grad() } else { p }
}

impl<X: Backend, M> ModuleMapper<Ad<X>> for Stepper<'_, X, M> {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<Ad<X>, D>>,
    ) -> Param<Tensor<Ad<X>, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some((grad, device)) = self.grads.remove::<Distributed<X>, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let state =
            self.optim.records.remove(&id).map(|r| {
                <Muon as SimpleOptimizer<Distributed<X>>>::to_device(r.into_state(), &device)
            });
        let step = &self.optim.step;
        let pair = [tensor.clone().inner(), grad];
        let (p, state) = if D < 2 || self.optim.is_table(&id) {
            step.adamw_step(self.lr, pair, state)
        } else if let Some(halves) = self.halves.as_mut() {
            let (half, state) = step.muon_begin(pair, state);
            halves.push((id, half));
            self.optim
                .records
                .insert(id, AdaptorRecord::from_state(state));
            return Param::from_mapped_value(id, tensor, mapper);
        } else {
            step.muon_step(self.lr, pair, state)
        };
        self.optim
            .records
            .insert(id, AdaptorRecord::from_state(state));
        Param::from_mapped_value(id, stepped(p, require_grad), mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The iteration leaves a matrix's singular values near 1 (the quintic's band, 0.7–1.2) and
    /// its singular vectors alone: `O·Oᵀ ≈ I` for a wide matrix, and a tall one is the wide
    /// one's transpose.
    #[test]
    fn newton_schulz_orthogonalises() {
        type B = burn::backend::Flex;
        let device = Default::default();
        let (n, m) = (8, 24);
        let data: Vec<f32> = (0..n * m)
            .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * (1.0 + (i % 7) as f32))
            .collect();
        let g = Tensor::<B, 2>::from_data(TensorData::new(data, [n, m]), &device);
        let c = MuonConfig::default();
        let o = newton_schulz(g.clone(), c.ns_steps, c.ns_coefficients, c.epsilon);
        let gram: Vec<f32> = o
            .clone()
            .matmul(o.clone().transpose())
            .into_data()
            .to_vec()
            .unwrap();
        for i in 0..n {
            for j in 0..n {
                let v = gram[i * n + j];
                if i == j {
                    assert!((0.45..1.45).contains(&v), "diagonal {i}: {v}");
                } else {
                    assert!(v.abs() < 0.3, "({i}, {j}): {v}");
                }
            }
        }
        let tall = newton_schulz(g.transpose(), c.ns_steps, c.ns_coefficients, c.epsilon);
        let (a, b): (Vec<f32>, Vec<f32>) = (
            tall.transpose().into_data().to_vec().unwrap(),
            o.into_data().to_vec().unwrap(),
        );
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}
