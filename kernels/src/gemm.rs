//! Dense products for any backend: cuBLASLt on Burn's CUDA backend (feature `cuda`,
//! [`cube::blas`](crate::cube::blas)), Burn's own `float_matmul` / `linear` everywhere else and
//! for what cuBLASLt does not take. The `Distributed` decorator runs its matmuls and linear
//! layers (forward and both backward products) through these, so `Autodiff<Distributed<Cuda>>`
//! trains on cuBLASLt with no change to the model. (`Fusion<Cuda>`'s tensors live in Burn's fusion
//! stream: its GEMMs stay CubeCL's.)
//!
//! On Flex, the f32 products of two matrices call the `gemm` crate as Burn's `float_matmul` does
//! — the same arguments, so the same numbers bit for bit — into an output that is not zeroed
//! first: Burn's allocates it with `vec![0; n]` and the product then overwrites every element
//! (the zeroing was 6% of a step of nanoGPT's shakespeare-char model on 2 cores). A product of
//! one row (a generated token) where `gemm` would run its single-threaded matrix–vector path
//! runs [`flex::gemv`](crate::flex)'s kernels instead: the same operations in the same order, so
//! the same bits, its columns split over the rank's pool.

use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorPrimitive};
use std::any::TypeId;

/// Whether `B`'s float tensors are `C`.
fn tensors_are<B: Backend, C: 'static>() -> bool {
    TypeId::of::<FloatTensor<B>>() == TypeId::of::<C>()
}

/// One type's move to the same type under another name (`A` and `C` are one type: checked).
fn cast<A: 'static, C: 'static>(a: A) -> C {
    assert!(TypeId::of::<A>() == TypeId::of::<C>(), "one type");
    let a = std::mem::ManuallyDrop::new(a);
    // SAFETY: `A` and `C` are the same type (the `TypeId`s are equal), and `a` is not dropped.
    unsafe { std::mem::transmute_copy::<A, C>(&a) }
}

/// Whether the products run here, not as Burn's ops: cuBLASLt, or Flex's f32 GEMM (`B`'s own
/// tensors: a model on the plain backend, not under the autodiff or the decorator, whose rules
/// call these themselves).
pub fn own_products<B: Backend>() -> bool {
    uses_blas::<B>() || tensors_are::<B, burn_flex::FlexTensor>()
}

/// `lhs @ rhs`, as Burn's `float_matmul` (batch dims broadcast).
pub fn matmul<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    if tensors_are::<B, burn_flex::FlexTensor>() {
        let (l, r): (burn_flex::FlexTensor, burn_flex::FlexTensor) = (cast(lhs), cast(rhs));
        return cast(flex::matmul(l, r));
    }
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
    if !own_products::<B>() || x.shape().num_dims() != 2 {
        return B::linear(x, w, bias);
    }
    if tensors_are::<B, burn_flex::FlexTensor>() {
        let (x, w) = (cast(x), cast(w));
        return cast(flex::linear(x, w, bias.map(cast)));
    }
    #[cfg(feature = "cuda")]
    let (x, w, bias) = if uses_blas::<B>() {
        use cuda::{from, to};
        let (x, w, bias) = (to::<B>(x), to::<B>(w), bias.map(to::<B>));
        if let Some(out) = crate::cube::blas::matmul_bias(&x, &w, bias.as_ref()) {
            return from::<B>(out);
        }
        (from::<B>(x), from::<B>(w), bias.map(from::<B>))
    } else {
        (x, w, bias)
    };
    // Burn's `linear` of a matrix: the product, then the bias as a `[1, n]` row.
    let out = matmul::<B>(x, w);
    match bias {
        Some(b) => {
            let n = b.shape()[0];
            B::float_add(out, B::float_reshape(b, Shape::new([1, n])))
        }
        None => out,
    }
}

