//! Attention on Flex: attention on packed q/k/v projections ([`attention_qkv`]) and on separate
//! q, k, v with grouped key/value heads ([`attention`]), forward and backward, one (batch, head)
//! pair per task through the same two head functions; and the causal softmax the attention core
//! uses otherwise ([`causal_softmax`]).
//!
//! The causal softmax: Burn ops cost a mask tensor, a broadcast `mask_fill` over the whole
//! score matrix and a softmax over every key, masked or not, about 7 ms per `[4, 4, 256, 256]`
//! on two cores. One pass per row over the valid keys only, rows in parallel, does the same.
//!
//! Numerics: the maximum and the sum run over the valid keys in order (one row function,
//! `softmax_row`, serves this and the packed attention); masked keys get exactly 0 (as
//! `exp(−1e9 − max)` underflows to in the Burn-op form). Results agree with the Burn-op form
//! to rounding, not bitwise (the sum order differs); every path of a run uses this function, so
//! recomputation stays bitwise equal to keeping the probabilities.

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};
use rayon::prelude::*;

/// Rows handed to one task.
const ROWS_PER_TASK: usize = 32;

/// [`FusedOps::fused_causal_softmax`](crate::FusedOps::fused_causal_softmax) on Flex: native
/// for contiguous f32 `[b, h, t, s]`, the Burn-op form otherwise.
pub fn causal_softmax(scores: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let shape = scores.shape();
    if scores.dtype() != DType::F32 || shape.num_dims() != 4 {
        return crate::reference::causal_softmax::<Flex>(scores);
    }
    let scores: FlexTensor = scores.to_contiguous();
    let Some(input) = scores.as_slice::<f32>() else {
        return crate::reference::causal_softmax::<Flex>(scores);
    };
    let (t, s) = (shape[2], shape[3]);
    if s == 0 {
        return scores;
    }
    let mut output = vec![0f32; input.len()];
    output
        .par_chunks_mut(ROWS_PER_TASK * s)
        .zip(input.par_chunks(ROWS_PER_TASK * s))
        .enumerate()
        .for_each(|(task, (out, inp))| {
            for (r, (o, x)) in out.chunks_mut(s).zip(inp.chunks(s)).enumerate() {
                let query = (task * ROWS_PER_TASK + r) % t;
                // Keys 0 ..= query + (s − t) are visible.
                let valid = (query + s).saturating_sub(t - 1).min(s);
                causal_row(x, o, valid);
            }
        });
    super::float(output, shape)
}

/// Softmax of `x[..valid]` into `o[..valid]`; `o[valid..]` is 0. A row with no visible key is
/// uniform (every entry masked alike).
fn causal_row(x: &[f32], o: &mut [f32], valid: usize) {
    if valid == 0 {
        o.fill(1.0 / x.len() as f32);
        return;
    }
    o.copy_from_slice(x);
    softmax_row(o, valid);
}

/// A raw pointer that rayon tasks share to write disjoint parts of one buffer (or to read one
/// that none of them writes).
#[derive(Clone, Copy)]
pub(crate) struct Shared(pub(crate) *mut f32);
// SAFETY: every task writes a region no other task touches (here one (batch, head) pair each;
// `gemm::flex`'s split products a range of columns each) or only reads.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer (a method, so closures capture the `Send` wrapper, not its field).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// A strided matrix operand of [`matmul`]: pointer, column stride, row stride.
pub(crate) type Operand = (*const f32, isize, isize);

