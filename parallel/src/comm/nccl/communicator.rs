//! Making a rank's NCCL communicators: one per mesh group, with ids handed out over a
//! [`Bootstrap`].

use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::driver::CudaContext;
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::{CommHandle, Error, NcclCommunicator, NcclOptions, p2p};
use crate::comm::Member;
use crate::comm::bootstrap::{Bootstrap, bootstrap_groups, exchange_group_ids};
use crate::comm::header::Sequence;
use crate::mesh::DeviceMesh;

impl NcclCommunicator {
    /// Rank `rank` of `mesh` on CUDA device `device`: makes one NCCL communicator per group of
    /// the rank (every axis, then the world), with ids handed out over `boot` (an MPI or other
    /// host communicator, or a [`TcpRendezvous`](crate::comm::TcpRendezvous)). Every rank of
    /// the mesh must call this at the same time (NCCL's initialisation is collective).
    pub fn new(
        mesh: DeviceMesh,
        rank: usize,
        device: CudaDevice,
        boot: &(impl Bootstrap + ?Sized),
        options: NcclOptions,
    ) -> Result<Self, Error> {
        // cudarc loads the libraries at first use and panics when one is missing: ask first.
        super::check_libcuda()?;
        // SAFETY: only tries to open the shared library.
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err(Error::Nccl {
                call: "loading libnccl",
                reason: "libnccl.so was not found: install NCCL (e.g. Debian/Ubuntu libnccl2) \
                         or put it on LD_LIBRARY_PATH"
                    .into(),
            });
        }
        let cuda = |e: cudarc::driver::DriverError| Error::Cuda(format!("{e:?}"));
        let ctx = CudaContext::new(device.index).map_err(cuda)?;
        ctx.bind_to_thread().map_err(cuda)?;
        let stream = ctx.new_stream().map_err(cuda)?;
        let client = CudaRuntime::client(&device);
        let ids = exchange_group_ids(&mesh, boot, super::new_unique_id)?;
        let mut comms = Vec::new();
        for (group, id) in bootstrap_groups(&mesh).into_iter().zip(ids) {
            let n = group.size(&mesh).expect("a bootstrap group");
            let index = group.index(&mesh, rank).expect("a bootstrap group");
            let unique = super::unique_id(&id);
            let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm` is a valid out-pointer; every member of the group makes the same
            // call with the same id (handed out above), in the same group order.
            unsafe { nccl::comm_init_rank(&mut comm, n as i32, unique, index as i32) }.map_err(
                |e| Error::Nccl {
                    call: "ncclCommInitRank",
                    reason: format!("{:?}", e.0),
                },
            )?;
            comms.push(CommHandle(comm));
        }
        let channels = p2p::P2pChannel::make(&mesh, boot, &ctx)?;
        tracing::info!(
            rank,
            groups = comms.len(),
            channels = channels.len(),
            "NCCL communicators ready"
        );
        Ok(Self {
            member: Member::new(rank, mesh),
            device,
            client,
            ctx,
            stream,
            comms,
            channels,
            options,
            sequence: Sequence::default(),
            calls: Mutex::new(()),
            aborted: AtomicBool::new(false),
        })
    }

    /// The CUDA device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }
}
