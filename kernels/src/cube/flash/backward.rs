//! The two backward passes (dQ and delta; dK and dV) and their launch.

use super::registers::*;
use super::*;

/// Pass 1 of the backward: dQ, and `delta = rowsum(dO∘O)` (written for pass 2); one cube per
/// `planes · rows` queries, each plane its rows, over the key blocks up to the diagonal.
#[cube(launch, launch_unchecked, fast_math = fast_exp!())]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_backward_q_kernel<E: Float, N: Size>(
    q: &Tensor<Vector<E, N>>,
    k: &Tensor<Vector<E, N>>,
    v: &Tensor<Vector<E, N>>,
    out: &Tensor<Vector<E, N>>,
    d_out: &Tensor<Vector<E, N>>,
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
    #[comptime] planes: usize,
    #[comptime] rows: usize,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] causal: bool,
    #[comptime] cmma: bool,
    #[comptime] registers: bool,
    #[comptime] loads: Loads,
    #[define(E)] _dtype: StorageType,
) {
    let own = comptime!(planes * rows);
    let units = comptime!(planes * LANES);
    let (seq_q, seq_k) = (seq_q as usize, seq_k as usize);
    let (b, h, hk) = this_head(heads, kv_group);
    let start = CUBE_POS_X as usize * own;
    if comptime!(registers) {
        occupancy_hint(loads.cubes_per_sm);
        let ldv = comptime!((d + 8) / 2);
        let chunk = comptime!(if cmma { CHUNK } else { bk });
        let shape = comptime!(Phase::new(chunk, d, ldv, cmma, loads.ldsm));
        let q_start = start;
        let (plane, g, t) = plane_lanes();
        let i0 = q_start + plane * rows + g;
        let s_base = head_base(&s_l, b, h);
        let s_token = *s_l.index(3usize) as usize;

        let mut qs = SharedMemory::<Vector<E, N>>::new_aligned(own * ldv, 16usize);
        let mut dos = SharedMemory::<Vector<E, N>>::new_aligned(own * ldv, 16usize);
        let mut ks = SharedMemory::<Vector<E, N>>::new_aligned(bk * ldv, 16usize);
        let mut vs = SharedMemory::<Vector<E, N>>::new_aligned(bk * ldv, 16usize);
        let (mut emu, mut red) = emulation_memory::<E>(planes, chunk, d, cmma);

        load_rows_pair::<E, N>(
            q, &q_l, &mut qs, d_out, &o_l, &mut dos, b, h, q_start, seq_q, own, d, ldv, units,
        );
        // delta and lse of rows g and g + 8: each of a row's four lanes sums every fourth pair.
        let o_base = head_base(&o_l, b, h) / 2;
        let o_token = *o_l.index(3usize) as usize / 2;
        let mut part0 = 0.0f32;
        let mut part1 = 0.0f32;
        let mut lse0 = 0.0f32;
        let mut lse1 = 0.0f32;
        #[unroll]
        for pv in 0..2usize {
            let i = i0 + 8 * pv;
            let mut acc = 0.0f32;
            let mut row_lse = 0.0f32;
            if i < seq_q {
                let mut got = Sequence::<Vector<E, N>>::new();
                #[unroll]
                for c in 0..comptime!(d / 8) {
                    got.push(out[o_base + i * o_token + 4 * c + t]);
                }
                #[unroll]
                for c in 0..comptime!(d / 8) {
                    let gv = d_out[o_base + i * o_token + 4 * c + t];
                    let ov = *got.index(c);
                    acc += f32::cast_from(gv[0]) * f32::cast_from(ov[0])
                        + f32::cast_from(gv[1]) * f32::cast_from(ov[1]);
                }
                row_lse = lse[s_base + i * s_token];
            }
            if comptime!(pv == 0) {
                part0 = acc;
                lse0 = row_lse;
            } else {
                part1 = acc;
                lse1 = row_lse;
            }
        }
        let (delta0, delta1) = quad_combine(part0, part1, &mut red, false, cmma);
        if t == 0 {
            if i0 < seq_q {
                delta[s_base + i0 * s_token] = delta0;
            }
            if i0 + 8 < seq_q {
                delta[s_base + (i0 + 8) * s_token] = delta1;
            }
        }
        sync_cube();
        let qf = a_operands::<E, N>(&qs, plane * rows, d, ldv);
        let dof = a_operands::<E, N>(&dos, plane * rows, d, ldv);
        let mut acc = acc_zeros::<N>(comptime!(d / 8));
        // The next block's K and V read during each block's products (`kv_first`).
        let first = first_block(b, hk, seq_q, seq_k, q_start, q_offset);
        let blocks = kv_first::<E, N>(
            k,
            &k_l,
            v,
            &v_l,
            &first,
            &mut ks,
            &mut vs,
            own,
            bk,
            d,
            units,
            causal,
            loads.prefetch,
        );
        let ahead = comptime!(if loads.prefetch { bk } else { 0 });
        for kb in 0..blocks {
            let at = key_block(&first, kb, bk);
            let k_start = at.k_start;
            let gk = kv_ahead::<E, N>(k, &k_l, &at, bk, ahead, d, units);
            let gv = kv_ahead::<E, N>(v, &v_l, &at, bk, ahead, d, units);
            let masked = kv_block::<E, N>(
                k,
                &k_l,
                v,
                &v_l,
                &at,
                &mut ks,
                &mut vs,
                bk,
                d,
                units,
                causal,
                loads.prefetch,
            );
            #[unroll]
            for ph in 0..comptime!(bk / chunk) {
                let n0 = ph * chunk;
                let mut ds = product_t::<E, N>(&qf, &ks, n0, &mut emu, shape);
                let dp = product_t::<E, N>(&dof, &vs, n0, &mut emu, shape);
                let rows_at = QueryRows {
                    i0,
                    j0: k_start + n0 + 2 * t,
                    lse: (lse0, lse1),
                    delta: (delta0, delta1),
                };
                // Blocks inside every row's visible range skip the per-score test (a branch
                // uniform over the cube).
                if masked {
                    ds_scores::<N>(&mut ds, &dp, &rows_at, &at, scale, chunk, true, causal);
                } else {
                    ds_scores::<N>(&mut ds, &dp, &rows_at, &at, scale, chunk, false, causal);
                }
                // dQ += dS·K
                product_acc::<E, N>(&ds, &ks, n0, &mut acc, &mut emu, shape);
            }
            sync_cube();
            kv_next::<E, N>(
                &gk,
                &gv,
                &at,
                kb,
                blocks,
                &mut ks,
                &mut vs,
                bk,
                d,
                units,
                loads.prefetch,
            );
        }

        let dq_base = head_base(&dq_l, b, h);
        let dq_token = *dq_l.index(3usize) as usize;
        #[unroll]
        for pv in 0..2usize {
            let i = i0 + 8 * pv;
            if i < seq_q {
                store_pairs::<E, N>(dq, &acc, dq_base + i * dq_token + 2 * t, scale, pv, d);
            }
        }
    } else {
        let (ld, ldp, w, per_row, cols) = comptime!(tile_layout(d, bk, rows));
        let q_start = start;
        let o_base = head_base(&o_l, b, h);
        let o_token = *o_l.index(3usize) as usize;
        let s_base = head_base(&s_l, b, h);
        let s_token = *s_l.index(3usize) as usize;
        let (plane, lane, r, part) = lane_layout(per_row);
        let i = q_start + plane * rows + r;

        let mut qs = SharedMemory::<E>::new(own * ld);
        let mut dos = SharedMemory::<E>::new(own * ld);
        let mut ks = SharedMemory::<E>::new(bk * ld);
        let mut vs = SharedMemory::<E>::new(bk * ld);
        let mut ps = SharedMemory::<E>::new(own * ldp);
        let mut sc = SharedMemory::<f32>::new(own * w);
        let mut dps = SharedMemory::<f32>::new(own * w);
        let mut red = SharedMemory::<f32>::new(planes * LANES);
        let mut plain = SharedMemory::<f32>::new(comptime!(if cmma { 1 } else { own * d }));

        load_pair::<E, N>(
            q, &q_l, d_out, &o_l, b, h, q_start, seq_q, &mut qs, &mut dos, own, d, ld, units,
        );
        // delta of this unit's row in f32 from the stored dO and O, by one unit per row in column
        // order (for one visible key, dP − delta is then exactly 0 without tensor cores, as the
        // product `dO·Vᵀ` sums in the same order); the row's lse.
        let mut part_delta = 0.0f32;
        if i < seq_q && part == 0 {
            let at = o_base + i * o_token;
            let n = d_out.vector_size();
            // Unrolled: the row's reads are all issued before the sum waits on them (one unit reads
            // a whole row: rolled, each read waited in turn, the pass's main stall on an H200).
            #[unroll]
            for cv in 0..comptime!(d / n) {
                let g = d_out[at / n + cv];
                let o = out[at / n + cv];
                #[unroll]
                for j in 0..n {
                    part_delta += f32::cast_from(g[j]) * f32::cast_from(o[j]);
                }
            }
        }
        let dl = row_combine(&mut red, part_delta, per_row, false, cmma);
        let mut row_lse = 0.0f32;
        if i < seq_q {
            row_lse = lse[s_base + i * s_token];
            if part == 0 {
                delta[s_base + i * s_token] = dl;
            }
        }
        let acc = acc_fragments(d, cmma);
        let a_off = plane * rows * ld;
        let p_off = plane * rows * ldp;
        let s_off = plane * rows * w;
        let o_off = plane * rows * d;
        plane_zero(&mut plain, o_off, rows, d, cmma);
        let blocks = keys_end(q_start, seq_k, q_offset, own, causal).div_ceil(bk);
        sync_cube();

        for kb in 0..blocks {
            let k_start = kb * bk;
            load_pair::<E, N>(
                k, &k_l, v, &v_l, b, hk, k_start, seq_k, &mut ks, &mut vs, bk, d, ld, units,
            );
            sync_cube();
            // S = Q·Kᵀ and dP = dO·Vᵀ for the plane's rows
            plane_scores::<E>(
                &qs, a_off, &ks, &mut sc, s_off, rows, bk, d, ld, ld, w, cmma,
            );
            plane_scores::<E>(
                &dos, a_off, &vs, &mut dps, s_off, rows, bk, d, ld, ld, w, cmma,
            );
            sync_tiles(cmma);
            // dS = P∘(dP − delta) with P = exp(S·scale − lse), in f32, rounded once
            let row = s_off + r * w + part * cols;
            let prow = p_off + r * ldp + part * cols;
            for c in 0..cols {
                let j = (c + lane) % cols;
                let mut ds = 0.0f32;
                if visible(i, k_start + part * cols + j, seq_q, seq_k, q_offset, causal) {
                    let p = f32::exp(sc[row + j] * scale - row_lse);
                    ds = p * (dps[row + j] - dl);
                }
                ps[prow + j] = E::cast_from(ds);
            }
            sync_tiles(cmma);
            // dQ += dS·K
            plane_accumulate::<E>(
                &ps, p_off, &ks, &acc, &mut plain, o_off, rows, d, bk, ldp, ld, cmma,
            );
            sync_cube();
        }

        plane_spill(&acc, &plain, o_off, &mut sc, s_off, rows, d, w, cmma);
        sync_tiles(cmma);
        let dq_base = head_base(&dq_l, b, h);
        let dq_token = *dq_l.index(3usize) as usize;
        let mut e = lane;
        while e < rows * d {
            let rr = e / d;
            let ii = q_start + plane * rows + rr;
            if ii < seq_q {
                dq[dq_base + ii * dq_token + e % d] =
                    E::cast_from(sc[s_off + rr * w + e % d] * scale);
            }
            e += LANES;
        }
    }
}

