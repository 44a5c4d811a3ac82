//! One row times a matrix, `out = x · W` for a `1 × k` row `x` (a generated token's activations
//! through a projection, or the tied head's `x · tableᵀ`), streaming the weight once at the
//! memory's speed. `gemm`'s own matrix–vector path reached 12 GB/s a thread where PyTorch's
//! reaches 14–15 (GPT-2 124M's weights, 2 threads of an Intel Xeon: `gemm` 16.6 GB/s, these
//! kernels 27, PyTorch 29; `benches/generate.rs` measures what a token costs).
//!
//! The numbers are `gemm`'s for the same call, bit for bit (so [`crate::gemm`]'s products stay
//! Burn Flex's): its matrix–vector paths (`gemm_common::gemv`), with the vector width it picks
//! (AVX-512 where the CPU has it, AVX2 + FMA otherwise), are followed operation for operation:
//! - **rows** (`W` row-major `[k, n]`, a linear layer's weight; `gemm`'s `mixed_gemv_colmajor`):
//!   each output one `fma` chain over `k` in order, `outⱼ = x₀·w₀ⱼ` first (or `fma` onto the
//!   output with `add`). The kernel reads eight rows a step and keeps the chain's value in a
//!   register between them.
//! - **columns** (`W = Aᵀ` with `A` row-major `[n, k]`, a tied table; `mixed_gemv_rowmajor`): a
//!   dot product per output in eight vector accumulators over blocks of eight vectors, added as a
//!   tree (`0+1, 2+3, 4+5, 6+7`, then pairs), then the remaining whole vectors `fma`'d into the
//!   sum, its lanes added in order, the last `k mod width` elements by scalar `fma`, and the
//!   output added last with `add`. Two outputs a step on AVX-512 (sixteen accumulators).
//!
//! [`gemm_takes`] says which calls those paths serve (one row, `k ≥ 3`, at least two columns,
//! and for the columns layout more than 256 of them and a contiguous row: `gemm` runs other
//! kernels otherwise). Each output element is computed alone, so any split of the columns over
//! threads gives the same numbers. Without AVX2 + FMA (or off x86-64) nothing is taken here.

use std::ops::Range;

/// How the weight `W` (`k × n`, f32) lies in memory.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Weight {
    /// `W[i, j]` at `ptr + i·stride + j` (row-major rows, `stride ≥ n`).
    Rows(*const f32, usize),
    /// `W[i, j]` at `ptr + j·stride + i` (the transpose of a row-major `[n, k]`, `stride ≥ k`).
    Columns(*const f32, usize),
}

// SAFETY: a weight is only read, by every thread of a split product.
unsafe impl Send for Weight {}
unsafe impl Sync for Weight {}

