//! AdamW with 8-bit block-quantised moments (Dettmers, Lewis, Shleifer and Zettlemoyer, "8-bit
//! Optimizers via Block-wise Quantization", ICLR 2022; the arithmetic of bitsandbytes'
//! `optimizer_update_8bit_blockwise` reference on the CPU, at the paper's block of 2,048).
//!
//! Per parameter and step: the codes are dequantised (`map[code] · absmax[block]`), the f32
//! AdamW update runs on the result ([`FusedOps::fused_adamw`], the kernel of the f32 optimizer),
//! and the new moments are quantised again — each block's absolute maximum, then each element
//! scaled by its reciprocal, clamped to ±1, and given the code of the nearest value of the map
//! (bitsandbytes' `quantize_blockwise`: `bucketize` over the midpoints of the sorted map). The
//! first moment uses bitsandbytes' signed dynamic-tree map, the second its unsigned one
//! ([`dynamic_map`]). The parameter update reads the unquantised new moments, as bitsandbytes'.
//!
//! **Blocks are global.** Block `b` is elements `2048·b ..` of the tensor's row-major flattening,
//! whatever the layout: each rank quantises its piece against the scales of the global blocks
//! it overlaps, and a block that straddles two ranks' pieces gets its absolute maximum from an
//! all-reduce (max) of the per-block maxima over the axes that split the tensor — one small
//! collective per tensor and step (`⌈numel / 2048⌉` f32), where bitsandbytes, on one device,
//! has none. So every layout quantises the same numbers to the same codes; at world size 1 no
//! collective runs. A piece must be a contiguous range of the flattening for that (a split of
//! the first non-unit dimension, as ZeRO and FSDP make): a parameter split otherwise (a
//! column-parallel weight's dim 1) keeps its state on the layout that splits dim 0 over the
//! same axes instead, and each step moves the gradient there and the new parameter back.
//!
//! Tensors under [`MIN_8BIT_SIZE`] elements keep f32 moments (bitsandbytes' `min_8bit_size`):
//! the fused AdamW step, unchanged. The codes are `u8` where the backend stores them (Flex,
//! CUDA), else the backend's `i32` (Wgpu's WGSL has no 8-bit integers: there the state saves
//! nothing, the numbers are the same). They live outside the distributed tensors, so the
//! decorator counts them, and the scales, through [`DeviceBytes`].
//!
//! A checkpoint stores the codes as f32 integers shaped like the parameter (resharded like any
//! state tensor) and the scales as `[⌈numel / 2048⌉]` tensors, so a resumed run — on any
//! layout — continues from the very codes it saved. A checkpoint of f32 AdamW moments loads
//! too: the first step quantises them.
//!
//! The block maxima, the quantisation and the dequantisation are [`FusedOps`] methods: host
//! loops on Flex (one pass each), CubeCL kernels on every CubeCL backend (Wgpu, CUDA: one launch
//! each, the map in shared memory; `wildfire_kernels::cube`), Burn ops elsewhere (a fusion
//! stream included). A step on CUDA is thus two dequantisations, the fused AdamW, two block-max
//! passes, the all-reduce where blocks straddle ranks, two quantisations and the skip masks,
//! where bitsandbytes has one fused dequantise–update–quantise kernel: its blocks never straddle
//! a device, ours may, so the maxima must be complete before any code is written. Not here:
//! stochastic rounding.

use std::sync::Arc;

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamWState, AdaptiveMomentumState, SimpleOptimizer};
use burn::prelude::*;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::{DType, IntDType, TensorPrimitive};
use serde::{Deserialize, Serialize};
use wildfire_kernels::FusedOps;
use wildfire_parallel::{
    DTensor, DeviceBytes, DeviceMesh, DistDevice, Distributed, EncodedState, Layout, Placement,
    ReduceOp, StateCodec, StateShape, StateSpec, dtensor,
};

use crate::fused_tail::{FusedAdamWConfig, TailInputs, adamw_step, on_grad_layout, on_layout};

/// Elements per quantisation block (the paper's 2,048).
pub const BLOCK: usize = wildfire_parallel::QUANT_BLOCK;

/// Tensors with fewer elements keep f32 moments (bitsandbytes' `min_8bit_size`).
pub const MIN_8BIT_SIZE: usize = wildfire_parallel::MIN_QUANT_SIZE;

