//! Stock burn-nn models and a synthetic classification task, shared by the `backend_swap`
//! example, the tests and the benchmarks. Nothing here knows about distribution: that is the
//! point — the same code runs on `Autodiff<Flex>` and `Autodiff<Distributed<Flex>>`.

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use std::ops::Range;
use wildfire_parallel::rng::XorShift64;

/// A stock burn-nn transformer encoder classifier: project, encode, mean-pool, classify.
#[derive(Module, Debug)]
pub struct EncoderClassifier<B: Backend> {
    input: Linear<B>,
    encoder: TransformerEncoder<B>,
    head: Linear<B>,
}

/// Sizes of [`EncoderClassifier`].
#[derive(Config, Debug)]
pub struct EncoderClassifierConfig {
    /// Features per sequence position.
    #[config(default = 4)]
    pub d_input: usize,
    /// Model width.
    #[config(default = 16)]
    pub d_model: usize,
    /// Attention heads.
    #[config(default = 2)]
    pub n_heads: usize,
    /// Encoder layers.
    #[config(default = 2)]
    pub n_layers: usize,
    /// Feed-forward width.
    #[config(default = 32)]
    pub d_ff: usize,
    /// Output classes.
    #[config(default = 3)]
    pub n_classes: usize,
}

impl EncoderClassifierConfig {
    /// Build the model (dropout off, so runs are deterministic).
    pub fn init<B: Backend>(&self, device: &B::Device) -> EncoderClassifier<B> {
        EncoderClassifier {
            input: LinearConfig::new(self.d_input, self.d_model).init(device),
            encoder: TransformerEncoderConfig::new(
                self.d_model,
                self.d_ff,
                self.n_heads,
                self.n_layers,
            )
            .with_dropout(0.0)
            .with_norm_first(true)
            .init(device),
            head: LinearConfig::new(self.d_model, self.n_classes).init(device),
        }
    }
}

/// A classifier over a batch of sequences `[batch, seq, d_input]`.
pub trait Classifier<B: Backend>: Module<B> {
    /// Logits `[batch, classes]`.
    fn logits(&self, x: Tensor<B, 3>) -> Tensor<B, 2>;
}

impl<B: Backend> Classifier<B> for EncoderClassifier<B> {
    fn logits(&self, x: Tensor<B, 3>) -> Tensor<B, 2> {
        let [batch, _, _] = x.dims();
        let h = self
            .encoder
            .forward(TransformerEncoderInput::new(self.input.forward(x)));
        let d_model = h.dims()[2];
        self.head.forward(h.mean_dim(1).reshape([batch, d_model]))
    }
}

/// A stock burn-nn MLP classifier on the mean of the sequence.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    fc1: Linear<B>,
    act: Relu,
    fc2: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// `d_input -> hidden -> classes`.
    pub fn new(d_input: usize, hidden: usize, classes: usize, device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(d_input, hidden).init(device),
            act: Relu::new(),
            fc2: LinearConfig::new(hidden, classes).init(device),
        }
    }
}

impl<B: Backend> Classifier<B> for Mlp<B> {
    fn logits(&self, x: Tensor<B, 3>) -> Tensor<B, 2> {
        let [batch, _, d] = x.dims();
        let x = x.mean_dim(1).reshape([batch, d]);
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

struct DeterministicInit {
    seed: u64,
}

impl<B: Backend> ModuleMapper<B> for DeterministicInit {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let fan_in = if D > 1 { shape[0] } else { shape[0].max(1) };
        let scale = 1.0 / (fan_in as f32).sqrt();
        self.seed += 1;
        // Reproducible values with no dependency on a backend's RNG (ranks as threads share one
        // process-wide RNG, so backend random init is not reproducible across meshes).
        let mut rng = XorShift64::new(self.seed, 0x9E37_79B9_7F4A_7C15);
        let values: Vec<f32> = (0..shape.num_elements())
            .map(|_| rng.next_signed_f32() * scale)
            .collect();
        let fresh = Tensor::<B, D>::from_data(TensorData::new(values, shape), &tensor.device());
        let fresh = if tensor.is_require_grad() {
            fresh.require_grad()
        } else {
            fresh
        };
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Overwrite every parameter with reproducible values (same on every backend and rank).
pub fn deterministic_init<B: Backend, M: Module<B>>(module: M, seed: u64) -> M {
    module.map(&mut DeterministicInit { seed })
}

/// Classify sequences by which of `classes` fixed directions their mean points to most.
#[derive(Clone, Debug)]
pub struct SyntheticTask {
    /// Sequence length.
    pub seq: usize,
    /// Features per position.
    pub d_input: usize,
    /// Number of classes.
    pub classes: usize,
    /// Seed.
    pub seed: u64,
}

impl SyntheticTask {
    /// Rows `rows` of step `step`'s global batch: inputs `[rows, seq, d_input]` and labels.
    /// The global batch of a step is the same whatever slice of it a rank asks for.
    pub fn batch(&self, step: usize, rows: Range<usize>) -> (TensorData, Vec<i64>) {
        let mut x = Vec::with_capacity(rows.len() * self.seq * self.d_input);
        let mut y = Vec::with_capacity(rows.len());
        for row in rows.clone() {
            let mut rng = XorShift64::new(
                self.seed ^ ((step as u64) << 32) ^ row as u64,
                0x2545_F491_4F6C_DD1D,
            );
            let mut mean = vec![0.0f32; self.d_input];
            for _ in 0..self.seq {
                for m in mean.iter_mut() {
                    let v = rng.next_signed_f32();
                    x.push(v);
                    *m += v;
                }
            }
            // Class c's direction: +1 on feature c mod d, -1 on the next one.
            let score = |c: usize| mean[c % self.d_input] - mean[(c + 1) % self.d_input];
            let label = (0..self.classes)
                .max_by(|a, b| score(*a).total_cmp(&score(*b)))
                .unwrap_or(0);
            y.push(label as i64);
        }
        (TensorData::new(x, [rows.len(), self.seq, self.d_input]), y)
    }
}

/// One training run's record.
#[derive(Clone, Debug, Default)]
pub struct TrainLog {
    /// Loss of each step (on this rank's slice of the batch).
    pub losses: Vec<f32>,
}

/// Train `model` for `steps` steps of SGD on `task`, each step on rows `rows` of the global batch.
/// `after_backward` runs between `GradientsParams::from_grads` and the optimizer step (the
/// distributed run passes `sync_gradients` there; the plain run passes nothing).
#[allow(clippy::too_many_arguments)]
pub fn train<B, M, O>(
    mut model: M,
    optim: &mut O,
    task: &SyntheticTask,
    steps: usize,
    lr: f64,
    rows: Range<usize>,
    device: &B::Device,
    mut after_backward: impl FnMut(&M, &mut GradientsParams),
) -> (M, TrainLog)
where
    B: AutodiffBackend,
    M: Classifier<B> + burn::module::AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let mut log = TrainLog::default();
    for step in 0..steps {
        let (x, y) = task.batch(step, rows.clone());
        let x = Tensor::<B, 3>::from_data(x, device);
        let y = Tensor::<B, 1, Int>::from_data(TensorData::new(y, [rows.len()]), device);
        let loss = loss_fn.forward(model.logits(x), y);
        log.losses.push(loss.clone().into_scalar().elem::<f32>());
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        after_backward(&model, &mut grads);
        model = optim.step(lr, model, grads);
    }
    (model, log)
}

/// Every parameter's values, in visiting order.
pub fn parameters<B: Backend, M: Module<B>>(model: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0
                .push(param.val().into_data().convert::<f32>().to_vec().unwrap());
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}
