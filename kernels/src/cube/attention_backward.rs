//! Flash attention backward, FlashAttention-2 style, in two tiled passes that need no atomics
//! (deterministic, and Wgpu has no float atomics):
//!
//! 1. **dQ** — one cube per `bq` queries: `delta = rowsum(dO∘O)` for its rows (written for pass
//!    2), then over the key blocks up to the diagonal: `S = Q·Kᵀ` and `dP = dO·Vᵀ`, then
//!    `P = exp(S·scale − lse)` and `dS = P∘(dP − delta)` in f32 (rounded once), `dQ += dS·K`.
//! 2. **dK, dV** — one cube per `bk` keys, over the query blocks from the diagonal on:
//!    `Sᵀ = K·Qᵀ`, `Pᵀ`, `dV += Pᵀ·dO`, `dPᵀ = V·dOᵀ`, `dSᵀ = Pᵀ∘(dPᵀ − delta)`, `dK += dSᵀ·Q`.
//!
//! No `t × t` buffer exists; the probabilities are recomputed from the forward's log-sum-exp. The
//! tile products are [`tile_mm`]'s (tensor cores for f16/bf16 where available). Shared memory per
//! cube: dQ `E·(2·bq·d + 2·bk·d + bq·bk) + 4·(2·bq·bk + bq·d + 2·bq)`, dK/dV
//! `E·(2·bk·d + 2·bq·d + bk·bq) + 4·(bk·bq + 2·bk·d + 2·bq)` ([`Tiles::shared_bytes`]).

use super::attention::{
    Heads, Operands, Pass, Problem, Tiles, head_base, keys_end, launch_dims, load_rows, load_stats,
    packed_operands, problem, seq_arg, this_head, tile_mm, visible,
};
use super::{Cb, arg, contiguous, empty, empty_f32, launched};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

