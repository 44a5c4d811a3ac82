//! The counted fallback: for an op without a propagation rule, bring every float input to
//! `Replicate` on the axes where it is sharded or partial (`Local` stays per-rank), run the op on
//! the local values, and mark the output `Local` on the data axes where an input was `Local`,
//! `Replicate` elsewhere. Always correct; every call that had to communicate is counted.

use crate::device::{DistDevice, current_device};
use crate::error::raise;
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use burn_backend::{Backend, TensorPrimitive};
use std::cell::RefCell;

struct State<B: Backend> {
    device: Option<DistDevice<B>>,
    /// Per mesh axis: some input was `Local` there.
    local: Vec<bool>,
    inputs: usize,
    communicated: bool,
}

/// One fallback op call.
pub(crate) struct Fallback<B: Backend> {
    op: &'static str,
    state: RefCell<State<B>>,
}

impl<B: Backend> Fallback<B> {
    pub(crate) fn new(op: &'static str) -> Self {
        Self {
            op,
            state: RefCell::new(State {
                device: None,
                local: Vec::new(),
                inputs: 0,
                communicated: false,
            }),
        }
    }

    fn note_device(&self, device: &DistDevice<B>) {
        let mut state = self.state.borrow_mut();
        if state.device.is_none() {
            state.local = vec![false; device.mesh().axes().len()];
            state.device = Some(device.clone());
        }
    }

    /// An input: its full (or per-rank `Local`) value.
    pub(crate) fn float(&self, t: DTensor<B>) -> B::FloatTensorPrimitive {
        let t = t.ready();
        self.note_device(&t.device);
        let target = t.layout.unsharded();
        let mut state = self.state.borrow_mut();
        state.inputs += 1;
        for (a, p) in t.layout.placements().iter().enumerate() {
            if *p == Placement::Local {
                state.local[a] = true;
            }
        }
        if target == t.layout {
            return t.local;
        }
        state.communicated = true;
        drop(state);
        match t.redistribute(&target) {
            Ok(t) => t.local,
            Err(e) => raise(e),
        }
    }

    /// An input read by reference (no redistribution: only metadata is read).
    pub(crate) fn float_ref<'a>(&self, t: &'a DTensor<B>) -> &'a B::FloatTensorPrimitive {
        &t.local
    }

    /// A device argument.
    pub(crate) fn device<'a>(&self, device: &'a DistDevice<B>) -> &'a B::Device {
        self.note_device(device);
        &device.inner
    }

    /// A float-or-quantized input.
    pub(crate) fn prim(&self, t: TensorPrimitive<Distributed<B>>) -> TensorPrimitive<B> {
        match t {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(self.float(t)),
            TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
        }
    }

    /// The output's layout.
    fn layout(&self, device: &DistDevice<B>) -> Layout {
        let state = self.state.borrow();
        if state.inputs == 0 {
            return Layout::fresh(device.mesh());
        }
        let mut layout = Layout::replicated(device.mesh());
        for (a, local) in state.local.iter().enumerate() {
            if *local {
                layout.set(a, Placement::Local);
            }
        }
        layout
    }

    /// Wrap a float output.
    pub(crate) fn wrap(&self, out: B::FloatTensorPrimitive) -> DTensor<B> {
        let device = self
            .state
            .borrow()
            .device
            .clone()
            .unwrap_or_else(current_device::<B>);
        if self.state.borrow().local.is_empty() {
            self.note_device(&device);
        }
        let layout = self.layout(&device);
        DTensor::new_unchecked(out, layout, device)
    }

    /// Wrap a float-or-quantized output.
    pub(crate) fn wrap_prim(&self, out: TensorPrimitive<B>) -> TensorPrimitive<Distributed<B>> {
        match out {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(self.wrap(t)),
            TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
        }
    }
}

impl<B: Backend> Drop for Fallback<B> {
    fn drop(&mut self) {
        let state = self.state.borrow();
        if state.communicated
            && let Some(device) = &state.device
        {
            device.ctx.count_fallback(self.op);
        }
    }
}

use super::Distributed;
