//! A mixture-of-experts MLP (Switch Transformer, GShard, Mixtral, DeepSeek-MoE): a router scores
//! each token against `E` experts (softmax or sigmoid), the token goes to its `k` best, and
//! their outputs come back summed with the gates; shared experts (DeepSeek-MoE) see every token.
//! The experts are the Llama family's SwiGLU MLP.
//!
//! - **Gates**: the top-k scores; renormalised to sum to 1 per token when `normalize` (Mixtral's
//!   top-k softmax, DeepSeek-V3's sigmoid), as they are otherwise (Switch, GShard's top-2
//!   without).
//! - **Capacity** (GShard): with a capacity factor `c`, expert `e` takes at most
//!   `⌈c · n · k / E⌉` of a batch's `n` tokens, filled first choices first (every token's first
//!   expert, then every token's second, …), tokens in order within a choice; an assignment past
//!   the capacity is dropped (that expert contributes nothing to the token; the residual
//!   stream carries it). Without one, dropless: every assignment is kept.
//! - **Losses**: Switch's load-balancing loss `E · Σₑ fₑ · Pₑ` (`fₑ`: the fraction of the
//!   `n·k` assignments routed to `e` before capacity, `Pₑ`: the mean router score of `e`; 1 when
//!   perfectly balanced) and ST-MoE's router z-loss `mean(logsumexp(logits)²)`, each with its
//!   coefficient; the block returns them for the model's loss.
//!
//! Routing is decided on the host (the assignment counts set the expert batches' shapes, as in
//! dropless MoE implementations). The experts' weights are stacked (`[E, d, ffn]`, dim 0 the
//! expert): a rank's kept assignments, sorted by expert, are dispatched
//! ([`wildfire_kernels::experts`]), the experts run as three grouped matmuls — each expert on
//! exactly its rows, no padding — and the rows come back ([`ops::expert_combine`]) to be gated
//! and added in place (`select_assign`).
//! Under expert parallelism (a `Distributed` backend whose mesh has an `ep` axis) the stacked
//! weights are split over that axis and dispatch and combine are all-to-alls: each member runs
//! its own experts on every member's rows for them.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::IndexingUpdateOp;
use burn::tensor::activation;
use serde::{Deserialize, Serialize};
use wildfire_kernels::experts::ExpertRoute;
use wildfire_kernels::{FusedOps, ops};

use crate::Error;
use crate::lm::dense;
use crate::swiglu::SwiGlu;

/// How the router turns logits into scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RouterScore {
    /// Softmax over the experts (Switch, GShard, Mixtral).
    #[default]
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

/// Over which tokens the load-balancing loss counts each expert's share `fₑ`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BalanceScope {
    /// The rank's micro-batch (Switch, GShard, Megatron-Core's `aux_loss`).
    #[default]
    MicroBatch,
    /// The micro-batch of every data-parallel rank together (Megatron-Core's
    /// `global_aux_loss`): the counts summed over the data ranks before `fₑ` is taken; the mean
    /// scores `Pₑ` stay the rank's (the gradient flows through them). Looser on a rank, as the
    /// experts need balance over the global batch only.
    Global,
}

/// The shape and rules of a mixture-of-experts MLP.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Routed experts `E`.
    pub experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// Softmax or sigmoid scores.
    pub score: RouterScore,
    /// Renormalise each token's `k` gates to sum to 1.
    pub normalize: bool,
    /// The load-balancing loss's coefficient (Switch: 0.01).
    pub aux_loss_coef: f64,
    /// The router z-loss's coefficient (ST-MoE: 0.001).
    pub z_loss_coef: f64,
    /// GShard's capacity factor; `None`: dropless.
    pub capacity_factor: Option<f64>,
    /// Shared experts, applied to every token (DeepSeek-MoE); 0 for none.
    pub shared_experts: usize,
    /// Over which tokens the load-balancing loss counts the experts' shares.
    #[serde(default)]
    pub balance: BalanceScope,
}