/// Pass 2 of the backward: dK and dV, one cube per `planes · rows` keys of one (batch, query
/// head), each plane its keys, over the query blocks from the diagonal on; `dkv` holds both
/// (laid out `dk_l`, `dv_l`). With grouped key/value heads each query head writes its own
/// partial, summed over the group by the host.
#[cube(launch, launch_unchecked, fast_math = fast_exp!())]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_backward_kv_kernel<E: Float, N: Size>(
    q: &Tensor<Vector<E, N>>,
    k: &Tensor<Vector<E, N>>,
    v: &Tensor<Vector<E, N>>,
    d_out: &Tensor<Vector<E, N>>,
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
    #[comptime] planes: usize,
    #[comptime] rows: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] causal: bool,
    #[comptime] cmma: bool,
    #[comptime] registers: bool,
    #[comptime] loads: Loads,
    #[define(E)] _dtype: StorageType,
) {
    let own = comptime!(planes * rows);
    let units = comptime!(planes * LANES);
    let (seq_q, seq_k) = (seq_q as usize, seq_k as usize);
    let (b, h, hk) = this_head(heads, kv_group);
    let start = CUBE_POS_X as usize * own;
    if comptime!(registers) {
        occupancy_hint(loads.cubes_per_sm);
        let ldv = comptime!((d + 8) / 2);
        let chunk = comptime!(if cmma { CHUNK } else { bq });
        let shape = comptime!(Phase::new(chunk, d, ldv, cmma, loads.ldsm));
        let k_start = start;
        let (plane, g, t) = plane_lanes();
        let key0 = k_start + plane * rows + g;
        let s_base = head_base(&s_l, b, h);
        let s_token = *s_l.index(3usize) as usize;

        let mut ks = SharedMemory::<Vector<E, N>>::new_aligned(own * ldv, 16usize);
        let mut vs = SharedMemory::<Vector<E, N>>::new_aligned(own * ldv, 16usize);
        let mut qs = SharedMemory::<Vector<E, N>>::new_aligned(bq * ldv, 16usize);
        let mut dos = SharedMemory::<Vector<E, N>>::new_aligned(bq * ldv, 16usize);
        let mut lse_s = SharedMemory::<f32>::new(bq);
        let mut delta_s = SharedMemory::<f32>::new(bq);
        let (mut emu, _) = emulation_memory::<E>(planes, chunk, d, cmma);

        load_rows_pair::<E, N>(
            k, &k_l, &mut ks, v, &v_l, &mut vs, b, hk, k_start, seq_k, own, d, ldv, units,
        );
        sync_cube();
        // The plane's K and V operands, held in registers for the whole loop unless reread
        // at each product (`kv_reread`: none held).
        let held = comptime!(if loads.kv_reread { 0 } else { d });
        let kf = a_operands::<E, N>(&ks, plane * rows, held, ldv);
        let vf = a_operands::<E, N>(&vs, plane * rows, held, ldv);
        let mut dk = acc_zeros::<N>(comptime!(d / 8));
        let mut dv = acc_zeros::<N>(comptime!(d / 8));
        // Query blocks from the first query that sees this cube's first key.
        let first = first_query_block(k_start, q_offset, bq, causal);
        let blocks = seq_q.div_ceil(bq);

        for qb in first..blocks {
            let q_start = qb * bq;
            sync_cube();
            load_rows_pair::<E, N>(
                q, &q_l, &mut qs, d_out, &o_l, &mut dos, b, h, q_start, seq_q, bq, d, ldv, units,
            );
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
            let mut masked = q_start + bq > seq_q || k_start + own > seq_k;
            if comptime!(causal) {
                masked = masked
                    || i32::cast_from(k_start + own - 1) > i32::cast_from(q_start) + q_offset;
            }
            #[unroll]
            for ph in 0..comptime!(bq / chunk) {
                let n0 = ph * chunk;
                let (mut pt, mut dst) = kv_products::<E, N>(
                    &kf,
                    &vf,
                    &ks,
                    &vs,
                    &qs,
                    &dos,
                    plane * rows,
                    n0,
                    &mut emu,
                    shape,
                    loads.kv_reread,
                );
                let at = KeyRows {
                    key0,
                    q_start,
                    q0: n0 + 2 * t,
                    seq_q,
                    seq_k,
                    q_offset,
                };
                // Blocks inside every key's visible range skip the per-score test (a branch
                // uniform over the cube).
                if masked {
                    p_ds_transposed::<N>(
                        &mut pt, &mut dst, &lse_s, &delta_s, &at, scale, chunk, true, causal,
                    );
                } else {
                    p_ds_transposed::<N>(
                        &mut pt, &mut dst, &lse_s, &delta_s, &at, scale, chunk, false, causal,
                    );
                }
                // dV += Pᵀ·dO, dK += dSᵀ·Q
                product_acc::<E, N>(&pt, &dos, n0, &mut dv, &mut emu, shape);
                product_acc::<E, N>(&dst, &qs, n0, &mut dk, &mut emu, shape);
            }
        }

        let dk_base = head_base(&dk_l, b, h);
        let dk_token = *dk_l.index(3usize) as usize;
        let dv_base = head_base(&dv_l, b, h);
        let dv_token = *dv_l.index(3usize) as usize;
        #[unroll]
        for pv in 0..2usize {
            let j = key0 + 8 * pv;
            if j < seq_k {
                store_pairs::<E, N>(dkv, &dk, dk_base + j * dk_token + 2 * t, scale, pv, d);
                store_pairs::<E, N>(dkv, &dv, dv_base + j * dv_token + 2 * t, 1.0, pv, d);
            }
        }
    } else {
        let (ld, ldp, w, per_row, cols) = comptime!(tile_layout(d, bq, rows));
        let k_start = start;
        let s_base = head_base(&s_l, b, h);
        let s_token = *s_l.index(3usize) as usize;
        let (plane, lane, r, part) = lane_layout(per_row);
        let key = k_start + plane * rows + r;

        let mut ks = SharedMemory::<E>::new(own * ld);
        let mut vs = SharedMemory::<E>::new(own * ld);
        let mut qs = SharedMemory::<E>::new(bq * ld);
        let mut dos = SharedMemory::<E>::new(bq * ld);
        let mut pt = SharedMemory::<E>::new(own * ldp);
        let mut dst = SharedMemory::<E>::new(own * ldp);
        let mut sc = SharedMemory::<f32>::new(own * w);
        let mut dps = SharedMemory::<f32>::new(own * w);
        let mut lse_s = SharedMemory::<f32>::new(bq);
        let mut delta_s = SharedMemory::<f32>::new(bq);
        let mut plain = SharedMemory::<f32>::new(comptime!(if cmma { 1 } else { 2 * own * d }));

        load_pair::<E, N>(
            k, &k_l, v, &v_l, b, hk, k_start, seq_k, &mut ks, &mut vs, own, d, ld, units,
        );
        let dk_acc = acc_fragments(d, cmma);
        let dv_acc = acc_fragments(d, cmma);
        let a_off = plane * rows * ld;
        let p_off = plane * rows * ldp;
        let s_off = plane * rows * w;
        let dk_off = plane * rows * d;
        let dv_off = comptime!(own * d) + plane * rows * d;
        plane_zero(&mut plain, dk_off, rows, d, cmma);
        plane_zero(&mut plain, dv_off, rows, d, cmma);
        // Query blocks from the first query that sees this cube's first key.
        let first = first_query_block(k_start, q_offset, bq, causal);
        let blocks = seq_q.div_ceil(bq);

        for qb in first..blocks {
            let q_start = qb * bq;
            load_pair::<E, N>(
                q, &q_l, d_out, &o_l, b, h, q_start, seq_q, &mut qs, &mut dos, bq, d, ld, units,
            );
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
            // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for the plane's keys
            plane_scores::<E>(
                &ks, a_off, &qs, &mut sc, s_off, rows, bq, d, ld, ld, w, cmma,
            );
            plane_scores::<E>(
                &vs, a_off, &dos, &mut dps, s_off, rows, bq, d, ld, ld, w, cmma,
            );
            sync_tiles(cmma);
            // Pᵀ and dSᵀ = Pᵀ∘(dPᵀ − delta), each rounded once
            let row = s_off + r * w + part * cols;
            let prow = p_off + r * ldp + part * cols;
            for c in 0..cols {
                let j = (c + lane) % cols;
                let qj = part * cols + j;
                let mut p = 0.0f32;
                let mut ds = 0.0f32;
                if visible(q_start + qj, key, seq_q, seq_k, q_offset, causal) {
                    p = f32::exp(sc[row + j] * scale - lse_s[qj]);
                    ds = p * (dps[row + j] - delta_s[qj]);
                }
                pt[prow + j] = E::cast_from(p);
                dst[prow + j] = E::cast_from(ds);
            }
            sync_tiles(cmma);
            // dV += Pᵀ·dO, dK += dSᵀ·Q
            plane_accumulate::<E>(
                &pt, p_off, &dos, &dv_acc, &mut plain, dv_off, rows, d, bq, ldp, ld, cmma,
            );
            plane_accumulate::<E>(
                &dst, p_off, &qs, &dk_acc, &mut plain, dk_off, rows, d, bq, ldp, ld, cmma,
            );
            sync_cube();
        }

        plane_spill(&dk_acc, &plain, dk_off, &mut sc, s_off, rows, d, w, cmma);
        plane_spill(&dv_acc, &plain, dv_off, &mut dps, s_off, rows, d, w, cmma);
        sync_tiles(cmma);
        let dk_base = head_base(&dk_l, b, h);
        let dk_token = *dk_l.index(3usize) as usize;
        let dv_base = head_base(&dv_l, b, h);
        let dv_token = *dv_l.index(3usize) as usize;
        let mut e = lane;
        while e < rows * d {
            let jj = k_start + plane * rows + e / d;
            let c = e % d;
            if jj < seq_k {
                let at = s_off + (e / d) * w + c;
                dkv[dk_base + jj * dk_token + c] = E::cast_from(sc[at] * scale);
                dkv[dv_base + jj * dv_token + c] = E::cast_from(dps[at]);
            }
            e += LANES;
        }
    }
}

