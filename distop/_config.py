"""Settings: what the environment and `distop.configure` ask of distop.

Settings come from environment variables when distop is imported and can be changed
with `distop.configure`; they apply to programs traced afterwards.
- `DISTOP_CHECK_COLLECTIVES=1` (default 0): the checking mode.
- `DISTOP_WATCHDOG=SECONDS` (default 60; 0 turns it off): the longest a rank may wait
  for its peers (in a distop step, or in an MPI call of an operator's method) while no
  peer is known to be computing, before it reports where every rank stands and aborts
  the job. Time a method spends computing does not count.

Other modules read their own yes/no variables with `env_flag` when they need them.
"""

import dataclasses
import os


def env_flag(name: str, default: bool | None) -> bool | None:
    """Read a yes/no setting from the environment.

    **Arguments:**
    - `name`: the environment variable.
    - `default`: the value where it is unset or empty.

    **Returns:** True for 1, true, yes, on (or any other nonzero integer), False for 0,
    false, no, off, in any case; `default` where the variable is unset or empty.

    **Raises:** ValueError naming the variable, for any other value.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("true", "yes", "on"):
        return True
    if value in ("false", "no", "off"):
        return False
    try:
        return int(value) != 0
    except ValueError:
        pass
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1, true, yes or on, or 0, "
                     "false, no or off.")


def _seconds(name: str, default: float) -> float:
    """Read a duration from the environment.

    **Arguments:**
    - `name`: the environment variable.
    - `default`: the value where it is unset or empty.

    **Returns:** the number of seconds.

    **Raises:** ValueError naming the variable, for anything but a number.
    """
    value = os.environ.get(name, "").strip()
    try:
        return float(value) if value else default
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r}: expected a number of seconds "
                         "(0 turns it off).") from None


@dataclasses.dataclass
class Settings:
    """distop's run-time settings (see the module docstring)."""

    check_collectives: bool = bool(env_flag("DISTOP_CHECK_COLLECTIVES", False))
    watchdog: float = _seconds("DISTOP_WATCHDOG", 60.0)


# The one instance every module reads, so that `configure` reaches them all.
settings = Settings()


def configure(*, check_collectives: bool | None = None,
              watchdog: float | None = None) -> Settings:
    """Change distop's run-time settings.

    **Arguments:**
    - `check_collectives`: the run-time checking mode (env `DISTOP_CHECK_COLLECTIVES`);
      it applies to programs traced afterwards.
    - `watchdog`: seconds a rank may wait for its peers, while none is known to be
      computing, before it aborts the job (env `DISTOP_WATCHDOG`; 0 turns it off); it
      takes effect at once.

    **Returns:** the `Settings` now in force.

    **Raises:** `TypeError` or `ValueError` for a `watchdog` that is not a number.

    ```python
    import distop

    distop.configure(watchdog=120.0)  # long solves may keep ranks waiting for minutes
    distop.configure(watchdog=60.0)
    ```
    """
    if check_collectives is not None:
        settings.check_collectives = bool(check_collectives)
    if watchdog is not None:
        settings.watchdog = float(watchdog)
    return settings
