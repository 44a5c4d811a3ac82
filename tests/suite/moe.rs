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
    for (i, (a, b)) in got.iter().zip(expected).enumerate() {
        assert_eq!(a.len(), b.len(), "{what}: parameter {i}");
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        for (x, y) in a.iter().zip(b) {
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
    let differ = plain
        .iter()
        .zip(&with_aux)
        .filter(|(a, b)| a.iter().zip(b.iter()).any(|(x, y)| (x - y).abs() > 1e-6))
        .count();
    assert!(differ > 0, "the auxiliary terms change some gradient");
}
