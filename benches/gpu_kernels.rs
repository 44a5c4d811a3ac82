//! The GPU's hot kernels at GPT-2 124M's shapes, on CUDA: flash attention forward + backward
//! (packed q/k/v, as the GPT calls it) and each bf16 GEMM of a training step, forward and both
//! backward products, as the decorator runs them (`wildfire_kernels::gemm`: cuBLASLt on CUDA),
//! the forward ones also through Burn's CubeCL matmul (autotuned; `cubecl_matmul_…`), and the
//! memory-bound embedding-table gradient (beside Burn's own) and cross-entropy backward.
//! `benches/gpu.sh` runs it beside `benches/pytorch/gpu_kernels.py` (SDPA and `torch.matmul` on
//! the same shapes) on the same GPU.
//!
//! ```text
//! cargo bench --bench gpu_kernels --features cuda [-- --batch 8 --seq 1024]
//! WILDFIRE_ATTENTION_CMMA=0 …   # the tiled attention without tensor cores, for comparison
//! … -- --head-dim 128 --attention-only   # the attention alone at another head dim (768 wide)
//! ```
//!
//! Prints one JSON object per line: `{"kernel", "shape", "ms", "tflops"}` (mean over the timed
//! calls after two warm-up calls, which compile and autotune).

use burn::backend::Cuda;
use burn::tensor::ops::ModuleOps;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData};
use std::time::Instant;
use wildfire::kernels::{FusedOps, gemm};

type B = Cuda;

fn sync() {
    <B as burn::tensor::backend::Backend>::sync(&Default::default()).unwrap();
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect("a number"))
}

/// Mean seconds per call of `f` over `iters` calls, after two warm-up calls.
fn time(iters: usize, f: &dyn Fn()) -> f64 {
    f();
    f();
    sync();
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    sync();
    start.elapsed().as_secs_f64() / iters as f64
}

fn report(kernel: &str, shape: &str, seconds: f64, flops: f64) {
    println!(
        "{{\"kernel\": \"{kernel}\", \"shape\": \"{shape}\", \"ms\": {:.4}, \"tflops\": {:.1}}}",
        seconds * 1e3,
        flops / seconds / 1e12
    );
}

/// A memory-bound kernel: GB/s of the `bytes` it must read and write (no FLOP/s).
fn report_bytes(kernel: &str, shape: &str, seconds: f64, bytes: f64) {
    println!(
        "{{\"kernel\": \"{kernel}\", \"shape\": \"{shape}\", \"ms\": {:.4}, \"tflops\": 0.0, \"gbps\": {:.0}}}",
        seconds * 1e3,
        bytes / seconds / 1e9
    );
}

fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

fn random_bf16<const D: usize>(shape: [usize; D]) -> Tensor<B, D> {
    Tensor::<B, D>::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
        .cast(DType::BF16)
}

