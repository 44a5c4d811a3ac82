//! Host-buffer arithmetic behind the collectives: reduce, concatenate and chunk [`TensorData`].
//!
//! Splitting and joining work on bytes, for any dtype with whole-byte elements: a row-major
//! buffer is viewed as `[outer, dim, inner]`, where `outer` is the product of the sizes before
//! `dim` and `inner` the product of the sizes after it. Reductions decode the elements and
//! combine the buffers strictly in the order given.

use burn::tensor::{DType, Shape, TensorData, bf16, f16};

use super::{Error, ReduceOp};

/// The size in bytes of one element of `data`, checking that the buffer holds exactly
/// `num_elements` such elements (quantized and packed storage does not).
pub(crate) fn element_size(data: &TensorData) -> Result<usize, Error> {
    whole_elements(data.dtype, data.shape.num_elements(), data.bytes.len())
}

/// [`element_size`] of `bytes` holding `elements` of `dtype`.
pub(crate) fn whole_elements(dtype: DType, elements: usize, bytes: usize) -> Result<usize, Error> {
    let size = dtype.size();
    if size == 0 || bytes != elements * size {
        return Err(Error::UnsupportedDType(format!(
            "{} ({bytes} bytes for {elements} elements)",
            dtype.name(),
        )));
    }
    Ok(size)
}

/// Fails unless a buffer of `ndims` dimensions has dimension `dim` (the dimension a gather or
/// scatter runs along).
pub(crate) fn check_dim(op: super::CollectiveKind, ndims: usize, dim: usize) -> Result<(), Error> {
    if dim < ndims {
        Ok(())
    } else {
        Err(Error::InvalidDim { op, dim, ndims })
    }
}

/// Fails unless dimension `dim`, of size `size`, splits into `parts` equal chunks (a
/// reduce-scatter).
pub(crate) fn check_divisible(size: usize, dim: usize, parts: usize) -> Result<(), Error> {
    if size.is_multiple_of(parts) {
        Ok(())
    } else {
        Err(Error::Unsplittable { dim, size, parts })
    }
}

/// Fails unless reductions support `dtype`.
pub(crate) fn check_reducible(dtype: DType) -> Result<(), Error> {
    match dtype {
        DType::F32 | DType::Flex32 | DType::F64 | DType::F16 | DType::BF16 | DType::I32 => Ok(()),
        DType::I64 => Ok(()),
        other => Err(Error::UnsupportedDType(other.name().to_owned())),
    }
}

/// The element-wise reduction of `parts` (raw buffers of `dtype`, each holding `shape`),
/// combined in order: `((p0 ⊕ p1) ⊕ p2) ⊕ …`. `Avg` divides the sum by `parts.len()`;
/// f16 and bf16 accumulate in f32 and round once at the end.
///
/// The caller has checked the dtype ([`check_reducible`]) and the lengths.
pub(crate) fn reduce(parts: &[&[u8]], dtype: DType, shape: Shape, op: ReduceOp) -> TensorData {
    assert!(!parts.is_empty(), "a reduction needs at least one buffer");
    match dtype {
        DType::F32 => TensorData::new(fold::<f32, f32>(parts, op, |x| x, |x| x), shape),
        DType::Flex32 => {
            let mut data = TensorData::new(fold::<f32, f32>(parts, op, |x| x, |x| x), shape);
            data.dtype = DType::Flex32;
            data
        }
        DType::F64 => TensorData::new(fold::<f64, f64>(parts, op, |x| x, |x| x), shape),
        DType::F16 => TensorData::new(
            fold::<f16, f32>(parts, op, f16::to_f32, f16::from_f32),
            shape,
        ),
        DType::BF16 => TensorData::new(
            fold::<bf16, f32>(parts, op, bf16::to_f32, bf16::from_f32),
            shape,
        ),
        DType::I32 => TensorData::new(fold::<i32, i32>(parts, op, |x| x, |x| x), shape),
        DType::I64 => TensorData::new(fold::<i64, i64>(parts, op, |x| x, |x| x), shape),
        other => unreachable!("check_reducible lets {other:?} through"),
    }
}

