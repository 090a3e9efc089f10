"""What a remote host's processes inherit: ``.dslab_env`` files and ``NCCL_*``, ``PYTHON*`` and
``DSLAB_*`` variables of the launching shell.

A ``.dslab_env`` file holds ``KEY=VALUE`` lines (blank lines and ``#`` comment lines skipped;
the value is everything after the first ``=``, taken literally). The one in the home directory is
read first and the one in the current directory second, so the current directory's wins; both
win over the launching shell's variables. A local process inherits the launching shell anyway
and gets the files' variables on top.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

ENV_FILE_NAME = ".dslab_env"
PROPAGATED_PREFIXES = ("NCCL_", "PYTHON", "DSLAB_")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def read_env_file(path: str | Path) -> dict[str, str]:
    """``{KEY: VALUE}`` from one ``.dslab_env`` file; a bad line is a ValueError naming file:line."""
    values: dict[str, str] = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise ValueError(f"{path}:{number}: expected KEY=VALUE, got {raw.strip()!r}")
        values[key] = value.strip()
    return values


def env_file_values(cwd: str | Path | None = None, home: str | Path | None = None) -> dict[str, str]:
    """The ``.dslab_env`` variables: home's, then the current directory's on top."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    home = Path.home() if home is None else Path(home)
    values: dict[str, str] = {}
    seen: set[Path] = set()
    for directory in (home, cwd):
        path = directory / ENV_FILE_NAME
        if path.is_file() and path.resolve() not in seen:
            seen.add(path.resolve())
            values.update(read_env_file(path))
    return values


def propagated_env(environ: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                   home: str | Path | None = None) -> dict[str, str]:
    """Variables to export on a remote host: the shell's ``NCCL_*``/``PYTHON*``/``DSLAB_*`` (by
    name), then the ``.dslab_env`` files' (which win)."""
    environ = os.environ if environ is None else environ
    values = {key: environ[key] for key in sorted(environ) if key.startswith(PROPAGATED_PREFIXES)}
    values.update(env_file_values(cwd, home))
    return values
