//! Writes the flash-attention kernels' CUDA source, as CubeCL generates it for an sm_90 device,
//! without a GPU: `cargo run -p wildfire-kernels --features cuda --release --example flash_cuda
//! -- DIR [HEAD_DIM] [bf16|f16|f32] [causal|full]` (defaults 64, bf16, causal) writes
//! `DIR/flash_forward.cu`, `flash_backward_q.cu` and `flash_backward_kv.cu`; then
//! `tools/cuda_sass.py DIR/*.cu` compiles them with NVRTC and `ptxas` (registers, spills, SASS).

use burn::tensor::DType;
use std::path::PathBuf;

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next().map(PathBuf::from) else {
        eprintln!("usage: flash_cuda DIR [HEAD_DIM] [bf16|f16|f32] [causal|full]");
        std::process::exit(2);
    };
    let d: usize = args
        .next()
        .map_or(64, |x| x.parse().expect("HEAD_DIM is a number"));
    let dtype = match args.next().as_deref() {
        None | Some("bf16") => DType::BF16,
        Some("f16") => DType::F16,
        Some("f32") => DType::F32,
        Some(other) => panic!("dtype {other}: bf16, f16 or f32"),
    };
    let causal = !matches!(args.next().as_deref(), Some("full"));
    std::fs::create_dir_all(&dir).expect("the output directory");
    for (name, source) in wildfire_kernels::cube::codegen::flash_sources(d, causal, dtype) {
        let path = dir.join(format!("{name}.cu"));
        std::fs::write(&path, source).expect("writable output directory");
        println!("{}", path.display());
    }
}
