//! The one error type of the engine.

/// What can stop a training step.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum Error {
    /// The parallel layer failed (a collective, a layout, a rank).
    #[error(transparent)]
    Parallel(#[from] wildfire_parallel::Error),
    /// The loss or the gradients were not finite for too many steps in a row (Megatron's NaN
    /// check): training stops instead of going on with NaN.
    #[error(
        "step {step}: the loss or the gradients were not finite {in_a_row} steps in a row ({}); \
         training stopped: lower the learning rate, check the data, or resume from an earlier \
         checkpoint",
        match parameter {
            Some(p) => format!("first non-finite gradient: {p}"),
            None => "the gradients were finite: the loss was not".to_string(),
        }
    )]
    NonFinite {
        /// The step (counted by the [`crate::StepRunner`]) that gave up.
        step: usize,
        /// Non-finite steps in a row, each skipped on every rank.
        in_a_row: usize,
        /// The first parameter (in visiting order, over every rank's shards) whose gradient has a
        /// NaN or an infinity, by module path.
        parameter: Option<String>,
    },
}
