//! Fused kernels against the same operation composed from Burn ops, on Wgpu (lavapipe here: the
//! times are informational, a software driver is not a GPU), forward and backward, side by side
//! in one run (fused and unfused interleaved round by round).
//!
//! ```text
//! cargo bench --bench kernels --features wgpu [-- --rounds 5]
//! ```
//!
//! Columns: median time per call (after a warm-up call that compiles the shaders), the fused
//! kernel launches per call (exact: counted by `wildfire_kernels::cube`), and the call's tensor
//! bytes in + out (the size of every input read and every output written, once each — the
//! traffic a fused kernel needs at least; the unfused composition also writes and re-reads every
//! intermediate).

mod common;

use burn::backend::Wgpu;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Distribution, Int, Tensor, TensorData, TensorMetadata};
use std::time::Instant;
use wildfire::kernels::{FusedOps, cube, reference};

type B = Wgpu;
type Prim = FloatTensor<B>;

fn bytes(ts: &[&Prim]) -> usize {
    ts.iter()
        .map(|t| t.shape().num_elements() * t.dtype().size())
        .sum()
}

fn sync() {
    <B as burn::tensor::backend::Backend>::sync(&Default::default()).unwrap();
}

fn random(shape: &[usize], std: f64) -> Prim {
    Tensor::<B, 1>::random(
        [shape.iter().product::<usize>()],
        Distribution::Normal(0.0, std),
        &Default::default(),
    )
    .into_primitive()
    .tensor()
    .reshape_to(shape)
}

trait ReshapeTo {
    fn reshape_to(self, shape: &[usize]) -> Prim;
}

impl ReshapeTo for Prim {
    fn reshape_to(self, shape: &[usize]) -> Prim {
        <B as burn::tensor::ops::FloatTensorOps<B>>::float_reshape(self, shape.into())
    }
}

