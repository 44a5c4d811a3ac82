//! The flash kernels' CUDA source without a GPU: CubeCL's own CUDA code generation
//! (`CudaCompiler`, what `cubecl-cuda` hands NVRTC) run on the kernels' definitions, with the
//! device properties an sm_90 device registers and the comptime split the launches pick there.
//! A CPU-only machine then compiles the source with NVRTC and `ptxas` (`tools/cuda_sass.py`) and
//! reads registers, spills and SASS, instead of waiting for a GPU run's compilation log.
//!
//! CubeCL builds a kernel's definition from a `ComputeClient` (its device properties decide
//! which instructions the expansion may use), and a CUDA client needs a driver; so the client
//! here is of [`Codegen`], a runtime whose server only holds the properties (nothing runs on it:
//! every other server method fails) and whose compiler is `cubecl-cuda`'s.

use super::backward::{flash_backward_kv_kernel, flash_backward_q_kernel};
use super::forward::flash_forward_kernel;
use super::{Flash, LANES, Pass};
use cubecl::Runtime;
use cubecl::cuda::{CudaCompiler, CudaRuntime};
use cubecl::prelude::*;
use cubecl_common::bytes::Bytes;
use cubecl_common::device::{Device, DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl_common::future::DynFut;
use cubecl_common::profile::{ProfileDuration, TimingMethod};
use cubecl_common::stream_id::StreamId;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, DialectWmmaCompiler, register_mma_features,
    register_wmma_features,
};
use cubecl_ir::features::Plane;
use cubecl_ir::{
    DeviceProperties, ElemType, FloatKind, HardwareProperties, MemoryDeviceProperties, VectorSize,
};
use cubecl_runtime::allocator::ContiguousMemoryLayoutPolicy;
use cubecl_runtime::compiler::{Compiler, CubeTask};
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{ManagedMemoryHandle, MemoryAllocationMode, MemoryUsage};
use cubecl_runtime::server::{
    Binding, ComputeServer, CopyDescriptor, KernelArguments, ProfileError, ProfilingToken,
    ServerCommunication, ServerError, ServerUtilities,
};
use cubecl_runtime::storage::{BytesStorage, ComputeStorage, ManagedResource};
use std::sync::Arc;

/// The compute capability the source is generated for (H100 / H200).
const ARCH: u32 = 90;

/// The device of [`Codegen`] (one, index 0).
#[derive(Debug, Default, Clone)]
pub struct CodegenDevice;

impl Device for CodegenDevice {
    fn from_id(_: DeviceId) -> Self {
        CodegenDevice
    }

    fn to_id(&self) -> DeviceId {
        DeviceId::new(0, 0)
    }
}

/// A server that holds an sm_90 device's properties and runs nothing.
#[derive(Debug)]
pub struct CodegenServer {
    utilities: Arc<ServerUtilities<Self>>,
}

impl DeviceService for CodegenServer {
    fn init(_: DeviceId) -> Self {
        let utilities = ServerUtilities::new(
            sm90_properties(),
            Arc::new(ServerLogger::default()),
            (),
            ContiguousMemoryLayoutPolicy::new(512),
        );
        CodegenServer {
            utilities: Arc::new(utilities),
        }
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone() as ServerUtilitiesHandle
    }
}

impl ServerCommunication for CodegenServer {
    const SERVER_COMM_ENABLED: bool = false;
}

/// The one answer of every [`CodegenServer`] method that would touch a device.
fn no_device() -> ServerError {
    ServerError::Generic {
        reason: "the code-generation runtime has no device".into(),
        backtrace: Default::default(),
    }
}

impl ComputeServer for CodegenServer {
    type Kernel = Box<dyn CubeTask<CudaCompiler>>;
    type Info = ();
    type MemoryLayoutPolicy = ContiguousMemoryLayoutPolicy;
    type Storage = BytesStorage;

    fn initialize_memory(&mut self, _: ManagedMemoryHandle, _: u64, _: StreamId) {
        panic!("{}", no_device())
    }

