//! Every propagation rule against the same op on the full tensors, on a 2×2 (dp × tp) mesh of
//! thread ranks: each input is laid out in every placement combination the shapes allow, the op
//! runs on `Distributed<Flex>`, and the gathered result must equal the plain `Flex` result.

use crate::*;
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData, activation, module};
use std::sync::Arc;

type F = Flex;
type D = Distributed<Flex>;

fn mesh22() -> DeviceMesh {
    DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap()
}

/// Deterministic values in [-1, 1).
fn values(shape: &[usize], seed: u64) -> TensorData {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 2000) as f32 / 1000.0 - 1.0
        })
        .collect();
    TensorData::new(v, shape.to_vec())
}

/// All layouts of a rank-`rank` tensor on `mesh` (each axis: Replicate, Shard(d), Partial(Sum),
/// and Local on data axes).
fn layouts(mesh: &DeviceMesh, rank: usize) -> Vec<Layout> {
    let mut out = vec![Layout::new(vec![])];
    for axis in mesh.axes() {
        let mut options = vec![Placement::Replicate, Placement::Partial(ReduceOp::Sum)];
        options.extend((0..rank).map(Placement::Shard));
        if axis.kind == AxisKind::Data {
            options.push(Placement::Local);
        }
        out = out
            .into_iter()
            .flat_map(|l| {
                options.iter().map(move |p| {
                    let mut v = l.placements().to_vec();
                    v.push(*p);
                    Layout::new(v)
                })
            })
            .collect();
    }
    out
}

/// This rank's value of an input: per-rank (`Local`) inputs differ between data-parallel ranks.
fn rank_value(base: &TensorData, layout: &Layout, mesh: &DeviceMesh, rank: usize) -> TensorData {
    let local_axes: Vec<usize> = (0..layout.len())
        .filter(|&a| layout.get(a) == Placement::Local)
        .collect();
    if local_axes.is_empty() {
        return base.clone();
    }
    let coords = mesh.coords(rank);
    let scale = 1.0
        + local_axes
            .iter()
            .map(|&a| coords[a] as f32 * 0.25)
            .sum::<f32>();
    let v: Vec<f32> = base
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|x| x * scale)
        .collect();
    TensorData::new(v, base.shape.clone())
}

fn close(got: &TensorData, expected: &TensorData) -> Result<(), String> {
    if got.shape != expected.shape {
        return Err(format!("shape {:?} != {:?}", got.shape, expected.shape));
    }
    let (g, e) = (
        got.clone().convert::<f32>().to_vec::<f32>().unwrap(),
        expected.clone().convert::<f32>().to_vec::<f32>().unwrap(),
    );
    for (i, (a, b)) in g.iter().zip(&e).enumerate() {
        if (a - b).abs() > 1e-5 * b.abs().max(1.0) {
            return Err(format!("element {i}: {a} != {b}"));
        }
    }
    Ok(())
}

fn dist<const N: usize>(
    full: &TensorData,
    layout: &Layout,
    device: &DistDevice<F>,
) -> Option<Tensor<D, N>> {
    let t = Tensor::<F, N>::from_data(full.clone(), &Default::default());
    let dt = DTensor::from_full(t.into_primitive().tensor(), layout, device).ok()?;
    Some(from_dtensor::<D, N>(dt))
}

trait Op1<const N: usize>: Sync {
    fn apply<B: Backend>(&self, x: Tensor<B, N>) -> TensorData;
}

trait Op2<const N: usize, const M: usize>: Sync {
    fn apply<B: Backend>(&self, a: Tensor<B, N>, b: Tensor<B, M>) -> TensorData;
}

macro_rules! op1 {
    ($n:literal, |$x:ident| $body:expr) => {{
        struct O;
        impl Op1<$n> for O {
            fn apply<B: Backend>(&self, $x: Tensor<B, $n>) -> TensorData {
                ($body).into_data()
            }
        }
        O
    }};
}

macro_rules! op2 {
    ($n:literal, $m:literal, |$a:ident, $b:ident| $body:expr) => {{
        struct O;
        impl Op2<$n, $m> for O {
            fn apply<B: Backend>(&self, $a: Tensor<B, $n>, $b: Tensor<B, $m>) -> TensorData {
                ($body).into_data()
            }
        }
        O
    }};
}

