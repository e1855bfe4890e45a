"""megatron-core on machines without CUDA.

megatron-core 0.16 assumes a GPU in a few places: its RNG tracker keeps CUDA generator states,
about 175 call sites allocate on ``torch.cuda.current_device()``, the pipeline schedules build
``torch.zeros(..., device="cuda")`` and p2p code calls ``torch.cuda.synchronize()``. This module
answers those assumptions on the CPU so the same library code runs with gloo on a laptop or CI.

Everything here is switched on by :func:`install_cpu_compat` (and, for DeepSpeed,
:func:`install_deepspeed_cpu_compat`), which do nothing when CUDA is available: on GPU clusters
megatron-core and DeepSpeed run unpatched. The rest of the code asks this module, not
``torch.cuda``, what the machine can do: :func:`compute_device`, :func:`model_config_defaults`,
:func:`gpu_only_refusal`, :func:`synchronize`.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

log = logging.getLogger(__name__)

_INSTALLED = False

# megatron-core modules that write device="cuda" literally (found with grep in 0.16.1).
_MODULES_HARDCODING_CUDA = (
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.rerun_state_machine",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device model code should allocate on: the current GPU, or the CPU without one."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize() -> None:
    """Wait for queued device work (timing): a no-op without CUDA."""
    if cuda_available():
        torch.cuda.synchronize()


def model_config_defaults() -> dict:
    """TransformerConfig settings that depend on the machine: build weights on the CPU when
    there is no GPU, and skip the sync after batched p2p (it needs CUDA; gloo has no use for it)."""
    return {"use_cpu_initialization": not cuda_available(), "batch_p2p_sync": cuda_available()}


# Features megatron-core (0.16) offers only on CUDA, with what to use instead on a CPU.
_GPU_ONLY = {
    "sequence_parallel": "megatron-core's torch-norm path refuses it on CPU; set it to False",
    "mixed_precision_optimizer": "its mixed-precision optimizer is GPU-only; use fp32 or "
                                 "parallel.engine=deepspeed",
    "distributed_optimizer": "on CPU shard optimizer state with parallel.engine=deepspeed (ZeRO)",
}


def gpu_only_refusal(feature: str):
    """None on a GPU machine; else why ``feature`` (a key of _GPU_ONLY) cannot run here."""
    return None if cuda_available() else f"needs CUDA ({_GPU_ONLY[feature]})"


def name_deepspeed_accelerator() -> None:
    """Without CUDA, tell DeepSpeed it is on the CPU (``DS_ACCELERATOR=cpu``, unless the user
    chose one): its import, which transformers' accelerate integration triggers while saving or
    loading a model, would otherwise probe for a GPU and print a warning on stdout. Call it
    before DeepSpeed is imported; a no-op with CUDA."""
    import os

    if not cuda_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def install_deepspeed_cpu_compat() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (~50 s) used only by
    inference kernels; training collectives go through torch.distributed (gloo) either way, so
    skip building it. A no-op with CUDA."""
    if cuda_available():
        return
    import sys

    import deepspeed.comm.torch  # noqa: F401  (deepspeed.comm's `torch` attribute is torch itself)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def _as_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _TorchWithCpuDevices:
    """Stands in for the ``torch`` module inside megatron modules that hard-code ``"cuda"``.

    Only factory functions are rerouted; every other attribute is torch's own.
    """

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "empty_like", "zeros_like")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:

            @functools.wraps(attr)
            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _as_cpu_device(kwargs["device"])
                return attr(*args, **kwargs)

            return factory
        return attr


def _make_cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """megatron's named RNG streams kept as CPU generator states.

        ``fork(name)`` swaps the default CPU generator to the named stream and back, so
        tensor-parallel dropout draws from a per-TP-rank stream exactly as on GPU, and activation
        recompute can snapshot/restore the streams with ``get_states``/``set_states``.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def flush_cpu_denormals(enabled: bool) -> bool:
    """Set whether CPU math flushes subnormal floats to zero (x86 FTZ/DAZ), on the calling
    thread and on torch's OpenMP threads; returns True when every one of them flushes. Left
    alone with CUDA.

    Subnormal operands cost x86 cores a microcode assist per instruction: a CPU run's step time
    doubled over its first few hundred steps (2-3% of its attention probabilities had become
    subnormal) and fell by ~45% with the flush, its weights unchanged to the last bit
    (docs/benchmarks.md, "Subnormal floats on CPU").
    The switch is per thread and a new thread copies its creator's, so OpenMP threads started
    before it keep the old mode: then the pool is released (omp_pause_resource_all) and the next
    parallel region starts fresh threads."""
    if cuda_available():
        return False
    if not torch.set_flush_denormal(enabled):
        return False  # a CPU without the flags (torch: no SSE3 on x86)
    if _subnormals_surviving() != (0 if enabled else _PROBE_SIZE):
        _restart_openmp_threads()
    return enabled and _subnormals_surviving() == 0


@contextlib.contextmanager
def cpu_denormals_flushed(enabled: bool):
    """flush_cpu_denormals(enabled) inside, the process's previous mode restored after."""
    if cuda_available():
        yield False
        return
    before = _subnormals_surviving() == 0
    try:
        yield flush_cpu_denormals(enabled)
    finally:
        if before != enabled:
            flush_cpu_denormals(before)


_PROBE_SIZE = 1 << 20  # 32 of torch's 32768-element grains: a share for each of up to 32 threads


def _subnormals_surviving() -> int:
    """How many of _PROBE_SIZE subnormal floats survive a multiplication by one: 0 when every
    thread flushes, all of them when none does. Counted on the integer bits, as a float
    comparison under DAZ would itself read them as zero."""
    smallest_subnormal = torch.ones(_PROBE_SIZE, dtype=torch.int32).view(torch.float32)
    return int(((smallest_subnormal * 1.0).view(torch.int32) != 0).sum())


def _restart_openmp_threads() -> None:
    import ctypes

    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):  # no OpenMP runtime in the process (or not OpenMP 5.0)
        return
    pause(2)  # omp_pause_hard: the threads exit; the next parallel region creates new ones


def install_cpu_compat() -> bool:
    """Make megatron-core usable on the CPU. Returns True when the shim is active.

    Idempotent; a no-op when CUDA is available.
    """
    global _INSTALLED
    if cuda_available():
        return False
    if _INSTALLED:
        return True

    # Allocation sites ask for torch.cuda.current_device(): answer "cpu". Synchronising a
    # device that does not exist is a no-op.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None

    # Moving a tensor "to the GPU" on a machine without one leaves it where it is.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    import importlib

    from megatron.core.tensor_parallel import random as mp_random

    cpu_torch = _TorchWithCpuDevices()
    for name in _MODULES_HARDCODING_CUDA:
        importlib.import_module(name).torch = cpu_torch

    mp_random._CUDA_RNG_STATE_TRACKER = _make_cpu_rng_tracker_class()()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # megatron's own activation checkpoint saves/restores the "cuda" generator next to the CPU
    # one; without CUDA the tracker's CPU streams are all there is.
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *args, **kwargs: None

    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm

    _INSTALLED = True
    log.debug("megatron-core CPU compatibility layer installed")
    return True


def _clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's clip_grad_by_total_norm_fp32 without its assertion that grads live on CUDA."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)
