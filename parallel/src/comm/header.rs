//! A [`Call`] on the wire (MPI, hybrid and NCCL communicators): the members of a group
//! exchange their calls as fixed-size headers — call number, collective, op, dim, root, dtype and
//! shape — before any data moves, so that members that diverge fail with
//! [`Error::Mismatch`] naming each member's call ([`Round`]) instead of hanging or mixing
//! buffers.

use std::collections::HashMap;
use std::sync::Mutex;

use burn::tensor::DType;

use super::call::{Call, Operand, Round};
use super::{CollectiveKind, Error, Group, ReduceOp, lock};
use crate::mesh::DeviceMesh;

/// Dimensions a header can describe.
const MAX_DIMS: usize = 8;
/// Words of an encoded buffer: dtype, ndims, shape.
pub(crate) const OPERAND: usize = 2 + MAX_DIMS;
/// Header words: sequence, kind, op, dim, root, then the buffer.
pub(crate) const HEADER: usize = 5 + OPERAND;
/// One member's header.
pub(crate) type Header = [i64; HEADER];
/// `ndims` of a member that passes no buffer (a broadcast's non-root members).
const NO_BUFFER: i64 = -1;

const KINDS: [CollectiveKind; 8] = [
    CollectiveKind::AllReduce,
    CollectiveKind::AllGather,
    CollectiveKind::ReduceScatter,
    CollectiveKind::Broadcast,
    CollectiveKind::Barrier,
    CollectiveKind::Send,
    CollectiveKind::Recv,
    CollectiveKind::AllToAll,
];

const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