/// Run `op` on every layout of an input of `shape`; returns the number of layouts checked.
fn check1<const N: usize>(name: &str, shape: [usize; N], op: impl Op1<N>) -> usize {
    check1_where(name, shape, |_| true, op)
}

/// [`check1`] over the layouts `keep` accepts.
fn check1_where<const N: usize>(
    name: &str,
    shape: [usize; N],
    keep: impl Fn(&Layout) -> bool,
    op: impl Op1<N>,
) -> usize {
    let mesh = mesh22();
    let base = values(&shape, 7);
    let all: Vec<Layout> = layouts(&mesh, N).into_iter().filter(|l| keep(l)).collect();
    let results =
        launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
            let (mut checked, mut fails) = (0, Vec::new());
            for layout in &all {
                let value = rank_value(&base, layout, &mesh, device.rank());
                let Some(x) = dist::<N>(&value, layout, &device) else {
                    continue;
                };
                let expected = op.apply(Tensor::<F, N>::from_data(value, &Default::default()));
                if let Err(e) = close(&op.apply(x), &expected) {
                    fails.push(format!("{name} on {layout}: {e}"));
                }
                checked += 1;
            }
            (checked, fails)
        })
        .unwrap();
    let fails: Vec<String> = results.iter().flat_map(|(_, f)| f.clone()).collect();
    assert!(
        fails.is_empty(),
        "{} failures, first: {:#?}",
        fails.len(),
        &fails[..fails.len().min(5)]
    );
    results[0].0
}

/// Run `op` on pairs of layouts (every `stride`-th pair, to keep the test quick).
fn check2<const N: usize, const M: usize>(
    name: &str,
    shapes: ([usize; N], [usize; M]),
    stride: usize,
    op: impl Op2<N, M>,
) -> usize {
    check2_where(name, shapes, stride, |_| true, op)
}

/// [`check2`] over the layouts of the second operand that `keep` accepts.
fn check2_where<const N: usize, const M: usize>(
    name: &str,
    shapes: ([usize; N], [usize; M]),
    stride: usize,
    keep: impl Fn(&Layout) -> bool,
    op: impl Op2<N, M>,
) -> usize {
    let mesh = mesh22();
    let (base_a, base_b) = (values(&shapes.0, 3), values(&shapes.1, 5));
    let la = layouts(&mesh, N);
    let lb: Vec<Layout> = layouts(&mesh, M).into_iter().filter(|l| keep(l)).collect();
    let pairs: Vec<(Layout, Layout)> = la
        .iter()
        .flat_map(|a| lb.iter().map(move |b| (a.clone(), b.clone())))
        .step_by(stride)
        .collect();
    let results =
        launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
            let (mut checked, mut fails) = (0, Vec::new());
            let plain = Default::default();
            for (l1, l2) in &pairs {
                let va = rank_value(&base_a, l1, &mesh, device.rank());
                let vb = rank_value(&base_b, l2, &mesh, device.rank());
                let (Some(a), Some(b)) = (dist::<N>(&va, l1, &device), dist::<M>(&vb, l2, &device))
                else {
                    continue;
                };
                let expected = op.apply(
                    Tensor::<F, N>::from_data(va, &plain),
                    Tensor::<F, M>::from_data(vb, &plain),
                );
                if let Err(e) = close(&op.apply(a, b), &expected) {
                    fails.push(format!("{name} on {l1} × {l2}: {e}"));
                }
                checked += 1;
            }
            (checked, fails)
        })
        .unwrap();
    let fails: Vec<String> = results.iter().flat_map(|(_, f)| f.clone()).collect();
    assert!(
        fails.is_empty(),
        "{} failures, first: {:#?}",
        fails.len(),
        &fails[..fails.len().min(5)]
    );
    results[0].0
}

#[test]
fn unary_elementwise_rules_match_full_tensors() {
    let s = [4, 4, 8];
    assert!(check1("exp", s, op1!(3, |x| x.exp())) > 20);
    check1("neg", s, op1!(3, |x| x.neg()));
    check1("mul_scalar", s, op1!(3, |x| x.mul_scalar(3.0)));
    check1("add_scalar", s, op1!(3, |x| x.add_scalar(1.5)));
    check1("gelu", s, op1!(3, |x| activation::gelu(x)));
    check1("relu", s, op1!(3, |x| activation::relu(x)));
    check1("sqrt_abs", s, op1!(3, |x| x.abs().sqrt()));
    check1("cast", s, op1!(3, |x| x.cast(burn::tensor::DType::F64)));
}

