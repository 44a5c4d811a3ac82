//! Pipeline parallelism on a `pp` axis.
//!
//! Landed so far: the schedules as data ([`Schedule`]: GPipe, 1F1B, interleaved 1F1B, ZB-H1),
//! checked and simulated (bubble, held activations, point-to-point counts), printed as a table
//! and drawn as an SVG timeline; which blocks each stage holds ([`StagePlan`]); and the runner ([`run_step`]) that executes one rank's part of
//! a step on any Burn module split into chunks, over the rank's communicator — whole backwards
//! only (GPipe, 1F1B, interleaved). Not yet: the GPT's split into stages and `gpt_pretrain
//! --pp`, the zero-bubble split backward, composition with FSDP / TP inside the stages.

pub mod plan;
pub mod runner;
pub mod schedule;

pub use plan::StagePlan;
pub use runner::{PipelineStep, run_step, run_step_scaled};
pub use schedule::{Action, Costs, Placed, Schedule, ScheduleKind, Timeline, Work};