/// `x · weight + bias` over the last dimension, as Burn's
/// [`module::linear`](burn::tensor::module::linear) (`weight` `[k, n]`, `bias` `[n]`). Where this
/// crate runs the products on `B`'s own tensors ([`own_products`]: a model on plain Flex or CUDA,
/// e.g. generating; not under the autodiff or the decorator, which keep Burn's `linear` and their
/// own rules), the input's rows are one matrix through [`linear`]. Burn's default runs a batched
/// product against the weight broadcast over the leading dimensions, which on Flex copies a
/// transposed weight (a tied table's `tableᵀ`: 154 MB for GPT-2's) at every call and leaves a
/// generated token's one-row product to `gemm`'s single-threaded matrix–vector path.
pub fn linear_layer<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    if D < 2 || !own_products::<B>() {
        return burn::tensor::module::linear(x, weight, bias);
    }
    let mut dims = x.dims();
    let k = dims[D - 1];
    let rows = x.reshape([dims[..D - 1].iter().product::<usize>(), k]);
    let out = linear::<B>(
        rows.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
    );
    dims[D - 1] = out.shape()[1];
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out)).reshape(dims)
}

/// `g [rows, n] @ wᵀ`, as Burn's `linear_x_backward` (the transpose a strided view).
pub fn linear_x_backward<B: Backend>(w: FloatTensor<B>, g: FloatTensor<B>) -> FloatTensor<B> {
    if !own_products::<B>() || g.shape().num_dims() != 2 {
        return B::linear_x_backward(w, g);
    }
    matmul::<B>(g, B::float_swap_dims(w, 0, 1))
}

/// `xᵀ @ g` for `x [rows, k]`, `g [rows, n]`, as Burn's `linear_weight_backward`.
pub fn linear_weight_backward<B: Backend>(x: FloatTensor<B>, g: FloatTensor<B>) -> FloatTensor<B> {
    if !own_products::<B>() || x.shape().num_dims() != 2 {
        return B::linear_weight_backward(x, g);
    }
    matmul::<B>(B::float_swap_dims(x, 0, 1), g)
}

/// [`linear_weight_backward`] with its output in `out` (when given) where the product can write
/// it directly (cuBLASLt: 16-bit operands into an f32 output, the f32 accumulator stored as it
/// is); anything else in the operands' dtype, for the caller to cast. Under a 16-bit compute
/// dtype the decorator asks for the master weights' f32 here: on CUDA the weight gradient's
/// cast (one launch and a pass over the gradient per weight, 49 a GPT-2 step) is gone.
pub fn linear_weight_backward_into<B: Backend>(
    x: FloatTensor<B>,
    g: FloatTensor<B>,
    out: Option<burn::tensor::FloatDType>,
) -> FloatTensor<B> {
    #[cfg(feature = "cuda")]
    if let Some(out) = out.filter(|&o| uses_blas::<B>() && x.dtype() != o.into())
        && x.shape().num_dims() == 2
    {
        use cuda::{from, to};
        let (xt, g) = (to::<B>(B::float_swap_dims(x, 0, 1)), to::<B>(g));
        if let Some(dw) = crate::cube::blas::matmul_as(&xt, &g, out.into()) {
            return from::<B>(dw);
        }
        return matmul::<B>(from::<B>(xt), from::<B>(g));
    }
    #[cfg(not(feature = "cuda"))]
    let _ = out;
    linear_weight_backward::<B>(x, g)
}

/// Burn's `linear_bias_backward` (`Σ g` over every dimension but the last) written in `out`
/// (when given) where a kernel can: on CubeCL's Wgpu and CUDA runtimes f32 partial sums over
/// chunks of rows and one pass adding them (`cube::column_sums`, two launches, deterministic),
/// where Burn's is a strided reduction per leading dimension, one unit per output element, and a
/// cast. Elsewhere Burn's, in `g`'s dtype, for the caller to cast.
pub fn linear_bias_backward_into<B: Backend>(
    g: FloatTensor<B>,
    out: Option<burn::tensor::FloatDType>,
) -> FloatTensor<B> {
    #[cfg(feature = "cube")]
    if g.shape().num_elements() > 0 {
        use crate::cube::column_sums;
        use burn_cubecl::tensor::CubeTensor;
        let dtype = out.map_or(g.dtype(), Into::into);
        #[cfg(feature = "wgpu")]
        if tensors_are::<B, CubeTensor<burn::backend::wgpu::WgpuRuntime>>() {
            return cast(column_sums::<burn::backend::wgpu::WgpuRuntime>(
                cast(g),
                dtype,
            ));
        }
        #[cfg(feature = "cuda")]
        if tensors_are::<B, CubeTensor<cubecl::cuda::CudaRuntime>>() {
            return cast(column_sums::<cubecl::cuda::CudaRuntime>(cast(g), dtype));
        }
    }
    let _ = out;
    B::linear_bias_backward(g)
}

