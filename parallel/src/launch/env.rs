//! Which launcher started this process, read once from the environment: `mpirun` (Open MPI),
//! MPICH / Intel MPI (PMI), `srun` (SLURM) or `torchrun`. Every place that needs the world size,
//! this process's rank or its local rank asks here.
//!
//! Precedence: an MPI runtime's own variables first (they are set only for processes it
//! started); then torchrun's `WORLD_SIZE` + `RANK`, because torchrun is often run inside a SLURM
//! allocation, where the allocation's `SLURM_NTASKS` is set as well but torchrun's world is the
//! one the processes form; then SLURM's `SLURM_NTASKS` + `SLURM_PROCID` (`srun` starting the
//! processes, which then form an MPI world).

use std::fmt;

use crate::error::Error;

/// The program that started this process's world.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// A PMI launcher: MPICH's or Intel MPI's `mpiexec` (`PMI_SIZE`, `PMI_RANK`).
    Pmi,
    /// SLURM's `srun` (`SLURM_NTASKS`, `SLURM_PROCID`, `SLURM_LOCALID`).
    Slurm,
    /// PyTorch's `torchrun` or anything setting its variables (`WORLD_SIZE`, `RANK`,
    /// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`).
    Torchrun,
}

impl Launcher {
    /// Whether the processes form an MPI world (everything but torchrun).
    pub fn is_mpi(self) -> bool {
        self != Launcher::Torchrun
    }

    /// (world size, rank, local rank) variable names, in the order they are tried.
    fn variables(self) -> (&'static str, &'static str, &'static [&'static str]) {
        match self {
            Launcher::OpenMpi => (
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_RANK",
                &["OMPI_COMM_WORLD_LOCAL_RANK"],
            ),
            Launcher::Pmi => (
                "PMI_SIZE",
                "PMI_RANK",
                &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"],
            ),
            Launcher::Torchrun => ("WORLD_SIZE", "RANK", &["LOCAL_RANK"]),
            Launcher::Slurm => ("SLURM_NTASKS", "SLURM_PROCID", &["SLURM_LOCALID"]),
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::OpenMpi => "mpirun (Open MPI)",
            Launcher::Pmi => "mpiexec (PMI)",
            Launcher::Slurm => "srun (SLURM)",
            Launcher::Torchrun => "torchrun",
        })
    }
}

/// This process's place in a launched world.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Who started it.
    pub launcher: Launcher,
    /// Processes in the world.
    pub world_size: usize,
    /// This process's rank.
    pub rank: usize,
    /// Its rank among the processes of its node (which local device to use; 0 when the
    /// launcher does not say).
    pub local_rank: usize,
}

impl LaunchEnv {
    /// Read the process environment; `None` when no launcher started this process.
    pub fn detect() -> Result<Option<Self>, Error> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`LaunchEnv::detect`] over any variable lookup.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, Error> {
        let number = |name: &'static str| -> Result<Option<usize>, Error> {
            var(name)
                .map(|value| {
                    value.trim().parse().map_err(|e| Error::LaunchEnv {
                        var: name,
                        value: value.clone(),
                        reason: format!("not a number ({e})"),
                    })
                })
                .transpose()
        };
        for launcher in [
            Launcher::OpenMpi,
            Launcher::Pmi,
            Launcher::Torchrun,
            Launcher::Slurm,
        ] {
            let (size_var, rank_var, local_vars) = launcher.variables();
            let Some(world_size) = number(size_var)? else {
                continue;
            };
            let rank = number(rank_var)?.unwrap_or(0);
            if world_size == 0 || rank >= world_size {
                return Err(Error::LaunchEnv {
                    var: rank_var,
                    value: rank.to_string(),
                    reason: format!("not a rank of a world of {world_size} ({size_var})"),
                });
            }
            let mut local_rank = 0;
            for name in local_vars {
                if let Some(local) = number(name)? {
                    local_rank = local;
                    break;
                }
            }
            return Ok(Some(LaunchEnv {
                launcher,
                world_size,
                rank,
                local_rank,
            }));
        }
        Ok(None)
    }

    /// The local rank of this process (0 without a launcher or on a bad variable): which of the
    /// node's devices a process-per-device launch uses.
    pub fn local_rank_or_zero() -> usize {
        Self::detect().ok().flatten().map_or(0, |e| e.local_rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>, Error> {
        LaunchEnv::from_vars(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn no_launcher_is_none() {
        assert_eq!(env(&[("HOME", "/root")]), Ok(None));
    }

    #[test]
    fn torchrun_inside_a_slurm_allocation_is_torchrun() {
        let e = env(&[
            ("SLURM_NTASKS", "1"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                launcher: Launcher::Torchrun,
                world_size: 4,
                rank: 3,
                local_rank: 1
            }
        );
        assert!(!e.launcher.is_mpi());
    }

    #[test]
    fn mpi_runtimes_and_srun() {
        let ompi = env(&[
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("SLURM_NTASKS", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (ompi.launcher, ompi.rank, ompi.local_rank),
            (Launcher::OpenMpi, 1, 1)
        );
        let srun = env(&[
            ("SLURM_NTASKS", "8"),
            ("SLURM_PROCID", "5"),
            ("SLURM_LOCALID", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (srun.launcher, srun.world_size, srun.rank, srun.local_rank),
            (Launcher::Slurm, 8, 5, 1)
        );
        assert!(srun.launcher.is_mpi());
        let pmi = env(&[("PMI_SIZE", "3"), ("PMI_RANK", "2")])
            .unwrap()
            .unwrap();
        assert_eq!((pmi.launcher, pmi.local_rank), (Launcher::Pmi, 0));
    }

    #[test]
    fn bad_variables_are_typed_errors() {
        let e = env(&[("WORLD_SIZE", "four")]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::LaunchEnv {
                    var: "WORLD_SIZE",
                    ..
                }
            ),
            "{e:?}"
        );
        let e = env(&[("WORLD_SIZE", "2"), ("RANK", "2")]).unwrap_err();
        assert!(matches!(e, Error::LaunchEnv { var: "RANK", .. }), "{e:?}");
        assert!(e.to_string().contains("not a rank of a world of 2"), "{e}");
    }
}