/// bitsandbytes' dynamic-tree quantisation map (`create_dynamic_map(signed)`, 8 bits, up to 7
/// exponent bits): 256 sorted values in `[-1, 1]` (signed) or `[0, 1]`, dense near zero — the
/// means of `linspace(0.1, 1, k)` scaled by `10^(i-6)`, then 0 and 1. The values are
/// bitsandbytes' own, bit for bit (`engine/src/quant_maps.rs`, written by
/// `tools/adamw8bit_reference.py`): its `torch.linspace` rounds by the CPU's vector width, so
/// recomputing them here would differ from it in the last bit of some entries.
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    let bits = if signed {
        &crate::quant_maps::SIGNED
    } else {
        &crate::quant_maps::UNSIGNED
    };
    bits.map(f32::from_bits)
}

/// The midpoints between neighbouring values of a sorted map (`bucketize`'s boundaries).
fn midpoints(map: &[f32; 256]) -> Vec<f32> {
    map.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect()
}

/// Where a contiguous local piece lies in its tensor's row-major flattening.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    /// The flat index of the piece's first element.
    start: usize,
    /// The piece's elements (padding included: zeros past the tensor's end).
    len: usize,
    /// The tensor's elements.
    numel: usize,
}

impl Span {
    /// The tensor's blocks.
    fn total(&self) -> usize {
        self.numel.div_ceil(BLOCK)
    }
}

/// The distinct tensor dimensions `layout` splits.
fn split_dims(layout: &Layout) -> Vec<usize> {
    let mut dims: Vec<usize> = layout
        .placements()
        .iter()
        .filter_map(|p| match p {
            Placement::Shard(d) => Some(*d),
            _ => None,
        })
        .collect();
    dims.sort_unstable();
    dims.dedup();
    dims
}

/// `layout` if each piece is a contiguous range of a `shape` tensor's flattening (it splits at
/// most one dimension, with only unit dimensions before it), else the layout that splits dim 0
/// over the same axes.
fn flat_layout(layout: &Layout, shape: &[usize]) -> Layout {
    let contiguous = match split_dims(layout).as_slice() {
        [] => true,
        [dim] => shape[..*dim].iter().all(|&n| n == 1),
        _ => false,
    };
    if contiguous {
        return layout.clone();
    }
    Layout::new(layout.placements().iter().map(|&p| match p {
        Placement::Shard(_) => Placement::Shard(0),
        p => p,
    }))
}

/// The span of `rank`'s piece of a `shape` tensor under the contiguous `layout`.
fn span_of(layout: &Layout, shape: &[usize], mesh: &DeviceMesh, rank: usize) -> Span {
    let pieces = layout.local_box(shape, mesh, rank);
    let len = pieces.iter().map(|(_, extent)| extent).product();
    let start = match split_dims(layout).first() {
        None => 0,
        Some(&dim) => pieces[dim].0.start * shape[dim + 1..].iter().product::<usize>(),
    };
    Span {
        start,
        len,
        numel: shape.iter().product(),
    }
}

/// Where a quantised state lives: the contiguous layout, the tensor's global shape and this
/// rank's padded local shape.
#[derive(Clone, Debug)]
struct Site<X: Backend> {
    layout: Layout,
    global_shape: Vec<usize>,
    local_shape: Vec<usize>,
    device: DistDevice<X>,
}

impl<X: Backend> Site<X> {
    fn of(t: &DTensor<X>) -> Self {
        Self {
            layout: t.layout().clone(),
            global_shape: t.global_shape().to_vec(),
            local_shape: t.local_shape().to_vec(),
            device: t.device().clone(),
        }
    }

    fn span(&self) -> Span {
        let device = &self.device;
        span_of(
            &self.layout,
            &self.global_shape,
            device.mesh(),
            device.context().rank(),
        )
    }

    fn same_place(&self, other: &Self) -> bool {
        self.layout == other.layout && self.local_shape == other.local_shape
    }

    /// The layout of the block scales: replicated where the tensor is split.
    fn scale_layout(&self) -> Layout {
        wildfire_parallel::blocks_layout(&self.layout)
    }

