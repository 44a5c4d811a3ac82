//! Dense GEMMs on CUDA through cuBLASLt (feature `cuda`), what PyTorch, JAX and Megatron call for
//! their matrix products: CubeCL's best tuned GEMMs ran at 3× `torch.matmul`'s time on every
//! GPT-2 shape on an H100 (README, "On a GPU"). The fused kernels stay CubeCL.
//!
//! How a product runs: the call is handed to CubeCL's device thread — the thread its client
//! hands every kernel launch to — as one more task in the same queue, so it runs there after
//! the launches queued before it and before those queued after it. There the operands' CubeCL
//! buffers are resolved to device addresses (`ComputeServer::get_resource`, which also orders
//! the caller's stream after any other stream that wrote them) and the GEMM is enqueued on the
//! CUDA stream the output's storage lives on — the caller's stream, which CubeCL launches its
//! kernels on (exposed by the vendored `cubecl-cuda`'s `GpuResource::stream`,
//! `vendor/README.md`) — so it is ordered with CubeCL's kernels before and after it, and nothing
//! is synchronised. The calling thread waits for that task once (resolving the buffers from it,
//! as before, cost a blocking round trip per buffer: three or four per GEMM, each waiting for
//! every launch queued before it), or with `WILDFIRE_CUBLAS_ASYNC=1` not at all.
//!
//! Layouts: Burn's row-major `C[m, n] = A[m, k] · B[k, n]` is cuBLAS's column-major
//! `Cᵀ[n, m] = Bᵀ · Aᵀ`; an operand with unit column stride is a column-major transpose (leading
//! dimension its row stride), one with unit row stride (a transposed view, as the linear
//! backward's `xᵀ` and `wᵀ`) a column-major matrix taken with `op = T`: no copies for either.
//! Batches whose dims collapse to one stride (or broadcast, stride 0) are one strided-batched
//! call. Anything else (mixed broadcast, no unit stride, differing dtypes) is made contiguous or
//! left to Burn's matmul.
//!
//! Precision: f32 operands compute in f32 (`CUBLAS_COMPUTE_32F`, no TF32: CUDA keeps following
//! Flex), bf16 and f16 on tensor cores with f32 accumulation and an output in the inputs' dtype,
//! as `torch.matmul` under autocast — except a weight gradient under a 16-bit compute dtype
//! ([`matmul_as`], from `gemm::linear_weight_backward_into`): its f32 accumulator is written
//! as f32, the master weights' dtype, with no cast after it (PyTorch rounds it to bf16 and
//! casts it back in `AccumulateGrad`).
//!
//! State per device, on its device thread: a cuBLASLt handle, a 32 MiB workspace per CUDA
//! stream, and the plans (descriptors and the heuristic's algorithm) per shape, strides, dtype
//! and pointer alignment. They live as long as the process (a few KB per shape; their
//! destruction at thread exit would run CUDA calls from TLS destructors, where the driver may be
//! gone). A GEMM that fails on the device thread when nobody waits for it (a CUDA error after its
//! plan was made) is logged there and makes the next GEMM call panic with it.
//! `WILDFIRE_CUBLAS=0` turns the path off (Burn's CubeCL matmul then runs); a machine without
//! `libcublasLt` falls back with one warning.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

type T = CubeTensor<CudaRuntime>;

/// Workspace per stream: cuBLAS's recommendation for Hopper.
const WORKSPACE: usize = 32 << 20;

/// A cuBLASLt error as a message naming the call that failed.
fn failed(what: &'static str) -> impl Fn(lt::CublasError) -> String {
    move |e| format!("{what}: {e}")
}

/// Set one attribute from a value (descriptor, layout or preference).
macro_rules! set {
    ($f:ident, $obj:expr, $attr:expr, $value:expr, $what:literal) => {{
        let value = $value;
        // SAFETY: `$obj` is alive (made by `Plan::new`; plans are never freed); the attribute's
        // buffer is `value`.
        unsafe {
            lt::$f(
                $obj,
                $attr,
                (&value) as *const _ as *const c_void,
                std::mem::size_of_val(&value),
            )
            .map_err(failed($what))
        }
    }};
}