/// Pass 1: dQ and `delta`, one cube per `bq` queries.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_q_kernel<E: Float>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out: &Tensor<E>,
    d_out: &Tensor<E>,
    lse: &Tensor<f32>,
    dq: &mut Tensor<E>,
    delta: &mut Tensor<f32>,
    q_l: Sequence<u32>,
    k_l: Sequence<u32>,
    v_l: Sequence<u32>,
    o_l: Sequence<u32>,
    s_l: Sequence<u32>,
    dq_l: Sequence<u32>,
    heads: u32,
    kv_group: u32,
    seq_q: u32,
    seq_k: u32,
    q_offset: i32,
    scale: f32,
    #[comptime] bq: usize,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] causal: bool,
    #[comptime] cmma: bool,
    #[define(E)] _dtype: StorageType,
) {
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let (b, h, hk) = this_head(heads, kv_group);
    let q_start = CUBE_POS_X as usize * bq;
    let o_base = head_base(&o_l, b, h);
    let o_token = *o_l.index(3usize) as usize;
    let s_base = head_base(&s_l, b, h);
    let s_token = *s_l.index(3usize) as usize;
    let k_base = head_base(&k_l, b, hk);
    let v_base = head_base(&v_l, b, hk);

    let mut qs = SharedMemory::<E>::new(bq * d);
    let mut dos = SharedMemory::<E>::new(bq * d);
    let mut ks = SharedMemory::<E>::new(bk * d);
    let mut vs = SharedMemory::<E>::new(bk * d);
    let mut ss = SharedMemory::<f32>::new(bq * bk);
    let mut dps = SharedMemory::<f32>::new(bq * bk);
    let mut ps = SharedMemory::<E>::new(bq * bk);
    let mut dqs = SharedMemory::<f32>::new(bq * d);
    let mut lse_s = SharedMemory::<f32>::new(bq);
    let mut delta_s = SharedMemory::<f32>::new(bq);

    load_rows::<E>(
        q,
        head_base(&q_l, b, h),
        *q_l.index(3usize) as usize,
        q_start,
        seq_q,
        &mut qs,
        bq,
        d,
    );
    load_rows::<E>(d_out, o_base, o_token, q_start, seq_q, &mut dos, bq, d);
    load_stats(lse, s_base, s_token, q_start, seq_q, 0.0, &mut lse_s, bq);
    let mut e = UNIT_POS as usize;
    while e < bq * d {
        dqs[e] = 0.0;
        e += CUBE_DIM as usize;
    }
    // delta = rowsum(dO∘O), one unit per row, in f32 from the stored dO and O.
    let mut r = UNIT_POS as usize;
    while r < bq {
        let mut acc = 0.0f32;
        if q_start + r < seq_q {
            let row = o_base + (q_start + r) * o_token;
            for c in 0..d {
                acc += f32::cast_from(d_out[row + c]) * f32::cast_from(out[row + c]);
            }
            delta[s_base + (q_start + r) * s_token] = acc;
        }
        delta_s[r] = acc;
        r += CUBE_DIM as usize;
    }
    let blocks = keys_end(q_start, seq_k, q_offset, bq, causal).div_ceil(bk);
    sync_cube();

    for kb in 0..blocks {
        let k_start = kb * bk;
        load_rows::<E>(
            k,
            k_base,
            *k_l.index(3usize) as usize,
            k_start,
            seq_k,
            &mut ks,
            bk,
            d,
        );
        load_rows::<E>(
            v,
            v_base,
            *v_l.index(3usize) as usize,
            k_start,
            seq_k,
            &mut vs,
            bk,
            d,
        );
        sync_cube();
        // S = Q·Kᵀ and dP = dO·Vᵀ (independent: one phase; dP into `dps`)
        tile_mm::<E>(
            &qs, &ks, &mut ss, bq, bk, d, d, d, bk, false, true, false, false, cmma,
        );
        tile_mm::<E>(
            &dos, &vs, &mut dps, bq, bk, d, d, d, bk, false, true, false, false, cmma,
        );
        sync_cube();
        // P (f32, from the scores) and dS = P∘(dP − delta), rounded once into `ps`
        let mut e = UNIT_POS as usize;
        while e < bq * bk {
            let r = e / bk;
            let j = e % bk;
            let mut ds = 0.0f32;
            if visible(q_start + r, k_start + j, seq_q, seq_k, q_offset, causal) {
                let p = f32::exp(ss[e] * scale - lse_s[r]);
                ds = p * (dps[e] - delta_s[r]);
            }
            ps[e] = E::cast_from(ds);
            e += CUBE_DIM as usize;
        }
        sync_cube();
        // dQ += dS·K
        tile_mm::<E>(
            &ps, &ks, &mut dqs, bq, d, bk, bk, d, d, false, false, false, true, cmma,
        );
        sync_cube();
    }

    let dq_base = head_base(&dq_l, b, h);
    let dq_token = *dq_l.index(3usize) as usize;
    let mut e = UNIT_POS as usize;
    while e < bq * d {
        let r = e / d;
        if q_start + r < seq_q {
            dq[dq_base + (q_start + r) * dq_token + e % d] = E::cast_from(dqs[e] * scale);
        }
        e += CUBE_DIM as usize;
    }
}

