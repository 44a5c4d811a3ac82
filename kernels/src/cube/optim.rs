//! The optimizer tail: unscale + Σg² + non-finite flag in one pass, then AdamW predicated on the
//! flag (read on the device).

use super::reduce::cube_sum;
use super::{Cb, arg, as_dtype, empty, empty_f32, empty_like, launched};
use crate::AdamWStep;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

/// The unscale over `count` gradients of one dtype in one launch (the optimizer tail's
/// multi-tensor form, as PyTorch's `_amp_foreach_non_finite_check_and_unscale_`): gradient `k`
/// takes cubes `first_cube[k]..first_cube[k + 1]`, its units striding over its `lens[k]`
/// elements, so its partials do not depend on the others in the launch. Each unit writes the
/// unscaled values (with `write`; without — an `inv_scale` of 1, whose values are the
/// gradient's own — nothing is bound to `outputs`); each cube's `Σ g²` (divided by `copies[k]`,
/// the gradient's number of copies over the mesh) and non-finite count go to
/// `partial_sq[offset + cube]` and `partial_bad[offset + cube]`, a non-finite value checked in
/// the gradient's own dtype (an f16 overflow is caught). A cube's gradient is uniform over the
/// cube, so the branches below are too.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn unscale_many_kernel<F: Float>(
    grads: &Sequence<Tensor<F>>,
    outputs: &mut Sequence<Tensor<F>>,
    partial_sq: &mut Tensor<f32>,
    partial_bad: &mut Tensor<f32>,
    first_cube: &Sequence<u32>,
    lens: &Sequence<u32>,
    copies: &Sequence<f32>,
    offset: u32,
    inv_scale: f32,
    #[comptime] count: usize,
    #[comptime] block: usize,
    #[comptime] write: bool,
    #[define(F)] _dtype: StorageType,
) {
    let tid = UNIT_POS_X as usize;
    let cube = CUBE_POS_X;
    let mut shared = SharedMemory::<f32>::new(block);
    let mut acc = f32::new(0.0);
    let mut flag = f32::new(0.0);
    let mut div = f32::new(1.0);
    #[unroll]
    for k in 0..count {
        let start = *first_cube.index(k);
        let end = *first_cube.index(k + 1);
        if cube >= start && cube < end {
            let grad = grads.index(k);
            let len = *lens.index(k) as usize;
            let stride = ((end - start) * CUBE_DIM_X) as usize;
            let mut i = (cube - start) as usize * CUBE_DIM_X as usize + tid;
            while i < len {
                let g = f32::cast_from(grad[i]) * inv_scale;
                let out = F::cast_from(g);
                let back = f32::cast_from(out);
                if f32::is_nan(back) || f32::is_inf(back) {
                    flag = f32::new(1.0);
                }
                if write {
                    let o = outputs.index_mut(k);
                    o[i] = out;
                }
                acc += g * g;
                i += stride;
            }
            div = *copies.index(k);
        }
    }
    let sq = cube_sum(&mut shared, acc);
    let bad = cube_sum(&mut shared, flag);
    if tid == 0 {
        partial_sq[(offset + cube) as usize] = sq / div;
        partial_bad[(offset + cube) as usize] = bad;
    }
}

/// One cube folds the step's partial buffers: `out = [any non-finite (1 or 0), Σ partial_sq]`,
/// each unit striding over the partials in a fixed order, then a tree sum (deterministic).
#[cube(launch)]
fn unscale_total_kernel(
    partial_sq: &Tensor<f32>,
    partial_bad: &Tensor<f32>,
    out: &mut Tensor<f32>,
    len: u32,
    #[comptime] block: usize,
) {
    let tid = UNIT_POS_X as usize;
    let mut shared = SharedMemory::<f32>::new(block);
    let mut acc = f32::new(0.0);
    let mut bad = f32::new(0.0);
    let mut i = tid;
    while i < len as usize {
        acc += partial_sq[i];
        bad += partial_bad[i];
        i += block;
    }
    let sq = cube_sum(&mut shared, acc);
    let bad = cube_sum(&mut shared, bad);
    if tid == 0 {
        out[0] = select(bad > f32::new(0.0), f32::new(1.0), f32::new(0.0));
        out[1] = sq;
    }
}