    /// `q`'s codes as f32 integers on this layout (a checkpoint's tensor), padded shape.
    fn codes_tensor(&self, q: &Quantised<X>) -> DTensor<X> {
        let local = q.codes.clone().cast(IntDType::I32).float();
        DTensor::from_local_padded(
            shaped(local, &self.local_shape),
            self.layout.clone(),
            &self.global_shape,
            &self.device,
        )
        .unwrap_or_else(|e| wildfire_parallel::internal::raise(e))
    }

    /// `q`'s block scales as a checkpoint's tensor (replicated).
    fn scale_tensor(&self, q: &Quantised<X>) -> DTensor<X> {
        DTensor::from_local(
            q.absmax.clone().into_primitive().tensor(),
            self.scale_layout(),
            &self.device,
        )
        .unwrap_or_else(|e| wildfire_parallel::internal::raise(e))
    }

    /// The code dtype: `u8` where the backend stores it.
    fn code_dtype(&self) -> IntDType {
        if X::supports_dtype(self.device.inner(), DType::U8) {
            IntDType::U8
        } else {
            IntDType::I32
        }
    }
}

/// One moment's codes (this rank's piece, flat) and its tensor's block scales (all blocks).
#[derive(Clone)]
struct Quantised<X: Backend> {
    codes: Tensor<X, 1, Int>,
    absmax: Tensor<X, 1>,
}

/// The two moments of a tensor's 8-bit state, where they live, and their bytes in the rank's
/// accounting (opaque; never changed in place, so a record's clones share it).
pub struct QuantMoments<X: Backend> {
    m: Quantised<X>,
    v: Quantised<X>,
    site: Site<X>,
    _held: DeviceBytes,
}

/// The signed and unsigned maps and their midpoints, on a device.
struct Maps<X: Backend> {
    signed: Tensor<X, 1>,
    unsigned: Tensor<X, 1>,
    signed_mids: Tensor<X, 1>,
    unsigned_mids: Tensor<X, 1>,
}

impl<X: Backend> Maps<X> {
    fn on(device: &X::Device) -> Self {
        let upload = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<X, 1>::from_data(TensorData::new(v, [n]), device)
        };
        let (s, u) = (dynamic_map(true), dynamic_map(false));
        Self {
            signed: upload(s.to_vec()),
            unsigned: upload(u.to_vec()),
            signed_mids: upload(midpoints(&s)),
            unsigned_mids: upload(midpoints(&u)),
        }
    }
}

/// The maps, uploaded once per device and shared by an optimizer's clones (a rank steps every
/// tensor on its one device; before, each tensor's step uploaded the four tables again).
#[derive(Clone)]
struct MapCache<X: Backend>(Arc<std::sync::Mutex<Vec<DeviceMaps<X>>>>);

/// A device and the maps uploaded to it.
struct DeviceMaps<X: Backend> {
    device: X::Device,
    maps: Arc<Maps<X>>,
}

impl<X: Backend> Default for MapCache<X> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<X: Backend> std::fmt::Debug for MapCache<X> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MapCache")
    }
}

impl<X: Backend> MapCache<X> {
    fn on(&self, device: &X::Device) -> Arc<Maps<X>> {
        let mut cached = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(hit) = cached.iter().find(|c| &c.device == device) {
            return hit.maps.clone();
        }
        let maps = Arc::new(Maps::on(device));
        cached.push(DeviceMaps {
            device: device.clone(),
            maps: maps.clone(),
        });
        maps
    }
}

fn float<X: Backend, const D: usize>(t: X::FloatTensorPrimitive) -> Tensor<X, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// A flat `t` as a primitive of `shape`.
fn shaped<X: Backend>(t: Tensor<X, 1>, shape: &[usize]) -> X::FloatTensorPrimitive {
    X::float_reshape(t.into_primitive().tensor(), Shape::from(shape.to_vec()))
}

impl<X: FusedOps> Quantised<X> {
    /// The zero moment: every scale 0 (any code reads 0), the codes of 0.
    fn zero(site: &Site<X>, map: &[f32; 256]) -> Self {
        let device = site.device.inner();
        let span = site.span();
        let zero = map.iter().position(|&v| v == 0.0).expect("0 is in the map") as i64;
        Self {
            codes: Tensor::<X, 1, Int>::full([span.len], zero, device).cast(site.code_dtype()),
            absmax: Tensor::zeros([span.total()], device),
        }
    }

