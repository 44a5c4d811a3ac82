#[macro_use]
extern crate derive_new;
extern crate alloc;

mod compute;
mod device;
mod runtime;

pub use device::*;
pub use runtime::*;

#[cfg(feature = "ptx-wmma")]
pub(crate) type WmmaCompiler = cubecl_cpp::cuda::mma::PtxWmmaCompiler;

#[cfg(not(feature = "ptx-wmma"))]
pub(crate) type WmmaCompiler = cubecl_cpp::cuda::mma::CudaWmmaCompiler;

pub mod install {
    use std::path::PathBuf;

    pub fn include_path() -> PathBuf {
        let mut path = cuda_path().expect("
        CUDA installation not found.
        Please ensure that CUDA is installed and the CUDA_PATH environment variable is set correctly.
        Note: Default paths are used for Linux (/usr/local/cuda) and Windows (C:/Program Files/NVIDIA GPU Computing Toolkit/CUDA/), which may not be correct.
    ");
        path.push("include");
        path
    }

    pub fn cccl_include_path() -> PathBuf {
        let mut path = include_path();
        path.push("cccl");
        path
    }

    pub fn cuda_path() -> Option<PathBuf> {
        if let Ok(path) = std::env::var("CUDA_PATH") {
            return Some(PathBuf::from(path));
        }

        #[cfg(target_os = "linux")]
        {
            // If it is installed as part of the distribution
            return if std::fs::exists("/usr/local/cuda").is_ok_and(|exists| exists) {
                Some(PathBuf::from("/usr/local/cuda"))
            } else if std::fs::exists("/opt/cuda").is_ok_and(|exists| exists) {
                Some(PathBuf::from("/opt/cuda"))
            } else if std::fs::exists("/usr/bin/nvcc").is_ok_and(|exists| exists) {
                // Maybe the compiler was installed within the user path.
                Some(PathBuf::from("/usr"))
            } else {
                None
            };
        }

        #[cfg(target_os = "windows")]
        {
            return Some(PathBuf::from(
                "C:/Program Files/NVIDIA GPU Computing Toolkit/CUDA/",
            ));
        }

        #[allow(unreachable_code)]
        None
    }
}

/// Wildfire's patch (not in CubeCL 0.10): an occupancy request a kernel carries in its source.
///
/// CubeCL writes every CUDA kernel as `__launch_bounds__(units)` with no second argument, so
/// `ptxas` may use as many registers as the cube's size allows — for a kernel that keeps its
/// operands in registers that can mean fewer cubes per multiprocessor than it was designed for.
/// A kernel asks for `n` cubes per multiprocessor by writing the comment [`MARKER`]`n` (CubeCL's
/// `comment!`, or `cube_comment::expand` with the number formatted in) anywhere in its body;
/// [`apply`] turns the signature's `__launch_bounds__(units)` into `__launch_bounds__(units, n)`
/// (CUDA's `minBlocksPerMultiprocessor`) before NVRTC compiles it. The comment is part of the
/// kernel's source, so the kernel's id (its comptime values) already tells the PTX cache apart.
pub mod launch_hints {
    use alloc::borrow::Cow;
    use alloc::format;

    /// The comment's text before the number of cubes.
    pub const MARKER: &str = "wildfire:cubes-per-sm=";

    /// The cubes per multiprocessor `source` asks for, if it carries [`MARKER`] with a number
    /// from 1 to 32.
    pub fn requested(source: &str) -> Option<u32> {
        let at = source.find(MARKER)? + MARKER.len();
        let digits: &str = &source[at..];
        let end = digits
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(digits.len());
        digits[..end]
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=32).contains(n))
    }

    /// `source` with the request written into its `__launch_bounds__` (unchanged without a
    /// request, or where the signature has no single-argument `__launch_bounds__`).
    pub fn apply(source: &str) -> Cow<'_, str> {
        const BOUNDS: &str = "__launch_bounds__(";
        let Some(cubes) = requested(source) else {
            return Cow::Borrowed(source);
        };
        let Some(open) = source.find(BOUNDS).map(|at| at + BOUNDS.len()) else {
            return Cow::Borrowed(source);
        };
        let Some(close) = source[open..].find(')').map(|at| open + at) else {
            return Cow::Borrowed(source);
        };
        let units = source[open..close].trim();
        if units.is_empty() || !units.chars().all(|c| c.is_ascii_digit()) {
            return Cow::Borrowed(source);
        }
        Cow::Owned(format!(
            "{}{units}, {cubes}{}",
            &source[..open],
            &source[close..]
        ))
    }
}

#[cfg(test)]
#[allow(unexpected_cfgs)]
mod tests {
    pub type TestRuntime = crate::CudaRuntime;

    pub use half::{bf16, f16};

    cubecl_core::testgen_all!(f32: [f16, bf16, f32, f64], i32: [i8, i16, i32, i64], u32: [u8, u16, u32, u64]);
    cubecl_std::testgen!();
    cubecl_std::testgen_tensor_identity!([f16, bf16, f32, u32]);
    cubecl_std::testgen_quantized_view!(f16);
}