/// AdamW over `count` parameters of one dtype and one step in one launch (a multi-tensor AdamW,
/// as PyTorch's `fused=True`; a single parameter's step is a launch with `count` 1): parameter
/// `k` takes cubes `first_cube[k]..first_cube[k + 1]`, its units striding over its `lens[k]`
/// elements — so a parameter's result does not depend on the others in its launch. With
/// `with_copy` the new parameter also goes to `copies[k]` in its dtype `C` (the compute dtype's
/// copy); `copies` is bound only then.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn adamw_many_kernel<F: Float, C: Float>(
    params: &Sequence<Tensor<F>>,
    grads: &Sequence<Tensor<F>>,
    ms: &Sequence<Tensor<F>>,
    vs: &Sequence<Tensor<F>>,
    grad_scale: &Tensor<F>,
    skip: &Tensor<F>,
    param_outs: &mut Sequence<Tensor<F>>,
    m_outs: &mut Sequence<Tensor<F>>,
    v_outs: &mut Sequence<Tensor<F>>,
    copies: &mut Sequence<Tensor<C>>,
    first_cube: &Sequence<u32>,
    lens: &Sequence<u32>,
    lr: f32,
    beta1: f32,
    beta2: f32,
    epsilon: f32,
    decay: f32,
    correction1: f32,
    correction2: f32,
    #[comptime] count: usize,
    #[comptime] with_copy: bool,
    #[define(F, C)] _dtypes: [StorageType; 2],
) {
    let cube = CUBE_POS_X;
    let skipped = f32::cast_from(skip[0]) != f32::new(0.0);
    let scale = f32::cast_from(grad_scale[0]);
    #[unroll]
    for k in 0..count {
        let start = *first_cube.index(k);
        let end = *first_cube.index(k + 1);
        if cube >= start && cube < end {
            let (param, grad, m, v) = (params.index(k), grads.index(k), ms.index(k), vs.index(k));
            let len = *lens.index(k) as usize;
            let stride = ((end - start) * CUBE_DIM_X) as usize;
            let mut i = (cube - start) as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
            while i < len {
                let (p0, m0, v0) = (param[i], m[i], v[i]);
                // The inputs as they are where the step is skipped (an overflow), else the f32
                // update (`decay` is `1 − lr·wd`, `correction1/2` the bias corrections).
                let mut p1 = p0;
                let mut m1 = m0;
                let mut v1 = v0;
                if !skipped {
                    let g = f32::cast_from(grad[i]) * scale;
                    let m_new = beta1 * f32::cast_from(m0) + (f32::new(1.0) - beta1) * g;
                    let v_new = beta2 * f32::cast_from(v0) + (f32::new(1.0) - beta2) * g * g;
                    let m_hat = m_new / correction1;
                    let v_hat = v_new / correction2;
                    let p = f32::cast_from(p0);
                    p1 = F::cast_from(p * decay - lr * m_hat / (f32::sqrt(v_hat) + epsilon));
                    m1 = F::cast_from(m_new);
                    v1 = F::cast_from(v_new);
                }
                let po = param_outs.index_mut(k);
                po[i] = p1;
                let mo = m_outs.index_mut(k);
                mo[i] = m1;
                let vo = v_outs.index_mut(k);
                vo[i] = v1;
                if with_copy {
                    let c = copies.index_mut(k);
                    c[i] = C::cast_from(p1);
                }
                i += stride;
            }
        }
    }
}

/// `(grad · inv_scale, Σ g², non-finite flag)`, the last two `[1]` f32.
pub(super) fn unscale<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    grad: CubeTensor<R>,
    inv_scale: f64,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let (mut output, partial_sq, partial_bad) = unscale_partials(vec![grad], &[1], inv_scale);
    let sum_squares = Cb::<R, F, I, BT>::float_sum(partial_sq);
    let non_finite = Cb::<R, F, I, BT>::float_max(partial_bad);
    (output.remove(0), sum_squares, non_finite)
}

/// Units per cube of the unscale kernels.
const UNSCALE_BLOCK: usize = 256;

