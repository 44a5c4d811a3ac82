//! Adafactor (Shazeer & Stern, 2018) as PyTorch's `torch.optim.Adafactor` defines it: the
//! second moment of a matrix kept factored, as a row and a column statistic (`n + m` values for
//! an `n × m` weight instead of `n · m`), no first moment, a relative step size, and the update
//! clipped by its RMS.
//!
//! Per parameter `θ` with gradient `G` at step `t` (hyper-parameters in [`AdafactorConfig`]):
//!
//! ```text
//! β₂ₜ = 1 − t^β₂_decay          ρₜ = min(lr, 1/√t)          αₜ = max(ε₂, RMS(θ)) · ρₜ
//! θ  ← θ · (1 − lr · λ)
//! rank ≥ 2:  R ← β₂ₜ R + (1 − β₂ₜ) mean_last(G²)        (shape [.., n, 1])
//!            C ← β₂ₜ C + (1 − β₂ₜ) mean_second_last(G²) (shape [.., 1, m])
//!            V = R · C / max(mean_second_last(R), ε₁)
//! rank 1:    V ← β₂ₜ V + (1 − β₂ₜ) G²
//! U = G / √max(V, ε₁²)            θ ← θ − αₜ · U / max(1, RMS(U) / d)
//! ```
//!
//! Written in Burn's tensor ops, so on `Distributed<B>` it runs on any layout: under FSDP's row
//! sharding the row statistic stays sharded with its rows, and the column statistic — a sum over
//! the sharded rows — is all-reduced by the propagation rules when it enters the state (one
//! all-reduce of `m` values per matrix and step), so every rank keeps the same columns. Means are sums divided by the global
//! sizes, so a padded shard's zero rows change nothing. The scalars (`RMS(θ)`, `RMS(U)`) stay
//! on the device: the step reads nothing back.
//!
//! Its state is a [`StateCodec`]: the row and column statistics (`row`, `col`) of a matrix, or
//! the full second moment (`second`) of a vector, saved and resharded by the distributed
//! checkpoint like AdamW's moments.

use burn::config::Config;
use burn::module::AutodiffModule;
use burn::optim::SimpleOptimizer;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::prelude::*;
use burn::record::Record;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use wildfire_parallel::{EncodedState, StateCodec, StateShape, StateSpec};

/// Adafactor's hyper-parameters (PyTorch's defaults). The learning rate the optimizer is stepped
/// with (PyTorch's default is 1e-2) caps the relative step size, `ρₜ = min(lr, 1/√t)`.
#[derive(Config, Debug)]
pub struct AdafactorConfig {
    /// The exponent of the second-moment decay, `β₂ₜ = 1 − t^β₂_decay`.
    #[config(default = -0.8)]
    pub beta2_decay: f64,
    /// `ε₁`: the floor of the second-moment estimate (its square is the floor of `V`); `None`
    /// for the parameter dtype's machine epsilon (f32: 1.19e-7).
    #[config(default = "None")]
    pub epsilon1: Option<f64>,
    /// `ε₂`: the floor of the parameter's RMS in the step size.
    #[config(default = 1e-3)]
    pub epsilon2: f64,
    /// `d`: the update's RMS clipping threshold.
    #[config(default = 1.0)]
    pub clip_threshold: f64,
    /// Decoupled weight decay `λ` (scaled by the learning rate).
    #[config(default = 0.0)]
    pub weight_decay: f64,
}

impl AdafactorConfig {
    /// The optimizer for `M` (Burn's adaptor: use it as any Burn optimizer).
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
    ) -> OptimizerAdaptor<Adafactor, M, B> {
        OptimizerAdaptor::from(self.build())
    }

    /// The per-tensor step itself (Burn's `SimpleOptimizer`), without the module adaptor.
    pub fn build(&self) -> Adafactor {
        Adafactor {
            beta2_decay: self.beta2_decay,
            epsilon1: self.epsilon1,
            epsilon2: self.epsilon2,
            clip_threshold: self.clip_threshold,
            weight_decay: self.weight_decay,
        }
    }
}

/// The Adafactor step ([`AdafactorConfig`] builds it).
#[derive(Clone, Debug)]
pub struct Adafactor {
    beta2_decay: f64,
    epsilon1: Option<f64>,
    epsilon2: f64,
    clip_threshold: f64,
    weight_decay: f64,
}

/// One parameter's Adafactor state.
#[derive(Record, Clone)]
pub struct AdafactorState<B: Backend, const D: usize> {
    /// Steps taken.
    pub time: usize,
    /// A matrix's row statistic (`[.., n, 1]`), or a vector's whole second moment.
    pub row: Tensor<B, D>,
    /// A matrix's column statistic (`[.., 1, m]`); `None` for a vector.
    pub col: Option<Tensor<B, D>>,
}

