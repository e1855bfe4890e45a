"""lm-evaluation-harness backend ``iiet``: a megatron checkpoint scored at its TP/PP layout.

    torchrun --nproc-per-node 2 tools/evaluate.py --checkpoint RUN/checkpoints --tp 2 ...

or, from Python, ``lm_eval.api.registry.get_model("iiet")(checkpoint=..., batch_size=8)`` after
``import megatron_iiet.eval.native_lm``. Every rank builds the model; rank 0 runs lm-eval and
the others serve its requests (``ParallelScorer``), so lm-eval itself sees one process.

Tokenization, truncation and the empty-context prefix follow lm-eval's ``hf`` backend on the
project's HF export of the same checkpoint: the tokenizer adds no BOS, the prefix token is BOS
(EOS when there is none), inputs are cut from the left to the model's sequence length, and for
generation the context to ``max_length - max_gen_toks``. Generation is greedy.

``runner``: how the model runs. ``megatron`` builds megatron-core's model at the job's layout
(``scoring.py``: every rank serves; generation recomputes the sequence per token). ``torch``
converts the checkpoint in memory to the project's plain PyTorch model and scores in this
process (``local_scorer.py``: no megatron per-module overhead, generation with the per-(layer,
pass) KV cache); it needs a one-process job. ``auto`` (the default) takes ``torch`` for a
one-process job at TP=PP=1, else ``megatron``.
"""

from __future__ import annotations

import logging
from typing import Optional

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from megatron_iiet.errors import OperatorError
from megatron_iiet.eval.scoring import ParallelScorer

_log = logging.getLogger(__name__)


@register_model("iiet")
class IIETMegatronLM(TemplateLM):
    """``checkpoint``: an ``iter_*`` folder or a checkpoint root (its newest complete one).
    ``tensor_parallel`` / ``pipeline_parallel``: the layout to run at (any; the checkpoint is
    resharded on load); the remaining ranks of the launch are data-parallel. ``runner``:
    ``auto`` | ``megatron`` | ``torch`` (module docstring)."""

    def __init__(self, checkpoint: Optional[str] = None, tokenizer: Optional[str] = None,
                 batch_size: int | str = 8, max_length: Optional[int] = None,
                 max_gen_toks: int = 256, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 progress: bool = True, runner: str = "auto", scorer=None,
                 tokenizer_object=None, **_ignored):
        super().__init__()
        if scorer is None:
            if checkpoint is None:
                raise OperatorError("the iiet backend needs checkpoint=PATH")
            scorer, tokenizer_object = _scorer_for_checkpoint(
                checkpoint, tokenizer, _batch_size(batch_size), max_length,
                int(tensor_parallel), int(pipeline_parallel), progress, runner)
        self.scorer = scorer
        self.tokenizer = tokenizer_object
        self._max_gen_toks = int(max_gen_toks)
        if self.tokenizer.eos_id is None:
            raise OperatorError("the checkpoint's tokenizer has no EOS token (lm-eval needs one)")

    # -- what lm-eval asks of a model --------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs):
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokenizer.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        scored, too_long = [], 0
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("loglikelihood requests need a context and a continuation")
            # lm-eval's hf backend asserts here; like its vllm backend, score what fits.
            too_long += len(continuation) > self.max_length
            scored.append(((context + continuation)[-(self.max_length + 1):],
                           min(len(continuation), self.max_length)))
        if too_long:
            _log.warning(
                f"{too_long} continuation(s) longer than the model's {self.max_length} tokens: "
                "only their last tokens are scored")
        results = self.scorer.loglikelihood(scored)
        for (pair, _, _), answer in zip(requests, results):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window,
                                             lm_utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length,
                                                 context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tokenizer.decode([self.eot_token_id])
        groups: dict[tuple, list[int]] = {}
        settings = []
        for index, req in enumerate(requests):
            context, gen_kwargs = req.args
            until, max_new = _generation_settings(gen_kwargs, self.max_gen_toks)
            if eos_text and eos_text not in until:
                until.append(eos_text)
            settings.append((context, until))
            groups.setdefault((tuple(until), max_new), []).append(index)
        outputs: list[Optional[str]] = [None] * len(requests)
        for (until, max_new), indices in groups.items():
            limit = max(self.max_length - max_new, 1)
            prompts = [self.tok_encode(settings[i][0])[-limit:] for i in indices]
            generated = self.scorer.generate(prompts, max_new, list(until), self.eot_token_id)
            for i, tokens in zip(indices, generated):
                text = self.tok_decode(tokens)
                for term in until:
                    if term:
                        text = text.split(term)[0]
                outputs[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return outputs


def _batch_size(value) -> int:
    if isinstance(value, str) and not value.isdigit():
        raise OperatorError(f"batch_size {value!r}: the iiet backend takes a number of requests "
                            "per batch (no 'auto')")
    return int(value)


def _generation_settings(gen_kwargs: dict, default_max: int) -> tuple[list[str], int]:
    """lm-eval's ``until`` and ``max_gen_toks``; sampling is refused (greedy decoding only)."""
    kwargs = dict(gen_kwargs or {})
    until = kwargs.pop("until", None)
    if isinstance(until, str):
        until = [until]
    max_new = int(kwargs.pop("max_gen_toks", default_max))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    if kwargs.pop("do_sample", False) or temperature > 0:
        raise OperatorError("the iiet backend decodes greedily: do_sample/temperature > 0 are "
                            "not supported (use lm-eval's hf backend on the export)")
    return list(until or []), max_new


RUNNERS = ("auto", "megatron", "torch")


def _one_process_job() -> bool:
    import torch.distributed as dist

    from megatron_iiet.distributed import _env_int  # the trainer's reading of torchrun/srun

    if dist.is_initialized():
        return dist.get_world_size() == 1
    return _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1) == 1


