//! Dense products for any backend: cuBLASLt on Burn's CUDA backend (feature `cuda`,
//! [`cube::blas`](crate::cube::blas)), Burn's own `float_matmul` / `linear` everywhere else and
//! for what cuBLASLt does not take. The `Distributed` decorator runs its matmuls and linear
//! layers (forward and both backward products) through these, so `Autodiff<Distributed<Cuda>>`
//! trains on cuBLASLt with no change to the model. (`Fusion<Cuda>`'s tensors live in Burn's fusion
//! stream: its GEMMs stay CubeCL's.)

#[cfg(feature = "cuda")]
use burn::tensor::Shape;
use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

/// `lhs @ rhs`, as Burn's `float_matmul` (batch dims broadcast).
pub fn matmul<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    #[cfg(feature = "cuda")]
    let (lhs, rhs) = if cuda::is_cuda::<B>() {
        use cuda::{from, to};
        let (l, r) = (to::<B>(lhs), to::<B>(rhs));
        match crate::cube::blas::matmul(&l, &r) {
            Some(out) => return from::<B>(out),
            None => (from::<B>(l), from::<B>(r)),
        }
    } else {
        (lhs, rhs)
    };
    B::float_matmul(lhs, rhs)
}

/// Whether [`matmul`] runs cuBLASLt on this backend (the linear layers then take it too).
pub fn uses_blas<B: Backend>() -> bool {
    #[cfg(feature = "cuda")]
    if cuda::is_cuda::<B>() && crate::cube::blas::enabled() {
        return true;
    }
    false
}

/// `x [rows, k] @ w [k, n] + bias`, as Burn's `linear`; on cuBLASLt the bias is the GEMM's
/// epilogue.
pub fn linear<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    if !uses_blas::<B>() || x.shape().num_dims() != 2 {
        return B::linear(x, w, bias);
    }
    #[cfg(feature = "cuda")]
    {
        use cuda::{from, to};
        let (x, w, bias) = (to::<B>(x), to::<B>(w), bias.map(to::<B>));
        if let Some(out) = crate::cube::blas::matmul_bias(&x, &w, bias.as_ref()) {
            return from::<B>(out);
        }
        let (x, w, bias) = (from::<B>(x), from::<B>(w), bias.map(from::<B>));
        let out = matmul::<B>(x, w);
        match bias {
            Some(b) => {
                let n = b.shape()[0];
                B::float_add(out, B::float_reshape(b, Shape::new([1, n])))
            }
            None => out,
        }
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("cuBLASLt is a CUDA build's")
}

/// `g [rows, n] @ wᵀ`, as Burn's `linear_x_backward` (the transpose a strided view).
pub fn linear_x_backward<B: Backend>(w: FloatTensor<B>, g: FloatTensor<B>) -> FloatTensor<B> {
    if !uses_blas::<B>() || g.shape().num_dims() != 2 {
        return B::linear_x_backward(w, g);
    }
    matmul::<B>(g, B::float_swap_dims(w, 0, 1))
}

/// `xᵀ @ g` for `x [rows, k]`, `g [rows, n]`, as Burn's `linear_weight_backward`.
pub fn linear_weight_backward<B: Backend>(x: FloatTensor<B>, g: FloatTensor<B>) -> FloatTensor<B> {
    if !uses_blas::<B>() || x.shape().num_dims() != 2 {
        return B::linear_weight_backward(x, g);
    }
    matmul::<B>(B::float_swap_dims(x, 0, 1), g)
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::backend::Backend;
    use burn::tensor::ops::FloatTensor;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::cuda::CudaRuntime;
    use std::any::{Any, TypeId};

    /// Whether `B`'s float tensors are CUDA CubeCL tensors (`CubeBackend<CudaRuntime, …>`).
    pub(super) fn is_cuda<B: Backend>() -> bool {
        TypeId::of::<FloatTensor<B>>() == TypeId::of::<CubeTensor<CudaRuntime>>()
    }

    type T = CubeTensor<CudaRuntime>;

    /// One type's move to the same type under another name (checked by `TypeId`).
    fn cast<A: 'static, C: 'static>(a: A) -> C {
        let boxed: Box<dyn Any> = Box::new(a);
        *boxed
            .downcast::<C>()
            .unwrap_or_else(|_| unreachable!("the caller checked is_cuda: one type"))
    }

    /// A float tensor of `B` as the CUDA tensor it is (the caller checked [`is_cuda`]).
    pub(super) fn to<B: Backend>(t: FloatTensor<B>) -> T {
        cast(t)
    }

    /// A CUDA tensor as a float tensor of `B` (the caller checked [`is_cuda`]).
    pub(super) fn from<B: Backend>(t: T) -> FloatTensor<B> {
        cast(t)
    }
}