/// Pass 2: dK and dV, one cube per `bk` keys of one (batch, query head); `dkv` holds both (its
/// layouts `dk_l`, `dv_l`). With grouped key/value heads each query head writes its own
/// partial, summed over the group by the host.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_kv_kernel<E: Float>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    d_out: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dkv: &mut Tensor<E>,
    q_l: Sequence<u32>,
    k_l: Sequence<u32>,
    v_l: Sequence<u32>,
    o_l: Sequence<u32>,
    s_l: Sequence<u32>,
    dk_l: Sequence<u32>,
    dv_l: Sequence<u32>,
    heads: u32,
    kv_group: u32,
    seq_q: u32,
    seq_k: u32,
    q_offset: i32,
    scale: f32,
    #[comptime] bq: usize,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] causal: bool,
    #[comptime] cmma: bool,
    #[define(E)] _dtype: StorageType,
) {
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let (b, h, hk) = this_head(heads, kv_group);
    let k_start = CUBE_POS_X as usize * bk;
    let q_base = head_base(&q_l, b, h);
    let q_token = *q_l.index(3usize) as usize;
    let o_base = head_base(&o_l, b, h);
    let o_token = *o_l.index(3usize) as usize;
    let s_base = head_base(&s_l, b, h);
    let s_token = *s_l.index(3usize) as usize;

    let mut ks = SharedMemory::<E>::new(bk * d);
    let mut vs = SharedMemory::<E>::new(bk * d);
    let mut qs = SharedMemory::<E>::new(bq * d);
    let mut dos = SharedMemory::<E>::new(bq * d);
    let mut st = SharedMemory::<f32>::new(bk * bq);
    let mut pt = SharedMemory::<E>::new(bk * bq);
    let mut dks = SharedMemory::<f32>::new(bk * d);
    let mut dvs = SharedMemory::<f32>::new(bk * d);
    let mut lse_s = SharedMemory::<f32>::new(bq);
    let mut delta_s = SharedMemory::<f32>::new(bq);

    load_rows::<E>(
        k,
        head_base(&k_l, b, hk),
        *k_l.index(3usize) as usize,
        k_start,
        seq_k,
        &mut ks,
        bk,
        d,
    );
    load_rows::<E>(
        v,
        head_base(&v_l, b, hk),
        *v_l.index(3usize) as usize,
        k_start,
        seq_k,
        &mut vs,
        bk,
        d,
    );
    let mut e = UNIT_POS as usize;
    while e < bk * d {
        dks[e] = 0.0;
        dvs[e] = 0.0;
        e += CUBE_DIM as usize;
    }
    // Query blocks from the first query that sees this block's first key.
    let mut first = 0usize;
    if comptime!(causal) {
        let q_first = i32::cast_from(k_start) - q_offset;
        first = usize::cast_from(i32::max(q_first, 0)) / bq;
    }
    let blocks = seq_q.div_ceil(bq);

    for qb in first..blocks {
        let q_start = qb * bq;
        // (the previous block's last product has read `qs`, `dos`, `pt`: `sync_cube` closed it)
        load_rows::<E>(q, q_base, q_token, q_start, seq_q, &mut qs, bq, d);
        load_rows::<E>(d_out, o_base, o_token, q_start, seq_q, &mut dos, bq, d);
        load_stats(lse, s_base, s_token, q_start, seq_q, 0.0, &mut lse_s, bq);
        load_stats(
            delta,
            s_base,
            s_token,
            q_start,
            seq_q,
            0.0,
            &mut delta_s,
            bq,
        );
        sync_cube();
        // Sᵀ = K·Qᵀ, then Pᵀ
        tile_mm::<E>(
            &ks, &qs, &mut st, bk, bq, d, d, d, bq, false, true, false, false, cmma,
        );
        sync_cube();
        let mut e = UNIT_POS as usize;
        while e < bk * bq {
            let j = e / bq;
            let i = e % bq;
            let mut p = 0.0f32;
            if visible(q_start + i, k_start + j, seq_q, seq_k, q_offset, causal) {
                p = f32::exp(st[e] * scale - lse_s[i]);
            }
            pt[e] = E::cast_from(p);
            e += CUBE_DIM as usize;
        }
        sync_cube();
        // dV += Pᵀ·dO and dPᵀ = V·dOᵀ (independent: one phase)
        tile_mm::<E>(
            &pt, &dos, &mut dvs, bk, d, bq, bq, d, d, false, false, false, true, cmma,
        );
        tile_mm::<E>(
            &vs, &dos, &mut st, bk, bq, d, d, d, bq, false, true, false, false, cmma,
        );
        sync_cube();
        // dSᵀ = Pᵀ∘(dPᵀ − delta) in place of Pᵀ
        let mut e = UNIT_POS as usize;
        while e < bk * bq {
            let i = e % bq;
            let p = f32::cast_from(pt[e]);
            pt[e] = E::cast_from(p * (st[e] - delta_s[i]));
            e += CUBE_DIM as usize;
        }
        sync_cube();
        // dK += dSᵀ·Q
        tile_mm::<E>(
            &pt, &qs, &mut dks, bk, d, bq, bq, d, d, false, false, false, true, cmma,
        );
        sync_cube();
    }

    let dk_base = head_base(&dk_l, b, h);
    let dk_token = *dk_l.index(3usize) as usize;
    let dv_base = head_base(&dv_l, b, h);
    let dv_token = *dv_l.index(3usize) as usize;
    let mut e = UNIT_POS as usize;
    while e < bk * d {
        let j = e / d;
        let c = e % d;
        if k_start + j < seq_k {
            dkv[dk_base + (k_start + j) * dk_token + c] = E::cast_from(dks[e] * scale);
            dkv[dv_base + (k_start + j) * dv_token + c] = E::cast_from(dvs[e]);
        }
        e += CUBE_DIM as usize;
    }
}

