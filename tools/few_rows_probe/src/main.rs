//! GFLOP/s of `gemm`'s `Parallelism::Rayon(0)` call against single-threaded calls on column
//! ranges (`2 × threads` of them, as `wildfire_kernels::gemm` splits), best of 3, and whether the
//! two give the same bits. Two families of shapes: a prompt's products (`x · W`, the weight
//! row-major or a tied table transposed) and narrow layers' weight gradients (`xᵀ · g`, the left
//! operand transposed in place).

use rayon::prelude::*;
use std::time::Instant;

/// A pointer the pool's tasks share (each writes its own columns).
#[derive(Clone, Copy)]
struct Shared(*mut f32);
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// `[m, k] · [k, n]`: each operand's (column stride, row stride).
struct Product {
    m: usize,
    k: usize,
    n: usize,
    lhs: (isize, isize),
    rhs: (isize, isize),
    label: String,
}

fn values(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * seed) % 1000) as f32 * 1e-3 - 0.5)
        .collect()
}

impl Product {
    /// `dst[:, cols] = lhs · rhs[:, cols]`.
    fn run(
        &self,
        dst: Shared,
        x: &[f32],
        w: &[f32],
        cols: std::ops::Range<usize>,
        par: gemm::Parallelism,
    ) {
        // SAFETY: the strides address `m × k` and `k × n` elements inside `x` and `w`; `dst` has
        // room for `m × n`, row stride `n`.
        unsafe {
            gemm::gemm(
                self.m,
                cols.len(),
                self.k,
                dst.0.add(cols.start),
                1,
                self.n as isize,
                false,
                x.as_ptr(),
                self.lhs.0,
                self.lhs.1,
                w.as_ptr().offset(cols.start as isize * self.rhs.0),
                self.rhs.0,
                self.rhs.1,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                par,
            )
        }
    }

    fn compare(&self) {
        let (m, k, n) = (self.m, self.k, self.n);
        let (x, w) = (values(m * k, 7919), values(k * n, 104_729));
        let (mut whole, mut split) = (vec![0f32; m * n], vec![0f32; m * n]);
        let reps = ((2e9 / (2.0 * (m * n * k) as f64)) as usize).clamp(3, 200);
        let chunks = ((k * n) / 65536)
            .min(2 * rayon::current_num_threads())
            .min(n / 16)
            .max(1);
        let width = n.div_ceil(chunks).next_multiple_of(16);
        let time = |f: &mut dyn FnMut()| {
            let t = Instant::now();
            (0..reps).for_each(|_| f());
            t.elapsed().as_secs_f64() / reps as f64
        };
        let mut best = [f64::MAX; 2];
        for _ in 0..3 {
            let dst = Shared(whole.as_mut_ptr());
            best[0] = best[0].min(time(&mut || {
                self.run(dst, &x, &w, 0..n, gemm::Parallelism::Rayon(0))
            }));
            let dst = Shared(split.as_mut_ptr());
            best[1] = best[1].min(time(&mut || {
                (0..n.div_ceil(width)).into_par_iter().for_each(|c| {
                    let cols = c * width..((c + 1) * width).min(n);
                    self.run(dst, &x, &w, cols, gemm::Parallelism::None)
                })
            }));
        }
        let same = whole
            .iter()
            .zip(&split)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let gflops = |s: f64| 2.0 * (m * n * k) as f64 / s / 1e9;
        println!(
            "| {} | {m} × {k} × {n} | {:.1} | {:.1} | {:.2}× | {same} |",
            self.label,
            gflops(best[0]),
            gflops(best[1]),
            best[0] / best[1]
        );
    }
}

fn main() {
    println!(
        "{} threads; GFLOP/s, best of 3\n",
        rayon::current_num_threads()
    );
    println!("| product | rows × k × n | gemm's split | column ranges | ratio | bitwise |");
    println!("|---|---|---|---|---|---|");
    for m in [16, 32, 64, 128, 256] {
        for (k, n, table) in [
            (768, 2304, false),
            (768, 3072, false),
            (3072, 768, false),
            (768, 768, false),
            (768, 50304, true),
        ] {
            let rhs = if table {
                (k as isize, 1)
            } else {
                (1, n as isize)
            };
            let label = if table { "x · tableᵀ" } else { "x · W" }.to_string();
            Product {
                m,
                k,
                n,
                lhs: (1, k as isize),
                rhs,
                label,
            }
            .compare();
        }
    }
    for m in [64, 128] {
        for k in [1024, 4096, 16384] {
            for n in [128, 384, 512] {
                // `xᵀ` of a row-major `x [k, m]`, read in place.
                let label = "xᵀ · g".to_string();
                Product {
                    m,
                    k,
                    n,
                    lhs: (m as isize, 1),
                    rhs: (1, n as isize),
                    label,
                }
                .compare();
            }
        }
    }
}