/// `dst[m×n] (row stride dst_rs) = alpha·lhs·rhs` (or, with `add`, `+=`), single-threaded (the
/// tasks are the parallelism).
///
/// # Safety
/// Every operand must be valid for its `m × k`, `k × n` and `m × n` strided extent.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul(
    [m, n, k]: [usize; 3],
    dst: *mut f32,
    dst_rs: isize,
    lhs: Operand,
    rhs: Operand,
    alpha: f32,
    add: bool,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs,
            add,
            lhs.0,
            lhs.1,
            lhs.2,
            rhs.0,
            rhs.1,
            rhs.2,
            if add { 1.0 } else { 0.0 },
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Rows `start..start + m` of `dst` (row stride `t`) = `alpha·A·Bᵀ` over their first `n`
/// columns, for `m` rows of `hd` in `a` from row `start` and `n` rows in `b` (`a.1` and `b.1`
/// apart): those rows of A dotted with the first rows of B (the scores `Q·Kᵀ`, the score
/// gradients `dO·Vᵀ`, one block of rows).
///
/// # Safety
/// `a.0` must be valid for `start + m` rows and `b.0` for `n` rows of `hd` elements at their row
/// strides; `dst` holds `t` columns per row, `n ≤ t`.
unsafe fn row_dots(
    dst: &mut [f32],
    a: (&[f32], isize),
    b: (&[f32], isize),
    [start, m, n, hd, t]: [usize; 5],
    alpha: f32,
) {
    debug_assert!(n <= t && dst.len() >= (start + m) * t);
    // SAFETY: `dst` holds the rows; `a` and `b` as the caller guarantees.
    unsafe {
        matmul(
            [m, n, hd],
            dst.as_mut_ptr().add(start * t),
            t as isize,
            (a.0.as_ptr().add(start * a.1 as usize), 1, a.1),
            (b.0.as_ptr(), b.1, 1),
            alpha,
            false,
        );
    }
}

super::math::dispatch! {
    /// Softmax of `row[..valid]` in place (`row[valid..]` set to 0); returns the log-sum-exp.
    fn softmax_row(row: &mut [f32], valid: usize) -> f32 {
        let (seen, masked) = row.split_at_mut(valid);
        let max = super::math::lane_max(seen);
        // The sum in lanes, so the exponentials vectorise (a single running sum keeps them
        // scalar: its additions cannot be reordered).
        let mut acc = [0f32; super::math::LANES];
        let mut chunks = seen.chunks_exact_mut(super::math::LANES);
        for c in &mut chunks {
            for (a, p) in acc.iter_mut().zip(c.iter_mut()) {
                *p = super::math::exp(*p - max);
                *a += *p;
            }
        }
        for (a, p) in acc.iter_mut().zip(chunks.into_remainder()) {
            *p = super::math::exp(*p - max);
            *a += *p;
        }
        let sum = super::math::combine(acc);
        let inv = 1.0 / sum;
        for p in seen.iter_mut() {
            *p *= inv;
        }
        masked.fill(0.0);
        max + sum.ln()
    }
}

super::math::dispatch! {
    /// The probabilities `p = exp(s − lse)` from the scores in `p`, and the score gradients
    /// `dp ← p·(dp − delta)` on the visible keys; 0 on the masked ones.
    fn probabilities_and_score_grads(p: &mut [f32], dp: &mut [f32], valid: usize, lse: f32, delta: f32) {
        for (p, dp) in p[..valid].iter_mut().zip(&mut dp[..valid]) {
            *p = super::math::exp(*p - lse);
            *dp = *p * (*dp - delta);
        }
        p[valid..].fill(0.0);
        dp[valid..].fill(0.0);
    }
}

/// The shape `[b, t, h, hd]` of packed projections `[b, t, h, 3·hd]`.
fn packed_dims(qkv: &FlexTensor) -> Option<[usize; 4]> {
    let shape = qkv.shape();
    if shape.num_dims() != 4 || !shape[3].is_multiple_of(3) || shape[3] == 0 {
        return None;
    }
    Some([shape[0], shape[1], shape[2], shape[3] / 3])
}

/// Keys visible to query `i` of `t`.
fn visible(i: usize, t: usize, causal: bool) -> usize {
    if causal { i + 1 } else { t }
}

/// Rows per block of the causal GEMMs.
const CAUSAL_BLOCK: usize = 64;

/// The blocks of `t` rows the GEMMs take, `(start, end, keys)`: rows `start..end` attend to keys
/// `..keys`. Causal: blocks of [`CAUSAL_BLOCK`] seeing the keys up to their last row, so the
/// blocks above the diagonal are never computed (about half of the score GEMMs at long `t`);
/// otherwise one block of every row and key.
fn row_blocks(t: usize, causal: bool) -> impl Iterator<Item = (usize, usize, usize)> {
    let block = if causal { CAUSAL_BLOCK } else { t.max(1) };
    (0..t).step_by(block).map(move |start| {
        let end = (start + block).min(t);
        (start, end, if causal { end } else { t })
    })
}

