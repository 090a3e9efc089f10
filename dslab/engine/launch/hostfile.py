"""DeepSpeed's hostfile: one ``hostname slots=N`` per line.

``#`` starts a comment (whole line or trailing), blank lines are skipped. A host listed twice, a
line that is not ``hostname slots=N`` or a slot count below 1 is a ValueError naming the file and
the line. The host order of the file is kept: the first host is node 0 and the default master.
"""

from __future__ import annotations

import re
from pathlib import Path

DEFAULT_HOSTFILE = "/job/hostfile"

_LINE = re.compile(r"^(?P<host>[^\s=#]+)\s+slots\s*=\s*(?P<slots>\S+)$")


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """``{host: slots}`` in file order from the text of a hostfile (``source`` names it in errors)."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{source}:{number}: expected 'hostname slots=N', got {raw.strip()!r}")
        host, slots = match["host"], match["slots"]
        if not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"{source}:{number}: slots must be an integer >= 1, got {slots!r} for host {host!r}")
        if host in hosts:
            raise ValueError(f"{source}:{number}: host {host!r} is listed twice "
                             f"(first on line {first_line[host]})")
        hosts[host] = int(slots)
        first_line[host] = number
    if not hosts:
        raise ValueError(f"{source}: no hosts (expected lines of 'hostname slots=N')")
    return hosts


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """``{host: slots}`` in file order from the hostfile at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"hostfile {path} does not exist")
    return parse_hostfile_text(path.read_text(), str(path))
