//! One row times a matrix, `out = x · W` for a `1 × k` row `x` (a generated token's activations
//! through a projection, or the tied head's `x · tableᵀ`), streaming the weight once at the
//! memory's speed. `gemm`'s own matrix–vector path reached 12 GB/s a thread where PyTorch's
//! reaches 14–15 (GPT-2 124M's weights, 2 threads of an Intel Xeon: `gemm` 16.6 GB/s, these
//! kernels 27, PyTorch 29; `benches/generate.rs` measures what a token costs).
//!
//! Two layouts of `W`, each with its own kernel:
//! - **rows** (`W` row-major `[k, n]`, a linear layer's weight): eight rows at a time, each
//!   output element `s = x₀w₀ⱼ`, `s = fma(xᵣ, wᵣⱼ, s)` for the next seven, `outⱼ += s`; the
//!   rows past the last full eight one `fma` each into `outⱼ`.
//! - **columns** (`W = Aᵀ` with `A` row-major `[n, k]`, a tied table): a dot product per output,
//!   sixteen lane sums (`lane l` takes the elements `c ≡ l mod 16`, an `fma` chain in order; the
//!   `k mod 16` last elements go to lanes `0…` by scalar `fma`), combined by halving (`l + l+8`,
//!   then `+4`, `+2`, `+1`), added to `outⱼ`.
//!
//! Every output element is computed by the same operations in the same order whatever the
//! vector width (AVX-512, or AVX2 + FMA with two registers a sixteen-lane sum) and whatever range
//! of columns a call covers, so the results are the same bit for bit across those machines and
//! across any split of the columns over threads. Without AVX2 + FMA (or off x86-64) there is no
//! kernel here ([`available`] is false) and the caller keeps `gemm`.

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

/// Whether this CPU has a kernel here (AVX2 + FMA on x86-64; checked once).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
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