/// cuBLASLt calls made so far (process-wide; the tests check the path ran).
static CALLS: AtomicU64 = AtomicU64::new(0);

/// GEMMs run through cuBLASLt since start-up.
pub fn calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// Whether the cuBLASLt path is on: not turned off by `WILDFIRE_CUBLAS=0` and the library
/// loads. Asked once per process.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if std::env::var("WILDFIRE_CUBLAS").is_ok_and(|v| v == "0") {
            return false;
        }
        // cudarc panics when no candidate name loads: try its candidates first.
        let found = cudarc::get_lib_name_candidates("cublasLt")
            .iter()
            // SAFETY: loading cuBLASLt runs its initialisers, as cudarc's own load would.
            .any(|name| unsafe { libloading::Library::new(name) }.is_ok());
        if !found {
            tracing::warn!("libcublasLt not found: GEMMs run on CubeCL's matmul");
        }
        found
    })
}

/// `lhs @ rhs` (Burn's `float_matmul`: batch dims broadcast) through cuBLASLt, or `None` when
/// this product is not one it takes (the caller runs Burn's matmul).
pub fn matmul(lhs: &T, rhs: &T) -> Option<T> {
    matmul_bias(lhs, rhs, None)
}

/// `x @ w + bias` for a 2-D `x`, the bias added by the GEMM's epilogue (bias in the output's
/// dtype, contiguous), or `None`.
pub fn matmul_bias(lhs: &T, rhs: &T, bias: Option<&T>) -> Option<T> {
    let product = Product::of(lhs, rhs, bias, lhs.dtype)?;
    product.run(lhs, rhs, bias).map_err(|e| warn_once(&e)).ok()
}

/// `lhs @ rhs` written in `out`: the operands' dtype, or f32 from f16/bf16 operands — the
/// tensor cores' f32 accumulator stored as it is, not rounded to 16 bits and cast back (a
/// weight gradient under a 16-bit compute dtype, wanted in the master weights' f32: one GEMM
/// instead of a GEMM and a cast, and no rounding between). `None` when cuBLASLt does not take
/// the product.
pub fn matmul_as(lhs: &T, rhs: &T, out: DType) -> Option<T> {
    let product = Product::of(lhs, rhs, None, out)?;
    product.run(lhs, rhs, None).map_err(|e| warn_once(&e)).ok()
}

fn warn_once(e: &str) {
    static SEEN: OnceLock<()> = OnceLock::new();
    SEEN.get_or_init(|| tracing::warn!("cuBLASLt GEMM failed ({e}); Burn's matmul runs instead"));
}

/// One operand as cuBLAS sees it: column-major storage `rows × cols` with leading dim `ld`, and
/// whether the product takes it transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Operand {
    rows: u64,
    cols: u64,
    ld: i64,
    trans: bool,
    batch_stride: i64,
}

impl Operand {
    /// The matrices `[.., rows, cols]` of `dims` with element `strides`, batched against the
    /// output's dims `out`; `None` when cuBLASLt cannot read them in place.
    fn new(dims: &[usize], strides: &[usize], out: &[usize]) -> Option<Self> {
        let d = dims.len();
        let (rows, cols, ld, trans) =
            storage(dims[d - 2], dims[d - 1], strides[d - 2], strides[d - 1])?;
        Some(Self {
            rows,
            cols,
            ld,
            trans,
            batch_stride: batch_stride(dims, strides, out)?,
        })
    }
}

/// A product cuBLASLt can run: the two operands (cuBLAS's A is Burn's `rhs`, B is `lhs`), the
/// output's dims `[batch…, m, n]`, the operands' dtype and the output's, with a bias or not.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Product {
    a: Operand,
    b: Operand,
    out: Vec<usize>,
    dtype: DTypeKey,
    out_dtype: DTypeKey,
    bias: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum DTypeKey {
    F32,
    F16,
    BF16,
}