/// Concatenates `parts` along `dim`. The caller has checked that they share the dtype and
/// every size but `dim`'s.
pub(crate) fn concat(parts: &[&TensorData], dim: usize) -> Result<TensorData, Error> {
    let first = parts[0];
    let size = element_size(first)?;
    let dims = first.shape.as_slice();
    let outer: usize = dims[..dim].iter().product();
    let inner_bytes = dims[dim + 1..].iter().product::<usize>() * size;
    let mut out_dims = dims.to_vec();
    out_dims[dim] = parts.iter().map(|part| part.shape[dim]).sum();
    for part in parts {
        element_size(part)?;
    }
    let mut bytes = Vec::with_capacity(out_dims.iter().product::<usize>() * size);
    for row in 0..outer {
        for part in parts {
            let block = part.shape[dim] * inner_bytes;
            bytes.extend_from_slice(&part.as_bytes()[row * block..(row + 1) * block]);
        }
    }
    Ok(TensorData::from_bytes_vec(bytes, out_dims, first.dtype))
}

/// An all-to-all's result: from each member's buffer (in group order) the rows `pieces` names
/// for it (`(first row, rows)`: what it sends this member), concatenated along dim 0. The round
/// checked the splits.
pub(crate) fn all_to_all_rows(
    buffers: &[&TensorData],
    pieces: &[(usize, usize)],
) -> Result<TensorData, Error> {
    let first = buffers[0];
    let size = element_size(first)?;
    let row = first.shape.as_slice()[1..].iter().product::<usize>() * size;
    let mut shape = first.shape.to_vec();
    shape[0] = pieces.iter().map(|&(_, rows)| rows).sum();
    let mut bytes = Vec::with_capacity(shape[0] * row);
    for (data, &(start, rows)) in buffers.iter().zip(pieces) {
        bytes.extend_from_slice(&data.as_bytes()[start * row..(start + rows) * row]);
    }
    Ok(TensorData::from_bytes_vec(bytes, shape, first.dtype))
}

/// The members' pieces, received one after the other in `all` (`shapes[i]`, `dtype`),
/// concatenated along `dim`. When every dim before `dim` has size 1 (dim 0 included, FSDP's
/// gathers) the received bytes already are the concatenation and are used as they are;
/// otherwise the rows are interleaved.
#[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
pub(crate) fn gathered(
    all: Vec<u8>,
    shapes: &[Vec<usize>],
    dim: usize,
    dtype: DType,
) -> Result<TensorData, Error> {
    let first = &shapes[0];
    let mut out = first.clone();
    out[dim] = shapes.iter().map(|s| s[dim]).sum();
    if first[..dim].iter().all(|&d| d == 1) {
        return Ok(TensorData::from_bytes_vec(all, out, dtype));
    }
    let size = dtype.size();
    let mut parts = Vec::with_capacity(shapes.len());
    let mut at = 0;
    for shape in shapes {
        let count = shape.iter().product::<usize>() * size;
        parts.push(TensorData::from_bytes_vec(
            all[at..at + count].to_vec(),
            shape.clone(),
            dtype,
        ));
        at += count;
    }
    concat(&parts.iter().collect::<Vec<_>>(), dim)
}