impl Default for MoeConfig {
    /// 8 experts, top-2 softmax renormalised (Mixtral), Switch's and ST-MoE's coefficients,
    /// dropless, no shared expert.
    fn default() -> Self {
        Self {
            experts: 8,
            top_k: 2,
            score: RouterScore::Softmax,
            normalize: true,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.001,
            capacity_factor: None,
            shared_experts: 0,
            balance: BalanceScope::MicroBatch,
        }
    }
}

impl MoeConfig {
    /// Refuse what cannot route: no experts, `k` of 0 or more than `E`, a capacity factor that
    /// is not a positive number, negative coefficients.
    pub fn check(&self) -> Result<(), Error> {
        let bad = |reason: String| Err(Error::Config(format!("mixture of experts: {reason}")));
        if self.experts == 0 {
            return bad("0 experts: choose 1 or more".into());
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return bad(format!(
                "top-k {} over {} experts: choose k from 1 to {}",
                self.top_k, self.experts, self.experts
            ));
        }
        if let Some(c) = self.capacity_factor
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!(
                "capacity factor {c}: choose a positive number (or dropless)"
            ));
        }
        if !(self.aux_loss_coef >= 0.0 && self.z_loss_coef >= 0.0) {
            return bad("the loss coefficients must be 0 or more".into());
        }
        Ok(())
    }

    /// Each expert's capacity for a batch of `n` tokens: `⌈c · n · k / E⌉`, or `n·k` (every
    /// assignment) when dropless.
    pub fn capacity(&self, n: usize) -> usize {
        capacity(self.capacity_factor, n, self.top_k, self.experts)
    }
}

/// Each of `experts` experts' capacity for `n` tokens routed to `k` each: `⌈c · n · k / E⌉` with
/// a capacity factor `c`, every assignment (`n·k`) without one.
fn capacity(factor: Option<f64>, n: usize, k: usize, experts: usize) -> usize {
    match factor {
        Some(c) => (c * (n * k) as f64 / experts as f64).ceil() as usize,
        None => n * k,
    }
}

/// One projection of every expert, stacked: `[E, rows, cols]`.
#[derive(Module, Debug)]
pub struct ExpertLinear<B: Backend> {
    /// `[E, rows, cols]`, dim 0 the expert.
    pub weight: Param<Tensor<B, 3>>,
}

/// `E` SwiGLU experts (the Llama family's MLP), their weights stacked so that they run as
/// grouped matmuls on the dispatched rows, each expert on exactly its rows (under expert
/// parallelism, a member's experts on the rows every member sent them).
#[derive(Module, Debug)]
pub struct Experts<B: Backend> {
    /// Gate projections `[E, d, ffn]`.
    pub gate_proj: ExpertLinear<B>,
    /// Up projections `[E, d, ffn]`.
    pub up_proj: ExpertLinear<B>,
    /// Down projections `[E, ffn, d]`.
    pub down_proj: ExpertLinear<B>,
}

impl<B: FusedOps> Experts<B> {
    /// Dispatched rows `[rows, d]` through their experts, `down(silu(gate(x)) ⊙ up(x))`: the
    /// first `groups[0]` rows through the first expert (of those the rank holds), the next
    /// `groups[1]` through the second, …
    pub fn forward(&self, x: Tensor<B, 2>, groups: &[usize]) -> Tensor<B, 2> {
        let gate = ops::grouped_matmul(x.clone(), self.gate_proj.weight.val(), groups);
        let up = ops::grouped_matmul(x, self.up_proj.weight.val(), groups);
        let h = if B::FUSED.swiglu {
            ops::swiglu(gate, up)
        } else {
            activation::silu(gate) * up
        };
        ops::grouped_matmul(h, self.down_proj.weight.val(), groups)
    }

    /// Expert `e` alone on rows `[n, d]` (the dense reference).
    fn forward_one(&self, e: usize, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let w = |p: &ExpertLinear<B>| {
            let [_, r, c] = p.weight.dims();
            p.weight.val().narrow(0, e, 1).reshape([r, c])
        };
        let h = activation::silu(x.clone().matmul(w(&self.gate_proj))) * x.matmul(w(&self.up_proj));
        h.matmul(w(&self.down_proj))
    }
}

