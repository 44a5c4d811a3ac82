//! The fused operations (`wildfire_kernels::FusedOps`) against references built from Burn's own
//! ops, forward and backward through `Autodiff`: on Flex (its native loops — LayerNorm, GELU,
//! cross-entropy, packed attention, the optimizer tail — and the Burn-op defaults with the
//! written-out backward formulas for the rest) and, with the `wgpu` feature (on in `scripts/test.sh`), the CubeCL kernels
//! on Wgpu over lavapipe.
//!
//! Each check runs the fused op and an independent composition of Burn ops (differentiated by
//! Burn's autodiff) on the same inputs, with a random upstream gradient, and compares the outputs
//! and every input gradient: `max |a − b| ≤ tol · max |b| + 1e-6`, `tol` stated per call.

use burn::backend::Autodiff;
use burn::tensor::activation;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Bool, Distribution, Int, Tensor, TensorData};
use wildfire_kernels::{FusedOps, ops};

fn data<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

fn close_tol(what: &str, got: &[f32], expected: &[f32], tol: f32) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths");
    let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let worst = crate::suite::pairs(got, expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // An absolute floor for outputs near 0 computed from O(1) inputs: 4e-6 in f32 (≈ 32 ulps at
    // 1: CUDA's LayerNorm backward of one-element rows, exactly 0, came out 1.5e-6), one f16 step
    // at 1 (≈ 1e-3) in f16.
    // (bf16: one step at 1 is ≈ 8e-3.)
    let floor = match INPUT_DTYPE.get() {
        Some(burn::tensor::FloatDType::BF16) => 8e-3,
        Some(_) => 1e-3,
        None => 4e-6,
    };
    assert!(
        got.iter().all(|v| v.is_finite()) && worst <= tol * scale + floor,
        "{what}: max |diff| {worst} > {tol} × scale {scale} + {floor}"
    );
}

/// Reads one input's gradient.
type GradOf<'a, B> = dyn Fn(&<B as AutodiffBackend>::Gradients) -> Vec<f32> + 'a;

/// Gradient of `Σ y·w` w.r.t. each input, for a fused and a reference output.
fn grads<B: AutodiffBackend, const D: usize>(
    y: Tensor<B, D>,
    w: &Tensor<B, D>,
    inputs: &[&GradOf<'_, B>],
) -> Vec<Vec<f32>> {
    let g = (y * w.clone()).sum().backward();
    inputs.iter().map(|f| f(&g)).collect()
}

fn grad_of<B: AutodiffBackend, const D: usize>(
    t: &Tensor<B, D>,
) -> impl Fn(&B::Gradients) -> Vec<f32> + '_ {
    move |g| data(t.grad(g).expect("input is tracked"))
}

thread_local! {
    /// The float dtype of the checks' inputs (f32 unless a test asks for f16).
    static INPUT_DTYPE: std::cell::Cell<Option<burn::tensor::FloatDType>> =
        const { std::cell::Cell::new(None) };
}

thread_local! {
    /// The checks' inputs come from a generator seeded the same on every test thread (each test
    /// runs on its own): a failing comparison reproduces with the same numbers.
    static INPUTS: std::cell::RefCell<rand::rngs::StdRng> =
        std::cell::RefCell::new(rand::SeedableRng::seed_from_u64(0x5eed));
}

/// A random tensor in the checks' input dtype.
fn random<B: burn::tensor::backend::Backend, const D: usize>(
    shape: impl Into<burn::tensor::Shape>,
    std: f64,
    device: &B::Device,
) -> Tensor<B, D> {
    let data = INPUTS.with_borrow_mut(|rng| {
        TensorData::random::<f32, _, _>(shape, Distribution::Normal(0.0, std), rng)
    });
    let t: Tensor<B, D> = Tensor::from_data(data, device);
    match INPUT_DTYPE.get() {
        Some(dtype) => t.cast(dtype),
        None => t,
    }
}

fn normal<B: AutodiffBackend, const D: usize>(
    shape: [usize; D],
    std: f64,
    device: &B::Device,
) -> Tensor<B, D> {
    random::<B, D>(shape, std, device).require_grad()
}

/// Compare a fused output and gradients with the reference's.
fn compare<B: AutodiffBackend, const D: usize>(
    what: &str,
    fused: Tensor<B, D>,
    reference: Tensor<B, D>,
    inputs: &[&GradOf<'_, B>],
    tol: f32,
) {
    let w = random::<B, D>(fused.shape(), 1.0, &fused.device());
    if let Some(dtype) = INPUT_DTYPE.get() {
        assert_eq!(fused.dtype(), dtype.into(), "{what} keeps the input dtype");
        assert_eq!(
            reference.dtype(),
            dtype.into(),
            "{what}'s reference keeps the input dtype"
        );
    }
    close_tol(
        &format!("{what} forward"),
        &data(fused.clone()),
        &data(reference.clone()),
        tol,
    );
    let gf = grads(fused, &w, inputs);
    let gr = grads(reference, &w, inputs);
    for (i, (a, b)) in crate::suite::pairs(&gf, &gr).enumerate() {
        close_tol(&format!("{what} gradient of input {i}"), a, b, tol);
    }
}

fn check_softmax<B: AutodiffBackend + FusedOps>(device: &B::Device, shape: [usize; 3], tol: f32) {
    let x = normal::<B, 3>(shape, 3.0, device);
    let gx = grad_of(&x);
    type Form<B> = fn(Tensor<B, 3>) -> Tensor<B, 3>;
    let forms: [(&str, Form<B>, Form<B>); 2] = [
        ("softmax", ops::softmax, |x| activation::softmax(x, 2)),
        ("log_softmax", ops::log_softmax, |x| {
            activation::log_softmax(x, 2)
        }),
    ];
    for (name, fused, reference) in forms {
        compare(
            &format!("{name} {shape:?}"),
            fused(x.clone()),
            reference(x.clone()),
            &[&gx],
            tol,
        );
    }
}

fn check_norms<B: AutodiffBackend + FusedOps>(device: &B::Device, shape: [usize; 3], tol: f32) {
    let eps = 1e-5;
    let x = normal::<B, 3>(shape, 2.0, device).add_scalar(0.5);
    // Over one element a norm's output is flat in x: its input gradient is two O(1/|x|) terms
    // cancelling (γ·ε/(x²+ε)^1.5 ≈ 0), so its rounding error grows as 1/|x| and beat the
    // 1e-6 floor for an input near 0 (1.3e-6 seen in CI). Keep |x| ≥ 1 there.
    let x = if shape[2] == 1 {
        x.abs().add_scalar(1.0)
    } else {
        x
    };
    let x = x.detach().require_grad();
    let gamma = normal::<B, 1>([shape[2]], 1.0, device);
    let beta = normal::<B, 1>([shape[2]], 1.0, device);
    let (gx, gg, gb) = (grad_of(&x), grad_of(&gamma), grad_of(&beta));
    let (var, mean) = x.clone().var_mean_bias(2);
    let reference = (x.clone() - mean) / var.add_scalar(eps).sqrt()
        * gamma.clone().unsqueeze::<3>()
        + beta.clone().unsqueeze::<3>();
    compare(
        &format!("layer_norm {shape:?}"),
        ops::layer_norm(x.clone(), gamma.clone(), beta.clone(), eps),
        reference,
        &[&gx, &gg, &gb],
        tol,
    );
    let ms = x.clone().square().mean_dim(2);
    let reference = x.clone() / ms.add_scalar(eps).sqrt() * gamma.clone().unsqueeze::<3>();
    compare(
        &format!("rms_norm {shape:?}"),
        ops::rms_norm(x.clone(), gamma.clone(), eps),
        reference,
        &[&gx, &gg],
        tol,
    );
}

fn check_gelu<B: AutodiffBackend + FusedOps>(device: &B::Device, shape: [usize; 3], tol: f32) {
    let x = normal::<B, 3>(shape, 2.0, device);
    let bias = normal::<B, 1>([shape[2]], 1.0, device);
    let (gx, gb) = (grad_of(&x), grad_of(&bias));
    // Written out: Burn's `gelu_backward` default (used by its CubeCL backends) differentiates the
    // tanh approximation, not the erf form its forward computes.
    let z = x.clone() + bias.clone().unsqueeze::<3>();
    let reference = z.clone()
        * z.mul_scalar(std::f64::consts::FRAC_1_SQRT_2)
            .erf()
            .add_scalar(1.0)
            .mul_scalar(0.5);
    compare(
        &format!("gelu_bias {shape:?}"),
        ops::gelu_bias(x.clone(), bias.clone(), false),
        reference,
        &[&gx, &gb],
        tol,
    );
    // The tanh approximation (GPT-2's `gelu_new`), written out the same way.
    let z = x.clone() + bias.clone().unsqueeze::<3>();
    let inner = (z.clone() + z.clone().powi_scalar(3).mul_scalar(0.044715))
        .mul_scalar((2.0 / std::f64::consts::PI).sqrt());
    let reference = z * inner.tanh().add_scalar(1.0).mul_scalar(0.5);
    compare(
        &format!("gelu_bias tanh {shape:?}"),
        ops::gelu_bias(x.clone(), bias.clone(), true),
        reference,
        &[&gx, &gb],
        tol,
    );
}

fn check_swiglu<B: AutodiffBackend + FusedOps>(device: &B::Device, shape: [usize; 3], tol: f32) {
    let gate = normal::<B, 3>(shape, 3.0, device);
    let up = normal::<B, 3>(shape, 1.0, device);
    let (gg, gu) = (grad_of(&gate), grad_of(&up));
    compare(
        &format!("swiglu {shape:?}"),
        ops::swiglu(gate.clone(), up.clone()),
        activation::silu(gate.clone()) * up.clone(),
        &[&gg, &gu],
        tol,
    );
}

/// The rotary embedding against rotate-half written with Burn ops; random tables (their two
/// halves differ, unlike real ones), so the gradient checks the general transposed rotation.
fn check_rope<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    [b, h, t, hd]: [usize; 4],
    tol: f32,
) {
    let x = normal::<B, 4>([b, h, t, hd], 1.0, device);
    let [cos, sin] = [0, 1].map(|_| random::<B, 2>([t, hd], 1.0, device));
    let gx = grad_of(&x);
    let half = hd / 2;
    let rotated = Tensor::cat(
        vec![
            x.clone().narrow(3, half, half).neg(),
            x.clone().narrow(3, 0, half),
        ],
        3,
    );
    let reference =
        x.clone() * cos.clone().unsqueeze::<4>() + rotated * sin.clone().unsqueeze::<4>();
    compare(
        &format!("rope {:?}", [b, h, t, hd]),
        ops::rope(x.clone(), cos, sin),
        reference,
        &[&gx],
        tol,
    );
}