/// The bytes of chunk `index` of `parts` equal chunks of `data` along `dim`, and that chunk's
/// shape: borrowed where the chunk is one run of `data`'s bytes (`dim` 0, or every dim before it
/// of size 1), else copied. The caller has checked that `parts` divides the size of `dim`.
pub(crate) fn chunk_bytes(
    data: &TensorData,
    dim: usize,
    parts: usize,
    index: usize,
) -> Result<(std::borrow::Cow<'_, [u8]>, Shape), Error> {
    let size = element_size(data)?;
    let dims = data.shape.as_slice();
    let outer: usize = dims[..dim].iter().product();
    let inner_bytes = dims[dim + 1..].iter().product::<usize>() * size;
    let chunk = dims[dim] / parts;
    let block = dims[dim] * inner_bytes;
    let piece = chunk * inner_bytes;
    let mut shape = dims.to_vec();
    shape[dim] = chunk;
    let bytes = data.as_bytes();
    if outer == 1 {
        let start = index * piece;
        return Ok((
            std::borrow::Cow::Borrowed(&bytes[start..start + piece]),
            Shape::from(shape),
        ));
    }
    let mut out = Vec::with_capacity(outer * piece);
    for row in 0..outer {
        let start = row * block + index * piece;
        out.extend_from_slice(&bytes[start..start + piece]);
    }
    Ok((std::borrow::Cow::Owned(out), Shape::from(shape)))
}

/// A stored element type, decoded from native-endian bytes of any alignment.
trait Lane: Copy {
    const SIZE: usize;
    fn read(bytes: &[u8]) -> Self;
}

macro_rules! lane {
    ($($ty:ty => $bits:ty, $from:expr;)*) => {$(
        impl Lane for $ty {
            const SIZE: usize = size_of::<$ty>();
            fn read(bytes: &[u8]) -> Self {
                let bits = <$bits>::from_ne_bytes(bytes.try_into().expect("one element"));
                $from(bits)
            }
        }
    )*};
}

lane! {
    f32 => u32, f32::from_bits;
    f64 => u64, f64::from_bits;
    f16 => u16, f16::from_bits;
    bf16 => u16, bf16::from_bits;
    i32 => i32, std::convert::identity;
    i64 => i64, std::convert::identity;
}

/// The type a reduction accumulates in.
trait Accumulator: Copy {
    fn add(self, other: Self) -> Self;
    fn max(self, other: Self) -> Self;
    fn div(self, count: usize) -> Self;
}

macro_rules! float_accumulator {
    ($($ty:ty),*) => {$(
        impl Accumulator for $ty {
            fn add(self, other: Self) -> Self {
                self + other
            }
            fn max(self, other: Self) -> Self {
                if self.is_nan() || other.is_nan() { <$ty>::NAN } else { <$ty>::max(self, other) }
            }
            fn div(self, count: usize) -> Self {
                self / count as $ty
            }
        }
    )*};
}

macro_rules! int_accumulator {
    ($($ty:ty),*) => {$(
        impl Accumulator for $ty {
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn max(self, other: Self) -> Self {
                Ord::max(self, other)
            }
            fn div(self, count: usize) -> Self {
                self / count as $ty
            }
        }
    )*};
}

float_accumulator!(f32, f64);
int_accumulator!(i32, i64);

fn fold<S: Lane, A: Accumulator>(
    parts: &[&[u8]],
    op: ReduceOp,
    widen: impl Fn(S) -> A + Copy,
    narrow: impl Fn(A) -> S,
) -> Vec<S> {
    // One monomorphised loop per operation: a function pointer here kept the compiler from
    // inlining and vectorising the element loop (4-5× slower on large buffers).
    match op {
        ReduceOp::Sum | ReduceOp::Avg => fold_with(parts, op, widen, narrow, A::add),
        ReduceOp::Max => fold_with(parts, op, widen, narrow, A::max),
    }
}

