"""Step 5 of the planner: routed regions -> messages in rounds.

Regions of one (src, dst) pair are packed back to back into messages of at most ``mem_cap_bytes``
(a larger region is cut first); messages then go into rounds, first fit decreasing, so that per round
no device sends or receives more than the cap or more than ``max_messages`` messages, and each pair
sends at most one message.
"""

from __future__ import annotations

from collections import defaultdict

from etc_agent.planner.plan import KeyGroup, Region

Message = tuple[int, int, list[Region], int]
"""``(src, dst, regions, bytes)``, devices by id."""
ScheduledMessage = tuple[int, int, int, list[Region], int]
"""``(src, dst, round, regions, bytes)``."""


def schedule(
    groups: list[KeyGroup],
    pair_regions: dict[tuple[int, int], list[tuple[Region, int]]],
    cap: int,
    max_messages: int,
) -> list[ScheduledMessage]:
    """Messages in rounds, sorted by (round, src, dst)."""
    return _assign_rounds(_coalesce(groups, pair_regions, cap), cap, max_messages)


def _coalesce(
    groups: list[KeyGroup], pair_regions: dict[tuple[int, int], list[tuple[Region, int]]], cap: int
) -> list[Message]:
    """Per (src, dst) pair in sorted order, its regions packed into messages of at most ``cap`` bytes."""
    messages: list[Message] = []
    for src, dst in sorted(pair_regions):
        chunk: list[Region] = []
        chunk_bytes = 0
        for region, nbytes in pair_regions[(src, dst)]:
            w = groups[region.group].bytes_per_element
            for piece in _split_region(region, w, cap) if nbytes > cap else [region]:
                pbytes = piece.numel * w
                if chunk and chunk_bytes + pbytes > cap:
                    messages.append((src, dst, chunk, chunk_bytes))
                    chunk, chunk_bytes = [], 0
                chunk.append(piece)
                chunk_bytes += pbytes
        if chunk:
            messages.append((src, dst, chunk, chunk_bytes))
    return messages


def _assign_rounds(messages: list[Message], cap: int, max_messages: int) -> list[ScheduledMessage]:
    # First fit decreasing: biggest messages first, each into the earliest round with room at
    # both ends (bytes and message count), at most one message per (src, dst) pair per round.
    order = sorted(range(len(messages)), key=lambda i: (-messages[i][3], messages[i][0], messages[i][1]))
    send_bytes: dict[int, list[int]] = defaultdict(list)
    recv_bytes: dict[int, list[int]] = defaultdict(list)
    send_count: dict[int, list[int]] = defaultdict(list)
    recv_count: dict[int, list[int]] = defaultdict(list)
    pair_rounds: dict[tuple[int, int], set[int]] = defaultdict(set)
    out: list[ScheduledMessage] = []
    for i in order:
        src, dst, regions, nbytes = messages[i]
        rnd = 0
        while True:
            for table in (send_bytes[src], recv_bytes[dst], send_count[src], recv_count[dst]):
                while len(table) <= rnd:
                    table.append(0)
            if (
                send_bytes[src][rnd] + nbytes <= cap
                and recv_bytes[dst][rnd] + nbytes <= cap
                and send_count[src][rnd] < max_messages
                and recv_count[dst][rnd] < max_messages
                and rnd not in pair_rounds[(src, dst)]
            ):
                break
            rnd += 1
        send_bytes[src][rnd] += nbytes
        recv_bytes[dst][rnd] += nbytes
        send_count[src][rnd] += 1
        recv_count[dst][rnd] += 1
        pair_rounds[(src, dst)].add(rnd)
        out.append((src, dst, rnd, regions, nbytes))
    out.sort(key=lambda m: (m[2], m[0], m[1]))
    return out


def _split_region(region: Region, bytes_per_element: int, cap: int) -> list[Region]:
    """Cut a region into boxes of at most ``cap`` bytes (along its outermost splittable dims)."""
    if region.numel * bytes_per_element <= cap:
        return [region]
    dims = [i for i, n in enumerate(region.lengths) if n > 1]
    if not dims:
        raise ValueError(
            f"memory cap of {cap} bytes is below one element of key group {region.group} ({bytes_per_element} bytes)"
        )
    dim = dims[0]
    unit = region.numel // region.lengths[dim] * bytes_per_element
    step = max(1, cap // unit)
    out: list[Region] = []
    for start in range(0, region.lengths[dim], step):
        length = min(step, region.lengths[dim] - start)
        offsets = tuple(o + start if i == dim else o for i, o in enumerate(region.offsets))
        lengths = tuple(length if i == dim else n for i, n in enumerate(region.lengths))
        out += _split_region(Region(region.group, offsets, lengths), bytes_per_element, cap)
    return out
