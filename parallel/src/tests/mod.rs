//! The crate's unit tests, on meshes of thread ranks: every propagation rule against the same op
//! on the full tensors (each input laid out in every placement combination the shapes allow, the
//! op run on `Distributed<Flex>`, the gathered result equal to the plain `Flex` result),
//! redistribution, sharded gradients, and the rank's context. The shared helpers are here.

use crate::*;
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData, activation, module};
use std::sync::Arc;

type F = Flex;
type D = Distributed<Flex>;

/// Run `f` on every rank of `mesh`, ranks as threads; the results in rank order.
fn threads<T: Send>(mesh: &DeviceMesh, f: impl Fn(DistDevice<F>) -> T + Sync) -> Vec<T> {
    launch_ranks::<F, _, _>(mesh, &Default::default(), &Default::default(), f).unwrap()
}

fn mesh22() -> DeviceMesh {
    DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap()
}

/// Deterministic values in [-1, 1).
fn values(shape: &[usize], seed: u64) -> TensorData {
    let n: usize = shape.iter().product();
    let mut rng = crate::rng::SplitMix64::new(seed);
    let v: Vec<f32> = (0..n)
        .map(|_| rng.below(2000) as f32 / 1000.0 - 1.0)
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

/// `y`'s data, its global shape (the metadata a rule wrote) checked against the data's.
fn checked_data<B: Backend, const N: usize, K>(y: Tensor<B, N, K>) -> TensorData
where
    K: burn::tensor::BasicOps<B>,
{
    let shape = y.shape().to_vec();
    let data = y.into_data();
    assert_eq!(shape, data.shape.to_vec(), "global shape against data");
    data
}

macro_rules! op1 {
    ($n:literal, |$x:ident| $body:expr) => {{
        struct O;
        impl Op1<$n> for O {
            fn apply<B: Backend>(&self, $x: Tensor<B, $n>) -> TensorData {
                checked_data($body)
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
                checked_data($body)
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
    checked_on_every_rank(&mesh, |device| {
        let (mut checked, mut fails) = (0, Vec::new());
        for layout in &all {
            let value = rank_value(&base, layout, &mesh, device.rank());
            let Some(x) = dist::<N>(&value, layout, device) else {
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
    checked_on_every_rank(&mesh, |device| {
        let (mut checked, mut fails) = (0, Vec::new());
        let plain = Default::default();
        for (l1, l2) in &pairs {
            let va = rank_value(&base_a, l1, &mesh, device.rank());
            let vb = rank_value(&base_b, l2, &mesh, device.rank());
            let (Some(a), Some(b)) = (dist::<N>(&va, l1, device), dist::<M>(&vb, l2, device))
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
}

/// Run `check` on every rank of `mesh`: each returns how many cases it checked and its failures.
/// Asserts that no rank failed; rank 0's count.
fn checked_on_every_rank(
    mesh: &DeviceMesh,
    check: impl Fn(&DistDevice<F>) -> (usize, Vec<String>) + Sync,
) -> usize {
    let results = threads(mesh, |device| check(&device));
    let fails: Vec<&String> = results.iter().flat_map(|(_, f)| f).collect();
    assert!(
        fails.is_empty(),
        "{} failures, first: {:#?}",
        fails.len(),
        &fails[..fails.len().min(5)]
    );
    results[0].0
}

/// The layouts of a rank-`rank` tensor on `mesh` that are global (no `Local` axis).
fn placed_layouts(mesh: &DeviceMesh, rank: usize) -> Vec<Layout> {
    layouts(mesh, rank).into_iter().filter(placed).collect()
}

fn placed(layout: &Layout) -> bool {
    !layout.placements().contains(&Placement::Local)
}

// After the macros above, which they use.
mod gradients;
mod pipeline;
mod rank;
mod redistribute;
mod rules;