impl DTypeKey {
    fn of(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Self::F32),
            DType::F16 => Some(Self::F16),
            DType::BF16 => Some(Self::BF16),
            _ => None,
        }
    }

    fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::BF16 => DType::BF16,
        }
    }

    fn cuda(self) -> sys::cudaDataType {
        match self {
            Self::F32 => sys::cudaDataType::CUDA_R_32F,
            Self::F16 => sys::cudaDataType::CUDA_R_16F,
            Self::BF16 => sys::cudaDataType::CUDA_R_16BF,
        }
    }
}

/// A `rows × cols` matrix with element strides `(sr, sc)` as column-major storage: unit column
/// stride is the transpose stored with `ld = sr`, unit row stride the matrix itself with
/// `ld = sc` (taken transposed by the product). `None` when neither stride is 1.
fn storage(rows: usize, cols: usize, sr: usize, sc: usize) -> Option<(u64, u64, i64, bool)> {
    let (r, c) = (rows as u64, cols as u64);
    if cols == 1 || sc == 1 {
        // Row-major: column-major `cols × rows`, ld the row stride.
        let ld = if rows == 1 { cols } else { sr };
        if ld >= cols.max(1) {
            return Some((c, r, ld as i64, false));
        }
    }
    if rows == 1 || sr == 1 {
        let ld = if cols == 1 { rows } else { sc };
        if ld >= rows.max(1) {
            return Some((r, c, ld as i64, true));
        }
    }
    None
}

/// The batch stride of an operand's leading dims against the output's (of the same rank): 0
/// when they all broadcast, the innermost batch stride when they match the output and collapse
/// to one stride, `None` otherwise.
fn batch_stride(dims: &[usize], strides: &[usize], out: &[usize]) -> Option<i64> {
    let lead = dims.len() - 2;
    if dims[..lead].iter().all(|&d| d == 1) {
        return Some(0);
    }
    if dims[..lead] != out[..lead] {
        return None;
    }
    // Collapsible: stride[i] = stride[i+1]·dims[i+1] over the dims of size > 1.
    let present: Vec<usize> = (0..lead).filter(|&i| dims[i] > 1).collect();
    let inner = *present.last()?;
    for w in present.windows(2) {
        let (i, j) = (w[0], w[1]);
        let span: usize = dims[i + 1..=j].iter().product();
        if strides[i] != strides[j] * span {
            return None;
        }
    }
    Some(strides[inner] as i64)
}

impl Product {
    /// The product of `lhs [.., m, k]` and `rhs [.., k, n]` into an `out` output if cuBLASLt
    /// takes it as stored: `out` is the operands' dtype, or f32 from 16-bit operands without a
    /// bias.
    fn of(lhs: &T, rhs: &T, bias: Option<&T>, out: DType) -> Option<Self> {
        if !enabled() || lhs.dtype != rhs.dtype || lhs.qparams.is_some() || rhs.qparams.is_some() {
            return None;
        }
        let dtype = DTypeKey::of(lhs.dtype)?;
        let out_dtype = DTypeKey::of(out)?;
        if out_dtype != dtype && (out_dtype != DTypeKey::F32 || bias.is_some()) {
            return None;
        }
        let (ls, rs) = (lhs.shape(), rhs.shape());
        let (ld, rd) = (ls.as_slice(), rs.as_slice());
        if ld.len() < 2 || ld.len() != rd.len() {
            return None;
        }
        let d = ld.len();
        let (m, k, n) = (ld[d - 2], ld[d - 1], rd[d - 1]);
        if rd[d - 2] != k || m == 0 || n == 0 || k == 0 {
            return None;
        }
        let mut out: Vec<usize> = (0..d - 2).map(|i| ld[i].max(rd[i])).collect();
        if (0..d - 2).any(|i| (ld[i] != out[i] && ld[i] != 1) || (rd[i] != out[i] && rd[i] != 1)) {
            return None;
        }
        out.extend([m, n]);
        let (lst, rst) = (lhs.meta.strides(), rhs.meta.strides());
        let (lst, rst) = (&lst[..], &rst[..]);
        // cuBLAS's A = rhs as `Bᵀ [n, k]`, B = lhs as `Aᵀ [k, m]`.
        let a = Operand::new(rd, rst, &out)?;
        let b = Operand::new(ld, lst, &out)?;
        if let Some(bias) = bias {
            let fits = bias.dtype == lhs.dtype
                && d == 2
                && bias.shape().as_slice() == [n]
                && bias.meta.strides()[..] == [1];
            if !fits {
                return None;
            }
        }
        Some(Self {
            a,
            b,
            out,
            dtype,
            out_dtype,
            bias: bias.is_some(),
        })
    }

