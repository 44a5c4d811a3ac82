//! The header every checked collective exchanges first (MPI, hybrid and NCCL communicators):
//! call number, collective, op, dim, root, dtype and shape, so that members that diverge fail
//! with [`CommError::Mismatch`] naming each member's call instead of hanging or mixing buffers.

use burn::tensor::{DType, TensorData};

use super::buffer::element_size;
use super::{CollectiveKind, CommError, Group, ReduceOp};
use crate::mesh::DeviceMesh;

/// Dimensions a header can describe.
const MAX_DIMS: usize = 8;
/// Header words: sequence, kind, op, dim, root, dtype, ndims, shape.
pub(crate) const HEADER: usize = 7 + MAX_DIMS;
/// `ndims` of a member that passes no buffer (a broadcast's non-root members).
const NO_BUFFER: i64 = -1;

#[derive(Clone, Copy)]
pub(crate) struct Call {
    pub(crate) kind: CollectiveKind,
    pub(crate) op: Option<ReduceOp>,
    pub(crate) dim: usize,
    pub(crate) root: usize,
}

impl Call {
    /// A call along dim 0 (or a broadcast from `root`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn new(kind: CollectiveKind, op: Option<ReduceOp>, root: usize) -> Self {
        Self {
            kind,
            op,
            dim: 0,
            root,
        }
    }
}

fn kind_code(kind: CollectiveKind) -> i64 {
    kind as i64
}

fn op_code(op: Option<ReduceOp>) -> i64 {
    match op {
        None => -1,
        Some(ReduceOp::Sum) => 0,
        Some(ReduceOp::Avg) => 1,
        Some(ReduceOp::Max) => 2,
    }
}

pub(crate) const DTYPES: [DType; 13] = [
    DType::F64,
    DType::F32,
    DType::Flex32,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::I8,
    DType::U64,
    DType::U32,
    DType::U16,
    DType::U8,
];

fn dtype_code(dtype: DType) -> Result<i64, CommError> {
    DTYPES
        .iter()
        .position(|d| *d == dtype)
        .map(|i| i as i64)
        .ok_or_else(|| CommError::UnsupportedDType(dtype.name().to_owned()))
}

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn header(
    seq: i64,
    call: Call,
    data: Option<&TensorData>,
) -> Result<[i64; HEADER], CommError> {
    if let Some(data) = data {
        element_size(data)?;
    }
    header_of(seq, call, data.map(|d| (d.dtype, d.shape.as_slice())))
}

/// [`header`] from a buffer's dtype and shape (a device tensor's, say).
pub(crate) fn header_of(
    seq: i64,
    call: Call,
    buffer: Option<(DType, &[usize])>,
) -> Result<[i64; HEADER], CommError> {
    let mut h = [0i64; HEADER];
    h[0] = seq;
    h[1] = kind_code(call.kind);
    h[2] = op_code(call.op);
    h[3] = call.dim as i64;
    h[4] = call.root as i64;
    match buffer {
        Some((dtype, dims)) => {
            if dims.len() > MAX_DIMS {
                return Err(CommError::InvalidDim {
                    op: call.kind,
                    dim: dims.len(),
                    ndims: MAX_DIMS,
                });
            }
            h[5] = dtype_code(dtype)?;
            h[6] = dims.len() as i64;
            for (slot, d) in h[7..].iter_mut().zip(dims) {
                *slot = *d as i64;
            }
        }
        None => {
            h[5] = -1;
            h[6] = NO_BUFFER;
        }
    }
    Ok(h)
}

pub(crate) fn header_shape(h: &[i64]) -> Option<Vec<usize>> {
    (h[6] != NO_BUFFER).then(|| {
        h[7..7 + h[6] as usize]
            .iter()
            .map(|&d| d as usize)
            .collect()
    })
}

pub(crate) fn describe(h: &[i64]) -> String {
    let kind = match h[1] {
        0 => "all_reduce",
        1 => "all_gather",
        2 => "reduce_scatter",
        3 => "broadcast",
        4 => "barrier",
        _ => "?",
    };
    let dtype = usize::try_from(h[5])
        .ok()
        .and_then(|i| DTYPES.get(i))
        .map_or("-", |d| d.name());
    let op = ["sum", "avg", "max"]
        .get(h[2] as usize)
        .copied()
        .unwrap_or("-");
    format!(
        "call #{} {kind} (op {op}, dim {}, root {}) {dtype} {:?}",
        h[0],
        h[3],
        h[4],
        header_shape(h).unwrap_or_default()
    )
}

/// The mismatch of a round whose members' headers differ, naming every member's call.
pub(crate) fn mismatch(
    mesh: &DeviceMesh,
    rank: usize,
    group: Group,
    kind: CollectiveKind,
    headers: &[[i64; HEADER]],
) -> CommError {
    let members = group.ranks(mesh, rank).unwrap_or_default();
    CommError::Mismatch {
        op: kind,
        group: group.label(mesh).unwrap_or("?").to_owned(),
        detail: headers
            .iter()
            .zip(&members)
            .map(|(h, r)| format!("rank {r}: {}", describe(h)))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// Whether the members' buffers agree in dtype and shape (except on dim `except`).
pub(crate) fn layouts_agree<'h>(
    mut headers: impl Iterator<Item = &'h [i64; HEADER]> + Clone,
    except: Option<usize>,
) -> bool {
    let Some(first) = headers.clone().next() else {
        return true;
    };
    headers.all(|h| {
        h[5] == first[5]
            && h[6] == first[6]
            && (0..h[6].max(0) as usize).all(|d| Some(d) == except || h[7 + d] == first[7 + d])
    })
}
