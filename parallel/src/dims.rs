//! The parallel degrees of a run, validated once: which mesh they make, how many ranks they
//! need, over which ranks the data is split and the parameters are sharded. The driver's flags,
//! the launcher check and the memory estimate all read them from here.
//!
//! The axes, outermost first (the last varies fastest, so tensor-parallel peers are neighbours):
//!
//! | degree | axis | kind | what it splits |
//! |---|---|---|---|
//! | `dp_replicate` | `dp_replicate` | data | the batch; HSDP's replicas of a sharded model |
//! | `dp_shard` | `dp` (`dp_shard` under HSDP) | data | the batch; FSDP / ZeRO shard over it |
//! | `ep` | `ep` | data | taken from the `dp_shard` ranks (as torchtitan does): the batch, and an expert layer's experts |
//! | `pp` | `pp` | model | the layers, into stages |
//! | `cp` | `cp` | data | the sequence (not the rows: its ranks read the same ones); parameters and gradients as on a data axis |
//! | `tp` | `tp` | model | weight matrices (Megatron); with `sp`, the residual stream's sequence too |
//!
//! Sequence parallelism is a mode of `tp`, not an axis. `ep` is no extra rank: `dp_shard` ranks
//! are split into `dp_shard / ep` groups of `ep`, so the world is
//! `dp_replicate · dp_shard · pp · cp · tp` whatever `ep` is.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::mesh::DeviceMesh;

/// The parallel degrees of a run (see the module docs for the axes they make).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParallelDims {
    /// Replicas of the sharded model (HSDP's outer data axis); 1 otherwise.
    pub dp_replicate: usize,
    /// Data-parallel ranks within a replica: what FSDP / ZeRO shard over (DDP replicates).
    pub dp_shard: usize,
    /// Expert-parallel ranks, a factor of `dp_shard`.
    pub ep: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Context-parallel ranks: each holds `1/cp` of every sequence.
    pub cp: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Megatron sequence parallelism over the `tp` ranks.
    pub sp: bool,
}

impl Default for ParallelDims {
    /// One rank.
    fn default() -> Self {
        Self {
            dp_replicate: 1,
            dp_shard: 1,
            ep: 1,
            pp: 1,
            cp: 1,
            tp: 1,
            sp: false,
        }
    }
}

impl ParallelDims {
    /// Check the degrees: each at least 1, `ep` a factor of `dp_shard`, `sp` only with `tp > 1`.
    pub fn validate(self) -> Result<Self, Error> {
        let invalid = |reason: String| Err(Error::InvalidDims { reason });
        for (name, size) in [
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("ep", self.ep),
            ("pp", self.pp),
            ("cp", self.cp),
            ("tp", self.tp),
        ] {
            if size == 0 {
                return invalid(format!("{name} is 0: every degree is at least 1"));
            }
        }
        if !self.dp_shard.is_multiple_of(self.ep) {
            return invalid(format!(
                "ep {} does not divide the {} data-sharding ranks it is taken from: choose ep a \
                 factor of dp_shard",
                self.ep, self.dp_shard
            ));
        }
        if self.sp && self.tp < 2 {
            return invalid(
                "sequence parallelism shards over the tensor-parallel ranks: it needs tp 2 or more"
                    .into(),
            );
        }
        Ok(self)
    }

    /// Ranks in all: `dp_replicate · dp_shard · pp · cp · tp`.
    pub fn world_size(&self) -> usize {
        self.data_degree() * self.model_degree()
    }

