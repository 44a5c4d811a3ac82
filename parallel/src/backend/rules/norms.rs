//! Normalisation: layer norm over a whole last dim, its parameters whole.

use super::{check_param, to_layout, whole_dim, wrap};
use crate::backend::prelude::*;
use crate::placement::Layout;
use crate::tensor::DTensor;

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
    let whole = Layout::replicated(x.device.mesh());
    let gamma = to_layout(OP, gamma, &whole).local;
    let beta = beta.map(|b| {
        check_param(OP, &b);
        to_layout(OP, b, &whole).local
    });
    wrap(
        B::layer_norm(x.local, gamma, beta, epsilon),
        x.layout,
        x.device,
    )
}