/// Both passes: dQ into `dq` (laid out `dq_l`), dK and dV into `dkv` (laid out `dk_l`, `dv_l`:
/// per query head, `[b, h, …]`).
#[allow(clippy::too_many_arguments)]
fn backward_into<R: CubeRuntime>(
    ops: &Operands<R>,
    p: &Problem,
    output: (&CubeTensor<R>, Heads),
    d_output: &CubeTensor<R>,
    lse: (&CubeTensor<R>, Heads),
    dq: (&CubeTensor<R>, Heads),
    dkv: &CubeTensor<R>,
    dk_l: Heads,
    dv_l: Heads,
) {
    let q = &ops.q.0;
    let delta = empty_f32(q, lse.0.shape());
    let tiles = Tiles::choose(q, Pass::BackwardQ, p.head_dim);
    let (count, dim) = launch_dims(p.seq_q, tiles.bq, p);
    flash_backward_q_kernel::launch::<R>(
        &q.client,
        count,
        dim,
        arg(q),
        arg(&ops.k.0),
        arg(&ops.v.0),
        arg(output.0),
        arg(d_output),
        arg(lse.0),
        arg(dq.0),
        arg(&delta),
        seq_arg(&ops.q.1),
        seq_arg(&ops.k.1),
        seq_arg(&ops.v.1),
        seq_arg(&output.1),
        seq_arg(&lse.1),
        seq_arg(&dq.1),
        p.heads as u32,
        p.kv_group as u32,
        p.seq_q as u32,
        p.seq_k as u32,
        p.q_offset as i32,
        p.scale,
        tiles.bq,
        tiles.bk,
        p.head_dim,
        p.causal,
        tiles.cmma,
        q.dtype.into(),
    );
    let tiles = Tiles::choose(q, Pass::BackwardKv, p.head_dim);
    let (count, dim) = launch_dims(p.seq_k, tiles.bk, p);
    flash_backward_kv_kernel::launch::<R>(
        &q.client,
        count,
        dim,
        arg(q),
        arg(&ops.k.0),
        arg(&ops.v.0),
        arg(d_output),
        arg(lse.0),
        arg(&delta),
        arg(dkv),
        seq_arg(&ops.q.1),
        seq_arg(&ops.k.1),
        seq_arg(&ops.v.1),
        seq_arg(&output.1),
        seq_arg(&lse.1),
        seq_arg(&dk_l),
        seq_arg(&dv_l),
        p.heads as u32,
        p.kv_group as u32,
        p.seq_q as u32,
        p.seq_k as u32,
        p.q_offset as i32,
        p.scale,
        tiles.bq,
        tiles.bk,
        p.head_dim,
        p.causal,
        tiles.cmma,
        q.dtype.into(),
    );
    launched(2);
}

