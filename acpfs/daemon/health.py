"""A mount's health, from its status document: ``acpfs status --check`` (one line per mount,
exit status 0 healthy, 1 degraded, 2 down) and the ``acpfs_healthy`` metric apply the same
rule (docs/operations.md, "Health checks")."""

from __future__ import annotations

import time
from typing import Any

from ..config import age, format_size, safe

HEALTHY, DEGRADED, DOWN = 0, 1, 2   # exit status of 'acpfs status --check'
REPLICAS_OWED_S = 30.0   # changes not copied to another node for longer: degraded


def health(doc: dict[str, Any], max_unsaved_age: float | None) -> tuple[int, list[str]]:
    """A mount's health from its status document: (HEALTHY, DEGRADED or DOWN, the reasons)."""
    if doc.get("stale"):
        return DOWN, ["its daemon is gone (stale mount)"]
    why = []
    if not doc["flusher_alive"]:
        why.append("the flusher is dead: nothing is persisted")
    for e in doc["errors"][:3]:
        why.append(f"{e['op']} {safe(e['path'])} failing for {age(time.time() - e['since'])} "
                   f"({e['attempts']} attempts): {e['reason']}")
    cache = doc.get("cache") or {}
    if cache.get("over_limit_bytes"):
        why.append(f"cache over its size by {format_size(cache['over_limit_bytes'])}: "
                   f"{cache.get('writers_passed_through', 0)} files written with passthrough grew "
                   f"past what was kept free for them; new writers take the daemon's path until "
                   f"they are closed and persisted")
    if doc.get("journal_error"):
        why.append(f"journal cannot be written: {doc['journal_error']}")
    oldest = doc.get("oldest_dirty_age_s")
    if max_unsaved_age is not None and oldest is not None and oldest > max_unsaved_age:
        why.append(f"unsaved data {age(oldest)} old (more than {age(max_unsaved_age)})")
    held = (doc.get("peers") or {}).get("held")
    if held:
        why.append(held_text(held))
    sending = (doc.get("replicas") or {}).get("sending") or {}
    if sending.get("owed_age_s", 0) > REPLICAS_OWED_S:
        why.append(f"{sending['owed_records']} changes ({format_size(sending['owed_bytes'])}) not "
                   f"copied to another node for {age(sending['owed_age_s'])} (--replicas 1): "
                   f"{sending.get('error') or 'copying'}")
    for origin, t in ((doc.get("replicas") or {}).get("takeovers") or {}).items():
        if t.get("state") == "failed":
            why.append(f"persisting the unsaved changes of dead node {origin} failed: {t.get('said')}")
    return (DEGRADED if why else HEALTHY), why


def held_text(held: dict[str, Any]) -> str:
    who = f"node {held['waiting_for']}" if held["waiting_for"] else "a fresh listing of the nodes"
    return (f"held for global order {age(max(0.0, time.time() - held['since']))}: "
            f"{held['op']} {safe(held['path'])} waits for {who}")
