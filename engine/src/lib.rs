//! Wildfire's training engine: the pieces of a training step that are not the model — dynamic
//! loss scaling, the one-collective overflow check and global-norm clipping, activation
//! recomputation ([`recompute`]), and the training step that puts them together ([`StepRunner`]).

pub mod adafactor;
mod error;
pub mod fused_tail;
pub mod grad_check;
pub mod metrics;
pub mod muon;
pub mod offload;
pub mod pipeline;
pub mod quant_adamw;
mod quant_maps;
pub mod recompute;
pub mod report;
pub mod scaler;
pub mod step;
pub mod trace;

pub use adafactor::{Adafactor, AdafactorConfig, AdafactorState};
pub use error::Error;
pub use fused_tail::{
    FusedAdamW, FusedAdamWConfig, FusedAdamWOptimizer, MomentDtype, TailInputs, fused_unscale_check,
};
pub use grad_check::{GradCheck, unscale_check_clip};
pub use metrics::RankPeaks;
pub use muon::{Muon, MuonConfig, MuonLr, MuonOptimizer, MuonSplit, MuonState, NEWTON_SCHULZ};
pub use offload::{HANDED_TO_ITS_THREAD, OffloadAdamW, OffloadAdamWOptimizer, OffloadState};
pub use pipeline::PipelineRecord;
pub use quant_adamw::{
    BLOCK, MIN_8BIT_SIZE, QuantAdamW, QuantAdamWOptimizer, QuantAdamWState, QuantMoments,
    dynamic_map, quantise_blockwise,
};
pub use recompute::{AttentionSpec, Recompute, Recomputer, attention_reference, dropout_mask};
pub use scaler::{DynamicLossScaler, LossScalerConfig, StepDecision};
pub use step::{PhasePeaks, RouterRecord, StepRecord, StepRunner, StepRunnerConfig};