    /// `map[code] · absmax[block]`, flat.
    fn dequantised(&self, map: &Tensor<X, 1>, span: Span) -> Tensor<X, 1> {
        float(X::blockwise_dequantise(
            self.codes.clone().into_primitive(),
            self.absmax.clone().into_primitive().tensor(),
            map.clone().into_primitive().tensor(),
            span.start,
            BLOCK,
        ))
    }

    /// `x` (this rank's flat piece) quantised against its blocks' absolute maxima over the
    /// whole tensor (an all-reduce where a block straddles ranks).
    fn of(x: Tensor<X, 1>, mids: &Tensor<X, 1>, site: &Site<X>) -> Self {
        let span = site.span();
        let x = x.into_primitive().tensor();
        let mine = X::blockwise_absmax(x.clone(), span.start, BLOCK, span.total());
        let absmax = all_blocks(float(mine), site);
        let codes = X::blockwise_quantise(
            x,
            absmax.clone().into_primitive().tensor(),
            mids.clone().into_primitive().tensor(),
            span.start,
            BLOCK,
            site.code_dtype(),
        );
        Self {
            codes: Tensor::from_primitive(codes),
            absmax,
        }
    }

    /// `self` where `skip` (a `[1]` flag) is 0, `old` where it is not: a skipped step keeps its
    /// state's very codes.
    fn unless(self, skip: &Tensor<X, 1>, old: &Self) -> Self {
        let total = self.absmax.dims()[0];
        let keep = skip.clone().expand([total]).not_equal_elem(0.0);
        Self {
            codes: Tensor::from_primitive(X::int_unless_skipped(
                self.codes.into_primitive(),
                old.codes.clone().into_primitive(),
                skip.clone().into_primitive().tensor(),
            )),
            absmax: self.absmax.mask_where(keep, old.absmax.clone()),
        }
    }

    fn bytes(&self) -> usize {
        let size = |dtype: DType| dtype.size();
        self.codes.dims()[0] * size(self.codes.dtype()) + self.absmax.dims()[0] * 4
    }
}

/// Every rank's per-block maxima combined over the axes that split the tensor (nothing to do
/// where none does).
fn all_blocks<X: Backend>(absmax: Tensor<X, 1>, site: &Site<X>) -> Tensor<X, 1> {
    if split_dims(&site.layout).is_empty() {
        return absmax;
    }
    let partial = Layout::new(site.layout.placements().iter().map(|&p| match p {
        Placement::Shard(_) => Placement::Partial(ReduceOp::Max),
        p => p,
    }));
    let raise = |e| wildfire_parallel::internal::raise(e);
    let t = DTensor::from_local(absmax.into_primitive().tensor(), partial, &site.device)
        .unwrap_or_else(raise)
        .redistribute(&site.scale_layout())
        .unwrap_or_else(raise);
    float(t.into_local())
}

impl<X: FusedOps> QuantMoments<X> {
    fn new(m: Quantised<X>, v: Quantised<X>, site: Site<X>) -> Self {
        let held = DeviceBytes::new(site.device.context(), m.bytes() + v.bytes());
        Self {
            m,
            v,
            site,
            _held: held,
        }
    }

    fn zero(site: &Site<X>) -> Self {
        Self::new(
            Quantised::zero(site, &dynamic_map(true)),
            Quantised::zero(site, &dynamic_map(false)),
            site.clone(),
        )
    }

    /// The state from a checkpoint's codes (f32 integers, any layout) and scales.
    fn from_tensors(codes: [DTensor<X>; 2], absmax: [DTensor<X>; 2]) -> Self {
        let shape = codes[0].global_shape().to_vec();
        let flat = flat_layout(codes[0].layout(), &shape);
        let [cm, cv] = codes.map(|c| on_layout(c, &flat));
        let site = Site::of(&cm);
        let dtype = site.code_dtype();
        let codes = |c: DTensor<X>| {
            let n = site.local_shape.iter().product::<usize>();
            float::<X, 1>(c.into_local()).reshape([n]).int().cast(dtype)
        };
        let [am, av] = absmax.map(|a| {
            let whole = on_layout(a.clone(), &Layout::replicated(a.device().mesh()));
            float::<X, 1>(whole.into_local())
        });
        let m = Quantised {
            codes: codes(cm),
            absmax: am,
        };
        let v = Quantised {
            codes: codes(cv),
            absmax: av,
        };
        Self::new(m, v, site)
    }

