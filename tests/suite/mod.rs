//! Shared by the test modules.

/// `got` equals `expected` to `1e-5` of the tensor's scale: max |a − b| ≤ 1e-5 · max |b|
/// (element-wise relative error is ill-posed for near-zero entries, which AdamW's normalised step
/// amplifies).
pub(crate) fn close(what: &str, got: &[f32], expected: &[f32]) {
    assert_eq!(got.len(), expected.len(), "{what}");
    let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (a, b)) in pairs(got, expected).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * scale,
            "{what}[{i}]: {a} vs {b} (scale {scale})"
        );
    }
}

/// The pairs of two lists a parity check compares, which must have the same, non-zero length
/// (a bare `zip` passes when one side is empty or short).
pub(crate) fn pairs<'a, T>(
    got: &'a [T],
    expected: &'a [T],
) -> impl Iterator<Item = (&'a T, &'a T)> {
    assert_eq!(got.len(), expected.len(), "compared lists differ in length");
    assert!(!expected.is_empty(), "nothing to compare");
    got.iter().zip(expected)
}

/// Every tensor of `got` equals its counterpart in `expected` to `tol` of that tensor's scale:
/// max |a − b| ≤ tol · max |b| (parameters, one `Vec` each, as `parameters` lists them).
pub(crate) fn tensors_close(what: &str, got: &[Vec<f32>], expected: &[Vec<f32>], tol: f32) {
    for (i, (p, q)) in pairs(got, expected).enumerate() {
        assert_eq!(p.len(), q.len(), "{what}: tensor {i}");
        let scale = q.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (x, y) in pairs(p, q) {
            assert!(
                (x - y).abs() <= tol * scale,
                "{what}: tensor {i}: {x} vs {y} (scale {scale})"
            );
        }
    }
}

/// Every value of `got` equals its counterpart in `expected` to `tol` (relative): per-step
/// losses.
pub(crate) fn losses_close_f32(what: &str, got: &[f32], expected: &[f32], tol: f32) {
    for (i, (a, b)) in pairs(got, expected).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs(),
            "{what} step {i}: {a} vs {b}"
        );
    }
}

/// Every step's loss of a pretraining run equals the expected run's to `tol` (relative).
pub(crate) fn losses_close(
    what: &str,
    got: &[wildfire::pretrain::StepMetrics],
    expected: &[wildfire::pretrain::StepMetrics],
    tol: f32,
) {
    for (a, b) in pairs(got, expected) {
        assert!(
            (a.loss - b.loss).abs() <= tol * b.loss.abs(),
            "{what} step {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
    }
}

/// The backends the parity tests compare: plain Burn, and Burn under the distributed decorator.
pub(crate) type Plain = burn::backend::Autodiff<burn::backend::Flex>;
pub(crate) type Dist =
    burn::backend::Autodiff<wildfire::parallel::Distributed<burn::backend::Flex>>;

/// The synthetic classification task of the parity tests: `seq` positions of 4 features, 3
/// classes.
pub(crate) fn task(seq: usize, seed: u64) -> wildfire::demo::SyntheticTask {
    wildfire::demo::SyntheticTask {
        seq,
        d_input: 4,
        classes: 3,
        seed,
    }
}

/// A deterministic MLP `d_in → hidden → d_out` (initialised from `seed`), sharded on `mesh`
/// under `strategy`.
pub(crate) fn sharded_mlp(
    device: &wildfire::parallel::DistDevice<burn::backend::Flex>,
    mesh: &wildfire::parallel::DeviceMesh,
    [d_in, hidden, d_out]: [usize; 3],
    seed: u64,
    strategy: wildfire::parallel::FsdpStrategy,
) -> wildfire::demo::Mlp<Dist> {
    let m = wildfire::demo::deterministic_init(
        wildfire::demo::Mlp::new(d_in, hidden, d_out, device),
        seed,
    );
    wildfire::parallel::fully_shard(m, mesh, strategy).unwrap()
}

/// The tests' small GPT: vocabulary 64, 16 positions, width 32, 2 heads, no dropout; `n_layer`
/// blocks, initialised from `init_seed`.
pub(crate) fn small_gpt(n_layer: usize, init_seed: u64) -> wildfire::models::gpt::GptConfig {
    wildfire::models::gpt::GptConfig {
        vocab_size: 64,
        block_size: 16,
        n_layer,
        n_head: 2,
        n_embd: 32,
        init_seed,
        dropout: 0.0,
        vocab_used: None,
        gelu: wildfire::models::gpt::Gelu::Erf,
    }
}

/// Run `f` on every rank of `mesh`, ranks as threads on Flex; the results in rank order.
pub(crate) fn threads<T: Send>(
    mesh: &wildfire::parallel::DeviceMesh,
    f: impl Fn(wildfire::parallel::DistDevice<burn::backend::Flex>) -> T + Sync,
) -> Vec<T> {
    wildfire::parallel::launch_ranks::<burn::backend::Flex, _, _>(
        mesh,
        &Default::default(),
        &wildfire::parallel::LaunchOptions::default(),
        f,
    )
    .unwrap()
}

/// The driver's CI-sized GPT: 2 layers, 2 heads, width 32, context 32.
pub fn tiny_gpt_flags() -> wildfire::models::ModelFlags {
    wildfire::models::ModelFlags {
        preset: wildfire::models::Preset::Tiny,
        n_layer: Some(2),
        n_head: Some(2),
        n_embd: Some(32),
        block_size: Some(32),
        ..Default::default()
    }
}

mod adamw8bit;
mod context_parallel;
mod data_parallel;
mod engine;
mod fsdp;
mod gemm;
mod kernels;
#[cfg(feature = "learner")]
mod learner;
mod llama;
mod moe;
mod optimizer_state;
mod pretrain;
mod recompute;
mod tensor_parallel;

/// The collective timeout (`--timeout`, seconds) of the runs on Wgpu over lavapipe: its first
/// compile of each kernel takes tens of seconds, and longer on a 2-core machine running other
/// tests, so a rank may reach a collective over a minute (the default) after its peers (seen:
/// the dp 2 × tp 2 GPT run with a cold shader cache).
#[cfg(feature = "wgpu")]
pub const ON_LAVAPIPE_TIMEOUT: f64 = 900.0;