/// Targets in `0..vocab`, every 5th row ignored (-100).
fn targets<B: AutodiffBackend>(rows: usize, vocab: usize, device: &B::Device) -> Tensor<B, 1, Int> {
    let t: Vec<i64> = (0..rows)
        .map(|r| {
            if r % 5 == 4 {
                -100
            } else {
                ((r * 7919 + 13) % vocab) as i64
            }
        })
        .collect();
    Tensor::from_data(TensorData::new(t, [rows]), device)
}

fn check_cross_entropy<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    rows: usize,
    vocab: usize,
    tol: f32,
) {
    let logits = normal::<B, 2>([rows, vocab], 3.0, device);
    let t = targets::<B>(rows, vocab, device);
    let gl = grad_of(&logits);
    let kept = t.clone().greater_equal_elem(0);
    let picked = activation::log_softmax(logits.clone(), 1)
        .gather(1, t.clone().clamp_min(0).unsqueeze_dim(1));
    let reference = picked
        .squeeze_dim::<1>(1)
        .neg()
        .mask_fill(kept.bool_not(), 0.0);
    compare(
        &format!("cross_entropy {rows}x{vocab}"),
        ops::cross_entropy(logits.clone(), t),
        reference,
        &[&gl],
        tol,
    );
}

/// The ids of [`check_embedding`]'s cases: `(vocab, d, [batch, seq], ids)`.
fn embedding_cases() -> Vec<(usize, usize, [usize; 2], Vec<i64>)> {
    let ids = |n: usize, f: &dyn Fn(usize) -> usize| (0..n).map(|i| f(i) as i64).collect();
    vec![
        // Repeats in no order.
        (37, 5, [2, 9], ids(18, &|i| (i * 7 + 3) % 11)),
        // Rows wider than a cube, positions over three of the sort's 256-id tiles, runs across
        // tile boundaries, the table's first and last rows.
        (
            1000,
            300,
            [3, 200],
            ids(600, &|i| match i % 50 {
                0 => 0,
                1 => 999,
                _ => (i * 7919) % 97,
            }),
        ),
        // One token at every position: a single run as long as the batch.
        (50, 64, [2, 300], ids(600, &|_| 7)),
        (3, 1, [1, 1], ids(1, &|_| 2)),
    ]
}

/// The embedding lookup ([`ops::embedding`]) and its table gradient against Burn's
/// `module::embedding` on the same backend. The lookup is the same op; in f32 the gradient is
/// Burn's bit for bit where no id occurs more than the kernels' segment (each id's rows added in
/// position order from zero, in f32), and within rounding where one does (the CubeCL kernels
/// sum a longer run in segments, then the segments); in f16 the kernels add in f32 and round
/// once where Burn rounds after every add.
fn check_embedding<B: AutodiffBackend + FusedOps>(device: &B::Device, tol: f32) {
    for (vocab, d, [b, t], ids) in embedding_cases() {
        let longest = (0..vocab as i64)
            .map(|v| ids.iter().filter(|&&i| i == v).count())
            .max()
            .unwrap_or(0);
        let what = format!("embedding {vocab}x{d} at {b}x{t}");
        let table = normal::<B, 2>([vocab, d], 1.0, device);
        let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, t]), device);
        let fused = ops::embedding(table.clone(), idx.clone());
        let reference = burn::tensor::module::embedding(table.clone(), idx);
        assert_eq!(
            data(fused.clone()),
            data(reference.clone()),
            "{what}: the lookup"
        );
        let w = random::<B, 3>([b, t, d], 1.0, device);
        let gt = grad_of(&table);
        let [got] = <[_; 1]>::try_from(grads(fused, &w, &[&gt])).unwrap();
        let [want] = <[_; 1]>::try_from(grads(reference, &w, &[&gt])).unwrap();
        if INPUT_DTYPE.get().is_none() && longest <= wildfire_kernels::EMBEDDING_SEGMENT {
            // The differing elements (at most eight), so that a failure on a GPU says what went
            // wrong: an addend missing or doubled, or the last bit of a sum.
            let differ: Vec<String> = (0..got.len())
                .filter(|&i| got[i].to_bits() != want[i].to_bits())
                .take(8)
                .map(|i| format!("[{}, {}] {:e} vs {:e}", i / d, i % d, got[i], want[i]))
                .collect();
            assert!(
                differ.is_empty(),
                "{what}: the table's gradient, bitwise: {}",
                differ.join("; ")
            );
        } else {
            close_tol(
                &format!("{what}: the table's gradient"),
                &got,
                &want,
                tol.max(1e-5),
            );
        }
    }
}

fn check_attention<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    shape: [usize; 4],
    causal: bool,
    tol: f32,
) {
    let q = normal::<B, 4>(shape, 1.0, device);
    let k = normal::<B, 4>(shape, 1.0, device);
    let v = normal::<B, 4>(shape, 1.0, device);
    let scale = 1.0 / (shape[3] as f64).sqrt();
    let (gq, gk, gv) = (grad_of(&q), grad_of(&k), grad_of(&v));
    let mut scores = q
        .clone()
        .matmul(k.clone().swap_dims(2, 3))
        .mul_scalar(scale);
    if causal {
        let s = shape[2];
        let mask = Tensor::<B, 2, Bool>::tril_mask([s, s], 0, device)
            .unsqueeze::<4>()
            .expand([shape[0], shape[1], s, s]);
        scores = scores.mask_fill(mask, f32::NEG_INFINITY);
    }
    let reference = activation::softmax(scores, 3).matmul(v.clone());
    compare(
        &format!("attention {shape:?} causal {causal}"),
        ops::attention(q.clone(), k.clone(), v.clone(), scale, causal),
        reference,
        &[&gq, &gk, &gv],
        tol,
    );
}

/// Attention on packed projections `[b, t, h, 3·hd]` against the split-and-softmax composition.
fn check_attention_qkv<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    [b, t, h, hd]: [usize; 4],
    causal: bool,
    tol: f32,
) {
    let qkv = normal::<B, 4>([b, t, h, 3 * hd], 1.0, device);
    let gqkv = grad_of(&qkv);
    let scale = 1.0 / (hd as f64).sqrt();
    let split = |i: usize| qkv.clone().narrow(3, i * hd, hd).swap_dims(1, 2);
    let mut scores = split(0).matmul(split(1).swap_dims(2, 3)).mul_scalar(scale);
    if causal {
        let mask = Tensor::<B, 2, Bool>::tril_mask([t, t], 0, device)
            .unsqueeze::<4>()
            .expand([b, h, t, t]);
        scores = scores.mask_fill(mask, f32::NEG_INFINITY);
    }
    let reference = activation::softmax(scores, 3)
        .matmul(split(2))
        .swap_dims(1, 2);
    compare(
        &format!("attention_qkv {:?} causal {causal}", [b, t, h, hd]),
        ops::attention_qkv(qkv.clone(), scale, causal),
        reference,
        &[&gqkv],
        tol,
    );
}

/// Grouped-query attention: `k`, `v` with `kv_heads` heads shared by `h / kv_heads` query heads
/// each, against the reference on key/value heads repeated to `h`.
fn check_attention_gqa<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    [b, h, s, d]: [usize; 4],
    kv_heads: usize,
    tol: f32,
) {
    let q = normal::<B, 4>([b, h, s, d], 1.0, device);
    let k = normal::<B, 4>([b, kv_heads, s, d], 1.0, device);
    let v = normal::<B, 4>([b, kv_heads, s, d], 1.0, device);
    let scale = 1.0 / (d as f64).sqrt();
    let (gq, gk, gv) = (grad_of(&q), grad_of(&k), grad_of(&v));
    let repeat = |t: &Tensor<B, 4>| {
        t.clone()
            .unsqueeze_dim::<5>(2)
            .expand([b, kv_heads, h / kv_heads, s, d])
            .reshape([b, h, s, d])
    };
    let mask = Tensor::<B, 2, Bool>::tril_mask([s, s], 0, device)
        .unsqueeze::<4>()
        .expand([b, h, s, s]);
    let scores = q
        .clone()
        .matmul(repeat(&k).swap_dims(2, 3))
        .mul_scalar(scale)
        .mask_fill(mask, f32::NEG_INFINITY);
    let reference = activation::softmax(scores, 3).matmul(repeat(&v));
    compare(
        &format!(
            "grouped-query attention {:?} kv heads {kv_heads}",
            [b, h, s, d]
        ),
        ops::attention(q.clone(), k.clone(), v.clone(), scale, true),
        reference,
        &[&gq, &gk, &gv],
        tol,
    );
}

/// The tiled flash attention across its edges: sequences of one token, shorter than a tile, a
/// whole tile, past two tiles (130), head dims 32, 64 and 128, causal and not, separate and packed
/// q/k/v; one long sequence (1024: many key blocks, most of them skipped above the diagonal);
/// grouped key/value heads.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn check_attention_tiles<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    seqs: &[usize],
    tol: f32,
) {
    for &d in &[32, 64, 128] {
        for &s in seqs {
            for causal in [true, false] {
                check_attention::<B>(device, [2, 2, s, d], causal, tol);
                check_attention_qkv::<B>(device, [2, s, 2, d], causal, tol);
            }
        }
    }
    check_attention::<B>(device, [1, 1, 1024, 64], true, tol);
    check_attention_gqa::<B>(device, [1, 4, 33, 32], 2, tol);
}

/// Every fused op and its backward on one backend, across shapes with non-powers-of-two, single
/// rows and columns wider than a cube.
fn check_all<B: AutodiffBackend + FusedOps>(device: &B::Device, tol: f32) {
    // [4, 64, 96]: rows in more than one parallel task on Flex (the column sums of γ, β and the
    // bias are added over tasks).
    for shape in [
        [2, 3, 37],
        [1, 1, 1],
        [3, 5, 300],
        [2, 2, 1000],
        [4, 64, 96],
    ] {
        // The one-element row is checked in f32 only: in f16 its outputs are single roundings
        // near 0 (a norm over one element is ε-dominated, 0 in exact arithmetic).
        if INPUT_DTYPE.get().is_some() && shape == [1, 1, 1] {
            continue;
        }
        check_softmax::<B>(device, shape, tol);
        check_norms::<B>(device, shape, tol);
        check_gelu::<B>(device, shape, tol);
        check_swiglu::<B>(device, shape, tol);
    }
    // Rotary embeddings: one token, odd lengths, head dims from 2 to 128, many heads.
    for shape in [[1, 1, 1, 2], [2, 3, 17, 8], [1, 4, 33, 64], [2, 2, 5, 128]] {
        check_rope::<B>(device, shape, tol);
    }
    for (rows, vocab) in [(7, 37), (1, 2), (5, 1000)] {
        check_cross_entropy::<B>(device, rows, vocab, tol);
    }
    check_embedding::<B>(device, tol);
    // Attention on `[batch, heads, seq, head_dim]`, and on the same sizes packed q/k/v laid out
    // `[batch, seq, heads, head_dim]`.
    for ([b, h, s, d], causal) in [
        ([2, 3, 17, 8], true),
        ([1, 2, 1, 16], true),
        ([2, 1, 9, 4], false),
        ([1, 2, 70, 32], true),
    ] {
        check_attention::<B>(device, [b, h, s, d], causal, tol);
        check_attention_qkv::<B>(device, [b, s, h, d], causal, tol);
    }
    // Grouped key/value heads (the Llama family's), two and four query heads to each.
    check_attention_gqa::<B>(device, [2, 4, 9, 8], 2, tol);
    check_attention_gqa::<B>(device, [1, 8, 5, 4], 2, tol);
}