/// One head's rows: a slice starting at its first row and the distance between rows.
type Rows<'a> = (&'a [f32], isize);

/// Where one head's outputs go: its first row (or element) and the distance between rows.
type Out = (Shared, isize);

/// One (batch, head) pair of the forward: `S = scale·Q·Kᵀ` and `O = P·V` as GEMMs reading `q`,
/// `k` and `v` where they lie, the softmax in between, the output rows and log-sum-exps written
/// at `out` and `lse`; causal, by blocks of rows that skip the keys above the diagonal.
///
/// # Safety
/// `q`, `k`, `v` must hold `t` rows of `hd` at their strides; `out` and `lse` must be valid for
/// `t` rows (elements) at theirs, written by this call alone.
unsafe fn head_forward(
    [q, k, v]: [Rows; 3],
    out: Out,
    lse: Out,
    [t, hd]: [usize; 2],
    scale: f32,
    causal: bool,
) {
    let mut s = vec![0f32; t * t];
    for (start, end, keys) in row_blocks(t, causal) {
        let m = end - start;
        // SAFETY: as the caller guarantees; `s` is t × t.
        unsafe {
            // S[start..end, ..keys] = scale·Q·Kᵀ.
            row_dots(&mut s, q, k, [start, m, keys, hd, t], scale);
            for i in start..end {
                let l = softmax_row(&mut s[i * t..i * t + keys], visible(i, t, causal));
                *lse.0.get().offset(i as isize * lse.1) = l;
            }
            // O[start..end] = P[start..end, ..keys]·V[..keys].
            matmul(
                [m, hd, keys],
                out.0.get().offset(start as isize * out.1),
                out.1,
                (s.as_ptr().add(start * t), 1, t as isize),
                (v.0.as_ptr(), 1, v.1),
                1.0,
                false,
            );
        }
    }
}

/// One (batch, head) pair of the backward: the probabilities again from the log-sum-exp, then
/// `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP − rowsum(dO∘O))`, `dQ = scale·dS·K`,
/// `dK = scale·dSᵀ·Q`, each written at its place — `dK` and `dV` added to what is there with
/// `add` (query heads sharing a key/value head).
///
/// # Safety
/// As `head_forward`: every operand holds `t` rows at its stride, `lse` `t` elements; the
/// gradients' rows are written by this call alone.
#[allow(clippy::too_many_arguments)]
unsafe fn head_backward(
    [q, k, v]: [Rows; 3],
    [o, d_o]: [Rows; 2],
    lse: Rows,
    [dq, dk, dv]: [Out; 3],
    [t, hd]: [usize; 2],
    scale: f32,
    causal: bool,
    add: bool,
) {
    let mut p = vec![0f32; t * t];
    let mut dp = vec![0f32; t * t];
    let orow = o.1 as usize;
    for (start, end, keys) in row_blocks(t, causal) {
        let m = end - start;
        // P and dP on rows start..end, keys ..keys (the blocks above the diagonal stay 0).
        // SAFETY: as the caller guarantees; `p` and `dp` are t × t.
        unsafe {
            let dims = [start, m, keys, hd, t];
            row_dots(&mut p, q, k, dims, scale);
            row_dots(&mut dp, d_o, v, dims, 1.0);
        }
        for i in start..end {
            let valid = visible(i, t, causal);
            let lse_i = lse.0[i * lse.1 as usize];
            let r = i * orow;
            let delta: f32 = (0..hd).map(|c| d_o.0[r + c] * o.0[r + c]).sum();
            let (p, dp) = (&mut p[i * t..i * t + keys], &mut dp[i * t..i * t + keys]);
            probabilities_and_score_grads(p, dp, valid, lse_i, delta);
        }
        // dQ[start..end] = scale·dS[start..end, ..keys]·K[..keys].
        // SAFETY: the rows of dQ are this call's alone.
        unsafe {
            matmul(
                [m, hd, keys],
                dq.0.get().offset(start as isize * dq.1),
                dq.1,
                (dp.as_ptr().add(start * t), 1, t as isize),
                (k.0.as_ptr(), 1, k.1),
                scale,
                false,
            );
        }
    }
    // dV and dK by blocks of keys: keys start..end are seen by the queries from `start` on
    // (causal) or by all.
    for (start, end, _) in row_blocks(t, causal) {
        let m = end - start;
        let first = if causal { start } else { 0 };
        let n = t - first;
        // SAFETY: the rows of dK and dV are this call's alone; `p` and `dp` are t × t.
        unsafe {
            // dV = Pᵀ·dO
            matmul(
                [m, hd, n],
                dv.0.get().offset(start as isize * dv.1),
                dv.1,
                (p.as_ptr().add(first * t + start), t as isize, 1),
                (d_o.0.as_ptr().add(first * orow), 1, d_o.1),
                1.0,
                add,
            );
            // dK = scale·dSᵀ·Q
            matmul(
                [m, hd, n],
                dk.0.get().offset(start as isize * dk.1),
                dk.1,
                (dp.as_ptr().add(first * t + start), t as isize, 1),
                (q.0.as_ptr().add(first * q.1 as usize), 1, q.1),
                scale,
                add,
            );
        }
    }
}

