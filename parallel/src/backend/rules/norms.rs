//! Normalisation: layer norm over a whole last dim, its parameters whole.

use super::{check_param, to_layout, whole_dim, whole_param, wrap};
use crate::backend::prelude::*;
use crate::tensor::DTensor;
use burn_backend::TensorMetadata;

pub(crate) fn layer_norm<B: Backend>(
    tensor: DTensor<B>,
    gamma: DTensor<B>,
    beta: Option<DTensor<B>>,
    epsilon: f64,
) -> DTensor<B> {
    const OP: &str = "layer_norm";
    check_param(OP, &gamma);
    let last = tensor.shape.num_dims() - 1;
    let target = whole_dim(&tensor.layout, last);
    let x = to_layout(OP, tensor, &target);
    // The parameters whole, in the input's dtype (cast once per value under the precision
    // policy, see `DTensor::local_in`).
    let dtype = x.local.dtype().into();
    let whole = |p: DTensor<B>| {
        let target = whole_param(&p.layout);
        to_layout(OP, p, &target).local_in(OP, dtype)
    };
    let gamma = whole(gamma);
    let beta = beta.map(|b| {
        check_param(OP, &b);
        whole(b)
    });
    wrap(
        B::layer_norm(x.local, gamma, beta, epsilon),
        x.meta.layout.clone(),
        x.meta.device.clone(),
    )
}
