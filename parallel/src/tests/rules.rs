//! Every propagation rule against the same op on the full tensors: each input laid out in every
//! placement combination the shapes allow on the 2 × 2 mesh (padded data shards included).

use super::*;

#[test]
fn unary_elementwise_rules_match_full_tensors() {
    let s = [4, 4, 8];
    assert!(check1("exp", s, op1!(3, |x| x.exp())) > 20);
    check1("neg", s, op1!(3, |x| x.neg()));
    check1("mul_scalar", s, op1!(3, |x| x.mul_scalar(3.0)));
    check1("add_scalar", s, op1!(3, |x| x.add_scalar(1.5)));
    check1("gelu", s, op1!(3, |x| activation::gelu(x)));
    check1("relu", s, op1!(3, |x| activation::relu(x)));
    check1("sqrt_abs", s, op1!(3, |x| x.abs().sqrt()));
    check1("cast", s, op1!(3, |x| x.cast(burn::tensor::DType::F64)));
}

#[test]
fn reduction_rules_match_full_tensors() {
    let s = [4, 4, 8];
    check1("sum", s, op1!(3, |x| x.sum()));
    check1("mean", s, op1!(3, |x| x.mean()));
    check1("sum_dim", s, op1!(3, |x| x.sum_dim(1)));
    check1("mean_dim", s, op1!(3, |x| x.mean_dim(2)));
    check1("max_dim", s, op1!(3, |x| x.max_dim(0)));
    check1("max", s, op1!(3, |x| x.max()));
    check1("min_dim", s, op1!(3, |x| x.min_dim(1)));
    check1("argmax", s, op1!(3, |x| x.argmax(2)));
    check1("sum_then_exp", s, op1!(3, |x| x.sum_dim(2).exp()));
}

#[test]
fn dim_local_rules_match_full_tensors() {
    let s = [4, 4, 8];
    check1("softmax", s, op1!(3, |x| activation::softmax(x, 2)));
    check1("log_softmax", s, op1!(3, |x| activation::log_softmax(x, 0)));
    check1("cumsum", s, op1!(3, |x| x.cumsum(1)));
}

#[test]
fn shape_rules_match_full_tensors() {
    let s = [4, 4, 8];
    check1("reshape_merge", s, op1!(3, |x| x.reshape([16, 8])));
    check1("reshape_split", s, op1!(3, |x| x.reshape([4, 4, 2, 4])));
    check1("reshape_all", s, op1!(3, |x| x.reshape([128])));
    check1("swap_dims", s, op1!(3, |x| x.swap_dims(0, 2)));
    check1("permute", s, op1!(3, |x| x.permute([2, 0, 1])));
    check1("transpose", s, op1!(3, |x| x.transpose()));
    check1("slice_part", s, op1!(3, |x| x.slice([0..4, 1..3, 0..8])));
    check1("slice_full", s, op1!(3, |x| x.slice([0..4, 0..4])));
    check1("narrow", s, op1!(3, |x| x.narrow(2, 2, 4)));
    check1(
        "expand",
        s,
        op1!(3, |x| x.unsqueeze::<4>().expand([2, 4, 4, 8])),
    );
    check1(
        "cat",
        s,
        op1!(3, |x| Tensor::cat(vec![x.clone(), x.exp()], 1)),
    );
    check1(
        "select",
        s,
        op1!(3, |x| {
            let idx = Tensor::<B, 1, Int>::from_data([3, 0, 1], &x.device());
            x.select(1, idx)
        }),
    );
    check1(
        "gather",
        s,
        op1!(3, |x| {
            let idx: Vec<i64> = (0..128).map(|i| (i * 7 % 4) as i64).collect();
            let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(idx, [4, 4, 8]), &x.device());
            x.gather(1, idx)
        }),
    );
    check1(
        "mask_fill",
        s,
        op1!(3, |x| {
            let mask = x.clone().greater_elem(0.2);
            x.mask_fill(mask, -2.0)
        }),
    );
}

#[test]
fn binary_rules_match_full_tensors() {
    let s = ([4, 4, 8], [4, 4, 8]);
    assert!(check2("add", s, 3, op2!(3, 3, |a, b| a + b)) > 100);
    check2("sub", s, 5, op2!(3, 3, |a, b| a - b));
    check2("mul", s, 3, op2!(3, 3, |a, b| a * b));
    check2("div", s, 7, op2!(3, 3, |a, b| a / (b.abs() + 1.0)));
    check2("powf", s, 11, op2!(3, 3, |a, b| a.abs().powf(b)));
    check2(
        "broadcast_add",
        ([4, 4, 8], [1, 4, 8]),
        1,
        op2!(3, 3, |a, b| a + b),
    );
    // Broadcast over leading dims of size 1 (run as rows of the trailing block), either side.
    check2(
        "broadcast_sub_rows",
        ([1, 4, 8], [4, 4, 8]),
        5,
        op2!(3, 3, |a, b| a - b),
    );
    check2(
        "broadcast_div_rows",
        ([2, 2, 4, 8], [1, 1, 4, 8]),
        7,
        op2!(4, 4, |a, b| a / (b.abs() + 1.0)),
    );
    check2(
        "broadcast_mul",
        ([4, 4, 8], [4, 4, 1]),
        1,
        op2!(3, 3, |a, b| a * b),
    );
    check2(
        "slice_assign",
        ([4, 4, 8], [4, 2, 8]),
        3,
        op2!(3, 3, |a, b| a.slice_assign([0..4, 1..3, 0..8], b)),
    );
    check2(
        "mask_where",
        s,
        9,
        op2!(3, 3, |a, b| {
            let mask = a.clone().lower_elem(0.0);
            a.mask_where(mask, b)
        }),
    );
}