    /// The output's `(batch count, m, n)`.
    fn sizes(&self) -> (u64, u64, u64) {
        let d = self.out.len();
        let batch: usize = self.out[..d - 2].iter().product();
        (batch as u64, self.out[d - 2] as u64, self.out[d - 1] as u64)
    }

    /// Enqueue the product on the output's stream, from CubeCL's device thread (`enqueue`),
    /// after the launches this thread queued before it and before those it queues after.
    /// By default this thread waits for the call to be enqueued there (one round trip, which
    /// also waits for the launches queued before it); with `WILDFIRE_CUBLAS_ASYNC=1` it does not
    /// wait ([`asynchronous`]): a product's first call (a new shape, strides, dtype or alignment)
    /// still makes its plan on the device thread and waits for it, so that a product cuBLASLt
    /// cannot run falls back to Burn's matmul either way.
    fn run(&self, lhs: &T, rhs: &T, bias: Option<&T>) -> Result<T, String> {
        report_deferred_failure();
        let out = super::empty(lhs, Shape::from(self.out.clone()), self.out_dtype.dtype());
        let device = out.device.index;
        let runner = runner(&out.device);
        let bindings = [rhs, lhs, &out].map(|t| t.handle.clone().binding());
        let bias = bias.map(|t| t.handle.clone().binding());
        let thread = |e| format!("CubeCL's device thread: {e:?}");
        if asynchronous() {
            let key = PlanKey {
                product: self.clone(),
                align: [rhs, lhs, &out].map(|t| align(expected_address(t))),
            };
            if !KNOWN.with(|known| known.borrow().contains(&key)) {
                let first = key.clone();
                runner
                    .submit_blocking(move |_| {
                        with_device_state(device, |state| state.plan(&first).map(|_| ()))
                    })
                    .map_err(thread)??;
                KNOWN.with(|known| known.borrow_mut().insert(key.clone()));
            }
            runner.submit(move |server| {
                if let Err(e) = enqueue(server, device, key, bindings, bias) {
                    tracing::error!("a cuBLASLt GEMM failed on CubeCL's device thread: {e}");
                    *lock_failure() = Some(e);
                }
            });
        } else {
            let key = PlanKey {
                product: self.clone(),
                align: [0; 3],
            };
            runner
                .submit_blocking(move |server| enqueue(server, device, key, bindings, bias))
                .map_err(thread)??;
        }
        CALLS.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }
}

/// Whether GEMMs are handed to CubeCL's device thread without waiting
/// (`WILDFIRE_CUBLAS_ASYNC=1`; asked once per process). Off by default: on an H200 it passed
/// the GEMM and parity checks but ran GPT-2 124M slower than one wait per GEMM (162,412 against
/// 194,887 tokens/s, README "On a GPU"); `benches/gpu.sh`'s `gpt2_async` step times it.
pub fn asynchronous() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("WILDFIRE_CUBLAS_ASYNC").is_ok_and(|v| v == "1"))
}

/// CubeCL's CUDA server: its device thread runs the closures handed to [`runner`]'s handle.
type Server = <CudaRuntime as cubecl::Runtime>::Server;

/// The largest power of two (≤ 256) dividing an address.
fn align(address: u64) -> u32 {
    (1u64 << address.trailing_zeros().min(8)) as u32
}

/// A buffer's device address modulo CubeCL's allocation alignment (512 bytes on CUDA: pages and
/// the slices in them start at multiples of it), known without asking the device thread: its
/// offset into its slice.
fn expected_address(t: &T) -> u64 {
    t.handle.offset_start.unwrap_or(0)
}

