//! The device mesh: named axes over the ranks of a world.
//!
//! A mesh arranges `world_size` ranks in an n-dimensional grid whose axes have a name and a
//! role. Ranks are numbered row-major, the **last axis varying fastest** (like PyTorch's
//! `init_device_mesh`): on `dp=2 × tp=2`, ranks 0 and 1 share a `dp` coordinate and form one
//! tensor-parallel group, ranks 0 and 2 form one data-parallel group.
//!
//! "Axis" always means a mesh axis; "dim" always means a tensor dimension.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// What a mesh axis is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AxisKind {
    /// Data parallelism (DDP, FSDP, HSDP, and the expert axis taken from its ranks): every rank
    /// on the axis sees different batch data. Parameters are replicated or sharded over it and
    /// gradients reduced over it. The context axis ([`CONTEXT_AXIS`]) is one too, its ranks
    /// seeing different positions of the same rows.
    Data,
    /// Model parallelism (tensor, pipeline): ranks on the axis hold different pieces of the model
    /// and see the same batch data.
    Model,
}

/// The name of the pipeline axis: its ranks hold different stages of the model (a parameter lives
/// on one of them, so a sum over the mesh counts it once there, never as replicated).
pub const PIPELINE_AXIS: &str = "pp";

/// The name of the context-parallel axis: a data axis whose ranks read the same rows (each holds
/// a part of every sequence), so [`DeviceMesh::data_index`] does not count it.
pub const CONTEXT_AXIS: &str = "cp";

/// The name of the expert-parallel axis: a data axis taken from the data-sharding ranks, over
/// which a mixture of experts' experts are split (their stacked weights `Shard(0)`) and its
/// routed rows exchanged.
pub const EXPERT_AXIS: &str = "ep";

/// The accepted axis names and their roles, in the order error messages list them (see
/// [`crate::ParallelDims`] for what each splits). Sequence parallelism is a mode of `tp`, not an
/// axis; `ep` is a split of the data-sharding ranks.
const AXIS_NAMES: [(&str, AxisKind); 7] = [
    ("dp", AxisKind::Data),
    ("dp_replicate", AxisKind::Data),
    ("dp_shard", AxisKind::Data),
    (EXPERT_AXIS, AxisKind::Data),
    (CONTEXT_AXIS, AxisKind::Data),
    ("tp", AxisKind::Model),
    (PIPELINE_AXIS, AxisKind::Model),
];

impl AxisKind {
    /// The role of the axis called `name`, or `None` when the name is not an accepted one.
    pub fn of(name: &str) -> Option<AxisKind> {
        AXIS_NAMES
            .iter()
            .find(|(known, _)| *known == name)
            .map(|&(_, kind)| kind)
    }
}

/// One axis of a [`DeviceMesh`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshAxis {
    /// The axis name, one of `dp`, `dp_replicate`, `dp_shard`, `ep`, `cp`, `tp`, `pp`.
    pub name: String,
    /// How many ranks lie along the axis (at least 1).
    pub size: usize,
    /// The axis role, implied by its name.
    pub kind: AxisKind,
}

impl MeshAxis {
    /// Whether this is the pipeline axis ([`PIPELINE_AXIS`]): its ranks hold different stages,
    /// so a tensor `Replicate` along it is not a copy of one value.
    pub fn is_pipeline(&self) -> bool {
        self.name == PIPELINE_AXIS
    }
}

fn accepted_names() -> String {
    let names = |kind| {
        AXIS_NAMES
            .iter()
            .filter(|(_, k)| *k == kind)
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{} (data axes) and {} (model axes)",
        names(AxisKind::Data),
        names(AxisKind::Model)
    )
}

/// Named axes over the ranks of a world, validated on construction.
///
/// Ranks are laid out row-major: the last axis varies fastest, so
/// `rank = Σ coord_i · stride_i` with `stride_i = Π_{j>i} size_j`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawMesh")]
pub struct DeviceMesh {
    axes: Vec<MeshAxis>,
}

/// The serialised form, validated into a [`DeviceMesh`] on deserialisation.
#[derive(Deserialize)]
struct RawMesh {
    axes: Vec<MeshAxis>,
}

impl TryFrom<RawMesh> for DeviceMesh {
    type Error = Error;

    fn try_from(raw: RawMesh) -> Result<Self, Error> {
        for axis in &raw.axes {
            if let Some(expected) = AxisKind::of(&axis.name)
                && expected != axis.kind
            {
                return Err(Error::WrongKind {
                    name: axis.name.clone(),
                    kind: format!("{:?}", axis.kind),
                    expected: format!("{expected:?}"),
                });
            }
        }
        DeviceMesh::new(raw.axes.into_iter().map(|axis| (axis.name, axis.size)))
    }
}