    fn logger(&self) -> Arc<ServerLogger> {
        self.utilities.logger.clone()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn read(
        &mut self,
        _: Vec<CopyDescriptor>,
        _: StreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        Box::pin(async { Err(no_device()) })
    }

    fn write(&mut self, _: Vec<(CopyDescriptor, Bytes)>, _: StreamId) {
        panic!("{}", no_device())
    }

    fn sync(&mut self, _: StreamId) -> DynFut<Result<(), ServerError>> {
        Box::pin(async { Err(no_device()) })
    }

    fn get_resource(
        &mut self,
        _: Binding,
        _: StreamId,
    ) -> Result<ManagedResource<<BytesStorage as ComputeStorage>::Resource>, ServerError> {
        Err(no_device())
    }

    unsafe fn launch(
        &mut self,
        _: Self::Kernel,
        _: CubeCount,
        _: KernelArguments,
        _: ExecutionMode,
        _: StreamId,
    ) {
        panic!("{}", no_device())
    }

    fn flush(&mut self, _: StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    fn memory_usage(&mut self, _: StreamId) -> Result<MemoryUsage, ServerError> {
        Err(no_device())
    }

    fn memory_cleanup(&mut self, _: StreamId) {}

    fn start_profile(&mut self, _: StreamId) -> Result<ProfilingToken, ServerError> {
        Err(no_device())
    }

    fn end_profile(
        &mut self,
        _: StreamId,
        _: ProfilingToken,
    ) -> Result<ProfileDuration, ProfileError> {
        Err(ProfileError::Unknown {
            reason: "the code-generation runtime has no device".into(),
            backtrace: Default::default(),
        })
    }

    fn allocation_mode(&mut self, _: MemoryAllocationMode, _: StreamId) {}
}

/// A runtime for code generation only: CUDA's compiler and target, [`CodegenServer`]'s
/// properties.
#[derive(Debug, Clone)]
pub struct Codegen;

impl Runtime for Codegen {
    type Compiler = CudaCompiler;
    type Server = CodegenServer;
    type Device = CodegenDevice;

    fn client(device: &CodegenDevice) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }

    fn name(_: &ComputeClient<Self>) -> &'static str {
        "cuda-codegen"
    }

    fn require_array_lengths() -> bool {
        CudaRuntime::require_array_lengths()
    }

    fn max_cube_count() -> (u32, u32, u32) {
        (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32)
    }

    fn can_read_tensor(_: &cubecl::zspace::Shape, _: &cubecl::zspace::Strides) -> bool {
        true
    }

    fn target_properties() -> cubecl_ir::TargetProperties {
        CudaRuntime::target_properties()
    }

    fn enumerate_devices(_: u16, _: &()) -> Vec<DeviceId> {
        vec![DeviceId::new(0, 0)]
    }
}

/// What `cubecl-cuda` registers for an sm_90 device (`DeviceService::init` of its server, the
/// parts the kernels' expansion reads: types, plane operations, `mma`/`wmma` shapes,
/// `ldmatrix`), with an H200's limits.
fn sm90_properties() -> DeviceProperties {
    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 1024,
        max_shared_memory_size: 232_448,
        max_cube_count: (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: Some(8),
        num_cpu_cores: None,
        max_vector_size: VectorSize::MAX,
    };
    let memory = MemoryDeviceProperties {
        max_page_size: 1 << 34,
        alignment: 512,
    };
    let mut props =
        DeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System);
    cubecl_cpp::register_supported_types(&mut props);
    props.features.plane.insert(Plane::Sync);
    props.features.plane.insert(Plane::Ops);
    props.features.plane.insert(Plane::NonUniformControlFlow);
    props.features.memory_reinterpret = true;
    props.features.alignment = true;
    props.features.copy_async = true;
    props.features.cube_cluster = true;
    for f in [FloatKind::F16, FloatKind::BF16] {
        props
            .features
            .matmul
            .ldmatrix
            .insert(ElemType::Float(f).into());
        props
            .features
            .matmul
            .stmatrix
            .insert(ElemType::Float(f).into());
    }
    let arch = CudaArchitecture { version: ARCH };
    register_wmma_features(
        CudaWmmaCompiler::supported_wmma_combinations(&arch),
        &mut props,
    );
    register_mma_features(
        CudaWmmaCompiler::supported_mma_combinations(&arch),
        &mut props,
    );
    props
}

/// The options `cubecl-cuda` compiles with on sm_90.
fn sm90_options() -> CompilationOptions {
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            grid_constants: true,
            clusters: true,
            fast_math: true,
            fast_tanh: true,
            elect_sync: true,
        },
    }
}

/// One kernel's definition compiled to CUDA as the device would (unchecked launches), with its
/// occupancy request written into `__launch_bounds__` as the workspace's `cubecl-cuda` writes it
/// before NVRTC (`cubecl::cuda::launch_hints`).
fn cuda_source(kernel: impl CubeKernel) -> String {
    let address = kernel.address_type();
    let source = CudaCompiler::default()
        .compile(
            kernel.define(),
            &sm90_options(),
            ExecutionMode::Unchecked,
            address,
        )
        .expect("CubeCL's CUDA compiler accepts the flash kernels");
    let source = source.to_string();
    let source = cubecl_cpp::formatter::format_cpp(&source).unwrap_or(source);
    cubecl::cuda::launch_hints::apply(&source).into_owned()
}

