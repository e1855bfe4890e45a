"""Issue 31, why IIET fails at the baselines' LR: how far one optimizer step moves the model.

Hypothesis (docs/scaling.md): at equal LR IIET's step is effectively larger than the baselines',
as each layer applies its block 1 + max_iterations times with the same weights. Measured here:
from a run's checkpoint (its weights, AdamW moments and step count), the update AdamW took last,
``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * theta`` (tests/sweep/test_step_probe.py checks
it is the step training took), applied again with a probe LR ``eta`` to one group of parameters
at a time. The next update's moment part, before its new gradient, is the same direction times
beta1 / sqrt(beta2) (~0.9), the same factor for every run. On the held-out book:

- ``speed = sqrt(2 * KL(p_theta || p_theta')) / eta``: the step's length in the model's output
  distribution per unit LR (KL is quadratic in a small step, so it does not depend on eta while
  eta is small: two etas are measured to show it);
- ``dloss = (loss_theta' - loss_theta) / eta``: the held-out loss change per unit LR;
- ``descent_cosine``: the cosine between the step ``-u`` and the held-out loss's steepest
  descent ``-gradient`` at the checkpoint (negative: the step goes uphill there, as when
  training oscillates across the sharp directions of the loss);
- ``history``: each layer's rows of the cross-layer history (``pop_weight``, ``refine_weight``;
  spec section 3) where the architecture has one.

Two runs at the same LR and recipe compared at the same checkpoint step: an IIET/vanilla speed
ratio near 1 rejects the hypothesis; near 2 (or more) supports it, and the per-group rows say
where the extra length comes from (the blocks, which IIET repeats, or the embedding).

    python examples/step_probe.py CELL RUN [RUN ...] [--eta 1e-4 2e-4] [--batches 4]
    # e.g. python examples/step_probe.py s_20tpp_release vanilla_s_14.79M_lr0.002_s1234 \
    #          iiet_s_14.79M_lr0.002_s1234
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from two_stage import cell_plan, finished_run, results_dir

from megatron_iiet.errors import OperatorError

GROUPS = ("all", "embedding", "blocks", "other")


def group_of(name: str) -> str:
    """The parameter group a probe perturbs: the (tied) word embedding, the layers' repeated
    blocks, or the rest (history coefficients and norms, the final norm)."""
    if name.startswith("embedding."):
        return "embedding"
    if ".block." in name:
        return "blocks"
    return "other"


def checkpoint_keys(model) -> dict[str, str]:
    """Each parameter's key in the dist-checkpoint: megatron renames some (a fused norm's
    weight is stored under its linear layer's name)."""
    sharded = model.sharded_state_dict()
    return {name: sharded[name].key for name, _ in model.named_parameters()}


def decays(name: str, p: torch.Tensor) -> bool:
    """Megatron's rule: no weight decay on biases and 1-D parameters (norms, history rows)."""
    return p.dim() > 1 and not name.endswith(".bias")