    /// The same state on `site` (loaded for another layout than the step's: moved once).
    fn on(self: Arc<Self>, site: &Site<X>) -> Arc<Self> {
        if self.site.same_place(site) {
            return self;
        }
        let moved = |q: &Quantised<X>| on_layout(self.site.codes_tensor(q), &site.layout);
        let codes = [moved(&self.m), moved(&self.v)];
        let absmax = [
            self.site.scale_tensor(&self.m),
            self.site.scale_tensor(&self.v),
        ];
        Arc::new(Self::from_tensors(codes, absmax))
    }
}

/// `t` quantised block-wise as [`QuantAdamW`] quantises a moment (`signed`: the first
/// moment's map, else the second's), on the layout the optimizer keeps its state in: the
/// codes (f32 integers, shaped like `t`) and the `[⌈numel / 2048⌉]` block scales (replicated).
/// Whatever `t`'s layout, the gathered codes and the scales are the same.
pub fn quantise_blockwise<X: FusedOps>(t: &DTensor<X>, signed: bool) -> (DTensor<X>, DTensor<X>) {
    let flat = flat_layout(t.layout(), &t.global_shape().to_vec());
    let t = on_layout(t.clone(), &flat);
    let site = Site::of(&t);
    let maps = Maps::<X>::on(site.device.inner());
    let mids = if signed {
        &maps.signed_mids
    } else {
        &maps.unsigned_mids
    };
    let x = float::<X, 1>(X::float_reshape(
        t.into_local(),
        Shape::from(vec![site.span().len]),
    ));
    let q = Quantised::of(x, mids, &site);
    (site.codes_tensor(&q), site.scale_tensor(&q))
}

/// AdamW with 8-bit block-quantised moments (see the module docs).
#[derive(Clone, Debug)]
pub struct QuantAdamW<X: Backend> {
    config: FusedAdamWConfig,
    inputs: TailInputs<X>,
    maps: MapCache<X>,
}

/// [`QuantAdamW`] as a Burn optimizer over `Autodiff<Distributed<X>>`.
pub type QuantAdamWOptimizer<X, M> =
    OptimizerAdaptor<QuantAdamW<X>, M, burn::backend::Autodiff<Distributed<X>>>;

impl<X: FusedOps> QuantAdamW<X> {
    /// The Burn optimizer and the handle [`crate::fused_unscale_check`] fills before each step
    /// (`config`'s moment dtype is not read: the state is 8-bit, f32 for small tensors).
    pub fn optimizer<M>(config: FusedAdamWConfig) -> (QuantAdamWOptimizer<X, M>, TailInputs<X>)
    where
        M: burn::module::AutodiffModule<burn::backend::Autodiff<Distributed<X>>>,
    {
        let config = FusedAdamWConfig {
            moments: crate::MomentDtype::F32,
            ..config
        };
        crate::fused_tail::with_tail_inputs(|inputs| Self {
            config,
            inputs,
            maps: MapCache::default(),
        })
    }
}

/// One parameter's state: f32 moments (a small tensor, or a checkpoint of f32 AdamW not yet
/// quantised) or the 8-bit codes (shared by a record's clones: never changed in place).
#[derive(Clone)]
pub enum QuantAdamWState<X: Backend, const D: usize> {
    /// f32 moments (AdamW's record).
    Full(AdamWState<Distributed<X>, D>),
    /// Block-quantised moments after `time` steps.
    Blocks {
        /// Steps taken.
        time: usize,
        /// The codes and scales.
        state: Arc<QuantMoments<X>>,
    },
}

type DistParam<X, const D: usize> = Tensor<Distributed<X>, D>;

fn wrap<X: Backend, const D: usize>(t: DTensor<X>) -> DistParam<X, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