/// The optimizer tail against the formulas computed on the host: unscale + `Σ g²` + non-finite
/// flag, AdamW for a device-resident clip coefficient, and the skipped step (bitwise no-op).
fn check_optimizer_tail<B: burn::tensor::backend::Backend + FusedOps>(
    device: &B::Device,
    tol: f32,
) {
    use wildfire_kernels::AdamWStep;
    let n = 37 * 13;
    let host = |seed: u64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u64 * 2654435761 + seed * 97) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let tensor = |v: &[f32], shape: [usize; 2]| -> Tensor<B, 2> {
        Tensor::from_data(TensorData::new(v.to_vec(), shape), device)
    };
    let prim = |t: Tensor<B, 2>| t.into_primitive().tensor();
    let back = |p| {
        data(Tensor::<B, 2>::from_primitive(
            burn::tensor::TensorPrimitive::Float(p),
        ))
    };
    let back1 = |p| {
        data(Tensor::<B, 1>::from_primitive(
            burn::tensor::TensorPrimitive::Float(p),
        ))
    };
    let g: Vec<f32> = host(1).iter().map(|x| x * 1024.0).collect();
    let out = B::fused_unscale(prim(tensor(&g, [37, 13])), 1.0 / 1024.0);
    let expected: Vec<f32> = g.iter().map(|x| x / 1024.0).collect();
    close_tol("unscaled gradient", &back(out.grad), &expected, tol);
    let sq: f32 = expected.iter().map(|x| x * x).sum();
    close_tol("Σ g²", &back1(out.sum_squares), &[sq], tol);
    assert_eq!(back1(out.non_finite), vec![0.0], "finite gradient flagged");
    for bad in [f32::INFINITY, f32::NAN] {
        let mut g2 = g.clone();
        g2[200] = bad;
        let out = B::fused_unscale(prim(tensor(&g2, [37, 13])), 1.0 / 1024.0);
        assert_eq!(back1(out.non_finite), vec![1.0], "{bad} not flagged");
    }

    let (p, gr, m) = (host(2), host(3), host(4));
    let v: Vec<f32> = host(5).iter().map(|x| x.abs()).collect();
    let step = AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.1,
        step: 3,
    };
    let one = |x: f32| {
        Tensor::<B, 1>::from_data(TensorData::new(vec![x], [1]), device)
            .into_primitive()
            .tensor()
    };
    let operands = |skip: f32| -> [_; 6] {
        [&p, &gr, &m, &v]
            .map(|x| prim(tensor(x, [37, 13])))
            .into_iter()
            .chain([one(0.5), one(skip)])
            .collect::<Vec<_>>()
            .try_into()
            .unwrap()
    };
    let run = |skip: f32| {
        let [param, grad, m, v, scale, skip] = operands(skip);
        B::fused_adamw(param, grad, m, v, scale, skip, step)
    };
    let out = run(0.0);
    let (mut pe, mut me, mut ve) = (vec![], vec![], vec![]);
    for i in 0..n {
        let g = gr[i] as f64 * 0.5;
        let m1 = 0.9 * m[i] as f64 + 0.1 * g;
        let v1 = 0.95 * v[i] as f64 + 0.05 * g * g;
        let (mh, vh) = (m1 / (1.0 - 0.9f64.powi(3)), v1 / (1.0 - 0.95f64.powi(3)));
        pe.push((p[i] as f64 * (1.0 - 1e-3) - 1e-2 * mh / (vh.sqrt() + 1e-8)) as f32);
        me.push(m1 as f32);
        ve.push(v1 as f32);
    }
    close_tol("AdamW parameter", &back(out.param), &pe, tol);
    close_tol("AdamW m", &back(out.m), &me, tol);
    close_tol("AdamW v", &back(out.v), &ve, tol);
    let skipped = run(1.0);
    assert_eq!(back(skipped.param), p, "a skipped step changes nothing");
    assert_eq!(back(skipped.m), m);
    assert_eq!(back(skipped.v), v);
    // With the compute dtype's copy of the new parameter (written by the same kernel on CubeCL
    // backends): the same step, and the copy is the parameter's cast bit for bit, skipped or not
    // (f16: WGSL has no bf16).
    for skip in [0.0, 1.0] {
        let plain = run(skip);
        let (with, copy) =
            B::fused_adamw_with_copy(operands(skip), step, burn::tensor::FloatDType::F16);
        assert_eq!(
            burn::tensor::TensorMetadata::dtype(&copy),
            burn::tensor::DType::F16
        );
        let cast = B::float_cast(plain.param.clone(), burn::tensor::FloatDType::F16);
        assert_eq!(back(with.param), back(plain.param), "skip {skip}: the step");
        assert_eq!(back(copy), back(cast), "skip {skip}: the copy is the cast");
    }
    check_unscale_all::<B>(device, tol);
    check_adamw_many::<B>(device);
}

/// [`FusedOps::fused_adamw_many`] against each entry's own [`FusedOps::fused_adamw`] (or
/// `_with_copy`) bit for bit: entries of several sizes (one element; one past 1,024 cubes of
/// 256, whose units stride), two step numbers, with and without the f16 copy, skipped or not.
fn check_adamw_many<B: burn::tensor::backend::Backend + FusedOps>(device: &B::Device) {
    use wildfire_kernels::{AdamWEntry, AdamWStep};
    let shapes = [[37usize, 13], [1, 1], [600, 500], [5, 7], [64, 3]];
    let host = |n: usize, seed: u64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u64 * 2654435761 + seed * 97) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let prim = |v: Vec<f32>, s: [usize; 2]| {
        Tensor::<B, 2>::from_data(TensorData::new(v, s), device)
            .into_primitive()
            .tensor()
    };
    let one = |x: f32| {
        Tensor::<B, 1>::from_data(TensorData::new(vec![x], [1]), device)
            .into_primitive()
            .tensor()
    };
    let back = |p: burn::tensor::ops::FloatTensor<B>| {
        Tensor::<B, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(p))
            .cast(burn::tensor::FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    let step = |t: u32| AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.1,
        step: t,
    };
    let entry = |k: usize| {
        let s = shapes[k];
        let n = s[0] * s[1];
        let seed = 10 * k as u64;
        let v: Vec<f32> = host(n, seed + 3).iter().map(|x| x.abs()).collect();
        AdamWEntry::<B> {
            operands: [
                prim(host(n, seed), s),
                prim(host(n, seed + 1), s),
                prim(host(n, seed + 2), s),
                prim(v, s),
            ],
            step: step(if k.is_multiple_of(2) { 3 } else { 4 }),
            copy: (k != 1).then_some(burn::tensor::FloatDType::F16),
        }
    };
    for skip in [0.0, 1.0] {
        let many = B::fused_adamw_many((0..shapes.len()).map(entry).collect(), one(0.5), one(skip));
        assert_eq!(many.len(), shapes.len());
        for (k, (got, copy)) in many.into_iter().enumerate() {
            let e = entry(k);
            let [param, grad, m, v] = e.operands;
            let operands = [param, grad, m, v, one(0.5), one(skip)];
            let (want, want_copy) = match e.copy {
                Some(c) => {
                    let (w, copy) = B::fused_adamw_with_copy(operands, e.step, c);
                    (w, Some(copy))
                }
                None => {
                    let [param, grad, m, v, scale, skip] = operands;
                    (B::fused_adamw(param, grad, m, v, scale, skip, e.step), None)
                }
            };
            let what = format!("skip {skip}, entry {k}");
            assert_eq!(back(got.param), back(want.param), "{what}: parameter");
            assert_eq!(back(got.m), back(want.m), "{what}: m");
            assert_eq!(back(got.v), back(want.v), "{what}: v");
            assert_eq!(
                copy.is_some(),
                want_copy.is_some(),
                "{what}: a copy where asked"
            );
            if let (Some(c), Some(w)) = (copy, want_copy) {
                assert_eq!(
                    burn::tensor::TensorMetadata::dtype(&c),
                    burn::tensor::DType::F16
                );
                assert_eq!(back(c), back(w), "{what}: copy");
            }
        }
    }
}

/// [`FusedOps::fused_unscale_all`] over gradients of several sizes (one of a single element, one
/// spanning many cubes, one held by two ranks) against the per-gradient pass combined in order
/// (`reference::unscale_all`): the unscaled gradients bit for bit, `Σ g² / copies` within `tol`
/// of it and of an f64 host sum, the flag 0; then with an infinity in the middle gradient, the
/// flag 1.
fn check_unscale_all<B: burn::tensor::backend::Backend + FusedOps>(device: &B::Device, tol: f32) {
    use burn::tensor::TensorMetadata;
    let shapes = [[37usize, 13], [1, 1], [300, 77]];
    let copies = [1usize, 2, 1];
    let host = |n: usize, seed: u64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u64 * 2654435761 + seed * 97) % 2001) as f32 / 1000.0 - 1.0)
            .map(|x| x * 512.0)
            .collect()
    };
    let values: Vec<Vec<f32>> = shapes
        .iter()
        .enumerate()
        .map(|(k, [r, c])| host(r * c, k as u64 + 7))
        .collect();
    let prims = |values: &[Vec<f32>]| -> Vec<_> {
        values
            .iter()
            .zip(shapes)
            .map(|(v, s)| {
                Tensor::<B, 2>::from_data(TensorData::new(v.clone(), s), device)
                    .into_primitive()
                    .tensor()
            })
            .collect::<Vec<burn::tensor::ops::FloatTensor<B>>>()
    };
    let flat = |p: burn::tensor::ops::FloatTensor<B>| {
        let t = Tensor::<B, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(p));
        data(t.flatten::<1>(0, 1))
    };
    let flat_any = |p: burn::tensor::ops::FloatTensor<B>| match p.shape().num_dims() {
        1 => data(Tensor::<B, 1>::from_primitive(
            burn::tensor::TensorPrimitive::Float(p),
        )),
        _ => flat(p),
    };
    // A loss scale, and none (an inverse of 1: CubeCL backends only read the gradients, and hand
    // them back as they are).
    for inv in [1.0 / 512.0, 1.0] {
        let (got, stats) = B::fused_unscale_all(prims(&values), &copies, inv);
        let (want, want_stats) =
            wildfire_kernels::reference::unscale_all::<B>(prims(&values), &copies, inv);
        for (k, (g, w)) in got.into_iter().zip(want).enumerate() {
            assert_eq!(
                flat_any(g),
                flat_any(w),
                "inv {inv}: gradient {k} unscaled alike"
            );
        }
        let stats = flat_any(stats);
        let want_stats = flat_any(want_stats);
        let host_sum: f64 = values
            .iter()
            .zip(copies)
            .map(|(v, c)| v.iter().map(|x| (*x as f64 * inv).powi(2)).sum::<f64>() / c as f64)
            .sum();
        assert_eq!(stats[0], 0.0, "inv {inv}: finite gradients flagged");
        close_tol("Σ g² / copies", &stats[1..], &want_stats[1..], tol);
        close_tol("Σ g² / copies, f64", &stats[1..], &[host_sum as f32], tol);
        let mut bad = values.clone();
        bad[1][0] = f32::INFINITY;
        let (_, stats) = B::fused_unscale_all(prims(&bad), &copies, inv);
        assert_eq!(
            flat_any(stats)[0],
            1.0,
            "inv {inv}: an infinite gradient flagged"
        );
    }
}

