//! The mixture of experts' auxiliary losses reach backward as if they were added to the loss:
//! the trainer's hooks carry them on the block's output with the objective's weight
//! (`FusedOps::carry_loss`), recomputed blocks included.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use std::cell::RefCell;
use wildfire::engine::{Recompute, Recomputer};
use wildfire::kernels::hooks::{Auxiliary, ForwardHooks};
use wildfire::models::CausalLm;
use wildfire::models::llama::{Llama, LlamaConfig, LlamaMoe};
use wildfire::models::moe::MoeConfig;

type A = Autodiff<Flex>;

/// A Llama of 2 blocks, both mixtures of 4 experts (width 24, top-2), vocabulary 64, width 32.
fn tiny_moe() -> LlamaConfig {
    LlamaConfig {
        n_layer: 2,
        d_model: 32,
        ffn_hidden: 64,
        block_size: 16,
        init_seed: 3,
        moe: Some(LlamaMoe {
            config: MoeConfig {
                experts: 4,
                top_k: 2,
                // Large enough that the auxiliary terms move every gradient they reach.
                aux_loss_coef: 0.5,
                z_loss_coef: 0.1,
                ..MoeConfig::default()
            },
            every: 1,
            expert_hidden: 24,
        }),
        ..LlamaConfig::tiny(64)
    }
}

/// The reference: hooks that hand each block's auxiliary loss back, still in the graph, to be
/// added to the loss by hand.
#[derive(Default)]
struct Collect {
    aux: RefCell<Vec<Tensor<A, 1>>>,
}

impl<'a> ForwardHooks<'a, A> for Collect {
    fn auxiliary_loss(&self, _layer: usize, x: Tensor<A, 3>, aux: Auxiliary<A>) -> Tensor<A, 3> {
        self.aux.borrow_mut().push(aux.loss);
        x
    }
}

/// Every parameter's gradient, in visiting order (empty where none reached it).
struct Grads<'g> {
    grads: &'g <A as burn::tensor::backend::AutodiffBackend>::Gradients,
    out: Vec<Vec<f32>>,
}

impl ModuleVisitor<A> for Grads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
        let g = param.val().grad(self.grads);
        self.out.push(g.map_or(Vec::new(), |g| {
            g.into_data().convert::<f32>().to_vec().unwrap()
        }));
    }
}

fn grads_of(
    model: &Llama<A>,
    grads: &<A as burn::tensor::backend::AutodiffBackend>::Gradients,
) -> Vec<Vec<f32>> {
    let mut v = Grads {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut v);
    v.out
}

fn close(what: &str, got: &[Vec<f32>], expected: &[Vec<f32>]) {
    assert_eq!(got.len(), expected.len(), "{what}");
    for (i, (a, b)) in crate::suite::pairs(got, expected).enumerate() {
        assert_eq!(a.len(), b.len(), "{what}: parameter {i}");
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        for (x, y) in crate::suite::pairs(a, b) {
            assert!(
                (x - y).abs() <= 1e-5 * scale,
                "{what}: parameter {i}: {x} vs {y} (scale {scale})"
            );
        }
    }
}

