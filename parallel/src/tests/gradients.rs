//! Gradients of sharded models against the unsharded run, with the collectives they cost.

use super::*;

/// Megatron column- then row-parallel MLP on tp = 2: forward and backward equal the unsharded
/// run, with exactly one all-reduce forward (after the row-parallel matmul) and one backward
/// (the column-parallel input gradient), and nothing from the fallback.
#[test]
fn tensor_parallel_mlp_gradients_match_and_count_collectives() {
    type A = Autodiff<D>;
    let mesh = DeviceMesh::new([("tp", 2)]).unwrap();
    let (x0, w1, w2) = (values(&[3, 8], 1), values(&[8, 4], 2), values(&[4, 8], 3));
    let reference = {
        let dev = Default::default();
        let x = Tensor::<Autodiff<F>, 2>::from_data(x0.clone(), &dev).require_grad();
        let a = Tensor::<Autodiff<F>, 2>::from_data(w1.clone(), &dev).require_grad();
        let b = Tensor::<Autodiff<F>, 2>::from_data(w2.clone(), &dev).require_grad();
        let y = activation::gelu(module::linear(x.clone(), a.clone(), None));
        let y = module::linear(y, b.clone(), None);
        let loss = (y.clone() * y).sum();
        let g = loss.backward();
        (
            loss.into_data(),
            x.grad(&g).unwrap().into_data(),
            a.grad(&g).unwrap().into_data(),
            b.grad(&g).unwrap().into_data(),
        )
    };
    let results = threads(&mesh, |device| {
        let put = |v: &TensorData, p: Placement| {
            let t = Tensor::<F, 2>::from_data(v.clone(), &Default::default());
            let dt = DTensor::from_full(t.into_primitive().tensor(), &Layout::new([p]), &device)
                .unwrap();
            from_dtensor::<A, 2>(dt).require_grad()
        };
        let x = put(&x0, Placement::Replicate);
        let a = put(&w1, Placement::Shard(1));
        let b = put(&w2, Placement::Shard(0));
        device.context().reset_counters();
        let y = activation::gelu(module::linear(x.clone(), a.clone(), None));
        let y = module::linear(y, b.clone(), None);
        let loss = (y.clone() * y).sum();
        let forward = device.context().comm().stats();
        let g = loss.backward();
        let total = device.context().comm().stats();
        let counters = device.context().counters();
        let full = |t: Tensor<D, 2>| {
            dtensor(&t)
                .full()
                .map(|p| {
                    Tensor::<F, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(p))
                        .into_data()
                })
                .unwrap()
        };
        let out = (
            Tensor::<F, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
                dtensor(&loss.inner()).full().unwrap(),
            ))
            .into_data(),
            full(x.grad(&g).unwrap()),
            full(a.grad(&g).unwrap()),
            full(b.grad(&g).unwrap()),
        );
        (out, forward, total, counters)
    });
    for ((loss, gx, ga, gb), forward, total, counters) in results {
        close(&loss, &reference.0).unwrap();
        close(&gx, &reference.1).unwrap();
        close(&ga, &reference.2).unwrap();
        close(&gb, &reference.3).unwrap();
        assert_eq!(forward.count(CollectiveKind::AllReduce), 1, "{forward}");
        assert_eq!(total.count(CollectiveKind::AllReduce), 2, "{total}");
        assert_eq!(total.count(CollectiveKind::AllGather), 0, "{total}");
        assert_eq!(counters.fallback_total(), 0, "{counters:?}");
    }
}

/// Embedding gradients on a dp = 2 mesh are averaged where they are born (the weight's
/// placement is visible to `embedding_backward`), matching the mean of the per-rank gradients.
#[test]
fn data_parallel_embedding_gradient_is_reduced_at_birth() {
    type A = Autodiff<D>;
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let w0 = values(&[8, 4], 9);
    let indices = |rank: usize| TensorData::new(vec![rank as i64, 7, 2 + rank as i64, 3], [2, 2]);
    let reference: Vec<f32> = {
        let dev = Default::default();
        let grads: Vec<Vec<f32>> = (0..2)
            .map(|rank| {
                let w = Tensor::<Autodiff<F>, 2>::from_data(w0.clone(), &dev).require_grad();
                let idx = Tensor::<Autodiff<F>, 2, Int>::from_data(indices(rank), &dev);
                let y = module::embedding(w.clone(), idx);
                let g = (y.clone() * y).sum().backward();
                w.grad(&g).unwrap().into_data().to_vec().unwrap()
            })
            .collect();
        grads[0]
            .iter()
            .zip(&grads[1])
            .map(|(a, b)| (a + b) / 2.0)
            .collect()
    };
    let results = threads(&mesh, |device| {
        let t = Tensor::<F, 2>::from_data(w0.clone(), &Default::default());
        let dt = DTensor::from_full(
            t.into_primitive().tensor(),
            &Layout::replicated(&mesh),
            &device,
        )
        .unwrap();
        let w = from_dtensor::<A, 2>(dt).require_grad();
        let idx = Tensor::<A, 2, Int>::from_data(indices(device.rank()), &device);
        let y = module::embedding(w.clone(), idx);
        let g = (y.clone() * y).sum().backward();
        let grad = dtensor(&w.grad(&g).unwrap());
        assert_eq!(grad.layout(), &Layout::replicated(&mesh));
        let stats = device.context().comm().stats();
        let full = grad.full().unwrap();
        let data =
            Tensor::<F, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(full)).into_data();
        (data, stats)
    });
    for (grad, stats) in results {
        close(&grad, &TensorData::new(reference.clone(), [8, 4])).unwrap();
        assert_eq!(stats.count(CollectiveKind::AllReduce), 1, "{stats}");
    }
}