/// A mixture-of-experts MLP: `[b, t, d] → [b, t, d]`.
#[derive(Module, Debug)]
pub struct MoeMlp<B: Backend> {
    /// The router `[d, E]`, without bias.
    pub router: Linear<B>,
    /// The routed experts.
    pub experts: Experts<B>,
    /// Routed experts `E`.
    pub num_experts: usize,
    /// The shared experts (every token).
    pub shared: Vec<SwiGlu<B>>,
    /// Experts per token.
    pub top_k: usize,
    /// Sigmoid scores (else softmax).
    pub sigmoid: bool,
    /// Renormalised gates.
    pub normalize: bool,
    /// Capacity factor; 0: dropless.
    pub capacity_factor: f64,
    /// Load-balancing loss coefficient.
    pub aux_loss_coef: f64,
    /// Router z-loss coefficient.
    pub z_loss_coef: f64,
    /// The load-balancing loss's shares over every data-parallel rank's tokens.
    pub global_balance: bool,
}

/// What routing did to one batch: the trainer's hooks' record
/// ([`Routing`](wildfire_kernels::hooks::Routing)).
pub use wildfire_kernels::hooks::Routing as RouterStats;

/// One batch's routing: per expert the rows it processes and which of each row's `k` choices
/// that is, and the statistics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Routing {
    /// Per expert: (token row, choice slot) in processing order.
    pub assignments: Vec<Vec<(usize, usize)>>,
    /// The counts.
    pub stats: RouterStats,
}

impl Routing {
    /// Route `n` tokens whose chosen experts are `chosen` (`[n, k]` row-major, best first) over
    /// `experts` experts with `capacity` each: choices in order (every token's first, then every
    /// token's second, …), tokens in order within a choice, past the capacity dropped.
    pub fn new(chosen: &[usize], n: usize, k: usize, experts: usize, capacity: usize) -> Self {
        let mut assignments = vec![Vec::new(); experts];
        let mut stats = RouterStats {
            routed: vec![0; experts],
            kept: vec![0; experts],
            dropped: 0,
        };
        for slot in 0..k {
            for row in 0..n {
                let e = chosen[row * k + slot];
                stats.routed[e] += 1;
                if assignments[e].len() < capacity {
                    assignments[e].push((row, slot));
                    stats.kept[e] += 1;
                } else {
                    stats.dropped += 1;
                }
            }
        }
        Self { assignments, stats }
    }
}

/// A forward's output and its routing losses (already times their coefficients).
#[derive(Debug, Clone)]
pub struct MoeOutput<B: Backend> {
    /// `[b, t, d]`.
    pub output: Tensor<B, 3>,
    /// `aux_loss_coef · E · Σₑ fₑ · Pₑ`, shape `[1]`.
    pub aux_loss: Tensor<B, 1>,
    /// `z_loss_coef · mean(logsumexp(logits)²)`, shape `[1]`.
    pub z_loss: Tensor<B, 1>,
    /// What routing did.
    pub stats: RouterStats,
}

/// The router's view of a batch: logits `[n, E]` (f32), scores, the top-k gates and choices.
struct Scores<B: Backend> {
    logits: Tensor<B, 2>,
    scores: Tensor<B, 2>,
    gates: Tensor<B, 2>,
    chosen: Vec<usize>,
}