/// The unscale kernel's cubes for `grad`: enough to fill a GPU, each unit covering several
/// elements.
fn unscale_cubes<R: CubeRuntime>(grad: &CubeTensor<R>) -> usize {
    grad.shape()
        .num_elements()
        .div_ceil(UNSCALE_BLOCK * 8)
        .clamp(1, 1024)
}

/// [`crate::FusedOps::fused_unscale_all`]: every gradient's cube partials in one pair of
/// buffers ([`unscale_partials`]), then one cube folds them.
pub(super) fn unscale_all<R: CubeRuntime>(
    grads: Vec<CubeTensor<R>>,
    copies: &[usize],
    inv_scale: f64,
) -> (Vec<CubeTensor<R>>, CubeTensor<R>) {
    assert_eq!(grads.len(), copies.len(), "a copy count per gradient");
    assert!(!grads.is_empty(), "fused_unscale_all of no gradient");
    let (outputs, partial_sq, partial_bad) = unscale_partials(grads, copies, inv_scale);
    let total = partial_sq.shape().num_elements();
    let stats = empty_f32(&partial_sq, [2]);
    unscale_total_kernel::launch::<R>(
        &partial_sq.client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(UNSCALE_BLOCK as u32),
        arg(&partial_sq),
        arg(&partial_bad),
        arg(&stats),
        total as u32,
        UNSCALE_BLOCK,
    );
    launched(1);
    (outputs, stats)
}

/// The unscale of `grads` (each `Σ g²` divided by its `copies`): the unscaled gradients (the
/// gradients themselves where `inv_scale` is 1: the kernel only reads) and every gradient's
/// cube partials, in order, in one pair of f32 buffers `(Σ g², non-finite count)`. The
/// gradients go [`UNSCALE_CHUNK`] at a time at most (runs of one dtype, in order) through
/// [`unscale_many_kernel`], so a step of 149 gradients is five launches on CUDA, where a launch
/// per gradient was 149 — each launch a host submission and a kernel boundary on a step that
/// waits on its host. A gradient's partials are what a launch of its own gives, bit for bit.
fn unscale_partials<R: CubeRuntime>(
    grads: Vec<CubeTensor<R>>,
    copies: &[usize],
    inv_scale: f64,
) -> (Vec<CubeTensor<R>>, CubeTensor<R>, CubeTensor<R>) {
    let grads: Vec<_> = grads.into_iter().map(into_contiguous).collect();
    let cubes: Vec<u32> = grads.iter().map(|g| unscale_cubes(g) as u32).collect();
    let total: u32 = cubes.iter().sum();
    let partial_sq = empty_f32(&grads[0], [total as usize]);
    let partial_bad = empty_like(&partial_sq);
    let write = inv_scale != 1.0;
    let chunk = unscale_chunk(&grads[0], write);
    let mut outputs = Vec::with_capacity(grads.len());
    let (mut first, mut offset) = (0, 0);
    while first < grads.len() {
        let dtype = grads[first].dtype;
        let mut last = first + 1;
        while last < grads.len() && last - first < chunk && grads[last].dtype == dtype {
            last += 1;
        }
        let run = &grads[first..last];
        let outs: Vec<_> = if write {
            run.iter().map(empty_like).collect()
        } else {
            Vec::new()
        };
        let first_cube = first_cubes(&cubes[first..last]);
        let at = first_cube[run.len()];
        // SAFETY: gradient `k`'s units index `i < lens[k]`, its own length (and its output's,
        // a tensor of its shape); the partials at `offset + cube` lie inside the `total`
        // elements, since the launch's cubes are its gradients' `cubes` counted from `offset`.
        unsafe {
            unscale_many_kernel::launch_unchecked::<R>(
                &run[0].client,
                CubeCount::Static(at, 1, 1),
                CubeDim::new_1d(UNSCALE_BLOCK as u32),
                run.iter().map(arg).collect(),
                outs.iter().map(arg).collect(),
                arg(&partial_sq),
                arg(&partial_bad),
                first_cube.into_iter().collect(),
                run.iter()
                    .map(|g| g.shape().num_elements() as u32)
                    .collect(),
                copies[first..last].iter().map(|&c| c as f32).collect(),
                offset,
                inv_scale as f32,
                run.len(),
                UNSCALE_BLOCK,
                write,
                dtype.into(),
            );
        }
        launched(1);
        offset += at;
        if write {
            outputs.extend(outs);
        } else {
            outputs.extend(run.iter().cloned());
        }
        first = last;
    }
    (outputs, partial_sq, partial_bad)
}