impl<X: FusedOps> SimpleOptimizer<Distributed<X>> for QuantAdamW<X> {
    type State<const D: usize> = QuantAdamWState<X, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: DistParam<X, D>,
        grad: DistParam<X, D>,
        state: Option<Self::State<D>>,
    ) -> (DistParam<X, D>, Option<Self::State<D>>) {
        let numel = dtensor(&tensor).global_shape().num_elements();
        if numel < MIN_8BIT_SIZE {
            let prior = state.map(|s| match s {
                QuantAdamWState::Full(s) => s,
                QuantAdamWState::Blocks { .. } => {
                    unreachable!("a tensor under the 8-bit size keeps f32 moments")
                }
            });
            let (t, s) = adamw_step(&self.config, &self.inputs, lr, tensor, grad, prior);
            return (t, Some(QuantAdamWState::Full(s)));
        }
        let (p, g) = on_grad_layout(&tensor, &grad);
        let back = g.layout().clone();
        let flat = flat_layout(&back, &p.global_shape().to_vec());
        let (p, g) = (on_layout(p, &flat), on_layout(g, &flat));
        let site = Site::of(&p);
        let span = site.span();
        let device = site.device.inner().clone();
        let maps = self.maps.on(&device);
        let (time, old) = match state {
            None => (1, Arc::new(QuantMoments::zero(&site))),
            Some(QuantAdamWState::Blocks { time, state }) => (time + 1, state.on(&site)),
            Some(QuantAdamWState::Full(s)) => {
                // f32 moments from a checkpoint: quantised as they are, then stepped.
                let moment = |t: DistParam<X, D>| {
                    let local = on_layout(dtensor(&t).clone(), &flat).into_local();
                    let local = X::float_cast(local, burn::tensor::FloatDType::F32);
                    float::<X, D>(local).reshape([span.len])
                };
                let m = Quantised::of(moment(s.momentum.moment_1), &maps.signed_mids, &site);
                let v = Quantised::of(moment(s.momentum.moment_2), &maps.unsigned_mids, &site);
                (
                    s.momentum.time + 1,
                    Arc::new(QuantMoments::new(m, v, site.clone())),
                )
            }
        };
        let m = old.m.dequantised(&maps.signed, span);
        let v = old.v.dequantised(&maps.unsigned, span);
        let (scale, skip) = self.inputs.scale_and_skip(&device);
        let out = X::fused_adamw(
            p.local().clone(),
            g.into_local(),
            shaped(m, &site.local_shape),
            shaped(v, &site.local_shape),
            scale,
            skip.clone(),
            self.config.step(lr, time),
        );
        let skip = float::<X, 1>(skip);
        let flat_of = |t| float::<X, 1>(t).reshape([span.len]);
        let m = Quantised::of(flat_of(out.m), &maps.signed_mids, &site).unless(&skip, &old.m);
        let v = Quantised::of(flat_of(out.v), &maps.unsigned_mids, &site).unless(&skip, &old.v);
        let new = QuantMoments::new(m, v, site);
        let p = on_layout(p.with_local(out.param), &back);
        let state = QuantAdamWState::Blocks {
            time,
            state: Arc::new(new),
        };
        (wrap(p), Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, _device: &DistDevice<X>) -> Self::State<D> {
        state
    }
}

/// The checkpoint names of the 8-bit state.
const CODES: [&str; 2] = ["moment_1_codes", "moment_2_codes"];
const SCALES: [&str; 2] = ["moment_1_absmax", "moment_2_absmax"];

impl<X: FusedOps> StateCodec<Distributed<X>> for QuantAdamW<X> {
    /// AdamW's moments (a small tensor's state, or an f32 checkpoint's), then for a tensor of
    /// at least [`MIN_8BIT_SIZE`] elements the codes and the block scales.
    fn state_specs(shape: &[usize]) -> Vec<StateSpec> {
        let mut specs = wildfire_parallel::adamw_specs();
        if shape.iter().product::<usize>() >= MIN_8BIT_SIZE {
            specs.extend(CODES.map(|n| StateSpec::new(n, StateShape::Param)));
            specs.extend(SCALES.map(|n| StateSpec::new(n, StateShape::Blocks(BLOCK))));
        }
        specs
    }

    fn encode<const D: usize>(
        state: Self::State<D>,
    ) -> Result<EncodedState<Distributed<X>>, String> {
        match state {
            QuantAdamWState::Full(s) => wildfire_parallel::encode_adamw(s),
            QuantAdamWState::Blocks { time, state } => {
                let b = &*state;
                let some = |t: DTensor<X>| Some(t);
                Ok(EncodedState {
                    steps: time,
                    tensors: vec![
                        None,
                        None,
                        some(b.site.codes_tensor(&b.m)),
                        some(b.site.codes_tensor(&b.v)),
                        some(b.site.scale_tensor(&b.m)),
                        some(b.site.scale_tensor(&b.v)),
                    ],
                })
            }
        }
    }