/// Through the training hooks (no recomputation, and full recomputation whose replayed blocks
/// carry the losses again), backward from `w · loss` gives the gradients of `w · (loss + Σ aux)`
/// written out by hand, for `w` 1 and 4 (a loss scale over micro-batches); the router's gradient
/// is not the one of the loss alone; the hooks record each block's loss and routing once.
#[test]
fn auxiliary_losses_reach_backward_weighted_as_the_loss() {
    let device = Default::default();
    let config = tiny_moe();
    let model: Llama<A> = config.init(&device).unwrap();
    let (b, t) = (2, 16);
    let tokens = |shift: usize| {
        let ids: Vec<i64> = (0..b * t).map(|i| ((i * 5 + shift) % 64) as i64).collect();
        Tensor::<A, 2, Int>::from_data(TensorData::new(ids, [b, t]), &device)
    };
    let (x, y) = (tokens(0), tokens(1));
    for w in [1.0, 4.0] {
        let hooks = Collect::default();
        let loss = model.loss_with(x.clone(), y.clone(), &hooks);
        let aux: Vec<_> = hooks.aux.take();
        assert_eq!(aux.len(), 2, "both blocks report an auxiliary loss");
        let aux_sum: f32 = aux.iter().map(|a| a.clone().into_scalar()).sum();
        let total = aux.into_iter().fold(loss, |l, a| l + a);
        let expected = grads_of(&model, &total.mul_scalar(w).backward());
        for policy in [Recompute::None, Recompute::Full] {
            let ckpt = Recomputer::<A>::new(policy, 1).with_objective_weight(w);
            let loss = model.loss_with(x.clone(), y.clone(), &ckpt);
            let grads = ckpt.backward(loss.mul_scalar(w), &model).unwrap();
            let got = grads_of(&model, &grads);
            close(&format!("{policy} weight {w}"), &got, &expected);
            let recorded = ckpt.auxiliary();
            assert_eq!(
                recorded.iter().map(|(layer, _)| *layer).collect::<Vec<_>>(),
                vec![0, 1]
            );
            let sum: f32 = recorded
                .iter()
                .map(|(_, a)| a.loss.clone().into_scalar())
                .sum();
            assert!(
                (sum - aux_sum).abs() <= 1e-6 * aux_sum,
                "{sum} vs {aux_sum}"
            );
            for (_, a) in &recorded {
                assert_eq!(a.routing.routed.iter().sum::<u64>(), (b * t * 2) as u64);
            }
        }
    }
    // The loss alone (evaluation's hooks drop the auxiliary terms) gives the router another
    // gradient.
    let plain = grads_of(&model, &model.loss(x.clone(), y.clone()).backward());
    let hooks = Collect::default();
    let loss = model.loss_with(x, y, &hooks);
    let total = hooks.aux.take().into_iter().fold(loss, |l, a| l + a);
    let with_aux = grads_of(&model, &total.backward());
    let differ = crate::suite::pairs(&plain, &with_aux)
        .filter(|(a, b)| crate::suite::pairs(a, b).any(|(x, y)| (x - y).abs() > 1e-6))
        .count();
    assert!(differ > 0, "the auxiliary terms change some gradient");
}

/// Values in [-scale, scale) from a seed (the same every run).
fn values(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    let mut rng = wildfire::parallel::rng::SplitMix64::new(seed);
    (0..len).map(|_| rng.next_signed_f32() * scale).collect()
}

/// A mixture-of-experts block whose weights come from fixed seeds, on any backend.
fn moe_block<B: wildfire::kernels::FusedOps>(
    config: &MoeConfig,
    d: usize,
    ffn: usize,
    device: &B::Device,
) -> wildfire::models::moe::MoeMlp<B> {
    let seed = std::cell::Cell::new(0u64);
    let next = || {
        seed.set(seed.get() + 1);
        seed.get()
    };
    wildfire::models::moe::MoeMlp::new(
        config,
        d,
        ffn,
        |_, [r, c]| Tensor::from_data(TensorData::new(values(next(), r * c, 0.5), [r, c]), device),
        |_, [e, r, c]| {
            Tensor::from_data(
                TensorData::new(values(next(), e * r * c, 0.5), [e, r, c]),
                device,
            )
        },
    )
    .unwrap()
}

/// What one rank's forward and backward of a block gave: its output rows, its input's
/// gradient, every parameter's gradient (global, in visiting order) and its routed counts.
struct BlockRun {
    output: Vec<f32>,
    input_grad: Vec<f32>,
    param_grads: Vec<Vec<f32>>,
    kept: Vec<u64>,
}

/// The block's loss on rank `rank`'s rows: `Σ output ⊙ w + aux + z`.
fn block_loss<B: wildfire::kernels::FusedOps>(
    block: &wildfire::models::moe::MoeMlp<B>,
    rank: usize,
    rows: usize,
    d: usize,
    device: &B::Device,
) -> (Tensor<B, 3>, Tensor<B, 1>, Tensor<B, 3>, Vec<u64>) {
    let x = Tensor::<B, 3>::from_data(
        TensorData::new(values(100 + rank as u64, rows * d, 1.0), [1, rows, d]),
        device,
    )
    .require_grad();
    let w = Tensor::<B, 3>::from_data(
        TensorData::new(values(200 + rank as u64, rows * d, 1.0), [1, rows, d]),
        device,
    );
    let out = block.forward(x.clone());
    let loss = (out.output.clone() * w).sum() + out.aux_loss + out.z_loss;
    (x, loss, out.output, out.stats.kept)
}