#[test]
fn optimizer_tail_on_flex() {
    check_optimizer_tail::<burn::backend::Flex>(&Default::default(), 1e-5);
}

#[test]
fn fused_ops_on_flex_match_burn_ops_forward_and_backward() {
    // Flex's native loops, the Burn-op defaults and the written-out backward formulas, through
    // the fused autodiff nodes.
    check_all::<Autodiff<burn::backend::Flex>>(&Default::default(), 2e-5);
    check_norms_as::<burn::backend::Flex>(&Default::default());
}

/// The norms with their output in another dtype (`fused_layer_norm_as`, `fused_rms_norm_as`:
/// the precision policy's compute dtype, written by the kernel) give the cast of the plain op's
/// output bit for bit, and its statistics; their backward reading a narrower gradient as it is
/// (`_backward_any`) gives the numbers of widening it first (f16: WGSL has no bf16).
fn check_norms_as<B: burn::tensor::backend::Backend + FusedOps>(device: &B::Device) {
    use burn::tensor::{DType, FloatDType, TensorMetadata};
    let back = |t| {
        let t = Tensor::<B, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(t));
        data(t)
    };
    let back1 = |t| {
        let t = Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(t));
        data(t)
    };
    let cast = |t| B::float_cast(t, FloatDType::F16);
    for shape in [[2, 3, 37], [1, 1, 1], [3, 5, 300]] {
        let input = || random::<B, 3>(shape, 1.0, device).into_primitive().tensor();
        let param = |std| {
            random::<B, 1>([shape[2]], std, device)
                .into_primitive()
                .tensor()
        };
        let (x, gamma, beta) = (input(), param(1.0), param(0.5));
        let plain = B::fused_layer_norm(x.clone(), gamma.clone(), beta.clone(), 1e-5);
        let half = B::fused_layer_norm_as(x.clone(), gamma.clone(), beta, 1e-5, FloatDType::F16);
        assert_eq!(half.output.dtype(), DType::F16, "{shape:?}");
        assert_eq!(
            back(half.output),
            back(cast(plain.output)),
            "layer norm {shape:?}"
        );
        assert_eq!(back(half.mean.clone()), back(plain.mean), "{shape:?}");
        assert_eq!(back(half.rstd.clone()), back(plain.rstd), "{shape:?}");
        // The backward reading an f16 gradient as it is (`_any`): the numbers of widening it
        // first, bit for bit.
        let dy = cast(input());
        let wide = || B::float_cast(dy.clone(), FloatDType::F32);
        let (mean, rstd) = (half.mean, half.rstd);
        let (xg, gg) = (x.clone(), gamma.clone());
        let plain = B::fused_layer_norm_backward(xg, gg, mean.clone(), rstd.clone(), wide());
        let (xg, gg) = (x.clone(), gamma.clone());
        let any = B::fused_layer_norm_backward_any([xg, gg, mean, rstd, dy.clone()]);
        assert_eq!(back(any.x), back(plain.x), "layer norm dx {shape:?}");
        assert_eq!(back1(any.gamma), back1(plain.gamma), "dγ {shape:?}");
        assert_eq!(back1(any.beta), back1(plain.beta), "dβ {shape:?}");
        let plain = B::fused_rms_norm(x.clone(), gamma.clone(), 1e-6);
        let half = B::fused_rms_norm_as(x.clone(), gamma.clone(), 1e-6, FloatDType::F16);
        assert_eq!(back(half.output), back(cast(plain.output)), "rms {shape:?}");
        assert_eq!(back(half.rstd), back(plain.rstd.clone()), "rms {shape:?}");
        let (xg, gg, r) = (x.clone(), gamma.clone(), plain.rstd.clone());
        let (dx, dg) = B::fused_rms_norm_backward(xg, gg, r, wide());
        let (ax, ag) = B::fused_rms_norm_backward_any([x, gamma, plain.rstd, dy]);
        assert_eq!(back(ax), back(dx), "rms dx {shape:?}");
        assert_eq!(back1(ag), back1(dg), "rms dγ {shape:?}");
    }
}

/// The causal softmax of the attention core: Flex's native row loop against the Burn-op form
/// (square and shifted masks), and under `Distributed<Flex>` on 2 ranks with the scores split
/// by heads (stays local) or by query rows (gathered first: the mask needs the positions),
/// equal to one device bitwise.
#[test]
fn causal_softmax_native_on_flex_and_under_distributed() {
    use wildfire::parallel::{DTensor, DeviceMesh, Layout, Placement, launch_ranks};
    type F = burn::backend::Flex;
    let device = Default::default();
    let prim = |x: Tensor<F, 4>| x.into_primitive().tensor();
    for shape in [[2, 4, 16, 16], [1, 2, 6, 10]] {
        let x = Tensor::<F, 4>::random(shape, Distribution::Normal(0.0, 3.0), &device);
        let native = data(Tensor::<F, 4>::from_primitive(
            burn::tensor::TensorPrimitive::Float(F::fused_causal_softmax(prim(x.clone()))),
        ));
        let reference = data(Tensor::<F, 4>::from_primitive(
            burn::tensor::TensorPrimitive::Float(wildfire_kernels::reference::causal_softmax::<F>(
                prim(x.clone()),
            )),
        ));
        close_tol("causal softmax", &native, &reference, 1e-6);
        let mesh = DeviceMesh::new([("tp", 2)]).unwrap();
        for split in [Placement::Shard(1), Placement::Shard(2)] {
            let x0 = x.to_data();
            let got = launch_ranks::<F, _, _>(&mesh, &device, &Default::default(), |d| {
                let t = Tensor::<F, 4>::from_data(x0.clone(), &Default::default());
                let dt = DTensor::from_full(prim(t), &Layout::new([split]), &d).unwrap();
                let y = <wildfire::parallel::Distributed<F> as FusedOps>::fused_causal_softmax(dt);
                data(Tensor::<F, 4>::from_primitive(
                    burn::tensor::TensorPrimitive::Float(y.full().unwrap()),
                ))
            })
            .unwrap();
            for rank in got {
                assert_eq!(rank, native, "{shape:?} split {split:?}");
            }
        }
    }
}