impl<B: Backend> MoeMlp<B> {
    /// A block of `config` over width `d`, experts of hidden width `ffn`, weights drawn from
    /// `init` (`init(name, [rows, cols])`: the names `router` and `shared.{s}.{gate,up,down}_proj`)
    /// and the stacked expert weights from `stacked` (`stacked(name, [E, rows, cols])`:
    /// `experts.{gate,up,down}_proj`).
    pub fn new(
        config: &MoeConfig,
        d: usize,
        ffn: usize,
        mut init: impl FnMut(&str, [usize; 2]) -> Tensor<B, 2>,
        mut stacked: impl FnMut(&str, [usize; 3]) -> Tensor<B, 3>,
    ) -> Result<Self, Error> {
        config.check()?;
        let linear = |w: Tensor<B, 2>| Linear {
            weight: Param::from_tensor(w),
            bias: None,
        };
        let router = linear(init("router", [d, config.experts]));
        let e = config.experts;
        let mut expert = |name: &str, shape: [usize; 2]| ExpertLinear {
            weight: Param::from_tensor(stacked(
                &format!("experts.{name}"),
                [e, shape[0], shape[1]],
            )),
        };
        let experts = Experts {
            gate_proj: expert("gate_proj", [d, ffn]),
            up_proj: expert("up_proj", [d, ffn]),
            down_proj: expert("down_proj", [ffn, d]),
        };
        let mut mlp = |prefix: String| SwiGlu {
            gate_proj: linear(init(&format!("{prefix}.gate_proj"), [d, ffn])),
            up_proj: linear(init(&format!("{prefix}.up_proj"), [d, ffn])),
            down_proj: linear(init(&format!("{prefix}.down_proj"), [ffn, d])),
        };
        let shared = (0..config.shared_experts)
            .map(|s| mlp(format!("shared.{s}")))
            .collect();
        Ok(Self {
            router,
            experts,
            num_experts: e,
            shared,
            top_k: config.top_k,
            sigmoid: config.score == RouterScore::Sigmoid,
            normalize: config.normalize,
            capacity_factor: config.capacity_factor.unwrap_or(0.0),
            aux_loss_coef: config.aux_loss_coef,
            z_loss_coef: config.z_loss_coef,
            global_balance: config.balance == BalanceScope::Global,
        })
    }
}

impl<B: FusedOps> MoeMlp<B> {
    /// The router's scores of `n` flattened tokens `[n, d]` and where they go.
    fn route(&self, flat: Tensor<B, 2>) -> (Scores<B>, Routing) {
        let n = flat.dims()[0];
        let (k, e) = (self.top_k, self.num_experts);
        let factor = (self.capacity_factor > 0.0).then_some(self.capacity_factor);
        let s = self.scores(flat);
        let routing = Routing::new(&s.chosen, n, k, e, capacity(factor, n, k, e));
        (s, routing)
    }

    fn scores(&self, x: Tensor<B, 2>) -> Scores<B> {
        let logits = dense(&self.router, x).cast(burn::tensor::FloatDType::F32);
        let scores = if self.sigmoid {
            activation::sigmoid(logits.clone())
        } else {
            activation::softmax(logits.clone(), 1)
        };
        let (top, chosen) = scores.clone().topk_with_indices(self.top_k, 1);
        let gates = if self.normalize {
            top.clone() / top.sum_dim(1)
        } else {
            top
        };
        let chosen = chosen
            .into_data()
            .convert::<i64>()
            .into_vec::<i64>()
            .expect("int indices")
            .into_iter()
            .map(|e| e as usize)
            .collect();
        Scores {
            logits,
            scores,
            gates,
            chosen,
        }
    }

