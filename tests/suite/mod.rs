//! Shared by the test modules.

/// `got` equals `expected` to `1e-5` of the tensor's scale: max |a − b| ≤ 1e-5 · max |b|
/// (element-wise relative error is ill-posed for near-zero entries, which AdamW's normalised step
/// amplifies).
pub(crate) fn close(what: &str, got: &[f32], expected: &[f32]) {
    assert_eq!(got.len(), expected.len(), "{what}");
    let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (a, b)) in got.iter().zip(expected).enumerate() {
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

mod data_parallel;
mod engine;
mod fsdp;
mod kernels;
mod pretrain;
mod recompute;
mod tensor_parallel;