/// Gradients per [`unscale_many_kernel`] launch on `like`'s device: a gradient's binding, and
/// its output's where the kernel `write`s ([`per_launch`]), at most [`UNSCALE_CHUNK`].
pub(super) fn unscale_chunk<R: CubeRuntime>(like: &CubeTensor<R>, write: bool) -> usize {
    per_launch(like, if write { 2 } else { 1 }, UNSCALE_CHUNK)
}

/// The most gradients one unscale launch takes (kernel parameters of a few hundred bytes on
/// CUDA; each count is a kernel of its own, compiled once).
const UNSCALE_CHUNK: usize = 32;

/// Tensors per launch of a multi-tensor kernel on `like`'s device, each taking `bindings`
/// buffers: as many as the device binds beside a few shared buffers and the runtime's metadata,
/// from 1 to `most`.
fn per_launch<R: CubeRuntime>(like: &CubeTensor<R>, bindings: usize, most: usize) -> usize {
    let max = like.client.properties().hardware.max_bindings as usize;
    (max.saturating_sub(4) / bindings).clamp(1, most)
}

/// A multi-tensor launch's cube ranges for tensors of `cubes[k]` cubes: tensor `k`'s first cube
/// at `k`, the launch's cube count last.
fn first_cubes(cubes: &[u32]) -> Vec<u32> {
    let mut first = Vec::with_capacity(cubes.len() + 1);
    let mut at = 0;
    for &c in cubes {
        first.push(at);
        at += c;
    }
    first.push(at);
    first
}

/// `(param, m, v)` after one AdamW step (the inputs where `skip` is non-zero), every operand
/// taken in the parameter's dtype; with `copy`, also the new parameter in that dtype, written by
/// the same pass: [`adamw_many`] of one entry.
pub(super) fn adamw<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    operands: [CubeTensor<R>; 6],
    step: AdamWStep,
    copy: Option<DType>,
) -> ([CubeTensor<R>; 3], Option<CubeTensor<R>>) {
    let [param, grad, m, v, grad_scale, skip] = operands;
    let entry = crate::AdamWEntry {
        operands: [param, grad, m, v],
        step,
        copy: copy.map(burn::tensor::FloatDType::from),
    };
    let (out, copy) = adamw_many::<R, F, I, BT>(vec![entry], grad_scale, skip)
        .pop()
        .expect("one entry, one result");
    ([out.param, out.m, out.v], copy)
}

/// The AdamW kernels' f32 scalars of `step`: `[lr, β₁, β₂, ε, 1 − lr·wd, 1 − β₁ᵗ, 1 − β₂ᵗ]`.
fn step_scalars(step: &AdamWStep) -> [f32; 7] {
    let t = step.step.max(1) as i32;
    [
        step.lr as f32,
        step.beta1 as f32,
        step.beta2 as f32,
        step.epsilon as f32,
        (1.0 - step.lr * step.weight_decay) as f32,
        (1.0 - step.beta1.powi(t)) as f32,
        (1.0 - step.beta2.powi(t)) as f32,
    ]
}

