//! `parallelize_gpt`: how a GPT is laid out over a mesh, in torchtitan's fixed order
//! (tensor parallel → activation recomputation → FSDP / data parallel).

use crate::gpt::Gpt;
use serde::{Deserialize, Serialize};
use std::str::FromStr;
use wildfire_parallel::{DeviceMesh, DistError, DistributedBackend, replicate};

/// The data-parallel strategy (names follow what users know from DeepSpeed / PyTorch FSDP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsdpStrategy {
    /// Replicated parameters (DDP).
    None,
    /// ZeRO-1: optimizer state sharded.
    Zero1,
    /// ZeRO-2: gradients and optimizer state sharded.
    GradOp,
    /// ZeRO-3 / FSDP: everything sharded.
    Full,
    /// HSDP: shard within a group, replicate across groups.
    Hybrid,
}

impl FromStr for FsdpStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "none" | "ddp" => FsdpStrategy::None,
            "zero1" => FsdpStrategy::Zero1,
            "grad-op" | "zero2" => FsdpStrategy::GradOp,
            "full" | "zero3" => FsdpStrategy::Full,
            "hybrid" | "hsdp" => FsdpStrategy::Hybrid,
            other => {
                return Err(format!(
                    "unknown --fsdp '{other}': choose none, zero1, grad-op, full or hybrid"
                ));
            }
        })
    }
}

/// Activation recomputation policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Recompute the attention core.
    Selective,
    /// Recompute every block.
    Full,
    /// Recompute every n-th block.
    EveryNth(usize),
}

impl FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "none" => Recompute::None,
            "selective" => Recompute::Selective,
            "full" => Recompute::Full,
            other => match other.strip_prefix("every-").and_then(|n| n.parse().ok()) {
                Some(n) if n > 0 => Recompute::EveryNth(n),
                _ => {
                    return Err(format!(
                        "unknown --recompute '{other}': choose none, selective, full or every-N"
                    ));
                }
            },
        })
    }
}

/// How to parallelise: sizes of the mesh axes and the strategies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelConfig {
    /// Data-parallel ranks.
    pub dp: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Data-parallel strategy.
    pub fsdp: FsdpStrategy,
    /// Activation recomputation.
    pub recompute: Recompute,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            dp: 1,
            tp: 1,
            fsdp: FsdpStrategy::None,
            recompute: Recompute::None,
        }
    }
}

/// A parallelisation that is not available yet, with the issue that brings it.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum ParallelizeError {
    /// Not implemented yet.
    #[error("{what} is not available yet (it lands with the {issue} issue); run without it")]
    NotAvailable {
        /// The option.
        what: String,
        /// Which issue.
        issue: &'static str,
    },
    /// The decorator refused.
    #[error(transparent)]
    Dist(#[from] DistError),
}

impl ParallelConfig {
    /// The device mesh: `dp × tp` (axes of size 1 kept, so layouts have a fixed shape).
    pub fn mesh(&self) -> Result<DeviceMesh, DistError> {
        Ok(DeviceMesh::new([("dp", self.dp), ("tp", self.tp)])?)
    }

    /// Refuse, before any work, what is not implemented yet.
    pub fn check_available(&self) -> Result<(), ParallelizeError> {
        if self.tp > 1 {
            return Err(ParallelizeError::NotAvailable {
                what: format!("--tp {}", self.tp),
                issue: "tensor-parallelism",
            });
        }
        if self.fsdp != FsdpStrategy::None {
            return Err(ParallelizeError::NotAvailable {
                what: format!("--fsdp {:?}", self.fsdp).to_lowercase(),
                issue: "FSDP",
            });
        }
        if self.recompute != Recompute::None {
            return Err(ParallelizeError::NotAvailable {
                what: format!("--recompute {:?}", self.recompute).to_lowercase(),
                issue: "activation-recomputation",
            });
        }
        Ok(())
    }
}

/// Lay `model` out over `mesh` (tensor parallel → recompute → FSDP / DDP). Today: DDP.
pub fn parallelize_gpt<B: DistributedBackend>(
    model: Gpt<B>,
    mesh: &DeviceMesh,
    config: &ParallelConfig,
) -> Result<Gpt<B>, ParallelizeError> {
    config.check_available()?;
    Ok(replicate(model, mesh)?)
}
