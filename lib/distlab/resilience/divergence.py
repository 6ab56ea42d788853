"""The answer to lab 12's ``first_divergence``: from every rank's flight record, the
first collective where the ranks of a group part, and the rank that parted (what
PyTorch's flight-recorder analyzer, ``torch.distributed.flight_recorder``, reports as a
mismatch, without its false alarms on entries the ring buffer dropped)."""
from __future__ import annotations

from collections import Counter


def first_divergence(records, groups):
    """``{"rank", "group", "seq"}`` of the first collective at which the members of a
    group disagree (an entry missing, or another op, sizes or dtypes), or None."""
    for name, members in groups.items():
        if not members or any(not 0 <= r < len(records) for r in members):
            raise ValueError(f"group {name!r} names ranks outside the {len(records)} records")
    found = [d for d in (_first_in(records, name, members) for name, members in groups.items())
             if d is not None]
    stuck = {(d["group"], d["seq"]) for d in found}
    causes = [d for d in found if not (d["missing"] and _last(records[d["rank"]]) in stuck)]
    if not found:
        return None
    first = min(causes or found, key=lambda d: d["time"])
    return {"rank": first["rank"], "group": first["group"], "seq": first["seq"]}


def _first_in(records, name, members):
    """The first sequence number at which the known entries of ``name``'s members differ."""
    mine = {r: {e["seq"]: e for e in records[r]["entries"] if e["group"] == name}
            for r in members}
    known_from = {r: (min(mine[r], default=float("inf")) if records[r]["dropped"] else 1)
                  for r in members}
    for seq in sorted({s for r in members for s in mine[r]}):
        here = [r for r in members if seq >= known_from[r]]
        keys = {r: _key(mine[r].get(seq)) for r in here}
        if len(set(keys.values())) < 2:
            continue
        counts = Counter(keys.values())
        top = max(counts.values())
        expected = keys[min(r for r in here if counts[keys[r]] == top)]
        culprit = min(r for r in here if keys[r] != expected)
        return {"rank": culprit, "group": name, "seq": seq, "missing": keys[culprit] is None,
                "time": min(mine[r][seq]["time_ns"] for r in here if seq in mine[r])}
    return None


def _last(record):
    """Where a rank waits: its last entry's (group, seq)."""
    return (record["entries"][-1]["group"], record["entries"][-1]["seq"]) \
        if record["entries"] else None


def _key(entry):
    if entry is None:
        return None
    return entry["op"], tuple(map(tuple, entry["sizes"])), tuple(entry["dtypes"])
