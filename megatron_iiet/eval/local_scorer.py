"""Scoring and greedy generation in one process, with the plain PyTorch model of the checkpoint.

A job of one process has nothing to shard, and megatron-core's modules cost a fixed ~3 ms per
(layer, pass) on CPU in dispatch and process-group lookups (docs/benchmarks.md, evaluation):
at 12 layers x 4 passes that is more than the model's own arithmetic on short requests. So a
one-process evaluation converts the checkpoint in memory to the project's own PyTorch model
(`hf/modeling_iiet.py`, what `convert_checkpoint.py megatron-to-hf` writes, tested equal to the
megatron forward) and scores with it:

* loglikelihood: requests whose contexts are the same tokens (the choices of a multiple-choice
  question: HellaSwag's 4 endings, ARC's answers) share one pass over the context when that
  saves enough tokens (`_worth_sharing`): the contexts run once, batched, and each
  continuation runs on a copy of its context's per-(layer, pass) KV cache.
  The other requests (PIQA's two long solutions to a short question, say, where the second
  forward costs more than it saves) run in the same length-sorted, right-padded batches as
  `ParallelScorer`. The LM head and the softmax run only at the scored positions.
* generation: left-padded batches decoded with the per-(layer, pass) KV cache (exact: the
  cached logits equal the full-sequence ones), instead of recomputing the sequence per token.

Results are those of `ParallelScorer` at any layout, to fp32 rounding (tests/eval).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_iiet.eval.scoring import Request, length_sorted_batches, progress_bar, stopped
from megatron_iiet.hf.modeling_iiet import CACHE_FIELD, IIETCache


class LocalScorer:
    """``ParallelScorer``'s interface over an ``IIETForCausalLM`` in this process."""

    def __init__(self, model: torch.nn.Module, batch_size: int, max_length: int,
                 decode: Optional[Callable[[list[int]], str]] = None, progress: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.batch_size = batch_size
        self.max_length = max_length
        self.decode = decode
        self.progress = progress
        self.device = next(model.parameters()).device

    def drive(self, work: Callable[[], object]):
        return work()

    def loglikelihood(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the scored tokens, whether each was the argmax)."""
        requests = list(requests)
        by_context: dict[tuple, list[int]] = {}
        for i, (tokens, n) in enumerate(requests):
            by_context.setdefault(tuple(tokens[:len(tokens) - n]), []).append(i)
        shared, alone = [], []
        for group in by_context.values():
            if _worth_sharing(group, requests):
                shared.append(group)
            else:
                alone.extend(group)
        results: list = [None] * len(requests)
        bar = progress_bar(len(requests), "score") if self.progress else None
        with torch.inference_mode():
            for batch in length_sorted_batches([len(requests[i][0]) for i in alone],
                                               self.batch_size):
                indices = [alone[j] for j in batch]
                self._place(results, indices, self._score_batch([requests[i] for i in indices]), bar)
            context_lengths = [len(requests[g[0]][0]) - requests[g[0]][1] for g in shared]
            for batch in length_sorted_batches(context_lengths, self.batch_size):
                groups = [shared[j] for j in batch]
                for indices, out in self._score_shared(groups, requests):
                    self._place(results, indices, out, bar)
        if bar is not None:
            bar.close()
        return results

    @staticmethod
    def _place(results: list, indices: list[int], outputs: list, bar) -> None:
        for i, out in zip(indices, outputs):
            results[i] = out
        if bar is not None:
            bar.update(len(indices))

    def generate(self, prompts: Sequence[list[int]], max_new_tokens: int,
                 stop: Sequence[str] = (), eos_id: Optional[int] = None) -> list[list[int]]:
        """Greedy continuations, each ending at the first stop string's token, the EOS token,
        ``max_new_tokens`` or the model's maximum length (as ``ParallelScorer.generate``)."""
        return self._batched(
            "generate", list(prompts), [len(p) for p in prompts],
            lambda batch: self._generate_batch(batch, int(max_new_tokens), list(stop), eos_id))

    def _batched(self, op: str, items: list, lengths: list[int], run) -> list:
        bar = progress_bar(len(items), op) if self.progress else None
        results: list = [None] * len(items)
        with torch.inference_mode():
            for indices in length_sorted_batches(lengths, self.batch_size):
                self._place(results, indices, run([items[i] for i in indices]), bar)
        if bar is not None:
            bar.close()
        return results

    def _score_batch(self, requests: list[Request]) -> list[tuple[float, bool]]:
        rows = [tokens[:-1] for tokens, _ in requests]
        # Right padding needs no mask: a causal model's real positions never see a padded one.
        hidden = self.model.model(self._right_padded(rows), use_cache=False).last_hidden_state
        picked = [hidden[k, len(tokens) - 1 - n:len(tokens) - 1]
                  for k, (tokens, n) in enumerate(requests)]
        return self._scores(picked, [tokens[len(tokens) - n:] for tokens, n in requests])

    def _score_shared(self, groups: list[list[int]], requests: list[Request]):
        """Yield (request indices, results) for ``groups`` of requests with one context each:
        the contexts in one forward, then the continuations in batches of ``batch_size`` rows,
        each on its context's cached keys and values."""
        requests_of = [requests[g[0]] for g in groups]
        contexts = [tokens[:len(tokens) - n] for tokens, n in requests_of]
        lengths = torch.tensor([len(c) for c in contexts], device=self.device)
        out = self.model.model(self._right_padded(contexts), use_cache=True)
        cache = getattr(out, CACHE_FIELD)
        # The last context position predicts every continuation's first token.
        first = out.last_hidden_state[torch.arange(len(groups), device=self.device), lengths - 1]
        # The cached context positions each row may see: its own context, not another's padding.
        context_mask = (torch.arange(cache.get_seq_length(), device=self.device)[None]
                        < lengths[:, None]).long()
        rows = [(k, i) for k, group in enumerate(groups) for i in group]
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            owners = torch.tensor([k for k, _ in chunk], device=self.device)
            targets = [requests[i][0][len(requests[i][0]) - requests[i][1]:] for _, i in chunk]
            picked = [first[k:k + 1] for k, _ in chunk]
            width = max(len(t) for t in targets) - 1
            if width > 0:  # continuations of more than one token: their inputs after the first
                inputs = self._right_padded([t[:-1] for t in targets], width)
                mask = torch.cat([context_mask[owners], context_mask.new_ones(len(chunk), width)], 1)
                hidden = self.model.model(inputs, attention_mask=mask,
                                          cache=_cache_rows(cache, owners),
                                          use_cache=True).last_hidden_state
                picked = [torch.cat([p, hidden[r, :len(t) - 1]])
                          for r, (p, t) in enumerate(zip(picked, targets))]
            yield [i for _, i in chunk], self._scores(picked, targets)

    def _right_padded(self, rows: list[list[int]], width: Optional[int] = None) -> torch.Tensor:
        ids = torch.zeros(len(rows), width or max(len(r) for r in rows), dtype=torch.long)
        for k, row in enumerate(rows):
            ids[k, :len(row)] = torch.tensor(row, dtype=torch.long)
        return ids.to(self.device)

    def _scores(self, hidden: list[torch.Tensor], targets: list[list[int]]):
        """Per request: the hidden states at its scored positions and the tokens they predict
        -> (sum of log-probabilities, all greedy)."""
        logprobs = torch.log_softmax(self.model.lm_head(torch.cat(hidden)).float(), dim=-1)
        flat = torch.tensor([t for row in targets for t in row], device=self.device)
        token_logprob = logprobs.gather(-1, flat[:, None]).squeeze(-1)
        greedy = logprobs.argmax(-1) == flat
        results, offset = [], 0
        for row in targets:
            span = slice(offset, offset + len(row))
            results.append((float(token_logprob[span].double().sum()), bool(greedy[span].all())))
            offset += len(row)
        return results

    def _generate_batch(self, prompts: list[list[int]], max_new: int, stop: list[str],
                        eos: Optional[int]) -> list[list[int]]:
        new: list[list[int]] = [[] for _ in prompts]
        active = [max_new > 0 and len(p) < self.max_length for p in prompts]
        if not any(active):
            return new
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for k, prompt in enumerate(prompts):  # left padding: every row's next token is last
            ids[k, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[k, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        for _ in range(max_new):
            tokens = out.logits[:, -1].float().argmax(-1)  # the first maximum, as megatron's
            for k, token in enumerate(tokens.tolist()):
                if not active[k]:
                    continue
                new[k].append(token)
                if (token == eos or len(prompts[k]) + len(new[k]) >= self.max_length
                        or stopped(new[k], stop, self.decode)):
                    active[k] = False
            if not any(active):
                break
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
            out = self.model(tokens[:, None], attention_mask=mask, cache=getattr(out, CACHE_FIELD),
                             use_cache=True, logits_to_keep=1)
        return new


def _worth_sharing(group: list[int], requests: list[Request]) -> bool:
    """Whether one pass over the group's shared context pays for the extra forward and the
    cache copies: the tokens it saves, (k - 1) x context, at least half the continuations' own.
    A rule fitted on CPU (docs/benchmarks.md, evaluation): it shares HellaSwag's and ARC's
    choices and leaves PIQA's, whose sharing was slower."""
    if len(group) < 2:
        return False
    tokens, n = requests[group[0]]
    saved = (len(group) - 1) * (len(tokens) - n)
    return 2 * saved >= sum(requests[i][1] for i in group)


def _cache_rows(cache: IIETCache, rows: torch.Tensor) -> IIETCache:
    """A new cache holding batch rows ``rows`` of ``cache`` (a row may repeat): one copy of a
    shared context per continuation, which then grows on its own."""
    picked = IIETCache(cache.passes_per_layer)
    for source, target in zip(cache.layers, picked.layers):
        target.lazy_initialization(source.keys, source.values)
        target.keys = source.keys.index_select(0, rows)
        target.values = source.values.index_select(0, rows)
    return picked