/// [`FusedOps::fused_attention_qkv`](crate::FusedOps::fused_attention_qkv) on Flex: per (batch,
/// head) pair `head_forward`, reading q, k and v where they lie in the packed buffer and
/// writing the output in `[b, t, h, hd]` order (no layout copies). `None` for other dtypes or
/// shapes.
pub fn attention_qkv(
    qkv: &FlexTensor,
    scale: f64,
    causal: bool,
) -> Option<crate::AttentionOutput<Flex>> {
    let [b, t, h, hd] = packed_dims(qkv)?;
    let qkv = super::contiguous(qkv)?;
    let x = qkv.f32s();
    let rs = (h * 3 * hd) as isize;
    // One (batch, head) pair's output rows and log-sum-exps, at `out` and `lse`.
    let head = |task: usize, out: Shared, lse: Shared| {
        let (bi, hi) = (task / h, task % h);
        let base = bi * t * h * 3 * hd + hi * 3 * hd;
        let qkv = [0, hd, 2 * hd].map(|at| (&x[base + at..], rs));
        // SAFETY: the head's rows are `rs` apart inside `x`; its output rows (`h·hd` apart) and
        // log-sum-exps (`h` apart) are this task's alone.
        unsafe {
            let out = (
                Shared(out.get().add(bi * t * h * hd + hi * hd)),
                (h * hd) as isize,
            );
            let lse = (Shared(lse.get().add(bi * t * h + hi)), h as isize);
            head_forward(qkv, out, lse, [t, hd], scale as f32, causal);
        }
    };
    let mut lse = Vec::new();
    let fill = |out: &mut [f32]| {
        let o_ptr = Shared(out.as_mut_ptr());
        let fill_lse = |lse: &mut [f32]| {
            let l_ptr = Shared(lse.as_mut_ptr());
            (0..b * h)
                .into_par_iter()
                .for_each(|task| head(task, o_ptr, l_ptr));
        };
        // SAFETY: as for `out` below.
        lse = unsafe { super::written(b * t * h, fill_lse) };
    };
    // SAFETY: the (batch, head) tasks cover every output row and log-sum-exp, and
    // `head_forward` assigns each (its product is written with `add` false) without reading it.
    let out = unsafe { super::written(b * t * h * hd, fill) };
    Some(crate::AttentionOutput {
        output: super::float(out, Shape::new([b, t, h, hd])),
        lse: super::float(lse, Shape::new([b, t, h])),
    })
}