/// Under expert parallelism (ep 2 and 4, the 8 experts' stacked weights split over the expert
/// axis, the rows exchanged by all-to-alls) each rank's block output and input gradient are
/// those of the same block on one device on that rank's rows, and every parameter's gradient
/// — the experts' included, born split over the axis — is the mean of the ranks' one-device
/// gradients (within 1e-5), dropless and with a capacity (tokens dropped), with a shared
/// expert, and with one token per rank (a member receiving no row: an empty grouped matmul).
/// The all-to-alls move exactly the routed rows: per rank, two calls forward (dispatch,
/// combine) and two backward, `2·(sent + received)·d·4` bytes.
#[test]
fn expert_parallel_block_matches_one_device_and_moves_the_routed_rows() {
    use wildfire::parallel::CollectiveKind::AllToAll;
    use wildfire::parallel::{
        DeviceMesh, ExpertPlan, Layout, create_replicated, dtensor, expert_parallel, sync_gradients,
    };
    type D = wildfire::parallel::Distributed<Flex>;
    type Dist = Autodiff<D>;
    let (d, ffn) = (16, 24);
    // (ep, capacity factor, rows per rank, k): the last with one token per rank, top-1, so that
    // some member receives no row at all (an empty grouped matmul).
    let cases = [
        (2, None, 12, 2),
        (4, None, 12, 2),
        (2, Some(1.0), 12, 2),
        (4, None, 1, 1),
    ];
    for (ep, capacity, rows, top_k) in cases {
        let config = MoeConfig {
            experts: 8,
            top_k,
            capacity_factor: capacity,
            shared_experts: 1,
            ..MoeConfig::default()
        };
        let what = format!("ep {ep}, capacity {capacity:?}, {rows} rows, top-{top_k}");
        // The reference: each rank's rows through the block on one device.
        let reference: Vec<BlockRun> = (0..ep)
            .map(|rank| {
                let device = Default::default();
                let block = moe_block::<A>(&config, d, ffn, &device);
                let (x, loss, output, kept) = block_loss(&block, rank, rows, d, &device);
                let grads = loss.backward();
                let mut params = Grads {
                    grads: &grads,
                    out: Vec::new(),
                };
                block.visit(&mut params);
                BlockRun {
                    output: output.into_data().into_vec().unwrap(),
                    input_grad: x.grad(&grads).unwrap().into_data().into_vec().unwrap(),
                    param_grads: params.out,
                    kept,
                }
            })
            .collect();
        let mesh = DeviceMesh::new([("ep", ep), ("tp", 1)]).unwrap();
        let plan = ExpertPlan::new().with("experts.gate_proj|up_proj|down_proj");
        let runs = crate::suite::threads(&mesh, |device| {
            let block = create_replicated(|| moe_block::<Dist>(&config, d, ffn, &device));
            let block = expert_parallel(block, device.mesh(), &plan).unwrap();
            let before = device.context().comm_stats();
            let (x, loss, output, kept) = block_loss(&block, device.rank(), rows, d, &device);
            let grads = loss.backward();
            let input_grad = x.grad(&grads).unwrap().into_data().into_vec().unwrap();
            let mut grads = burn::optim::GradientsParams::from_grads(grads, &block);
            sync_gradients(&block, &mut grads).unwrap();
            // Every gradient gathered whole.
            struct Gather<'g>(&'g burn::optim::GradientsParams, Vec<Vec<f32>>);
            impl burn::module::ModuleVisitor<Dist> for Gather<'_> {
                fn visit_float<const K: usize>(&mut self, param: &Param<Tensor<Dist, K>>) {
                    let g = self.0.get::<D, K>(param.id).unwrap();
                    let t = dtensor(&g);
                    let whole = Layout::replicated(t.device().mesh());
                    let whole = t.redistribute(&whole).unwrap();
                    let local = Tensor::<Flex, K>::from_primitive(
                        burn::tensor::TensorPrimitive::Float(whole.into_local()),
                    );
                    self.1.push(local.into_data().into_vec().unwrap());
                }
            }
            let mut gather = Gather(&grads, Vec::new());
            block.visit(&mut gather);
            let moved = device.context().comm_stats();
            let all_to_all = (
                moved.count(AllToAll) - before.count(AllToAll),
                moved.bytes(AllToAll) - before.bytes(AllToAll),
            );
            (
                BlockRun {
                    output: output.into_data().into_vec().unwrap(),
                    input_grad,
                    param_grads: gather.1,
                    kept,
                },
                all_to_all,
            )
        });
        if capacity.is_some() {
            let dropped: u64 = reference
                .iter()
                .map(|r| (rows * top_k) as u64 - r.kept.iter().sum::<u64>())
                .sum();
            assert!(dropped > 0, "{what}: nothing dropped");
        }
        let local = 8 / ep;
        let received = |member: usize| -> u64 {
            reference
                .iter()
                .map(|r| {
                    r.kept[member * local..(member + 1) * local]
                        .iter()
                        .sum::<u64>()
                })
                .sum()
        };
        if rows == 1 {
            assert!(
                (0..ep).any(|m| received(m) == 0),
                "{what}: every member got a row"
            );
        }
        assert_eq!(runs.len(), reference.len(), "{what}: ranks");
        for (rank, ((got, (calls, bytes)), want)) in runs.iter().zip(&reference).enumerate() {
            let what = format!("{what}, rank {rank}");
            assert_eq!(got.kept, want.kept, "{what}: routing");
            crate::suite::close(&format!("{what}: output"), &got.output, &want.output);
            crate::suite::close(
                &format!("{what}: input gradient"),
                &got.input_grad,
                &want.input_grad,
            );
            let sent: u64 = want.kept.iter().sum();
            let received = received(rank);
            assert_eq!(*calls, 4, "{what}: all-to-all calls");
            assert_eq!(
                *bytes,
                2 * (sent + received) * d as u64 * 4,
                "{what}: all-to-all bytes"
            );
            let mean: Vec<Vec<f32>> = (0..want.param_grads.len())
                .map(|p| {
                    let n = reference[0].param_grads[p].len();
                    (0..n)
                        .map(|i| {
                            reference.iter().map(|r| r.param_grads[p][i]).sum::<f32>() / ep as f32
                        })
                        .collect()
                })
                .collect();
            crate::suite::tensors_close(
                &format!("{what}: parameter gradients"),
                &got.param_grads,
                &mean,
                1e-5,
            );
        }
    }
}

