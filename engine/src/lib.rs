//! Wildfire's training engine: the pieces of a training step that are not the model — dynamic
//! loss scaling, the one-collective overflow check and global-norm clipping. (Precision policy,
//! a `TrainStep`, recomputation and checkpoints: see the open issues.)

pub mod grad_check;
pub mod scaler;

pub use grad_check::{GradCheck, unscale_check_clip};
pub use scaler::{DynamicLossScaler, LossScalerConfig, StepDecision};