#[test]
fn reduction_rules_match_full_tensors() {
    let s = [4, 4, 8];
    check1("sum", s, op1!(3, |x| x.sum()));
    check1("mean", s, op1!(3, |x| x.mean()));
    check1("sum_dim", s, op1!(3, |x| x.sum_dim(1)));
    check1("mean_dim", s, op1!(3, |x| x.mean_dim(2)));
    check1("max_dim", s, op1!(3, |x| x.max_dim(0)));
    check1("max", s, op1!(3, |x| x.max()));
    check1("min_dim", s, op1!(3, |x| x.min_dim(1)));
    check1("argmax", s, op1!(3, |x| x.argmax(2)));
    check1("sum_then_exp", s, op1!(3, |x| x.sum_dim(2).exp()));
}

#[test]
fn dim_local_rules_match_full_tensors() {
    let s = [4, 4, 8];
    check1("softmax", s, op1!(3, |x| activation::softmax(x, 2)));
    check1("log_softmax", s, op1!(3, |x| activation::log_softmax(x, 0)));
    check1("cumsum", s, op1!(3, |x| x.cumsum(1)));
}

#[test]
fn shape_rules_match_full_tensors() {
    let s = [4, 4, 8];
    check1("reshape_merge", s, op1!(3, |x| x.reshape([16, 8])));
    check1("reshape_split", s, op1!(3, |x| x.reshape([4, 4, 2, 4])));
    check1("reshape_all", s, op1!(3, |x| x.reshape([128])));
    check1("swap_dims", s, op1!(3, |x| x.swap_dims(0, 2)));
    check1("permute", s, op1!(3, |x| x.permute([2, 0, 1])));
    check1("transpose", s, op1!(3, |x| x.transpose()));
    check1("slice_part", s, op1!(3, |x| x.slice([0..4, 1..3, 0..8])));
    check1("slice_full", s, op1!(3, |x| x.slice([0..4, 0..4])));
    check1("narrow", s, op1!(3, |x| x.narrow(2, 2, 4)));
    check1(
        "expand",
        s,
        op1!(3, |x| x.unsqueeze::<4>().expand([2, 4, 4, 8])),
    );
    check1(
        "cat",
        s,
        op1!(3, |x| Tensor::cat(vec![x.clone(), x.exp()], 1)),
    );
    check1(
        "select",
        s,
        op1!(3, |x| {
            let idx = Tensor::<B, 1, Int>::from_data([3, 0, 1], &x.device());
            x.select(1, idx)
        }),
    );
    check1(
        "gather",
        s,
        op1!(3, |x| {
            let idx: Vec<i64> = (0..128).map(|i| (i * 7 % 4) as i64).collect();
            let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(idx, [4, 4, 8]), &x.device());
            x.gather(1, idx)
        }),
    );
    check1(
        "mask_fill",
        s,
        op1!(3, |x| {
            let mask = x.clone().greater_elem(0.2);
            x.mask_fill(mask, -2.0)
        }),
    );
}

#[test]
fn binary_rules_match_full_tensors() {
    let s = ([4, 4, 8], [4, 4, 8]);
    assert!(check2("add", s, 3, op2!(3, 3, |a, b| a + b)) > 100);
    check2("sub", s, 5, op2!(3, 3, |a, b| a - b));
    check2("mul", s, 3, op2!(3, 3, |a, b| a * b));
    check2("div", s, 7, op2!(3, 3, |a, b| a / (b.abs() + 1.0)));
    check2("powf", s, 11, op2!(3, 3, |a, b| a.abs().powf(b)));
    check2(
        "broadcast_add",
        ([4, 4, 8], [1, 4, 8]),
        1,
        op2!(3, 3, |a, b| a + b),
    );
    check2(
        "broadcast_mul",
        ([4, 4, 8], [4, 4, 1]),
        1,
        op2!(3, 3, |a, b| a * b),
    );
    check2(
        "slice_assign",
        ([4, 4, 8], [4, 2, 8]),
        3,
        op2!(3, 3, |a, b| a.slice_assign([0..4, 1..3, 0..8], b)),
    );
    check2(
        "mask_where",
        s,
        9,
        op2!(3, 3, |a, b| {
            let mask = a.clone().lower_elem(0.0);
            a.mask_where(mask, b)
        }),
    );
}