/// Launches both backward passes: dQ into `dq`, `delta` (f32, laid out like lse), dK and dV
/// into `dkv` (laid out `dk_l`, `dv_l`: per query head).
#[allow(clippy::too_many_arguments)]
pub(in crate::cube) fn backward<R: CubeRuntime>(
    ops: &Operands<R>,
    p: &Problem,
    output: (&CubeTensor<R>, Heads),
    d_output: &CubeTensor<R>,
    lse: (&CubeTensor<R>, Heads),
    delta: &CubeTensor<R>,
    dq: (&CubeTensor<R>, Heads),
    dkv: &CubeTensor<R>,
    dk_l: Heads,
    dv_l: Heads,
) {
    use super::super::arg;
    let q = &ops.q.0;
    let n = vector_width(
        &[
            (q, ops.q.1),
            (&ops.k.0, ops.k.1),
            (&ops.v.0, ops.v.1),
            (d_output, output.1),
            (output.0, output.1),
        ],
        p.head_dim,
    );
    // The register kernels for both passes, or the older ones for both.
    let (fq, fkv) = registers_split(q, Pass::BackwardQ, p.head_dim, n)
        .zip(registers_split(q, Pass::BackwardKv, p.head_dim, n))
        .unwrap_or_else(|| {
            (
                Flash::choose(q, Pass::BackwardQ, p.head_dim),
                Flash::choose(q, Pass::BackwardKv, p.head_dim),
            )
        });
    if fq.registers {
        super::super::REGISTER_ATTENTION.fetch_add(2, std::sync::atomic::Ordering::Relaxed);
    }
    let f = fq;
    let (count, dim) = f.launch_dims(p.seq_q, p);
    launch_flash!(
        flash_backward_q_kernel,
        q,
        p,
        f,
        count,
        dim,
        n,
        [
            arg(q),
            arg(&ops.k.0),
            arg(&ops.v.0),
            arg(output.0),
            arg(d_output),
            arg(lse.0),
            arg(dq.0),
            arg(delta),
            seq_arg(&ops.q.1),
            seq_arg(&ops.k.1),
            seq_arg(&ops.v.1),
            seq_arg(&output.1),
            seq_arg(&lse.1),
            seq_arg(&dq.1),
        ]
    );
    let f = fkv;
    let (count, dim) = f.launch_dims(p.seq_k, p);
    launch_flash!(
        flash_backward_kv_kernel,
        q,
        p,
        f,
        count,
        dim,
        n,
        [
            arg(q),
            arg(&ops.k.0),
            arg(&ops.v.0),
            arg(d_output),
            arg(lse.0),
            arg(delta),
            arg(dkv),
            seq_arg(&ops.q.1),
            seq_arg(&ops.k.1),
            seq_arg(&ops.v.1),
            seq_arg(&output.1),
            seq_arg(&lse.1),
            seq_arg(&dk_l),
            seq_arg(&dv_l),
        ]
    );
}

