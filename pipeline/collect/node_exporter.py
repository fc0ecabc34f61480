"""node_exporter's InfiniBand metrics -> ``telemetry.network``, where node_exporter
already reads the node's sysfs and the agent should not.

node_exporter's ``infiniband`` collector (enabled by default) exports one series per
``device`` and ``port`` label.  The text is parsed with ``prometheus_client``'s parser:

====================  ========================================================================
record field          node_exporter metric (``node_infiniband_`` prefix left out)
====================  ========================================================================
symbol_errors         ``symbol_error_total``
link_error_recovery   ``link_error_recovery_total``
link_downed           ``link_downed_total``
rcv_errors            ``port_errors_received_total``
xmit_discards         ``port_discards_transmitted_total``
xmit_wait             ``port_transmit_wait_total``
xmit_bytes            ``legacy_data_transmitted_bytes_total`` (mlx4's 64-bit counters_ext) where
                      exported, else ``port_data_transmitted_bytes_total`` (already in octets)
rcv_bytes             ``legacy_data_received_bytes_total``, else ``port_data_received_bytes_total``
state                 ``state_id`` 4 (active), and ``physical_state_id`` not 1-3
phys_state            ``physical_state_id``, named as the kernel names it (5 -> ``LinkUp``)
rate_gbps             ``rate_bytes_per_second`` x 8 / 10**9
hca                   the ``hca_type`` label of ``info``
====================  ========================================================================

node_exporter leaves out a series whose sysfs file answered ``N/A (no PMA)`` or was
missing, so such a counter is ``None`` here too, as it is from sysfs.  A counter at the
maximum of its PMA width is ``None`` and named in ``saturated``, as from sysfs.
node_exporter does not export the link width, the lane speed or the link layer (they are
``None``) and renames the driver's ``hw_counters`` (they are not carried).  The metrics
have no host label: one exporter describes one node, the agent's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from schemas.records import MAX_COUNTER, MAX_PORTS

from pipeline.collect.infiniband import UNKNOWN_SWITCH, switch_of, natural_key

log = logging.getLogger(__name__)

PREFIX = "node_infiniband_"
#: record field -> (metric names, most preferred first; the counter's PMA width in bits, per name)
COUNTERS: dict[str, tuple[tuple[str, int], ...]] = {
    "symbol_errors": (("symbol_error_total", 16),),
    "link_error_recovery": (("link_error_recovery_total", 8),),
    "link_downed": (("link_downed_total", 8),),
    "rcv_errors": (("port_errors_received_total", 16),),
    "xmit_discards": (("port_discards_transmitted_total", 16),),
    "xmit_wait": (("port_transmit_wait_total", 32),),
    "xmit_bytes": (("legacy_data_transmitted_bytes_total", 64), ("port_data_transmitted_bytes_total", 32)),
    "rcv_bytes": (("legacy_data_received_bytes_total", 64), ("port_data_received_bytes_total", 32)),
}
#: node_exporter multiplies the data counters (4-octet words) by 4.
_OCTETS = frozenset({"legacy_data_transmitted_bytes_total", "legacy_data_received_bytes_total",
                     "port_data_transmitted_bytes_total", "port_data_received_bytes_total"})
#: The kernel's names of the physical port states (drivers/infiniband/core/sysfs.c).
PHYS_STATES = {1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining", 5: "LinkUp",
               6: "LinkErrorRecovery", 7: "Phy Test"}
_STATE_ACTIVE = 4
_PHYS_NOT_UP = frozenset({1, 2, 3})


def _saturated(name: str, value: float, bits: int) -> bool:
    raw = value / 4 if name in _OCTETS else value
    return bits < 64 and raw == 2**bits - 1


def parse_node_exporter(text: str, node: str, *, ts: float,
                        switches: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """One NetworkSample wire dict for the ports in node_exporter's text; ``None`` if it
    has none.  ``switches`` maps ``"<device>/<port>"`` or ``"<device>"`` to a switch id."""
    series: dict[tuple[str, str], dict[str, float]] = {}
    hca: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX):
            continue
        for sample in family.samples:
            device, port = sample.labels.get("device"), sample.labels.get("port")
            if sample.name == PREFIX + "info" and device and sample.labels.get("hca_type"):
                hca[device] = sample.labels["hca_type"][:64]
            if not device or not port or not math.isfinite(sample.value):
                continue
            series.setdefault((device, port), {})[sample.name.removeprefix(PREFIX)] = sample.value
    ports = []
    for (device, port), values in sorted(series.items(), key=lambda kv: (natural_key(kv[0][0]), natural_key(kv[0][1]))):
        port_id = f"{device}/{port}"
        phys = values.get("physical_state_id")
        phys_code = int(phys) if phys is not None else None
        up = values.get("state_id") == _STATE_ACTIVE and phys_code not in _PHYS_NOT_UP
        rec: dict[str, Any] = {"port": port_id, "switch": switch_of(switches, port_id, device) or UNKNOWN_SWITCH,
                               "state": "up" if up else "down"}
        saturated = []
        for field, names in COUNTERS.items():
            rec[field] = None
            for name, bits in names:
                if (value := values.get(name)) is None:
                    continue
                if _saturated(name, value, bits):
                    saturated.append(field)
                elif 0 <= value <= MAX_COUNTER:
                    rec[field] = int(value)
                else:
                    log.warning("%s: %s%s out of range (%r): unknown", port_id, PREFIX, name, value)
                break
        if saturated:
            rec["saturated"] = saturated
        rate = values.get("rate_bytes_per_second")
        rec["rate_gbps"] = rate * 8 / 1e9 if rate is not None and 0 <= rate <= 1.25e13 else None
        rec["phys_state"] = PHYS_STATES.get(phys_code) if phys_code is not None else None
        rec["hca"] = hca.get(device)
        ports.append(rec)
    if not ports:
        return None
    if len(ports) > MAX_PORTS:
        log.warning("%s: %d fabric ports, only the first %d are reported", node, len(ports), MAX_PORTS)
        ports = ports[:MAX_PORTS]
    return {"schema": "network/2", "ts": ts, "node": node, "ports": ports}
