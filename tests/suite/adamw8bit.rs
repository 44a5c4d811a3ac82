//! AdamW with 8-bit block-quantised moments against bitsandbytes (`tools/adamw8bit_reference.py`
//! wrote the fixture with bitsandbytes 0.50 and PyTorch): its maps, its block-wise quantiser,
//! and its 8-bit optimizer step at the paper's block of 2,048 — bit for bit; and the same codes
//! and scales on every layout.

use super::{Dist, threads};
use burn::module::{Module, Param};
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use wildfire::demo::parameters;
use wildfire::engine::{
    FusedAdamWConfig, MomentDtype, QuantAdamW, dynamic_map, quantise_blockwise,
};
use wildfire::parallel::{DTensor, DeviceMesh, Layout, Placement};

const FIXTURE: &str = include_str!("../fixtures/adamw8bit_bnb.json");

fn fixture() -> serde_json::Value {
    serde_json::from_str(FIXTURE).unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// `got` and `want` bit for bit; else the first differences.
fn same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let diff: Vec<String> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .map(|i| format!("[{i}] {} vs {}", got[i], want[i]))
        .collect();
    assert!(
        diff.is_empty(),
        "{what}: {} of {} differ, first: {:?}",
        diff.len(),
        got.len(),
        &diff[..diff.len().min(5)]
    );
}

/// The signed and unsigned maps are bitsandbytes' `create_dynamic_map`, bit for bit.
#[test]
fn dynamic_maps_are_bitsandbytes() {
    let f = fixture();
    for (signed, name) in [(true, "signed"), (false, "unsigned")] {
        let want = floats(&f["maps"][name]);
        same_bits(&format!("{name} map"), &dynamic_map(signed), &want);
    }
}

/// A tensor's values on every rank of a `DTensor` laid out as `layout` (from the full values).
fn distributed(
    values: &[f32],
    shape: [usize; 2],
    layout: &Layout,
    device: &wildfire::parallel::DistDevice<burn::backend::Flex>,
) -> DTensor<burn::backend::Flex> {
    let full = Tensor::<burn::backend::Flex, 2>::from_data(
        TensorData::new(values.to_vec(), shape),
        device.inner(),
    );
    DTensor::from_full(full.into_primitive().tensor(), layout, device).unwrap()
}

fn host(t: DTensor<burn::backend::Flex>) -> Vec<f32> {
    let full = t.full().unwrap();
    Tensor::<burn::backend::Flex, 1>::from_primitive(TensorPrimitive::Float(full))
        .reshape([-1])
        .into_data()
        .to_vec::<f32>()
        .unwrap()
}

/// bitsandbytes' `quantize_blockwise` (block 2,048) of three blocks — six decades of
/// magnitude, a block of zeros, a block whose largest magnitude is negative — with either map:
/// the same codes and scales from one rank, and from 2 and 4 ranks under every layout that
/// splits the tensor: rows (blocks straddling the ranks' pieces: the scales combined by an
/// all-reduce), columns (no piece contiguous: the state moves to a row split), both.
#[test]
fn blockwise_quantisation_is_bitsandbytes_on_every_layout() {
    let f = fixture();
    // 6,144 elements as 48 × 128: a row split over 2 ranks cuts block 1 in half, over 4 ranks
    // cuts blocks 0 and 2.
    let shape = [48, 128];
    let layouts = |axes: usize| -> Vec<Layout> {
        let mut all = vec![
            Layout::new(vec![Placement::Replicate; axes]),
            Layout::new(vec![Placement::Shard(0); axes]),
            Layout::new(vec![Placement::Shard(1); axes]),
        ];
        if axes == 2 {
            all.push(Layout::new([Placement::Shard(0), Placement::Shard(1)]));
            all.push(Layout::new([Placement::Shard(1), Placement::Shard(0)]));
        }
        all
    };
    for case in f["quantise"].as_array().unwrap() {
        let signed = case["map"] == "signed";
        let input = floats(&case["input"]);
        let want_codes = floats(&case["codes"]);
        let want_absmax = floats(&case["absmax"]);
        for mesh in [
            DeviceMesh::new([("dp", 1)]).unwrap(),
            DeviceMesh::new([("dp", 2)]).unwrap(),
            DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap(),
        ] {
            for layout in layouts(mesh.axes().len()) {
                let out = threads(&mesh, |device| {
                    let t = distributed(&input, shape, &layout, &device);
                    let (codes, absmax) = quantise_blockwise(&t, signed);
                    (host(codes), host(absmax))
                });
                for (rank, (codes, absmax)) in out.iter().enumerate() {
                    let what = format!("{} map, {mesh} {layout}, rank {rank}", case["map"]);
                    same_bits(&format!("{what}: codes"), codes, &want_codes);
                    same_bits(&format!("{what}: scales"), absmax, &want_absmax);
                }
            }
        }
    }
}

/// A `[32, 128]` matrix (two blocks, 8-bit state) and a 40-element vector (f32 state).
#[derive(Module, Debug)]
struct Two<B: Backend> {
    matrix: Param<Tensor<B, 2>>,
    vector: Param<Tensor<B, 1>>,
}

/// [`QuantAdamW`] on one rank against bitsandbytes' CPU 8-bit step (dequantise, f32 AdamW,
/// quantise; the fixture's at block 2,048 with Wildfire's AdamW arithmetic): both parameters
/// after each of 3 steps, bit for bit — the dequantised moments, the update and the new codes
/// all equal, or a later step would differ.
#[test]
fn adamw8bit_matches_bitsandbytes() {
    let f = fixture();
    let run = &f["runs"][0];
    let c = &run["config"];
    let config = FusedAdamWConfig {
        beta1: c["beta1"].as_f64().unwrap(),
        beta2: c["beta2"].as_f64().unwrap(),
        epsilon: c["eps"].as_f64().unwrap(),
        weight_decay: c["weight_decay"].as_f64().unwrap(),
        moments: MomentDtype::Int8,
        multi_tensor: true,
    };
    let lr = c["lr"].as_f64().unwrap();
    let mesh = DeviceMesh::new([("dp", 1)]).unwrap();
    let got = threads(&mesh, |device| {
        let init = |k: usize| floats(&run["init"][k]);
        let mut m = Two {
            matrix: Param::from_tensor(Tensor::<Dist, 2>::from_data(
                TensorData::new(init(0), [32, 128]),
                &device,
            )),
            vector: Param::from_tensor(Tensor::<Dist, 1>::from_data(
                TensorData::new(init(1), [40]),
                &device,
            )),
        };
        let (mut optim, _) = QuantAdamW::<burn::backend::Flex>::optimizer::<Two<Dist>>(config);
        let mut after = Vec::new();
        for step in run["grads"].as_array().unwrap() {
            let g0 =
                Tensor::<Dist, 2>::from_data(TensorData::new(floats(&step[0]), [32, 128]), &device);
            let g1 = Tensor::<Dist, 1>::from_data(TensorData::new(floats(&step[1]), [40]), &device);
            let loss = (m.matrix.val() * g0).sum() + (m.vector.val() * g1).sum();
            let grads = GradientsParams::from_grads(loss.backward(), &m);
            m = optim.step(lr, m, grads);
            after.push(parameters(&m));
        }
        after
    });
    for (step, got) in got[0].iter().enumerate() {
        for k in 0..2 {
            let want = floats(&run["params"][step][k]);
            same_bits(&format!("step {} parameter {k}", step + 1), &got[k], &want);
        }
    }
}