/// The dQ pass's rows of a lane: rows `i0` and `i0 + 8`, its first column `j0` in the key block,
/// and the rows' log-sum-exp and `delta`.
#[derive(CubeType, Clone, Copy)]
struct QueryRows {
    i0: usize,
    j0: usize,
    lse: (f32, f32),
    delta: (f32, f32),
}

/// `dS = P ∘ (dP − delta)` in place of the scores `ds` of one phase (`chunk` keys), `P` from the
/// rows' log-sum-exp; with `mask` (a block crossing the diagonal or the sequence's end) 0 where
/// a row does not see the key.
#[cube]
#[allow(clippy::too_many_arguments)]
fn ds_scores<N: Size>(
    ds: &mut Sequence<Array<Vector<f32, N>>>,
    dp: &Sequence<Array<Vector<f32, N>>>,
    rows: &QueryRows,
    at: &KeyBlock,
    scale: f32,
    #[comptime] chunk: usize,
    #[comptime] mask: bool,
    #[comptime] causal: bool,
) {
    #[unroll]
    for n in 0..comptime!(chunk / 8) {
        let c = ds.index_mut(n);
        let y = dp.index(n);
        #[unroll]
        for pv in 0..2usize {
            let mut x = c[pv];
            let z = y[pv];
            let mut row_lse = rows.lse.1;
            let mut dl = rows.delta.1;
            if comptime!(pv == 0) {
                row_lse = rows.lse.0;
                dl = rows.delta.0;
            }
            #[unroll]
            for e in 0..2usize {
                let mut p = f32::exp(x[e] * scale - row_lse);
                if comptime!(mask) {
                    let j = rows.j0 + n * 8 + e;
                    if !visible(rows.i0 + 8 * pv, j, at.seq_q, at.seq_k, at.q_offset, causal) {
                        p = 0.0;
                    }
                }
                x[e] = p * (z[e] - dl);
            }
            c[pv] = x;
        }
    }
}

