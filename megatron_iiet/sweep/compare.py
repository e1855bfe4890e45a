"""Which runs a sweep's fit and comparison use, and the architectures side by side per size.

A ladder with an LR grid holds runs at learning rates that lost; fitting a law through them would
describe the grid, not the architecture. Each (architecture, size, tokens) cell is therefore
represented by its best LR: the one whose mean final loss over seeds is lowest (the usual rule of
scaling-law work: the loss a size reaches when tuned). Every seed at that LR is kept, so a cell
with seeds carries its noise into the fit and into the table.

Rows are collect's results (dicts with `architecture`, `size`, `tokens`, `lr`, `seed`, `loss`,
`flops`); rows without `lr` (synthetic ladders) are kept as they are.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from megatron_iiet.sweep.plan import tokens_tag

Rows = Sequence[Mapping[str, Any]]


def _cell(row: Mapping[str, Any]) -> tuple:
    return (row["architecture"], row.get("size", row.get("params")), float(row["tokens"]))


def best_lr_rows(rows: Rows) -> list[Mapping[str, Any]]:
    """Per (architecture, size, tokens): every run at the LR with the lowest mean loss."""
    by_cell: dict[tuple, dict[float, list]] = {}
    kept = []
    for row in rows:
        if row.get("lr") is None:
            kept.append(row)
            continue
        by_cell.setdefault(_cell(row), {}).setdefault(round(float(row["lr"]), 12), []).append(row)
    for runs_by_lr in by_cell.values():
        best = min(runs_by_lr.values(), key=lambda runs: statistics.fmean(r["loss"] for r in runs))
        kept.extend(best)
    return kept


def _mean_and_spread(values: Sequence[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} (n={len(values)})"


def equal_tokens_table(rows: Rows, losses: Mapping[str, str]) -> str:
    """Markdown: one line per (size, tokens), each architecture's loss at its best LR (mean ± the
    seeds' standard deviation where a cell has several), per validation set in `losses`
    (column title -> row key), and each architecture's training FLOPs. The best LR is picked by
    `loss`."""
    selected = best_lr_rows(rows)
    architectures = list(dict.fromkeys(r["architecture"] for r in selected))
    cells: dict[tuple, dict[str, list]] = {}
    for row in selected:  # the architectures' parameter counts differ a little at one size
        size_key = (row.get("size", row.get("params")), float(row["tokens"]))
        cells.setdefault(size_key, {}).setdefault(row["architecture"], []).append(row)
    header = ["size", "non-emb params", "tokens"]
    for title in losses:
        header += [f"{a} ({title})" for a in architectures]
    header += [f"FLOPs {a}" for a in architectures]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    def order(item):
        (_, tokens), by_arch = item
        return min(float(r["params"]) for runs in by_arch.values() for r in runs), tokens

    for (size, tokens), by_arch in sorted(cells.items(), key=order):
        params = [float(runs[0]["params"]) for runs in by_arch.values()]
        line = [str(size), f"{min(params) / 1e6:.3f}M", tokens_tag(tokens)]
        for key in losses.values():
            for arch in architectures:
                values = [r[key] for r in by_arch.get(arch, []) if r.get(key) is not None]
                line.append(_mean_and_spread(values) if values else "")
        for arch in architectures:
            line.append(f"{float(by_arch[arch][0]['flops']):.3g}" if arch in by_arch else "")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines) + "\n"
