#!/usr/bin/env python3
"""Generate parallel/src/backend/forward.rs: the `Distributed<B>` impls of Burn 0.21.0's op traits.

Every op is classified once, below; the Rust code for each class lives in
`parallel/src/backend/{fallback,rules}.rs`. Run `python3 tools/gen_forward.py` after changing a list.
"""
import pathlib, re
import burn_traits as bt

UNARY_LINEAR = """float_neg float_mul_scalar float_div_scalar float_detach float_set_require_grad
float_cast""".split()
UNARY_NONLINEAR = """float_add_scalar float_sub_scalar float_clamp_min float_clamp_max float_clamp
float_recip float_exp float_log float_log1p float_powi_scalar float_powi_scalar_impl float_powf_scalar
float_powf_scalar_impl float_sqrt float_abs float_cos float_sin float_tan float_cosh float_sinh float_tanh
float_acos float_acosh float_asin float_asinh float_atan float_atanh float_round float_floor float_ceil
float_trunc float_erf float_sign float_remainder_scalar leaky_relu relu gelu sigmoid hard_sigmoid
log_sigmoid""".split()
BINARY = {
    "float_add": "Add", "float_sub": "Add", "float_mul": "Mul", "float_div": "Div",
    "float_powf": "NonLinear", "float_atan2": "NonLinear", "float_remainder": "NonLinear",
    "relu_backward": "NonLinear", "gelu_backward": "NonLinear", "sigmoid_backward": "NonLinear",
    "log_sigmoid_backward": "NonLinear",
}
DIM_LOCAL = """softmax log_softmax softmin float_cumsum float_cumprod float_cummin float_cummax
float_sort""".split()
# Hand-written in rules/, same name and arguments.
RULES = """float_from_data float_random float_device float_to_device float_sum float_sum_dim float_mean float_mean_dim
float_max_dim float_min_dim float_max float_min float_reshape float_swap_dims float_permute float_slice float_slice_assign
float_cat float_expand float_select float_gather float_scatter_add float_matmul float_mask_fill float_mask_where linear linear_x_backward
linear_weight_backward linear_bias_backward embedding embedding_backward layer_norm int_device bool_device
q_device tr_execute quantize max_pool1d_with_indices max_pool2d_with_indices
max_pool1d_with_indices_backward max_pool2d_with_indices_backward deform_conv2d_backward""".split()
# Rules that take padded shards as they are.
KEEP_PADDED = """float_to_device""".split()
# Default methods left to the trait: their defaults are compositions of ops that have rules.
KEEP_DEFAULT = """float_transpose""".split()

FLOAT = "FloatTensor<B>"

def selfify(t):
    return re.sub(r"<B>", "<Self>", t).replace("crate::tensor::", "burn_backend::tensor::")

def emit(name, sig):
    n, generics, args, ret, where = bt.parse_sig(sig)
    head = f"    fn {n}{generics}({', '.join(f'{a}: {selfify(t)}' for a, t in args)})"
    if ret:
        head += f" -> {selfify(ret)}"
    if where:
        head += f" {where}"
    names = [a for a, _ in args]
    rest = lambda k: "".join(f", {a}" for a in names[k:])
    if n in RULES:
        # Padded shards (data-axis splits that do not divide) are gathered before any rule but
        # the elementwise ones; moving a tensor to a device keeps it as it is.
        def unpad(a, t):
            if n in KEEP_PADDED:
                return a
            if t == FLOAT:
                return f"rules::unpadded::<B>({a})"
            if t == f"Option<{FLOAT}>":
                return f"{a}.map(rules::unpadded::<B>)"
            if t == f"Vec<{FLOAT}>":
                return f"{a}.into_iter().map(rules::unpadded::<B>).collect()"
            return a
        body = f"rules::{n}::<B>({', '.join(unpad(a, t) for a, t in args)})"
    elif n in UNARY_LINEAR or n in UNARY_NONLINEAR:
        lin = "Linear" if n in UNARY_LINEAR else "NonLinear"
        body = f'rules::unary::<B>("{n}", {names[0]}, Linearity::{lin}, |t| B::{n}(t{rest(1)}))'
    elif n in BINARY:
        body = (f'rules::binary::<B>("{n}", {names[0]}, {names[1]}, BinaryKind::{BINARY[n]}, '
                f"|l, r| B::{n}(l, r{rest(2)}))")
    elif n in DIM_LOCAL:
        assert names[1] == "dim", n
        body = f'rules::dim_local::<B>("{n}", {names[0]}, dim, |t| B::{n}(t{rest(1)}))'
    else:
        return head + " {\n" + fallback_body(n, args, ret) + "    }\n"
    return head + " {\n        " + body + "\n    }\n"

