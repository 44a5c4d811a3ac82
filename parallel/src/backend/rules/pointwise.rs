//! Elementwise ops (PyTorch DTensor's `_pointwise_ops`): unary ops, broadcasting binary ops,
//! ops along one whole dim (softmax, cumsum, sort), and the masked fills.

use super::{dims, local_range, to_layout, whole_dim, without_partials, wrap};
use crate::backend::prelude::*;
use crate::device::DistDevice;
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use Placement::{Local, Partial, Replicate, Shard};
use burn_backend::{DType, TensorMetadata};

/// Whether a unary op commutes with sums (so `Partial(Sum | Avg)` may pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Linearity {
    /// `f(a + b) = f(a) + f(b)`.
    Linear,
    /// Anything else.
    NonLinear,
}

/// How a binary elementwise op treats `Partial` operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BinaryKind {
    /// `Partial ± Partial` stays partial.
    Add,
    /// `Partial * Replicate` (either side) stays partial.
    Mul,
    /// `Partial / Replicate` stays partial.
    Div,
    /// Every partial operand is reduced first.
    NonLinear,
}

/// How an elementwise op is distributed: the rule that runs it and what passes through it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pointwise {
    /// [`unary`], with the op's linearity.
    Unary(Linearity),
    /// [`binary`], with the op's treatment of partial operands.
    Binary(BinaryKind),
    /// [`dim_local`]: the op works along one dim (softmax, cumsum, sort).
    AlongDim,
}

use Linearity::{Linear, NonLinear};
use Pointwise::{AlongDim, Binary, Unary};

/// Every elementwise op of Burn's op traits and its rule: which ops are linear (may take and
/// give `Partial` values) is decided here and nowhere else. `tools/gen_forward.py` reads this
/// table to forward each op to its rule; the generated code reads each op's linearity or kind
/// back from it at compile time (`const { rules::linearity("float_neg") }`), so an op the
/// generator forwards that this table lacks does not compile.
pub(crate) const POINTWISE_OPS: &[(&str, Pointwise)] = &[
    // Unary, linear: a partial sum passes.
    ("float_neg", Unary(Linear)),
    ("float_mul_scalar", Unary(Linear)),
    ("float_div_scalar", Unary(Linear)),
    ("float_detach", Unary(Linear)),
    // Unary, non-linear: a partial value is reduced first.
    ("float_add_scalar", Unary(NonLinear)),
    ("float_sub_scalar", Unary(NonLinear)),
    ("float_clamp_min", Unary(NonLinear)),
    ("float_clamp_max", Unary(NonLinear)),
    ("float_clamp", Unary(NonLinear)),
    ("float_recip", Unary(NonLinear)),
    ("float_exp", Unary(NonLinear)),
    ("float_log", Unary(NonLinear)),
    ("float_log1p", Unary(NonLinear)),
    ("float_powi_scalar", Unary(NonLinear)),
    ("float_powi_scalar_impl", Unary(NonLinear)),
    ("float_powf_scalar", Unary(NonLinear)),
    ("float_powf_scalar_impl", Unary(NonLinear)),
    ("float_sqrt", Unary(NonLinear)),
    ("float_abs", Unary(NonLinear)),
    ("float_cos", Unary(NonLinear)),
    ("float_sin", Unary(NonLinear)),
    ("float_tan", Unary(NonLinear)),
    ("float_cosh", Unary(NonLinear)),
    ("float_sinh", Unary(NonLinear)),
    ("float_tanh", Unary(NonLinear)),
    ("float_acos", Unary(NonLinear)),
    ("float_acosh", Unary(NonLinear)),
    ("float_asin", Unary(NonLinear)),
    ("float_asinh", Unary(NonLinear)),
    ("float_atan", Unary(NonLinear)),
    ("float_atanh", Unary(NonLinear)),
    ("float_round", Unary(NonLinear)),
    ("float_floor", Unary(NonLinear)),
    ("float_ceil", Unary(NonLinear)),
    ("float_trunc", Unary(NonLinear)),
    ("float_erf", Unary(NonLinear)),
    ("float_sign", Unary(NonLinear)),
    ("float_remainder_scalar", Unary(NonLinear)),
    ("leaky_relu", Unary(NonLinear)),
    ("relu", Unary(NonLinear)),
    ("gelu", Unary(NonLinear)),
    ("sigmoid", Unary(NonLinear)),
    ("hard_sigmoid", Unary(NonLinear)),
    ("log_sigmoid", Unary(NonLinear)),
    // Binary, broadcasting.
    ("float_add", Binary(BinaryKind::Add)),
    ("float_sub", Binary(BinaryKind::Add)),
    ("float_mul", Binary(BinaryKind::Mul)),
    ("float_div", Binary(BinaryKind::Div)),
    ("float_powf", Binary(BinaryKind::NonLinear)),
    ("float_atan2", Binary(BinaryKind::NonLinear)),
    ("float_remainder", Binary(BinaryKind::NonLinear)),
    ("relu_backward", Binary(BinaryKind::NonLinear)),
    ("gelu_backward", Binary(BinaryKind::NonLinear)),
    ("sigmoid_backward", Binary(BinaryKind::NonLinear)),
    ("log_sigmoid_backward", Binary(BinaryKind::NonLinear)),
    // Along one dim, which must be whole.
    ("softmax", AlongDim),
    ("log_softmax", AlongDim),
    ("softmin", AlongDim),
    ("float_cumsum", AlongDim),
    ("float_cumprod", AlongDim),
    ("float_cummin", AlongDim),
    ("float_cummax", AlongDim),
    ("float_sort", AlongDim),
];