/// The SwiGLU gate and the rotary embedding under `Distributed<Flex>` on 2 ranks, forward and
/// backward, equal to one device bitwise: SwiGLU with both operands split by columns (a
/// column-parallel gate/up pair: stays local) and with `up` replicated (brought to `gate`'s
/// layout); the rotary embedding split by heads (stays local) and by positions (gathered first:
/// the tables are per position).
#[test]
fn swiglu_and_rope_under_distributed_equal_one_device() {
    use burn::tensor::TensorPrimitive;
    use wildfire::parallel::{DTensor, DeviceMesh, Distributed, Layout, Placement, launch_ranks};
    type F = burn::backend::Flex;
    type D = Distributed<F>;
    let device = Default::default();
    let prim = |x: Tensor<F, 4>| x.into_primitive().tensor();
    let back = |x| data(Tensor::<F, 4>::from_primitive(TensorPrimitive::Float(x)));
    let normal =
        |shape: [usize; 4]| Tensor::<F, 4>::random(shape, Distribution::Normal(0.0, 2.0), &device);
    let [gate, up, x, dy] = [[2, 3, 4, 8], [2, 3, 4, 8], [2, 4, 6, 8], [2, 4, 6, 8]].map(normal);
    let [cos, sin] = [0, 1].map(|_| normal([1, 1, 6, 8]).reshape([6, 8]));
    let tables = |t: &Tensor<F, 2>| t.clone().into_primitive().tensor();
    let one = [
        back(F::fused_swiglu(prim(gate.clone()), prim(up.clone()))),
        back(
            F::fused_swiglu_backward(
                prim(gate.clone()),
                prim(up.clone()),
                prim(dy.clone().narrow(1, 0, 3).narrow(2, 0, 4)),
            )
            .0,
        ),
        back(F::fused_rope(prim(x.clone()), tables(&cos), tables(&sin))),
        back(F::fused_rope_backward(
            prim(dy.clone()),
            tables(&cos),
            tables(&sin),
        )),
    ];
    let mesh = DeviceMesh::new([("tp", 2)]).unwrap();
    let host = [&gate, &up, &x, &dy].map(|t| t.to_data());
    let host_tables = [&cos, &sin].map(|t| t.to_data());
    let cases = [
        (
            Placement::Shard(3),
            Placement::Shard(3),
            Placement::Shard(1),
        ),
        (
            Placement::Shard(3),
            Placement::Replicate,
            Placement::Shard(2),
        ),
    ];
    for (gate_split, up_split, x_split) in cases {
        let got = launch_ranks::<F, _, _>(&mesh, &device, &Default::default(), |d| {
            let dt = |data: &TensorData, split| {
                let t = Tensor::<F, 4>::from_data(data.clone(), &Default::default());
                DTensor::from_full(prim(t), &Layout::new([split]), &d).unwrap()
            };
            let table = |data: &TensorData| {
                let t = Tensor::<F, 2>::from_data(data.clone(), &Default::default());
                DTensor::from_full(
                    t.into_primitive().tensor(),
                    &Layout::new([Placement::Replicate]),
                    &d,
                )
                .unwrap()
            };
            let [g, u] = [(&host[0], gate_split), (&host[1], up_split)].map(|(h, p)| dt(h, p));
            let dy_small = Tensor::<F, 4>::from_data(host[3].clone(), &Default::default())
                .narrow(1, 0, 3)
                .narrow(2, 0, 4)
                .into_data();
            let full = |t: DTensor<F>| back(t.full().unwrap());
            let (c, s) = (table(&host_tables[0]), table(&host_tables[1]));
            [
                full(D::fused_swiglu(g.clone(), u.clone())),
                full(D::fused_swiglu_backward(g, u, dt(&dy_small, Placement::Replicate)).0),
                full(D::fused_rope(dt(&host[2], x_split), c.clone(), s.clone())),
                full(D::fused_rope_backward(dt(&host[3], x_split), c, s)),
            ]
        })
        .unwrap();
        for rank in got {
            for (i, (got, want)) in crate::suite::pairs(&rank, &one).enumerate() {
                assert_eq!(
                    got, want,
                    "output {i}, splits {gate_split:?} {up_split:?} {x_split:?}"
                );
            }
        }
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    use burn::backend::Wgpu;
    use burn::tensor::{DType, FloatDType};
    use wildfire_kernels::cube;

    type W = Autodiff<Wgpu>;

    /// Which backends compute on the rank's rayon pool (so the pretraining loop keeps its
    /// workers looking for work): Flex, under every wrapper; not Wgpu (nor, by the same
    /// implementation, CUDA), with or without fusion.
    #[test]
    fn only_the_cpu_backend_computes_on_the_host_pool() {
        use wildfire_parallel::Distributed;
        let answers = [
            <burn::backend::Flex as FusedOps>::COMPUTES_ON_HOST_POOL,
            <Autodiff<Distributed<burn::backend::Flex>> as FusedOps>::COMPUTES_ON_HOST_POOL,
            <Wgpu as FusedOps>::COMPUTES_ON_HOST_POOL,
            <Autodiff<Distributed<Wgpu>> as FusedOps>::COMPUTES_ON_HOST_POOL,
        ];
        assert_eq!(answers, [true, true, false, false]);
    }

    #[test]
    fn kernels_match_burn_ops_forward_and_backward() {
        // f32; the kernels accumulate in f32 in another order than Burn's reductions.
        let device = Default::default();
        // With the `fusion` feature (CI runs this test both ways), `Wgpu` is Burn's
        // `Fusion<CubeBackend<…>>` and the kernels run as custom ops of the fusion stream.
        let name = <Wgpu as burn::tensor::backend::Backend>::name(&device);
        assert_eq!(
            name.contains("fusion"),
            cfg!(feature = "fusion"),
            "backend {name}"
        );
        let before = cube::launches();
        check_all::<W>(&device, 1e-4);
        assert!(cube::launches() > before, "the CubeCL kernels ran");
    }

    /// The 8-bit state kernels (`i32` codes: WGSL has no 8-bit integers) give Flex's host
    /// loops' numbers (`u8` codes) bit for bit on [`BLOCKWISE`], both maps: block maxima (the
    /// blocks the piece does not touch 0), codes, the skip flag read on the device, the
    /// dequantised values. (With `fusion` the ops are the Burn-op forms: the same numbers.)
    #[test]
    fn blockwise_quantisation_kernels_are_the_host_loops() {
        use burn::tensor::IntDType;
        blockwise_kernels_are_the_host_loops::<Wgpu>(&Default::default(), IntDType::I32, "Wgpu");
    }

    /// `[n]` ones on the default device, as a primitive.
    fn ones(n: usize) -> burn::tensor::ops::FloatTensor<Wgpu> {
        Tensor::<Wgpu, 1>::ones([n], &Default::default())
            .into_primitive()
            .tensor()
    }

    /// The step's unscale over every gradient: the gradients a launch at a time as many as the
    /// device binds (all three here, lavapipe binding dozens of buffers), and one fold, with the
    /// exact sum of an all-ones case.
    #[test]
    fn unscale_all_is_one_launch_per_chunk_of_gradients_and_one() {
        // Launches for three gradients: chunks of the device's count, then the fold.
        #[cfg(not(feature = "fusion"))]
        let launches = |write: bool| {
            let per = cube::gradients_per_unscale_launch(&ones(1), write);
            assert!(
                per >= 3,
                "lavapipe binds three gradients and their outputs: {per}"
            );
            3usize.div_ceil(per) as u64 + 1
        };
        #[cfg(feature = "fusion")]
        let launches = |_: bool| 0u64;
        let before = cube::thread_launches();
        let (_, stats) = <Wgpu as FusedOps>::fused_unscale_all(
            vec![ones(10), ones(5000), ones(1)],
            &[1, 1, 2],
            0.5,
        );
        assert!(
            cfg!(feature = "fusion") || cube::thread_launches() - before == launches(true),
            "one unscale launch for the three gradients, and the fold"
        );
        let stats = data(Tensor::<Wgpu, 1>::from_primitive(
            burn::tensor::TensorPrimitive::Float(stats),
        ));
        assert_eq!(stats, vec![0.0, 0.25 * 5010.0 + 0.25 / 2.0]);
        // Without a loss scale the kernels only read: the same launches, the gradients handed
        // back are the inputs' buffers, and no gradient-sized buffer is allocated.
        let grads = vec![ones(10), ones(5000), ones(1)];
        #[cfg(not(feature = "fusion"))]
        let kept: Vec<_> = grads.iter().map(|g| g.handle.clone()).collect();
        let before = cube::thread_launches();
        let (_out, stats) = <Wgpu as FusedOps>::fused_unscale_all(grads, &[1, 1, 2], 1.0);
        assert!(
            cfg!(feature = "fusion") || cube::thread_launches() - before == launches(false),
            "one reading launch and the fold"
        );
        // Each output shares its buffer with the input's handle kept above (a fresh output
        // would be its buffer's only holder).
        #[cfg(not(feature = "fusion"))]
        for (k, o) in _out.iter().enumerate() {
            assert!(
                !o.handle.memory.can_mut(),
                "gradient {k} is its input's buffer"
            );
            assert_eq!(o.handle.size(), kept[k].size(), "gradient {k}");
        }
        let stats = data(Tensor::<Wgpu, 1>::from_primitive(
            burn::tensor::TensorPrimitive::Float(stats),
        ));
        assert_eq!(stats, vec![0.0, 5010.0 + 0.5]);
    }

    /// The table gradient's kernels: the table's zeros, the sort of the positions by id, the
    /// segments' sums and the long runs' sums, four launches whatever the batch; the table is
    /// contiguous (written at `id · cols`: CubeCL's pitched layout, which CUDA gives Burn's
    /// `float_zeros` where a row's bytes are not a multiple of its alignment, would put rows
    /// elsewhere).
    #[test]
    fn embedding_backward_is_four_launches() {
        let device = Default::default();
        // Runs of up to 12 positions, and one run of 600 (19 segments, then their sum).
        for case in [1, 2] {
            let (vocab, d, [b, t], ids) = embedding_cases().swap_remove(case);
            let grad = Tensor::<Wgpu, 3>::ones([b, t, d], &device);
            let table = Tensor::<Wgpu, 2>::zeros([vocab, d], &device);
            let idx =
                Tensor::<Wgpu, 2, Int>::from_data(TensorData::new(ids.clone(), [b, t]), &device);
            let before = cube::thread_launches();
            let dtable = <Wgpu as FusedOps>::fused_embedding_backward(
                table.into_primitive().tensor(),
                grad.into_primitive().tensor(),
                idx.into_primitive(),
            );
            let got = data(Tensor::<Wgpu, 2>::from_primitive(
                burn::tensor::TensorPrimitive::Float(dtable),
            ));
            assert!(
                cfg!(feature = "fusion") || cube::thread_launches() - before == 4,
                "the zeros, the sort, the segments and the long runs"
            );
            // All-ones rows: each row of the table counts its id's positions (exact in f32).
            for (row, chunk) in got.chunks(d).enumerate() {
                let count = ids.iter().filter(|&&i| i == row as i64).count() as f32;
                assert!(chunk.iter().all(|&x| x == count), "case {case}, row {row}");
            }
        }
    }

    /// A linear layer's bias gradient (`Σ g` over every dimension but the last) on a CubeCL
    /// backend: the f32 chunk sums and the pass adding them, two launches, written in the dtype
    /// asked for (f32 from f16 gradients: the master weights' under a compute dtype), against
    /// f64 sums on the host of the same values; rows not a multiple of the chunks, more chunks
    /// than the finishing cube's rows, columns not a multiple of its width or of a vector.
    #[test]
    fn bias_gradients_are_two_launches_of_f32_column_sums() {
        use wildfire_kernels::gemm::linear_bias_backward_into;
        let device = Default::default();
        let cases: [(&[usize], DType); 7] = [
            (&[1, 1], DType::F32),
            (&[37, 5], DType::F32),
            (&[3, 70, 96], DType::F32),
            (&[2, 1030, 24], DType::F32),
            (&[4096, 40], DType::F32),
            (&[2, 1030, 24], DType::F16),
            (&[65, 1000], DType::F16),
        ];
        for (shape, dtype) in cases {
            let n: usize = shape.iter().product();
            let cols = shape[shape.len() - 1];
            let host: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
                .map(|x| burn::tensor::f16::from_f32(x).to_f32())
                .collect();
            let g = Tensor::<Wgpu, 1>::from_data(TensorData::new(host.clone(), [n]), &device)
                .cast(FloatDType::from(dtype))
                .into_primitive()
                .tensor();
            let g = <Wgpu as burn::tensor::ops::FloatTensorOps<Wgpu>>::float_reshape(
                g,
                burn::tensor::Shape::from(shape.to_vec()),
            );
            for out in [Some(FloatDType::F32), None] {
                let before = cube::thread_launches();
                let got = linear_bias_backward_into::<Wgpu>(g.clone(), out);
                let launches = cube::thread_launches() - before;
                assert!(
                    cfg!(feature = "fusion") || launches == 2,
                    "{shape:?} {dtype:?}: {launches} launches"
                );
                use burn::tensor::TensorMetadata;
                // Under `fusion` the tensors are not CubeCL's: Burn's sum, in the input's dtype.
                let want_dtype = match out {
                    Some(o) if !cfg!(feature = "fusion") => o.into(),
                    _ => dtype,
                };
                assert_eq!(got.dtype(), want_dtype, "{shape:?} {out:?}");
                let got = data(Tensor::<Wgpu, 1>::from_primitive(
                    burn::tensor::TensorPrimitive::Float(got),
                ));
                assert_eq!(got.len(), cols, "{shape:?}");
                // f16 results: one rounding of the f32 sum (2⁻¹¹ relative).
                let tol = if want_dtype == DType::F16 { 1e-3 } else { 1e-5 };
                for (c, &g) in got.iter().enumerate() {
                    let column = host.iter().skip(c).step_by(cols).map(|&x| x as f64);
                    let (sum, abs) = column.fold((0.0, 0.0), |(s, a), x| (s + x, a + x.abs()));
                    assert!(
                        (g as f64 - sum).abs() <= tol * abs.max(1.0),
                        "{shape:?} {dtype:?} {out:?} column {c}: {g} vs {sum}"
                    );
                }
            }
        }
    }

    /// An f32 tensor plus an f16 one of its shape (a residual stream and a 16-bit branch): one
    /// launch, bit for bit the cast and the add, either operand first; and through the
    /// decorator's `float_add`, the same sum without a cast.
    #[test]
    fn a_wide_plus_a_narrow_tensor_is_one_launch_of_the_cast_and_the_add() {
        use wildfire_kernels::gemm::add_widened;
        let device = Default::default();
        for shape in [[2usize, 37], [3, 8 * 96], [1, 1]] {
            let n = shape[0] * shape[1];
            let a = random::<Wgpu, 2>(shape, 1.0, &device);
            let b = random::<Wgpu, 2>(shape, 2.0, &device).cast(FloatDType::F16);
            let want = data(a.clone() + b.clone().cast(FloatDType::F32));
            for swap in [false, true] {
                let (x, y) = (
                    a.clone().into_primitive().tensor(),
                    b.clone().into_primitive().tensor(),
                );
                let (x, y) = if swap { (y, x) } else { (x, y) };
                let before = cube::thread_launches();
                let got = add_widened::<Wgpu>(x, y);
                let launches = cube::thread_launches() - before;
                let got = match got {
                    Ok(got) => got,
                    // `Fusion<…>` tensors are not CubeCL's: the caller's cast and add.
                    Err(_) if cfg!(feature = "fusion") => continue,
                    Err(_) => panic!("{shape:?}: the kernel did not take the pair"),
                };
                assert_eq!(launches, 1, "{shape:?}");
                let got = data(Tensor::<Wgpu, 2>::from_primitive(
                    burn::tensor::TensorPrimitive::Float(got),
                ));
                assert_eq!(got.len(), n);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{shape:?} swap {swap}: not the cast and the add bit for bit"
                );
            }
        }
        // Operands it does not take come back unchanged: two f32, or shapes that broadcast.
        let a = random::<Wgpu, 2>([2, 3], 1.0, &device)
            .into_primitive()
            .tensor();
        let b = random::<Wgpu, 2>([1, 3], 1.0, &device).cast(FloatDType::F16);
        assert!(add_widened::<Wgpu>(a.clone(), a.clone()).is_err());
        assert!(add_widened::<Wgpu>(a, b.into_primitive().tensor()).is_err());
    }

    #[test]
    fn norms_write_the_compute_dtype() {
        check_norms_as::<Wgpu>(&Default::default());
    }

    /// The multi-tensor AdamW: a launch per run of parameters with one step and copy dtype, as
    /// many per launch as the device binds (lavapipe: at least two).
    #[test]
    fn adamw_many_is_a_launch_per_chunk_of_parameters() {
        use wildfire_kernels::{AdamWEntry, AdamWStep};
        let step = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            epsilon: 1e-8,
            weight_decay: 0.0,
            step: 1,
        };
        let entries = |n: usize| -> Vec<AdamWEntry<Wgpu>> {
            (0..n)
                .map(|k| AdamWEntry {
                    operands: [ones(10 + k), ones(10 + k), ones(10 + k), ones(10 + k)],
                    step,
                    copy: None,
                })
                .collect()
        };
        let per = <Wgpu as FusedOps>::adamw_batch(&ones(1));
        assert!(
            cfg!(feature = "fusion") || per >= 2,
            "lavapipe binds two parameters: {per}"
        );
        let n = 2 * per + 1;
        let before = cube::thread_launches();
        let zero = Tensor::<Wgpu, 1>::zeros([1], &Default::default())
            .into_primitive()
            .tensor();
        let out = <Wgpu as FusedOps>::fused_adamw_many(entries(n), ones(1), zero);
        assert_eq!(out.len(), n);
        assert!(
            cfg!(feature = "fusion") || cube::thread_launches() - before == 3,
            "{n} parameters in three launches"
        );
        // p − lr·m̂/(√v̂ + ε) with g = m = v = 1 at step 1: m₁ = v₁ = 1, m̂ = 1/0.1, v̂ = 1/0.05.
        let p = data(Tensor::<Wgpu, 1>::from_primitive(
            burn::tensor::TensorPrimitive::Float(out[n - 1].0.param.clone()),
        ));
        let want = (1.0 - 1e-2 * 10.0 / (20f64.sqrt() + 1e-8)) as f32;
        assert_eq!(p.len(), 10 + n - 1);
        assert!(
            p.iter().all(|&x| (x - want).abs() < 1e-6),
            "{p:?} against {want}"
        );
    }

    /// A small GPT trained on Wgpu through the fused tail with the multi-tensor AdamW (its steps
    /// queued, the parameters and moments — and under an f16 compute dtype the weights' f16
    /// copies — handed back deferred, the queue run a launch per chunk) and with a launch per
    /// parameter: the same losses and parameters bit for bit over three steps (one of three
    /// micro-batches), in f32 and f16, and the launches fewer by the count the chunks imply.
    #[test]
    fn multi_tensor_adamw_trains_as_a_launch_per_parameter() {
        use burn::module::{Module, ModuleVisitor, Param};
        use wildfire::engine::{FusedAdamW, FusedAdamWConfig, StepRunner, StepRunnerConfig};
        use wildfire::models::CausalLm;
        use wildfire::models::gpt::Gpt;
        use wildfire::parallel::{DeviceMesh, Distributed, launch_ranks};
        type D = burn::backend::Autodiff<Distributed<Wgpu>>;
        struct Values(Vec<Vec<f32>>);
        impl ModuleVisitor<D> for Values {
            fn visit_float<const N: usize>(&mut self, param: &Param<Tensor<D, N>>) {
                let v = param.val().into_data().convert::<f32>().to_vec().unwrap();
                self.0.push(v);
            }
        }
        let mesh = DeviceMesh::new([("dp", 1)]).unwrap();
        let run = |multi_tensor: bool, compute: Option<FloatDType>| {
            launch_ranks::<Wgpu, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
                device
                    .context()
                    .update_policy(|p| p.compute_dtype = compute);
                let (adamw, inputs) = FusedAdamW::<Wgpu>::optimizer::<Gpt<D>>(FusedAdamWConfig {
                    multi_tensor,
                    ..FusedAdamWConfig::default()
                });
                let mut optim = adamw;
                let mut model: Gpt<D> = crate::suite::small_gpt(2, 5).init(&device).unwrap();
                let ids = |shift: usize| {
                    let v: Vec<i64> = (0..2 * 16)
                        .map(|i| ((i * 13 + shift) % 64) as i64)
                        .collect();
                    Tensor::<D, 2, Int>::from_data(TensorData::new(v, [2, 16]), &device)
                };
                let config = StepRunnerConfig {
                    clip: Some(0.5),
                    ..StepRunnerConfig::default()
                };
                let mut step = StepRunner::new(config, None);
                let (mut losses, before) = (Vec::new(), cube::thread_launches());
                for seeds in [&[1u64][..], &[1, 2, 3], &[4]] {
                    let (stepped, record) = step
                        .run(
                            &device,
                            model,
                            &mut optim,
                            Some(&inputs),
                            1e-2,
                            seeds,
                            |m, i, h| m.loss_with(ids(i), ids(i + 1), h),
                        )
                        .unwrap();
                    model = stepped;
                    losses.push(record.loss);
                }
                let launches = cube::thread_launches() - before;
                let casts = device.context().counters().cast_total();
                let mut values = Values(Vec::new());
                model.visit(&mut values);
                (losses, values.0, launches, casts)
            })
            .unwrap()
            .pop()
            .unwrap()
        };
        // Under an f16 compute dtype each step also writes the weights' f16 copies (deferred
        // with them) for the next forward.
        for compute in [None, Some(FloatDType::F16)] {
            let (batched, single) = (run(true, compute), run(false, compute));
            assert_eq!(batched.0, single.0, "{compute:?}: the losses");
            assert_eq!(batched.1.len(), single.1.len());
            for (k, (b, s)) in batched.1.iter().zip(&single.1).enumerate() {
                assert_eq!(b, s, "{compute:?}: parameter {k}");
            }
            // The copies the queued steps wrote were taken by the next forwards (a weight cast
            // again would count).
            assert_eq!(batched.3, single.3, "{compute:?}: the casts");
            assert!(compute.is_none() || batched.3 > 0);
            if compute.is_some() {
                continue;
            }
            // Each step: a launch per parameter, against one per `adamw_batch` of them (the queue
            // runs each time it holds that many; every other launch of the step is the same).
            let params = batched.1.len() as u64;
            let one = Tensor::<Wgpu, 1>::ones([1], &Default::default())
                .into_primitive()
                .tensor();
            let per = <Wgpu as FusedOps>::adamw_batch(&one) as u64;
            assert!(
                cfg!(feature = "fusion")
                    || single.2 - batched.2 == 3 * (params - params.div_ceil(per)),
                "launches: {} batched against {} a parameter at a time ({params} parameters, {per} a launch)",
                batched.2,
                single.2
            );
        }
    }

    #[test]
    fn optimizer_tail_kernels() {
        let before = cube::launches();
        check_optimizer_tail::<Wgpu>(&Default::default(), 1e-5);
        assert!(cube::launches() > before, "the CubeCL kernels ran");
    }

    #[test]
    fn cross_entropy_over_a_gpt2_vocabulary() {
        // 50,304 logits per row: many units per row, the row far wider than a cube.
        let device = Default::default();
        check_cross_entropy::<W>(&device, 6, 50_304, 1e-4);
    }

    /// Every fused kernel in f16 against the same computation written with Burn ops in f16 on
    /// the same backend, forward and every input gradient (the f32 checks' shapes and
    /// references, inputs cast to f16). Tolerance 3e-2 of the output's scale: f16 keeps 11
    /// significant bits (2⁻¹¹ ≈ 4.9e-4 per rounding), the kernels round once from f32 while the
    /// Burn-op references round after every op, and a 1000-wide row's sums in f16 collect some
    /// tens of roundings; the `[1, 1, 1]` norms' near-zero gradients differ by one f16 step at
    /// 1e-2 (measured: 1e-3 fails on softmax's gradient, 1e-2 on that one-element row).
    #[test]
    fn kernels_in_f16_match_burn_ops_in_f16_forward_and_backward() {
        let device = Default::default();
        assert!(
            <Wgpu as burn::tensor::backend::Backend>::supports_dtype(&device, DType::F16),
            "the Wgpu device has no f16 (lavapipe has): this test must run in f16"
        );
        INPUT_DTYPE.set(Some(FloatDType::F16));
        let result = std::panic::catch_unwind(|| check_all::<Autodiff<Wgpu>>(&device, 3e-2));
        INPUT_DTYPE.set(None);
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }

    /// The tiled flash attention (the cube-wide tile products without tensor cores: lavapipe has
    /// none) against Burn ops, forward and every input gradient, in f32 and f16 (f16 inputs
    /// against the same composition in f16: tolerance as for the other f16 kernels).
    #[test]
    fn tiled_attention_matches_burn_ops_f32_and_f16() {
        let device = Default::default();
        check_attention_tiles::<W>(&device, &[1, 17, 64, 130], 1e-4);
        INPUT_DTYPE.set(Some(FloatDType::F16));
        let result = std::panic::catch_unwind(|| {
            check_attention_tiles::<W>(&device, &[17, 130], 3e-2);
        });
        INPUT_DTYPE.set(None);
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }

    /// The register-fragment attention (FlashAttention-2's data flow on `mma.m16n8k16`
    /// fragments: the kernels CUDA runs for f16 and bf16) with its `mma` emulated, against Burn
    /// ops in f16, forward and every input gradient: head dims 32, 64 and 128, causal and not,
    /// one key block and many (17, 77, 130 and 1,024 tokens), separate and packed q/k/v, grouped
    /// key/value heads; the dK/dV pass with its K and V operands held in registers (the
    /// default up to head dim 96) and reread from shared memory at each product (above: 128
    /// here, and 64 under `with_kv_reread`). Tolerance as for the other f16 kernels. (lavapipe
    /// takes ≈ 25 s to compile each kernel: one configuration per head dim and mask here.)
    #[test]
    #[cfg(not(feature = "fusion"))]
    fn register_attention_emulated_matches_burn_ops_in_f16() {
        let device = Default::default();
        INPUT_DTYPE.set(Some(FloatDType::F16));
        let before = cube::register_attention_launches();
        let result = std::panic::catch_unwind(|| {
            cube::with_emulated_mma(|| {
                check_attention::<W>(&device, [2, 2, 17, 32], false, 3e-2);
                check_attention_gqa::<W>(&device, [1, 4, 33, 32], 2, 3e-2);
                check_attention_qkv::<W>(&device, [2, 130, 2, 64], true, 3e-2);
                check_attention::<W>(&device, [1, 1, 1024, 64], true, 3e-2);
                check_attention::<W>(&device, [1, 2, 77, 128], true, 3e-2);
                // the reread dK/dV pass at head dim 64 (the other passes' kernels as above)
                cube::with_kv_reread(true, || {
                    check_attention::<W>(&device, [1, 1, 130, 64], true, 3e-2);
                });
            })
        });
        INPUT_DTYPE.set(None);
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
        // Six calls, each a forward and two backward passes.
        assert!(
            cube::register_attention_launches() >= before + 18,
            "the register-fragment attention ran every call"
        );
    }

    /// The GPT trains on `Autodiff<Distributed<Wgpu>>` through the fused kernels (layer norms,
    /// GELU-with-bias, flash attention, cross-entropy) and the decorator's fused placement rules;
    /// its losses track the Flex run (plain Burn ops) step by step, on one rank and sharded.
    #[test]
    fn gpt_pretraining_on_wgpu_runs_the_kernels_and_tracks_flex() {
        use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig};
        use wildfire::pretrain::{PretrainConfig, run, run_on};
        let base = PretrainConfig {
            model: crate::suite::tiny_gpt_flags(),
            steps: 4,
            batch_size: 4,
            warmup: 2,
            eval_every: 0,
            eval_iters: 1,
            sample_tokens: 0,
            log_every: 1000,
            progress: false,
            plot: None,
            metrics: None,
            timeout: crate::suite::ON_LAVAPIPE_TIMEOUT,
            ..PretrainConfig::default()
        };
        let flex = run(&base).unwrap();
        let device = Default::default();
        for (dp, tp, sp, fsdp) in [
            (1, 1, false, FsdpStrategy::NoShard),
            (2, 1, false, FsdpStrategy::FullShard),
            (1, 2, true, FsdpStrategy::NoShard),
            (2, 2, false, FsdpStrategy::FullShard),
        ] {
            let parallel = ParallelConfig {
                dp,
                tp,
                sp,
                fsdp,
                ..ParallelConfig::default()
            };
            let before = cube::launches();
            let got = run_on::<Wgpu>(
                &PretrainConfig {
                    parallel,
                    ..base.clone()
                },
                &device,
            )
            .unwrap();
            assert!(
                cube::launches() > before,
                "dp {dp} tp {tp}: the fused kernels ran"
            );
            crate::suite::losses_close(
                &format!("dp {dp} tp {tp} sp {sp}, wgpu vs flex:"),
                &got.steps,
                &flex.steps,
                1e-4,
            );
        }
    }
}