/// The CUDA source of the three flash kernels (forward, dQ, dK/dV) for head dimension `d`,
/// `causal` or not, in `dtype` (bf16 or f16: the register kernels with `mma` and `ldmatrix`, as
/// launched on an sm_90 device; f32: the tile kernels), each as `(name, source)`.
pub fn flash_sources(d: usize, causal: bool, dtype: burn::tensor::DType) -> Vec<(String, String)> {
    let client = Codegen::client(&CodegenDevice);
    let half = matches!(dtype, burn::tensor::DType::F16 | burn::tensor::DType::BF16);
    let n = if half { 2 } else { 1 };
    let split = |pass: Pass| -> Flash {
        if half {
            super::registers::split_on(client.properties(), dtype, pass, d, n)
                .expect("the register kernels take this head dimension")
        } else {
            super::Flash::split_on(client.properties(), dtype, pass, d)
        }
    };
    let storage: StorageType = dtype.into();
    let tensor = || TensorCompilationArg { inplace: None };
    let layout = || (0..4).map(|_| ()).collect::<SequenceCompilationArg<u32>>();
    let settings = |f: &Flash| {
        KernelSettings::default()
            .cube_dim(CubeDim::new_1d((f.planes * LANES) as u32))
            .address_type(AddressType::U32)
    };
    let f = split(Pass::Forward);
    let forward = flash_forward_kernel::FlashForwardKernel::<Codegen>::new(
        settings(&f),
        client.clone(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        layout(),
        layout(),
        layout(),
        layout(),
        layout(),
        (),
        (),
        (),
        (),
        (),
        (),
        n,
        f.planes,
        f.rows,
        f.block,
        d,
        causal,
        f.cmma,
        f.registers,
        f.loads,
        storage,
    );
    let fq = split(Pass::BackwardQ);
    let backward_q = flash_backward_q_kernel::FlashBackwardQKernel::<Codegen>::new(
        settings(&fq),
        client.clone(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        layout(),
        layout(),
        layout(),
        layout(),
        layout(),
        layout(),
        (),
        (),
        (),
        (),
        (),
        (),
        n,
        fq.planes,
        fq.rows,
        fq.block,
        d,
        causal,
        fq.cmma,
        fq.registers,
        fq.loads,
        storage,
    );
    let fkv = split(Pass::BackwardKv);
    let backward_kv = flash_backward_kv_kernel::FlashBackwardKvKernel::<Codegen>::new(
        settings(&fkv),
        client.clone(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        layout(),
        layout(),
        layout(),
        layout(),
        layout(),
        layout(),
        layout(),
        (),
        (),
        (),
        (),
        (),
        (),
        n,
        fkv.planes,
        fkv.rows,
        fkv.block,
        d,
        causal,
        fkv.cmma,
        fkv.registers,
        fkv.loads,
        storage,
    );
    vec![
        ("flash_forward".into(), cuda_source(forward)),
        ("flash_backward_q".into(), cuda_source(backward_q)),
        ("flash_backward_kv".into(), cuda_source(backward_kv)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a GPU (CI's), the three kernels' CUDA source comes out as an sm_90
    /// launch would compile it: with bf16 the register kernels (`mma.m16n8k16`, `ldmatrix`), one
    /// `__global__` entry each; with f32 the tile kernels, no tensor-core instruction.
    #[test]
    fn codegen_writes_the_flash_kernels_cuda_without_a_device() {
        let half = flash_sources(64, true, burn::tensor::DType::BF16);
        assert_eq!(half.len(), 3);
        for (name, source) in &half {
            assert_eq!(source.matches("__global__").count(), 1, "{name}");
            assert!(
                source.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
                "{name}"
            );
            assert!(source.contains("ldmatrix.sync.aligned.m8n8.x4"), "{name}");
            // three cubes per multiprocessor asked of ptxas at head dim 64 (unless overridden)
            if std::env::var_os("WILDFIRE_ATTENTION_CUBES_PER_SM").is_none() {
                assert!(source.contains("__launch_bounds__(128, 3)"), "{name}");
            }
        }
        for (name, source) in flash_sources(32, false, burn::tensor::DType::F32) {
            assert_eq!(source.matches("__global__").count(), 1, "{name}");
            assert!(!source.contains("mma.sync"), "{name}");
            assert!(
                !source.contains(super::super::registers::OCCUPANCY_MARKER),
                "{name}"
            );
        }
    }

    /// The vendored `cubecl-cuda`'s rewrite: a request becomes `__launch_bounds__`' second
    /// argument; no request, a request of 0 or a signature without the bound leave the source
    /// as it is.
    #[test]
    fn an_occupancy_request_becomes_the_second_launch_bound() {
        use cubecl::cuda::launch_hints::{apply, requested};
        use std::borrow::Cow;
        let marker = super::super::registers::OCCUPANCY_MARKER;
        assert_eq!(marker, cubecl::cuda::launch_hints::MARKER);
        let src = format!(
            "extern \"C\" __global__ void __launch_bounds__(128) k(int* a) {{\n/* {marker}3 */\n}}"
        );
        assert_eq!(requested(&src), Some(3));
        assert!(apply(&src).contains("__launch_bounds__(128, 3) k(int* a)"));
        let plain = "extern \"C\" __global__ void __launch_bounds__(128) k() {}";
        assert!(matches!(apply(plain), Cow::Borrowed(_)));
        let zero = format!("__launch_bounds__(64) k() {{/* {marker}0 */}}");
        assert_eq!(requested(&zero), None);
        assert_eq!(apply(&zero), zero.as_str());
        let unbounded = format!("__global__ void k() {{/* {marker}2 */}}");
        assert_eq!(apply(&unbounded), unbounded.as_str());
    }
}
