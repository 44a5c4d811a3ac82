//! The Llama family's elementwise kernels: the SwiGLU gate `silu(g)·u` and the rotary position
//! embedding (rotate-half), forward and backward, one unit per output element, f32 arithmetic.

use super::{arg, contiguous, elementwise, empty_like, launched};
use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// `σ(g)`.
#[cube]
fn sigmoid(g: f32) -> f32 {
    f32::new(1.0) / (f32::new(1.0) + f32::exp(-g))
}

/// `gate` at element `ABSOLUTE_POS` of `len`, in f32; a unit past the last element stops here.
#[cube]
fn gate_at<F: Float>(gate: &Tensor<F>, len: u32) -> f32 {
    if ABSOLUTE_POS >= len as usize {
        terminate!();
    }
    f32::cast_from(gate[ABSOLUTE_POS])
}

#[cube(launch)]
fn swiglu_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    output: &mut Tensor<F>,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let g = gate_at::<F>(gate, len);
    let u = f32::cast_from(up[ABSOLUTE_POS]);
    output[ABSOLUTE_POS] = F::cast_from(g * sigmoid(g) * u);
}

/// `dup = dy·g·σ(g)`, `dgate = dy·u·σ(g)·(1 + g·(1 − σ(g)))`.
#[cube(launch)]
fn swiglu_backward_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    dy: &Tensor<F>,
    dgate: &mut Tensor<F>,
    dup: &mut Tensor<F>,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let g = gate_at::<F>(gate, len);
    let d = f32::cast_from(dy[ABSOLUTE_POS]);
    let u = f32::cast_from(up[ABSOLUTE_POS]);
    let s = sigmoid(g);
    dup[ABSOLUTE_POS] = F::cast_from(d * g * s);
    dgate[ABSOLUTE_POS] = F::cast_from(d * u * s * (f32::new(1.0) + g * (f32::new(1.0) - s)));
}

/// Element `ABSOLUTE_POS` of `x` `[…, t, hd]` against table row `p` (its position):
/// `y₁ = x₁c₁ − x₂s₁`, `y₂ = x₂c₂ + x₁s₂`; with `transpose` `y₁ = x₁c₁ + x₂s₂`,
/// `y₂ = x₂c₂ − x₁s₁`.
#[cube(launch)]
fn rope_kernel<F: Float>(
    x: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    output: &mut Tensor<F>,
    len: u32,
    seq: u32,
    hd: u32,
    #[comptime] transpose: bool,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= len as usize {
        terminate!();
    }
    let (seq, hd) = (seq as usize, hd as usize);
    let half = hd / 2;
    let i = ABSOLUTE_POS % hd;
    let row = (ABSOLUTE_POS / hd) % seq * hd;
    let own = f32::cast_from(x[ABSOLUTE_POS]) * f32::cast_from(cos[row + i]);
    // The partner element in the other half, and the signed sine it is scaled by.
    let lower = i < half;
    let partner = if lower {
        ABSOLUTE_POS + half
    } else {
        ABSOLUTE_POS - half
    };
    let at = if comptime!(transpose) {
        if lower {
            row + i + half
        } else {
            row + i - half
        }
    } else {
        row + i
    };
    let sign = if lower == comptime!(transpose) {
        f32::new(1.0)
    } else {
        f32::new(-1.0)
    };
    let y = own + sign * f32::cast_from(x[partner]) * f32::cast_from(sin[at]);
    output[ABSOLUTE_POS] = F::cast_from(y);
}

/// `silu(gate)·up`.
pub(super) fn swiglu<R: CubeRuntime>(gate: CubeTensor<R>, up: CubeTensor<R>) -> CubeTensor<R> {
    let [gate, up] = contiguous([gate, up]);
    let len = gate.shape().num_elements();
    let out = empty_like(&gate);
    let (count, dim) = elementwise(&gate, len);
    swiglu_kernel::launch::<R>(
        &gate.client,
        count,
        dim,
        arg(&gate),
        arg(&up),
        arg(&out),
        len as u32,
        gate.dtype.into(),
    );
    launched(1);
    out
}

/// `(dgate, dup)`.
pub(super) fn swiglu_backward<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [gate, up, dy] = contiguous([gate, up, dy]);
    let len = gate.shape().num_elements();
    let (dgate, dup) = (empty_like(&gate), empty_like(&up));
    let (count, dim) = elementwise(&gate, len);
    swiglu_backward_kernel::launch::<R>(
        &gate.client,
        count,
        dim,
        arg(&gate),
        arg(&up),
        arg(&dy),
        arg(&dgate),
        arg(&dup),
        len as u32,
        gate.dtype.into(),
    );
    launched(1);
    (dgate, dup)
}

/// The rotary embedding of `x` `[b, h, t, hd]` with tables `[t, hd]` (or, with `transpose`,
/// its gradient map).
pub(super) fn rope<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    transpose: bool,
) -> CubeTensor<R> {
    let [x, cos, sin] = contiguous([x, cos, sin]);
    let shape = x.shape();
    let (seq, hd) = (shape[2], shape[3]);
    let len = shape.num_elements();
    let out = empty_like(&x);
    let (count, dim) = elementwise(&x, len);
    rope_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        arg(&x),
        arg(&cos),
        arg(&sin),
        arg(&out),
        len as u32,
        seq as u32,
        hd as u32,
        transpose,
        x.dtype.into(),
    );
    launched(1);
    out
}