/// The dK/dV pass's keys of a lane (`key0`, `key0 + 8`) against the query block from `q_start`,
/// its first query column `q0` in the block.
#[derive(CubeType, Clone, Copy)]
struct KeyRows {
    key0: usize,
    q_start: usize,
    q0: usize,
    seq_q: usize,
    seq_k: usize,
    q_offset: i32,
}

/// `Pᵀ` into `pt` and `dSᵀ = Pᵀ ∘ (dPᵀ − delta)` into `dst` for one phase (`chunk` queries), from
/// the block's log-sum-exp and `delta` in shared memory; with `mask` 0 where a query does not
/// see the key.
#[cube]
#[allow(clippy::too_many_arguments)]
fn p_ds_transposed<N: Size>(
    pt: &mut Sequence<Array<Vector<f32, N>>>,
    dst: &mut Sequence<Array<Vector<f32, N>>>,
    lse_s: &SharedMemory<f32>,
    delta_s: &SharedMemory<f32>,
    at: &KeyRows,
    scale: f32,
    #[comptime] chunk: usize,
    #[comptime] mask: bool,
    #[comptime] causal: bool,
) {
    #[unroll]
    for n in 0..comptime!(chunk / 8) {
        let c = pt.index_mut(n);
        let y = dst.index_mut(n);
        #[unroll]
        for pv in 0..2usize {
            let mut x = c[pv];
            let mut z = y[pv];
            #[unroll]
            for e in 0..2usize {
                let qj = at.q0 + n * 8 + e;
                let mut p = f32::exp(x[e] * scale - lse_s[qj]);
                if comptime!(mask) {
                    let key = at.key0 + 8 * pv;
                    if !visible(
                        at.q_start + qj,
                        key,
                        at.seq_q,
                        at.seq_k,
                        at.q_offset,
                        causal,
                    ) {
                        p = 0.0;
                    }
                }
                x[e] = p;
                z[e] = p * (z[e] - delta_s[qj]);
            }
            c[pv] = x;
            y[pv] = z;
        }
    }
}