/// `(dq, dk, dv)` from `[q, k, v, output, lse, d_output]` (`[b, h, t, d]`, lse `[b, h, t]`).
pub(super) fn backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    operands: [CubeTensor<R>; 6],
    scale: f64,
    causal: bool,
) -> [CubeTensor<R>; 3] {
    let [q, k, v, output, lse, d_output] = contiguous(operands);
    let p = problem(&q, &k, scale, causal);
    let (b, h, sk, d) = (p.batch, p.heads, p.seq_k, p.head_dim);
    let kv_heads = h / p.kv_group;
    let dq = empty(&q, q.shape(), q.dtype);
    // dK and dV of every query head in one buffer `[2, b, h, s, d]` (one writable binding).
    let dkv = empty(&q, Shape::new([2, b, h, sk, d]), q.dtype);
    let ops = Operands {
        q: (q, Heads::plain(h, p.seq_q, d)),
        k: (k, Heads::plain(kv_heads, sk, d)),
        v: (v, Heads::plain(kv_heads, sk, d)),
    };
    let mut dv_l = Heads::plain(h, sk, d);
    dv_l.offset = b * h * sk * d;
    backward_into(
        &ops,
        &p,
        (&output, Heads::plain(h, p.seq_q, d)),
        &d_output,
        (&lse, Heads::plain(h, p.seq_q, 1)),
        (&dq, Heads::plain(h, p.seq_q, d)),
        &dkv,
        Heads::plain(h, sk, d),
        dv_l,
    );
    let half = |i: usize| {
        let t = burn_cubecl::kernel::slice(dkv.clone(), &[i..i + 1, 0..b, 0..h, 0..sk, 0..d]);
        let t = burn_cubecl::ops::reshape(t, Shape::new([b, h, sk, d]));
        group_sum::<R, F, I, BT>(t, [b, kv_heads, p.kv_group, sk, d])
    };
    let (dk, dv) = (half(0), half(1));
    [dq, dk, dv]
}

/// Per-query-head key/value gradients `[b, h, s, d]` summed over each group of `group` query
/// heads into `[b, h / group, s, d]` (grouped-query attention); unchanged when `group` is 1.
fn group_sum<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    t: CubeTensor<R>,
    [b, kv_heads, group, s, d]: [usize; 5],
) -> CubeTensor<R> {
    if group == 1 {
        return t;
    }
    let t = burn_cubecl::ops::reshape(t, Shape::new([b, kv_heads, group, s * d]));
    let summed = Cb::<R, F, I, BT>::float_sum_dim(t, 2);
    burn_cubecl::ops::reshape(summed, Shape::new([b, kv_heads, s, d]))
}

/// The gradient of packed `qkv` `[b, t, h, 3·d]` (written in place, packed like it) from the
/// output `[b, t, h, d]`, its gradient and lse `[b, t, h]`.
pub(super) fn backward_packed<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    output: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_output: CubeTensor<R>,
    scale: f64,
    causal: bool,
) -> CubeTensor<R> {
    let [output, lse, d_output] = contiguous([output, lse, d_output]);
    let (ops, p) = packed_operands(qkv, scale, causal);
    let (h, t, d) = (p.heads, p.seq_q, p.head_dim);
    let dqkv = empty(&ops.q.0, ops.q.0.shape(), ops.q.0.dtype);
    backward_into(
        &ops,
        &p,
        (&output, Heads::packed(h, t, d, 1, 0)),
        &d_output,
        (&lse, Heads::packed(h, t, 1, 1, 0)),
        (&dqkv, Heads::packed(h, t, d, 3, 0)),
        &dqkv,
        Heads::packed(h, t, d, 3, 1),
        Heads::packed(h, t, d, 3, 2),
    );
    dqkv
}
