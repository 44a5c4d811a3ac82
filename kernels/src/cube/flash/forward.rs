//! The forward kernel and its launch.

use super::registers::*;
use super::*;

/// Forward: one cube per `planes · rows` queries of one (batch, head); each plane its `rows`
/// queries, over the key blocks up to the last one its cube's last query sees.
#[cube(launch, launch_unchecked, fast_math = fast_exp!())]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_forward_kernel<E: Float, N: Size>(
    q: &Tensor<Vector<E, N>>,
    k: &Tensor<Vector<E, N>>,
    v: &Tensor<Vector<E, N>>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    q_l: Sequence<u32>,
    k_l: Sequence<u32>,
    v_l: Sequence<u32>,
    o_l: Sequence<u32>,
    s_l: Sequence<u32>,
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
        // Rows padded by 8 elements (16 bytes): a fragment's 32-bit reads hit 32 banks.
        let ldv = comptime!((d + 8) / 2);
        let shape = comptime!(Phase::new(bk, d, ldv, cmma, loads.ldsm));
        let q_start = start;
        let (plane, g, t) = plane_lanes();
        let i0 = q_start + plane * rows + g;
        let mut qs = SharedMemory::<Vector<E, N>>::new_aligned(own * ldv, 16usize);
        let mut ks = SharedMemory::<Vector<E, N>>::new_aligned(bk * ldv, 16usize);
        let mut vs = SharedMemory::<Vector<E, N>>::new_aligned(bk * ldv, 16usize);
        let (mut emu, mut red) = emulation_memory::<E>(planes, bk, d, cmma);

        // The plane's Q operand, in registers for the whole loop.
        let got = fetch_rows::<E, N>(q, &q_l, b, h, q_start, seq_q, own, d, units);
        sync_cube();
        store_rows::<E, N>(&got, q_start, seq_q, &mut qs, own, d, ldv, units);
        sync_cube();
        let qf = a_operands::<E, N>(&qs, plane * rows, d, ldv);
        let mut o = acc_zeros::<N>(comptime!(d / 8));
        // Rows g and g + 8: running maxima (scaled scores) and this lane's partial sums.
        let mut m0 = f32::new(NEG_BIG);
        let mut m1 = f32::new(NEG_BIG);
        let mut l0 = 0.0f32;
        let mut l1 = 0.0f32;
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
            // S = Q·Kᵀ (bk / 8 accumulators of 16 × 8), scaled and masked; row maxima.
            let mut s = product_t::<E, N>(&qf, &ks, 0, &mut emu, shape);
            // A block inside every row's visible range (all but the diagonal's and the
            // sequence end's) takes a branch without a per-score test (uniform over the cube).
            let mut mx0 = m0;
            let mut mx1 = m1;
            if masked {
                scale_mask_block::<N>(
                    &mut s,
                    i0,
                    k_start + 2 * t,
                    &at,
                    scale,
                    &mut mx0,
                    &mut mx1,
                    bk,
                    true,
                    causal,
                );
            } else {
                scale_mask_block::<N>(
                    &mut s,
                    i0,
                    k_start + 2 * t,
                    &at,
                    scale,
                    &mut mx0,
                    &mut mx1,
                    bk,
                    false,
                    causal,
                );
            }
            let (mx0, mx1) = quad_combine(mx0, mx1, &mut red, true, cmma);
            let corr0 = f32::exp(m0 - mx0);
            let corr1 = f32::exp(m1 - mx1);
            m0 = mx0;
            m1 = mx1;
            l0 *= corr0;
            l1 *= corr1;
            #[unroll]
            for u in 0..comptime!(d / 8) {
                let c = o.index_mut(u);
                c[0] = c[0] * Vector::new(corr0);
                c[1] = c[1] * Vector::new(corr1);
            }
            // P = exp(S − m), summed into the lane's partial sums (a masked score gives 0).
            if masked {
                exp_block::<N>(&mut s, m0, m1, &mut l0, &mut l1, bk, true);
            } else {
                exp_block::<N>(&mut s, m0, m1, &mut l0, &mut l1, bk, false);
            }
            // O += P·V (the accumulator pairs of 16 keys are P's A operand).
            product_acc::<E, N>(&s, &vs, 0, &mut o, &mut emu, shape);
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

        let (l0, l1) = quad_combine(l0, l1, &mut red, false, cmma);
        let o_base = head_base(&o_l, b, h);
        let o_token = *o_l.index(3usize) as usize;
        #[unroll]
        for pv in 0..2usize {
            let i = i0 + 8 * pv;
            let mut l = l1;
            let mut m = m1;
            if comptime!(pv == 0) {
                l = l0;
                m = m0;
            }
            let inv = select(l > 0.0, 1.0 / l, 0.0);
            if i < seq_q {
                store_pairs::<E, N>(out, &o, o_base + i * o_token + 2 * t, inv, pv, d);
                if t == 0 {
                    let s_base = head_base(&s_l, b, h);
                    lse[s_base + i * *s_l.index(3usize) as usize] = m + f32::ln(l);
                }
            }
        }
    } else {
        let (ld, ldp, w, per_row, cols) = comptime!(tile_layout(d, bk, rows));
        let q_start = start;
        let (plane, lane, r, part) = lane_layout(per_row);
        let i = q_start + plane * rows + r;

        let mut qs = SharedMemory::<E>::new(own * ld);
        let mut ks = SharedMemory::<E>::new(bk * ld);
        let mut vs = SharedMemory::<E>::new(bk * ld);
        let mut ps = SharedMemory::<E>::new(own * ldp);
        let mut sc = SharedMemory::<f32>::new(own * w);
        let mut red = SharedMemory::<f32>::new(planes * LANES);
        let mut norm = SharedMemory::<f32>::new(own);
        let mut plain = SharedMemory::<f32>::new(comptime!(if cmma { 1 } else { own * d }));

        let n = q.vector_size();
        let got = fetch_rows::<E, N>(q, &q_l, b, h, q_start, seq_q, own, d, units);
        sync_cube();
        store_head::<E, N>(&got, q_start, seq_q, &mut qs, n, own, d, ld, units);
        let acc = acc_fragments(d, cmma);
        let a_off = plane * rows * ld;
        let p_off = plane * rows * ldp;
        let s_off = plane * rows * w;
        let o_off = plane * rows * d;
        plane_zero(&mut plain, o_off, rows, d, cmma);
        // This unit's running maximum (its row's) and partial sum (its slice of the row).
        let mut m = f32::new(NEG_BIG);
        let mut l = 0.0f32;
        let blocks = keys_end(q_start, seq_k, q_offset, own, causal).div_ceil(bk);
        sync_cube();

        for kb in 0..blocks {
            let k_start = kb * bk;
            load_pair::<E, N>(
                k, &k_l, v, &v_l, b, hk, k_start, seq_k, &mut ks, &mut vs, bk, d, ld, units,
            );
            sync_cube();
            // S = Q·Kᵀ for the plane's rows
            plane_scores::<E>(
                &qs, a_off, &ks, &mut sc, s_off, rows, bk, d, ld, ld, w, cmma,
            );
            sync_tiles(cmma);
            // The row's block maximum over its units' slices.
            let row = s_off + r * w + part * cols;
            let mut mx = f32::new(NEG_BIG);
            for c in 0..cols {
                let j = (c + lane) % cols;
                if visible(i, k_start + part * cols + j, seq_q, seq_k, q_offset, causal) {
                    mx = f32::max(mx, sc[row + j] * scale);
                }
            }
            let mx = row_combine(&mut red, mx, per_row, true, cmma);
            // Raise the running maximum only past the threshold (exact either way).
            let mut m_new = m;
            if mx > m + RESCALE_THRESHOLD {
                m_new = mx;
            }
            let corr = f32::exp(m - m_new);
            l *= corr;
            let prow = p_off + r * ldp + part * cols;
            for c in 0..cols {
                let j = (c + lane) % cols;
                let mut p = 0.0f32;
                if visible(i, k_start + part * cols + j, seq_q, seq_k, q_offset, causal) {
                    p = f32::exp(sc[row + j] * scale - m_new);
                }
                ps[prow + j] = E::cast_from(p);
                l += p;
            }
            // A grown maximum of a row that has seen keys rescales its output row.
            let grown = m_new != m && m > NEG_BIG;
            m = m_new;
            if comptime!(cmma) {
                if plane_any(grown) {
                    sync_plane();
                    plane_spill(&acc, &plain, o_off, &mut sc, s_off, rows, d, w, true);
                    sync_plane();
                    scale_row(&mut sc, s_off + r * w, corr, part, per_row, d);
                    sync_plane();
                    #[unroll]
                    for t in 0..comptime!(d / 16) {
                        cmma::load_with_layout(
                            acc.index(t),
                            &sc.slice(s_off + t * 16, sc.len()),
                            w as u32,
                            cmma::MatrixLayout::RowMajor,
                        );
                    }
                }
            } else {
                if grown {
                    scale_row(&mut plain, o_off + r * d, corr, part, per_row, d);
                }
            }
            sync_tiles(cmma);
            // O += P·V
            plane_accumulate::<E>(
                &ps, p_off, &vs, &acc, &mut plain, o_off, rows, d, bk, ldp, ld, cmma,
            );
            sync_cube();
        }

        let total = row_combine(&mut red, l, per_row, false, cmma);
        if part == 0 {
            norm[plane * rows + r] = total;
        }
        plane_spill(&acc, &plain, o_off, &mut sc, s_off, rows, d, w, cmma);
        sync_tiles(cmma);
        let o_base = head_base(&o_l, b, h);
        let o_token = *o_l.index(3usize) as usize;
        let mut e = lane;
        while e < rows * d {
            let rr = e / d;
            let c = e % d;
            let ii = q_start + plane * rows + rr;
            if ii < seq_q {
                let n = norm[plane * rows + rr];
                let mut x = 0.0f32;
                if n > 0.0 {
                    x = sc[s_off + rr * w + c] / n;
                }
                out[o_base + ii * o_token + c] = E::cast_from(x);
            }
            e += LANES;
        }
        if part == 0 && i < seq_q {
            let s_base = head_base(&s_l, b, h);
            lse[s_base + i * *s_l.index(3usize) as usize] = m + f32::ln(total);
        }
    }
}

/// Launches the forward into `output` and `lse` (f32).
pub(in crate::cube) fn forward<R: CubeRuntime>(
    ops: &Operands<R>,
    p: &Problem,
    output: (&CubeTensor<R>, Heads),
    lse: (&CubeTensor<R>, Heads),
) {
    use super::super::arg;
    let q = &ops.q.0;
    let n = vector_width(
        &[(q, ops.q.1), (&ops.k.0, ops.k.1), (&ops.v.0, ops.v.1)],
        p.head_dim,
    );
    let f = registers_split(q, Pass::Forward, p.head_dim, n)
        .unwrap_or_else(|| Flash::choose(q, Pass::Forward, p.head_dim));
    if f.registers {
        super::super::REGISTER_ATTENTION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let (count, dim) = f.launch_dims(p.seq_q, p);
    launch_flash!(
        flash_forward_kernel,
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
            arg(lse.0),
            seq_arg(&ops.q.1),
            seq_arg(&ops.k.1),
            seq_arg(&ops.v.1),
            seq_arg(&output.1),
            seq_arg(&lse.1),
        ]
    );
}
