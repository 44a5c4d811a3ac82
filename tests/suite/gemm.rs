//! cuBLASLt GEMMs on CUDA (`wildfire_kernels::gemm`, run by the GPU bench's correctness half,
//! `benches/gpu.sh`): every layout the decorator hands them — row-major, transposed views (the
//! linear backward's `xᵀ` and `wᵀ`), strided batches, broadcast batches, the bias epilogue — in
//! f32, f16 and bf16, against products computed on the host in f64 from the same (rounded)
//! inputs, entry by entry on a sample. Layouts cuBLASLt does not take (a head-transposed batch)
//! fall back to CubeCL's matmul and must still be right. No Burn matmul is the reference: on a
//! fresh machine each of its shapes would be autotuned first.

#![cfg(feature = "cuda")]

use burn::backend::Cuda;
use burn::tensor::{Distribution, FloatDType, Tensor, TensorPrimitive};
use wildfire_kernels::cube::blas;
use wildfire_kernels::gemm;

type C = Cuda;

fn prim<const D: usize>(t: Tensor<C, D>) -> burn::tensor::ops::FloatTensor<C> {
    t.into_primitive().tensor()
}

fn host<const D: usize>(t: &Tensor<C, D>) -> Vec<f32> {
    t.clone()
        .cast(FloatDType::F32)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap()
}

/// `[batch, rows, cols]` values of `t` (any strides: read through Burn) as row-major f32.
fn dense<const D: usize>(t: &Tensor<C, D>) -> (Vec<f32>, Vec<usize>) {
    (host(t), t.dims().to_vec())
}

/// Sampled entries of `out = lhs @ rhs (+ bias)` (batch dims broadcast) against f64 sums of the
/// same f32-read inputs: `|got − ref| ≤ rtol·(|ref| + √k)`.
fn check<const D: usize>(
    what: &str,
    lhs: &Tensor<C, D>,
    rhs: &Tensor<C, D>,
    bias: Option<&Tensor<C, 1>>,
    got: Tensor<C, D>,
    rtol: f64,
) {
    let ((l, ld), (r, rd)) = (dense(lhs), dense(rhs));
    let (o, od) = dense(&got);
    let b = bias.map(host);
    let d = od.len();
    let (m, k, n) = (ld[d - 2], ld[d - 1], rd[d - 1]);
    let batch: usize = od[..d - 2].iter().product();
    let index = |dims: &[usize], mut flat: usize| {
        // The operand's batch offset for the output's batch index `flat` (size-1 dims broadcast).
        let mut offset = 0;
        let mut stride = dims[d - 2] * dims[d - 1];
        for i in (0..d - 2).rev() {
            let at = flat % od[i];
            flat /= od[i];
            if dims[i] > 1 {
                offset += at * stride;
            }
            stride *= dims[i];
        }
        offset
    };
    let samples = 400.min(batch * m * n);
    let mut worst = 0f64;
    for s in 0..samples {
        // Spread over the output, corners included.
        let e = if s + 1 == samples {
            batch * m * n - 1
        } else {
            (s * 7_919_993) % (batch * m * n)
        };
        let (bi, i, j) = (e / (m * n), (e / n) % m, e % n);
        let (lo, ro) = (index(&ld, bi), index(&rd, bi));
        let mut want: f64 = (0..k)
            .map(|p| l[lo + i * k + p] as f64 * r[ro + p * n + j] as f64)
            .sum();
        if let Some(b) = &b {
            want += b[j] as f64;
        }
        let diff = (o[e] as f64 - want).abs() / (want.abs() + (k as f64).sqrt());
        worst = worst.max(diff);
        assert!(
            o[e].is_finite() && diff <= rtol,
            "{what}: entry {e} ({bi}, {i}, {j}) got {} want {want} (rel {diff:.2e} > {rtol:.0e})",
            o[e]
        );
    }
    eprintln!("{what}: {samples} entries, worst rel {worst:.2e}");
}

