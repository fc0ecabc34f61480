"""InfiniBand / RoCE port counters from sysfs -> ``telemetry.network``.

The RDMA core exposes every HCA port under ``/sys/class/infiniband``::

    <root>/<device>/ports/<port>/counters/<name>      one integer per file
    <root>/<device>/ports/<port>/hw_counters/<name>   driver counters (mlx5: RoCE, retries)
    <root>/<device>/ports/<port>/state                e.g. "4: ACTIVE"
    <root>/<device>/ports/<port>/phys_state           e.g. "5: LinkUp"
    <root>/<device>/ports/<port>/link_layer           "InfiniBand" or "Ethernet"

One record per node lists every port, ``"<device>/<port>"`` (e.g. ``mlx5_0/1``), with:

====================  ======================================================================
record field          sysfs file
====================  ======================================================================
symbol_errors         ``counters/symbol_error``
link_error_recovery   ``counters/link_error_recovery``
link_downed           ``counters/link_downed``
rcv_errors            ``counters/port_rcv_errors``
xmit_discards         ``counters/port_xmit_discards``
xmit_wait             ``counters/port_xmit_wait``
xmit_bytes            ``counters_ext/port_xmit_data_64`` where the driver has it (mlx4), else
                      ``counters/port_xmit_data``; x 4 (the counter counts 4-octet words)
rcv_bytes             ``counters_ext/port_rcv_data_64``, else ``counters/port_rcv_data``; x 4
hw                    every integer file of ``hw_counters/`` (``lifespan``, a setting, skipped)
state                 ``up`` when ``state`` is 4 (ACTIVE) and ``phys_state`` is not Sleep,
                      Polling or Disabled (1-3), else ``down``
phys_state            the name in ``phys_state`` ("5: LinkUp" -> ``LinkUp``)
rate_gbps, width,     ``rate``: "100 Gb/sec (4X EDR)" -> 100.0, 4, ``EDR``
speed
link_layer            ``link_layer``: ``InfiniBand`` or ``Ethernet`` (RoCE)
hca                   ``<device>/hca_type`` (e.g. ``MT4129``), where the driver has it
switch                see below
====================  ======================================================================

**A counter the port does not give is ``None``, never 0**: a port without a
performance-management agent answers ``N/A (no PMA)`` (Intel i40iw, some virtual
functions), a driver may lack a file (mlx4's second port has no error counters), and a
file may be unreadable or hold an absurd value (above the schema's limit; logged once per
port and counter).  InfiniBand counters do not wrap: they stop at the maximum of their
width (8 bits for ``link_downed`` and ``link_error_recovery``, 16 for the error counters,
32 for ``port_xmit_wait`` and the legacy data counters).  **A counter at that maximum is
saturated**: its field is ``None`` and its name is listed in ``saturated``, so no rate is
computed from it (clear it with ``perfquery -x -R`` to read it again).  The 64-bit
``counters_ext`` values and the 64-bit data counters the kernel serves from the
extended PMA do not saturate in practice.  An unreadable or non-integer ``hw_counters``
file is left out of ``hw``.  Ports of both link layers (InfiniBand and RoCE) are reported.

The switch a port is cabled to comes from ``switches`` (``"<device>/<port>"`` or
``"<device>"`` -> switch id, from the inventory), else from LLDP-style labels in
``lldp_dir`` (a directory holding ``<device>/<port>`` or ``<device>`` files whose first
line is the switch id, or a JSON file with the same mapping as ``switches``), else it is
``"unknown"``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from schemas.records import MAX_COUNTER, MAX_PORTS

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/sys/class/infiniband"
UNKNOWN_SWITCH = "unknown"

#: record field -> (counters/ file, multiplier to the record's unit, bits of the PMA counter)
COUNTERS: dict[str, tuple[str, int, int]] = {
    "symbol_errors": ("symbol_error", 1, 16),
    "link_error_recovery": ("link_error_recovery", 1, 8),
    "link_downed": ("link_downed", 1, 8),
    "rcv_errors": ("port_rcv_errors", 1, 16),
    "xmit_discards": ("port_xmit_discards", 1, 16),
    "xmit_wait": ("port_xmit_wait", 1, 32),
    "xmit_bytes": ("port_xmit_data", 4, 32),
    "rcv_bytes": ("port_rcv_data", 4, 32),
}
#: record field -> its 64-bit counters_ext/ file (mlx4's extended counters)
COUNTERS_EXT: dict[str, str] = {"xmit_bytes": "port_xmit_data_64", "rcv_bytes": "port_rcv_data_64"}
#: What a port without a performance-management agent answers for every counter.
NO_PMA = "N/A"

_RATE = re.compile(r"^\s*(?P<gbps>\d+(?:\.\d+)?)\s*Gb/sec\s*(?:\((?P<width>\d+)X\s*(?P<speed>[A-Za-z0-9]*)\))?")
_LINK_LAYERS = ("InfiniBand", "Ethernet")

#: hw_counters files that hold settings, not counters.
_NOT_COUNTERS = frozenset({"lifespan"})
#: Limits of PortSample.hw: entries, and length of a name.
_MAX_HW = 128
_MAX_HW_NAME = 64
_MAX_SWITCH_ID = 253

_STATE_ACTIVE = 4
#: phys_state codes of a physical link that is certainly not up: Sleep, Polling, Disabled
_PHYS_NOT_UP = frozenset({1, 2, 3})

_warned: set[tuple[str, str]] = set()


def _warn_once(where: str, what: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
    """Log the first time ``what`` goes wrong at ``where`` (a port directory)."""
    if (where, what) not in _warned:
        _warned.add((where, what))
        log.log(level, message, *args)


def natural_key(name: str) -> list[Any]:
    """Sort key putting mlx5_2 before mlx5_10 and port 2 before port 10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):  # missing, a directory, EINVAL from the driver, not text
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text, 10)
    except ValueError:
        return None