    /// Ranks that read different rows of the batch: `dp_replicate · dp_shard`.
    pub fn data_degree(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// Ranks that read the same rows: `pp · cp · tp`, the group a launcher's world is divided by
    /// to find the data-parallel degree.
    pub fn model_degree(&self) -> usize {
        self.pp * self.cp * self.tp
    }

    /// Ranks one parameter's shard group spans under FSDP / ZeRO: `dp_shard · cp`.
    pub fn shard_degree(&self) -> usize {
        self.dp_shard * self.cp
    }

    /// The data-parallel degree a launcher's `world` leaves once the model axes are placed, when
    /// it divides.
    pub fn data_degree_of(&self, world: usize) -> Option<usize> {
        world
            .is_multiple_of(self.model_degree())
            .then(|| world / self.model_degree())
    }

    /// The mesh: `dp` (or `dp_replicate × dp_shard` when there are replicas) with `ep` split
    /// from it when above 1 — `ep` the outer of the two, so that an expert-axis member's share
    /// of the stacked expert weights is one run of experts, FSDP's split over `dp` nested inside
    /// it — then `pp` and `cp` when above 1, and `tp` always (a size-1 `tp` keeps every layout
    /// the same shape).
    pub fn mesh(&self) -> Result<DeviceMesh, Error> {
        let shard = self.dp_shard / self.ep.max(1);
        let mut axes = Vec::new();
        if self.dp_replicate > 1 {
            axes.push(("dp_replicate", self.dp_replicate));
        }
        if self.ep > 1 {
            axes.push(("ep", self.ep));
        }
        axes.push((
            if self.dp_replicate > 1 {
                "dp_shard"
            } else {
                "dp"
            },
            shard,
        ));
        for (name, size) in [("pp", self.pp), ("cp", self.cp)] {
            if size > 1 {
                axes.push((name, size));
            }
        }
        axes.push(("tp", self.tp));
        DeviceMesh::new(axes)
    }
}

/// How a context-parallel rank's part of each sequence is laid out (`--cp-layout`).
///
/// The sequence is cut into equal chunks. `Plain`: `cp` chunks, rank `r` holding chunk `r` —
/// under a causal mask the last rank attends to every key and the first to its own only.
/// `Balanced` (the "zig-zag" of ring-attention implementations): `2·cp` chunks, rank `r` holding
/// chunks `r` and `2·cp − 1 − r`, so every rank attends to the same number of keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpLayout {
    /// Two chunks per rank, `r` and `2·cp − 1 − r`: equal causal work on every rank.
    #[default]
    Balanced,
    /// One contiguous chunk per rank, `r`.
    Plain,
}

impl CpLayout {
    /// How many chunks a sequence is cut into over `cp` ranks.
    pub fn chunks(self, cp: usize) -> usize {
        match self {
            CpLayout::Balanced => 2 * cp,
            CpLayout::Plain => cp,
        }
    }

    /// The chunks (global indices, in the order the rank holds them) of the member at `index`
    /// of a context-parallel group of `cp`.
    pub fn held(self, cp: usize, index: usize) -> Vec<usize> {
        match self {
            CpLayout::Balanced => vec![index, 2 * cp - 1 - index],
            CpLayout::Plain => vec![index],
        }
    }

    /// Where chunk `chunk` lives: the member that holds it, and its slot among that member's
    /// chunks ([`CpLayout::held`]).
    pub fn owner(self, cp: usize, chunk: usize) -> (usize, usize) {
        match self {
            CpLayout::Balanced if chunk >= cp => (2 * cp - 1 - chunk, 1),
            _ => (chunk, 0),
        }
    }

    /// The chunk length of a sequence of `t` over `cp` ranks, or a typed error naming the
    /// lengths that split.
    pub fn chunk_len(self, cp: usize, t: usize) -> Result<usize, Error> {
        let chunks = self.chunks(cp);
        if t == 0 || !t.is_multiple_of(chunks) {
            return Err(Error::InvalidDims {
                reason: format!(
                    "a sequence of {t} does not split into the {chunks} equal chunks of cp {cp} \
                     with the {self} layout: choose a length that is a multiple of {chunks}"
                ),
            });
        }
        Ok(t / chunks)
    }

    /// The ranges of a sequence of `t` that the member at `index` holds, in its order (the
    /// columns a data loader hands it).
    pub fn ranges(self, cp: usize, index: usize, t: usize) -> Result<Vec<Range<usize>>, Error> {
        let c = self.chunk_len(cp, t)?;
        Ok(self
            .held(cp, index)
            .into_iter()
            .map(|k| k * c..(k + 1) * c)
            .collect())
    }

    /// The global positions of the `len` positions the member at `index` holds (`len` its
    /// local sequence length).
    pub fn positions(self, cp: usize, index: usize, len: usize) -> Vec<usize> {
        let held = self.held(cp, index);
        let c = len / held.len();
        held.into_iter().flat_map(|k| k * c..(k + 1) * c).collect()
    }
}

impl fmt::Display for CpLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CpLayout::Balanced => "balanced",
            CpLayout::Plain => "plain",
        })
    }
}

impl FromStr for CpLayout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "balanced" => Ok(CpLayout::Balanced),
            "plain" => Ok(CpLayout::Plain),
            other => Err(format!(
                "unknown context-parallel layout '{other}': choose balanced or plain"
            )),
        }
    }
}

/// How a context-parallel rank meets the keys and values of the others (`--cp-rotate`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpRotate {
    /// Ring attention: the key/value blocks pass around the ring, one neighbour's per step,
    /// the next block's transfer overlapping the current block's compute; backward sends the
    /// key/value gradients around with them. A rank holds two key/value blocks at a time.
    #[default]
    Ring,
    /// One all-gather of the keys and values per layer (and a reduce-scatter of their
    /// gradients): fewer, larger messages, the whole sequence's keys and values held at once.
    AllGather,
}