/// This thread's handle to `device`'s CubeCL device thread (the one its client submits to).
fn runner(device: &cubecl::cuda::CudaDevice) -> cubecl::device_handle::DeviceHandle<Server> {
    use cubecl::device::Device;
    RUNNERS.with(|runners| {
        let mut runners = runners.borrow_mut();
        match runners.iter().find(|(index, _)| *index == device.index) {
            Some((_, runner)) => runner.clone(),
            None => {
                let runner = cubecl::device_handle::DeviceHandle::<Server>::new(device.to_id());
                runners.push((device.index, runner.clone()));
                runner
            }
        }
    })
}

/// On the device thread: resolve the buffers on the caller's stream (CubeCL orders that stream
/// after any other that wrote them) and enqueue the GEMM there.
fn enqueue(
    server: &mut Server,
    device: usize,
    mut key: PlanKey,
    bindings: [cubecl::server::Binding; 3],
    bias: Option<cubecl::server::Binding>,
) -> Result<(), String> {
    use cubecl::server::ComputeServer;
    let stream_id = cubecl::stream_id::StreamId::current();
    let mut resource = |b| {
        server
            .get_resource(b, stream_id)
            .map_err(|e| format!("CubeCL get_resource: {e:?}"))
    };
    let [a, b, d] = bindings;
    let (a, b, d) = (resource(a)?, resource(b)?, resource(d)?);
    let bias = bias.map(&mut resource).transpose()?;
    let (a_ptr, b_ptr, d_ptr) = (a.resource().ptr, b.resource().ptr, d.resource().ptr);
    let stream = d.resource().stream;
    if stream.is_null() {
        return Err("the output buffer has no stream".into());
    }
    // The addresses' alignment as they are (an asynchronous call's key was expected from the
    // offsets, equal unless CubeCL's allocations were aligned otherwise: then the plan for
    // these is made here).
    key.align = [align(a_ptr), align(b_ptr), align(d_ptr)];
    with_device_state(device, |state| {
        let workspace = state.workspace(stream as usize)?;
        let handle = state.handle;
        let plan = state.plan(&key)?;
        // The plan's bias epilogue reads this call's bias (a cached plan holds an earlier's).
        if let Some(bias) = &bias {
            set!(
                set_matmul_desc_attribute,
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                bias.resource().ptr as *const c_void,
                "BIAS_POINTER"
            )?;
        }
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the descriptors and algorithm were made for these shapes, strides, dtype
        // and alignments; the buffers hold them (CubeCL sized them from the same metadata)
        // and are kept alive (`a`, `b`, `d`, `bias`) until the call is enqueued — after it
        // CubeCL orders any reuse of their memory on this same stream; the workspace is this
        // stream's, used on it only.
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                (&alpha) as *const f32 as *const c_void,
                (&beta) as *const f32 as *const c_void,
                a_ptr as *const c_void,
                plan.a,
                b_ptr as *const c_void,
                plan.b,
                d_ptr as *const c_void,
                plan.d,
                d_ptr as *mut c_void,
                plan.d,
                &plan.algo,
                workspace as *mut c_void,
                WORKSPACE,
                stream as sys::cudaStream_t,
            )
            .map_err(|e| format!("cublasLtMatmul: {e}"))
        }
    })
}

/// A failure of a GEMM already handed to the device thread (its output was never written),
/// reported by the next GEMM call of any thread.
static FAILURE: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

fn lock_failure() -> std::sync::MutexGuard<'static, Option<String>> {
    FAILURE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Panics with an earlier enqueued GEMM's failure: the tensor it should have written holds