#[test]
fn matmul_and_linear_rules_match_full_tensors() {
    assert!(
        check2(
            "matmul",
            ([4, 4, 8], [4, 8, 4]),
            1,
            op2!(3, 3, |a, b| a.matmul(b))
        ) > 200
    );
    check2(
        "matmul_broadcast",
        ([4, 4, 8], [1, 8, 4]),
        1,
        op2!(3, 3, |a, b| a.matmul(b)),
    );
    // A weight is a parameter: per-rank (`Local`) weights are refused (see the DDP tests).
    check2_where(
        "linear",
        ([4, 4, 8], [8, 4]),
        1,
        placed,
        op2!(3, 2, |x, w| module::linear(x, w, None)),
    );
    check2_where(
        "linear_bias",
        ([4, 4, 8], [8, 4]),
        1,
        placed,
        op2!(3, 2, |x, w| {
            let b = w.clone().sum_dim(0).reshape([4]);
            module::linear(x, w, Some(b))
        }),
    );
}

#[test]
fn redistribute_round_trips_every_layout_pair() {
    let mesh = mesh22();
    let base = values(&[4, 4, 8], 11);
    let all: Vec<Layout> = layouts(&mesh, 3)
        .into_iter()
        .filter(|l| !l.placements().contains(&Placement::Local))
        .collect();
    let results =
        launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
            let mut checked = 0;
            for from in &all {
                for to in &all {
                    let t = Tensor::<F, 3>::from_data(base.clone(), &Default::default());
                    let Ok(dt) = DTensor::from_full(t.into_primitive().tensor(), from, &device)
                    else {
                        continue;
                    };
                    let Ok(moved) = dt.redistribute(to) else {
                        continue;
                    };
                    assert_eq!(moved.layout(), to);
                    let full = moved.full().unwrap();
                    let got =
                        Tensor::<F, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(full));
                    close(&got.into_data(), &base)
                        .unwrap_or_else(|e| panic!("{from} -> {to}: {e}"));
                    checked += 1;
                }
            }
            checked
        })
        .unwrap();
    assert!(results[0] > 400, "{results:?}");
}

#[test]
fn uneven_shards_are_a_typed_error() {
    let mesh = DeviceMesh::new([("tp", 4)]).unwrap();
    let results =
        launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
            let t = Tensor::<F, 2>::from_data(values(&[6, 3], 1), &Default::default());
            DTensor::from_full(
                t.into_primitive().tensor(),
                &Layout::new([Placement::Shard(0)]),
                &device,
            )
            .map(|_| ())
        })
        .unwrap();
    for r in results {
        match r {
            Err(DistError::Indivisible {
                dim: 0,
                size: 6,
                shards: 4,
                ..
            }) => {}
            other => panic!("expected Indivisible, got {other:?}"),
        }
    }
}

#[test]
fn local_data_cannot_become_global() {
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let results =
        launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
            let t = Tensor::<D, 1>::from_data([1.0, 2.0], &device);
            assert_eq!(dtensor(&t).layout(), &Layout::new([Placement::Local]));
            dtensor(&t)
                .redistribute(&Layout::new([Placement::Replicate]))
                .map(|_| ())
        })
        .unwrap();
    assert!(matches!(
        results[0],
        Err(DistError::InvalidRedistribution { .. })
    ));
}

