#!/usr/bin/env bash
# Why does IIET trail at CPU scale? One-run variants of the CPU ladder's smallest IIET (size xs,
# the 300K-token budget, LR 1e-3: the first grid's best), each a one-run sweep derived from
# examples/sweeps/cpu_ladder.yaml, so every other setting is the ladder's (docs/scaling.md).
#
#   usage: bash examples/sweeps/iiet_ablation.sh [--dry-run] [OUT [VARIANT...]]
#   OUT: outputs/sweeps/iiet_ablation; VARIANT...: some of the variants below (default: all)
#
#   r1, r2        max_iterations 1 or 2 instead of 3 (does iterating help at all here?)
#   fixed_point   the paper's fixed-point form (spec 5a) instead of the released history form
#   warmup20      20% warm-up instead of 5% (the plateau)
#   lr2e-3_s{1,2} the grid's next LR with two more seeds (is 1e-3 vs 2e-3 within the noise?)
#   history_current  W, Wc initialised one-hot on the layer's own state instead of uniform
#   {r3,r0,fixed_point}_lr8e-3  vanilla's best LR: the history form with r=3, with no iteration
#                 (predictor only: the history alone), and the iterations without the history
# Then collect them all: the table is printed (and written to OUT/ablation.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DRY=0
[ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
OUT=${1:-outputs/sweeps/iiet_ablation}
shift || true
ALL="r3 r1 r2 fixed_point warmup20 lr2e-3 history_current r3_lr8e-3 r0_lr8e-3 fixed_point_lr8e-3"
VARIANTS=${*:-$ALL}
mkdir -p "$OUT"
export PYTHONWARNINGS=ignore
"$PY" - "$OUT" <<'PYEOF'
import sys
from pathlib import Path
import yaml

out = Path(sys.argv[1]).resolve()
ladder = Path("examples/sweeps/cpu_ladder.yaml").resolve()
base = yaml.safe_load(ladder.read_text())
variants = {
    "r3": ({}, 1e-3, [1234]),
    "r1": ({"model.max_iterations": 1}, 1e-3, [1234]),
    "r2": ({"model.max_iterations": 2}, 1e-3, [1234]),
    "fixed_point": ({"model.formulation": "fixed_point"}, 1e-3, [1234]),
    "warmup20": ({}, 1e-3, [1234]),
    "lr2e-3": ({}, 2e-3, [1, 2]),
    "history_current": ({"model.history_init": "current"}, 1e-3, [1234]),
    "r3_lr8e-3": ({}, 8e-3, [1234]),
    "r0_lr8e-3": ({"model.max_iterations": 0}, 8e-3, [1234]),
    "fixed_point_lr8e-3": ({"model.formulation": "fixed_point"}, 8e-3, [1234]),
}
for name, (sets, lr, seeds) in variants.items():
    tree = dict(base)
    tree.update({
        "name": f"iiet_{name}", "base": str((ladder.parent / base["base"]).resolve()),
        "output": str(out / name), "architectures": ["iiet"],
        "arch_set": {"iiet": {**base["arch_set"]["iiet"], **sets}},
        "sizes": [base["sizes"][0]], "tokens": [base["tokens"][0]],
        "lr": {"values": {"iiet": lr}, "min_lr_ratio": base["lr"]["min_lr_ratio"]},
        "seeds": seeds, "noise": {},
        "warmup_fraction": 0.2 if name == "warmup20" else base["warmup_fraction"],
    })
    tree["set"] = {**base["set"], "data.cache_dir": str(Path(base["set"]["data.cache_dir"]).resolve())}
    for key in ("data.train", "data.valid"):
        tree["set"][key] = str(Path(base["set"][key]).resolve())
    (out / f"{name}.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
PYEOF
if [ "$DRY" = 1 ]; then  # the variants' plans only
  for v in $VARIANTS; do "$PY" tools/sweep.py plan "$OUT/$v.yaml" --dry-run | tail -n +3 | head -n -2; done
  exit 0
fi
for v in $VARIANTS; do
  "$PY" tools/sweep.py launch "$OUT/$v.yaml"
  "$PY" tools/sweep.py collect "$OUT/$v.yaml" --extra-valid wikitext=outputs/cpu_compare/data/wikitext2_valid >/dev/null
done
"$PY" - "$OUT" $ALL <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
done = [v for v in sys.argv[2:] if (out / v / "results.json").exists()]
lines = ["| variant | seed | params | FLOPs/token | valid loss (held-out book) | WikiText-2 valid loss |",
         "|---|---|---|---|---|---|"]
for name in done:
    for r in json.loads((out / name / "results.json").read_text()):
        lines.append(f"| {name} | {r['seed']} | {r['params'] / 1e6:.3f}M | {r['flops_per_token']:.3g} | "
                     f"{r['valid_loss']:.4f} | {r.get('valid_loss_wikitext', float('nan')):.4f} |")
text = "\n".join(lines)
(out / "ablation.md").write_text(text + "\n")
print(text)
PYEOF