def adam_direction(ckpt: Path, params: dict[str, torch.Tensor],
                   keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """The update AdamW took last, per unit LR: the checkpoint's first moment over the root of
    its second, both bias-corrected at its step count, plus decoupled weight decay on
    ``params`` where it applies."""
    from torch.distributed.checkpoint import FileSystemReader, load

    common = torch.load(ckpt / "common.pt", weights_only=True)["optimizer"]
    step = float(common["state"]["common_step"])
    groups = common["param_groups"]
    beta1, beta2 = groups[0]["betas"]
    eps = groups[0]["eps"]
    decay = max(g["weight_decay"] * g.get("wd_mult", 1.0) for g in groups)
    moments = {f"optimizer.state.{kind}.{keys[name]}": torch.empty_like(p)
               for name, p in params.items() for kind in ("exp_avg", "exp_avg_sq")}
    stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    missing = [k for k in moments if k not in stored]
    if missing:
        raise OperatorError(f"{ckpt}: no optimizer moments for {missing[0]} "
                            f"(a model-only checkpoint?)")
    load(moments, storage_reader=FileSystemReader(str(ckpt)))
    out = {}
    for name, p in params.items():
        m = moments[f"optimizer.state.exp_avg.{keys[name]}"] / (1 - beta1 ** step)
        v = moments[f"optimizer.state.exp_avg_sq.{keys[name]}"] / (1 - beta2 ** step)
        out[name] = m / (v.sqrt() + eps) + (decay * p if decays(name, p) else 0.0)
    return out


def descent_cosine(model, batches: list[dict], direction: dict[str, torch.Tensor]) -> float:
    """The cosine between the step ``-u`` and the held-out loss's steepest descent."""
    from megatron_iiet.training.step import forward_backward

    model.zero_grad(set_to_none=True)
    forward_backward(model, batches)
    params = [(p.grad, direction[n]) for n, p in model.named_parameters() if p.grad is not None]
    dot = sum(float((g * u).sum()) for g, u in params)
    norms = math.sqrt(sum(float(g.pow(2).sum()) for g, _ in params)) * math.sqrt(
        sum(float(u.pow(2).sum()) for _, u in params))
    model.zero_grad(set_to_none=True)
    return dot / norms


def history_rows(params: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {name: [round(float(x), 4) for x in p.detach()]
            for name, p in params.items() if name.endswith(("pop_weight", "refine_weight"))}


def logits(model, batches: list[dict]) -> list[torch.Tensor]:
    """In float64: the KL of a probe step is ~1e-5 per token, near float32's rounding."""
    with torch.no_grad():
        return [model(b["input_ids"]).double() for b in batches]


def heldout_loss(outputs: list[torch.Tensor], batches: list[dict]) -> float:
    return sum(float(torch.nn.functional.cross_entropy(o.flatten(0, 1), b["labels"].flatten()))
               for o, b in zip(outputs, batches)) / len(batches)


def compare(base: list[torch.Tensor], moved: list[torch.Tensor],
            batches: list[dict]) -> tuple[float, float]:
    """Mean KL(base || moved) per token and the mean held-out loss change (moved - base)."""
    from megatron_iiet.iiad.kl import vocab_parallel_kl

    kl = sum(float(vocab_parallel_kl(q, p).mean()) for p, q in zip(base, moved)) / len(batches)
    return kl, heldout_loss(moved, batches) - heldout_loss(base, batches)


def probe_checkpoint(ckpt: Path, batches_spec: tuple[str, int, int], etas: list[float]) -> dict:
    from megatron_iiet.eval.checkpoint import load_for_inference
    from megatron_iiet.iiad.influence import calibration_batches
    from megatron_iiet.training.checkpoint_index import step_of

    loaded = load_for_inference(ckpt, with_tokenizer=False)
    model = loaded.model
    params = dict(model.named_parameters())
    direction = adam_direction(ckpt, params, checkpoint_keys(model))
    prefix, count, size = batches_spec
    batches = calibration_batches(prefix, count, size, loaded.max_length)
    base = logits(model, batches)
    loss = heldout_loss(base, batches)
    saved = {n: p.detach().clone() for n, p in params.items()}
    rows = []
    for group in GROUPS:
        chosen = [n for n in params if group == "all" or group_of(n) == group]
        if not chosen:
            continue
        for eta in etas:
            with torch.no_grad():
                for n in chosen:
                    params[n].sub_(eta * direction[n])
            kl, dloss = compare(base, logits(model, batches), batches)
            with torch.no_grad():
                for n in chosen:
                    params[n].copy_(saved[n])
            rows.append({"group": group, "eta": eta, "kl": kl,
                         "speed": math.sqrt(2 * max(kl, 0.0)) / eta, "dloss": dloss / eta,
                         "update_rms": float(torch.cat([direction[n].flatten() for n in chosen])
                                             .pow(2).mean().sqrt())})
    return {"step": step_of(ckpt), "heldout_loss": loss, "rows": rows,
            "descent_cosine": descent_cosine(model, batches, direction),
            "history": history_rows(params)}


def probe_runs(cell: str, names: list[str], etas: list[float], batches: int,
               batch_size: int) -> dict:
    from megatron_iiet.hf.megatron_model import one_process_group
    from megatron_iiet.sweep.runner import run_dir
    from megatron_iiet.training.checkpoint_index import defect, list_checkpoints, step_of

    plan = cell_plan(cell)
    runs = {r.name: r for r in plan.runs}
    out = {}
    with one_process_group():
        for name in names:
            if name not in runs:
                raise OperatorError(f"{name}: not a run of {plan.spec.name}")
            run = finished_run(plan, name, runs[name].architecture)
            kept = [c for c in list_checkpoints(run_dir(plan, run) / "checkpoints")
                    if defect(c) is None and step_of(c) < run.train_steps]
            spec = (run.overrides["data.valid"], batches, batch_size)
            out[name] = {"architecture": run.architecture,
                         "checkpoints": [probe_checkpoint(c, spec, etas) for c in kept]}
            print(f"probed {name}: {len(kept)} checkpoints", file=sys.stderr, flush=True)
    return out


def table(probes: dict) -> str:
    """Speed per group and checkpoint step, each run against the first (the reference)."""
    names = list(probes)
    ref = probes[names[0]]
    lines = ["| run | step | held-out | group | eta | speed | ratio to " + names[0].split("_")[0]
             + " | dloss | update rms |", "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        for ck in probes[name]["checkpoints"]:
            ref_ck = next((c for c in ref["checkpoints"] if c["step"] == ck["step"]), None)
            for row in ck["rows"]:
                ref_row = ref_ck and next((r for r in ref_ck["rows"] if r["group"] == row["group"]
                                           and r["eta"] == row["eta"]), None)
                ratio = f"{row['speed'] / ref_row['speed']:.2f}" if ref_row else ""
                lines.append(f"| {name} | {ck['step']} | {ck['heldout_loss']:.3f} | "
                             f"{row['group']} | {row['eta']:g} | {row['speed']:.2f} | {ratio} | "
                             f"{row['dloss']:+.2f} | {row['update_rms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cell")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--eta", type=float, nargs="+", default=[1e-4, 2e-4],
                        help="probe LRs (small: the speed is read in the quadratic regime)")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--output", help="json path (default results/trained/CELL/"
                                         "step_probe.json, merged by run name)")
    args = parser.parse_args(argv)
    try:
        probes = probe_runs(args.cell, args.runs, args.eta, args.batches, args.batch_size)
    except OperatorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    path = Path(args.output) if args.output else results_dir(args.cell) / "step_probe.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged.update(probes)
    from megatron_iiet.data.atomic import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, merged)
    print(table(probes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
