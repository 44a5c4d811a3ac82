//! Ops whose inputs or results are Burn structs (transactions, quantization, pooling with
//! indices, deformable convolution's backward): the counted fallback, field by field.

use crate::backend::prelude::*;
use crate::tensor::DTensor;
use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices, TransactionPrimitiveData,
};

pub(crate) fn tr_execute<B: Backend>(
    transaction: TransactionPrimitive<Distributed<B>>,
) -> impl Future<Output = Result<TransactionPrimitiveData, ExecutionError>> + Send {
    let fb = Fallback::<B>::new("tr_execute");
    let floats = transaction
        .read_floats
        .into_iter()
        .map(|t| fb.float(t))
        .collect();
    B::tr_execute(TransactionPrimitive::new(
        floats,
        transaction.read_qfloats,
        transaction.read_ints,
        transaction.read_bools,
    ))
}

pub(crate) fn quantize<B: Backend>(
    tensor: DTensor<B>,
    scheme: &QuantScheme,
    qparams: QuantizationParametersPrimitive<Distributed<B>>,
) -> B::QuantizedTensorPrimitive {
    let fb = Fallback::<B>::new("quantize");
    let tensor = fb.float(tensor);
    let scales = fb.float(qparams.scales);
    B::quantize(tensor, scheme, QuantizationParametersPrimitive { scales })
}

pub(crate) fn max_pool1d_with_indices<B: Backend>(
    x: DTensor<B>,
    kernel_size: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    ceil_mode: bool,
) -> MaxPool1dWithIndices<Distributed<B>> {
    let fb = Fallback::<B>::new("max_pool1d_with_indices");
    let x = fb.float(x);
    let out = B::max_pool1d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode);
    MaxPool1dWithIndices::new(fb.wrap(out.output), out.indices)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn max_pool1d_with_indices_backward<B: Backend>(
    x: DTensor<B>,
    kernel_size: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    ceil_mode: bool,
    output_grad: DTensor<B>,
    indices: B::IntTensorPrimitive,
) -> MaxPool1dBackward<Distributed<B>> {
    let fb = Fallback::<B>::new("max_pool1d_with_indices_backward");
    let (x, g) = (fb.float(x), fb.float(output_grad));
    let out = B::max_pool1d_with_indices_backward(
        x,
        kernel_size,
        stride,
        padding,
        dilation,
        ceil_mode,
        g,
        indices,
    );
    MaxPool1dBackward::new(fb.wrap(out.x_grad))
}

pub(crate) fn max_pool2d_with_indices<B: Backend>(
    x: DTensor<B>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
) -> MaxPool2dWithIndices<Distributed<B>> {
    let fb = Fallback::<B>::new("max_pool2d_with_indices");
    let x = fb.float(x);
    let out = B::max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode);
    MaxPool2dWithIndices::new(fb.wrap(out.output), out.indices)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn max_pool2d_with_indices_backward<B: Backend>(
    x: DTensor<B>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
    output_grad: DTensor<B>,
    indices: B::IntTensorPrimitive,
) -> MaxPool2dBackward<Distributed<B>> {
    let fb = Fallback::<B>::new("max_pool2d_with_indices_backward");
    let (x, g) = (fb.float(x), fb.float(output_grad));
    let out = B::max_pool2d_with_indices_backward(
        x,
        kernel_size,
        stride,
        padding,
        dilation,
        ceil_mode,
        g,
        indices,
    );
    MaxPool2dBackward::new(fb.wrap(out.x_grad))
}

pub(crate) fn deform_conv2d_backward<B: Backend>(
    x: DTensor<B>,
    offset: DTensor<B>,
    weight: DTensor<B>,
    mask: Option<DTensor<B>>,
    bias: Option<DTensor<B>>,
    output_grad: DTensor<B>,
    options: DeformConvOptions<2>,
) -> DeformConv2dBackward<Distributed<B>> {
    let fb = Fallback::<B>::new("deform_conv2d_backward");
    let (x, offset, weight) = (fb.float(x), fb.float(offset), fb.float(weight));
    let (mask, bias) = (mask.map(|t| fb.float(t)), bias.map(|t| fb.float(t)));
    let out = B::deform_conv2d_backward(
        x,
        offset,
        weight,
        mask,
        bias,
        fb.float(output_grad),
        options,
    );
    DeformConv2dBackward::new(
        fb.wrap(out.x_grad),
        fb.wrap(out.offset_grad),
        fb.wrap(out.weight_grad),
        out.mask_grad.map(|t| fb.wrap(t)),
        out.bias_grad.map(|t| fb.wrap(t)),
    )
}