/// The sixteen lane sums of a dot product combined by halving (the order both vector widths use).
#[inline(always)]
fn combine(mut lanes: [f32; 16]) -> f32 {
    let mut width = 8;
    while width > 0 {
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
        width /= 2;
    }
    lanes[0]
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Range, Weight, combine};
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

    struct Avx512;
    struct Avx2;

    impl Lanes for Avx512 {
        type V = __m512;
        const N: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(a: f32) -> __m512 {
            unsafe { _mm512_set1_ps(a) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
    }

    impl Lanes for Avx2 {
        type V = __m256;
        const N: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(a: f32) -> __m256 {
            unsafe { _mm256_set1_ps(a) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
    }

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
    /// Outputs the columns kernel computes at once (each its own sixteen-lane sum).
    const DOTS: usize = 2;

    #[inline(always)]
    unsafe fn kernel<S: Lanes>(x: &[f32], w: Weight, cols: Range<usize>, out: *mut f32, add: bool) {
        let len = cols.len();
        // SAFETY (all below): the caller's extents; every pointer formed stays inside them.
        unsafe {
            let o = out.add(cols.start);
            match w {
                Weight::Rows(ptr, stride) => {
                    if !add {
                        std::ptr::write_bytes(o, 0, len);
                    }
                    rows::<S>(x, ptr.add(cols.start), stride, len, o)
                }
                Weight::Columns(ptr, stride) => {
                    columns::<S>(x, ptr.add(cols.start * stride), stride, len, o, add)
                }
            }
        }
    }

    /// `o[j] += Σᵢ x[i]·w[i·stride + j]` for `j < len`, eight rows a step.
    #[inline(always)]
    unsafe fn rows<S: Lanes>(x: &[f32], w: *const f32, stride: usize, len: usize, o: *mut f32) {
        let k = x.len();
        let vec_end = len / S::N * S::N;
        let mut i = 0;
        unsafe {
            while i + ROWS <= k {
                let a: [f32; ROWS] = std::array::from_fn(|r| x[i + r]);
                let av: [S::V; ROWS] = std::array::from_fn(|r| S::splat(a[r]));
                let row: [*const f32; ROWS] = std::array::from_fn(|r| w.add((i + r) * stride));
                let mut j = 0;
                while j < vec_end {
                    let mut s = S::mul(av[0], S::load(row[0].add(j)));
                    for r in 1..ROWS {
                        s = S::fma(av[r], S::load(row[r].add(j)), s);
                    }
                    S::store(o.add(j), S::add(S::load(o.add(j)), s));
                    j += S::N;
                }
                for j in vec_end..len {
                    let mut s = a[0] * *row[0].add(j);
                    for r in 1..ROWS {
                        s = a[r].mul_add(*row[r].add(j), s);
                    }
                    *o.add(j) += s;
                }
                i += ROWS;
            }
            for (i, &a) in x.iter().enumerate().skip(i) {
                let (av, row) = (S::splat(a), w.add(i * stride));
                let mut j = 0;
                while j < vec_end {
                    S::store(o.add(j), S::fma(av, S::load(row.add(j)), S::load(o.add(j))));
                    j += S::N;
                }
                for j in vec_end..len {
                    *o.add(j) = a.mul_add(*row.add(j), *o.add(j));
                }
            }
        }
    }

    /// `o[j] (+)= Σᵢ x[i]·w[j·stride + i]` for `j < len`, [`DOTS`] outputs a step.
    #[inline(always)]
    unsafe fn columns<S: Lanes>(
        x: &[f32],
        w: *const f32,
        stride: usize,
        len: usize,
        o: *mut f32,
        add: bool,
    ) {
        let mut j = 0;
        unsafe {
            while j + DOTS <= len {
                let sums = dots::<S, DOTS>(x, std::array::from_fn(|r| w.add((j + r) * stride)));
                for (r, s) in sums.into_iter().enumerate() {
                    let o = o.add(j + r);
                    *o = if add { *o + s } else { s };
                }
                j += DOTS;
            }
            while j < len {
                let [s] = dots::<S, 1>(x, [w.add(j * stride)]);
                let o = o.add(j);
                *o = if add { *o + s } else { s };
                j += 1;
            }
        }
    }

    /// The dot products of `x` with the `R` rows at `row`, each as sixteen lane sums combined
    /// ([`combine`]); with eight-lane registers a sum is two of them.
    #[inline(always)]
    unsafe fn dots<S: Lanes, const R: usize>(x: &[f32], row: [*const f32; R]) -> [f32; R] {
        let k = x.len();
        let full = k / 16 * 16;
        let halves = 16 / S::N;
        unsafe {
            let mut acc = [[S::zero(); 2]; R];
            let mut c = 0;
            while c < full {
                for h in 0..halves {
                    let xv = S::load(x.as_ptr().add(c + h * S::N));
                    for r in 0..R {
                        acc[r][h] = S::fma(xv, S::load(row[r].add(c + h * S::N)), acc[r][h]);
                    }
                }
                c += 16;
            }
            std::array::from_fn(|r| {
                let mut lanes = [0.0f32; 16];
                for h in 0..halves {
                    S::store(lanes.as_mut_ptr().add(h * S::N), acc[r][h]);
                }
                for c in full..k {
                    lanes[c - full] = x[c].mul_add(*row[r].add(c), lanes[c - full]);
                }
                combine(lanes)
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

    /// The definition above on the host, element by element: what both kernels must give bit
    /// for bit.
    fn reference(x: &[f32], w: &[f32], n: usize, columns: bool, out: &mut [f32]) {
        let k = x.len();
        let at = |i: usize, j: usize| if columns { w[j * k + i] } else { w[i * n + j] };
        for (j, o) in out.iter_mut().enumerate() {
            if columns {
                let mut lanes = [0.0f32; 16];
                for (i, &a) in x.iter().enumerate() {
                    let l = if i < k / 16 * 16 {
                        i % 16
                    } else {
                        i - k / 16 * 16
                    };
                    lanes[l] = a.mul_add(at(i, j), lanes[l]);
                }
                *o += combine(lanes);
            } else {
                let mut i = 0;
                while i + 8 <= k {
                    let mut s = x[i] * at(i, j);
                    for r in 1..8 {
                        s = x[i + r].mul_add(at(i + r, j), s);
                    }
                    *o += s;
                    i += 8;
                }
                for (i, &a) in x.iter().enumerate().skip(i) {
                    *o = a.mul_add(at(i, j), *o);
                }
            }
        }
    }

    /// Both layouts, with and without an output to add to, over shapes with tails of every kind
    /// (`k` not a multiple of 8 or 16, `n` not of 16, fewer than eight rows), whole and split
    /// into column ranges: bit for bit the definition, on each vector width this CPU has.
    #[test]
    fn a_row_times_a_matrix_is_the_definition_bit_for_bit() {
        if !available() {
            eprintln!("no AVX2 + FMA: the caller keeps gemm");
            return;
        }
        for (k, n) in [(768, 2304), (20, 37), (5, 16), (3072, 48), (33, 1), (1, 5)] {
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
                    let mut expected = start.clone();
                    reference(&x, &w, n, columns, &mut expected);
                    let mut kernels = vec![("v3", false)];
                    #[cfg(target_arch = "x86_64")]
                    if std::arch::is_x86_feature_detected!("avx512f") {
                        kernels.push(("v4", true));
                    }
                    for (name, wide) in kernels {
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
                                unsafe {
                                    #[cfg(target_arch = "x86_64")]
                                    if wide {
                                        x86::v4(&x, weight, cols, out.as_mut_ptr(), add)
                                    } else {
                                        x86::v3(&x, weight, cols, out.as_mut_ptr(), add)
                                    }
                                }
                            }
                            let same = out
                                .iter()
                                .zip(&expected)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(
                                same,
                                "{name}: {k}×{n}, columns {columns}, add {add}, split {split}"
                            );
                        }
                    }
                }
            }
        }
    }
}
