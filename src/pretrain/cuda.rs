//! Pretraining on Burn's CUDA backend (feature `cuda`): which collectives carry the run, chosen
//! here rather than by the binary, so the choice moves with the launcher.

use super::{PretrainConfig, PretrainError, RunSummary, run_on_with};

/// Burn's CUDA backend (wrapped in operation fusion with the feature `fusion`).
type Cuda = burn::backend::Cuda;

/// Run pretraining with `config` on Burn's CUDA backend, its collectives as
/// [`PretrainConfig::collectives`] says (the launch installs them: `wildfire_parallel::NcclLaunch`):
/// host and staged over the host communicator, every rank on the default GPU; NCCL installed on
/// every rank, rank `r` of a process on GPU `r` (or, for a torchrun-style process, NCCL carrying
/// everything).
/// Without libcuda this is a typed error ([`wildfire_parallel::Error::Cuda`]) before the device
/// is first used, whatever the collectives. NCCL needs Burn's CUDA backend without operation
/// fusion (a build without the feature `fusion`).
pub fn run_cuda(config: &PretrainConfig) -> Result<RunSummary, PretrainError> {
    // cudarc loads libcuda at the device's first use and panics when it is missing.
    wildfire_parallel::check_libcuda()?;
    if wildfire_kernels::gemm::uses_blas::<Cuda>() {
        tracing::info!(
            "CUDA: the model's GEMMs run on cuBLASLt (WILDFIRE_CUBLAS=0: Burn's autotuned CubeCL \
             matmuls instead); Burn's own matmuls elsewhere are autotuned once per shape, cached \
             in ~/.cache/cubecl"
        );
    } else {
        tracing::info!(
            "CUDA: Burn's matmuls are autotuned — each new GEMM shape is timed once on this GPU \
             (≈ 20–30 s per shape on a fresh machine, GPT-2 124M has ≈ 17; \
             CUBECL_AUTOTUNE_LEVEL=minimal|balanced|extensive|full sets the effort), cached in \
             ~/.cache/cubecl for later runs"
        );
    }
    let device = Default::default();
    #[cfg(not(feature = "fusion"))]
    {
        let nccl = wildfire_parallel::NcclLaunch::default();
        run_on_with::<Cuda, _>(config, &device, &nccl)
    }
    #[cfg(feature = "fusion")]
    {
        if config.collectives == super::Collectives::Nccl {
            return Err(PretrainError::Config(
                "--collectives nccl runs on Burn's CUDA backend without operation fusion: build \
                 without --features fusion"
                    .into(),
            ));
        }
        run_on_with::<Cuda, _>(config, &device, &wildfire_parallel::HostLaunch)
    }
}
