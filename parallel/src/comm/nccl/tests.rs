//! NCCL on a world of one GPU, where a machine has one.

use std::time::Duration;

use burn::tensor::TensorData;
use burn::tensor::ops::FloatTensorOps;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::nccl::sys as nccl_sys;

use super::{Error, NcclCommunicator, NcclOptions};
use crate::comm::{
    CollectiveKind, Communicator, DeviceCollectives, Group, InProcessWorld, ReduceOp,
};
use crate::mesh::DeviceMesh;

type Cuda = CubeBackend<CudaRuntime, f32, i32, u8>;

fn host(t: CubeTensor<CudaRuntime>) -> TensorData {
    burn_backend::read_sync(Cuda::float_into_data(t)).expect("read back")
}

/// On a machine with CUDA and NCCL: a world of one on GPU 0, where every collective still
/// runs through NCCL — the device path on contiguous and strided tensors, the experts'
/// all-to-all (grouped sends and receives, here to itself) and the host API, each equal to its
/// input (a group of one), counted in the statistics; all-to-all splits that do not fit the
/// buffer are a typed error. Without them: a typed error, not cudarc's panic on a missing
/// library.
#[test]
fn nccl_world_of_one_or_a_typed_error() {
    let mesh = DeviceMesh::single();
    let world = InProcessWorld::new(mesh.clone(), Duration::from_secs(30));
    let boot = world.communicator(0);
    let options = NcclOptions::default();
    let nccl = match NcclCommunicator::new(mesh, 0, CudaDevice::new(0), &boot, options) {
        Ok(nccl) => nccl,
        Err(Error::Cuda(reason)) => {
            // SAFETY: only tries to open the library.
            assert!(
                !unsafe { cudarc::driver::sys::is_culib_present() },
                "{reason}"
            );
            assert!(reason.contains("libcuda"), "{reason}");
            return;
        }
        Err(Error::Nccl { call, reason }) => {
            // SAFETY: only tries to open the library.
            assert!(!unsafe { nccl_sys::is_culib_present() }, "{call}: {reason}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let device = CudaDevice::new(0);
    let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
    let data = TensorData::new(values, [2, 3, 4]);
    let tensor = || Cuda::float_from_data(data.clone(), &device);
    let dc: &dyn DeviceCollectives<Cuda> = &nccl;
    let strided = Cuda::float_swap_dims(tensor(), 0, 2);
    let expected_strided = host(Cuda::float_swap_dims(tensor(), 0, 2));
    for (name, out, expected) in [
        (
            "all_reduce",
            dc.all_reduce(Group::World, tensor(), ReduceOp::Sum),
            &data,
        ),
        (
            "all_gather",
            dc.all_gather_first(Group::World, tensor()),
            &data,
        ),
        (
            "reduce_scatter",
            dc.reduce_scatter_first(Group::World, tensor(), ReduceOp::Avg),
            &data,
        ),
        ("broadcast", dc.broadcast(Group::World, tensor(), 0), &data),
        (
            "all_reduce strided",
            dc.all_reduce(Group::World, strided, ReduceOp::Max),
            &expected_strided,
        ),
    ] {
        let out = host(out.unwrap_or_else(|e| panic!("{name}: {e}")));
        assert_eq!(&out, expected, "{name}");
    }
    // The experts' all-to-all (grouped `ncclSend`/`ncclRecv`, here to itself): the rows come
    // back as they went.
    let rows = TensorData::new(data.to_vec::<f32>().unwrap(), [6, 4]);
    let exchanged = dc
        .all_to_all_first(
            Group::World,
            Cuda::float_from_data(rows.clone(), &device),
            &[6],
            &[6],
        )
        .unwrap_or_else(|e| panic!("all_to_all: {e}"));
    assert_eq!(host(exchanged), rows, "all_to_all");
    let stats = DeviceCollectives::<Cuda>::stats(&nccl);
    assert_eq!(stats.count(CollectiveKind::AllReduce), 2);
    assert_eq!(stats.count(CollectiveKind::Broadcast), 1);
    assert_eq!(stats.count(CollectiveKind::AllToAll), 1);
    // The host API, through NCCL too.
    let gathered = Communicator::all_gather(&nccl, Group::World, data.clone(), 1).unwrap();
    assert_eq!(gathered, data);
    let reduced =
        Communicator::all_reduce(&nccl, Group::World, data.clone(), ReduceOp::Sum).unwrap();
    assert_eq!(reduced, data);
    let exchanged = Communicator::all_to_all(&nccl, Group::World, rows.clone(), &[6], &[6]);
    assert_eq!(exchanged.unwrap(), rows, "host all_to_all");
    Communicator::barrier(&nccl, Group::World).unwrap();
    let sent = Communicator::broadcast(&nccl, Group::World, Some(data.clone()), 0).unwrap();
    assert_eq!(sent, data);
    // Splits that do not add up to the buffer's rows: a typed error, nothing enqueued.
    let bad = dc.all_to_all_first(
        Group::World,
        Cuda::float_from_data(rows.clone(), &device),
        &[5],
        &[5],
    );
    assert!(matches!(bad, Err(Error::Mismatch { .. })), "{bad:?}");
}