    /// The routing losses of a batch, times their coefficients.
    fn losses(&self, s: &Scores<B>, stats: &RouterStats, n: usize) -> [Tensor<B, 1>; 2] {
        let e = self.num_experts;
        let device = s.logits.device();
        // The assignments per expert and in all: the rank's, or every data rank's.
        let mut counts: Vec<usize> = stats.routed.iter().map(|&c| c as usize).collect();
        counts.push(n * self.top_k);
        if self.global_balance {
            counts = B::data_sum(&device, &counts);
        }
        let total = counts[e] as f32;
        let fraction: Vec<f32> = counts[..e].iter().map(|&c| c as f32 / total).collect();
        let f = Tensor::<B, 1>::from_data(TensorData::new(fraction, [e]), &device);
        let p = s.scores.clone().mean_dim(0).reshape([e]);
        let aux = (f * p).sum().mul_scalar(e as f64 * self.aux_loss_coef);
        let max = s.logits.clone().max_dim(1);
        let lse = (s.logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
        let z = lse.powi_scalar(2).mean().mul_scalar(self.z_loss_coef);
        [aux, z]
    }

    /// `[b, t, d] → [b, t, d]`, with the routing losses and statistics.
    pub fn forward(&self, x: Tensor<B, 3>) -> MoeOutput<B> {
        let [b, t, d] = x.dims();
        let n = b * t;
        let flat = x.reshape([n, d]);
        let device = flat.device();
        let (s, routing) = self.route(flat.clone());
        // The kept assignments sorted by expert (first choices first within an expert); at
        // least one, as every expert's capacity is.
        let order: Vec<(usize, usize)> = routing.assignments.iter().flatten().copied().collect();
        let m = order.len();
        let ids = |f: fn(&(usize, usize)) -> usize| {
            let v: Vec<i64> = order.iter().map(|a| f(a) as i64).collect();
            Tensor::<B, 1, Int>::from_data(TensorData::new(v, [m]), &device)
        };
        let (rows, slots) = (ids(|a| a.0), ids(|a| a.1));
        let counts: Vec<usize> = routing.assignments.iter().map(Vec::len).collect();
        let (index, members) = B::expert_axis(&device);
        let route = ExpertRoute::new(
            members,
            index,
            self.num_experts,
            B::expert_counts(&device, &counts),
        );
        let routed = ops::expert_dispatch(flat.clone().select(0, rows.clone()), &route);
        let y = ops::expert_combine(self.experts.forward(routed, &route.groups()), &route);
        let gate = s
            .gates
            .clone()
            .select(0, rows.clone())
            .gather(1, slots.reshape([m, 1]));
        let y = y.clone() * gate.cast(y.dtype());
        let out = self
            .shared_output(flat)
            .select_assign(0, rows, y, IndexingUpdateOp::Add);
        let [aux_loss, z_loss] = self.losses(&s, &routing.stats, n);
        MoeOutput {
            output: out.reshape([b, t, d]),
            aux_loss,
            z_loss,
            stats: routing.stats,
        }
    }

    /// The shared experts' sum on every token (zeros without any), `[n, d]`.
    fn shared_output(&self, flat: Tensor<B, 2>) -> Tensor<B, 2> {
        let [n, d] = flat.dims();
        self.shared
            .iter()
            .map(|mlp| mlp.forward(flat.clone().reshape([1, n, d])).reshape([n, d]))
            .reduce(|a, b| a + b)
            .unwrap_or_else(|| flat.zeros_like())
    }

    /// The same block written out densely: every expert on every token, weighted by the gate
    /// matrix `[n, E]` (each token's gates scattered to its chosen experts, 0 where it did not
    /// choose one or the assignment was dropped) — the reference the routed forward is checked
    /// against, gradients included.
    pub fn forward_dense(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let (n, k, e) = (b * t, self.top_k, self.num_experts);
        let flat = x.reshape([n, d]);
        let device = flat.device();
        let (s, routing) = self.route(flat.clone());
        let mut keep = vec![0f32; n * k];
        for assigned in &routing.assignments {
            for &(row, slot) in assigned {
                keep[row * k + slot] = 1.0;
            }
        }
        let keep = Tensor::<B, 2>::from_data(TensorData::new(keep, [n, k]), &device);
        let chosen: Vec<i64> = s.chosen.iter().map(|&c| c as i64).collect();
        let chosen = Tensor::<B, 2, Int>::from_data(TensorData::new(chosen, [n, k]), &device);
        let matrix = Tensor::<B, 2>::zeros([n, e], &device).scatter(
            1,
            chosen,
            s.gates.clone() * keep,
            IndexingUpdateOp::Add,
        );
        let mut out = self.shared_output(flat.clone());
        for i in 0..e {
            let y = self.experts.forward_one(i, flat.clone());
            let g = matrix.clone().narrow(1, i, 1);
            out = out + y.clone() * g.cast(y.dtype());
        }
        out.reshape([b, t, d])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};

    type A = Autodiff<Flex>;

    /// Values in [-scale, scale) from a seed (an LCG: the same every run).
    fn values(seed: u64, len: usize, scale: f32) -> Vec<f32> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    fn block(config: &MoeConfig, d: usize, ffn: usize) -> MoeMlp<A> {
        let device = Default::default();
        let seed = std::cell::Cell::new(0);
        let next = || {
            seed.set(seed.get() + 1);
            seed.get()
        };
        MoeMlp::new(
            config,
            d,
            ffn,
            |_, [r, c]| {
                let data = TensorData::new(values(next(), r * c, 0.5), [r, c]);
                Tensor::from_data(data, &device)
            },
            |_, [e, r, c]| {
                let data = TensorData::new(values(next(), e * r * c, 0.5), [e, r, c]);
                Tensor::from_data(data, &device)
            },
        )
        .unwrap()
    }

    fn max_diff(a: Tensor<Flex, 2>, b: Tensor<Flex, 2>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    /// First choices fill the experts before second ones, tokens in order; past the capacity an
    /// assignment is dropped and counted.
    #[test]
    fn routing_fills_first_choices_first_and_drops_past_capacity() {
        // 3 tokens, k 2, over 2 experts: choices (0, 1), (0, 1), (1, 0); capacity 2.
        let r = Routing::new(&[0, 1, 0, 1, 1, 0], 3, 2, 2, 2);
        assert_eq!(r.assignments[0], vec![(0, 0), (1, 0)]);
        assert_eq!(r.assignments[1], vec![(2, 0), (0, 1)]);
        assert_eq!(r.stats.routed, vec![3, 3]);
        assert_eq!(r.stats.kept, vec![2, 2]);
        assert_eq!(r.stats.dropped, 2);
        let dropless = Routing::new(&[0, 1, 0, 1, 1, 0], 3, 2, 2, 6);
        assert_eq!(dropless.stats.dropped, 0);
    }

    /// The routed block (each expert on its gathered tokens, added back in place) equals the
    /// dense one (every expert on every token, weighted by the gate matrix) — outputs, and the
    /// gradients of the input, the router and every expert — for top-1 and top-2, softmax and
    /// sigmoid scores, renormalised or not, dropless and with capacity (tokens dropped), with a
    /// shared expert.
    #[test]
    fn routed_equals_dense_forward_and_backward() {
        let (b, t, d, ffn) = (2, 8, 16, 24);
        let configs = [
            MoeConfig {
                experts: 4,
                top_k: 1,
                normalize: false,
                ..MoeConfig::default()
            },
            MoeConfig {
                experts: 4,
                top_k: 2,
                ..MoeConfig::default()
            },
            MoeConfig {
                experts: 4,
                top_k: 2,
                score: RouterScore::Sigmoid,
                capacity_factor: Some(1.0),
                ..MoeConfig::default()
            },
            MoeConfig {
                experts: 4,
                top_k: 2,
                capacity_factor: Some(0.5),
                shared_experts: 1,
                ..MoeConfig::default()
            },
        ];
        let device = Default::default();
        for config in configs {
            let m = block(&config, d, ffn);
            let x = Tensor::<A, 3>::from_data(
                TensorData::new(values(99, b * t * d, 1.0), [b, t, d]),
                &device,
            )
            .require_grad();
            let w = Tensor::<A, 3>::from_data(
                TensorData::new(values(7, b * t * d, 1.0), [b, t, d]),
                &device,
            );
            let routed = m.forward(x.clone());
            let dense = m.forward_dense(x.clone());
            let what = format!("{config:?}");
            let flat = |y: Tensor<A, 3>| y.inner().reshape([b * t, d]);
            let diff = max_diff(flat(routed.output.clone()), flat(dense.clone()));
            assert!(diff < 1e-5, "{what}: outputs differ by {diff}");
            if config.capacity_factor == Some(0.5) {
                assert!(routed.stats.dropped > 0, "{what}: nothing dropped");
            }
            let g1 = (routed.output * w.clone()).sum().backward();
            let g2 = (dense * w).sum().backward();
            let grad = |g: &<A as burn::tensor::backend::AutodiffBackend>::Gradients,
                        p: &Tensor<A, 2>| p.grad(g).unwrap();
            let mut params = vec![("router", m.router.weight.val())];
            for e in &m.shared {
                params.push(("gate_proj", e.gate_proj.weight.val()));
                params.push(("up_proj", e.up_proj.weight.val()));
                params.push(("down_proj", e.down_proj.weight.val()));
            }
            for (name, p) in params {
                let diff = max_diff(grad(&g1, &p), grad(&g2, &p));
                assert!(diff < 1e-5, "{what}: {name} gradients differ by {diff}");
            }
            let experts = &m.experts;
            for (name, p) in [
                ("experts.gate_proj", &experts.gate_proj),
                ("experts.up_proj", &experts.up_proj),
                ("experts.down_proj", &experts.down_proj),
            ] {
                let [e, r, c] = p.weight.dims();
                let w = p.weight.val();
                let flat = |g| w.grad(g).unwrap().reshape([e * r, c]);
                let diff = max_diff(flat(&g1), flat(&g2));
                assert!(diff < 1e-5, "{what}: {name} gradients differ by {diff}");
            }
            let dx = |g| flat(Tensor::from_inner(x.grad(g).unwrap()));
            let diff = max_diff(dx(&g1), dx(&g2));
            assert!(diff < 1e-5, "{what}: input gradients differ by {diff}");
        }
    }

    /// The load-balancing loss is `coef · E · Σₑ fₑ·Pₑ` and the z-loss `coef · mean(lse²)`, from
    /// the router's logits computed on the host.
    #[test]
    fn routing_losses_follow_their_formulas() {
        let (n, d) = (6, 8);
        let config = MoeConfig {
            experts: 3,
            top_k: 2,
            aux_loss_coef: 0.5,
            z_loss_coef: 0.25,
            ..MoeConfig::default()
        };
        let m = block(&config, d, 4);
        let device = Default::default();
        let xs = values(3, n * d, 1.0);
        let x = Tensor::<A, 3>::from_data(TensorData::new(xs.clone(), [1, n, d]), &device);
        let out = m.forward(x);
        let w = m.router.weight.val().into_data().into_vec::<f32>().unwrap();
        let (mut p, mut routed, mut z) = (vec![0f64; 3], vec![0u64; 3], 0f64);
        for row in 0..n {
            let logits: Vec<f64> = (0..3)
                .map(|e| {
                    (0..d)
                        .map(|i| (xs[row * d + i] * w[i * 3 + e]) as f64)
                        .sum()
                })
                .collect();
            let max = logits.iter().cloned().fold(f64::MIN, f64::max);
            let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            let probs: Vec<f64> = logits.iter().map(|l| (l - max).exp() / sum).collect();
            let mut order = [0, 1, 2];
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
            for &e in &order[..2] {
                routed[e] += 1;
            }
            for e in 0..3 {
                p[e] += probs[e] / n as f64;
            }
            z += (max + sum.ln()).powi(2) / n as f64;
        }
        assert_eq!(out.stats.routed, routed);
        let aux: f64 = (0..3)
            .map(|e| routed[e] as f64 / (2 * n) as f64 * p[e])
            .sum::<f64>()
            * 3.0
            * 0.5;
        let got = |t: Tensor<A, 1>| f64::from(t.into_scalar());
        assert!((got(out.aux_loss) - aux).abs() < 1e-5, "aux loss");
        assert!((got(out.z_loss) - 0.25 * z).abs() < 1e-5, "z loss");
    }

    #[test]
    fn bad_configurations_are_refused() {
        let err = |c: MoeConfig| c.check().unwrap_err().to_string();
        let e = err(MoeConfig {
            experts: 4,
            top_k: 5,
            ..MoeConfig::default()
        });
        assert!(e.contains("choose k from 1 to 4"), "{e}");
        assert!(
            err(MoeConfig {
                experts: 0,
                ..MoeConfig::default()
            })
            .contains("0 experts")
        );
        assert!(
            err(MoeConfig {
                capacity_factor: Some(0.0),
                ..MoeConfig::default()
            })
            .contains("capacity factor")
        );
        assert_eq!(MoeConfig::default().capacity(10), 20);
        let c = MoeConfig {
            capacity_factor: Some(1.25),
            ..MoeConfig::default()
        };
        assert_eq!(c.capacity(10), 4); // ⌈1.25 · 10 · 2 / 8⌉ = ⌈3.125⌉
    }
}