def choose_runner(runner: str, tp: int, pp: int) -> str:
    if runner not in RUNNERS:
        raise OperatorError(f"runner {runner!r}: choose one of {', '.join(RUNNERS)}")
    one = _one_process_job() and tp == 1 and pp == 1
    if runner == "torch" and not one:
        raise OperatorError("runner=torch scores in one process at TP=PP=1; this job has "
                            "several ranks or a TP/PP layout (use runner=megatron or auto)")
    if runner == "auto":
        return "torch" if one else "megatron"
    return runner


def _scorer_for_checkpoint(checkpoint, tokenizer, batch_size, max_length, tp, pp, progress,
                           runner="auto"):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_iiet.distributed import initialize
    from megatron_iiet.eval.checkpoint import load_for_inference
    from megatron_iiet.training.checkpoint_index import resolve_checkpoint

    resolve_checkpoint(checkpoint)  # a wrong path fails before any process group is made
    if choose_runner(runner, tp, pp) == "torch":
        return _local_scorer(checkpoint, tokenizer, batch_size, max_length, progress)
    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        try:
            initialize(tp, pp)
        except ValueError as err:
            raise OperatorError(str(err)) from err
    elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
          ) != (tp, pp):
        raise OperatorError(f"this job's process groups are TP={ps.get_tensor_model_parallel_world_size()}"
                            f"/PP={ps.get_pipeline_model_parallel_world_size()}, not {tp}/{pp}")
    loaded = load_for_inference(checkpoint, tokenizer)
    length = int(max_length) if max_length else loaded.max_length
    scorer = ParallelScorer(loaded.model, batch_size, length, decode=loaded.tokenizer.decode,
                            progress=progress)
    return scorer, loaded.tokenizer


def _local_scorer(checkpoint, tokenizer, batch_size, max_length, progress):
    from megatron_iiet.eval.local_scorer import LocalScorer
    from megatron_iiet.hf.megatron_to_hf import build_hf_model, resolve_tokenizer
    from megatron_iiet.platform import compute_device
    from megatron_iiet.training.checkpoint_index import read_meta, resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    meta = read_meta(ckpt)
    tok = resolve_tokenizer(meta, tokenizer, ckpt)
    # dtype None: the loaded tensors' own, i.e. the training precision, as the megatron runner's
    model, _, model_cfg = build_hf_model(ckpt, meta, tok, torch_dtype=None)
    length = int(max_length) if max_length else model_cfg.max_sequence_length
    scorer = LocalScorer(model.to(compute_device()), batch_size, length, decode=tok.decode,
                         progress=progress)
    return scorer, tok