/// [`FusedOps::fused_attention_qkv_backward`](crate::FusedOps::fused_attention_qkv_backward) on
/// Flex: per (batch, head) pair `head_backward`, each gradient written straight into its place
/// in the packed gradient.
pub fn attention_qkv_backward(
    qkv: &FlexTensor,
    output: &FlexTensor,
    lse: &FlexTensor,
    d_output: &FlexTensor,
    scale: f64,
    causal: bool,
) -> Option<FlexTensor> {
    let [b, t, h, hd] = packed_dims(qkv)?;
    let (qkv, output) = (super::contiguous(qkv)?, super::contiguous(output)?);
    let (lse, d_output) = (super::contiguous(lse)?, super::contiguous(d_output)?);
    let (x, o, l, d_o) = (qkv.f32s(), output.f32s(), lse.f32s(), d_output.f32s());
    if o.len() != b * t * h * hd || d_o.len() != o.len() || l.len() != b * t * h {
        return None;
    }
    let (rs, ors) = ((h * 3 * hd) as isize, (h * hd) as isize);
    let fill = |grad: &mut [f32]| {
        let g_ptr = Shared(grad.as_mut_ptr());
        (0..b * h).into_par_iter().for_each(|task| {
            let (bi, hi) = (task / h, task % h);
            let base = bi * t * h * 3 * hd + hi * 3 * hd;
            let obase = bi * t * h * hd + hi * hd;
            let qkv = [0, hd, 2 * hd].map(|at| (&x[base + at..], rs));
            let out = [(&o[obase..], ors), (&d_o[obase..], ors)];
            let lse = (&l[bi * t * h + hi..], h as isize);
            // SAFETY: the q, k and v column blocks of (bi, hi) in the packed gradient are this
            // task's alone.
            unsafe {
                let grads = [0, hd, 2 * hd].map(|at| (Shared(g_ptr.get().add(base + at)), rs));
                head_backward(qkv, out, lse, grads, [t, hd], scale as f32, causal, false);
            }
        })
    };
    // SAFETY: the (batch, head) tasks cover the packed gradient's q, k and v blocks of every
    // row, and `head_backward` with `add` false assigns each (products written, not added)
    // without reading it.
    let grad = unsafe { super::written(x.len(), fill) };
    Some(super::float(grad, qkv.0.shape()))
}

/// `[b, h, t, hd, kv]` and the contiguous q, k, v of [`heads`].
type Heads = ([usize; 5], [super::F32; 3]);

/// Separate queries `[b, h, t, hd]` and keys and values `[b, kv, t, hd]` of the same length
/// (`h` a multiple of `kv`), contiguous f32, with `[b, h, t, hd, kv]`; `None` otherwise.
fn heads(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor) -> Option<Heads> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.num_dims() != 4 || ks.as_slice() != vs.as_slice() || ks.num_dims() != 4 {
        return None;
    }
    let [b, h, t, hd] = [qs[0], qs[1], qs[2], qs[3]];
    let kv = ks[1];
    let fits = ks[0] == b && ks[2] == t && ks[3] == hd && kv > 0 && h.is_multiple_of(kv);
    let operands = [q, k, v].map(super::contiguous);
    let [Some(q), Some(k), Some(v)] = operands else {
        return None;
    };
    fits.then_some(([b, h, t, hd, kv], [q, k, v]))
}

/// [`FusedOps::fused_attention`](crate::FusedOps::fused_attention) on Flex: queries `[b, h, t,
/// hd]`, keys and values `[b, kv, t, hd]` (grouped-query attention: query head `j` reads key/value
/// head `j / (h / kv)`, in place, never repeated); per (batch, head) pair `head_forward`.
/// `None` for other dtypes or shapes (keys of another length than the queries).
pub fn attention(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    scale: f64,
    causal: bool,
) -> Option<crate::AttentionOutput<Flex>> {
    let ([b, h, t, hd, kv], [q, k, v]) = heads(q, k, v)?;
    let (qs, ks, vs) = (q.f32s(), k.f32s(), v.f32s());
    let mut out = vec![0f32; b * h * t * hd];
    let mut lse = vec![0f32; b * h * t];
    let (o_ptr, l_ptr) = (Shared(out.as_mut_ptr()), Shared(lse.as_mut_ptr()));
    let row = hd as isize;
    (0..b * h).into_par_iter().for_each(|task| {
        let (bi, hi) = (task / h, task % h);
        let kvi = (bi * kv + hi / (h / kv)) * t * hd;
        let io = [
            (&qs[task * t * hd..], row),
            (&ks[kvi..], row),
            (&vs[kvi..], row),
        ];
        // SAFETY: each operand holds the head's `t` rows of `hd`; its output rows and
        // log-sum-exps are this task's alone.
        unsafe {
            let out = (Shared(o_ptr.get().add(task * t * hd)), row);
            let lse = (Shared(l_ptr.get().add(task * t)), 1);
            head_forward(io, out, lse, [t, hd], scale as f32, causal);
        }
    });
    Some(crate::AttentionOutput {
        output: super::float(out, Shape::new([b, h, t, hd])),
        lse: super::float(lse, Shape::new([b, h, t])),
    })
}

