//! A rank's context: its precision and sharding policy, and its device ids.

use super::*;

/// The precision policy (as `torch.autocast`): with a bf16 compute dtype a matmul and a linear
/// run on bf16 operands and hand back bf16 — the next matmul takes it as it is; each operand value
/// is cast once (the linear after the matmul reuses both casts) and the weight's gradient comes
/// back in f32 for the master weight. Every cast is counted under the rule that asked.
#[test]
fn compute_dtype_runs_matmuls_in_bf16_and_casts_each_value_once() {
    use burn::tensor::{DType, FloatDType};
    type A = Autodiff<D>;
    let mesh = DeviceMesh::new([("dp", 1)]).unwrap();
    let out = threads(&mesh, |device| {
        let (a, b) = (values(&[4, 8], 1), values(&[8, 4], 2));
        let x = Tensor::<A, 2>::from_data(a.clone(), &device);
        let w = Tensor::<A, 2>::from_data(b.clone(), &device).require_grad();
        let exact = x.clone().matmul(w.clone()).into_data();
        device.context().reset_counters();
        device
            .context()
            .update_policy(|p| p.compute_dtype = Some(FloatDType::BF16));
        let mixed = x.clone().matmul(w.clone()).into_data();
        let linear = module::linear(x, w.clone(), None);
        let forward_casts = device.context().counters().casts;
        let grads = linear.clone().sum().backward();
        let w_grad = w.grad(&grads).unwrap();
        let casts = device.context().counters().casts;
        device.context().update_policy(|p| p.compute_dtype = None);
        let dev = Default::default();
        let xb = Tensor::<F, 2>::from_data(a, &dev).cast(DType::BF16);
        let reference = xb
            .clone()
            .matmul(Tensor::<F, 2>::from_data(b, &dev).cast(DType::BF16))
            .into_data();
        let ones = Tensor::<F, 2>::ones([4, 4], &dev).cast(DType::BF16);
        let w_reference = xb.transpose().matmul(ones).cast(DType::F32).into_data();
        let w_grad = (w_grad.dtype(), w_grad.into_data());
        (
            exact,
            mixed,
            linear.into_data(),
            reference,
            forward_casts,
            casts,
            w_grad,
            w_reference,
        )
    });
    let (exact, mixed, linear, reference, forward_casts, casts, w_grad, w_reference) = &out[0];
    assert_eq!(mixed.dtype, DType::BF16);
    assert_eq!(mixed, reference);
    assert_eq!(linear, reference);
    assert_ne!(
        mixed.clone().convert::<f32>(),
        *exact,
        "bf16 compute must differ from f32 somewhere"
    );
    let counted = |pairs: &[(&'static str, u64)]| pairs.iter().copied().collect();
    assert_eq!(*forward_casts, counted(&[("float_matmul", 2)]));
    assert_eq!(
        *casts,
        counted(&[("float_matmul", 2), ("linear_weight_backward", 1)])
    );
    assert_eq!(w_grad.0, DType::F32);
    assert_eq!(w_grad.1, *w_reference);
}

/// Devices of finished ranks give their ids back: 70,000 devices made and dropped one after the
/// other fit the 65,536 ids a `DeviceId` names (the table grew by one per rank per launch and
/// panicked past 65,536), and a live device still round-trips through its id.
#[test]
fn device_ids_are_reused_after_ranks_end() {
    use burn::tensor::backend::Device;
    for _ in 0..70_000 {
        let world = InProcessWorld::new(DeviceMesh::single(), std::time::Duration::from_secs(5));
        drop(DistDevice::<Flex>::new(
            Default::default(),
            Arc::new(world.communicator(0)),
        ));
    }
    // Other tests of this binary register their ranks' devices meanwhile: a few hundred at most.
    assert!(
        crate::device::registered_slots() < 10_000,
        "{} slots",
        crate::device::registered_slots()
    );
    let world = InProcessWorld::new(DeviceMesh::single(), std::time::Duration::from_secs(5));
    let device = DistDevice::<Flex>::new(Default::default(), Arc::new(world.communicator(0)));
    let back = DistDevice::<Flex>::from_id(device.to_id());
    assert!(Arc::ptr_eq(back.context(), device.context()));
}

/// The rank policy: set in one call, kept by the parallelism transforms, which fill in their
/// parts (`fully_shard` the sharding: where parameters, gradients and optimizer state rest, and
/// when gradients are reduced); the thin setters change one field and keep the rest.
#[test]
fn rank_policy_is_set_once_and_filled_in_by_fully_shard() {
    use burn::tensor::FloatDType::BF16;
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let out = threads(&mesh, |device| {
        let ctx = device.context().clone();
        let set = RankPolicy {
            compute_dtype: Some(BF16),
            memory_budget: Some(1 << 30),
            ..Default::default()
        };
        ctx.set_policy(set.clone());
        let linear = || burn::nn::LinearConfig::new(4, 4).init::<D>(&device);
        fully_shard(linear(), &mesh, FsdpStrategy::FullShard).unwrap();
        let full_shard = ctx.policy();
        fully_shard(linear(), &mesh, FsdpStrategy::ShardOptimizer).unwrap();
        let zero1 = ctx.policy();
        ctx.update_policy(|p| p.grad_reduce_dtype = Some(BF16));
        (set, full_shard, zero1, ctx.policy())
    });
    let (set, full_shard, zero1, last) = &out[0];
    assert_eq!(full_shard.compute_dtype, set.compute_dtype);
    assert_eq!(full_shard.memory_budget, set.memory_budget);
    let s = &full_shard.sharding;
    assert_eq!(
        (
            s.param_shard_axes(),
            s.grad_shard_axes(),
            s.optimizer_shard_axes()
        ),
        (&[0][..], &[0][..], &[0][..])
    );
    assert_eq!(s.gradient_reduction(), GradientReduction::WhereBorn);
    let s = &zero1.sharding;
    assert_eq!(
        (
            s.param_shard_axes(),
            s.grad_shard_axes(),
            s.optimizer_shard_axes()
        ),
        (&[][..], &[][..], &[0][..])
    );
    assert_eq!(s.gradient_reduction(), GradientReduction::AtSync);
    assert_eq!(
        last,
        &RankPolicy {
            grad_reduce_dtype: Some(BF16),
            ..zero1.clone()
        }
    );
}

thread_local! {
    /// Touched by a rank's body, after its launcher made the rank's device current: a rank's
    /// thread destroys it before that device (thread-local destructors run in reverse order of
    /// first use).
    static TOUCHED: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Device collectives that say, when dropped, whether their thread's locals were still alive:
/// `false` when a thread-local destructor dropped them as the thread exited (where NCCL's
/// communicators crashed the process at exit).
#[derive(Debug)]
struct DropProbe(std::sync::mpsc::Sender<bool>);

impl Drop for DropProbe {
    fn drop(&mut self) {
        let _ = self.0.send(TOUCHED.try_with(|_| ()).is_ok());
    }
}

impl DeviceCollectives<F> for DropProbe {
    fn all_reduce(
        &self,
        _: Group,
        _: burn_backend::tensor::FloatTensor<F>,
        _: ReduceOp,
    ) -> Result<burn_backend::tensor::FloatTensor<F>, Error> {
        unreachable!("the probe is only dropped")
    }

    fn all_gather_first(
        &self,
        _: Group,
        _: burn_backend::tensor::FloatTensor<F>,
    ) -> Result<burn_backend::tensor::FloatTensor<F>, Error> {
        unreachable!("the probe is only dropped")
    }

    fn reduce_scatter_first(
        &self,
        _: Group,
        _: burn_backend::tensor::FloatTensor<F>,
        _: ReduceOp,
    ) -> Result<burn_backend::tensor::FloatTensor<F>, Error> {
        unreachable!("the probe is only dropped")
    }

    fn broadcast(
        &self,
        _: Group,
        _: burn_backend::tensor::FloatTensor<F>,
        _: usize,
    ) -> Result<burn_backend::tensor::FloatTensor<F>, Error> {
        unreachable!("the probe is only dropped")
    }
}

/// A rank's context, and the device collectives installed on it, are released when the rank's
/// body ends, on the rank's thread, before the launch returns: a lone rank (which runs on a pool
/// worker) and ranks on threads of their own. They were kept as the thread's current device
/// until a thread-local destructor dropped them at thread exit, where NCCL's
/// `ncclCommDestroy` crashed the process.
#[test]
fn a_rank_context_is_released_when_the_rank_ends() {
    for dp in [1, 2] {
        let (sender, dropped) = std::sync::mpsc::channel();
        let mesh = DeviceMesh::new([("dp", dp)]).unwrap();
        threads(&mesh, |device| {
            TOUCHED.with(|t| t.borrow_mut().push(device.rank()));
            let probe = Arc::new(DropProbe(sender.clone()));
            device.context().set_device_collectives::<F>(probe);
        });
        drop(sender);
        let dropped: Vec<bool> = dropped.try_iter().collect();
        assert_eq!(dropped, vec![true; dp], "dp {dp}");
    }
}

/// An error raised on a rank is reported once, by whoever the launcher hands it to, not also by
/// the panic hook as each rank thread's panic (with a backtrace under `RUST_BACKTRACE`); a raise
/// outside every launcher, which nothing hands on, is still reported by the hook. Run in a child
/// process of this test binary, whose stderr is read.
#[test]
fn a_raised_error_is_reported_by_its_receiver_not_the_panic_hook() {
    const NAME: &str = "tests::rank::a_raised_error_is_reported_by_its_receiver_not_the_panic_hook";
    let budget = |rank| Error::MemoryBudget {
        rank,
        bytes: 2,
        budget: 1,
    };
    match std::env::var("WILDFIRE_RAISE_CHILD").as_deref() {
        Ok("launch") => {
            let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
            let result = launch_ranks::<F, _, _>(
                &mesh,
                &Default::default(),
                &Default::default(),
                |device| -> () { crate::error::raise(budget(device.rank())) },
            );
            eprintln!("returned: {}", result.unwrap_err());
            return;
        }
        Ok("bare") => {
            let caught = std::panic::catch_unwind(|| crate::error::raise(budget(7)));
            assert!(caught.is_err());
            return;
        }
        _ => {}
    }
    let child = |mode: &str| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env("WILDFIRE_RAISE_CHILD", mode)
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        assert!(out.status.success(), "{mode}: {out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let launched = child("launch");
    // Named once: the budget's message begins with its rank.
    assert!(
        launched.contains("returned: rank 0 needs 2 bytes")
            || launched.contains("returned: rank 1 needs 2 bytes"),
        "{launched}"
    );
    assert!(
        launched.contains("over its budget of 1 bytes"),
        "{launched}"
    );
    assert!(!launched.contains("panicked at"), "{launched}");
    assert!(!launched.contains("stack backtrace"), "{launched}");
    let bare = child("bare");
    assert!(bare.contains("panicked at"), "{bare}");
    assert!(bare.contains("rank 7 needs 2 bytes"), "{bare}");
}