/// `lhs @ rhs` through `gemm::matmul`.
fn matmul<const D: usize>(lhs: &Tensor<C, D>, rhs: &Tensor<C, D>) -> Tensor<C, D> {
    let out = gemm::matmul::<C>(prim(lhs.clone()), prim(rhs.clone()));
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

fn random<const D: usize>(shape: [usize; D], dtype: FloatDType) -> Tensor<C, D> {
    Tensor::<C, D>::random(shape, Distribution::Normal(0.0, 1.0), &Default::default()).cast(dtype)
}

fn rtol(dtype: FloatDType) -> f64 {
    match dtype {
        FloatDType::F32 => 1e-5,
        FloatDType::F16 => 2e-3,
        _ => 1e-2,
    }
}

/// Every layout the decorator hands `gemm`, in each dtype; the cuBLASLt path ran where it should
/// (its call count) and not where it falls back.
#[test]
fn cuda_tensor_core_gemm_matches_host_products() {
    assert!(blas::enabled(), "cuBLASLt loads on this machine");
    for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
        let tol = rtol(dtype);
        let before = blas::calls();
        // Row-major [m, k] @ [k, n], odd sizes.
        let (x, w) = (random([37, 70], dtype), random([70, 45], dtype));
        let got = matmul(&x, &w);
        check(
            &format!("{dtype:?} [37,70]@[70,45]"),
            &x,
            &w,
            None,
            got,
            tol,
        );
        // The linear layer with its bias epilogue, GPT-2's qkv shape.
        let (x, w, b) = (
            random([1024, 768], dtype),
            random([768, 2304], dtype),
            random([2304], dtype),
        );
        let got = Tensor::from_primitive(TensorPrimitive::Float(gemm::linear::<C>(
            prim(x.clone()),
            prim(w.clone()),
            Some(prim(b.clone())),
        )));
        check(
            &format!("{dtype:?} linear + bias"),
            &x,
            &w,
            Some(&b),
            got,
            tol,
        );
        // Its backward products: g @ wᵀ and xᵀ @ g (transposed views, no copies).
        let g = random([1024, 2304], dtype);
        let dx = Tensor::from_primitive(TensorPrimitive::Float(gemm::linear_x_backward::<C>(
            prim(w.clone()),
            prim(g.clone()),
        )));
        check(
            &format!("{dtype:?} g @ wT"),
            &g,
            &w.clone().transpose(),
            None,
            dx,
            tol,
        );
        let dw = Tensor::from_primitive(TensorPrimitive::Float(gemm::linear_weight_backward::<C>(
            prim(x.clone()),
            prim(g.clone()),
        )));
        check(
            &format!("{dtype:?} xT @ g"),
            &x.clone().transpose(),
            &g,
            None,
            dw,
            tol,
        );
        // The weight gradient under a 16-bit compute dtype, written in f32 by the GEMM itself:
        // the f32 accumulator of the rounded inputs, so within f32's tolerance of the f64 sums
        // (a bf16 output would be 1e-2 off), and in f32.
        let mut mixed = 0;
        if dtype != FloatDType::F32 {
            let dw = Tensor::<C, 2>::from_primitive(TensorPrimitive::Float(
                gemm::linear_weight_backward_into::<C>(
                    prim(x.clone()),
                    prim(g.clone()),
                    Some(FloatDType::F32),
                ),
            ));
            assert_eq!(
                dw.dtype(),
                burn::tensor::DType::F32,
                "{dtype:?}: an f32 gradient"
            );
            check(
                &format!("{dtype:?} xT @ g into f32"),
                &x.clone().transpose(),
                &g,
                None,
                dw,
                1e-4,
            );
            mixed = 1;
        }
        // Both operands transposed views.
        let (a, c) = (random([64, 48], dtype), random([80, 64], dtype));
        let (at, ct) = (a.transpose(), c.transpose());
        let got = matmul(&at, &ct);
        check(&format!("{dtype:?} aT @ cT"), &at, &ct, None, got, tol);
        // Strided batch [2, 3, m, k] @ [2, 3, k, n], and a broadcast right side [1, 1, k, n].
        let (p, q) = (random([2, 3, 33, 40], dtype), random([2, 3, 40, 24], dtype));
        let got = matmul(&p, &q);
        check(&format!("{dtype:?} batched"), &p, &q, None, got, tol);
        let q1 = random([1, 1, 40, 24], dtype);
        let got = matmul(&p, &q1);
        check(&format!("{dtype:?} broadcast"), &p, &q1, None, got, tol);
        assert_eq!(
            blas::calls() - before,
            7 + mixed,
            "{dtype:?}: every product above ran on cuBLASLt"
        );
    }
    // A head-transposed batch ([b, t, h, d] seen as [b, h, t, d]): not one batch stride, so
    // CubeCL's matmul runs it — still right (f32 only: CubeCL tunes each new shape first). Its
    // f32 GEMMs take TF32 tensor cores where the GPU has them (an H200 gave a relative error of
    // 1.3e-4 here): the tolerance is TF32's (10 fraction bits), not f32's.
    let before = blas::calls();
    let s = random([2, 16, 3, 32], FloatDType::F32).swap_dims(1, 2);
    let kt = random([2, 3, 32, 16], FloatDType::F32);
    let got = matmul(&s, &kt);
    check("F32 head-transposed (fallback)", &s, &kt, None, got, 2e-3);
    assert_eq!(blas::calls(), before, "the fallback took it");
}