    fn decode<const D: usize>(
        encoded: EncodedState<Distributed<X>>,
    ) -> Result<Self::State<D>, String> {
        let steps = encoded.steps;
        let mut tensors = encoded.tensors;
        let quantised = tensors.len() == 6 && tensors[2].is_some();
        if !quantised {
            tensors.truncate(2);
            let f32_state = EncodedState { steps, tensors };
            return wildfire_parallel::decode_adamw(f32_state).map(QuantAdamWState::Full);
        }
        let names = [CODES, SCALES].concat();
        let take = |i: usize, tensors: &mut Vec<Option<DTensor<X>>>| {
            tensors[i].take().ok_or_else(|| {
                format!(
                    "8-bit AdamW's state tensor {} is not in the checkpoint",
                    names[i - 2]
                )
            })
        };
        let codes = [take(2, &mut tensors)?, take(3, &mut tensors)?];
        let absmax = [take(4, &mut tensors)?, take(5, &mut tensors)?];
        let state = QuantMoments::from_tensors(codes, absmax);
        Ok(QuantAdamWState::Blocks {
            time: steps,
            state: Arc::new(state),
        })
    }
}

/// [`QuantAdamWState`] as plain data (Burn's record serialisation): f32 moments, or the codes
/// and scales, with where they live.
#[derive(Clone, Serialize, Deserialize)]
pub struct QuantAdamWItem {
    time: usize,
    layout: Layout,
    global_shape: Vec<usize>,
    local_shape: Vec<usize>,
    quantised: bool,
    /// f32 moments, or the codes as f32 integers.
    first: Vec<f32>,
    second: Vec<f32>,
    /// The block scales (quantised only).
    scales: [Vec<f32>; 2],
}

fn host<X: Backend>(t: &DTensor<X>) -> Vec<f32> {
    float::<X, 1>(t.local().clone())
        .reshape([-1])
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 values")
}

impl<X: FusedOps, const D: usize> Record<Distributed<X>> for QuantAdamWState<X, D> {
    type Item<S: PrecisionSettings> = QuantAdamWItem;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        let (time, quantised, [a, b], scales) = match self {
            QuantAdamWState::Full(s) => {
                let m = s.momentum;
                let pair = [dtensor(&m.moment_1).clone(), dtensor(&m.moment_2).clone()];
                (m.time, false, pair, [vec![], vec![]])
            }
            QuantAdamWState::Blocks { time, state } => {
                let q = &*state;
                let scales = [&q.m, &q.v].map(|x| host(&q.site.scale_tensor(x)));
                (
                    time,
                    true,
                    [q.site.codes_tensor(&q.m), q.site.codes_tensor(&q.v)],
                    scales,
                )
            }
        };
        QuantAdamWItem {
            time,
            layout: a.layout().clone(),
            global_shape: a.global_shape().to_vec(),
            local_shape: a.local_shape().to_vec(),
            quantised,
            first: host(&a),
            second: host(&b),
            scales,
        }
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, device: &DistDevice<X>) -> Self {
        let raise = |e| wildfire_parallel::internal::raise(e);
        let upload = |values: Vec<f32>, shape: Vec<usize>, layout: Layout| {
            let local = X::float_from_data(TensorData::new(values, shape), device.inner());
            DTensor::from_local_padded(local, layout, &item.global_shape, device)
                .unwrap_or_else(raise)
        };
        let first = upload(item.first, item.local_shape.clone(), item.layout.clone());
        let second = upload(item.second, item.local_shape.clone(), item.layout.clone());
        if !item.quantised {
            return QuantAdamWState::Full(AdamWState {
                momentum: AdaptiveMomentumState {
                    time: item.time,
                    moment_1: wrap(first),
                    moment_2: wrap(second),
                    max_moment_2: None,
                },
            });
        }
        let scale = |values: Vec<f32>| {
            let n = values.len();
            let local = X::float_from_data(TensorData::new(values, [n]), device.inner());
            let layout = Layout::replicated(device.mesh());
            DTensor::from_local(local, layout, device).unwrap_or_else(raise)
        };
        let [sm, sv] = item.scales;
        let state = QuantMoments::from_tensors([first, second], [scale(sm), scale(sv)]);
        QuantAdamWState::Blocks {
            time: item.time,
            state: Arc::new(state),
        }
    }
}