/// The same checks on CUDA (run by the GPU bench's correctness half, `benches/gpu.sh`): f32 (the
/// tiled products without tensor cores), then f16 and bf16 through tensor-core fragments.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use burn::backend::Cuda;
    use burn::tensor::FloatDType;

    type C = Autodiff<Cuda>;

    /// Every kernel against Burn ops on CUDA, f32 (slow on a fresh machine: each reference
    /// matmul shape is autotuned once).
    #[test]
    fn cuda_kernels_match_burn_ops() {
        let device = Default::default();
        check_all::<C>(&device, 1e-4);
        check_attention_tiles::<C>(&device, &[1, 17, 64, 130], 1e-4);
    }

    /// The tensor-core kernels (bf16 and f16 q, k, v; f32 accumulation) against the f32 tiles on
    /// the same inputs — the f32 path is the one checked against Burn ops here and on lavapipe,
    /// and this comparison needs no Burn matmul (no autotuning): forward and the gradient of the
    /// packed input, through the casts; first the `cmma` fragment kernels
    /// (`WILDFIRE_ATTENTION_MMA=0`), then the register kernels on `mma.m16n8k16` (the default).
    /// Tolerances of the
    /// output's scale: bf16 keeps 8 significant bits (inputs and probabilities rounded once
    /// each), f16 11.
    #[test]
    fn cuda_tensor_core_attention_matches_f32_tiles() {
        let device = Default::default();
        let cases = [
            ([2, 130, 2, 64], true),
            ([2, 130, 2, 64], false),
            ([1, 1024, 2, 64], true),
            ([2, 77, 2, 128], true),
            ([1, 17, 3, 32], false),
            // a head dim not a multiple of 32: the `ldmatrix` Q·Kᵀ loads' last 16 columns
            ([1, 33, 2, 48], true),
            ([1, 1, 2, 64], true),
        ];
        let check = || {
            for (dtype, tol) in [(FloatDType::BF16, 4e-2), (FloatDType::F16, 8e-3)] {
                for ([b, t, h, hd], causal) in cases {
                    let qkv = normal::<C, 4>([b, t, h, 3 * hd], 1.0, &device);
                    let g = grad_of(&qkv);
                    let scale = 1.0 / (hd as f64).sqrt();
                    let reference = ops::attention_qkv(qkv.clone(), scale, causal);
                    let got = ops::attention_qkv(qkv.clone().cast(dtype), scale, causal)
                        .cast(FloatDType::F32);
                    compare(
                        &format!(
                            "{dtype:?} tensor-core attention {:?} causal {causal}",
                            [b, t, h, hd]
                        ),
                        got,
                        reference,
                        &[&g],
                        tol,
                    );
                }
            }
        };
        let before = wildfire_kernels::cube::register_attention_launches();
        wildfire_kernels::cube::with_fragment_kernels(check);
        assert_eq!(
            wildfire_kernels::cube::register_attention_launches(),
            before,
            "the fragment kernels ran"
        );
        let before = wildfire_kernels::cube::register_attention_launches();
        check();
        // Every call above (head dims multiples of 16) ran the register kernels: sm_80 and later.
        assert_eq!(
            wildfire_kernels::cube::register_attention_launches() - before,
            (2 * cases.len() * 3) as u64,
            "the register-fragment attention ran every call"
        );
    }

    /// The 8-bit block-wise state kernels on CUDA (`u8` codes, as the optimizer stores them there)
    /// give Flex's host loops' numbers bit for bit on [`BLOCKWISE`], both maps: the block maxima,
    /// the codes, a taken and a skipped step, the dequantised values.
    #[test]
    fn cuda_blockwise_quantisation_kernels_are_the_host_loops() {
        use burn::tensor::IntDType;
        blockwise_kernels_are_the_host_loops::<Cuda>(&Default::default(), IntDType::U8, "CUDA");
    }
}