def _state_code(path: Path) -> int | None:
    """The number of a ``state`` / ``phys_state`` file ("4: ACTIVE" -> 4)."""
    text = _read_text(path)
    head = (text or "").split(":", 1)[0].strip()
    return int(head) if head.isdigit() else None


def _switch_id(value: object, source: str) -> str | None:
    """The first line of ``value`` if it is a usable switch id."""
    lines = str(value).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if 0 < len(text) <= _MAX_SWITCH_ID:
        return text
    log.warning("ignoring switch id %r from %s (empty or longer than %d characters)",
                value, source, _MAX_SWITCH_ID)
    return None


def _load_lldp(lldp: str | Path | None) -> dict[str, str]:
    """Switch labels from an LLDP directory or JSON file, as ``switches`` would give them."""
    if lldp is None:
        return {}
    path = Path(lldp)
    labels: dict[str, str] = {}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("switch labels %s unreadable: %s", path, exc)
            return {}
        if not isinstance(data, dict):
            log.warning("switch labels %s: expected a JSON object of port -> switch id", path)
            return {}
        items = list(data.items())
    elif path.is_dir():
        items = []
        for entry in path.iterdir():
            if entry.is_file():
                items.append((entry.name, _read_text(entry)))
            elif entry.is_dir():
                items.extend((f"{entry.name}/{f.name}", _read_text(f)) for f in entry.iterdir() if f.is_file())
    else:
        return {}
    for key, value in items:
        if value is not None and (switch := _switch_id(value, f"{path} [{key}]")) is not None:
            labels[str(key)] = switch
    return labels


def switch_of(table: Mapping[str, str] | None, port_id: str, device: str) -> str | None:
    """The switch of a port from a port or device mapping."""
    if not table:
        return None
    value = table.get(port_id) or table.get(device)
    return None if value is None else _switch_id(value, f"the switch of {port_id}")


def _read_hw(port_id: str, hw_dir: Path) -> dict[str, int] | None:
    """The integer files of ``hw_counters/``, by name; ``None`` if there is none."""
    if not hw_dir.is_dir():
        return None
    hw: dict[str, int] = {}
    for entry in sorted(hw_dir.iterdir(), key=lambda p: p.name):
        if entry.name in _NOT_COUNTERS or len(entry.name) > _MAX_HW_NAME:
            continue
        value = _read_int(entry)
        if value is None or not 0 <= value <= MAX_COUNTER:
            log.debug("%s: hw_counters/%s unreadable or not a counter: skipped", port_id, entry.name)
            continue
        if len(hw) == _MAX_HW:
            _warn_once(str(hw_dir), "hw", "%s: more than %d hw_counters: the rest are left out", port_id, _MAX_HW)
            break
        hw[entry.name] = value
    return hw or None


def parse_rate(text: str | None) -> tuple[float | None, int | None, str | None]:
    """``rate`` ("100 Gb/sec (4X EDR)", "10 Gb/sec (4X)") -> (Gb/s, lanes, lane speed)."""
    m = _RATE.match(text or "")
    if m is None:
        return None, None, None
    width = int(m["width"]) if m["width"] else None
    return float(m["gbps"]), width if width and 1 <= width <= 64 else None, (m["speed"] or None)