/// Megatron column- then row-parallel MLP on tp = 2: forward and backward equal the unsharded
/// run, with exactly one all-reduce forward (after the row-parallel matmul) and one backward
/// (the column-parallel input gradient), and nothing from the fallback.
#[test]
fn tensor_parallel_mlp_gradients_match_and_count_collectives() {
    type A = Autodiff<D>;
    let mesh = DeviceMesh::new([("tp", 2)]).unwrap();
    let (x0, w1, w2) = (values(&[3, 8], 1), values(&[8, 4], 2), values(&[4, 8], 3));
    let reference = {
        let dev = Default::default();
        let x = Tensor::<Autodiff<F>, 2>::from_data(x0.clone(), &dev).require_grad();
        let a = Tensor::<Autodiff<F>, 2>::from_data(w1.clone(), &dev).require_grad();
        let b = Tensor::<Autodiff<F>, 2>::from_data(w2.clone(), &dev).require_grad();
        let y = activation::gelu(module::linear(x.clone(), a.clone(), None));
        let y = module::linear(y, b.clone(), None);
        let loss = (y.clone() * y).sum();
        let g = loss.backward();
        (
            loss.into_data(),
            x.grad(&g).unwrap().into_data(),
            a.grad(&g).unwrap().into_data(),
            b.grad(&g).unwrap().into_data(),
        )
    };
    let results =
        launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
            let put = |v: &TensorData, p: Placement| {
                let t = Tensor::<F, 2>::from_data(v.clone(), &Default::default());
                let dt =
                    DTensor::from_full(t.into_primitive().tensor(), &Layout::new([p]), &device)
                        .unwrap();
                from_dtensor::<A, 2>(dt).require_grad()
            };
            let x = put(&x0, Placement::Replicate);
            let a = put(&w1, Placement::Shard(1));
            let b = put(&w2, Placement::Shard(0));
            device.context().reset_counters();
            let y = activation::gelu(module::linear(x.clone(), a.clone(), None));
            let y = module::linear(y, b.clone(), None);
            let loss = (y.clone() * y).sum();
            let forward = device.context().comm().stats();
            let g = loss.backward();
            let total = device.context().comm().stats();
            let counters = device.context().counters();
            let full = |t: Tensor<D, 2>| {
                dtensor(&t)
                    .full()
                    .map(|p| {
                        Tensor::<F, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(p))
                            .into_data()
                    })
                    .unwrap()
            };
            let out = (
                Tensor::<F, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
                    dtensor(&loss.inner()).full().unwrap(),
                ))
                .into_data(),
                full(x.grad(&g).unwrap()),
                full(a.grad(&g).unwrap()),
                full(b.grad(&g).unwrap()),
            );
            (out, forward, total, counters)
        })
        .unwrap();
    for ((loss, gx, ga, gb), forward, total, counters) in results {
        close(&loss, &reference.0).unwrap();
        close(&gx, &reference.1).unwrap();
        close(&ga, &reference.2).unwrap();
        close(&gb, &reference.3).unwrap();
        assert_eq!(forward.count(CollectiveKind::AllReduce), 1, "{forward}");
        assert_eq!(total.count(CollectiveKind::AllReduce), 2, "{total}");
        assert_eq!(total.count(CollectiveKind::AllGather), 0, "{total}");
        assert_eq!(counters.fallback_total(), 0, "{counters:?}");
    }
}

fn placed(layout: &Layout) -> bool {
    !layout.placements().contains(&Placement::Local)
}

#[test]
fn embedding_and_layer_norm_rules_match_full_tensors() {
    assert!(
        check1_where(
            "embedding",
            [8, 4],
            placed,
            op1!(2, |w| {
                let idx = Tensor::<B, 2, Int>::from_data([[1, 7, 0], [3, 3, 5]], &w.device());
                module::embedding(w, idx)
            }),
        ) > 10
    );
    check2_where(
        "layer_norm",
        ([4, 4, 8], [8]),
        1,
        placed,
        op2!(3, 1, |x, gamma| {
            let beta = gamma.clone().mul_scalar(0.5);
            let out = B::layer_norm(
                x.into_primitive().tensor(),
                gamma.into_primitive().tensor(),
                Some(beta.into_primitive().tensor()),
                1e-5,
            );
            Tensor::<B, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(out))
        }),
    );
}

