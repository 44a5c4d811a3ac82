//! The Learner's optimizer on a mesh: gradients synchronised (and clipped by their global norm)
//! before the wrapped optimizer steps.

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use wildfire_parallel::{FsdpOptimizer, sync_gradients};

use super::Sharded;
use super::handoff::Handoff;

/// Any Burn optimizer, as the Learner's optimizer on a mesh. Its `step` — which burn-train calls
/// once per optimizer step, between backward and the update — first synchronises the gradients
/// over the data-parallel axes (`sync_gradients`: all-reduce for DDP, reduce-scatter for FSDP and
/// ZeRO-2, both for HSDP), then, with a clipping norm, agrees on the global norm over the whole
/// mesh and scales the gradients to it (a non-finite norm skips the step on every rank), then
/// steps the inner optimizer as [`FsdpOptimizer`] does (ZeRO-1/2: the optimizer state sharded).
/// After each step it leaves its state's record where the training strategy finds it for a
/// checkpoint.
#[derive(Clone)]
pub struct ShardedOptimizer<O> {
    inner: FsdpOptimizer<O>,
    clip: Option<f32>,
    handoff: Handoff,
}

impl<O> ShardedOptimizer<O> {
    pub(super) fn new(inner: O, clip: Option<f32>, handoff: Handoff) -> Self {
        Self {
            inner: FsdpOptimizer::new(inner),
            clip,
            handoff,
        }
    }
}

impl<O, M, X> Optimizer<M, Sharded<X>> for ShardedOptimizer<O>
where
    X: Backend,
    O: Optimizer<M, Sharded<X>>,
    O::Record: 'static,
    M: AutodiffModule<Sharded<X>>,
{
    type Record = O::Record;

    fn step(&mut self, lr: LearningRate, module: M, mut grads: GradientsParams) -> M {
        // A typed error stops the rank (`LearnerRank::launch` reports it).
        sync_gradients(&module, &mut grads)
            .unwrap_or_else(|e| wildfire_parallel::internal::raise(e));
        if let Some(max_norm) = self.clip {
            let check = wildfire_engine::unscale_check_clip::<Sharded<X>, X, M>(
                &module,
                &mut grads,
                1.0,
                Some(max_norm),
            )
            .unwrap_or_else(|e| wildfire_parallel::internal::raise(e));
            if check.found_inf {
                tracing::warn!(
                    norm = check.norm,
                    "non-finite gradients: step skipped on every rank"
                );
                return module;
            }
        }
        let module = self.inner.step(lr, module, grads);
        self.handoff.put(self.inner.to_record());
        module
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        // burn-train's multi-device strategy (one model over several devices), which a sharded
        // run does not use: the inner optimizer's.
        self.inner.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        Self {
            inner: self.inner.load_record(record),
            ..self
        }
    }
}