impl fmt::Display for CpRotate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CpRotate::Ring => "ring",
            CpRotate::AllGather => "allgather",
        })
    }
}

impl FromStr for CpRotate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ring" => Ok(CpRotate::Ring),
            "allgather" | "all-gather" => Ok(CpRotate::AllGather),
            other => Err(format!(
                "unknown context-parallel rotation '{other}': choose ring or allgather"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(dp_replicate: usize, dp_shard: usize, pp: usize, cp: usize, tp: usize) -> ParallelDims {
        ParallelDims {
            dp_replicate,
            dp_shard,
            pp,
            cp,
            tp,
            ..ParallelDims::default()
        }
    }

    /// The mesh of each combination, the world it needs, and the degrees read from it.
    #[test]
    fn meshes_and_degrees() {
        let cases = [
            (dims(1, 1, 1, 1, 1), "dp=1 × tp=1"),
            (dims(1, 4, 1, 1, 2), "dp=4 × tp=2"),
            (dims(2, 2, 1, 1, 2), "dp_replicate=2 × dp_shard=2 × tp=2"),
            (dims(1, 2, 2, 1, 2), "dp=2 × pp=2 × tp=2"),
            (dims(1, 2, 1, 2, 1), "dp=2 × cp=2 × tp=1"),
            (
                ParallelDims {
                    ep: 2,
                    ..dims(1, 4, 1, 1, 1)
                },
                "ep=2 × dp=2 × tp=1",
            ),
        ];
        for (d, want) in cases {
            let d = d.validate().unwrap();
            let mesh = d.mesh().unwrap();
            assert_eq!(mesh.to_string(), want);
            assert_eq!(mesh.world_size(), d.world_size(), "{want}");
            // The rows a rank reads: every data axis but cp.
            assert_eq!(mesh.data_index(0).1, d.data_degree(), "{want}");
        }
        let d = dims(1, 2, 2, 2, 2);
        assert_eq!(d.world_size(), 16);
        assert_eq!(d.model_degree(), 8);
        assert_eq!(d.shard_degree(), 4);
        assert_eq!(d.data_degree_of(32), Some(4));
        assert_eq!(d.data_degree_of(12), None);
    }

    /// The balanced layout gives member `r` chunks `r` and `2·cp − 1 − r` (every chunk held once,
    /// found where `owner` says), the plain one chunk `r`; positions and ranges follow them.
    #[test]
    fn context_layouts_hold_every_chunk_once() {
        for cp in [1, 2, 3, 4] {
            for layout in [CpLayout::Balanced, CpLayout::Plain] {
                let mut seen = vec![0; layout.chunks(cp)];
                for r in 0..cp {
                    for (slot, k) in layout.held(cp, r).into_iter().enumerate() {
                        seen[k] += 1;
                        assert_eq!(layout.owner(cp, k), (r, slot), "{layout} cp {cp} chunk {k}");
                    }
                }
                assert!(seen.iter().all(|&n| n == 1), "{layout} cp {cp}: {seen:?}");
            }
        }
        let b = CpLayout::Balanced;
        assert_eq!(b.ranges(2, 0, 8).unwrap(), vec![0..2, 6..8]);
        assert_eq!(b.ranges(2, 1, 8).unwrap(), vec![2..4, 4..6]);
        assert_eq!(b.positions(2, 1, 4), vec![2, 3, 4, 5]);
        assert_eq!(CpLayout::Plain.positions(2, 1, 4), vec![4, 5, 6, 7]);
        let e = b.ranges(2, 0, 6).unwrap_err().to_string();
        assert!(e.contains("multiple of 4"), "{e}");
        assert_eq!("plain".parse::<CpLayout>(), Ok(CpLayout::Plain));
        assert_eq!("allgather".parse::<CpRotate>(), Ok(CpRotate::AllGather));
        assert!(
            "zigzag"
                .parse::<CpLayout>()
                .unwrap_err()
                .contains("balanced or plain")
        );
    }

    #[test]
    fn invalid_degrees_are_refused_with_the_fix() {
        let err = |d: ParallelDims| d.validate().unwrap_err().to_string();
        assert!(err(dims(1, 0, 1, 1, 1)).contains("dp_shard is 0"));
        let e = err(ParallelDims {
            ep: 3,
            ..dims(1, 4, 1, 1, 1)
        });
        assert!(e.contains("ep 3 does not divide"), "{e}");
        let e = err(ParallelDims {
            sp: true,
            ..dims(1, 2, 1, 1, 1)
        });
        assert!(e.contains("needs tp 2 or more"), "{e}");
    }
}