/// [`FusedOps::fused_attention_backward`](crate::FusedOps::fused_attention_backward) on Flex:
/// per (batch, key/value head) the `head_backward` of each query head it serves, in order, the
/// key and value gradients summed over them.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    output: &FlexTensor,
    lse: &FlexTensor,
    d_output: &FlexTensor,
    scale: f64,
    causal: bool,
) -> Option<crate::AttentionGrads<Flex>> {
    let ([b, h, t, hd, kv], [q, k, v]) = heads(q, k, v)?;
    let (output, lse) = (super::contiguous(output)?, super::contiguous(lse)?);
    let d_output = super::contiguous(d_output)?;
    let (qs, ks, vs) = (q.f32s(), k.f32s(), v.f32s());
    let (o, l, d_o) = (output.f32s(), lse.f32s(), d_output.f32s());
    if o.len() != qs.len() || d_o.len() != qs.len() || l.len() != b * h * t {
        return None;
    }
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; qs.len()],
        vec![0f32; ks.len()],
        vec![0f32; vs.len()],
    );
    let ptrs = [&mut dq, &mut dk, &mut dv].map(|g| Shared(g.as_mut_ptr()));
    let (row, group) = (hd as isize, h / kv);
    (0..b * kv).into_par_iter().for_each(|task| {
        let kvi = task * t * hd;
        for hi in (task % kv) * group..(task % kv + 1) * group {
            let head = (task / kv) * h + hi;
            let qi = head * t * hd;
            let io = [(&qs[qi..], row), (&ks[kvi..], row), (&vs[kvi..], row)];
            let out = [(&o[qi..], row), (&d_o[qi..], row)];
            let lse = (&l[head * t..], 1);
            // SAFETY: the query head's dQ rows and this key/value head's dK and dV rows are
            // this task's alone (every query head of the group runs in this task, in order).
            unsafe {
                let at = [qi, kvi, kvi];
                let grads = [0, 1, 2].map(|i| (Shared(ptrs[i].get().add(at[i])), row));
                let add = hi % group != 0;
                head_backward(io, out, lse, grads, [t, hd], scale as f32, causal, add);
            }
        }
    });
    Some(crate::AttentionGrads {
        q: super::float(dq, q.0.shape()),
        k: super::float(dk, k.0.shape()),
        v: super::float(dv, v.0.shape()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Tensor, TensorData};

    /// Against the Burn-op form: square and shifted (`t < s`) masks, every probability within
    /// rounding, masked ones exactly 0.
    #[test]
    fn native_causal_softmax_matches_the_burn_op_form() {
        let device = Default::default();
        for [b, h, t, s] in [[2, 3, 70, 70], [1, 2, 5, 9], [1, 1, 1, 4]] {
            let n = b * h * t * s;
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1000) as f32 / 50.0 - 10.0)
                .collect();
            let x = Tensor::<Flex, 4>::from_data(TensorData::new(values, [b, h, t, s]), &device);
            let prim = |x: Tensor<Flex, 4>| x.into_primitive().tensor();
            let native = causal_softmax(prim(x.clone()));
            let reference = crate::reference::causal_softmax::<Flex>(prim(x));
            let native = native.into_data().to_vec::<f32>().unwrap();
            let reference = reference.into_data().to_vec::<f32>().unwrap();
            for (i, (a, r)) in native.iter().zip(&reference).enumerate() {
                assert!(
                    (a - r).abs() <= 1e-6,
                    "{:?} at {i}: {a} vs {r}",
                    [b, h, t, s]
                );
                if *r == 0.0 {
                    assert_eq!(*a, 0.0, "masked entry {i}");
                }
            }
        }
    }
}
