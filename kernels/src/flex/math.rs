//! Vectorisable scalar maths for the native Flex ops, and the dispatch that compiles a loop once
//! per x86 instruction set (AVX-512, AVX2 + FMA, the baseline) and picks one at run time.
//!
//! `f32::exp` and `f32::erf` call libm one element at a time; these are branch-free polynomials
//! that LLVM turns into vector code inside the dispatched loops. Reductions keep [`LANES`]
//! independent partial sums combined in a fixed order, so a result does not depend on which
//! instruction set ran it (LLVM never reorders a plain float sum by itself).

/// Independent accumulators of a reduction (one AVX-512 register of f32).
pub const LANES: usize = 16;

/// `eˣ` within 2 ulp on `[−87.3, 88.7]`, 0 below, `+∞` above (Cephes' `expf`: `x = n·ln 2 + r`,
/// a degree-6 polynomial for `eʳ`, `2ⁿ` from the exponent bits).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.336_54, 88.376_26);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let z = r * r;
    let p = (((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * z
        + r
        + 1.0;
    // SAFETY: `n` is an integer in [−126, 128] (x is clamped), so `n + 127` fits an i32; the
    // unchecked conversion is what vectorises (`as` saturates element by element).
    let biased = unsafe { (n + 127.0).to_int_unchecked::<i32>() };
    let scale = f32::from_bits((biased as u32) << 23);
    let y = p * scale;
    if x < -87.336_54 {
        0.0
    } else if x > 88.376_26 {
        f32::INFINITY
    } else {
        y
    }
}

/// `tanh(x)` as `1 − 2/(e^{2x} + 1)`: ±1 where `e^{2x}` under- or overflows, within a few ulp of
/// 1 elsewhere (the form vectorises like [`exp`]).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * x) + 1.0)
}

/// `erf(x)` within 5e-7: Abramowitz & Stegun 7.1.26 (1.5e-7, the form PyTorch's vectorised CPU
/// `erf` uses) plus the rounding of its f32 evaluation.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    const P: f32 = 0.327_591_1;
    const A1: f32 = 0.254_829_6;
    const A2: f32 = -0.284_496_72;
    const A3: f32 = 1.421_413_8;
    const A4: f32 = -1.453_152_1;
    const A5: f32 = 1.061_405_4;
    let a = x.abs();
    let t = 1.0 / (1.0 + P * a);
    let r = ((((A5 * t + A4) * t + A3) * t + A2) * t + A1) * t;
    let y = 1.0 - r * exp(-a * a);
    y.copysign(x)
}

/// `Σ f(i)` for `i < n` in [`LANES`] interleaved partial sums, combined pairwise.
#[inline(always)]
pub fn lane_sum(n: usize, mut f: impl FnMut(usize) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let body = n / LANES * LANES;
    let mut i = 0;
    while i < body {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(i + l);
        }
        i += LANES;
    }
    for (l, a) in acc.iter_mut().enumerate().take(n - body) {
        *a += f(body + l);
    }
    combine(acc)
}

/// `Σ f(x)` over a slice, in [`LANES`] interleaved partial sums (the same order as [`lane_sum`]);
/// slice chunks instead of indices, so the loop vectorises with no bounds checks.
#[inline(always)]
pub fn lane_sum_map(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += f(v);
    }
    combine(acc)
}

/// `max f(i)` for `i < n` (`−∞` when empty), in lanes.
#[inline(always)]
pub fn lane_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a = a.max(v);
    }
    acc.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// The [`LANES`] partial sums combined pairwise (the order every lane sum here uses).
#[inline(always)]
pub(crate) fn combine(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// Define `fn $name(args) -> ret` whose body is compiled for AVX-512, AVX2 + FMA and the baseline,
/// the best one the CPU offers chosen at each call (a cached feature check). The body is the same
/// code in each, so results agree across machines up to FMA contraction, which Rust never does
/// by itself.
macro_rules! dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma,bmi2")]
                fn v4($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                fn v3($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("bmi2")
                {
                    // SAFETY: the CPU has every feature `v4` is compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has every feature `v3` is compiled for.
                    return unsafe { v3($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use dispatch;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, r) = (exp(x), x.exp());
            worst = worst.max(((a - r) / r).abs());
            x += 0.001_37;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(-1e9), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn erf_is_within_5e7_of_the_f64_reference() {
        let mut x = -6.0f32;
        while x < 6.0 {
            let r = libm_erf(x as f64);
            assert!(
                (erf(x) as f64 - r).abs() < 5e-7,
                "erf({x}) = {} vs {r}",
                erf(x)
            );
            x += 0.000_731;
        }
        assert_eq!(erf(0.0), 0.0);
    }

    /// erf in f64 by its Taylor series (|x| < 3) or continued fraction tail, for the test only.
    fn libm_erf(x: f64) -> f64 {
        let a = x.abs();
        let v = if a < 3.0 {
            let (mut term, mut sum, mut n) = (a, a, 0.0);
            while term.abs() > 1e-17 * sum.abs() {
                n += 1.0;
                term *= -a * a / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc continued fraction (Lentz), ample at |x| ≥ 3.
            let mut f = a;
            for k in (1..60).rev() {
                f = a + (k as f64 / 2.0) / f;
            }
            1.0 - (-a * a).exp() / (f * std::f64::consts::PI.sqrt())
        };
        v.copysign(x)
    }

    #[test]
    fn lane_reductions_cover_every_element() {
        for n in [0, 1, 15, 16, 17, 100] {
            let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
            assert_eq!(lane_sum(n, |i| x[i]), (n * n.saturating_sub(1) / 2) as f32);
            assert_eq!(lane_sum_map(&x, |v| v), lane_sum(n, |i| x[i]));
            let m = lane_max(&x);
            assert_eq!(
                m,
                if n == 0 {
                    f32::NEG_INFINITY
                } else {
                    (n - 1) as f32
                }
            );
        }
    }
}