/// Whether this CPU has a kernel here: the widths `gemm` picks (AVX-512, or AVX2 + FMA; checked
/// once).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                || (std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma"))
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the one-row product `x · W` (`k` deep, `n` columns, `x`'s elements `x_stride`
/// apart) runs one of `gemm`'s matrix–vector paths that the kernels here follow, on this CPU.
pub(crate) fn gemm_takes(w: &Weight, k: usize, n: usize, x_stride: isize) -> bool {
    available()
        && k >= 3
        && n >= 2
        && match w {
            Weight::Rows(..) => true,
            Weight::Columns(..) => n > 256 && x_stride == 1,
        }
}

/// `out[j] = Σᵢ x[i]·W[i, j]` (with `add`, `out[j] += …`) for the columns `cols` of `W`;
/// `out` points at column 0 of the output row.
///
/// # Safety
/// [`available`] must be true; `W` must be valid for its `x.len() × cols.end` extent, `out` for
/// `cols.end` elements, and with `add` those of `cols` initialised. No other thread may touch
/// `out[cols]` meanwhile.
pub(crate) unsafe fn row_times(x: &[f32], w: Weight, cols: Range<usize>, out: *mut f32, add: bool) {
    debug_assert!(available());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract; the features are checked once per call here.
    unsafe {
        if std::arch::is_x86_feature_detected!("avx512f") {
            x86::v4(x, w, cols, out, add)
        } else {
            x86::v3(x, w, cols, out, add)
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, w, cols, out, add);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Range, Weight};
    use std::arch::x86_64::*;

    /// One vector width's registers: `N` lanes of f32.
    trait Lanes {
        type V: Copy;
        const N: usize;
        unsafe fn zero() -> Self::V;
        unsafe fn splat(a: f32) -> Self::V;
        unsafe fn load(p: *const f32) -> Self::V;
        unsafe fn store(p: *mut f32, v: Self::V);
        unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
        unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
        /// `a·b + c`, one rounding.
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    }

    /// A [`Lanes`] type `$name` of register `$v` (`$n` lanes) over its intrinsics.
    macro_rules! lanes {
        ($name:ident, $v:ty, $n:expr, [$zero:ident, $splat:ident, $load:ident, $store:ident, $mul:ident, $add:ident, $fma:ident]) => {
            struct $name;

            impl Lanes for $name {
                type V = $v;
                const N: usize = $n;
                #[inline(always)]
                unsafe fn zero() -> $v {
                    unsafe { $zero() }
                }
                #[inline(always)]
                unsafe fn splat(a: f32) -> $v {
                    unsafe { $splat(a) }
                }
                #[inline(always)]
                unsafe fn load(p: *const f32) -> $v {
                    unsafe { $load(p) }
                }
                #[inline(always)]
                unsafe fn store(p: *mut f32, v: $v) {
                    unsafe { $store(p, v) }
                }
                #[inline(always)]
                unsafe fn mul(a: $v, b: $v) -> $v {
                    unsafe { $mul(a, b) }
                }
                #[inline(always)]
                unsafe fn add(a: $v, b: $v) -> $v {
                    unsafe { $add(a, b) }
                }
                #[inline(always)]
                unsafe fn fma(a: $v, b: $v, c: $v) -> $v {
                    unsafe { $fma(a, b, c) }
                }
            }
        };
    }

    lanes!(
        Avx512,
        __m512,
        16,
        [
            _mm512_setzero_ps,
            _mm512_set1_ps,
            _mm512_loadu_ps,
            _mm512_storeu_ps,
            _mm512_mul_ps,
            _mm512_add_ps,
            _mm512_fmadd_ps
        ]
    );
    lanes!(
        Avx2,
        __m256,
        8,
        [
            _mm256_setzero_ps,
            _mm256_set1_ps,
            _mm256_loadu_ps,
            _mm256_storeu_ps,
            _mm256_mul_ps,
            _mm256_add_ps,
            _mm256_fmadd_ps
        ]
    );

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn v4(x: &[f32], w: Weight, cols: Range<usize>, out: *mut f32, add: bool) {
        unsafe { kernel::<Avx512>(x, w, cols, out, add) }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn v3(x: &[f32], w: Weight, cols: Range<usize>, out: *mut f32, add: bool) {
        unsafe { kernel::<Avx2>(x, w, cols, out, add) }
    }

    /// Rows of `W` a step of the rows kernel reads at once.
    const ROWS: usize = 8;

    /// The `len` outputs a kernel writes from `o` on (with `add`, onto their values).
    #[derive(Clone, Copy)]
    struct Out {
        o: *mut f32,
        len: usize,
        add: bool,
    }

    #[inline(always)]
    unsafe fn kernel<S: Lanes>(x: &[f32], w: Weight, cols: Range<usize>, out: *mut f32, add: bool) {
        // SAFETY (all below): the caller's extents; every pointer formed stays inside them.
        unsafe {
            let out = Out {
                o: out.add(cols.start),
                len: cols.len(),
                add,
            };
            match w {
                Weight::Rows(ptr, stride) => rows::<S>(x, ptr.add(cols.start), stride, out),
                Weight::Columns(ptr, stride) => {
                    let w = ptr.add(cols.start * stride);
                    // Two outputs a step where the registers hold both sums' accumulators.
                    if S::N == 16 {
                        columns::<S, 2>(x, w, stride, out)
                    } else {
                        columns::<S, 1>(x, w, stride, out)
                    }
                }
            }
        }
    }

    /// `o[j] = fma(w[i·stride + j], x[i], o[j])` for `i` in order, from `o[j] = w[j]·x[0]`
    /// (with `add`, from `o[j]`), for `j < len`: eight rows a step.
    #[inline(always)]
    unsafe fn rows<S: Lanes>(x: &[f32], w: *const f32, stride: usize, out: Out) {
        let Out { o, len, add } = out;
        let vec_end = len / S::N * S::N;
        unsafe {
            let mut i = 0;
            if !add && let Some(&a) = x.first() {
                let av = S::splat(a);
                let mut j = 0;
                while j < vec_end {
                    S::store(o.add(j), S::mul(S::load(w.add(j)), av));
                    j += S::N;
                }
                for j in vec_end..len {
                    *o.add(j) = *w.add(j) * a;
                }
                i = 1;
            }
            while i + ROWS <= x.len() {
                let a: [f32; ROWS] = std::array::from_fn(|r| x[i + r]);
                let av: [S::V; ROWS] = std::array::from_fn(|r| S::splat(a[r]));
                let row: [*const f32; ROWS] = std::array::from_fn(|r| w.add((i + r) * stride));
                let mut j = 0;
                while j < vec_end {
                    let mut s = S::load(o.add(j));
                    for r in 0..ROWS {
                        s = S::fma(S::load(row[r].add(j)), av[r], s);
                    }
                    S::store(o.add(j), s);
                    j += S::N;
                }
                for j in vec_end..len {
                    let mut s = *o.add(j);
                    for r in 0..ROWS {
                        s = (*row[r].add(j)).mul_add(a[r], s);
                    }
                    *o.add(j) = s;
                }
                i += ROWS;
            }
            for (i, &a) in x.iter().enumerate().skip(i) {
                let (av, row) = (S::splat(a), w.add(i * stride));
                let mut j = 0;
                while j < vec_end {
                    S::store(o.add(j), S::fma(S::load(row.add(j)), av, S::load(o.add(j))));
                    j += S::N;
                }
                for j in vec_end..len {
                    *o.add(j) = (*row.add(j)).mul_add(a, *o.add(j));
                }
            }
        }
    }

    /// `o[j] = dot(x, w[j·stride..])` (with `add`, `+ o[j]`) for `j < len`, `R` outputs a step.
    #[inline(always)]
    unsafe fn columns<S: Lanes, const R: usize>(x: &[f32], w: *const f32, stride: usize, out: Out) {
        let Out { o, len, add } = out;
        let mut j = 0;
        unsafe {
            let put = |j: usize, s: f32| {
                let o = o.add(j);
                *o = if add { s + *o } else { s };
            };
            while j + R <= len {
                let sums = dots::<S, R>(x, std::array::from_fn(|r| w.add((j + r) * stride)));
                for (r, s) in sums.into_iter().enumerate() {
                    put(j + r, s);
                }
                j += R;
            }
            while j < len {
                let [s] = dots::<S, 1>(x, [w.add(j * stride)]);
                put(j, s);
                j += 1;
            }
        }
    }

    /// The dot products of `x` with the `R` rows at `row`, in `gemm`'s order (the module's
    /// doc).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // accumulators and elements by index, as `gemm`'s
    unsafe fn dots<S: Lanes, const R: usize>(x: &[f32], row: [*const f32; R]) -> [f32; R] {
        let k = x.len();
        let (lane, lane8) = (S::N, 8 * S::N);
        let (k_lane, k_lane8) = (k / lane * lane, k / lane8 * lane8);
        let xp = x.as_ptr();
        unsafe {
            let mut acc = [[S::zero(); 8]; R];
            let mut depth = 0;
            while depth < k_lane8 {
                for u in 0..8 {
                    let xv = S::load(xp.add(depth + u * lane));
                    for r in 0..R {
                        acc[r][u] = S::fma(S::load(row[r].add(depth + u * lane)), xv, acc[r][u]);
                    }
                }
                depth += lane8;
            }
            std::array::from_fn(|r| {
                let a = acc[r];
                let (a0, a2) = (S::add(a[0], a[1]), S::add(a[2], a[3]));
                let (a4, a6) = (S::add(a[4], a[5]), S::add(a[6], a[7]));
                let mut sum = S::add(S::add(a0, a2), S::add(a4, a6));
                let mut d = depth;
                while d < k_lane {
                    sum = S::fma(S::load(row[r].add(d)), S::load(xp.add(d)), sum);
                    d += lane;
                }
                let mut lanes = [0.0f32; 16];
                S::store(lanes.as_mut_ptr(), sum);
                let mut s = lanes[0];
                for &l in &lanes[1..lane] {
                    s += l;
                }
                for d in k_lane..k {
                    s = (*row[r].add(d)).mul_add(x[d], s);
                }
                s
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    }

    /// `gemm`'s matrix–vector order on the host, for vector width `lane` (the module's doc).
    #[allow(clippy::needless_range_loop)] // elements by index, as the kernels'
    fn reference(
        x: &[f32],
        w: &[f32],
        n: usize,
        columns: bool,
        lane: usize,
        out: &mut [f32],
        add: bool,
    ) {
        let k = x.len();
        let at = |i: usize, j: usize| if columns { w[j * k + i] } else { w[i * n + j] };
        for (j, o) in out.iter_mut().enumerate() {
            if !columns {
                let mut s = if add {
                    at(0, j).mul_add(x[0], *o)
                } else {
                    at(0, j) * x[0]
                };
                for (i, &a) in x.iter().enumerate().skip(1) {
                    s = at(i, j).mul_add(a, s);
                }
                *o = s;
                continue;
            }
            let (k_lane, k_lane8) = (k / lane * lane, k / (8 * lane) * 8 * lane);
            let mut acc = vec![vec![0.0f32; lane]; 8];
            for d in 0..k_lane8 {
                let (u, l) = ((d % (8 * lane)) / lane, d % lane);
                acc[u][l] = at(d, j).mul_add(x[d], acc[u][l]);
            }
            let sum =
                |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| a + b).collect::<Vec<f32>>();
            let (a0, a2, a4, a6) = (
                sum(&acc[0], &acc[1]),
                sum(&acc[2], &acc[3]),
                sum(&acc[4], &acc[5]),
                sum(&acc[6], &acc[7]),
            );
            let mut v = sum(&sum(&a0, &a2), &sum(&a4, &a6));
            for d in k_lane8..k_lane {
                v[d % lane] = at(d, j).mul_add(x[d], v[d % lane]);
            }
            let mut s = v[0];
            for &l in &v[1..] {
                s += l;
            }
            for d in k_lane..k {
                s = at(d, j).mul_add(x[d], s);
            }
            *o = if add { s + *o } else { s };
        }
    }

    /// `gemm`'s call for the one-row product, as `gemm::flex` makes it.
    fn gemm_call(x: &[f32], w: &[f32], n: usize, columns: bool, out: &mut [f32], add: bool) {
        let k = x.len();
        let (cs, rs) = if columns {
            (k as isize, 1)
        } else {
            (1, n as isize)
        };
        // SAFETY: the vectors' extents.
        unsafe {
            gemm::gemm(
                1,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                add,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                cs,
                rs,
                if add { 1.0 } else { 0.0 },
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }

    /// Both layouts, with and without an output to add to, over shapes with tails of every kind
    /// (`k` not a multiple of 8, 16 or 128, `n` not of 16, fewer than eight rows): the host
    /// reference of `gemm`'s order is `gemm` bit for bit at the width `gemm` picks here, and each
    /// kernel this CPU has is the reference at its width, whole and split into column ranges.
    #[test]
    fn a_row_times_a_matrix_is_gemms_bit_for_bit() {
        if !available() {
            eprintln!("no AVX2 + FMA: the products keep gemm");
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let wide = std::arch::is_x86_feature_detected!("avx512f");
        let mut checked = 0;
        for (k, n) in [
            (768, 2304),
            (20, 37),
            (5, 16),
            (3072, 300),
            (200, 257),
            (3, 700),
            (131, 2),
        ] {
            let x = values(k, 1);
            for columns in [false, true] {
                let w = values(k * n, 2);
                let weight = if columns {
                    Weight::Columns(w.as_ptr(), k)
                } else {
                    Weight::Rows(w.as_ptr(), n)
                };
                for add in [false, true] {
                    let start = if add { values(n, 3) } else { vec![0.0; n] };
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let at = |lane: usize| {
                        let mut out = start.clone();
                        reference(&x, &w, n, columns, lane, &mut out, add);
                        out
                    };
                    if gemm_takes(&weight, k, n, 1) {
                        let mut expected = start.clone();
                        gemm_call(&x, &w, n, columns, &mut expected, add);
                        let lane = if wide { 16 } else { 8 };
                        assert_eq!(
                            bits(&at(lane)),
                            bits(&expected),
                            "reference: {k}×{n}, columns {columns}, add {add}"
                        );
                        checked += 1;
                    }
                    let mut kernels = vec![(8, false)];
                    if wide {
                        kernels.push((16, true));
                    }
                    for (lane, v4) in kernels {
                        let expected = at(lane);
                        for split in [n, n.div_ceil(3).max(1), 16] {
                            let mut out = if add {
                                start.clone()
                            } else {
                                vec![f32::NAN; n]
                            };
                            for c in (0..n).step_by(split) {
                                let cols = c..(c + split).min(n);
                                // SAFETY: AVX2 + FMA (and AVX-512 for `v4`) checked; the
                                // extents are the vectors'.
                                #[cfg(target_arch = "x86_64")]
                                unsafe {
                                    if v4 {
                                        x86::v4(&x, weight, cols, out.as_mut_ptr(), add)
                                    } else {
                                        x86::v3(&x, weight, cols, out.as_mut_ptr(), add)
                                    }
                                }
                            }
                            assert_eq!(
                                bits(&out),
                                bits(&expected),
                                "{lane} lanes: {k}×{n}, columns {columns}, add {add}, split {split}"
                            );
                        }
                    }
                }
            }
        }
        assert!(
            checked >= 16,
            "gemm's matrix–vector paths checked {checked} times"
        );
    }
}