def fallback_body(n, args, ret):
    lines, call = [], []
    uses_fb = False
    for a, t in args:
        if t == FLOAT:
            lines.append(f"let {a} = fb.float({a});"); uses_fb = True
        elif t == "&" + FLOAT:
            lines.append(f"let {a} = fb.float_ref({a});"); uses_fb = True
        elif t == f"Option<{FLOAT}>":
            lines.append(f"let {a} = {a}.map(|t| fb.float(t));"); uses_fb = True
        elif t == f"Vec<{FLOAT}>":
            lines.append(f"let {a} = {a}.into_iter().map(|t| fb.float(t)).collect();"); uses_fb = True
        elif t == "&Device<B>":
            lines.append(f"let {a} = fb.device({a});"); uses_fb = True
        elif t == "TensorPrimitive<B>":
            lines.append(f"let {a} = fb.prim({a});"); uses_fb = True
        elif "<B>" in t and t not in ("IntTensor<B>", "BoolTensor<B>", "QuantizedTensor<B>",
                                      "Vec<IntTensor<B>>", "Vec<BoolTensor<B>>",
                                      "Vec<QuantizedTensor<B>>", "Option<BoolTensor<B>>",
                                      "&IntTensor<B>", "&BoolTensor<B>", "&QuantizedTensor<B>"):
            raise SystemExit(f"{n}: argument type {t} needs a rule")
        call.append(a)
    out = f"B::{n}({', '.join(call)})"
    if ret == FLOAT:
        out = f"fb.wrap({out})"; uses_fb = True
    elif ret == "TensorPrimitive<B>":
        out = f"fb.wrap_prim({out})"; uses_fb = True
    elif ret == f"({FLOAT}, IntTensor<B>)":
        lines.append(f"let (out, indices) = {out};"); out = "(fb.wrap(out), indices)"; uses_fb = True
    elif ret == f"({FLOAT}, {FLOAT})":
        lines.append(f"let (a, b) = {out};"); out = "(fb.wrap(a), fb.wrap(b))"; uses_fb = True
    elif "<B>" in ret and not (ret in ("IntTensor<B>", "BoolTensor<B>", "QuantizedTensor<B>")
                               or ret.startswith("(IntTensor<B>") or ret.startswith("(QuantizedTensor<B>")
                               or ret.startswith("impl Future<Output = IntTensor<B>>")):
        raise SystemExit(f"{n}: return type {ret} needs a rule")
    if uses_fb:
        lines.insert(0, f'let fb = Fallback::<B>::new("{n}");')
    return "".join(f"        {l}\n" for l in lines + [out])

def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    out = ["// @generated by tools/gen_forward.py from burn-backend 0.21.0's op traits. Do not edit.",
           "//! Every op of Burn's `Backend` for `Distributed<B>`: one line each, dispatching to a",
           "//! propagation rule (`rules`) or to the counted fallback (`fallback`).",
           "#![allow(unused_variables, clippy::too_many_arguments, clippy::type_complexity)]",
           "use super::prelude::*;", ""]
    seen = set()
    for trait, rel in bt.TRAITS:
        out.append(f"impl<B: Backend> {trait}<Self> for Distributed<B> {{")
        for name, sig, has_default in bt.methods(trait, rel):
            seen.add(name)
            if name in KEEP_DEFAULT:
                assert has_default, name
                continue
            out.append(emit(name, sig))
        out.append("}\n")
    for group in (UNARY_LINEAR, UNARY_NONLINEAR, BINARY, DIM_LOCAL, RULES, KEEP_DEFAULT):
        for name in group:
            assert name in seen, f"{name} is not an op of burn-backend 0.21.0"
    (root / "parallel/src/backend/forward.rs").write_text("\n".join(out))
    print("wrote parallel/src/backend/forward.rs; now run `cargo fmt`")

if __name__ == "__main__":
    main()