/// The entry of `op` in [`POINTWISE_OPS`] (a compile-time error in a `const` block when absent).
const fn pointwise(op: &str) -> Pointwise {
    let mut i = 0;
    while i < POINTWISE_OPS.len() {
        if str_eq(POINTWISE_OPS[i].0, op) {
            return POINTWISE_OPS[i].1;
        }
        i += 1;
    }
    panic!("not an elementwise op of rules::POINTWISE_OPS")
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The linearity of unary op `op`, from [`POINTWISE_OPS`].
pub(crate) const fn linearity(op: &str) -> Linearity {
    match pointwise(op) {
        Unary(linearity) => linearity,
        _ => panic!("not a unary op in rules::POINTWISE_OPS"),
    }
}

/// The kind of binary op `op`, from [`POINTWISE_OPS`].
pub(crate) const fn binary_kind(op: &str) -> BinaryKind {
    match pointwise(op) {
        Binary(kind) => kind,
        _ => panic!("not a binary op in rules::POINTWISE_OPS"),
    }
}

/// `op`, checked to be an op along one dim in [`POINTWISE_OPS`].
pub(crate) const fn along_dim(op: &'static str) -> &'static str {
    match pointwise(op) {
        AlongDim => op,
        _ => panic!("not an op along one dim in rules::POINTWISE_OPS"),
    }
}

pub(crate) fn unary<B: Backend>(
    op: &'static str,
    t: DTensor<B>,
    linearity: Linearity,
    f: impl FnOnce(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> DTensor<B> {
    let t = t.settled();
    let target = without_partials(&t.layout, |p| {
        linearity == Linearity::Linear && p.is_linear_partial()
    });
    let t = to_layout(op, t, &target);
    // Elementwise: the shape is the input's (a padded shard's cannot be read off its piece).
    let DTensor { local, meta } = t;
    DTensor::fresh_from(f(local), meta)
}

/// The inner backend's `require_grad` flag (the identity on a backend without autodiff, as
/// under `Autodiff<Distributed<B>>`). An offloaded parameter stays in host memory: `valid()`
/// and the optimizer's adaptor set the flag on every parameter, and an upload for it would put
/// the piece back on the device for nothing.
pub(crate) fn float_set_require_grad<B: Backend>(
    tensor: DTensor<B>,
    require_grad: bool,
) -> DTensor<B> {
    const OP: &str = "float_set_require_grad";
    if tensor.is_offloaded() {
        return tensor;
    }
    unary(OP, tensor, Linearity::Linear, |t| {
        B::float_set_require_grad(t, require_grad)
    })
}

/// A cast: elementwise and linear (partial sums pass, padded shards stay), counted in
/// [`OpCounters::casts`](crate::OpCounters) when the dtype changes.
pub(crate) fn float_cast<B: Backend>(tensor: DTensor<B>, dtype: FloatDType) -> DTensor<B> {
    const OP: &str = "float_cast";
    if FloatDType::from(tensor.local.dtype()) != dtype {
        tensor.device.ctx.count_cast(OP);
    }
    unary(OP, tensor, Linearity::Linear, |t| B::float_cast(t, dtype))
}

/// Decide one mesh axis of a broadcasting elementwise op: (lhs target, rhs target, output).
fn decide_elementwise(
    mut pl: Placement,
    mut pr: Placement,
    kind: BinaryKind,
    gl: &[usize],
    gr: &[usize],
    sequence: Option<usize>,
) -> (Placement, Placement, Placement) {
    // Partial operands first.
    match (pl, pr) {
        (Partial(p), Partial(q)) if kind == BinaryKind::Add && p == q && pl.is_linear_partial() => {
            return (pl, pr, pl);
        }
        (Partial(_), Replicate)
            if matches!(kind, BinaryKind::Mul | BinaryKind::Div) && pl.is_linear_partial() =>
        {
            return (pl, pr, pl);
        }
        (Replicate, Partial(_)) if kind == BinaryKind::Mul && pr.is_linear_partial() => {
            return (pl, pr, pr);
        }
        _ => {}
    }
    // Sequence parallelism: a partial sum meeting a residual add is reduce-scattered over the
    // sequence instead of all-reduced.
    let reduced = match sequence {
        Some(d) if kind == BinaryKind::Add => Shard(d),
        _ => Replicate,
    };
    if matches!(pl, Partial(_)) {
        pl = reduced;
    }
    if matches!(pr, Partial(_)) {
        pr = reduced;
    }
    let shard_for = |d: usize, g: &[usize]| if g[d] == 1 { Replicate } else { Shard(d) };
    match (pl, pr) {
        (Local, Local) | (Local, Replicate) | (Replicate, Local) => (pl, pr, Local),
        (Local, _) => (Local, Replicate, Local),
        (_, Local) => (Replicate, Local, Local),
        (Replicate, Replicate) => (Replicate, Replicate, Replicate),
        (Shard(d), Shard(e)) if d == e => (pl, pr, pl),
        (Shard(d), _) => (pl, shard_for(d, gr), pl),
        (_, Shard(d)) => (shard_for(d, gl), pr, pr),
        (Partial(_), _) | (_, Partial(_)) => unreachable!("partials were reduced above"),
    }
}

/// A partial sum about to be broadcast to `elements` values is reduced first, while it is small
/// (the row sums of a softmax over a split vocabulary: `N` values, not `N × vocab`).
pub(super) fn reduced_before_broadcast<B: Backend>(
    op: &'static str,
    t: DTensor<B>,
    elements: usize,
) -> DTensor<B> {
    if elements > t.shape.num_elements() && t.layout.has_partial() {
        let target = without_partials(&t.layout, |_| false);
        to_layout(op, t.settled(), &target)
    } else {
        t
    }
}

/// Sequence parallelism: `(axis, 1)` when it is on and both operands are `[b, t, d]` activations
/// (broadcasting on the other dims: a `[1, t, d]` position embedding) whose sequence divides by
/// the axis size.
pub(super) fn sequence_dim<B: Backend>(
    device: &DistDevice<B>,
    gl: &[usize],
    gr: &[usize],
) -> Option<(usize, usize)> {
    let axis = device.ctx.with_policy(|p| p.sequence_parallel)?;
    (gl.len() == 3
        && gl.len() == gr.len()
        && gl[1] == gr[1]
        && gl[1].is_multiple_of(device.mesh().axis_size(axis)))
    .then_some((axis, 1))
}

/// Align the two operands of an elementwise op; returns them and the output layout.
fn align2<B: Backend>(
    op: &'static str,
    lhs: DTensor<B>,
    rhs: DTensor<B>,
    kind: BinaryKind,
) -> (DTensor<B>, DTensor<B>, Layout) {
    let (lhs, rhs) = (lhs.settled(), rhs.settled());
    let (gl, gr) = (dims(&lhs), dims(&rhs));
    let numel = |g: &[usize]| g.iter().product::<usize>();
    let lhs = reduced_before_broadcast(op, lhs, numel(&gr));
    let rhs = reduced_before_broadcast(op, rhs, numel(&gl));
    let mut tl = lhs.layout.clone();
    let mut tr = rhs.layout.clone();
    let mut out = lhs.layout.clone();
    let sp = sequence_dim(&lhs.device, &gl, &gr);
    for a in 0..tl.len() {
        let sequence = sp.filter(|&(axis, _)| axis == a).map(|(_, d)| d);
        let (l, r, o) = decide_elementwise(
            lhs.layout.get(a),
            rhs.layout.get(a),
            kind,
            &gl,
            &gr,
            sequence,
        );
        tl.set(a, l);
        tr.set(a, r);
        out.set(a, o);
    }
    (to_layout(op, lhs, &tl), to_layout(op, rhs, &tr), out)
}

pub(crate) fn binary<B: Backend>(
    op: &'static str,
    lhs: DTensor<B>,
    rhs: DTensor<B>,
    kind: BinaryKind,
    f: impl FnOnce(B::FloatTensorPrimitive, B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> DTensor<B> {
    // The common case first, without the alignment's allocations and policy reads: operands in
    // hand, of one shape and dtype, laid out alike with no axis split or partial — every rule
    // leaves them as they are and the output has their layout.
    if plain_pair(&lhs, &rhs) {
        let DTensor { local: l, meta } = lhs;
        return DTensor::fresh_from(f(l, rhs.local), meta);
    }
    let (lhs, rhs, out) = align2(op, lhs, rhs, kind);
    // Broadcasting: the output's shape from the operands' (padded shards cannot tell it).
    let shape: Vec<usize> = dims(&lhs)
        .iter()
        .zip(dims(&rhs))
        .map(|(&l, r)| if l == 1 { r } else { l })
        .collect();
    let device = lhs.device.clone();
    // An f32 stream plus a 16-bit branch of its shape: one pass where a kernel does it (the
    // cast and the add it replaces, bit for bit), no cast copy kept.
    if op == "float_add"
        && lhs.local.dtype() != rhs.local.dtype()
        && lhs.awaited.is_none()
        && rhs.awaited.is_none()
    {
        let (l, r) = (lhs.local.clone(), rhs.local.clone());
        if let Ok(sum) = wildfire_kernels::gemm::add_widened::<B>(l, r) {
            return DTensor::new_shaped(sum, out, Shape::from(shape), device);
        }
    }
    let (l, r) = promoted(op, lhs, rhs);
    DTensor::new_shaped(as_rows::<B>(l, r, f), out, Shape::from(shape), device)
}

/// `f` of two local pieces of one rank where one broadcasts over leading dims of size 1 against
/// the other's trailing block (`[b, t, d] + [1, t, d]`: a GPT's token plus position embeddings):
/// run on both viewed as rows (`[b, t·d] + [1, t·d]`), one shared row, which Flex's broadcasting
/// kernel runs as a vector loop where the 3-D broadcast walks its strided iterator element by
/// element. The same elementwise op on the same pairs: the same numbers. Any other pair of
/// shapes is `f` as it is.
fn as_rows<B: Backend>(
    l: B::FloatTensorPrimitive,
    r: B::FloatTensorPrimitive,
    f: impl FnOnce(B::FloatTensorPrimitive, B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> B::FloatTensorPrimitive {
    let (ls, rs) = (l.shape(), r.shape());
    match row_split(&ls, &rs) {
        Some(k) => {
            let rows = |s: &Shape| {
                Shape::from([s[..k].iter().product(), s[k..].iter().product::<usize>()])
            };
            let out = if ls[..k].iter().product::<usize>() >= rs[..k].iter().product() {
                ls.clone()
            } else {
                rs.clone()
            };
            let (l, r) = (
                B::float_reshape(l, rows(&ls)),
                B::float_reshape(r, rows(&rs)),
            );
            B::float_reshape(f(l, r), out)
        }
        None => f(l, r),
    }
}

/// Where two shapes of one rank split into leading dims of which one side's are all 1 and at
/// least two equal trailing dims (see [`as_rows`]): the first trailing dim, or `None`.
fn row_split(l: &[usize], r: &[usize]) -> Option<usize> {
    let n = l.len();
    if n < 3 || r.len() != n || l == r {
        return None;
    }
    // The equal trailing dims.
    let k = (0..n).rev().take_while(|&d| l[d] == r[d]).last()?;
    let ones = |s: &[usize]| s[..k].iter().all(|&x| x == 1);
    (n - k >= 2 && (ones(l) || ones(r))).then_some(k)
}

/// Whether `lhs ∘ rhs` needs no alignment: both in hand (no reduction in flight), the same
/// global shape (no broadcast), the same dtype (no promotion), the same layout of only `Local`
/// and `Replicate` placements (nothing to redistribute, nothing partial: no memo to consult).
#[inline]
fn plain_pair<B: Backend>(lhs: &DTensor<B>, rhs: &DTensor<B>) -> bool {
    lhs.awaited.is_none()
        && rhs.awaited.is_none()
        && lhs.meta.same_plain_form(&rhs.meta)
        && lhs.local.dtype() == rhs.local.dtype()
}

/// The operands' local pieces in one dtype: the wider of the two where they differ (type
/// promotion, as PyTorch's for `bf16 + f32`: a residual stream in f32 meeting a bf16 branch under
/// the precision policy, or gradients of both kinds summed), the narrower one cast once per value.
fn promoted<B: Backend>(
    op: &'static str,
    lhs: DTensor<B>,
    rhs: DTensor<B>,
) -> (B::FloatTensorPrimitive, B::FloatTensorPrimitive) {
    let (dl, dr) = (lhs.local.dtype(), rhs.local.dtype());
    if dl == dr {
        return (lhs.local, rhs.local);
    }
    let width = |d: DType| match d {
        DType::F64 => 3,
        DType::F32 => 2,
        _ => 1,
    };
    let wide = match width(dl).cmp(&width(dr)) {
        std::cmp::Ordering::Greater => dl,
        std::cmp::Ordering::Less => dr,
        std::cmp::Ordering::Equal => DType::F32, // bf16 with f16
    };
    let wide = FloatDType::from(wide);
    (lhs.local_in(op, wide), rhs.local_in(op, wide))
}

/// An op that works along `dim` (softmax, cumsum, sort): that dim must be whole and no operand
/// partial; every other placement passes.
pub(crate) fn dim_local<B: Backend>(
    op: &'static str,
    t: DTensor<B>,
    dim: usize,
    f: impl FnOnce(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> DTensor<B> {
    let target = whole_dim(&t.layout, dim);
    let t = to_layout(op, t, &target);
    let DTensor { local, meta } = t;
    DTensor::fresh_from(f(local), meta)
}

/// Slice a per-rank (full) bool mask to the local piece of a tensor laid out as `layout`.
fn slice_mask<B: Backend>(
    mask: B::BoolTensorPrimitive,
    layout: &Layout,
    global: &[usize],
    device: &DistDevice<B>,
) -> B::BoolTensorPrimitive {
    let mask_dims = mask.shape().to_vec();
    let offset = global.len() - mask_dims.len();
    let mut slices: Vec<Slice> = mask_dims
        .iter()
        .map(|&s| Slice::new(0, Some(s as isize), 1))
        .collect();
    let mut any = false;
    for d in offset..global.len() {
        if layout.shards_of(d, device.mesh()) > 1 && mask_dims[d - offset] == global[d] {
            slices[d - offset] = local_range(layout, d, global[d], device);
            any = true;
        }
    }
    if any {
        B::bool_slice(mask, &slices)
    } else {
        mask
    }
}

pub(crate) fn float_mask_fill<B: Backend>(
    tensor: DTensor<B>,
    mask: B::BoolTensorPrimitive,
    value: Scalar,
) -> DTensor<B> {
    let target = without_partials(&tensor.layout, |_| false);
    let t = to_layout("float_mask_fill", tensor, &target);
    let mask = slice_mask(mask, &t.layout, &t.shape.to_vec(), &t.device);
    wrap(
        B::float_mask_fill(t.local, mask, value),
        t.meta.layout.clone(),
        t.meta.device.clone(),
    )
}

pub(crate) fn float_mask_where<B: Backend>(
    tensor: DTensor<B>,
    mask: B::BoolTensorPrimitive,
    value: DTensor<B>,
) -> DTensor<B> {
    let (t, v, out) = align2("float_mask_where", tensor, value, BinaryKind::NonLinear);
    let global = out.global_shape(&t.local.shape().to_vec(), t.device.mesh());
    let mask = slice_mask(mask, &out, &global, &t.device);
    wrap(
        B::float_mask_where(t.local, mask, v.local),
        out,
        t.meta.device.clone(),
    )
}

#[cfg(test)]
mod tests {
    use super::row_split;

    #[test]
    fn rows_split_where_one_side_broadcasts_a_trailing_block() {
        assert_eq!(row_split(&[4, 64, 128], &[1, 64, 128]), Some(1));
        assert_eq!(row_split(&[1, 64, 128], &[4, 64, 128]), Some(1));
        assert_eq!(row_split(&[2, 3, 64, 128], &[1, 1, 64, 128]), Some(2));
        // A mixed broadcast, a single trailing dim (Flex's shared-row path already), equal
        // shapes, ranks below three or unequal: as they are.
        assert_eq!(row_split(&[2, 1, 64, 128], &[1, 3, 64, 128]), None);
        assert_eq!(row_split(&[4, 64, 128], &[4, 1, 128]), None);
        assert_eq!(row_split(&[4, 64, 128], &[4, 64, 128]), None);
        assert_eq!(row_split(&[4, 128], &[1, 128]), None);
        assert_eq!(row_split(&[4, 64, 128], &[64, 128]), None);
    }
}
