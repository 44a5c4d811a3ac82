//! Cross-entropy fused with the log-softmax: the forward keeps only the per-row log-sum-exp
//! (one cube per row), the backward one pass over the logits (a cube per row).

use super::reduce::{row_logsumexp, this_row};
use super::{
    arg, contiguous, empty, empty_f32, empty_like, launched, row_launch, row_vector, rows_cols,
};
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_kernel<F: Float, I: Int, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    targets: &Tensor<I>,
    loss: &mut Tensor<F>,
    lse_out: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    #[comptime] block: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let n = logits.vector_size();
    let vectors = cols as usize / n;
    let (row, base) = this_row(rows, vectors);
    let lse = row_logsumexp::<F, N>(logits, base, vectors, block);
    if UNIT_POS_X == 0 {
        let target = i32::cast_from(targets[row]);
        let mut l = f32::new(0.0);
        if target >= 0 {
            let t = target as usize;
            l = lse - f32::cast_from(element::<F, N>(logits[base + t / n], t % n));
        }
        loss[row] = F::cast_from(l);
        lse_out[row] = lse;
    }
}

/// Element `j` of `x` (a runtime index: a select over the vector's comptime width).
#[cube]
fn element<F: Float, N: Size>(x: Vector<F, N>, j: usize) -> F {
    let mut e = x[0];
    #[unroll]
    for i in 1..x.vector_size() {
        if i == j {
            e = x[i];
        }
    }
    e
}

/// One cube per row, its units striding over the row's vectors (up to 16 bytes each, see
/// [`row_vector`](super::row_vector)): the row's target, log-sum-exp and loss gradient read once (an elementwise
/// launch over `rows × cols` divided each 64-bit position by `cols` for every one of GPT-2's
/// 412 million logits; a 2-byte access per unit reached 649 GB/s of an H200's 4.8 TB/s).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_backward_kernel<F: Float, I: Int, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    targets: &Tensor<I>,
    lse: &Tensor<f32>,
    dloss: &Tensor<F>,
    dx: &mut Tensor<Vector<F, N>>,
    rows: u32,
    cols: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let n = logits.vector_size();
    let vectors = cols as usize / n;
    let (row, base) = this_row(rows, vectors);
    let target = i32::cast_from(targets[row]);
    let m = lse[row];
    let mut d = f32::cast_from(dloss[row]);
    if target < 0 {
        d = f32::new(0.0);
    }
    let mut col = UNIT_POS_X as usize;
    while col < vectors {
        let x = logits[base + col];
        let mut g = Vector::<F, N>::empty();
        #[unroll]
        for j in 0..n {
            let p = f32::exp(f32::cast_from(x[j]) - m);
            let mut hot = f32::new(0.0);
            if (col * n + j) as i32 == target {
                hot = f32::new(1.0);
            }
            g[j] = F::cast_from(d * (p - hot));
        }
        dx[base + col] = g;
        col += CUBE_DIM_X as usize;
    }
}

/// `(loss, lse)`, both `[rows]`.
pub(super) fn forward<R: CubeRuntime>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [logits, targets] = contiguous([logits, targets]);
    let (rows, cols) = rows_cols(&logits.shape());
    assert_eq!(
        targets.shape().num_elements(),
        rows,
        "cross_entropy: one target per row"
    );
    let loss = empty(&logits, Shape::new([rows]), logits.dtype);
    let lse = empty_f32(&logits, [rows]);
    let n = row_vector(&[&logits], cols);
    let (count, dim, block) = row_launch(rows, cols / n);
    cross_entropy_kernel::launch::<R>(
        &logits.client,
        count,
        dim,
        n,
        arg(&logits),
        arg(&targets),
        arg(&loss),
        arg(&lse),
        rows as u32,
        cols as u32,
        block,
        [logits.dtype.into(), targets.dtype.into()],
    );
    launched(1);
    (loss, lse)
}

/// The gradient w.r.t. the logits.
pub(super) fn backward<R: CubeRuntime>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    lse: CubeTensor<R>,
    dloss: CubeTensor<R>,
) -> CubeTensor<R> {
    let [logits, targets, lse, dloss] = contiguous([logits, targets, lse, dloss]);
    let (rows, cols) = rows_cols(&logits.shape());
    let dx = empty_like(&logits);
    let n = row_vector(&[&logits], cols);
    let (count, dim, _) = row_launch(rows, cols / n);
    cross_entropy_backward_kernel::launch::<R>(
        &logits.client,
        count,
        dim,
        n,
        arg(&logits),
        arg(&targets),
        arg(&lse),
        arg(&dloss),
        arg(&dx),
        rows as u32,
        cols as u32,
        [logits.dtype.into(), targets.dtype.into()],
    );
    launched(1);
    dx
}
