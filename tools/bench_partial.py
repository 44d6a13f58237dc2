"""Medians from a tools/bench.py results.json, for a run that stopped before it wrote table.md
(a deadline, a crash). tools/bench.py saves results.json after every measurement.

Usage: python3 tools/bench_partial.py OUTDIR   (prints the table and writes OUTDIR/summary.md)
"""

import json
import statistics
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    out = Path(sys.argv[1])
    doc = json.loads((out / "results.json").read_text())
    groups: dict[tuple[str, str], list[float]] = {}
    warm: dict[tuple[str, str], list[float]] = {}
    for s in doc.get("samples", []):
        (warm if s["warmup"] else groups).setdefault((s["metric"], s["target"]), []).append(s["value"])
    units = {s["metric"]: s["unit"] for s in doc.get("samples", [])}
    targets = sorted({t for _, t in list(groups) + list(warm)})
    metrics = list(dict.fromkeys(m for m, _ in list(groups) + list(warm)))
    lines = ["PARTIAL run (no table.md): medians of the measured repetitions; '(w)' = only a warm-up",
             f"args: {json.dumps(doc.get('meta', {}).get('args', {}))}", "",
             "| metric | unit | " + " | ".join(targets) + " |", "|---|---|" + "---|" * len(targets)]
    for m in metrics:
        row = [m, units.get(m, "")]
        for t in targets:
            v = groups.get((m, t))
            w = warm.get((m, t))
            row.append(f"{statistics.median(v):.4g} (n={len(v)})" if v else (f"{w[0]:.4g} (w)" if w else "-"))
        lines.append("| " + " | ".join(row) + " |")
    for n in doc.get("notes", []):
        lines.append(f"note: {n}")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