/// garbage, and nothing computed from it can be trusted.
fn report_deferred_failure() {
    if let Some(e) = lock_failure().take() {
        panic!("a cuBLASLt GEMM enqueued earlier failed on CubeCL's device thread: {e}");
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    product: Product,
    /// The largest power of two (≤ 256) dividing each address: A, B, D.
    align: [u32; 3],
}

/// A product's descriptors and the algorithm cuBLASLt's heuristic chose.
#[derive(Clone, Copy)]
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Plan {
    /// The plan of `key` (with a bias epilogue whose address each call sets, `enqueue`).
    fn new(handle: sys::cublasLtHandle_t, key: &PlanKey) -> Result<Self, String> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        use sys::cublasLtMatrixLayoutAttribute_t as L;
        let p = &key.product;
        let dtype = p.dtype.cuda();
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(failed("cublasLtMatmulDescCreate"))?;
        // `cublasOperation_t` (cuBLAS's header, not cuBLASLt's bindings): N = 0, T = 1, an i32.
        let op = |t: bool| -> i32 { t as i32 };
        set!(
            set_matmul_desc_attribute,
            desc,
            D::CUBLASLT_MATMUL_DESC_TRANSA,
            op(p.a.trans),
            "TRANSA"
        )?;
        set!(
            set_matmul_desc_attribute,
            desc,
            D::CUBLASLT_MATMUL_DESC_TRANSB,
            op(p.b.trans),
            "TRANSB"
        )?;
        if p.bias {
            set!(
                set_matmul_desc_attribute,
                desc,
                D::CUBLASLT_MATMUL_DESC_EPILOGUE,
                sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                "EPILOGUE"
            )?;
            set!(
                set_matmul_desc_attribute,
                desc,
                D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                dtype,
                "BIAS_DATA_TYPE"
            )?;
        }
        let (batch, m, n) = p.sizes();
        let layout = |dtype, rows: u64, cols: u64, ld: i64, stride: i64| -> Result<_, String> {
            let l = lt::create_matrix_layout(dtype, rows, cols, ld)
                .map_err(failed("cublasLtMatrixLayoutCreate"))?;
            if batch > 1 {
                set!(
                    set_matrix_layout_attribute,
                    l,
                    L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    batch as i32,
                    "BATCH_COUNT"
                )?;
                set!(
                    set_matrix_layout_attribute,
                    l,
                    L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    stride,
                    "STRIDED_BATCH_OFFSET"
                )?;
            }
            Ok(l)
        };
        let a = layout(dtype, p.a.rows, p.a.cols, p.a.ld, p.a.batch_stride)?;
        let b = layout(dtype, p.b.rows, p.b.cols, p.b.ld, p.b.batch_stride)?;
        // D (and C, the same): Burn's contiguous `[m, n]` is column-major `n × m`, in the
        // output's dtype (f32 from 16-bit operands: cuBLASLt's `CUBLAS_COMPUTE_32F` with
        // A/B `CUDA_R_16BF`/`16F` and C/D `CUDA_R_32F`).
        let d = layout(p.out_dtype.cuda(), n, m, n as i64, (m * n) as i64)?;
        let pref = lt::create_matmul_pref().map_err(failed("cublasLtMatmulPreferenceCreate"))?;
        set!(
            set_matmul_pref_attribute,
            pref,
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            WORKSPACE as u64,
            "MAX_WORKSPACE_BYTES"
        )?;
        // C is D (beta 0, written in place).
        let [aa, ab, ad] = key.align;
        for (attr, align) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aa),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ab),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ad),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ad),
        ] {
            set!(
                set_matmul_pref_attribute,
                pref,
                attr,
                align,
                "MIN_ALIGNMENT"
            )?;
        }
        // SAFETY: every descriptor was created above and is alive.
        let heuristic = unsafe { lt::get_matmul_algo_heuristic(handle, desc, a, b, d, d, pref) }
            .map_err(failed("cublasLtMatmulAlgoGetHeuristic"))?;
        // SAFETY: created above, used no more.
        unsafe { lt::destroy_matmul_pref(pref) }
            .map_err(failed("cublasLtMatmulPreferenceDestroy"))?;
        Ok(Self {
            desc,
            a,
            b,
            d,
            algo: heuristic.algo,
        })
    }
}

