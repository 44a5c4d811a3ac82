//! Pipeline parallelism on a `pp` axis.
//!
//! The schedules as data ([`Schedule`]: GPipe, 1F1B, interleaved 1F1B, ZB-H1), checked and
//! simulated (bubble, held activations, point-to-point counts), printed as a table and drawn as
//! an SVG timeline; which blocks each stage holds ([`StagePlan`]); and the runner
//! ([`run_step`], [`run_step_with`]) that executes one rank's part of a step on any Burn
//! module split into chunks, over the rank's communicator; [`pipeline`] splits any model that
//! is a sequence of blocks ([`Sequential`]: a burn-nn `TransformerEncoder`, a `Vec` of
//! [`Layer`]s) by a plan in one call — on the `Distributed` backend with
//! zero-bubble schedules' split backward (weight gradients deferred from `I` to `W`). The
//! training step around it (data-parallel sync, tied parameters, norm, optimizer) is
//! `wildfire_engine::StepRunner::run_pipeline`; the GPT's stages are
//! `wildfire_models::gpt::GptStage`. Outside the step, [`StagePasses`] runs forward-only passes
//! through a rank's stages (evaluation, generation) and [`gather_stage_parameters`] collects the
//! whole model's parameters on rank 0. Stages compose with FSDP / HSDP, tensor and sequence
//! parallelism (each rank sends its own piece of an activation with its layout: [`Pieces`]) and
//! recomputation ([`run_step_custom`] takes the backward, so a recomputing one runs the regions
//! the forward recorded); backward passes that communicate take turns within a process
//! ([`turns`]). Activations and their gradients go as host messages, or with [`Pieces`] on the
//! rank's device collectives when installed: NCCL send/recv on CUDA, one channel per directed
//! pair of neighbouring stages (`wildfire_parallel::comm::p2p_channels`).

pub mod plan;
pub mod runner;
pub mod schedule;
pub mod split;
pub mod stages;
pub mod turns;

pub use plan::StagePlan;
pub use runner::{
    Pieces, PipelineStep, StepOptions, Transport, Whole, run_step, run_step_custom, run_step_with,
};
pub use schedule::{Action, Costs, Placed, Schedule, ScheduleKind, Timeline, Work};
pub use split::{Layer, Pipeline, Sequential, pipeline};
pub use stages::{StagePasses, gather_stage_parameters};
pub use turns::StageGroup;
