//! What a model's forward pass goes through, so that the model never depends on the trainer:
//! dropout, the attention core and each block's region. A model is written once against
//! [`ForwardHooks`]; the trainer applies recomputation by handing it a recomputing
//! implementation (`wildfire_engine::Recomputer`), as torchtitan applies activation
//! checkpointing to a model after it is built; evaluation and generation hand it [`Inference`].
//!
//! [`Recompute`] is the recomputation policy a run chooses.

use crate::FusedOps;
use burn::module::Module;
use burn::prelude::*;
use serde::{Deserialize, Serialize};
use std::str::FromStr;

/// The hooks a model's forward calls. `'a` bounds what a recorded block region keeps (its
/// module, cloned: parameters are shared handles, so the clone copies no values, and a region
/// outlives the forward that recorded it — a pipeline stage runs its backward actions later).
/// The provided methods are the forward of evaluation and generation ([`Inference`]): no
/// dropout, nothing recomputed, attention through [`crate::ops::attention_qkv`] (the fused
/// kernel where the backend has one).
pub trait ForwardHooks<'a, B: FusedOps>: Sized {
    /// Block `index` of `count`: `f(module, x, self)`, which an implementation may run again in
    /// backward instead of keeping its activations.
    fn block<M, F, const D: usize>(
        &self,
        index: usize,
        count: usize,
        module: &M,
        x: Tensor<B, D>,
        f: F,
    ) -> Tensor<B, D>
    where
        M: Module<B> + 'a,
        F: Fn(&M, Tensor<B, D>, &Self) -> Tensor<B, D> + 'a,
    {
        let _ = (index, count);
        f(module, x, self)
    }

    /// The global positions of the `len` sequence positions the forward's activations hold
    /// (the model's learned or rotary positions are taken there): the backend's
    /// [`FusedOps::sequence_positions`] (`0..len`, or a context-parallel rank's chunks); a
    /// generation's key/value cache continues after the positions it holds.
    fn positions(&self, device: &B::Device, len: usize) -> Vec<usize> {
        B::sequence_positions(device, len)
    }

    /// The hidden states `[b, t, d]` whose logits the head computes (before its final norm):
    /// all of them; a generation needs only the last position's (a key/value cache made with
    /// `last_logits`), which saves the head's product for every other position of a prompt.
    fn head_input(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        x
    }

    /// Attention of layer `layer` on packed projections `qkv` `[b, t, h, 3·hd]` (per head:
    /// queries, keys, values side by side), giving `[b, t, h, hd]`, with dropout `dropout` on
    /// the probabilities while training.
    fn attention_qkv(
        &self,
        layer: usize,
        qkv: Tensor<B, 4>,
        scale: f64,
        causal: bool,
        dropout: f64,
    ) -> Tensor<B, 4> {
        let _ = (layer, dropout);
        crate::ops::attention_qkv(qkv, scale, causal)
    }

    /// Attention of layer `layer` on separate heads `[q, k, v]`, `[b, h, t, hd]` each — `k` and
    /// `v` may have fewer heads, each serving consecutive query heads (grouped-query attention)
    /// — giving `[b, h, t, hd]`, with dropout `dropout` on the probabilities while training.
    fn attention_heads(
        &self,
        layer: usize,
        qkv: [Tensor<B, 4>; 3],
        scale: f64,
        causal: bool,
        dropout: f64,
    ) -> Tensor<B, 4> {
        let _ = (layer, dropout);
        let [q, k, v] = qkv;
        crate::ops::attention(q, k, v, scale, causal)
    }

    /// Block `layer`'s output `x`, carrying the block's auxiliary loss into backward, weighted
    /// as the main loss is ([`FusedOps::carry_loss`]), and what its router did (`aux`).
    /// Evaluation and generation drop both: the loss they report is the model's.
    fn auxiliary_loss(&self, layer: usize, x: Tensor<B, 3>, aux: Auxiliary<B>) -> Tensor<B, 3> {
        let _ = (layer, aux);
        x
    }

    /// Inverted dropout with probability `p` at `(layer, site)` while training.
    fn dropout<const D: usize>(
        &self,
        layer: usize,
        site: u64,
        x: Tensor<B, D>,
        p: f64,
    ) -> Tensor<B, D> {
        let _ = (layer, site, p);
        x
    }
}

/// A block's auxiliary loss and what its router did with the batch.
#[derive(Clone, Debug)]
pub struct Auxiliary<B: Backend> {
    /// The loss, `[1]`, already times its coefficients (a mixture of experts' load-balancing
    /// and z-losses).
    pub loss: Tensor<B, 1>,
    /// The router's counts.
    pub routing: Routing,
}

/// What a mixture-of-experts router did with one batch (summed over its rows).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routing {
    /// Assignments (token, choice) each expert received, before capacity.
    pub routed: Vec<u64>,
    /// Assignments each expert processed, after capacity.
    pub kept: Vec<u64>,
    /// Assignments dropped for capacity.
    pub dropped: u64,
}

impl Routing {
    /// `other`'s counts added to these (same experts; an empty record takes `other`'s).
    pub fn add(&mut self, other: &Routing) {
        if self.routed.is_empty() {
            *self = other.clone();
            return;
        }
        for (a, b) in self.routed.iter_mut().zip(&other.routed) {
            *a += b;
        }
        for (a, b) in self.kept.iter_mut().zip(&other.kept) {
            *a += b;
        }
        self.dropped += other.dropped;
    }
}

/// The forward of evaluation and generation: the provided methods of [`ForwardHooks`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Inference;

impl<B: FusedOps> ForwardHooks<'_, B> for Inference {}

/// Which activations are recomputed in backward instead of kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Keep the matmul outputs, recompute the attention core (scores, probabilities, dropout).
    Selective,
    /// Keep only each block's input; recompute every block (but the last, see
    /// [`Recompute::recomputes_block`]).
    Full,
    /// Recompute blocks 0, n, 2n, … (not the last); keep the others' activations.
    EveryNth(usize),
}

impl Recompute {
    /// Whether block `index` of `count` is a recomputed region. The last block never is: its
    /// backward runs first, right after the forward, so keeping its activations adds nothing to
    /// the peak (a recomputed block's activations are alive at that point anyway) and saves
    /// recomputing it.
    pub fn recomputes_block(self, index: usize, count: usize) -> bool {
        index + 1 < count
            && match self {
                Recompute::Full => true,
                Recompute::EveryNth(n) => n > 0 && index.is_multiple_of(n),
                Recompute::None | Recompute::Selective => false,
            }
    }
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

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recompute::None => f.write_str("none"),
            Recompute::Selective => f.write_str("selective"),
            Recompute::Full => f.write_str("full"),
            Recompute::EveryNth(n) => write!(f, "every-{n}"),
        }
    }
}