/// Embedding gradients on a dp = 2 mesh are averaged where they are born (the weight's
/// placement is visible to `embedding_backward`), matching the mean of the per-rank gradients.
#[test]
fn data_parallel_embedding_gradient_is_reduced_at_birth() {
    type A = Autodiff<D>;
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let w0 = values(&[8, 4], 9);
    let indices = |rank: usize| TensorData::new(vec![rank as i64, 7, 2 + rank as i64, 3], [2, 2]);
    let reference: Vec<f32> = {
        let dev = Default::default();
        let grads: Vec<Vec<f32>> = (0..2)
            .map(|rank| {
                let w = Tensor::<Autodiff<F>, 2>::from_data(w0.clone(), &dev).require_grad();
                let idx = Tensor::<Autodiff<F>, 2, Int>::from_data(indices(rank), &dev);
                let y = module::embedding(w.clone(), idx);
                let g = (y.clone() * y).sum().backward();
                w.grad(&g).unwrap().into_data().to_vec().unwrap()
            })
            .collect();
        grads[0]
            .iter()
            .zip(&grads[1])
            .map(|(a, b)| (a + b) / 2.0)
            .collect()
    };
    let results =
        launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
            let t = Tensor::<F, 2>::from_data(w0.clone(), &Default::default());
            let dt = DTensor::from_full(
                t.into_primitive().tensor(),
                &Layout::replicated(&mesh),
                &device,
            )
            .unwrap();
            let w = from_dtensor::<A, 2>(dt).require_grad();
            let idx = Tensor::<A, 2, Int>::from_data(indices(device.rank()), &device);
            let y = module::embedding(w.clone(), idx);
            let g = (y.clone() * y).sum().backward();
            let grad = dtensor(&w.grad(&g).unwrap());
            assert_eq!(grad.layout(), &Layout::replicated(&mesh));
            let stats = device.context().comm().stats();
            let full = grad.full().unwrap();
            let data = Tensor::<F, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(full))
                .into_data();
            (data, stats)
        })
        .unwrap();
    for (grad, stats) in results {
        close(&grad, &TensorData::new(reference.clone(), [8, 4])).unwrap();
        assert_eq!(stats.count(CollectiveKind::AllReduce), 1, "{stats}");
    }
}

/// The precision policy: with a bf16 compute dtype, a matmul and a linear run in bf16 (their
/// results equal the same ops on bf16-cast operands, cast back) and hand back f32.
#[test]
fn compute_dtype_casts_matmuls_and_keeps_f32_outside() {
    let mesh = DeviceMesh::new([("dp", 1)]).unwrap();
    let out = launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
        let (a, b) = (values(&[4, 8], 1), values(&[8, 4], 2));
        let x = Tensor::<D, 2>::from_data(a.clone(), &device);
        let w = Tensor::<D, 2>::from_data(b.clone(), &device);
        let exact = x.clone().matmul(w.clone()).into_data();
        device
            .context()
            .set_compute_dtype(Some(burn::tensor::FloatDType::BF16));
        let mixed = x.clone().matmul(w.clone());
        let dtype = mixed.dtype();
        let mixed = mixed.into_data();
        let linear = module::linear(x, w, None).into_data();
        device.context().set_compute_dtype(None);
        let dev = Default::default();
        let reference = Tensor::<F, 2>::from_data(a, &dev)
            .cast(burn::tensor::DType::BF16)
            .matmul(Tensor::<F, 2>::from_data(b, &dev).cast(burn::tensor::DType::BF16))
            .cast(burn::tensor::DType::F32)
            .into_data();
        (exact, mixed, linear, reference, dtype)
    })
    .unwrap();
    let (exact, mixed, linear, reference, dtype) = &out[0];
    assert_eq!(*dtype, burn::tensor::DType::F32);
    assert_eq!(mixed, reference);
    assert_eq!(linear, reference);
    assert_ne!(mixed, exact, "bf16 compute must differ from f32 somewhere");
}

/// `scatter_add` (gather's backward) on every layout pair of target and values: equal to the full
/// op; on the tensor-parallel axis the result stays split over the scattered dim (loss-parallel
/// backward never holds the `[N, vocab]` gradient whole).
#[test]
fn scatter_add_rule_matches_full_tensors_and_stays_split() {
    use burn::tensor::IndexingUpdateOp;
    assert!(
        check2(
            "scatter_add",
            ([4, 8], [4, 1]),
            3,
            op2!(2, 2, |t, v| {
                let idx = Tensor::<B, 2, Int>::from_data([[1], [7], [0], [4]], &t.device());
                t.scatter(1, idx, v, IndexingUpdateOp::Add)
            }),
        ) > 10
    );
    let mesh = DeviceMesh::new([("dp", 1), ("tp", 2)]).unwrap();
    let out = launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
        let t = Tensor::<D, 2>::zeros([4, 8], &device);
        let v = Tensor::<D, 2>::from_data(values(&[4, 1], 1), &device);
        let idx = Tensor::<D, 2, Int>::from_data([[1], [7], [0], [4]], &device);
        let out = t.scatter(1, idx, v, IndexingUpdateOp::Add);
        dtensor(&out).layout().clone()
    })
    .unwrap();
    for layout in out {
        assert_eq!(layout.get(1), Placement::Shard(1), "{layout}");
    }
}

