"""Scoring and greedy generation with a live megatron model, at any TP/PP/DP layout.

One rank drives (rank 0: it runs lm-eval, or the trainer's task evaluation); every other rank
serves. The driver broadcasts each request list once over a gloo control group; all ranks then
split the batches over the data-parallel replicas, run them through megatron's schedules
(`training/step.py: forward_only`, so pipeline stages hand activations and the cross-layer
history on as in training), and the last stage of each replica sends its results back to the
driver.

Batching: requests are sorted by length (longest first) and cut into batches of `batch_size`,
right-padded. A causal model's outputs at a real position never see a padded one, so a
request's result does not depend on its batch (up to float rounding of batched kernels).

Log-probabilities are computed on vocabulary shards (logits stay [b, s, V/tp]): the max, the
sum of exponentials and the target logit are each one all-reduce over the tensor-parallel group,
and the argmax (for lm-eval's `is_greedy`) takes the lowest index among equal maxima, as
`torch.argmax` does. The softmax runs over the model's whole (padded) vocabulary, as the HF
export's does.

Generation recomputes the whole sequence for every new token (the megatron path has no KV
cache): exact, since attention is causal, and quadratic in the generated length. The HF export
(`hf/modeling_iiet.py`) decodes with the per-(layer, pass) cache instead.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_iiet.errors import ReportedByRank0

STOP = "stop"
INTERRUPTED = "interrupted"
Request = tuple[list[int], int]
"""Tokens (context + continuation, already truncated) and how many trailing ones are scored."""


class EvaluationInterrupted(Exception):
    """A preemption cut the evaluation short; ``everywhere``: raised on every rank at once (at
    the same batch), else on the driver alone, which then tells the serving ranks."""

    def __init__(self, message: str, everywhere: bool = False):
        super().__init__(message)
        self.everywhere = everywhere


class ParallelScorer:
    """The model's ranks acting as one scorer; rank 0 calls, the others ``serve()``.

    ``decode(ids) -> str`` (the tokenizer's) is needed on every rank for generation, whose stop
    strings every rank of a replica must check alike.

    An in-loop evaluation gives way to the save a preemption signal asks for: ``interrupted()``,
    a collective that agrees on every rank (the trainer's preemption check), is asked before
    each batch, and ``raising(exc_type)`` (PreemptionHandler.raising) makes a signal raise at
    once while the driver works alone (lm-eval building requests, computing metrics).
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, max_length: int,
                 decode: Optional[Callable[[list[int]], str]] = None, progress: bool = True,
                 interrupted: Optional[Callable[[], bool]] = None, raising=None):
        from megatron.core import parallel_state as ps

        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.model = model
        self.batch_size = batch_size
        self.max_length = max_length
        self.decode = decode
        self.progress = progress
        self.interrupted = interrupted
        self.raising = raising or (lambda exc_type: contextlib.nullcontext())
        self.rank = dist.get_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp = ps.get_data_parallel_world_size()
        self.last_stage = ps.is_pipeline_last_stage()
        self.reports = self.last_stage and ps.get_tensor_model_parallel_rank() == 0
        self.device = next(model.parameters()).device
        # Objects travel over gloo even when the model's collectives run on NCCL.
        self.control = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------------------ driver side
    def loglikelihood(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the scored tokens, whether each was the argmax)."""
        return self._call("score", list(requests))

    def generate(self, prompts: Sequence[list[int]], max_new_tokens: int,
                 stop: Sequence[str] = (), eos_id: Optional[int] = None) -> list[list[int]]:
        """Greedy continuations (token ids), each ending at the first stop string's token, the
        EOS token, ``max_new_tokens`` or the model's maximum length."""
        return self._call("generate", (list(prompts), int(max_new_tokens), list(stop), eos_id))

    def drive(self, work: Callable[[], object]):
        """Run ``work`` on rank 0 while the other ranks serve; all return when it ends (its
        value on rank 0, None elsewhere). An error on rank 0 stops every rank with it."""
        if self.rank != 0:
            self.serve()
            return None
        try:
            with self.raising(EvaluationInterrupted):
                result = work()
        except EvaluationInterrupted as err:
            if not err.everywhere:  # the serving ranks wait for the next request
                self._broadcast((INTERRUPTED, str(err), None))
            raise
        except BaseException as err:
            self._broadcast((STOP, f"{type(err).__name__}: {err}".splitlines()[0], None))
            raise
        self._broadcast((STOP, None, None))
        return result

    def serve(self) -> None:
        while True:
            op, payload, batch_size = self._broadcast(None)
            if op == INTERRUPTED:
                raise EvaluationInterrupted(payload, everywhere=True)
            if op == STOP:
                if payload is not None:
                    raise ReportedByRank0(f"rank 0 stopped the evaluation: {payload}")
                return
            self._execute(op, payload, batch_size)

    def _broadcast(self, message):
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def _call(self, op: str, payload):
        if self.rank != 0:
            raise RuntimeError("only rank 0 drives the scorer; other ranks serve()")
        # The driver's batch size travels with the work: every rank of a replica must cut the
        # same batches, or their collectives would not match. No signal may raise in there.
        with self.raising(None):
            self._broadcast((op, payload, self.batch_size))
            return self._execute(op, payload, self.batch_size)

    # ------------------------------------------------------------------------------ every rank
    def _execute(self, op: str, payload, batch_size: int):
        items = payload if op == "score" else payload[0]
        lengths = [len(item[0]) if op == "score" else len(item) for item in items]
        batches = length_sorted_batches(lengths, batch_size)
        mine = batches[self.dp_rank::self.dp]
        bar = progress_bar(len(items), op) if self.rank == 0 and self.progress else None
        done: dict[int, object] = {}
        # Every rank takes as many turns as the busiest replica, so that the interruption
        # check, a collective, is asked as often everywhere.
        for turn in range(-(-len(batches) // self.dp)):
            if self.interrupted is not None and self.interrupted():
                if bar is not None:
                    bar.close()
                raise EvaluationInterrupted(f"{op} stopped after {turn} of its batches",
                                            everywhere=True)
            if turn >= len(mine):
                continue
            indices = mine[turn]
            if op == "score":
                out = self._score_batch([items[i] for i in indices])
            else:
                _, max_new, stop, eos = payload
                out = self._generate_batch([items[i] for i in indices], max_new, stop, eos)
            if self.reports:
                done.update(zip(indices, out))
            if bar is not None:
                bar.update(len(indices) * self.dp)
        if bar is not None:
            bar.close()
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(done if self.reports else {}, gathered, dst=0, group=self.control)
        if self.rank != 0:
            return None
        merged: dict[int, object] = {}
        for part in gathered:
            merged.update(part)
        return [merged[i] for i in range(len(items))]

    def _forward(self, rows: list[list[int]], reduce):
        """Right-padded ``rows`` through the model; ``reduce(batch, logits)`` on the last stage."""
        from megatron_iiet.training.step import forward_only

        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for k, row in enumerate(rows):
            ids[k, :len(row)] = torch.tensor(row, dtype=torch.long)
        batch = {"input_ids": ids.to(self.device), "lengths": [len(r) for r in rows]}
        out = forward_only(self.model, [batch], lambda model, b: model(b["input_ids"]), reduce)
        return out[0] if out else None

    def _score_batch(self, requests: list[Request]) -> list[tuple[float, bool]]:
        rows = [tokens[:-1] for tokens, _ in requests]

        def reduce(batch, logits):
            targets = torch.zeros_like(batch["input_ids"])
            for k, (tokens, _) in enumerate(requests):
                targets[k, :len(tokens) - 1] = torch.tensor(tokens[1:], dtype=torch.long)
            logprob, argmax = vocab_parallel_logprob(logits, targets)
            results = []
            for k, (tokens, n) in enumerate(requests):
                end = len(tokens) - 1
                span = slice(end - n, end)
                results.append((float(logprob[k, span].double().sum()),
                                bool((argmax[k, span] == targets[k, span]).all())))
            return results

        return self._forward(rows, reduce)

    def _generate_batch(self, prompts: list[list[int]], max_new: int, stop: list[str],
                        eos: Optional[int]) -> list[list[int]]:
        from megatron.core import parallel_state as ps

        sequences = [list(p) for p in prompts]
        new: list[list[int]] = [[] for _ in prompts]
        active = [k for k in range(len(prompts)) if max_new > 0 and len(prompts[k]) < self.max_length]
        for _ in range(max_new):
            if not active:
                break

            def reduce(batch, logits):
                last = torch.tensor([n - 1 for n in batch["lengths"]], device=logits.device)
                picked = logits[torch.arange(logits.shape[0], device=logits.device), last]
                return vocab_parallel_argmax(picked)

            tokens = self._forward([sequences[k] for k in active], reduce)
            tokens = self._share_with_stages(tokens, len(active), ps)
            still = []
            for k, token in zip(active, tokens.tolist()):
                sequences[k].append(token)
                new[k].append(token)
                if not (token == eos or len(sequences[k]) >= self.max_length
                        or stopped(new[k], stop, self.decode)):
                    still.append(k)
            active = still
        return new

    def _share_with_stages(self, tokens, count: int, ps) -> torch.Tensor:
        """The last stage's next tokens, on every stage of this replica (all must append them)."""
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return tokens
        buffer = tokens if tokens is not None else torch.zeros(count, dtype=torch.long,
                                                               device=self.device)
        dist.broadcast(buffer, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        return buffer



def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Request indices sorted longest first (ties by index), cut into batches of ``batch_size``:
    the same cut on every rank, and little padding per batch."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def progress_bar(total: int, op: str):
    if total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"iiet {'loglikelihood' if op == 'score' else op}",
                unit="req", smoothing=0.1)


def stopped(generated: list[int], stop: Sequence[str], decode) -> bool:
    """Whether the decoded continuation holds one of the stop strings."""
    if not stop:
        return False
    if decode is None:
        raise RuntimeError("generation with stop strings needs decode=")
    text = decode(generated)
    return any(s in text for s in stop)


def vocab_parallel_logprob(logits: torch.Tensor, targets: torch.Tensor):
    """log p(target) and the argmax, from logits sharded over the vocabulary ([..., V/tp])."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    logits = logits.float()
    global_max = logits.amax(-1)
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (logits - global_max.unsqueeze(-1)).exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    start, width = _shard_range(logits)
    local = targets - start
    inside = (local >= 0) & (local < width)
    target_logit = logits.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = torch.where(inside, target_logit, torch.zeros_like(target_logit))
    dist.all_reduce(target_logit, group=group)
    logprob = target_logit - global_max - sum_exp.log()
    return logprob, vocab_parallel_argmax(logits, global_max)


def vocab_parallel_argmax(logits: torch.Tensor, global_max: Optional[torch.Tensor] = None):
    """Index of the largest logit over the whole vocabulary (lowest index on ties)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    logits = logits.float()
    local_max, local_arg = logits.amax(-1), logits.argmax(-1)  # argmax: the first maximum
    if global_max is None:
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    start, _ = _shard_range(logits)
    sentinel = torch.iinfo(torch.long).max
    index = torch.where(local_max == global_max, local_arg + start,
                        torch.full_like(local_arg, sentinel))
    dist.all_reduce(index, op=dist.ReduceOp.MIN, group=group)
    return index


def _shard_range(logits: torch.Tensor) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    width = logits.shape[-1]
    return ps.get_tensor_model_parallel_rank() * width, width