#[inline(always)]
fn fold_with<S: Lane, A: Accumulator>(
    parts: &[&[u8]],
    op: ReduceOp,
    widen: impl Fn(S) -> A + Copy,
    narrow: impl Fn(A) -> S,
    combine: impl Fn(A, A) -> A + Copy,
) -> Vec<S> {
    let decode = |bytes: &[u8]| widen(S::read(bytes));
    let mut acc: Vec<A> = parts[0].chunks_exact(S::SIZE).map(decode).collect();
    for part in &parts[1..] {
        for (total, bytes) in acc.iter_mut().zip(part.chunks_exact(S::SIZE)) {
            *total = combine(*total, decode(bytes));
        }
    }
    if op == ReduceOp::Avg {
        let count = parts.len();
        acc.iter_mut().for_each(|total| *total = total.div(count));
    }
    acc.into_iter().map(narrow).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`reduce`] of whole buffers, of the first one's dtype and shape.
    fn reduced(parts: &[&TensorData], op: ReduceOp) -> TensorData {
        let raw: Vec<&[u8]> = parts.iter().map(|data| data.as_bytes()).collect();
        reduce(&raw, parts[0].dtype, parts[0].shape.clone(), op)
    }

    /// `data`'s `n` chunks along `dim`.
    fn chunks(data: &TensorData, dim: usize, n: usize) -> Vec<TensorData> {
        (0..n)
            .map(|index| {
                let (bytes, shape) = chunk_bytes(data, dim, n, index).unwrap();
                TensorData::from_bytes_vec(bytes.into_owned(), shape, data.dtype)
            })
            .collect()
    }

    #[test]
    fn reduce_in_order_and_per_dtype() {
        let a = TensorData::new(vec![1.0f32, -2.0, f32::NAN], [3]);
        let b = TensorData::new(vec![3.0f32, 5.0, 0.0], [3]);
        let sum = reduced(&[&a, &b], ReduceOp::Sum).to_vec::<f32>().unwrap();
        assert_eq!(&sum[..2], &[4.0, 3.0]);
        assert!(sum[2].is_nan());
        let max = reduced(&[&a, &b], ReduceOp::Max).to_vec::<f32>().unwrap();
        assert_eq!(&max[..2], &[3.0, 5.0]);
        assert!(max[2].is_nan(), "max propagates NaN");

        let a = TensorData::new(vec![7i64, -7], [2]);
        let b = TensorData::new(vec![0i64, 0], [2]);
        let avg = reduced(&[&a, &b], ReduceOp::Avg);
        assert_eq!(avg.to_vec::<i64>().unwrap(), vec![3, -3]);

        // bf16 accumulates in f32: 256 + 1 + 1 is 258 in f32, but 256 in bf16 step by step.
        let parts: Vec<TensorData> = [256.0f32, 1.0, 1.0]
            .iter()
            .map(|&x| TensorData::new(vec![bf16::from_f32(x)], [1]))
            .collect();
        let refs: Vec<&TensorData> = parts.iter().collect();
        let sum = reduced(&refs, ReduceOp::Sum);
        assert_eq!(sum.dtype, DType::BF16);
        assert_eq!(sum.to_vec::<bf16>().unwrap(), vec![bf16::from_f32(258.0)]);

        assert!(check_reducible(DType::U8).is_err());
        assert!(check_reducible(DType::I32).is_ok());
    }

    #[test]
    fn concat_and_chunk_are_inverse() {
        let data = TensorData::new((0..24u8).collect::<Vec<_>>(), [2, 6, 2]);
        let pieces = chunks(&data, 1, 3);
        assert_eq!(pieces[1].shape.as_slice(), &[2, 2, 2]);
        assert_eq!(
            pieces[1].to_vec::<u8>().unwrap(),
            vec![4, 5, 6, 7, 16, 17, 18, 19]
        );
        let refs: Vec<&TensorData> = pieces.iter().collect();
        assert_eq!(concat(&refs, 1).unwrap(), data);
        // The same from the pieces received back to back (rows interleaved along dim 1; along
        // dim 0 the received bytes are the result as they are).
        for dim in [1, 0] {
            let pieces = chunks(&data, dim, 2);
            let all: Vec<u8> = pieces.iter().flat_map(|p| p.as_bytes().to_vec()).collect();
            let shapes: Vec<Vec<usize>> = pieces.iter().map(|p| p.shape.to_vec()).collect();
            assert_eq!(
                gathered(all, &shapes, dim, DType::U8).unwrap(),
                data,
                "dim {dim}"
            );
        }
    }
}