/// Dimensions that do not divide by a data axis are padded while split (FSDP's shards of any
/// shape): every rule on every layout of a `[3, 5, 4]` tensor on the 2 × 2 mesh (3 and 5 padded
/// on `dp`; model-axis splits of them are refused and skipped) equals the op on the full tensor.
#[test]
fn padded_data_shards_match_full_tensors() {
    let s = [3, 5, 4];
    let padded = |l: &Layout| {
        (0..2).any(|d| l.get(0) == Placement::Shard(d)) && l.get(0) != Placement::Shard(2)
    };
    assert!(check1_where("exp", s, padded, op1!(3, |x| x.exp())) > 5);
    check1_where("mul_scalar", s, padded, op1!(3, |x| x.mul_scalar(3.0)));
    check1_where("sum", s, padded, op1!(3, |x| x.sum()));
    check1_where("sum_dim0", s, padded, op1!(3, |x| x.sum_dim(0)));
    check1_where("sum_dim1", s, padded, op1!(3, |x| x.sum_dim(1)));
    check1_where("mean", s, padded, op1!(3, |x| x.mean()));
    check1_where("max_dim1", s, padded, op1!(3, |x| x.max_dim(1)));
    check1_where("reshape", s, padded, op1!(3, |x| x.reshape([15, 4])));
    check1_where("swap_dims", s, padded, op1!(3, |x| x.swap_dims(0, 1)));
    check1_where("slice", s, padded, op1!(3, |x| x.slice([1..3, 0..5, 0..2])));
    check1_where(
        "softmax0",
        s,
        padded,
        op1!(3, |x| activation::softmax(x, 0)),
    );
    check1_where(
        "sqrt_add",
        s,
        padded,
        op1!(3, |x| x.clone().abs().sqrt() + x),
    );
    check2("add", (s, s), 2, op2!(3, 3, |a, b| a + b));
    check2(
        "div_broadcast",
        (s, [1, 5, 4]),
        2,
        op2!(3, 3, |a, b| a / (b.abs() + 1.0)),
    );
    check2(
        "matmul",
        (s, [4, 3]),
        3,
        op2!(3, 2, |a, b| a.matmul(b.unsqueeze())),
    );
}

/// With device collectives installed, every redistribution goes through them (none through the
/// host communicator directly), each collective along every dimension is only ever asked of
/// them along dim 0, and the results are bitwise those of the host path.
#[test]
fn device_collectives_carry_every_redistribution_bitwise() {
    let mesh = mesh22();
    let base = values(&[4, 4, 8], 5);
    let all: Vec<Layout> = layouts(&mesh, 3)
        .into_iter()
        .filter(|l| !l.placements().contains(&Placement::Local))
        .collect();
    let results =
        launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
            let comm = device.context().comm_arc();
            let run = |device: &DistDevice<F>| {
                let mut out = Vec::new();
                for from in &all {
                    for to in &all {
                        let t = Tensor::<F, 3>::from_data(base.clone(), &Default::default());
                        let Ok(dt) = DTensor::from_full(t.into_primitive().tensor(), from, device)
                        else {
                            continue;
                        };
                        // Partial → Shard must reach the shard by a reduce-scatter on any dim.
                        let moved = dt.redistribute(to).unwrap();
                        out.push(crate::tensor::read::<F>(moved.local().clone()));
                    }
                }
                // A per-rank value adopted from member 0 (a broadcast).
                let local = Tensor::<F, 2>::from_data(
                    values(&[3, 5], device.rank() as u64),
                    &Default::default(),
                );
                let dt = DTensor::from_local(
                    local.into_primitive().tensor(),
                    Layout::new([Placement::Local, Placement::Replicate]),
                    device,
                )
                .unwrap();
                out.push(crate::tensor::read::<F>(
                    dt.adopt_from_first(0).unwrap().local().clone(),
                ));
                out
            };
            let host = run(&device);
            let host_stats = comm.stats();
            comm.reset_stats();
            let counting = Arc::new(HostStaged::new(comm.clone()));
            device
                .context()
                .set_device_collectives::<F>(counting.clone());
            let staged = run(&device);
            device.context().clear_device_collectives();
            let staged_stats = comm.stats();
            let calls = counting.calls();
            (host, staged, host_stats, staged_stats, calls)
        })
        .unwrap();
    for (host, staged, host_stats, staged_stats, calls) in results {
        assert_eq!(host.len(), staged.len());
        for (a, b) in host.iter().zip(&staged) {
            assert_eq!(a.as_bytes(), b.as_bytes());
            assert_eq!(a.shape, b.shape);
        }
        // The same collectives, by kind, and every one went through the device collectives
        // (whose host staging recorded it), along dim 0.
        for kind in [
            CollectiveKind::AllReduce,
            CollectiveKind::AllGather,
            CollectiveKind::ReduceScatter,
            CollectiveKind::Broadcast,
        ] {
            assert_eq!(host_stats.count(kind), staged_stats.count(kind), "{kind:?}");
            assert_eq!(host_stats.bytes(kind), staged_stats.bytes(kind), "{kind:?}");
            let calls = calls.get(&kind).copied().unwrap_or(0);
            assert_eq!(calls, host_stats.count(kind), "{kind:?}");
        }
        let count = |kind| calls.get(&kind).copied().unwrap_or(0);
        assert!(
            count(CollectiveKind::AllGather) > 50 && count(CollectiveKind::ReduceScatter) > 10,
            "{calls:?}"
        );
        assert_eq!(count(CollectiveKind::Broadcast), 1);
    }
}