/// `RMS(x)` as a one-element tensor shaped `[1; D]` (sum over the global element count: a
/// padded shard's zeros do not count).
fn rms<B: Backend, const D: usize>(x: &Tensor<B, D>) -> Tensor<B, D> {
    let n = x.shape().num_elements() as f64;
    x.clone()
        .square()
        .sum()
        .div_scalar(n)
        .sqrt()
        .reshape([1; D])
}

/// The mean of `x` over `dim` (kept, size 1), as a sum over the global size.
fn mean_dim<B: Backend, const D: usize>(x: Tensor<B, D>, dim: usize) -> Tensor<B, D> {
    let n = x.dims()[dim] as f64;
    x.sum_dim(dim).div_scalar(n)
}

/// `β · old + (1 − β) · new` (just `(1 − β) · new` on the first step, where `β` is 0). `new` is
/// a mean of squares, so `clamp_min(0)` leaves it as it is; on `Distributed` it is a non-linear
/// op, which reduces a partial sum (the column statistic of row-sharded rows) into a plain value
/// once, here — not at each use, and never stored partial.
fn running<B: Backend, const D: usize>(
    old: Option<Tensor<B, D>>,
    new: Tensor<B, D>,
    beta: f64,
) -> Tensor<B, D> {
    let new = new.clamp_min(0.0).mul_scalar(1.0 - beta);
    match old {
        Some(old) => old.mul_scalar(beta).add(new),
        None => new,
    }
}

impl<B: Backend> SimpleOptimizer<B> for Adafactor {
    type State<const D: usize> = AdafactorState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let time = state.as_ref().map_or(0, |s| s.time) + 1;
        let t = time as f64;
        let beta2 = 1.0 - t.powf(self.beta2_decay);
        let rho = lr.min(1.0 / t.sqrt());
        let eps1 = self
            .epsilon1
            .unwrap_or_else(|| machine_epsilon(grad.dtype()));
        let alpha = rms(&tensor).clamp_min(self.epsilon2).mul_scalar(rho);
        let tensor = if self.weight_decay > 0.0 {
            tensor.mul_scalar(1.0 - lr * self.weight_decay)
        } else {
            tensor
        };
        let g2 = grad.clone().square();
        let (row_old, col_old) = match state {
            Some(s) => (Some(s.row), s.col),
            None => (None, None),
        };
        let (variance, row, col) = if D >= 2 {
            let row = running(row_old, mean_dim(g2.clone(), D - 1), beta2);
            let col = running(col_old, mean_dim(g2, D - 2), beta2);
            let variance = row
                .clone()
                .mul(col.clone())
                .div(mean_dim(row.clone(), D - 2));
            (variance, row, Some(col))
        } else {
            let second = running(row_old, g2, beta2);
            (second.clone(), second, None)
        };
        let update = grad.mul(variance.clamp_min(eps1 * eps1).sqrt().recip());
        let denom = rms(&update).div_scalar(self.clip_threshold).clamp_min(1.0);
        let tensor = tensor.sub(update.mul(alpha.div(denom)));
        (tensor, Some(AdafactorState { time, row, col }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        AdafactorState {
            time: state.time,
            row: state.row.to_device(device),
            col: state.col.map(|c| c.to_device(device)),
        }
    }
}

/// The machine epsilon of a float dtype (PyTorch's `torch.finfo(dtype).eps`).
fn machine_epsilon(dtype: burn::tensor::DType) -> f64 {
    use burn::tensor::DType;
    match dtype {
        DType::F64 => f64::EPSILON,
        DType::F16 => 9.765625e-4,
        DType::BF16 => 7.8125e-3,
        _ => f32::EPSILON as f64,
    }
}

fn float<B: Backend, const D: usize>(t: Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
    t.into_primitive().tensor()
}

impl<B: Backend> StateCodec<B> for Adafactor {
    fn state_specs(shape: &[usize]) -> Vec<StateSpec> {
        let d = shape.len();
        if d >= 2 {
            vec![
                StateSpec::new("row", StateShape::Reduced(vec![d - 1])),
                StateSpec::new("col", StateShape::Reduced(vec![d - 2])),
            ]
        } else {
            vec![StateSpec::new("second", StateShape::Param)]
        }
    }

    fn encode<const D: usize>(state: Self::State<D>) -> Result<EncodedState<B>, String> {
        let mut tensors = vec![float(state.row)];
        tensors.extend(state.col.map(float));
        Ok(EncodedState::all(state.time, tensors))
    }

    fn decode<const D: usize>(state: EncodedState<B>) -> Result<Self::State<D>, String> {
        let names: &[&str] = if D >= 2 { &["row", "col"] } else { &["second"] };
        let time = state.steps;
        let mut tensors = state
            .require(&format!("Adafactor (a rank-{D} parameter)"), names)?
            .into_iter()
            .map(|t| Tensor::<B, D>::from_primitive(TensorPrimitive::Float(t)));
        Ok(AdafactorState {
            time,
            row: tensors.next().expect("counted"),
            col: tensors.next(),
        })
    }
}
