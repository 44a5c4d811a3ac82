//! Creation and devices (PyTorch DTensor's factory and `_random_ops`): tensors from data, random
//! tensors from the rank's stream, devices of every tensor kind, moves between devices.

use super::wrap;
use crate::backend::prelude::*;
use crate::device::{DistDevice, current_device};
use crate::placement::Layout;
use crate::tensor::DTensor;

pub(crate) fn float_from_data<B: Backend>(data: TensorData, device: &DistDevice<B>) -> DTensor<B> {
    let local = B::float_from_data(data, &device.inner);
    wrap(local, Layout::fresh(device.mesh()), device.clone())
}

/// Random values from this rank's stream once `Backend::seed` was called on the device (ranks as
/// threads draw deterministically, whatever the other threads do), else from the inner backend.
/// Replicated: ranks seeded alike draw alike.
pub(crate) fn float_random<B: Backend>(
    shape: Shape,
    distribution: Distribution,
    device: &DistDevice<B>,
    dtype: FloatDType,
) -> DTensor<B> {
    let drawn = device.ctx.with_rng(|rng| {
        TensorData::random::<f32, _, _>(shape.clone(), distribution, rng)
            .convert_dtype(burn_backend::DType::from(dtype))
    });
    let local = match drawn {
        Some(data) => B::float_from_data(data, &device.inner),
        None => B::float_random(shape, distribution, &device.inner, dtype),
    };
    wrap(local, Layout::replicated(device.mesh()), device.clone())
}

pub(crate) fn float_device<B: Backend>(tensor: &DTensor<B>) -> DistDevice<B> {
    tensor.device.clone()
}

pub(crate) fn float_to_device<B: Backend>(
    tensor: DTensor<B>,
    device: &DistDevice<B>,
) -> DTensor<B> {
    if tensor.device.mesh() == device.mesh() && tensor.device.rank() == device.rank() {
        let local = B::float_to_device(tensor.local, &device.inner);
        return DTensor::new_shaped(local, tensor.layout, tensor.shape, device.clone());
    }
    let fb = Fallback::<B>::new("float_to_device");
    let local = fb.float(tensor);
    wrap(
        B::float_to_device(local, &device.inner),
        Layout::fresh(device.mesh()),
        device.clone(),
    )
}

pub(crate) fn int_device<B: Backend>(_tensor: &B::IntTensorPrimitive) -> DistDevice<B> {
    current_device::<B>()
}

pub(crate) fn bool_device<B: Backend>(_tensor: &B::BoolTensorPrimitive) -> DistDevice<B> {
    current_device::<B>()
}

pub(crate) fn q_device<B: Backend>(_tensor: &B::QuantizedTensorPrimitive) -> DistDevice<B> {
    current_device::<B>()
}