/// A device's cuBLASLt handle, plans and workspaces (one per CUDA stream: two streams' GEMMs
/// may run at once), on its CubeCL device thread.
struct DeviceState {
    device: usize,
    handle: sys::cublasLtHandle_t,
    workspaces: HashMap<usize, u64>,
    plans: HashMap<PlanKey, Plan>,
    _ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl DeviceState {
    /// `key`'s plan, made on first use.
    fn plan(&mut self, key: &PlanKey) -> Result<Plan, String> {
        if let Some(plan) = self.plans.get(key) {
            return Ok(*plan);
        }
        let plan = Plan::new(self.handle, key)?;
        self.plans.insert(key.clone(), plan);
        Ok(plan)
    }

    /// The workspace of `stream`, allocated on first use.
    fn workspace(&mut self, stream: usize) -> Result<u64, String> {
        if let Some(w) = self.workspaces.get(&stream) {
            return Ok(*w);
        }
        // SAFETY: the device's primary context (CubeCL's) is current on this thread.
        let w = unsafe { cudarc::driver::result::malloc_sync(WORKSPACE) }
            .map_err(|e| format!("CUDA: {e}"))?;
        self.workspaces.insert(stream, w);
        Ok(w)
    }
}

/// `f` on `device`'s state of this (device) thread, made on first use.
fn with_device_state<R>(
    device: usize,
    f: impl FnOnce(&mut DeviceState) -> Result<R, String>,
) -> Result<R, String> {
    let cuda = |e: cudarc::driver::DriverError| format!("CUDA: {e}");
    STATE.with(|state| {
        let mut state = state.borrow_mut();
        let at = match state.iter().position(|t| t.device == device) {
            Some(at) => at,
            None => {
                let ctx = cudarc::driver::CudaContext::new(device).map_err(cuda)?;
                ctx.bind_to_thread().map_err(cuda)?;
                let handle = lt::create_handle().map_err(failed("cublasLtCreate"))?;
                state.push(DeviceState {
                    device,
                    handle,
                    workspaces: HashMap::new(),
                    plans: HashMap::new(),
                    _ctx: ctx,
                });
                state.len() - 1
            }
        };
        let entry = &mut state[at];
        entry._ctx.bind_to_thread().map_err(cuda)?;
        f(entry)
    })
}

thread_local! {
    /// On CubeCL's device threads: each device's cuBLASLt state.
    static STATE: RefCell<Vec<DeviceState>> = const { RefCell::new(Vec::new()) };
    /// On the calling threads: the handles to the device threads, by device index.
    static RUNNERS: RefCell<Vec<(usize, cubecl::device_handle::DeviceHandle<Server>)>> =
        const { RefCell::new(Vec::new()) };
    /// On the calling threads: the plans known to exist on the device thread.
    static KNOWN: RefCell<std::collections::HashSet<PlanKey>> =
        RefCell::new(std::collections::HashSet::new());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_reads_row_and_column_major() {
        // [4, 3] row-major: column-major 3 × 4, ld 3, not transposed.
        assert_eq!(storage(4, 3, 3, 1), Some((3, 4, 3, false)));
        // Its transposed view [3, 4] with strides (1, 3): column-major 3 × 4, ld 3, transposed.
        assert_eq!(storage(3, 4, 1, 3), Some((3, 4, 3, true)));
        // A padded row stride.
        assert_eq!(storage(4, 3, 8, 1), Some((3, 4, 8, false)));
        // Single rows and columns whatever their unused stride.
        assert_eq!(storage(1, 5, 0, 1), Some((5, 1, 5, false)));
        assert_eq!(storage(5, 1, 1, 0), Some((1, 5, 1, false)));
        // No unit stride.
        assert_eq!(storage(4, 3, 6, 2), None);
    }

    #[test]
    fn batch_strides_collapse_or_broadcast() {
        // [2, 3, m, k] contiguous (m·k = 12): one stride 12.
        assert_eq!(
            batch_stride(&[2, 3, 4, 3], &[36, 12, 3, 1], &[2, 3, 4, 5]),
            Some(12)
        );
        // Broadcast weight [1, 1, k, n].
        assert_eq!(
            batch_stride(&[1, 1, 3, 5], &[15, 15, 5, 1], &[2, 3, 4, 5]),
            Some(0)
        );
        // Head-transposed [b, h, t, d] view of [b, t, h, d]: b and h do not collapse.
        assert_eq!(
            batch_stride(&[2, 3, 4, 5], &[60, 5, 15, 1], &[2, 3, 4, 4]),
            None
        );
        // Mixed broadcast: [2, 1, ..] against [2, 3, ..].
        assert_eq!(
            batch_stride(&[2, 1, 4, 3], &[12, 12, 3, 1], &[2, 3, 4, 5]),
            None
        );
    }
}