#[test]
fn matmul_and_linear_rules_match_full_tensors() {
    assert!(
        check2(
            "matmul",
            ([4, 4, 8], [4, 8, 4]),
            1,
            op2!(3, 3, |a, b| a.matmul(b))
        ) > 200
    );
    check2(
        "matmul_broadcast",
        ([4, 4, 8], [1, 8, 4]),
        1,
        op2!(3, 3, |a, b| a.matmul(b)),
    );
    // A weight is a parameter: per-rank (`Local`) weights are refused (see the DDP tests).
    check2_where(
        "linear",
        ([4, 4, 8], [8, 4]),
        1,
        placed,
        op2!(3, 2, |x, w| module::linear(x, w, None)),
    );
    check2_where(
        "linear_bias",
        ([4, 4, 8], [8, 4]),
        1,
        placed,
        op2!(3, 2, |x, w| {
            let b = w.clone().sum_dim(0).reshape([4]);
            module::linear(x, w, Some(b))
        }),
    );
}

#[test]
fn embedding_and_layer_norm_rules_match_full_tensors() {
    assert!(
        check1_where(
            "embedding",
            [8, 4],
            placed,
            op1!(2, |w| {
                let idx = Tensor::<B, 2, Int>::from_data([[1, 7, 0], [3, 3, 5]], &w.device());
                module::embedding(w, idx)
            }),
        ) > 10
    );
    check2_where(
        "layer_norm",
        ([4, 4, 8], [8]),
        1,
        placed,
        op2!(3, 1, |x, gamma| {
            let beta = gamma.clone().mul_scalar(0.5);
            let out = B::layer_norm(
                x.into_primitive().tensor(),
                gamma.into_primitive().tensor(),
                Some(beta.into_primitive().tensor()),
                1e-5,
            );
            Tensor::<B, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(out))
        }),
    );
}

/// `scatter_add` (gather's backward) on every layout pair of target and values: equal to the full
/// op; on the tensor-parallel axis the result stays split over the scattered dim (loss-parallel
/// backward never holds the `[N, vocab]` gradient whole).
#[test]
fn scatter_add_rule_matches_full_tensors_and_stays_split() {
    use burn::tensor::IndexingUpdateOp;
    assert!(
        check2(
            "scatter_add",
            ([4, 8], [4, 1]),
            3,
            op2!(2, 2, |t, v| {
                let idx = Tensor::<B, 2, Int>::from_data([[1], [7], [0], [4]], &t.device());
                t.scatter(1, idx, v, IndexingUpdateOp::Add)
            }),
        ) > 10
    );
    let mesh = DeviceMesh::new([("dp", 1), ("tp", 2)]).unwrap();
    let out = threads(&mesh, |device| {
        let t = Tensor::<D, 2>::zeros([4, 8], &device);
        let v = Tensor::<D, 2>::from_data(values(&[4, 1], 1), &device);
        let idx = Tensor::<D, 2, Int>::from_data([[1], [7], [0], [4]], &device);
        let out = t.scatter(1, idx, v, IndexingUpdateOp::Add);
        dtensor(&out).layout().clone()
    });
    for layout in out {
        assert_eq!(layout.get(1), Placement::Shard(1), "{layout}");
    }
}

/// Dimensions that do not divide by a data axis are padded while split (FSDP's shards of any
/// shape): every rule on every layout of a `[3, 5, 4]` tensor on the 2 × 2 mesh (3 and 5 padded
/// on `dp`; model-axis splits of them are refused and skipped) equals the op on the full tensor.
#[test]
fn padded_data_shards_match_full_tensors() {
    let s = [3, 5, 4];
    let padded = |l: &Layout| {
        (0..2).any(|d| l.get(0) == Placement::Shard(d)) && l.get(0) != Placement::Shard(2)
    };
    assert!(check1_where("exp", s, padded, op1!(3, |x| x.exp())) > 5);
    check1_where("mul_scalar", s, padded, op1!(3, |x| x.mul_scalar(3.0)));
    check1_where("sum", s, padded, op1!(3, |x| x.sum()));
    check1_where("sum_dim0", s, padded, op1!(3, |x| x.sum_dim(0)));
    check1_where("sum_dim1", s, padded, op1!(3, |x| x.sum_dim(1)));
    check1_where("mean", s, padded, op1!(3, |x| x.mean()));
    check1_where("max_dim1", s, padded, op1!(3, |x| x.max_dim(1)));
    check1_where("reshape", s, padded, op1!(3, |x| x.reshape([15, 4])));
    check1_where("swap_dims", s, padded, op1!(3, |x| x.swap_dims(0, 1)));
    check1_where("slice", s, padded, op1!(3, |x| x.slice([1..3, 0..5, 0..2])));
    check1_where(
        "softmax0",
        s,
        padded,
        op1!(3, |x| activation::softmax(x, 0)),
    );
    check1_where(
        "sqrt_add",
        s,
        padded,
        op1!(3, |x| x.clone().abs().sqrt() + x),
    );
    check2("add", (s, s), 2, op2!(3, 3, |a, b| a + b));
    check2(
        "div_broadcast",
        (s, [1, 5, 4]),
        2,
        op2!(3, 3, |a, b| a / (b.abs() + 1.0)),
    );
    check2(
        "matmul",
        (s, [4, 3]),
        3,
        op2!(3, 2, |a, b| a.matmul(b.unsqueeze())),
    );
}
