//! Flex (the CPU backend) runs Burn ops for the fused operations, except the causal softmax of
//! the attention core: there Burn ops cost a mask tensor, a broadcast `mask_fill` over the whole
//! score matrix and a softmax over every key, masked or not, about 7 ms per `[4, 4, 256, 256]`
//! on two cores. One pass per row over the valid keys only, rows in parallel, does the same.
//!
//! Numerics: the maximum and the sum run over the valid keys in order; masked keys get exactly 0
//! (as `exp(−1e9 − max)` underflows to in the Burn-op form). Results agree with the Burn-op form
//! to rounding, not bitwise (the sum order differs); every path of a run uses this function, so
//! recomputation stays bitwise equal to keeping the probabilities.

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorData, TensorMetadata};
use rayon::prelude::*;

/// Rows handed to one task.
const ROWS_PER_TASK: usize = 32;

/// [`FusedOps::fused_causal_softmax`](crate::FusedOps::fused_causal_softmax) on Flex: native
/// for contiguous f32 `[b, h, t, s]`, the Burn-op form otherwise.
pub fn causal_softmax(scores: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let shape = scores.shape();
    if scores.dtype() != DType::F32 || shape.num_dims() != 4 {
        return crate::reference::causal_softmax::<Flex>(scores);
    }
    let scores: FlexTensor = scores.to_contiguous();
    let Some(input) = scores.as_slice::<f32>() else {
        return crate::reference::causal_softmax::<Flex>(scores);
    };
    let (t, s) = (shape[2], shape[3]);
    if s == 0 {
        return scores;
    }
    let mut output = vec![0f32; input.len()];
    output
        .par_chunks_mut(ROWS_PER_TASK * s)
        .zip(input.par_chunks(ROWS_PER_TASK * s))
        .enumerate()
        .for_each(|(task, (out, inp))| {
            for (r, (o, x)) in out.chunks_mut(s).zip(inp.chunks(s)).enumerate() {
                let query = (task * ROWS_PER_TASK + r) % t;
                // Keys 0 ..= query + (s − t) are visible.
                let valid = (query + s).saturating_sub(t - 1).min(s);
                causal_row(x, o, valid);
            }
        });
    FlexTensor::from_data(TensorData::new(output, shape))
}

/// Softmax of `x[..valid]` into `o[..valid]`; `o[valid..]` stays 0. A row with no visible key is
/// uniform (every entry masked alike).
fn causal_row(x: &[f32], o: &mut [f32], valid: usize) {
    if valid == 0 {
        o.fill(1.0 / x.len() as f32);
        return;
    }
    let (x, o) = (&x[..valid], &mut o[..valid]);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for (o, &x) in o.iter_mut().zip(x) {
        let e = (x - max).exp();
        *o = e;
        sum += e;
    }
    for o in o.iter_mut() {
        *o /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Tensor;

    /// Against the Burn-op form: square and shifted (`t < s`) masks, every probability within
    /// rounding, masked ones exactly 0.
    #[test]
    fn native_causal_softmax_matches_the_burn_op_form() {
        let device = Default::default();
        for [b, h, t, s] in [[2, 3, 70, 70], [1, 2, 5, 9], [1, 1, 1, 4]] {
            let n = b * h * t * s;
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1000) as f32 / 50.0 - 10.0)
                .collect();
            let x = Tensor::<Flex, 4>::from_data(TensorData::new(values, [b, h, t, s]), &device);
            let prim = |x: Tensor<Flex, 4>| x.into_primitive().tensor();
            let native = causal_softmax(prim(x.clone()));
            let reference = crate::reference::causal_softmax::<Flex>(prim(x));
            let native = native.into_data().to_vec::<f32>().unwrap();
            let reference = reference.into_data().to_vec::<f32>().unwrap();
            for (i, (a, r)) in native.iter().zip(&reference).enumerate() {
                assert!(
                    (a - r).abs() <= 1e-6,
                    "{:?} at {i}: {a} vs {r}",
                    [b, h, t, s]
                );
                if *r == 0.0 {
                    assert_eq!(*a, 0.0, "masked entry {i}");
                }
            }
        }
    }
}
