//! Block-wise 8-bit quantisation ([`crate::quant`]) as host loops: one pass per op over the
//! piece, blocks in parallel, `u8` codes. The same arithmetic as the Burn-op form (each scale's
//! reciprocal in f32, the product clamped to ±1, the count of midpoints below it), so the two
//! give the same codes.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, Shape, TensorData};
use rayon::prelude::*;

use super::{contiguous, float};
use crate::quant::Blocks;

/// Elements per parallel task (each element finds its block by its index).
const CHUNK: usize = 1 << 16;

/// `f(block, range)` for each run of the piece's elements `from .. from + len` that lies in
/// one block (one division per run, not per element).
fn per_block(
    start: usize,
    from: usize,
    len: usize,
    block: usize,
    mut f: impl FnMut(usize, std::ops::Range<usize>),
) {
    let mut i = 0;
    while i < len {
        let b = (start + from + i) / block;
        let end = ((b + 1) * block - start - from).min(len);
        f(b, i..end);
        i = end;
    }
}

/// [`crate::quant::absmax`] on host slices; `None` for a non-f32 input.
pub fn absmax(x: &FlexTensor, start: usize, block: usize, total: usize) -> Option<FlexTensor> {
    let x = contiguous(x)?;
    let x = x.f32s();
    let b = Blocks::of(start, x.len(), block);
    let own = b.own(total);
    let mut out = vec![0.0f32; total];
    // The piece's elements of each of its blocks the tensor has.
    out[own.clone()]
        .par_iter_mut()
        .enumerate()
        .for_each(|(k, m)| {
            let global = (own.start + k) * block;
            let lo = global.saturating_sub(start).min(x.len());
            let hi = (global + block).saturating_sub(start).min(x.len());
            *m = x[lo..hi].iter().fold(0.0f32, |acc, v| acc.max(v.abs()));
        });
    Some(float(out, Shape::new([total])))
}

/// [`crate::quant::quantise`] on host slices, `u8` codes; `None` for non-f32 inputs.
pub fn quantise(
    x: &FlexTensor,
    absmax: &FlexTensor,
    mids: &FlexTensor,
    start: usize,
    block: usize,
) -> Option<FlexTensor> {
    let (x, absmax, mids) = (contiguous(x)?, contiguous(absmax)?, contiguous(mids)?);
    let (x, absmax, mids) = (x.f32s(), absmax.f32s(), mids.f32s());
    if mids.len() != 255 {
        return None;
    }
    let recip: Vec<f32> = absmax.iter().map(|a| 1.0 / a.max(1e-38)).collect();
    let mut codes = vec![0u8; x.len()];
    codes
        .par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(c, (codes, x))| {
            per_block(start, c * CHUNK, x.len(), block, |b, run| {
                let r = recip.get(b).copied().unwrap_or(0.0);
                for (code, &v) in codes[run.clone()].iter_mut().zip(&x[run]) {
                    let scaled = (v * r).clamp(-1.0, 1.0);
                    // Branchless: a branch per level would be mispredicted half the time.
                    let mut at = 0usize;
                    for step in [128, 64, 32, 16, 8, 4, 2, 1] {
                        at += step * usize::from(scaled > mids[at + step - 1]);
                    }
                    *code = at as u8;
                }
            });
        });
    let n = codes.len();
    Some(FlexTensor::from_data(TensorData::new(codes, [n])))
}

/// [`crate::quant::dequantise`] on host slices; `None` unless the codes are `u8` and the rest
/// f32.
pub fn dequantise(
    codes: &FlexTensor,
    absmax: &FlexTensor,
    map: &FlexTensor,
    start: usize,
    block: usize,
) -> Option<FlexTensor> {
    if codes.dtype() != DType::U8 {
        return None;
    }
    let codes = codes.to_contiguous();
    let codes = codes.as_slice::<u8>()?;
    let (absmax, map) = (contiguous(absmax)?, contiguous(map)?);
    let (absmax, map) = (absmax.f32s(), map.f32s());
    if map.len() != 256 {
        return None;
    }
    let mut out = vec![0.0f32; codes.len()];
    out.par_chunks_mut(CHUNK)
        .zip(codes.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(c, (out, codes))| {
            per_block(start, c * CHUNK, codes.len(), block, |b, run| {
                let scale = absmax.get(b).copied().unwrap_or(0.0);
                for (o, &code) in out[run.clone()].iter_mut().zip(&codes[run]) {
                    *o = map[code as usize] * scale;
                }
            });
        });
    let n = out.len();
    Some(float(out, Shape::new([n])))
}
