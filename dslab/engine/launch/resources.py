"""Which hosts and slots a launch uses: ``--include`` / ``--exclude`` and ``--num_nodes`` /
``--num_gpus`` applied to the hostfile's ``{host: slots}``.

The filter syntax is DeepSpeed's: ``@``-separated hosts, each optionally followed by ``:`` and a
comma-separated list of slots (GPU indices on that host)::

    worker-0@worker-1:0,2     all of worker-0, and slots 0 and 2 of worker-1

``--include`` keeps only what it names; ``--exclude`` removes what it names (a host without a
slot list entirely). They are mutually exclusive, and neither combines with ``--num_nodes`` /
``--num_gpus``, which keep the first N hosts of the hostfile and the first N slots of each host.
A host or slot the hostfile does not have is a ValueError naming it.
"""

from __future__ import annotations


def parse_host_filter(spec: str, hosts: dict[str, int], option: str = "--include") -> dict[str, list[int] | None]:
    """``{host: sorted slots, or None for all}`` from a filter string, checked against ``hosts``."""
    if not spec or not spec.strip():
        raise ValueError(f"{option} is empty: expected 'host[:slot,...]@host...'")
    chosen: dict[str, list[int] | None] = {}
    for item in spec.split("@"):
        item = item.strip()
        host, sep, slot_list = item.partition(":")
        if not host:
            raise ValueError(f"{option} {spec!r}: empty host name in {item!r}")
        if host not in hosts:
            raise ValueError(f"{option} {spec!r}: unknown host {host!r} (hosts: {', '.join(hosts)})")
        if not sep:
            chosen[host] = None
            continue
        slots = []
        for text in slot_list.split(","):
            text = text.strip()
            if not text.isdigit():
                raise ValueError(f"{option} {spec!r}: slot {text!r} of host {host!r} is not a non-negative integer")
            slot = int(text)
            if slot >= hosts[host]:
                raise ValueError(f"{option} {spec!r}: host {host!r} has no slot {slot} "
                                 f"(it has slots 0-{hosts[host] - 1})")
            slots.append(slot)
        if host in chosen and chosen[host] is None:
            continue
        chosen[host] = sorted(set(slots) | set(chosen.get(host) or ()))
    return chosen


def select_resources(hosts: dict[str, int], include: str | None = None, exclude: str | None = None,
                     num_nodes: int | None = None, num_gpus: int | None = None) -> dict[str, list[int]]:
    """``{host: slots to use}`` in hostfile order (see the module docstring)."""
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive")
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise ValueError("--num_nodes/--num_gpus cannot be combined with --include/--exclude: "
                         "name the hosts and slots in the filter instead")
    selected = {host: list(range(slots)) for host, slots in hosts.items()}
    if include:
        chosen = parse_host_filter(include, hosts, "--include")
        selected = {host: selected[host] if chosen[host] is None else chosen[host]
                    for host in hosts if host in chosen}
    elif exclude:
        dropped = parse_host_filter(exclude, hosts, "--exclude")
        selected = {host: [s for s in slots if s not in dropped[host]] if host in dropped and dropped[host] is not None
                    else slots
                    for host, slots in selected.items() if not (host in dropped and dropped[host] is None)}
        selected = {host: slots for host, slots in selected.items() if slots}
    if num_nodes is not None:
        if num_nodes < 1 or num_nodes > len(selected):
            raise ValueError(f"--num_nodes {num_nodes}: the hostfile has {len(selected)} host(s)")
        selected = dict(list(selected.items())[:num_nodes])
    if num_gpus is not None:
        for host, slots in selected.items():
            if num_gpus < 1 or num_gpus > len(slots):
                raise ValueError(f"--num_gpus {num_gpus}: host {host!r} has {len(slots)} slot(s)")
        selected = {host: slots[:num_gpus] for host, slots in selected.items()}
    if not selected:
        raise ValueError("no hosts or slots left to launch on after --include/--exclude")
    return selected