impl DeviceMesh {
    /// A mesh with the given `(name, size)` axes, in order (the last varies fastest).
    ///
    /// Fails on an empty list, an unknown or repeated name, or a size of 0.
    pub fn new<I, S>(axes: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = (S, usize)>,
        S: Into<String>,
    {
        let mut checked: Vec<MeshAxis> = Vec::new();
        for (name, size) in axes {
            let name = name.into();
            let kind = AxisKind::of(&name).ok_or_else(|| Error::UnknownAxis {
                name: name.clone(),
                accepted: accepted_names(),
            })?;
            if checked.iter().any(|axis| axis.name == name) {
                return Err(Error::DuplicateAxis { name });
            }
            if size == 0 {
                return Err(Error::ZeroSize { name });
            }
            checked.push(MeshAxis { name, size, kind });
        }
        if checked.is_empty() {
            return Err(Error::EmptyMesh);
        }
        let mesh = DeviceMesh { axes: checked };
        mesh.axes
            .iter()
            .try_fold(1usize, |product, axis| product.checked_mul(axis.size))
            .ok_or_else(|| Error::MeshTooLarge {
                mesh: mesh.to_string(),
            })?;
        Ok(mesh)
    }

    /// Like [`DeviceMesh::new`], and also checks that the axis sizes multiply to `world`,
    /// reporting every factor in one message when they do not.
    pub fn with_world<I, S>(axes: I, world: usize) -> Result<Self, Error>
    where
        I: IntoIterator<Item = (S, usize)>,
        S: Into<String>,
    {
        let mesh = Self::new(axes)?;
        let product = mesh.world_size();
        if product != world {
            return Err(Error::WorldMismatch {
                mesh: mesh.to_string(),
                product,
                world,
            });
        }
        Ok(mesh)
    }

    /// The mesh of a world of one rank: a single data axis `dp` of size 1.
    pub fn single() -> Self {
        DeviceMesh {
            axes: vec![MeshAxis {
                name: "dp".to_owned(),
                size: 1,
                kind: AxisKind::Data,
            }],
        }
    }

    /// The number of ranks: the product of the axis sizes.
    pub fn world_size(&self) -> usize {
        self.axes.iter().map(|axis| axis.size).product()
    }

    /// The axes, in order (the last varies fastest).
    pub fn axes(&self) -> &[MeshAxis] {
        &self.axes
    }

    /// The axis at `index`.
    ///
    /// # Panics
    /// If `index` is not below the number of axes.
    pub fn axis(&self, index: usize) -> &MeshAxis {
        &self.axes[index]
    }

    /// The index of the axis called `name`.
    pub fn axis_index(&self, name: &str) -> Result<usize, Error> {
        self.axes
            .iter()
            .position(|axis| axis.name == name)
            .ok_or_else(|| Error::NoSuchAxis {
                name: name.to_owned(),
                mesh: self.to_string(),
                axes: self
                    .axes
                    .iter()
                    .map(|axis| axis.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The size of the axis at `index`.
    ///
    /// # Panics
    /// If `index` is not below the number of axes.
    pub fn axis_size(&self, index: usize) -> usize {
        self.axes[index].size
    }

    /// The distance in ranks between neighbours along the axis at `index`.
    fn stride(&self, index: usize) -> usize {
        self.axes[index + 1..]
            .iter()
            .map(|axis| axis.size)
            .product()
    }

    /// The coordinates of `rank`, one per axis.
    ///
    /// # Panics
    /// If `rank` is not below the world size.
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        self.check_rank(rank);
        let mut rest = rank;
        let mut coords = vec![0; self.axes.len()];
        for (coord, axis) in coords.iter_mut().zip(&self.axes).rev() {
            *coord = rest % axis.size;
            rest /= axis.size;
        }
        coords
    }

    /// The rank at `coords` (one per axis).
    ///
    /// # Panics
    /// If `coords` has the wrong length or a coordinate is out of range for its axis.
    pub fn rank_of(&self, coords: &[usize]) -> usize {
        assert_eq!(
            coords.len(),
            self.axes.len(),
            "mesh {self} has {} axes, got coordinates {coords:?}",
            self.axes.len()
        );
        coords
            .iter()
            .zip(&self.axes)
            .fold(0, |rank, (&coord, axis)| {
                assert!(
                    coord < axis.size,
                    "coordinate {coord} is out of range for axis {}={} (coordinates {coords:?})",
                    axis.name,
                    axis.size
                );
                rank * axis.size + coord
            })
    }

    /// The ranks of `rank`'s sub-group along the axis at `axis`: the ranks that share every
    /// other coordinate with `rank`, ordered by their coordinate on `axis`.
    ///
    /// # Panics
    /// If `rank` or `axis` is out of range.
    pub fn group_ranks(&self, rank: usize, axis: usize) -> Vec<usize> {
        let stride = self.stride(axis);
        let base = rank - self.group_index(rank, axis) * stride;
        (0..self.axes[axis].size)
            .map(|index| base + index * stride)
            .collect()
    }

    /// `rank`'s index inside its sub-group along the axis at `axis`: its coordinate on `axis`.
    ///
    /// # Panics
    /// If `rank` or `axis` is out of range.
    pub fn group_index(&self, rank: usize, axis: usize) -> usize {
        self.check_rank(rank);
        (rank / self.stride(axis)) % self.axes[axis].size
    }

    /// The mesh's expert axis ([`EXPERT_AXIS`]) and its size, when it has one of more than one
    /// member.
    pub fn expert_axis(&self) -> Option<(usize, usize)> {
        let a = self.axis_index(EXPERT_AXIS).ok()?;
        let size = self.axis_size(a);
        (size > 1).then_some((a, size))
    }

    /// `rank`'s index among the data-parallel ranks, row-major over the data axes but the
    /// context axis, and their number (the product of those axes): the ranks of one
    /// model-parallel group (tensor, pipeline) and of one context-parallel group share an index,
    /// so they read the same rows.
    ///
    /// # Panics
    /// If `rank` is out of range.
    pub fn data_index(&self, rank: usize) -> (usize, usize) {
        let coords = self.coords(rank);
        self.axes
            .iter()
            .zip(coords)
            .filter(|(axis, _)| axis.kind == AxisKind::Data && axis.name != CONTEXT_AXIS)
            .fold((0, 1), |(index, size), (axis, coord)| {
                (index * axis.size + coord, size * axis.size)
            })
    }

    fn check_rank(&self, rank: usize) {
        assert!(
            rank < self.world_size(),
            "rank {rank} is out of range for mesh {self} of {} ranks",
            self.world_size()
        );
    }
}

impl fmt::Display for DeviceMesh {
    /// Every factor: `dp=2 × tp=2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, axis) in self.axes.iter().enumerate() {
            if index > 0 {
                f.write_str(" × ")?;
            }
            write!(f, "{}={}", axis.name, axis.size)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The data index runs row-major over the data axes only: the tensor-parallel peers of a
    /// rank share it, and the pipeline axis (a model axis) does not split the data.
    #[test]
    fn data_index_counts_data_axes_only() {
        let mesh =
            DeviceMesh::new([("dp_replicate", 2), ("dp_shard", 2), ("pp", 2), ("tp", 2)]).unwrap();
        let indices: Vec<(usize, usize)> =
            (0..mesh.world_size()).map(|r| mesh.data_index(r)).collect();
        for (rank, &(index, size)) in indices.iter().enumerate() {
            assert_eq!(size, 4);
            assert_eq!(index, rank / 4, "rank {rank}");
        }
        assert_eq!(DeviceMesh::single().data_index(0), (0, 1));
    }

    #[test]
    fn world_mismatch_lists_every_factor() {
        let err = DeviceMesh::with_world([("dp", 3), ("tp", 2)], 4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "mesh dp=3 × tp=2 = 6 ranks does not match the world size 4; \
             choose axis sizes whose product is 4"
        );
        let mesh = DeviceMesh::with_world([("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)], 8)
            .expect("valid mesh");
        assert_eq!(mesh.to_string(), "dp_replicate=2 × dp_shard=2 × tp=2");
        assert_eq!(mesh.world_size(), 8);
    }

    #[test]
    fn invalid_axes_are_rejected() {
        let err = DeviceMesh::new([("batch", 2)]).unwrap_err();
        assert_eq!(
            err,
            Error::UnknownAxis {
                name: "batch".into(),
                accepted: accepted_names(),
            }
        );
        let message = err.to_string();
        for name in ["dp", "dp_replicate", "dp_shard", "ep", "cp", "tp", "pp"] {
            assert!(message.contains(name), "{message}");
        }
        // Sequence parallelism is a mode of tp, not an axis.
        assert!(DeviceMesh::new([("sp", 2)]).is_err());
        assert_eq!(
            DeviceMesh::new([("dp", 2), ("dp", 2)]).unwrap_err(),
            Error::DuplicateAxis { name: "dp".into() }
        );
        assert_eq!(
            DeviceMesh::new([("dp", 2), ("tp", 0)]).unwrap_err(),
            Error::ZeroSize { name: "tp".into() }
        );
        assert_eq!(
            DeviceMesh::new(Vec::<(&str, usize)>::new()).unwrap_err(),
            Error::EmptyMesh
        );
        assert!(matches!(
            DeviceMesh::new([("dp", usize::MAX), ("tp", 2)]),
            Err(Error::MeshTooLarge { .. })
        ));
    }

    #[test]
    fn kinds_and_lookup() {
        let mesh = DeviceMesh::new([("dp", 2), ("tp", 3)]).unwrap();
        assert_eq!(mesh.axis(0).kind, AxisKind::Data);
        assert_eq!(mesh.axis(1).kind, AxisKind::Model);
        assert_eq!(mesh.axis_index("tp"), Ok(1));
        assert_eq!(mesh.axis_size(1), 3);
        let err = mesh.axis_index("pp").unwrap_err();
        assert_eq!(
            err.to_string(),
            "mesh dp=2 × tp=3 has no axis \"pp\"; its axes are dp, tp"
        );
        let single = DeviceMesh::single();
        assert_eq!(single.world_size(), 1);
        assert_eq!(single.to_string(), "dp=1");
        assert_eq!(single.group_ranks(0, 0), vec![0]);
    }

    #[test]
    fn coords_round_trip() {
        let mesh = DeviceMesh::new([("pp", 2), ("dp", 3), ("tp", 2)]).unwrap();
        for rank in 0..mesh.world_size() {
            let coords = mesh.coords(rank);
            assert_eq!(mesh.rank_of(&coords), rank);
            for (axis, &coord) in coords.iter().enumerate() {
                assert_eq!(mesh.group_index(rank, axis), coord);
            }
        }
        // The last axis varies fastest.
        assert_eq!(mesh.coords(1), vec![0, 0, 1]);
        assert_eq!(mesh.coords(2), vec![0, 1, 0]);
        assert_eq!(mesh.coords(6), vec![1, 0, 0]);
    }

    #[test]
    fn group_ranks_on_2x2_and_2x3() {
        let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
        assert_eq!(mesh.group_ranks(0, 0), vec![0, 2]);
        assert_eq!(mesh.group_ranks(3, 0), vec![1, 3]);
        assert_eq!(mesh.group_ranks(0, 1), vec![0, 1]);
        assert_eq!(mesh.group_ranks(3, 1), vec![2, 3]);

        let mesh = DeviceMesh::new([("dp", 2), ("tp", 3)]).unwrap();
        assert_eq!(mesh.group_ranks(4, 0), vec![1, 4]);
        assert_eq!(mesh.group_ranks(4, 1), vec![3, 4, 5]);
        assert_eq!(mesh.group_index(4, 1), 1);
        assert_eq!(mesh.group_ranks(2, 1), vec![0, 1, 2]);
        assert_eq!(mesh.group_ranks(2, 0), vec![2, 5]);
        // Every rank is in exactly one group per axis, at its own index.
        for axis in 0..2 {
            for rank in 0..6 {
                let group = mesh.group_ranks(rank, axis);
                assert_eq!(group[mesh.group_index(rank, axis)], rank);
                for &member in &group {
                    assert_eq!(mesh.group_ranks(member, axis), group);
                }
            }
        }
    }

    #[test]
    fn deserialised_meshes_are_validated() {
        let axes = DeviceMesh::new([("dp", 2), ("tp", 2)])
            .unwrap()
            .axes()
            .to_vec();
        let mesh = DeviceMesh::try_from(RawMesh { axes: axes.clone() }).unwrap();
        assert_eq!(mesh.axes(), &axes[..]);
        let mut wrong = axes.clone();
        wrong[1].kind = AxisKind::Data;
        assert_eq!(
            DeviceMesh::try_from(RawMesh { axes: wrong }).unwrap_err(),
            Error::WrongKind {
                name: "tp".into(),
                kind: "Data".into(),
                expected: "Model".into()
            }
        );
        let mut zero = axes;
        zero[0].size = 0;
        assert!(DeviceMesh::try_from(RawMesh { axes: zero }).is_err());
    }

    #[test]
    #[should_panic(expected = "rank 4 is out of range")]
    fn coords_of_missing_rank_panics() {
        DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap().coords(4);
    }
}