/// Devices of finished ranks give their ids back: 70,000 devices made and dropped one after the
/// other fit the 65,536 ids a `DeviceId` names (the table grew by one per rank per launch and
/// panicked past 65,536), and a live device still round-trips through its id.
#[test]
fn device_ids_are_reused_after_ranks_end() {
    use burn::tensor::backend::Device;
    for _ in 0..70_000 {
        let world = InProcessWorld::new(DeviceMesh::single(), std::time::Duration::from_secs(5));
        drop(DistDevice::<Flex>::new(
            Default::default(),
            Arc::new(world.communicator(0)),
        ));
    }
    // Other tests of this binary register their ranks' devices meanwhile: a few hundred at most.
    assert!(
        crate::device::registered_slots() < 10_000,
        "{} slots",
        crate::device::registered_slots()
    );
    let world = InProcessWorld::new(DeviceMesh::single(), std::time::Duration::from_secs(5));
    let device = DistDevice::<Flex>::new(Default::default(), Arc::new(world.communicator(0)));
    let back = DistDevice::<Flex>::from_id(device.to_id());
    assert!(Arc::ptr_eq(back.context(), device.context()));
}

/// The rank policy: set in one call, kept by the parallelism transforms, which fill in their
/// parts (`fully_shard` the sharding: where parameters, gradients and optimizer state rest, and
/// when gradients are reduced); the thin setters change one field and keep the rest.
#[test]
fn rank_policy_is_set_once_and_filled_in_by_fully_shard() {
    use burn::tensor::FloatDType::BF16;
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let out = launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
        let ctx = device.context().clone();
        let set = RankPolicy {
            compute_dtype: Some(BF16),
            memory_budget: Some(1 << 30),
            ..Default::default()
        };
        ctx.set_policy(set.clone());
        let linear = || burn::nn::LinearConfig::new(4, 4).init::<D>(&device);
        fully_shard(linear(), &mesh, FsdpStrategy::FullShard).unwrap();
        let full_shard = ctx.policy();
        fully_shard(linear(), &mesh, FsdpStrategy::ShardOptimizer).unwrap();
        let zero1 = ctx.policy();
        ctx.set_gradient_reduce_dtype(Some(BF16));
        (set, full_shard, zero1, ctx.policy())
    })
    .unwrap();
    let (set, full_shard, zero1, last) = &out[0];
    assert_eq!(full_shard.compute_dtype, set.compute_dtype);
    assert_eq!(full_shard.memory_budget, set.memory_budget);
    let s = &full_shard.sharding;
    assert_eq!(
        (
            s.param_shard_axes(),
            s.grad_shard_axes(),
            s.optimizer_shard_axes()
        ),
        (&[0][..], &[0][..], &[0][..])
    );
    assert_eq!(s.gradient_reduction(), GradientReduction::WhereBorn);
    let s = &zero1.sharding;
    assert_eq!(
        (
            s.param_shard_axes(),
            s.grad_shard_axes(),
            s.optimizer_shard_axes()
        ),
        (&[][..], &[][..], &[0][..])
    );
    assert_eq!(s.gradient_reduction(), GradientReduction::AtSync);
    assert_eq!(
        last,
        &RankPolicy {
            grad_reduce_dtype: Some(BF16),
            ..zero1.clone()
        }
    );
}
