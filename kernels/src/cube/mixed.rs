//! The sum of a wide and a narrow float tensor in the wide dtype (`f32 + bf16`: a residual stream
//! meeting a 16-bit branch under a compute dtype), in one pass: what a cast of the narrow one and
//! an add did in two launches, bit for bit (the widening is exact and the add is the same f32
//! add).

use super::{arg, contiguous, elementwise, empty_like, launched, row_vector};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

#[cube(launch)]
fn add_widened_kernel<W: Float, S: Float, N: Size>(
    wide: &Tensor<Vector<W, N>>,
    narrow: &Tensor<Vector<S, N>>,
    out: &mut Tensor<Vector<W, N>>,
    len: u32,
    #[define(W, S)] _dtypes: [StorageType; 2],
) {
    if ABSOLUTE_POS >= len as usize {
        terminate!();
    }
    out[ABSOLUTE_POS] = wide[ABSOLUTE_POS] + Vector::<W, N>::cast_from(narrow[ABSOLUTE_POS]);
}

/// `wide + narrow` in `wide`'s dtype (same shapes).
pub(crate) fn add_widened<R: CubeRuntime>(
    wide: CubeTensor<R>,
    narrow: CubeTensor<R>,
) -> CubeTensor<R> {
    let [wide, narrow] = contiguous([wide, narrow]);
    let out = empty_like(&wide);
    let len = wide.meta.shape().num_elements();
    let n = row_vector(&[&wide, &narrow, &out], len);
    let (count, dim) = elementwise(&wide, len / n);
    add_widened_kernel::launch::<R>(
        &wide.client,
        count,
        dim,
        n,
        arg(&wide),
        arg(&narrow),
        arg(&out),
        (len / n) as u32,
        [wide.dtype.into(), narrow.dtype.into()],
    );
    launched(1);
    out
}