def _state_name(text: str | None) -> str | None:
    """The name of a ``phys_state`` file ("5: LinkUp" -> "LinkUp")."""
    if not text:
        return None
    name = text.split(":", 1)[-1].strip()
    return name[:64] or None


def _counter(port_id: str, port_dir: Path, field: str) -> tuple[int | None, bool]:
    """One counter field in the record's unit, and whether it is saturated."""
    name, scale, bits = COUNTERS[field]
    ext = COUNTERS_EXT.get(field)
    if ext is not None and (raw := _read_int(port_dir / "counters_ext" / ext)) is not None:
        bits = 64
    else:
        text = _read_text(port_dir / "counters" / name)
        if text is None:
            _warn_once(str(port_dir), name, "%s: counters/%s missing or unreadable: unknown", port_id, name,
                       level=logging.INFO)
            return None, False
        if text.startswith(NO_PMA):
            _warn_once(str(port_dir), NO_PMA, "%s: %r (no performance-management agent): counters unknown",
                       port_id, text, level=logging.INFO)
            return None, False
        try:
            raw = int(text, 10)
        except ValueError:
            _warn_once(str(port_dir), name, "%s: counters/%s holds %r, not a counter: unknown", port_id, name, text)
            return None, False
    if raw == 2**bits - 1:
        _warn_once(str(port_dir), f"{name}:saturated", "%s: %s stopped at its %d-bit maximum %d: unknown until "
                   "it is cleared", port_id, name, bits, raw)
        return None, True
    value = raw * scale
    if not 0 <= value <= MAX_COUNTER:
        _warn_once(str(port_dir), name, "%s: %s out of range (%r): unknown", port_id, name, raw)
        return None, False
    return value, False


def read_port(device: str, port_dir: Path, switch: str, hca: str | None = None) -> dict[str, Any]:
    """One PortSample as a dict, read from ``<root>/<device>/ports/<port>``."""
    port_id = f"{device}/{port_dir.name}"
    up = (_state_code(port_dir / "state") == _STATE_ACTIVE
          and _state_code(port_dir / "phys_state") not in _PHYS_NOT_UP)
    port: dict[str, Any] = {"port": port_id, "switch": switch, "state": "up" if up else "down"}
    saturated = []
    for field in COUNTERS:
        port[field], full = _counter(port_id, port_dir, field)
        if full:
            saturated.append(field)
    if saturated:
        port["saturated"] = saturated
    rate, width, speed = parse_rate(_read_text(port_dir / "rate"))
    layer = _read_text(port_dir / "link_layer")
    port.update({"rate_gbps": rate, "width": width, "speed": speed,
                 "phys_state": _state_name(_read_text(port_dir / "phys_state")),
                 "link_layer": layer if layer in _LINK_LAYERS else None, "hca": hca})
    hw = _read_hw(port_id, port_dir / "hw_counters")
    if hw is not None:
        port["hw"] = hw
    return port


def read_network_sample(
    node: str,
    *,
    ts: float,
    root: str | Path = DEFAULT_ROOT,
    switches: Mapping[str, str] | None = None,
    lldp_dir: str | Path | None = None,
) -> dict[str, Any] | None:
    """One NetworkSample wire dict for every port under ``root``; ``None`` if there is none."""
    try:
        devices = sorted((d for d in Path(root).iterdir() if (d / "ports").is_dir()), key=lambda d: natural_key(d.name))
    except OSError:  # no RDMA devices on this node: the class directory does not exist
        return None
    lldp = _load_lldp(lldp_dir)
    ports = []
    for dev in devices:
        hca = (_read_text(dev / "hca_type") or "")[:64] or None
        for port_dir in sorted((p for p in (dev / "ports").iterdir() if p.is_dir()), key=lambda p: natural_key(p.name)):
            port_id = f"{dev.name}/{port_dir.name}"
            switch = switch_of(switches, port_id, dev.name) or switch_of(lldp, port_id, dev.name) or UNKNOWN_SWITCH
            ports.append(read_port(dev.name, port_dir, switch, hca))
    if not ports:
        return None
    if len(ports) > MAX_PORTS:
        _warn_once(node, "ports", "%s: %d fabric ports, only the first %d are reported", node, len(ports), MAX_PORTS)
        ports = ports[:MAX_PORTS]
    return {"schema": "network/2", "ts": ts, "node": node, "ports": ports}
