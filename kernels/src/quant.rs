//! Block-wise 8-bit quantisation of an optimizer's state (bitsandbytes' `quantize_blockwise`,
//! Dettmers et al. 2022) as Burn ops: the defaults of [`FusedOps::blockwise_absmax`],
//! [`FusedOps::blockwise_quantise`] and [`FusedOps::blockwise_dequantise`].
//!
//! A piece is `len` consecutive elements of a tensor's row-major flattening starting at flat
//! index `start`; block `b` is elements `block·b ..` of the whole tensor, so a piece's first and
//! last blocks may be shared with its neighbours. Blocks past the tensor's `total` (a padded
//! piece's zeros) read a scale of 0.
//!
//! [`FusedOps::blockwise_absmax`]: crate::FusedOps::blockwise_absmax
//! [`FusedOps::blockwise_quantise`]: crate::FusedOps::blockwise_quantise
//! [`FusedOps::blockwise_dequantise`]: crate::FusedOps::blockwise_dequantise

use burn::prelude::*;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{IntDType, TensorPrimitive};

/// Where a piece lies among the blocks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Blocks {
    /// The piece's offset in its first block.
    pub lead: usize,
    /// Its first block.
    pub first: usize,
    /// The blocks it overlaps (padding's included).
    pub count: usize,
}

impl Blocks {
    pub(crate) fn of(start: usize, len: usize, block: usize) -> Self {
        let lead = start % block;
        Self {
            lead,
            first: start / block,
            count: (lead + len).div_ceil(block),
        }
    }

    /// The piece's blocks that are the tensor's (of `total`).
    pub(crate) fn own(&self, total: usize) -> std::ops::Range<usize> {
        self.first.min(total)..(self.first + self.count).min(total)
    }
}

fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// `n` zeros, or nothing.
fn zeros<B: Backend>(n: usize, device: &B::Device) -> Option<Tensor<B, 1>> {
    (n > 0).then(|| Tensor::zeros([n], device))
}

/// The present parts, concatenated.
fn cat<B: Backend>(parts: Vec<Option<Tensor<B, 1>>>) -> Tensor<B, 1> {
    Tensor::cat(parts.into_iter().flatten().collect(), 0)
}

/// Each of the piece's `len` elements' value of `per_block` (`[total]`).
fn per_element<B: Backend>(
    per_block: Tensor<B, 1>,
    start: usize,
    len: usize,
    block: usize,
) -> Tensor<B, 1> {
    let device = per_block.device();
    let total = per_block.dims()[0];
    let b = Blocks::of(start, len, block);
    let own = b.own(total);
    let beyond = b.count - own.len();
    let own = (!own.is_empty()).then(|| per_block.slice(own));
    cat(vec![own, zeros(beyond, &device)])
        .reshape([b.count, 1])
        .expand([b.count, block])
        .reshape([b.count * block])
        .slice(b.lead..b.lead + len)
}

/// The largest magnitude of each block the flat piece `x` overlaps, placed in a `[total]`
/// vector (zeros for the other blocks).
pub fn absmax<B: Backend>(
    x: FloatTensor<B>,
    start: usize,
    block: usize,
    total: usize,
) -> FloatTensor<B> {
    let x = float::<B, 1>(x);
    let device = x.device();
    let len = x.dims()[0];
    let b = Blocks::of(start, len, block);
    let tail = b.count * block - b.lead - len;
    let local = cat(vec![
        zeros(b.lead, &device),
        Some(x.abs()),
        zeros(tail, &device),
    ])
    .reshape([b.count, block])
    .max_dim(1)
    .reshape([b.count]);
    let own = b.own(total);
    let mine = (!own.is_empty()).then(|| local.slice(0..own.len()));
    prim(cat(vec![
        zeros(own.start, &device),
        mine,
        zeros(total - own.end, &device),
    ]))
}

/// The codes of the flat piece `x` against the block scales `absmax` (`[total]`): each value
/// times its block's `1 / max(absmax, 1e-38)`, clamped to ±1, and the number of `mids` (the
/// sorted map's 255 midpoints) below it — `torch.bucketize`, by a branchless binary search.
pub fn quantise<B: Backend>(
    x: FloatTensor<B>,
    absmax: FloatTensor<B>,
    mids: FloatTensor<B>,
    start: usize,
    block: usize,
    dtype: IntDType,
) -> IntTensor<B> {
    let x = float::<B, 1>(x);
    let len = x.dims()[0];
    let recip = float::<B, 1>(absmax).clamp_min(1e-38).recip();
    let scaled = (x * per_element(recip, start, len, block)).clamp(-1.0, 1.0);
    let mids = float::<B, 1>(mids);
    let mut at = Tensor::<B, 1, Int>::zeros([len], &scaled.device());
    for step in [128, 64, 32, 16, 8, 4, 2, 1] {
        let probe = mids.clone().select(0, at.clone().add_scalar(step - 1));
        at = at + scaled.clone().greater(probe).int().mul_scalar(step);
    }
    at.cast(dtype).into_primitive()
}

/// `map[code] · absmax[block]` of each code of a flat piece.
pub fn dequantise<B: Backend>(
    codes: IntTensor<B>,
    absmax: FloatTensor<B>,
    map: FloatTensor<B>,
    start: usize,
    block: usize,
) -> FloatTensor<B> {
    let codes = Tensor::<B, 1, Int>::from_primitive(codes).cast(IntDType::I32);
    let len = codes.dims()[0];
    let values = float::<B, 1>(map).select(0, codes);
    prim(values * per_element(float(absmax), start, len, block))
}

/// `kept` where the `[1]` flag `skip` is non-zero, else `new`, element by element.
pub fn unless_skipped<B: Backend>(
    new: IntTensor<B>,
    kept: IntTensor<B>,
    skip: FloatTensor<B>,
) -> IntTensor<B> {
    let new = Tensor::<B, 1, Int>::from_primitive(new);
    let n = new.dims()[0];
    let mask = float::<B, 1>(skip).expand([n]).not_equal_elem(0.0);
    new.mask_where(mask, Tensor::from_primitive(kept))
        .into_primitive()
}
