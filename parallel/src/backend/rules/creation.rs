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
    if let Some(scope) = device.ctx.take_init_scope(&shape) {
        return scoped(&shape, device, dtype, &scope, |start, out| {
            crate::rng::fill_distribution(scope.stream, distribution, start, out)
        });
    }
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

/// A constant tensor: this rank's piece of it inside a sharded initialisation, else the inner
/// backend's (through the fallback, as every op without a rule).
fn constant<B: Backend>(
    op: &'static str,
    shape: Shape,
    value: f32,
    device: &DistDevice<B>,
    dtype: FloatDType,
    inner: impl FnOnce(Shape, &B::Device) -> B::FloatTensorPrimitive,
) -> DTensor<B> {
    if let Some(scope) = device.ctx.take_init_scope(&shape) {
        return scoped(&shape, device, dtype, &scope, |_, out| out.fill(value));
    }
    let fb = Fallback::<B>::new(op);
    let inner_device = fb.device(device);
    fb.wrap(inner(shape, inner_device))
}

pub(crate) fn float_zeros<B: Backend>(
    shape: Shape,
    device: &DistDevice<B>,
    dtype: FloatDType,
) -> DTensor<B> {
    constant("float_zeros", shape, 0.0, device, dtype, |s, d| {
        B::float_zeros(s, d, dtype)
    })
}

pub(crate) fn float_ones<B: Backend>(
    shape: Shape,
    device: &DistDevice<B>,
    dtype: FloatDType,
) -> DTensor<B> {
    constant("float_ones", shape, 1.0, device, dtype, |s, d| {
        B::float_ones(s, d, dtype)
    })
}

pub(crate) fn float_full<B: Backend>(
    shape: Shape,
    fill_value: Scalar,
    device: &DistDevice<B>,
    dtype: FloatDType,
) -> DTensor<B> {
    let value = fill_value.elem::<f32>();
    constant("float_full", shape, value, device, dtype, |s, d| {
        B::float_full(s, fill_value, d, dtype)
    })
}

/// This rank's piece, in the scope's layout, of a tensor whose values `fill` gives by flat index
/// (see [`Layout::draw_local`]): the whole tensor is never made.
fn scoped<B: Backend>(
    shape: &Shape,
    device: &DistDevice<B>,
    dtype: FloatDType,
    scope: &crate::device::InitScope,
    fill: impl FnMut(usize, &mut [f32]),
) -> DTensor<B> {
    let (local, extents) =
        scope
            .layout
            .draw_local(&shape.to_vec(), device.mesh(), device.rank(), fill);
    let data = TensorData::new(local, extents).convert_dtype(burn_backend::DType::from(dtype));
    let local = B::float_from_data(data, &device.inner);
    DTensor::from_local_padded(local, scope.layout.clone(), &shape.to_vec(), device)
        .expect("a planned layout fits its tensor")
}

/// A float tensor read to the host (PyTorch's `.item()` / `.cpu()`): its full value (gathered
/// or reduced as the fallback does), counted as one host read of the rank
/// ([`OpCounters::host_reads`](crate::OpCounters::host_reads)) — each is a device
/// synchronisation, and a training step should need one.
pub(crate) fn float_into_data<B: Backend>(
    tensor: DTensor<B>,
) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    tensor.device.ctx.count_host_read();
    let fb = Fallback::<B>::new("float_into_data");
    let tensor = fb.float(tensor);
    B::float_into_data(tensor)
}

pub(crate) fn float_device<B: Backend>(tensor: &DTensor<B>) -> DistDevice<B> {
    tensor.device.clone()
}

pub(crate) fn float_to_device<B: Backend>(
    tensor: DTensor<B>,
    device: &DistDevice<B>,
) -> DTensor<B> {
    if tensor.device.mesh() == device.mesh() && tensor.device.rank() == device.rank() {
        // A value still awaited (a deferred optimizer result, an offloaded parameter) stays so
        // on its own device; moved, it is resolved first — its local piece is a stand-in.
        if tensor.meta.awaited.is_some() {
            if tensor.device.inner == device.inner {
                return tensor;
            }
            return float_to_device(tensor.ready(), device);
        }
        let local = B::float_to_device(tensor.local, &device.inner);
        return DTensor::new_shaped(
            local,
            tensor.meta.layout.clone(),
            tensor.meta.shape.clone(),
            device.clone(),
        );
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