const DTYPES: [DType; 13] = [
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

/// Each group's call counter (a header's call number).
#[derive(Debug, Default)]
pub(crate) struct Sequence(Mutex<HashMap<Group, i64>>);

impl Sequence {
    /// The number of this member's next call on `group`: 1, 2, …
    pub(crate) fn next(&self, group: Group) -> i64 {
        let mut sequence = lock(&self.0);
        let number = sequence.entry(group).or_insert(0);
        *number += 1;
        *number
    }

    /// The header of this member's next call, `call`: numbered on its group, its buffer
    /// checked to hold whole elements.
    pub(crate) fn header(&self, call: &Call) -> Result<(i64, Header), Error> {
        let seq = self.next(call.group());
        if let Some(buffer) = call.buffer() {
            buffer.check_element_size()?;
        }
        Ok((seq, encode(seq, call)?))
    }
}

fn code<T: PartialEq>(table: &[T], value: &T) -> Option<i64> {
    table.iter().position(|v| v == value).map(|i| i as i64)
}

fn decoded<T: Copy>(table: &[T], code: i64, what: &str) -> Result<T, Error> {
    usize::try_from(code)
        .ok()
        .and_then(|i| table.get(i).copied())
        .ok_or_else(|| {
            Error::Unsupported(format!(
                "a header with {what} code {code}, which this build does not know: every rank \
                 must run the same build"
            ))
        })
}

/// `dtype` as one header word.
pub(crate) fn dtype_code(dtype: DType) -> Result<i64, Error> {
    code(&DTYPES, &dtype).ok_or_else(|| Error::UnsupportedDType(format!("{dtype:?}")))
}

/// The dtype of a [`dtype_code`] word.
pub(crate) fn dtype_of(code: i64) -> Result<DType, Error> {
    decoded(&DTYPES, code, "dtype")
}

/// `buffer` as header words (`kind` names the call in errors).
pub(crate) fn encode_operand(
    kind: CollectiveKind,
    buffer: Option<&Operand>,
) -> Result<[i64; OPERAND], Error> {
    let mut words = [0i64; OPERAND];
    let Some(buffer) = buffer else {
        words[0] = -1;
        words[1] = NO_BUFFER;
        return Ok(words);
    };
    let dims = buffer.shape();
    if dims.len() > MAX_DIMS {
        return Err(Error::InvalidDim {
            op: kind,
            dim: dims.len(),
            ndims: MAX_DIMS,
        });
    }
    words[0] = code(&DTYPES, &buffer.dtype())
        .ok_or_else(|| Error::UnsupportedDType(buffer.dtype().name().to_owned()))?;
    words[1] = dims.len() as i64;
    for (slot, d) in words[2..].iter_mut().zip(dims) {
        *slot = *d as i64;
    }
    Ok(words)
}

/// The buffer [`encode_operand`] wrote.
pub(crate) fn decode_operand(words: &[i64]) -> Result<Option<Operand>, Error> {
    if words[1] == NO_BUFFER {
        return Ok(None);
    }
    let dtype = decoded(&DTYPES, words[0], "dtype")?;
    let ndims = usize::try_from(words[1])
        .ok()
        .filter(|&n| n <= MAX_DIMS)
        .ok_or_else(|| Error::Unsupported(format!("a header with {} dims", words[1])))?;
    let shape: Vec<usize> = words[2..2 + ndims].iter().map(|&d| d as usize).collect();
    Ok(Some(Operand::new(dtype, &shape)))
}

/// `call` as this member's `seq`-th call on its group.
pub(crate) fn encode(seq: i64, call: &Call) -> Result<Header, Error> {
    let mut h = [0i64; HEADER];
    h[0] = seq;
    h[1] = code(&KINDS, &call.kind()).expect("every kind has a code");
    h[2] = call
        .op()
        .map_or(-1, |op| code(&OPS, &op).expect("every op has a code"));
    h[3] = call.dim() as i64;
    h[4] = call.root() as i64;
    h[5..].copy_from_slice(&encode_operand(call.kind(), call.buffer())?);
    Ok(h)
}

/// The call number and call (on `group`) that [`encode`] wrote.
pub(crate) fn decode(h: &Header, group: Group) -> Result<(i64, Call), Error> {
    let op = match h[2] {
        -1 => None,
        code => Some(decoded(&OPS, code, "op")?),
    };
    let call = Call {
        kind: decoded(&KINDS, h[1], "collective")?,
        group,
        op,
        dim: h[3] as usize,
        root: h[4] as usize,
        buffer: decode_operand(&h[5..])?,
        // Variable-length: they travel after the header where the call has them.
        splits: None,
    };
    Ok((h[0], call))
}

/// Words as the bytes that travel (little-endian).
pub(crate) fn to_bytes(words: &[i64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// One little-endian word.
fn word(chunk: &[u8]) -> i64 {
    i64::from_le_bytes(chunk.try_into().expect("8 bytes"))
}

/// The first `N` words of `bytes` (little-endian).
pub(crate) fn from_bytes<const N: usize>(bytes: &[u8]) -> [i64; N] {
    let mut words = [0i64; N];
    for (w, chunk) in words.iter_mut().zip(bytes.chunks_exact(8)) {
        *w = word(chunk);
    }
    words
}

/// Every whole little-endian word of `bytes` (an all-to-all's splits, [`Splits::words`]).
///
/// [`Splits::words`]: super::call::Splits::words
pub(crate) fn words(bytes: &[u8]) -> Vec<i64> {
    bytes.chunks_exact(8).map(word).collect()
}

/// The round the members' headers describe (in group order), checked to be the same call with
/// the same call number on every member: `rank`'s call is `mine`.
pub(crate) fn round<'m>(
    mesh: &'m DeviceMesh,
    rank: usize,
    mine: &Call,
    headers: &[Header],
) -> Result<Round<'m>, Error> {
    let (numbers, calls): (Vec<i64>, Vec<Call>) = headers
        .iter()
        .map(|h| decode(h, mine.group()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .unzip();
    let round = Round::new(mesh, rank, mine.clone(), calls).numbered(numbers);
    round.check_calls()?;
    Ok(round)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    #[test]
    fn a_header_round_trips_its_call() {
        let data = TensorData::new(vec![1.0f32; 6], [2, 3]);
        let call = Call::reduce_scatter(Group::Axis(1), Operand::of(&data), 1, ReduceOp::Avg);
        let (seq, back) = decode(&encode(7, &call).unwrap(), Group::Axis(1)).unwrap();
        assert_eq!(seq, 7);
        assert!(back.same_call(&call));
        assert_eq!(back.to_string(), call.to_string());
        assert_eq!(back.counted_bytes(None), 24);
        let barrier = Call::barrier(Group::World);
        let (_, back) = decode(&encode(1, &barrier).unwrap(), Group::World).unwrap();
        assert!(back.same_call(&barrier) && back.buffer().is_none());
        let words = to_bytes(&encode(3, &call).unwrap());
        assert_eq!(from_bytes::<HEADER>(&words), encode(3, &call).unwrap());
    }

    #[test]
    fn a_diverging_round_names_every_member() {
        let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
        let data = TensorData::new(vec![1.0f32; 4], [4]);
        let mine = Call::all_reduce(Group::World, Operand::of(&data), ReduceOp::Sum);
        let other = Call::all_gather(Group::World, Operand::of(&data), 0);
        let headers = [encode(3, &mine).unwrap(), encode(3, &other).unwrap()];
        let error = round(&mesh, 0, &mine, &headers).err().unwrap().to_string();
        assert!(
            error.contains("rank 0 called all_reduce(sum) of f32 [4] (call #3)")
                && error.contains("rank 1 called all_gather(dim 0) of f32 [4] (call #3)"),
            "{error}"
        );
        let skipped = [encode(3, &mine).unwrap(), encode(4, &mine).unwrap()];
        assert!(round(&mesh, 0, &mine, &skipped).is_err());
    }
}