/// `lhs + rhs` where one is f32 and the other 16-bit, in f32 (PyTorch's promotion), as one pass
/// where a kernel can (CubeCL's Wgpu and CUDA runtimes: `cube::add_widened`, bit for bit the
/// cast and the add it replaces); otherwise the operands back, for the caller's cast and add.
#[allow(clippy::type_complexity)]
pub fn add_widened<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
) -> Result<FloatTensor<B>, (FloatTensor<B>, FloatTensor<B>)> {
    use burn::tensor::DType;
    let narrow = |d: DType| matches!(d, DType::F16 | DType::BF16);
    let (dl, dr) = (lhs.dtype(), rhs.dtype());
    let pair = (dl == DType::F32 && narrow(dr)) || (dr == DType::F32 && narrow(dl));
    if !pair || lhs.shape() != rhs.shape() || lhs.shape().num_elements() == 0 {
        return Err((lhs, rhs));
    }
    let (wide, narrow) = if dl == DType::F32 {
        (lhs, rhs)
    } else {
        (rhs, lhs)
    };
    #[cfg(feature = "cube")]
    {
        use burn_cubecl::tensor::CubeTensor;
        #[cfg(feature = "wgpu")]
        if tensors_are::<B, CubeTensor<burn::backend::wgpu::WgpuRuntime>>() {
            return Ok(cast(crate::cube::add_widened::<
                burn::backend::wgpu::WgpuRuntime,
            >(cast(wide), cast(narrow))));
        }
        #[cfg(feature = "cuda")]
        if tensors_are::<B, CubeTensor<cubecl::cuda::CudaRuntime>>() {
            return Ok(cast(crate::cube::add_widened::<cubecl::cuda::CudaRuntime>(
                cast(wide),
                cast(narrow),
            )));
        }
    }
    if dl == DType::F32 {
        Err((wide, narrow))
    } else {
        Err((narrow, wide))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::backend::Backend;
    use burn::tensor::ops::FloatTensor;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::cuda::CudaRuntime;

    /// Whether `B`'s float tensors are CUDA CubeCL tensors (`CubeBackend<CudaRuntime, …>`).
    pub(super) fn is_cuda<B: Backend>() -> bool {
        super::tensors_are::<B, T>()
    }

    type T = CubeTensor<CudaRuntime>;

    /// A float tensor of `B` as the CUDA tensor it is (the caller checked [`is_cuda`]).
    pub(super) fn to<B: Backend>(t: FloatTensor<B>) -> T {
        super::cast(t)
    }

    /// A CUDA tensor as a float tensor of `B` (the caller checked [`is_cuda`]).
    pub(super) fn from<B: Backend>(t: T) -> FloatTensor<B> {
        super::cast(t)
    }
}

mod flex {
    use burn::tensor::{DType, Shape};
    use burn_flex::FlexTensor;

    /// Burn Flex's threshold (`m·n·k`) from which a product runs on its rayon pool.
    const PARALLEL_THRESHOLD: usize = 192 * 192 * 192;
    /// Elements of a bias fill per parallel task (256 KB).
    const PARALLEL_FILL: usize = 1 << 16;

    /// Whether `lhs @ rhs` is a product of two f32 matrices.
    fn plain(lhs: &FlexTensor, rhs: &FlexTensor) -> bool {
        let (ls, rs) = (lhs.layout().shape(), rhs.layout().shape());
        lhs.dtype() == DType::F32
            && rhs.dtype() == DType::F32
            && ls.num_dims() == 2
            && rs.num_dims() == 2
            && ls[1] == rs[0]
    }

    /// `lhs @ rhs`: two f32 matrices by the `gemm` call of Burn Flex's `matmul_2d_strided`
    /// (strides as they are, its parallelism) into an output written once; anything else by
    /// Burn's `float_matmul`.
    pub(super) fn matmul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
        if !plain(&lhs, &rhs) {
            use burn::tensor::ops::FloatTensorOps;
            return burn::backend::Flex::float_matmul(lhs, rhs);
        }
        let n = rhs.layout().shape()[1];
        product(&lhs, &rhs, |m| Vec::with_capacity(m * n), false)
    }

    /// Burn's `linear` of a matrix — the product, then the bias added to each row — with the
    /// bias in the product where that gives the same numbers: the output starts as the bias
    /// rows and `gemm` adds the product to it (`dst = fma(1, Σ, dst)`, one rounding of
    /// `Σ + bias` as Burn's add of the rounded `Σ`), which holds when the product's depth is one
    /// block of `gemm` (`k ≤ 512`: `gemm_common::cache::kernel_params` takes at least 512) and
    /// neither its `k ≤ 2` nor its matrix–vector paths run. That saves the add's pass over the
    /// output (a strided, broadcasting binary op on Flex).
    pub(super) fn linear(x: FlexTensor, w: FlexTensor, bias: Option<FlexTensor>) -> FlexTensor {
        use burn::backend::Flex;
        use burn::tensor::ops::FloatTensorOps;
        let Some(b) = bias else {
            return matmul(x, w);
        };
        let n = b.layout().shape().num_elements();
        let fused = plain(&x, &w) && {
            let (m, [k, cols]) = (x.layout().shape()[0], w.layout().shape().dims::<2>());
            (3..=512).contains(&k) && m >= 2 && n >= 2 && cols == n && b.dtype() == DType::F32
        };
        if !fused {
            return Flex::float_add(matmul(x, w), Flex::float_reshape(b, Shape::new([1, n])));
        }
        let b = b.to_contiguous();
        let b = b.as_slice::<f32>().expect("a contiguous f32 bias");
        let rows = |m: usize| {
            use rayon::prelude::*;
            let mut out = Vec::<f32>::with_capacity(m * n);
            // Rows in parallel past a quarter of a million bytes: the fill writes the whole
            // output, fresh memory, serially a few per cent of a small model's step.
            let rows_per_task = (PARALLEL_FILL / n).max(1);
            out.spare_capacity_mut()[..m * n]
                .par_chunks_mut(rows_per_task * n)
                .with_min_len(1)
                .for_each(|chunk| {
                    for row in chunk.chunks_exact_mut(n) {
                        for (o, &v) in row.iter_mut().zip(b) {
                            o.write(v);
                        }
                    }
                });
            // SAFETY: every one of the `m × n` elements was written above.
            unsafe { out.set_len(m * n) };
            out
        };
        product(&x, &w, rows, true)
    }

    /// The `m × n` product of the f32 matrices `lhs` and `rhs` into the buffer `start(m)` makes:
    /// with `add`, one holding `m × n` values the product is added to; without, an empty one
    /// with room for them, which `gemm` writes without reading.
    fn product(
        lhs: &FlexTensor,
        rhs: &FlexTensor,
        start: impl FnOnce(usize) -> Vec<f32>,
        add: bool,
    ) -> FlexTensor {
        let (l, r) = (lhs.layout(), rhs.layout());
        let (m, k, n) = (l.shape()[0], l.shape()[1], r.shape()[1]);
        let lhs_ptr = lhs.storage::<f32>()[l.start_offset()..].as_ptr();
        let rhs_ptr = rhs.storage::<f32>()[r.start_offset()..].as_ptr();
        let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_THRESHOLD {
            gemm::Parallelism::Rayon(0)
        } else {
            gemm::Parallelism::None
        };
        let mut out = start(m);
        assert!(
            out.capacity() >= m * n && (!add || out.len() == m * n),
            "an m × n buffer"
        );
        let chunks = column_chunks(m, k, n, rayon::current_num_threads());
        if m == 1
            && let Some(weight) = row_weight(r.strides(), rhs_ptr)
            && crate::flex::gemv::gemm_takes(&weight, k, n, l.strides()[1])
        {
            // One row where `gemm` runs a matrix–vector path: the kernels that follow it, at
            // the memory's speed and on the pool (`gemm` runs it on one thread), its columns
            // split as `gemm`'s would be.
            let x: Vec<f32> = (0..k)
                // SAFETY: `lhs`'s layout: its `k` elements, `l.strides()[1]` apart.
                .map(|i| unsafe { *lhs_ptr.offset(i as isize * l.strides()[1]) })
                .collect();
            return crate::flex::float(
                row_times(&x, weight, n, chunks, out, add),
                Shape::new([1, n]),
            );
        }
        // SAFETY: the operands' pointers and strides are their layouts' (in bounds of their
        // buffers, as for Burn's call), and `out` has room for the `m × n` row-major product;
        // a split product's calls each write their own columns of it. With `add` its values are
        // initialised and read; without (`read_dst` false, alpha 0) `gemm` writes every element
        // without reading (`gemm_common::gemm`: alpha status 0; `k` 0 writes zeros) — so
        // `set_len` after it exposes only written values.
        unsafe {
            if chunks > 1 {
                use crate::flex::attention::{Shared, matmul};
                use rayon::prelude::*;
                let (l_cs, l_rs, r_cs, r_rs) = (
                    l.strides()[1],
                    l.strides()[0],
                    r.strides()[1],
                    r.strides()[0],
                );
                let (dst, lhs, rhs) = (
                    Shared(out.as_mut_ptr()),
                    Shared(lhs_ptr.cast_mut()),
                    Shared(rhs_ptr.cast_mut()),
                );
                column_ranges(n, chunks).for_each(|cols| {
                    // Columns `cols` of the product: `cols.start` column strides into `rhs`.
                    let rhs = rhs.get().offset(cols.start as isize * r_cs).cast_const();
                    matmul(
                        [m, cols.len(), k],
                        dst.get().add(cols.start),
                        n as isize,
                        (lhs.get().cast_const(), l_cs, l_rs),
                        (rhs, r_cs, r_rs),
                        1.0,
                        add,
                    );
                });
            } else {
                gemm::gemm(
                    m,
                    n,
                    k,
                    out.as_mut_ptr(),
                    1,
                    n as isize,
                    add,
                    lhs_ptr,
                    l.strides()[1],
                    l.strides()[0],
                    rhs_ptr,
                    r.strides()[1],
                    r.strides()[0],
                    if add { 1.0f32 } else { 0.0f32 },
                    1.0f32,
                    false,
                    false,
                    false,
                    parallelism,
                );
            }
            out.set_len(m * n);
        }
        crate::flex::float(out, Shape::new([m, n]))
    }

    /// The weight of a one-row product as the matrix–vector kernels take it: rows or columns
    /// contiguous (a linear layer's weight, a transposed table); `None` for other strides.
    fn row_weight(strides: &[isize], ptr: *const f32) -> Option<crate::flex::gemv::Weight> {
        use crate::flex::gemv::Weight;
        match *strides {
            [rs, 1] if rs >= 0 => Some(Weight::Rows(ptr, rs as usize)),
            [1, cs] if cs >= 0 => Some(Weight::Columns(ptr, cs as usize)),
            _ => None,
        }
    }

    /// The `1 × n` product `x · W` into `out` (with `add`, onto its `n` values), its columns
    /// in `chunks` ranges on the pool (each output element is computed alone, so any split
    /// gives the same numbers).
    fn row_times(
        x: &[f32],
        weight: crate::flex::gemv::Weight,
        n: usize,
        chunks: usize,
        mut out: Vec<f32>,
        add: bool,
    ) -> Vec<f32> {
        use crate::flex::attention::Shared;
        use rayon::prelude::*;
        let dst = Shared(out.as_mut_ptr());
        // SAFETY: the kernels take the call (checked by the caller); `weight` covers `k × n`
        // (its tensor's layout), `out` has room for `n` (initialised with `add`); each range
        // writes its own columns. Without `add` every element is written, so `set_len` exposes
        // only written values.
        column_ranges(n, chunks).for_each(|cols| unsafe {
            crate::flex::gemv::row_times(x, weight, cols, dst.get(), add);
        });
        unsafe { out.set_len(n) };
        out
    }

    /// `n` columns as `chunks` ranges of whole 16-column groups, on the pool.
    fn column_ranges(
        n: usize,
        chunks: usize,
    ) -> impl rayon::iter::ParallelIterator<Item = std::ops::Range<usize>> {
        use rayon::prelude::*;
        let width = n.div_ceil(chunks).next_multiple_of(16);
        (0..n.div_ceil(width))
            .into_par_iter()
            .map(move |c| c * width..((c + 1) * width).min(n))
    }

    /// Into how many column ranges a product of `m` rows is split over `threads` threads:
    /// `gemm` runs a product of up to 8 rows (a generated token's `1 × k` activations times a
    /// weight) on one thread whatever its parallelism, reading the whole weight there, and
    /// splits one of up to 128 (a prompt, a small batch) poorly — on 2 threads of a Xeon
    /// (AVX-512), single-threaded calls on column ranges ran `64 × 768 × 3072` at 184 GFLOP/s
    /// where `gemm`'s own split ran 82, `32 × 3072 × 768` at 161 against 102, and `128 × 3072 ×
    /// 768` at 218 against 168; from 256 rows they are level. So up to [`FEW_ROWS`] rows a
    /// weight of at least [`SPLIT_WEIGHT`] elements is cut into column ranges of at least that
    /// much, one single-threaded `gemm` call each on the pool. `gemm`'s depth blocks depend on
    /// `k` and the caches only (`gemm_common::cache::kernel_params`), so every output element
    /// is the same sum as in the unsplit product: the same bits. 1: no split.
    pub(super) fn column_chunks(m: usize, k: usize, n: usize, threads: usize) -> usize {
        if m > FEW_ROWS || threads < 2 || n < 32 {
            return 1;
        }
        (k.saturating_mul(n) / SPLIT_WEIGHT)
            .min(2 * threads)
            .min(n / 16)
            .max(1)
    }

    /// Rows up to which a product's weight is split over the pool by columns ([`column_chunks`]).
    const FEW_ROWS: usize = 128;
    /// The fewest weight elements (256 KB of f32) a column range of a split product reads.
    const SPLIT_WEIGHT: usize = 1 << 16;
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::prelude::*;

    /// `f` on a rayon pool of `threads` threads.
    fn on_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    }

    /// A product of few rows split over the pool by columns (a generated token's projections,
    /// a prompt's, the tied head's transposed table, a bias in the product) is bit for bit the
    /// product on one thread.
    #[test]
    fn few_row_products_split_by_columns_are_the_unsplit_product() {
        let device = Default::default();
        let matrix = |rows: usize, cols: usize, seed: usize| {
            Tensor::<Flex, 2>::from_data(
                TensorData::new(values(rows * cols, seed), [rows, cols]),
                &device,
            )
        };
        for (m, k, n, transposed, bias) in [
            (1, 768, 2304, false, false),
            (1, 768, 5000, true, false),
            (3, 256, 3000, false, true),
            (8, 512, 1024, true, true),
            (64, 768, 2304, false, true),
            (100, 600, 1000, true, false),
        ] {
            let x = matrix(m, k, 1);
            let w = if transposed {
                matrix(n, k, 2).transpose()
            } else {
                matrix(k, n, 2)
            };
            let b = bias
                .then(|| Tensor::<Flex, 1>::from_data(TensorData::new(values(n, 3), [n]), &device));
            let run = |threads: usize| {
                let (x, w, b) = (x.clone(), w.clone(), b.clone());
                on_pool(threads, move || {
                    let out = super::linear::<Flex>(
                        x.into_primitive().tensor(),
                        w.into_primitive().tensor(),
                        b.map(|b| b.into_primitive().tensor()),
                    );
                    Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(out))
                        .into_data()
                        .to_vec::<f32>()
                        .unwrap()
                })
            };
            assert!(
                super::flex::column_chunks(m, k, n, 4) > 1,
                "{m}×{k}×{n} is split"
            );
            let (one, four) = (run(1), run(4));
            let same = one
                .iter()
                .zip(&four)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{m}×{k}×{n} (transposed {transposed}, bias {bias})");
        }
        assert_eq!(
            super::flex::column_chunks(129, 768, 2304, 4),
            1,
            "many rows"
        );
        assert_eq!(
            super::flex::column_chunks(1, 64, 64, 4),
            1,
            "a small weight"
        );
    }
}
