//! One call that starts a job's ranks however it was launched — threads of this process, a
//! process of an `mpirun` / `srun` job, or a torchrun-style process — installs the collectives
//! it asked for on every rank, and runs a rank body on each.

use std::str::FromStr;
use std::sync::Arc;

use burn_backend::Backend;
use burn_backend::Device as _;
use serde::{Deserialize, Serialize};

use crate::comm::HostStaged;
use crate::device::DistDevice;
use crate::error::Error;
use crate::launch::{LaunchEnv, LaunchOptions, Launcher};
use crate::mesh::DeviceMesh;

/// What carries the collectives of the training tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Collectives {
    /// The host communicator: ranks as threads, or MPI between processes.
    #[default]
    Host,
    /// NCCL on the ranks' CUDA devices, bootstrapped over the host communicator (feature
    /// `cuda`, a [`DeviceLaunch`] that offers it): rank `r` of a process uses the GPU `r` places
    /// after the launch's device (its local rank under MPI).
    Nccl,
    /// The device-collectives path that NCCL takes (every redistribution handed the backend's
    /// tensors, asynchronous calls issued through it), carried by the host communicator and
    /// staged through host memory ([`HostStaged::queued`]): any backend, the host path's results
    /// bit for bit. For testing that path without GPUs.
    Staged,
}

impl FromStr for Collectives {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "host" => Ok(Self::Host),
            "nccl" => Ok(Self::Nccl),
            "staged" => Ok(Self::Staged),
            other => Err(format!(
                "unknown collectives '{other}': host, nccl or staged"
            )),
        }
    }
}