/// [`crate::FusedOps::fused_adamw_many`]: runs of entries with one parameter dtype, step and copy
/// dtype, [`adamw_chunk`] at a time, each run one [`adamw_many_kernel`] launch; the results in
/// the entries' order, each what a launch of its own gives, bit for bit.
pub(super) fn adamw_many<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    entries: Vec<crate::AdamWEntry<Cb<R, F, I, BT>>>,
    grad_scale: CubeTensor<R>,
    skip: CubeTensor<R>,
) -> Vec<crate::AdamWResult<Cb<R, F, I, BT>>> {
    let mut out = Vec::with_capacity(entries.len());
    let mut entries = entries.into_iter().peekable();
    while let Some(first) = entries.next() {
        let dtype = first.operands[0].dtype;
        let copy = first.copy.map(DType::from);
        let chunk = adamw_chunk(&first.operands[0], copy.is_some());
        let step = first.step;
        let mut run = vec![first];
        while run.len() < chunk
            && entries.peek().is_some_and(|e| {
                e.operands[0].dtype == dtype && e.step == step && e.copy.map(DType::from) == copy
            })
        {
            run.push(entries.next().expect("peeked"));
        }
        let [scale, skipped] =
            [&grad_scale, &skip].map(|t| as_dtype::<R, F, I, BT>(t.clone(), dtype));
        let operands: Vec<[CubeTensor<R>; 4]> = run
            .into_iter()
            .map(|e| e.operands.map(|t| as_dtype::<R, F, I, BT>(t, dtype)))
            .collect();
        let outputs: Vec<[CubeTensor<R>; 3]> = operands
            .iter()
            .map(|o| [(); 3].map(|_| empty_like(&o[0])))
            .collect();
        let copies: Vec<CubeTensor<R>> = match copy {
            Some(c) => operands
                .iter()
                .map(|o| empty(&o[0], o[0].shape(), c))
                .collect(),
            None => Vec::new(),
        };
        let lens: Vec<u32> = operands
            .iter()
            .map(|o| o[0].shape().num_elements() as u32)
            .collect();
        let cubes: Vec<u32> = lens
            .iter()
            .map(|&n| (n as usize).div_ceil(ADAMW_BLOCK).clamp(1, ADAMW_CUBES) as u32)
            .collect();
        let first_cube = first_cubes(&cubes);
        let at = first_cube[cubes.len()];
        let ins = |k: usize| operands.iter().map(|o| arg(&o[k])).collect();
        let outs = |k: usize| outputs.iter().map(|o| arg(&o[k])).collect();
        let [lr, beta1, beta2, epsilon, decay, correction1, correction2] = step_scalars(&step);
        let copy_dtype = copy.unwrap_or(dtype);
        // SAFETY: parameter `k`'s units index `i < lens[k]`, its element count, in each of its
        // tensors (operands, outputs and copy all of its shape, contiguous); the scale and skip
        // are read at 0 (`[1]` tensors); `copies` is indexed only `with_copy`, when it holds a
        // tensor per parameter.
        unsafe {
            adamw_many_kernel::launch_unchecked::<R>(
                &operands[0][0].client,
                CubeCount::Static(at, 1, 1),
                CubeDim::new_1d(ADAMW_BLOCK as u32),
                ins(0),
                ins(1),
                ins(2),
                ins(3),
                arg(&scale),
                arg(&skipped),
                outs(0),
                outs(1),
                outs(2),
                copies.iter().map(arg).collect(),
                first_cube.into_iter().collect(),
                lens.into_iter().collect(),
                lr,
                beta1,
                beta2,
                epsilon,
                decay,
                correction1,
                correction2,
                operands.len(),
                copy.is_some(),
                [dtype.into(), copy_dtype.into()],
            );
        }
        launched(1);
        let mut copies = copies.into_iter();
        for [param, m, v] in outputs {
            out.push((crate::AdamWState { param, m, v }, copy.and(copies.next())));
        }
    }
    out
}

/// Units per cube of the multi-tensor AdamW.
const ADAMW_BLOCK: usize = 256;
/// The most cubes one parameter takes in a multi-tensor launch (its units then stride).
const ADAMW_CUBES: usize = 1024;
/// The most parameters one multi-tensor AdamW launch takes.
const ADAMW_CHUNK: usize = 16;

/// Parameters per [`adamw_many_kernel`] launch on `like`'s device: seven bindings a parameter,
/// eight with its copy ([`per_launch`]), at most [`ADAMW_CHUNK`].
pub(super) fn adamw_chunk<R: CubeRuntime>(like: &CubeTensor<R>, with_copy: bool) -> usize {
    per_launch(like, if with_copy { 8 } else { 7 }, ADAMW_CHUNK)
}
