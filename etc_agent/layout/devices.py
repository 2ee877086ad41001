"""Device sets: nodes with local devices.

Written ``n0:8,n1:8`` (node name and device count: devices ``n0:0`` .. ``n0:7``) or with explicit
local indices ``n0:[0-2,4-7]`` when some devices of a node are missing. A device is named
``node:local``. Devices of an old and a new set with the same name are the same physical device.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

_NODE_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


MAX_DEVICES = 1 << 20
"""Devices a job may have (1,048,576): plans and placements are refused beyond it, in constant memory."""


@dataclass(frozen=True, order=True, slots=True)
class Device:
    node: str
    local: int

    def __str__(self) -> str:
        return f"{self.node}:{self.local}"

    @classmethod
    def parse(cls, text: str) -> Device:
        node, sep, local = text.strip().rpartition(":")
        if not sep or not _NODE_RE.match(node) or not local.isdigit():
            raise ValueError(f"bad device {text!r}: expected node:local, e.g. n1:3")
        return cls(node, int(local))


class DeviceSet:
    """An ordered list of distinct devices grouped by node (node order = first appearance)."""

    def __init__(self, devices: Iterable[Device]):
        self.devices: tuple[Device, ...] = tuple(devices)
        if len(set(self.devices)) != len(self.devices):
            dup = sorted({str(d) for d in self.devices if self.devices.count(d) > 1})
            raise ValueError(f"device set lists {', '.join(dup)} more than once")
        self.nodes: tuple[str, ...] = tuple(dict.fromkeys(d.node for d in self.devices))
        self._index = {d: i for i, d in enumerate(self.devices)}

    @classmethod
    def parse(cls, text: str) -> DeviceSet:
        """Parse ``n0:8,n1:8`` or ``n0:[0-2,4-7],n1:4``."""
        devices: list[Device] = []
        for item in _split_top_level(text):
            node, sep, spec = item.partition(":")
            node = node.strip()
            spec = spec.strip()
            if not sep or not _NODE_RE.match(node):
                raise ValueError(f"bad device set {text!r}: expected node:count items like n0:8,n1:8, got {item!r}")
            if spec.startswith("[") and spec.endswith("]"):
                locals_ = _parse_ranges(spec[1:-1], text)
            elif spec.isdigit() and 0 < int(spec) <= MAX_DEVICES:
                locals_ = list(range(int(spec)))
            elif spec.isdigit() and int(spec) > MAX_DEVICES:
                raise ValueError(f"bad device set {text!r}: more than {MAX_DEVICES} devices (the planner's limit)")
            else:
                raise ValueError(f"bad device set {text!r}: {item!r} needs a positive device count or [a-b,c]")
            if len(devices) + len(locals_) > MAX_DEVICES:
                raise ValueError(f"bad device set {text!r}: more than {MAX_DEVICES} devices (the planner's limit)")
            devices.extend(Device(node, i) for i in locals_)
        if not devices:
            raise ValueError(f"bad device set {text!r}: no devices")
        return cls(devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[Device]:
        return iter(self.devices)

    def __getitem__(self, i: int) -> Device:
        return self.devices[i]

    def __contains__(self, device: object) -> bool:
        return device in self._index

    def index(self, device: Device) -> int:
        return self._index[device]

    def node_devices(self, node: str) -> list[Device]:
        return [d for d in self.devices if d.node == node]

    def short(self) -> str:
        parts = []
        for node in self.nodes:
            locals_ = [d.local for d in self.devices if d.node == node]
            if locals_ == list(range(len(locals_))):
                parts.append(f"{node}:{len(locals_)}")
            else:
                parts.append(f"{node}:[{format_ranges(locals_)}]")
        return ",".join(parts)

    def __str__(self) -> str:
        return self.short()

    def __repr__(self) -> str:
        return f"DeviceSet({self.short()!r})"


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in (s.strip() for s in items) if item]


def _parse_ranges(spec: str, text: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"bad device set {text!r}: bad local range {part!r}")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"bad device set {text!r}: empty range {part!r}")
        if len(out) + last - first + 1 > MAX_DEVICES:
            raise ValueError(f"bad device set {text!r}: more than {MAX_DEVICES} devices (the planner's limit)")
        out.extend(range(first, last + 1))
    return out


def format_ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    parts, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)