/// The 8-bit block-wise state case: a piece starting mid-block (flat index 3,000 of a
/// 12,000-element tensor, 2,048 per block, so block 0 is not the piece's), of magnitudes over six
/// decades, with one block all zeros, whose last block runs past the tensor (padding: scale 0).
/// The second moment's map is for values ≥ 0, so the unsigned case is the magnitudes.
const BLOCKWISE: (usize, usize, usize, usize) = (3000, 9500, 2048, 12_000usize.div_ceil(2048));

fn blockwise_piece(signed: bool) -> Vec<f32> {
    let (_, len, _, _) = BLOCKWISE;
    let mut x: Vec<f32> = (0..len)
        .map(|i| (i as f32 * 0.37).sin() * 10f32.powf(-6.0 + 6.0 * i as f32 / len as f32))
        .collect();
    x[4000..6048].iter_mut().for_each(|v| *v = 0.0);
    x[8950..].iter_mut().for_each(|v| *v = 0.0); // past the tensor's 12,000 elements
    if !signed {
        x.iter_mut().for_each(|v| *v = v.abs());
    }
    x
}

/// What the 8-bit state ops give for [`BLOCKWISE`] on one backend: the block maxima, the codes,
/// the codes after a taken and after a skipped step (old codes all 0), the dequantised values.
#[derive(Debug, PartialEq)]
struct Blockwise {
    absmax: Vec<u32>,
    codes: Vec<i64>,
    unless_skipped: [Vec<i64>; 2],
    back: Vec<u32>,
}

/// `got` and `want` equal field by field, the first difference named (not the whole vectors).
fn same_blockwise(what: &str, got: &Blockwise, want: &Blockwise) {
    fn first<T: PartialEq + std::fmt::Debug>(what: &str, field: &str, a: &[T], b: &[T]) {
        assert_eq!(a.len(), b.len(), "{what}: {field} lengths");
        if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
            let n = (0..a.len()).filter(|&i| a[i] != b[i]).count();
            panic!(
                "{what}: {field} differ at {n} places, first [{i}]: {:?} vs {:?}",
                a[i], b[i]
            );
        }
    }
    first(what, "block maxima", &got.absmax, &want.absmax);
    first(what, "codes", &got.codes, &want.codes);
    first(
        what,
        "taken",
        &got.unless_skipped[0],
        &want.unless_skipped[0],
    );
    first(
        what,
        "skipped",
        &got.unless_skipped[1],
        &want.unless_skipped[1],
    );
    first(what, "dequantised", &got.back, &want.back);
}

/// The 8-bit state kernels on `B` (codes in `dtype`) give Flex's host loops' numbers (`u8`
/// codes) bit for bit on [`BLOCKWISE`], both maps, and ran (five launches a case: absmax,
/// quantise, two unless_skipped, dequantise; not counted under `fusion`, where the Burn-op forms
/// run).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn blockwise_kernels_are_the_host_loops<B: burn::tensor::backend::Backend + FusedOps>(
    device: &B::Device,
    dtype: burn::tensor::IntDType,
    what: &str,
) {
    use wildfire_kernels::cube::quant_launches;
    for signed in [true, false] {
        let before = quant_launches();
        let got = blockwise_on::<B>(device, signed, dtype, true);
        assert!(
            cfg!(feature = "fusion") || quant_launches() >= before + 5,
            "{what}: the 8-bit state kernels ran"
        );
        let want = blockwise_on::<burn::backend::Flex>(
            &Default::default(),
            signed,
            burn::tensor::IntDType::U8,
            true,
        );
        same_blockwise(&format!("{what}, signed {signed}"), &got, &want);
    }
}

