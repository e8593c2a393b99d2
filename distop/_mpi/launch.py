"""Launcher guardrails: check, before MPI starts and again after, that the launcher
(mpiexec, srun) matches the MPI library mpi4py loaded.

Two mismatches are common and silent or cryptic: an MPICH library under a PMIx launcher
(Open MPI's mpiexec, `srun --mpi=pmix`) dies in MPI_Init with "Runtime environment uses
unsupported PMI version PMIx"; an Open MPI library under MPICH's mpiexec gives every
rank a world of size 1, so N copies of a one-rank job run side by side. Set
`DISTOP_SKIP_LAUNCH_CHECK=1` to skip the checks for unusual setups.
"""

from collections.abc import Mapping

from .._config import env_flag


def _library_family(version: str) -> str:
    text = version.lower()
    if "open mpi" in text:
        return "Open MPI"
    if any(name in text for name in ("mpich", "mvapich", "intel(r) mpi", "cray mpich")):
        return "MPICH"
    return "an unknown MPI"


def detect_launcher(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """Recognize the launcher that started this process from its environment.

    **Arguments:**
    - `env`: the environment (a mapping, e.g. `os.environ`).

    **Returns:** (launcher description, number of processes it started or None), or
    (None, None) where no launcher is recognized.
    """
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "Open MPI's mpiexec (OMPI_COMM_WORLD_SIZE)", int(env["OMPI_COMM_WORLD_SIZE"])
    if "PMIX_RANK" in env or "PMIX_NAMESPACE" in env:
        size = env.get("SLURM_NTASKS") if "SLURM_STEP_ID" in env else None
        return ("a PMIx launcher (PMIX_RANK/PMIX_NAMESPACE: Open MPI's mpiexec or "
                "srun --mpi=pmix)"), (int(size) if size else None)
    if "PMI_SIZE" in env or "PMI_RANK" in env or "PMI_FD" in env:
        size = env.get("PMI_SIZE")
        return ("a PMI launcher (PMI_SIZE/PMI_RANK/PMI_FD: MPICH's mpiexec, or srun "
                "--mpi=pmi2)"), (int(size) if size else None)
    if "SLURM_STEP_ID" in env and "SLURM_NTASKS" in env:
        return "srun (SLURM_NTASKS)", int(env["SLURM_NTASKS"])
    if "MPI_LOCALNRANKS" in env:
        return "MPICH's mpiexec (MPI_LOCALNRANKS)", None
    return None, None


def diagnose(env: Mapping[str, str], library_version: str,
             world_size: int | None = None) -> str | None:
    """Find a launcher/library mismatch.

    **Arguments:**
    - `env`: the environment (a mapping, e.g. `os.environ`).
    - `library_version`: `MPI.Get_library_version()`.
    - `world_size`: the size of `MPI.COMM_WORLD` once MPI runs, or None before.

    **Returns:** an error message naming the library, the launcher and the fix, or
    None if all is well.
    """
    family = _library_family(library_version)
    launcher, started = detect_launcher(env)
    if launcher is None:
        return None
    pmix = "PMIx" in launcher
    fix_mpich = ("launch with the mpiexec that comes with this MPICH (with the pip "
                 "extra: the mpiexec beside your Python, e.g. .venv/bin/mpiexec), or "
                 "`srun --mpi=pmi2`; or reinstall mpi4py against the cluster's MPI "
                 "(pip install --no-binary mpi4py mpi4py, without the mpich extra)")
    fix_ompi = ("launch with Open MPI's own mpirun/mpiexec, or `srun --mpi=pmix`; or use "
                "MPICH's mpiexec with an MPICH build of mpi4py (pip install 'distop[mpich]')")
    if world_size is None:
        if family == "MPICH" and (pmix or "Open MPI" in launcher):
            return (f"mpi4py loaded an MPICH library, but the job was started by {launcher}. "
                    "MPI_Init would fail with 'Runtime environment uses unsupported PMI "
                    f"version PMIx'. Fix: {fix_mpich}.")
        if family == "Open MPI" and launcher.startswith("a PMI launcher"):
            return (f"mpi4py loaded an Open MPI library, but the job was started by "
                    f"{launcher}; every rank would get a world of size 1 and run alone. "
                    f"Fix: {fix_ompi}.")
        return None
    if started and started > 1 and world_size == 1:
        fix = fix_ompi if family == "Open MPI" else fix_mpich
        return (f"{launcher} started {started} processes, but {family} gives this one a "
                "world of size 1: the launcher does not match the MPI library, so the "
                f"ranks would run as {started} separate one-rank jobs. Fix: {fix}.")
    return None


def skip() -> bool:
    """**Returns:** whether the user turned the checks off (DISTOP_SKIP_LAUNCH_CHECK)."""
    return bool(env_flag("DISTOP_SKIP_LAUNCH_CHECK", False))