/// Median seconds of `f` over `rounds`, after a warm-up call.
fn time<T>(rounds: usize, f: &dyn Fn() -> T) -> f64 {
    let _ = f();
    sync();
    let mut times: Vec<f64> = (0..rounds)
        .map(|_| {
            let start = Instant::now();
            let out = f();
            sync();
            drop(out);
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

struct Case<'a> {
    name: String,
    /// The outputs of one call, fused (`true`) or with Burn ops (`false`).
    run: Box<dyn Fn(bool) -> Vec<Prim> + 'a>,
    inputs: Vec<Prim>,
}

/// A case of an op whose fused form (`B::fused_*`) and Burn-op form (`reference::*`) share one
/// signature `Op`: `call` calls the form it is given on (copies of) `inputs`, and returns the
/// outputs.
fn case<'a, Op: Copy + 'a, const N: usize>(
    name: String,
    [fused, unfused]: [Op; 2],
    inputs: [Prim; N],
    call: impl Fn(Op, [Prim; N]) -> Vec<Prim> + 'a,
) -> Case<'a> {
    let args = inputs.clone();
    let run = move |f: bool| call(if f { fused } else { unfused }, args.clone());
    Case {
        name,
        run: Box::new(run),
        inputs: inputs.to_vec(),
    }
}

fn main() {
    let smoke = common::smoke();
    let rounds: usize = common::arg("--rounds").unwrap_or(if smoke { 1 } else { 5 });
    // The small GPT's shapes (batch 4 × seq 256 rows, d = 256, 4 heads of 64, vocab 50,304).
    let (rows, d, vocab, heads, seq) = if smoke {
        (64, 96, 1000, 2, 32)
    } else {
        (1024, 256, 50_304, 4, 256)
    };
    let hd = 64.min(d / heads);
    let x = random(&[rows, d], 2.0);
    let dy = random(&[rows, d], 1.0);
    let gamma = random(&[d], 1.0);
    let beta = random(&[d], 1.0);
    let h4 = random(&[rows, 4 * d], 1.0);
    let dh4 = random(&[rows, 4 * d], 1.0);
    let bias4 = random(&[4 * d], 1.0);
    // 512 rows of logits: lavapipe refuses a single buffer of 1024 × 50,304 f32 (206 MB).
    let ce_rows = rows.min(512);
    let logits = random(&[ce_rows, vocab], 3.0);
    let targets: Tensor<B, 1, Int> = Tensor::from_data(
        TensorData::new(
            (0..ce_rows)
                .map(|r| ((r * 7919) % vocab) as i64)
                .collect::<Vec<_>>(),
            [ce_rows],
        ),
        &Default::default(),
    );
    let t = targets.into_primitive();
    let dloss = random(&[ce_rows], 1.0);
    let b = rows / seq;
    let (q, k, v) = (
        random(&[b, heads, seq, hd], 1.0),
        random(&[b, heads, seq, hd], 1.0),
        random(&[b, heads, seq, hd], 1.0),
    );
    let scale = 1.0 / (hd as f64).sqrt();
    let ln = B::fused_layer_norm(x.clone(), gamma.clone(), beta.clone(), 1e-5);
    let sm = B::fused_softmax(x.clone());
    let ce = B::fused_cross_entropy(logits.clone(), t.clone());
    let att = B::fused_attention(q.clone(), k.clone(), v.clone(), scale, true);
    let do_ = random(&[b, heads, seq, hd], 1.0);
    let (cos, sin) = (random(&[seq, hd], 1.0), random(&[seq, hd], 1.0));

    // The optimizer tail on one 4d × d matrix.
    let w = random(&[4 * d, d], 1.0);
    let (mom, vel) = (
        random(&[4 * d, d], 0.1),
        B::fused_unscale(random(&[4 * d, d], 0.1), 1.0).grad,
    );
    let vel = <B as burn::tensor::ops::FloatTensorOps<B>>::float_abs(vel);
    let one = |x: f32| -> Prim {
        Tensor::<B, 1>::from_data(TensorData::new(vec![x], [1]), &Default::default())
            .into_primitive()
            .tensor()
    };
    let (clip, no_skip) = (one(0.5), one(0.0));
    let adam = wildfire::kernels::AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.1,
        step: 10,
    };

    let cases = vec![
        case(
            format!("softmax [{rows}, {d}]"),
            [B::fused_softmax, |x| reference::softmax::<B>(x, false)],
            [x.clone()],
            |op, [x]| vec![op(x)],
        ),
        case(
            format!("softmax backward [{rows}, {d}]"),
            [B::fused_softmax_backward, |y, dy| {
                reference::softmax_backward::<B>(y, dy, false)
            }],
            [sm.clone(), dy.clone()],
            |op, [y, dy]| vec![op(y, dy)],
        ),
        case(
            format!("layer_norm [{rows}, {d}]"),
            [B::fused_layer_norm, reference::layer_norm::<B>],
            [x.clone(), gamma.clone(), beta.clone()],
            |op, [x, gamma, beta]| {
                let o = op(x, gamma, beta, 1e-5);
                vec![o.output, o.mean, o.rstd]
            },
        ),
        case(
            format!("layer_norm backward [{rows}, {d}]"),
            [
                B::fused_layer_norm_backward,
                reference::layer_norm_backward::<B>,
            ],
            [
                x.clone(),
                gamma.clone(),
                ln.mean.clone(),
                ln.rstd.clone(),
                dy.clone(),
            ],
            |op, [x, gamma, mean, rstd, dy]| {
                let g = op(x, gamma, mean, rstd, dy);
                vec![g.x, g.gamma, g.beta]
            },
        ),
        case(
            format!("gelu_bias [{rows}, {}]", 4 * d),
            [B::fused_gelu_bias, reference::gelu_bias::<B>],
            [h4.clone(), bias4.clone()],
            |op, [h, bias]| vec![op(h, bias, false)],
        ),
        case(
            format!("gelu_bias backward [{rows}, {}]", 4 * d),
            [
                B::fused_gelu_bias_backward,
                reference::gelu_bias_backward::<B>,
            ],
            [h4.clone(), bias4.clone(), dh4.clone()],
            |op, [h, bias, dh]| {
                let (a, b) = op(h, bias, dh, false);
                vec![a, b]
            },
        ),
        case(
            format!("swiglu [{rows}, {}]", 4 * d),
            [B::fused_swiglu, reference::swiglu::<B>],
            [h4.clone(), dh4.clone()],
            |op, [g, u]| vec![op(g, u)],
        ),
        case(
            format!("swiglu backward [{rows}, {}]", 4 * d),
            [B::fused_swiglu_backward, reference::swiglu_backward::<B>],
            [h4.clone(), dh4.clone(), h4.clone()],
            |op, [g, u, dy]| {
                let (a, b) = op(g, u, dy);
                vec![a, b]
            },
        ),
        case(
            format!("rope [{b}, {heads}, {seq}, {hd}]"),
            [B::fused_rope, |x, c, s| {
                reference::rope::<B>(x, c, s, false)
            }],
            [q.clone(), cos.clone(), sin.clone()],
            |op, [x, c, s]| vec![op(x, c, s)],
        ),
        case(
            format!("rope backward [{b}, {heads}, {seq}, {hd}]"),
            [B::fused_rope_backward, |x, c, s| {
                reference::rope::<B>(x, c, s, true)
            }],
            [do_.clone(), cos.clone(), sin.clone()],
            |op, [x, c, s]| vec![op(x, c, s)],
        ),
        case(
            format!("cross_entropy [{ce_rows}, {vocab}]"),
            [B::fused_cross_entropy, reference::cross_entropy::<B>],
            [logits.clone()],
            |op, [logits]| {
                let o = op(logits, t.clone());
                vec![o.loss, o.lse]
            },
        ),
        case(
            format!("cross_entropy backward [{ce_rows}, {vocab}]"),
            [
                B::fused_cross_entropy_backward,
                reference::cross_entropy_backward::<B>,
            ],
            [logits.clone(), ce.lse.clone(), dloss.clone()],
            |op, [logits, lse, dloss]| vec![op(logits, t.clone(), lse, dloss)],
        ),
        case(
            format!("attention causal [{b}, {heads}, {seq}, {hd}]"),
            [B::fused_attention, reference::attention::<B>],
            [q.clone(), k.clone(), v.clone()],
            |op, [q, k, v]| {
                let o = op(q, k, v, scale, true);
                vec![o.output, o.lse]
            },
        ),
        case(
            format!("attention causal backward [{b}, {heads}, {seq}, {hd}]"),
            [
                B::fused_attention_backward,
                reference::attention_backward::<B>,
            ],
            [
                q.clone(),
                k.clone(),
                v.clone(),
                att.output.clone(),
                att.lse.clone(),
                do_.clone(),
            ],
            |op, [q, k, v, o, lse, d_o]| {
                let g = op(q, k, v, o, lse, d_o, scale, true);
                vec![g.q, g.k, g.v]
            },
        ),
        case(
            format!("unscale + Σg² + non-finite [{}, {d}]", 4 * d),
            [B::fused_unscale, reference::unscale::<B>],
            [w.clone()],
            |op, [w]| {
                let o = op(w, 1.0 / 1024.0);
                vec![o.grad, o.sum_squares, o.non_finite]
            },
        ),
        case(
            format!("AdamW, predicated [{}, {d}]", 4 * d),
            [B::fused_adamw, reference::adamw::<B>],
            [
                w.clone(),
                w.clone(),
                mom.clone(),
                vel.clone(),
                clip.clone(),
                no_skip.clone(),
            ],
            |op, [param, grad, m, v, clip, skip]| {
                let o = op(param, grad, m, v, clip, skip, adam);
                vec![o.param, o.m, o.v]
            },
        ),
    ];

    println!("| op | fused | Burn ops | unfused / fused | fused launches | bytes in + out |");
    println!("|---|---|---|---|---|---|");
    for case in &cases {
        let before = cube::launches();
        let out = (case.run)(true);
        sync();
        let launches = cube::launches() - before;
        let io =
            bytes(&case.inputs.iter().collect::<Vec<_>>()) + bytes(&out.iter().collect::<Vec<_>>());
        drop(out);
        let (mut fused, mut unfused) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            fused.push(time(1, &|| (case.run)(true)));
            unfused.push(time(1, &|| (case.run)(false)));
        }
        fused.sort_by(f64::total_cmp);
        unfused.sort_by(f64::total_cmp);
        let (f, u) = (fused[rounds / 2], unfused[rounds / 2]);
        println!(
            "| {} | {:.3} ms | {:.3} ms | {:.2} | {launches} | {:.2} MB |",
            case.name,
            f * 1e3,
            u * 1e3,
            u / f,
            io as f64 / 1e6
        );
    }
}