/// How this process's ranks start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Launch {
    /// One thread per rank in this process.
    #[default]
    Threads,
    /// This process is one rank of the job `mpirun` / `srun` started (feature `mpi`); the mesh
    /// must have as many ranks as the job has processes.
    Mpi,
    /// This process is one rank of a torchrun-style launch (`MASTER_ADDR`, `MASTER_PORT`,
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`), with no MPI: NCCL on CUDA carries everything.
    Rendezvous,
}

impl Launch {
    /// How a process the launcher `env` started runs ([`LaunchEnv::detect`]): none or a world of
    /// one as threads, `mpirun` / `mpiexec` / `srun` as an MPI rank, `torchrun` as a rendezvous.
    pub fn of(env: Option<&LaunchEnv>) -> Self {
        match env.filter(|e| e.world_size > 1) {
            None => Launch::Threads,
            Some(env) if env.launcher == Launcher::Torchrun => Launch::Rendezvous,
            Some(_) => Launch::Mpi,
        }
    }
}

/// A job's launch, as the launcher needs it.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// The mesh of all the job's ranks.
    pub mesh: DeviceMesh,
    /// How this process's ranks start.
    pub launch: Launch,
    /// What carries the training tensors' collectives.
    pub collectives: Collectives,
    /// Timeouts, and the modelled links of ranks as threads.
    pub options: LaunchOptions,
}

/// What a backend adds to a launch: NCCL on its devices, and torchrun-style processes.
/// [`HostLaunch`] for every backend (host and staged collectives, threads and MPI);
/// `NcclLaunch` (feature `cuda`) for Burn's CUDA backend.
pub trait DeviceLaunch<B: Backend>: Sync {
    /// Whether it offers NCCL (and with it torchrun-style processes).
    fn offers_nccl(&self) -> bool;

    /// Install NCCL as the device collectives of a rank's device (every rank at once).
    fn install_nccl(&self, device: &DistDevice<B>) -> Result<(), Error>;

    /// Run `body` as this process's rank of `mesh` in a torchrun-style launch.
    fn rendezvous<T>(
        &self,
        mesh: &DeviceMesh,
        body: &mut dyn FnMut(DistDevice<B>) -> T,
    ) -> Result<T, Error>;
}

/// A launch with no device support: host or staged collectives, ranks as threads or MPI
/// processes.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostLaunch;

/// What to do when NCCL is asked of a launch that does not offer it.
const NO_NCCL: &str = "--collectives nccl runs on CUDA: build with --features cuda (without \
                       fusion) and pass --backend cuda";

/// What to do when a torchrun-style process has no NCCL.
const NO_RENDEZVOUS: &str = "a torchrun-style launch (WORLD_SIZE, MASTER_ADDR): without MPI the \
     ranks need NCCL: a binary built with --features cuda, run with --backend cuda --collectives \
     nccl; or run under mpirun / srun with a binary built with --features mpi";

impl<B: Backend> DeviceLaunch<B> for HostLaunch {
    fn offers_nccl(&self) -> bool {
        false
    }

    fn install_nccl(&self, _: &DistDevice<B>) -> Result<(), Error> {
        Err(Error::Unsupported(NO_NCCL.into()))
    }

    fn rendezvous<T>(
        &self,
        _: &DeviceMesh,
        _: &mut dyn FnMut(DistDevice<B>) -> T,
    ) -> Result<T, Error> {
        Err(Error::Unsupported(NO_RENDEZVOUS.into()))
    }
}

/// NCCL on Burn's CUDA backend (feature `cuda`).
#[cfg(feature = "cuda")]
#[derive(Clone, Debug, Default)]
pub struct NcclLaunch(pub crate::comm::NcclOptions);

#[cfg(feature = "cuda")]
impl<F, I, BT> DeviceLaunch<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, I, BT>>
    for NcclLaunch
where
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn offers_nccl(&self) -> bool {
        true
    }

    fn install_nccl(
        &self,
        device: &DistDevice<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, I, BT>>,
    ) -> Result<(), Error> {
        crate::comm::NcclCommunicator::install(device, self.0.clone()).map(|_| ())
    }

    fn rendezvous<T>(
        &self,
        mesh: &DeviceMesh,
        body: &mut dyn FnMut(
            DistDevice<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, I, BT>>,
        ) -> T,
    ) -> Result<T, Error> {
        super::launch_ranks_rendezvous(mesh, &self.0, body)
    }
}

/// The results of this process's ranks, in rank order, and the global rank of the first.
#[derive(Debug)]
pub struct Launched<T> {
    /// The global rank of `results[0]`: 0 for ranks as threads, this process's rank otherwise.
    pub first_rank: usize,
    /// One per rank this process ran (all of them as threads, one as a process).
    pub results: Vec<T>,
}

/// Whether `support` can run `spec` in this build: NCCL only where it is offered, a
/// torchrun-style process only on NCCL, MPI only with the feature `mpi`. [`launch_job`] checks it
/// first; a caller checks it before loading anything.
pub fn check_job<B: Backend, D: DeviceLaunch<B>>(spec: &JobSpec, support: &D) -> Result<(), Error> {
    let nccl = spec.collectives == Collectives::Nccl;
    match spec.launch {
        Launch::Rendezvous if !(nccl && support.offers_nccl()) => {
            Err(Error::Unsupported(NO_RENDEZVOUS.into()))
        }
        _ if nccl && !support.offers_nccl() => Err(Error::Unsupported(NO_NCCL.into())),
        #[cfg(not(feature = "mpi"))]
        Launch::Mpi => Err(Error::Unsupported(
            "this binary was built without MPI: cargo build --features mpi --example \
             gpt_pretrain, then mpirun -np N …"
                .into(),
        )),
        _ => Ok(()),
    }
}

/// The device the process's `local`-th rank of `spec` runs on, `device` being the first: one
/// device each under NCCL (the next ones of its kind), else the ranks share it.
pub fn rank_device<B: Backend>(spec: &JobSpec, device: &B::Device, local: usize) -> B::Device {
    if spec.collectives == Collectives::Nccl {
        use burn_backend::DeviceId;
        let id = device.to_id();
        B::Device::from_id(DeviceId::new(id.type_id, id.index_id + local as u16))
    } else {
        device.clone()
    }
}

/// Run `body` on this process's ranks of `spec.mesh`, started as `spec.launch` says, with
/// `spec.collectives` installed on every rank first (NCCL through `support`, staged collectives
/// on any backend). With NCCL, rank `r` of a process runs on the device `r` places after
/// `device` (its local rank: one GPU each); otherwise every rank of the process on `device`.
///
/// A combination the build or the backend cannot run — MPI without the feature `mpi`, NCCL or a
/// torchrun-style process without a backend that offers them — is an
/// [`Error::Unsupported`] that says what to build or pass, before any rank starts
/// ([`check_job`]).
pub fn launch_job<B, T, D, F>(
    spec: &JobSpec,
    device: &B::Device,
    support: &D,
    body: F,
) -> Result<Launched<T>, Error>
where
    B: Backend,
    T: Send,
    D: DeviceLaunch<B>,
    F: Fn(DistDevice<B>) -> T + Sync,
{
    check_job(spec, support)?;
    let per_rank_device = |local: usize| rank_device::<B>(spec, device, local);
    // A rank's collectives, installed before its body runs; a failure is the rank's result.
    let install = |d: &DistDevice<B>| -> Result<(), Error> {
        match spec.collectives {
            Collectives::Host => Ok(()),
            Collectives::Nccl => support.install_nccl(d),
            Collectives::Staged => {
                let ctx = d.context();
                ctx.set_device_collectives::<B>(Arc::new(HostStaged::queued(ctx.queue_arc())));
                Ok(())
            }
        }
    };
    let run = |d: DistDevice<B>| -> Result<T, Error> {
        install(&d)?;
        Ok(body(d))
    };
    let collect = |first_rank: usize, results: Vec<Result<T, Error>>| {
        Ok(Launched {
            first_rank,
            results: results.into_iter().collect::<Result<_, _>>()?,
        })
    };
    match spec.launch {
        Launch::Threads => {
            let results = super::launch_ranks_on(&spec.mesh, per_rank_device, &spec.options, run)?;
            collect(0, results)
        }
        #[cfg(feature = "mpi")]
        Launch::Mpi => {
            let rank = std::cell::Cell::new(0);
            let result =
                super::launch_ranks_mpi(&spec.mesh, per_rank_device, &spec.options, |d| {
                    rank.set(d.rank());
                    run(d)
                })?;
            collect(rank.get(), vec![result])
        }
        #[cfg(not(feature = "mpi"))]
        Launch::Mpi => unreachable!("check_job refuses MPI without the feature"),
        Launch::Rendezvous => {
            // NCCL installs itself: it is the process's only communicator.
            let mut rank = 0;
            let result = support.rendezvous(&spec.mesh, &mut |d: DistDevice<B>| {
                rank = d.rank();
                body(d)
            })?;
            Ok(Launched {
                first_rank: rank,
                results: vec![result],
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type F = burn::backend::Flex;

    /// A launch that offers NCCL: it installs nothing and runs a rendezvous as rank 1 of 2.
    struct FakeNccl;

    impl DeviceLaunch<F> for FakeNccl {
        fn offers_nccl(&self) -> bool {
            true
        }

        fn install_nccl(&self, _: &DistDevice<F>) -> Result<(), Error> {
            Ok(())
        }

        fn rendezvous<T>(
            &self,
            mesh: &DeviceMesh,
            body: &mut dyn FnMut(DistDevice<F>) -> T,
        ) -> Result<T, Error> {
            let world =
                crate::comm::InProcessWorld::new(mesh.clone(), crate::comm::DEFAULT_TIMEOUT);
            Ok(body(DistDevice::new(
                Default::default(),
                Arc::new(world.communicator(1)),
            )))
        }
    }

    fn spec(launch: Launch, collectives: Collectives) -> JobSpec {
        JobSpec {
            mesh: DeviceMesh::new([("dp", 2)]).unwrap(),
            launch,
            collectives,
            options: LaunchOptions::default(),
        }
    }

    /// Which launches each support can run, and what the refusal says to do.
    #[test]
    fn check_job_refuses_what_the_build_or_backend_cannot_run() {
        use Collectives::*;
        use Launch::*;
        let refusal = |launch, collectives| match check_job::<F, _>(
            &spec(launch, collectives),
            &HostLaunch,
        ) {
            Ok(()) => String::new(),
            Err(Error::Unsupported(why)) => why,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(refusal(Threads, Host), "");
        assert_eq!(refusal(Threads, Staged), "");
        assert!(refusal(Threads, Nccl).contains("--features cuda"));
        for collectives in [Host, Staged, Nccl] {
            assert!(
                refusal(Rendezvous, collectives).contains("without MPI the ranks need NCCL"),
                "{collectives:?}"
            );
        }
        assert_eq!(
            refusal(Mpi, Host).contains("built without MPI"),
            cfg!(not(feature = "mpi"))
        );
        for (launch, collectives) in [(Threads, Nccl), (Rendezvous, Nccl)] {
            check_job::<F, _>(&spec(launch, collectives), &FakeNccl).unwrap();
        }
        assert!(check_job::<F, _>(&spec(Rendezvous, Host), &FakeNccl).is_err());
    }

    /// Ranks as threads get the collectives asked for installed before their body runs (staged
    /// on any backend), and come back in rank order from rank 0; a torchrun-style process runs
    /// its one rank through the backend's rendezvous and reports that rank.
    #[test]
    fn launch_job_installs_the_collectives_and_reports_this_process_ranks() {
        for (collectives, installed) in [(Collectives::Host, false), (Collectives::Staged, true)] {
            let launched = launch_job::<F, _, _, _>(
                &spec(Launch::Threads, collectives),
                &Default::default(),
                &HostLaunch,
                |d| (d.rank(), d.context().device_collectives::<F>().is_some()),
            )
            .unwrap();
            assert_eq!(launched.first_rank, 0);
            assert_eq!(launched.results, vec![(0, installed), (1, installed)]);
        }
        let launched = launch_job::<F, _, _, _>(
            &spec(Launch::Rendezvous, Collectives::Nccl),
            &Default::default(),
            &FakeNccl,
            |d| d.rank() * 10,
        )
        .unwrap();
        assert_eq!((launched.first_rank, launched.results), (1, vec![10]));
    }
}
