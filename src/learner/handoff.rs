//! What the Learner's optimizer hands its training strategy: the optimizer state's record after
//! the last step taken, for the next checkpoint. Both hold one [`Handoff`] (made by the
//! Learner's builder) and neither imports the other.

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// A slot for the optimizer state's record, shared by the optimizer (which fills it after each
/// step) and the strategy (which reads it when it checkpoints).
#[derive(Clone, Default)]
pub(crate) struct Handoff(Arc<Mutex<Option<Box<dyn Any + Send>>>>);

impl Handoff {
    fn slot(&self) -> MutexGuard<'_, Option<Box<dyn Any + Send>>> {
        // A rank that panicked mid-step leaves the last record in place: still the last one.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leave `record` (replacing the previous step's).
    pub(crate) fn put<R: Any + Send>(&self, record: R) {
        *self.slot() = Some(Box::new(record));
    }

    /// The last record left, if it is an `R`.
    pub(crate) fn get<R: Any + Clone>(&self) -> Option<R> {
        self.slot()
            .as_ref()
            .and_then(|r| r.downcast_ref::<R>())
            .cloned()
    }
}