/// [`Blockwise`] through `B`'s [`FusedOps`] (`fused`) or the Burn-op forms
/// (`wildfire_kernels::quant`), codes in `dtype`.
fn blockwise_on<B: burn::tensor::backend::Backend + FusedOps>(
    device: &B::Device,
    signed: bool,
    dtype: burn::tensor::IntDType,
    fused: bool,
) -> Blockwise {
    use burn::tensor::TensorPrimitive;
    use wildfire_kernels::quant;
    let (start, len, block, total) = BLOCKWISE;
    let x = blockwise_piece(signed);
    let floats = |v: Vec<f32>| {
        let n = v.len();
        Tensor::<B, 1>::from_data(TensorData::new(v, [n]), device)
            .into_primitive()
            .tensor()
    };
    let map = wildfire::engine::dynamic_map(signed);
    let mids: Vec<f32> = map.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
    let bits = |t| {
        data(Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)))
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    let ints = |c| {
        Tensor::<B, 1, Int>::from_primitive(c)
            .into_data()
            .convert::<i64>()
            .to_vec::<i64>()
            .unwrap()
    };
    let absmax = if fused {
        B::blockwise_absmax(floats(x.clone()), start, block, total)
    } else {
        quant::absmax::<B>(floats(x.clone()), start, block, total)
    };
    let (piece, mids) = (floats(x), floats(mids));
    let codes = if fused {
        B::blockwise_quantise(piece, absmax.clone(), mids, start, block, dtype)
    } else {
        quant::quantise::<B>(piece, absmax.clone(), mids, start, block, dtype)
    };
    let unless_skipped = [0.0f32, 1.0].map(|flag| {
        let old = Tensor::<B, 1, Int>::zeros([len], device)
            .cast(dtype)
            .into_primitive();
        let skip = floats(vec![flag]);
        ints(if fused {
            B::int_unless_skipped(codes.clone(), old, skip)
        } else {
            quant::unless_skipped::<B>(codes.clone(), old, skip)
        })
    });
    let map = floats(map.to_vec());
    let back = if fused {
        B::blockwise_dequantise(codes.clone(), absmax.clone(), map, start, block)
    } else {
        quant::dequantise::<B>(codes.clone(), absmax.clone(), map, start, block)
    };
    Blockwise {
        absmax: bits(absmax),
        codes: ints(codes),
        unless_skipped,
        back: bits(back),
    }
}

/// The 8-bit block-wise state ops on Flex (host loops, `u8` codes) give the Burn-op forms'
/// numbers bit for bit on [`BLOCKWISE`], both maps; a skipped step keeps the old codes, a taken
/// one the new; and the round trip keeps each value within a tenth of the piece's largest.
#[test]
fn blockwise_quantisation_on_flex_is_the_burn_op_form() {
    use burn::backend::Flex;
    use burn::tensor::IntDType;
    let device = Default::default();
    for signed in [true, false] {
        let host = blockwise_on::<Flex>(&device, signed, IntDType::U8, true);
        let ops = blockwise_on::<Flex>(&device, signed, IntDType::U8, false);
        same_blockwise(&format!("signed {signed}"), &host, &ops);
        assert_eq!(
            host.unless_skipped,
            [host.codes.clone(), vec![0; host.codes.len()]],
            "a taken step's codes are the new, a skipped step's the old"
        );
        assert!(host.codes.iter().any(|&c| c != 0) && host.absmax[0] == 0);
        // The round trip is close.
        let x = blockwise_piece(signed);
        let back: Vec<f32> = host.back.iter().map(|b| f32::from_bits(*b)).collect();
        let worst = crate::suite::pairs(&back, &x)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 0.1 * x.iter().fold(0f32, |m, v| m.max(v.abs())),
            "{worst}"
        );
    }
}

/// Flex's own products (`wildfire_kernels::gemm`: the output not zeroed first, the bias in the
/// product where one `gemm` depth block covers `k`) are Burn's `linear`, `linear_x_backward`,
/// `linear_weight_backward` and `float_matmul` bit for bit: the GPT's shapes, depths around the
/// 512 boundary, `gemm`'s own small paths (`k ≤ 2`, one row, one column), one-row products on
/// `gemm::flex`'s matrix–vector kernels, strided operands.
#[test]
fn flex_products_are_burns_bit_for_bit() {
    use burn::backend::Flex;
    use burn::tensor::ops::{FloatTensor, ModuleOps};
    use wildfire_kernels::gemm;
    let device = Default::default();
    let random = |shape: [usize; 2], seed: u64| -> FloatTensor<Flex> {
        <Flex as burn::tensor::backend::Backend>::seed(&device, seed);
        Tensor::<Flex, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device)
            .into_primitive()
            .tensor()
    };
    let bits = |t: FloatTensor<Flex>| -> Vec<u32> {
        let t = Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(t));
        data(t).iter().map(|x| x.to_bits()).collect()
    };
    let shapes = [
        (768, 128, 384),
        (768, 512, 128),
        (33, 513, 17),
        (5, 3, 7),
        (16, 2, 8),
        (1, 16, 8),
        (16, 16, 1),
        (300, 1000, 70),
        // One row: `gemm`'s matrix–vector paths, which `gemm::flex` runs with its own kernels
        // (a weight's rows, or a table's columns past 256 of them, as `linear_x_backward` and a
        // transposed weight give), and those it leaves to `gemm`.
        (1, 768, 2304),
        (1, 300, 700),
        (1, 1000, 3),
        (1, 129, 50),
        // Up to 128 rows: single-threaded `gemm` calls on column ranges over the pool.
        (64, 768, 700),
        (128, 300, 513),
        (9, 1000, 100),
    ];
    for (seed, (m, k, n)) in shapes.into_iter().enumerate() {
        let seed = 10 * seed as u64;
        let (x, w, g) = (
            random([m, k], seed),
            random([k, n], seed + 1),
            random([m, n], seed + 2),
        );
        let bias = Tensor::<Flex, 1>::random([n], Distribution::Normal(0.0, 1.0), &device)
            .into_primitive()
            .tensor();
        let what = format!("{m}×{k}×{n}");
        for b in [None, Some(bias.clone())] {
            assert_eq!(
                bits(gemm::linear::<Flex>(x.clone(), w.clone(), b.clone())),
                bits(Flex::linear(x.clone(), w.clone(), b.clone())),
                "linear {what}, bias {}",
                b.is_some()
            );
        }
        assert_eq!(
            bits(gemm::linear_x_backward::<Flex>(w.clone(), g.clone())),
            bits(Flex::linear_x_backward(w.clone(), g.clone())),
            "linear_x_backward {what}"
        );
        assert_eq!(
            bits(gemm::linear_weight_backward::<Flex>(x.clone(), g.clone())),
            bits(Flex::linear_weight_backward(x.clone(), g.clone())),
            "linear_weight_backward {what}"
        );
        // A transposed weight (a tied table's `x · tableᵀ`).
        let wt = <Flex as burn::tensor::ops::FloatTensorOps<Flex>>::float_swap_dims(
            random([n, k], seed + 4),
            0,
            1,
        );
        assert_eq!(
            bits(gemm::linear::<Flex>(x.clone(), wt.clone(), None)),
            bits(Flex::linear(x.clone(), wt, None)),
            "linear of a transposed weight {what}"
        );
        // A transposed (strided) left operand.
        let xt = <Flex as burn::tensor::ops::FloatTensorOps<Flex>>::float_swap_dims(
            random([k, m], seed + 3),
            0,
            1,
        );
        assert_eq!(
            bits(gemm::matmul::<Flex>(xt.clone(), w.clone())),
            bits(<Flex as burn::tensor::ops::FloatTensorOps<Flex>>::float_matmul(xt, w)),
            "matmul of a transposed operand {what}"
        );
    }
}

/// `gemm::linear_layer` (the models' linear layers and tied heads) on plain Flex: the input's rows as one
/// matrix, bit for bit Burn's linear of those rows — also for a transposed weight, which Burn's
/// rank-3 linear copies whole at every call — and within rounding of Burn's rank-3 linear (one
/// product per batch entry). Under the autodiff it is Burn's rank-3 linear itself.
#[test]
fn model_linears_on_plain_flex_are_burns_linear_of_the_rows() {
    use burn::backend::Flex;
    use burn::tensor::module::linear;
    use wildfire_kernels::gemm;
    let device = Default::default();
    let random = |shape: [usize; 2], seed: u64| {
        <Flex as burn::tensor::backend::Backend>::seed(&device, seed);
        Tensor::<Flex, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device)
    };
    let bits = |t: Tensor<Flex, 2>| -> Vec<u32> { data(t).iter().map(|x| x.to_bits()).collect() };
    // (batch, positions, k, n): a generated token, a prompt, odd sizes, GPT-2's head columns.
    for (seed, (b, t, k, n)) in [
        (1, 1, 768, 2304),
        (2, 7, 33, 17),
        (3, 5, 64, 300),
        (1, 1, 96, 1000),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 10 * seed as u64;
        let x = random([b * t, k], seed).reshape([b, t, k]);
        let rows = x.clone().reshape([b * t, k]);
        let bias = random([1, n], seed + 1).reshape([n]);
        // A layer's weight, and a table's transpose (a strided view).
        for (w, what) in [
            (random([k, n], seed + 2), "weight"),
            (random([n, k], seed + 3).transpose(), "transposed table"),
        ] {
            for bias in [None, Some(bias.clone())] {
                let case = format!("{b}×{t}×{k}×{n}, {what}, bias {}", bias.is_some());
                let got = gemm::linear_layer(x.clone(), w.clone(), bias.clone());
                assert_eq!(got.dims(), [b, t, n], "{case}");
                let got = got.reshape([b * t, n]);
                assert_eq!(
                    bits(got.clone()),
                    bits(linear(rows.clone(), w.clone(), bias.clone())),
                    "{case}: Burn's linear of the rows"
                );
                let burn = linear(x.clone(), w.clone(), bias.clone()).reshape([b * t, n]);
                let (g, r) = (data(got), data(burn));
                for (i, (g, r)) in g.iter().zip(&r).enumerate() {
                    assert!(
                        (g - r).abs() <= 1e-5 * (1.0 + r.abs()) * (k as f32).sqrt(),
                        "{case}: element {i}: {g} against Burn's rank-3 linear {r}"
                    );
                }
            }
        }
    }
    // Under the autodiff (training without the decorator) the layer is Burn's own.
    type A = Autodiff<Flex>;
    let x = Tensor::<A, 3>::random([2, 3, 20], Distribution::Normal(0.0, 1.0), &device);
    let w = Tensor::<A, 2>::random([20, 9], Distribution::Normal(0.0, 1.0), &device);
    let same = |t: Tensor<A, 3>| -> Vec<u32> { data(t).iter().map(|x| x.to_bits()).collect() };
    assert_eq!(
        same(gemm::linear_layer(x.clone(), w.clone(), None)),
        same(linear(x, w, None))
    );
}