/// With `--aux-loss-scope global` each rank's load-balancing loss takes the experts' shares
/// over every data-parallel rank's tokens (Megatron-Core's global auxiliary loss) and its own
/// mean router scores: `coef · E · Σₑ (Σᵣ countᵣₑ / Σᵣ nᵣ·k) · Pₑ` on two data ranks, checked
/// against the formula on the host; the default (micro-batch) scope takes the rank's counts
/// alone, which differ.
#[test]
fn global_balance_counts_every_data_ranks_tokens() {
    use wildfire::models::moe::BalanceScope;
    use wildfire::parallel::{DeviceMesh, create_replicated};
    type Dist = Autodiff<wildfire::parallel::Distributed<Flex>>;
    let (d, ffn, rows, e, k) = (16, 24, 12, 4, 2);
    let mesh = DeviceMesh::new([("dp", 2), ("tp", 1)]).unwrap();
    // Each rank's mean router scores, from the router's values (the block's first draw).
    let w = values(1, d * e, 0.5);
    let mean_scores = |rank: u64| {
        let x = values(100 + rank, rows * d, 1.0);
        let mut p = vec![0f64; e];
        for r in 0..rows {
            let logits: Vec<f64> = (0..e)
                .map(|j| (0..d).map(|i| (x[r * d + i] * w[i * e + j]) as f64).sum())
                .collect();
            let max = logits.iter().cloned().fold(f64::MIN, f64::max);
            let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            for j in 0..e {
                p[j] += (logits[j] - max).exp() / sum / rows as f64;
            }
        }
        p
    };
    let mut seen = Vec::new();
    for scope in [BalanceScope::MicroBatch, BalanceScope::Global] {
        let config = MoeConfig {
            experts: e,
            top_k: k,
            aux_loss_coef: 1.0,
            z_loss_coef: 0.0,
            balance: scope,
            ..MoeConfig::default()
        };
        let out = crate::suite::threads(&mesh, |device| {
            let block = create_replicated(|| moe_block::<Dist>(&config, d, ffn, &device));
            let x = Tensor::<Dist, 3>::from_data(
                TensorData::new(
                    values(100 + device.rank() as u64, rows * d, 1.0),
                    [1, rows, d],
                ),
                &device,
            );
            let out = block.forward(x);
            (f64::from(out.aux_loss.into_scalar()), out.stats.routed)
        });
        for (rank, (aux, routed)) in out.iter().enumerate() {
            let counts: Vec<f64> = match scope {
                BalanceScope::MicroBatch => routed.iter().map(|&c| c as f64).collect(),
                BalanceScope::Global => (0..e)
                    .map(|j| out.iter().map(|(_, r)| r[j] as f64).sum())
                    .collect(),
            };
            let total: f64 = counts.iter().sum();
            let p = mean_scores(rank as u64);
            let want = e as f64 * (0..e).map(|j| counts[j] / total * p[j]).sum::<f64>();
            assert!(
                (aux - want).abs() < 1e-5,
                "{scope:?}, rank {rank}: aux {aux} vs {want}"
            );
        }
        seen.push(out[0].0);
    }
    assert!(
        (seen[0] - seen[1]).abs() > 1e-4,
        "the global shares differ from the rank's: {seen:?}"
    );
}