fn main() {
    let (b, t) = (arg("--batch", 8), arg("--seq", 1024));
    let (d, v) = (768, 50_304);
    let hd = arg("--head-dim", 64);
    assert!(
        hd > 0 && d % hd == 0,
        "--head-dim must divide the model width {d}"
    );
    let h = d / hd;
    let iters = arg("--iters", 20);

    // Attention, causal, packed [b, t, h, 3·hd]: forward, then forward + backward. FLOPs as
    // FlashAttention counts them for causal: forward 2·2·b·h·t²·hd / 2, backward 2.5× that.
    let qkv: FloatTensor<B> = random_bf16([b, t, h, 3 * hd]).into_primitive().tensor();
    let scale = 1.0 / (hd as f64).sqrt();
    let fwd_flops = 4.0 * (b * h * t * t * hd) as f64 / 2.0;
    let shape = format!("b{b} h{h} t{t} d{hd} causal bf16");
    let forward = || {
        let _ = B::fused_attention_qkv(qkv.clone(), scale, true);
    };
    report("attention_fwd", &shape, time(iters, &forward), fwd_flops);
    let out = B::fused_attention_qkv(qkv.clone(), scale, true);
    let d_out: FloatTensor<B> = random_bf16([b, t, h, hd]).into_primitive().tensor();
    let backward = || {
        let _ = B::fused_attention_qkv_backward(
            qkv.clone(),
            out.output.clone(),
            out.lse.clone(),
            d_out.clone(),
            scale,
            true,
        );
    };
    report(
        "attention_bwd",
        &shape,
        time(iters, &backward),
        2.5 * fwd_flops,
    );
    if flag("--attention-only") {
        return;
    }

    // The memory-bound ends of the step: the embedding table's gradient (f32, ids skewed like a
    // text's tokens: log-uniform over the vocabulary, the commonest about 6% of the batch) and
    // the cross-entropy backward over bf16 logits; GB/s of the bytes each must move.
    let rows = b * t;
    let device = Default::default();
    let vocab = 50_257;
    let ids: Vec<i64> = (0..rows)
        .map(|i| {
            let u = (i as f64 * 0.618_033_988_7).fract();
            ((u * (vocab as f64).ln()).exp() as i64 - 1).clamp(0, vocab as i64 - 1)
        })
        .collect();
    let flat = Tensor::<B, 1, Int>::from_data(TensorData::new(ids.clone(), [rows]), &device);
    let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, t]), &device);
    let (idx, flat) = (idx.into_primitive(), flat.into_primitive());
    let table: FloatTensor<B> = Tensor::<B, 2>::zeros([v, d], &device)
        .into_primitive()
        .tensor();
    let dy: FloatTensor<B> =
        Tensor::<B, 3>::random([b, t, d], Distribution::Normal(0.0, 1.0), &device)
            .into_primitive()
            .tensor();
    let shape = format!("{rows} ids, {v}x{d} f32");
    let bytes = ((v * d + rows * d) * 4) as f64;
    let ours = || {
        let _ = B::fused_embedding_backward(table.clone(), dy.clone(), idx.clone());
    };
    report_bytes("embedding_bwd", &shape, time(iters, &ours), bytes);
    let burn_op = || {
        let _ = B::embedding_backward(table.clone(), dy.clone(), idx.clone());
    };
    report_bytes("burn_embedding_bwd", &shape, time(iters, &burn_op), bytes);
    let logits: FloatTensor<B> = random_bf16([rows, v]).into_primitive().tensor();
    let ce = B::fused_cross_entropy(logits.clone(), flat.clone());
    let dloss: FloatTensor<B> = Tensor::<B, 1>::ones([rows], &device)
        .cast(DType::BF16)
        .into_primitive()
        .tensor();
    let ce_backward = || {
        let _ = B::fused_cross_entropy_backward(
            logits.clone(),
            flat.clone(),
            ce.lse.clone(),
            dloss.clone(),
        );
    };
    let bytes = (rows * v * 2 * 2) as f64;
    let shape = format!("{rows}x{v} bf16");
    report_bytes(
        "cross_entropy_bwd",
        &shape,
        time(iters, &ce_backward),
        bytes,
    );

    // The GEMMs of one layer and the head: forward `x·Wᵀ` (a transposed view, as the tied head
    // runs it), the input gradient `g·W` and the weight gradient `xᵀ·g` (a transposed view).
    let rows = b * t;
    for (name, k, n) in [
        ("qkv", d, 3 * d),
        ("attn_proj", d, d),
        ("mlp_fc", d, 4 * d),
        ("mlp_proj", 4 * d, d),
        ("lm_head", d, v),
    ] {
        let x = random_bf16([rows, k]).into_primitive().tensor();
        let w = random_bf16([n, k]).into_primitive().tensor();
        let g = random_bf16([rows, n]).into_primitive().tensor();
        let wt = || B::float_swap_dims(w.clone(), 0, 1);
        let flops = 2.0 * (rows * k * n) as f64;
        let shape = format!("{rows}x{k}x{n} bf16");
        let products: [(String, &dyn Fn()); 4] = [
            (format!("matmul_{name}"), &|| {
                let _ = gemm::matmul::<B>(x.clone(), wt());
            }),
            (format!("matmul_{name}_dx"), &|| {
                let _ = gemm::matmul::<B>(g.clone(), w.clone());
            }),
            (format!("matmul_{name}_dw"), &|| {
                let _ = gemm::matmul::<B>(B::float_swap_dims(x.clone(), 0, 1), g.clone());
            }),
            (format!("cubecl_matmul_{name}"), &|| {
                let _ = B::float_matmul(x.clone(), wt());
            }),
        ];
        for (kernel, f) in products {
            report(&kernel, &shape, time(iters, f), flops);
        }
    }
}
