"""Hugging Face model code for IIET (Iterative Implicit Euler Transformer) and its baselines.

Shipped inside every exported checkpoint folder: it imports only torch and transformers (plus the
siblings configuration_iiet.py and cache_iiet.py, which `save_pretrained` copies with it). The architectures follow the project's spec (docs: spec/IIET.md):

* Every layer owns one pre-norm block, `Block(u) = h + MLP(N2(h))`, `h = u + Attn(N1(u))`. A
  layer's forward evaluates that block one or more times; each evaluation is a *pass*.
* One mechanism runs every architecture: `IIETDecoderLayer.block(u, pass_index, ctx)`. The
  per-architecture step functions below only say how pass inputs are formed and how pass outputs
  are combined. The cross-layer history (PCformer, IIET history form) is the small `IIETHistory`.
* Exact incremental decoding: every (layer, pass) has its own key/value store (`IIETCache`),
  because during training each pass attends to the keys/values of its own pass.
* Per-token cost follows the passes: a decode step's work outside them is O(1) kernels per pass
  and per layer. The stores grow in place (`IIETCacheLayer`: no copy of the past per pass), the
  history keeps one partial sum per layer (`LayerHistory`: one fused multiply-add per pop /
  finish, not one per earlier state), and RoPE rows and the mask are set up once per forward.

State-dict names follow the authors' LLaMA-style release; the full list is in docs/hf.md.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:  # transformers >= 5: init helpers that skip tensors already loaded from a checkpoint
    from transformers import initialization as _init
except ImportError:  # pragma: no cover - older transformers
    _init = None

from .cache_iiet import IIETCache, IIETCacheLayer  # noqa: F401  (the store, for users and tests)
from .configuration_iiet import IIETConfig, architecture_key

# torch >= 2.4; exported folders may be loaded with an older torch.
_HAS_RMS_NORM = hasattr(F, "rms_norm")
# transformers 5 renamed the output field `past_key_values` to `cache`.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class PassContext:
    """What every pass of every layer needs besides its input: RoPE tables, mask, cache.

    Built once per forward (the tables, and the mask in the form its attention function takes,
    serve every (layer, pass)), so a pass does no set-up of its own."""

    cos: torch.Tensor  # [batch|1, 1, seq, head_dim]
    signed_sin: torch.Tensor  # sin with its first half negated (see apply_rope_signed)
    mask: torch.Tensor | None  # as prepared by the attention's mask function; None = attend all
    cache: IIETCache | None
    attend: Callable  # (q, k, v, mask) -> attention output, of config._attn_implementation

    def slot(self, layer_index, pass_index):
        return None if self.cache is None else self.cache.slot(layer_index, pass_index)


# ----------------------------------------------------------------------------------------------
# Block pieces: RMSNorm, RoPE, attention, SwiGLU
# ----------------------------------------------------------------------------------------------
class IIETRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        if x.dtype == self.weight.dtype == torch.float32 and _HAS_RMS_NORM:
            # In fp32 ATen's rms_norm is the lines below (x * rsqrt(mean(x^2) + eps) * weight): on
            # CPU the same ops, bit-identical, minus their Python overhead; on CUDA one fused kernel
            # (equal to fp32 rounding). Not used in bf16/fp16: there it rounds after the weight.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 so bf16 checkpoints decode like their fp32 originals.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(position_ids, head_dim, theta, dtype):
    """cos/sin of shape [batch, 1, seq, head_dim], non-interleaved (halves) layout. Every entry
    depends on its own position only (element-wise math), so `RopeTable` precomputes them."""
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = position_ids[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos()[:, None].to(dtype), angles.sin()[:, None].to(dtype)


class RopeTable:
    """cos and signed sin (`rope_tables` of positions 0 .. n-1) kept for reuse across forwards:
    a decode step then slices (default positions) or gathers its rows instead of recomputing
    the tables. Entries equal `rope_tables` of the same positions (the same element-wise math)."""

    def __init__(self):
        self._tables = {}  # (head_dim, theta, device, dtype) -> (cos [n, head_dim], signed sin)

    def get(self, head_dim, theta, device, dtype, length):
        key = (head_dim, float(theta), device, dtype)
        tables = self._tables.get(key)
        if tables is None or tables[0].shape[0] < length:
            old = 0 if tables is None else tables[0].shape[0]
            size = -(-max(length, 2 * old, 1024) // 256) * 256
            cos, sin = rope_tables(torch.arange(size, device=device)[None], head_dim, theta, dtype)
            tables = self._tables[key] = (cos[0, 0], signed_sin(sin[0, 0]))
        return tables

    def lookup(self, position_ids, start, query_len, head_dim, theta, device, dtype):
        """[batch|1, 1, seq, head_dim] cos and signed sin: positions start .. start+query_len-1
        when position_ids is None (a view, no kernel), else the rows of position_ids."""
        if position_ids is None:
            cos, sin = self.get(head_dim, theta, device, dtype, start + query_len)
            return cos[start:start + query_len][None, None], sin[start:start + query_len][None, None]
        position_ids = position_ids.to(device)
        if position_ids.numel() == 0 or int(position_ids.min()) < 0:  # not in the table: compute
            cos, sin = rope_tables(position_ids, head_dim, theta, dtype)
            return cos, signed_sin(sin)
        cos, sin = self.get(head_dim, theta, device, dtype, int(position_ids.max()) + 1)
        return cos[position_ids][:, None], sin[position_ids][:, None]


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def signed_sin(sin):
    """sin with its first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin(sin)
    element for element (a sign flip is exact), so the rotation needs no negation per pass."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope_signed(x, cos, sin_signed):
    """apply_rope with the precomputed signed_sin: bit-identical, one kernel fewer per call."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def sdpa_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_mask(allowed, dtype):
    """Boolean mask -> the additive one SDPA would make of it at every call (0 / -inf)."""
    return torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def eager_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d) + mask) v, as transformers' eager_attention_forward computes it:
    scores in the input dtype, softmax in fp32 and cast back (so it is the reference to debug
    SDPA kernels against, and the path for tools that need explicit attention). `mask` is
    additive (`eager_mask`) or boolean (True = attend)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = eager_mask(mask, scores.dtype)
        scores = scores + mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def eager_mask(allowed, dtype):
    """Boolean (True = attend) -> additive, as Llama's eager mask (finfo.min, not -inf)."""
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)


# config._attn_implementation -> function; anything else is refused (never silently SDPA).
ATTENTION_FUNCTIONS = {"sdpa": sdpa_attention, "eager": eager_attention}
# ... and how its mask is prepared, once per forward, from the boolean one (True = attend).
ATTENTION_MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}


def attention_function(implementation):
    if implementation not in ATTENTION_FUNCTIONS:
        raise ValueError(f'attn_implementation="{implementation}" is not supported by IIET models; '
                         f'use one of {", ".join(map(repr, ATTENTION_FUNCTIONS))}')
    return ATTENTION_FUNCTIONS[implementation]


def attention_mask_function(implementation):
    """Boolean mask -> the form the implementation's attention takes (identity if not listed)."""
    return ATTENTION_MASKS.get(implementation, lambda allowed, dtype: allowed)


class IIETAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def forward(self, x, ctx, slot):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope_signed(q, ctx.cos, ctx.signed_sin), apply_rope_signed(k, ctx.cos, ctx.signed_sin)
        if ctx.cache is not None:
            k, v = ctx.cache.update(k, v, slot)
        if self.num_kv_heads != self.num_heads:
            # GQA: key/value head j serves the consecutive query heads j*g .. j*g+g-1.
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = ctx.attend(q, k, v, ctx.mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class IIETMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class IIETDecoderLayer(nn.Module):
    """The weights of one layer; `block` is one pass, with its own (layer, pass) cache slot."""

    def __init__(self, config, layer_index):
        super().__init__()
        self.layer_index = layer_index
        self.input_layernorm = IIETRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = IIETAttention(config)
        self.post_attention_layernorm = IIETRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = IIETMLP(config)
        for name, module in architecture_of(config).layer_parameters(config).items():
            setattr(self, name, module)

    def block(self, u, pass_index, ctx):
        slot = ctx.slot(self.layer_index, pass_index)
        h = u + self.self_attn(self.input_layernorm(u), ctx, slot)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------------------------
# Cross-layer history (spec section 3)
# ----------------------------------------------------------------------------------------------
def uniform_lower_triangular(size):
    """Row i holds 1/(i+1) in columns 0..i: every row starts as a plain average of the states."""
    rows = torch.arange(size, dtype=torch.float32)[:, None]
    # in the default dtype, as every other parameter: from_pretrained(dtype=bf16) sets it while
    # the model is built, and a parameter created in fp32 would stay fp32 through the load
    return (torch.tril(torch.ones(size, size)) / (rows + 1)).to(torch.get_default_dtype())


class HistoryStates:
    """The states S_0 .. S_l of one forward: the embeddings, then each finished layer's state."""

    def __init__(self, embeddings, rows):
        self.states = [embeddings]  # S_0 .. S_l
        self.rows = rows  # rows[l]: [2, L+1] = row l of W and of Wc, in the states' dtype

    def __len__(self):
        return len(self.states)

    def __getitem__(self, k):
        return self.states[k]


class IIETHistory(nn.Module):
    """States S_0 (embeddings) .. S_l, combined by the pop (W) and refine (Wc) matrices.

    `start` opens the `HistoryStates` of one forward and `layer` gives a layer its
    `LayerHistory`; layers are 0-based here, so layer i writes S_{i+1} and reads row i+1 of W / Wc.
    """

    def __init__(self, config):
        super().__init__()
        size, d, eps = config.num_hidden_layers + 1, config.hidden_size, config.history_norm_eps
        self.weight = nn.Parameter(uniform_lower_triangular(size))
        self.weight_c = nn.Parameter(uniform_lower_triangular(size))
        self.layer_norms = nn.ModuleList(nn.LayerNorm(d, eps=eps) for _ in range(config.num_hidden_layers))
        self.rouge_predictions_norm = nn.ModuleList(
            nn.LayerNorm(d, eps=eps) for _ in range(config.num_hidden_layers)
        )

    def start(self, embeddings):
        rows = torch.stack([self.weight, self.weight_c], dim=1).to(embeddings.dtype).unbind(0)
        return HistoryStates(embeddings, rows)

    def layer(self, states, layer_index):
        return LayerHistory(self, states, layer_index)


class LayerHistory:
    """Layer l's view of the history (the HF twin of megatron's model/history.py LayerHistory).

    Only the layer's own state S_l changes while it runs: S_0 .. S_{l-1} are final. So one
    matmul over them, when the layer starts, gives both partial sums `P_l = sum_{k<l} W[l,k] S_k`
    and `R_l = sum_{k<l} Wc[l,k] S_k`, and each pop / finish is then one fused multiply-add with
    the newest state. The same code runs for any number of positions, so prefill and cached
    decode compute every position alike.
    """

    def __init__(self, history, states, layer_index):
        row = layer_index + 1
        if len(states) != row:
            raise RuntimeError(f"history holds {len(states)} states, layer {layer_index} expects {row}")
        earlier = torch.stack(states.states)  # S_0 .. S_{row-1}
        coefficients = states.rows[row]  # [2, L+1]: row `row` of W and of Wc
        partial = coefficients[:, :row] @ earlier.view(row, -1)
        self.pop_sum, self.refine_sum = partial.view(2, *earlier.shape[1:]).unbind(0)
        self.own_pop_weight, self.own_refine_weight = coefficients[:, row].unbind(0)
        self.predictor_norm = history.rouge_predictions_norm[layer_index]
        self.corrector_norm = history.layer_norms[layer_index]
        self.states = states

    def pop(self, state):
        """sum_k W[l, k] S_k over S_0..S_l, with ``state`` as the layer's newest S_l."""
        return torch.addcmul(self.pop_sum, self.own_pop_weight, state)

    def finish(self, state):
        """Stores ``state`` as the layer's final S_l; returns the layer output refine(l)."""
        self.states.states.append(state)
        return torch.addcmul(self.refine_sum, self.own_refine_weight, state)


# ----------------------------------------------------------------------------------------------
# Architectures: how pass inputs are formed and outputs combined (spec sections 1, 2, 4, 5).
# The HF twin of megatron_iiet/model/architectures.py, in the same dialect: a step gets
# `StepInputs` and calls `s.run(u)` once per pass (the next pass of the layer's block),
# `s.run.residual(u)` = Block(u) - u, and, with the history, `s.history.pop` / `.finish`. Only
# the parameter names differ: these are the release's (docs/hf.md).
# ----------------------------------------------------------------------------------------------
class PassRunner:
    """Runs the passes of one layer's block during one forward, each in its own cache slot."""

    def __init__(self, block, total_passes):
        self.block = block  # (u, pass_index) -> Block(u)
        self.total_passes = total_passes
        self.passes_run = 0

    def __call__(self, u, norm=None):
        index = self.passes_run
        if index >= self.total_passes:
            raise RuntimeError(f"architecture ran pass {index + 1} but declared {self.total_passes} passes")
        self.passes_run += 1
        out = self.block(u, index)
        return out if norm is None else norm(out)

    def residual(self, u):
        """F(u) = Block(u) - u, the block's residual branch (one pass)."""
        return self(u) - u

    def finish(self):
        if self.passes_run != self.total_passes:  # the cache has one slot per declared pass
            raise RuntimeError(f"architecture ran {self.passes_run} passes but declared {self.total_passes}")


@dataclass(frozen=True)
class StepInputs:
    x: torch.Tensor
    history: "LayerHistory | None"  # the layer's view of the history (uses_history only)
    run: PassRunner
    layer: nn.Module  # the IIETDecoderLayer: its block and its architecture's layer parameters
    shared: nn.Module  # the IIETModel, which holds the model-wide parameters (release layout)
    iterations: int


def _vanilla(s):
    return s.run(s.x)


def _rk2(s):
    f1 = s.run.residual(s.x)
    f2 = s.run.residual(s.x + f1)
    return s.x + 0.5 * (f1 + f2)


def _rk2_gated(s):
    f1 = s.run.residual(s.x)
    f2 = s.run.residual(s.x + f1)
    g = torch.sigmoid(s.layer.gate_linear(torch.cat([f1, f2], dim=-1)))
    return s.x + g * f1 + (1.0 - g) * f2


def _rk4(s):
    x, run = s.x, s.run
    f1 = run.residual(x)
    f2 = run.residual(x + 0.5 * f1)
    f3 = run.residual(x + 0.5 * f2)
    f4 = run.residual(x + f3)
    return x + (f1 + 2.0 * f2 + 2.0 * f3 + f4) / 6.0


def _pcformer_predictor(s):
    """RK predictor with EMA coefficients (spec 4.1); each o_j normalises the whole block output."""
    x, a, norms = s.x, s.shared.alpha.to(s.x.dtype), s.shared.RK_norm
    order = len(norms)
    # Stage inputs: RK2 x, x+o1; RK4 x, x+o1/2, x+o2/2, x+o3.
    input_scale = [1.0] if order == 2 else [0.5, 0.5, 1.0]
    outputs = []
    u = x
    for j in range(order):
        outputs.append(s.run(u, norm=norms[j]))
        if j + 1 < order:
            u = x + input_scale[j] * outputs[j]
    predicted = x
    for j, o in enumerate(outputs):
        # weight of o_j: a (1-a)^(order-1-j)
        predicted = predicted + a * (1.0 - a) ** (order - 1 - j) * o
    return predicted


def _pcformer(s):
    history = s.history
    state = history.predictor_norm(_pcformer_predictor(s))
    state = s.run(history.pop(state), norm=history.corrector_norm)
    return history.finish(state)


def _iiet_history(s):
    history = s.history
    state = s.run(s.x, norm=history.predictor_norm)
    for _ in range(s.iterations):
        state = s.run(history.pop(state), norm=history.corrector_norm)
    return history.finish(state)


def _iiet_fixed_point(s):
    y = s.run(s.x)  # explicit-Euler predictor y_0 = x + F(x)
    for _ in range(s.iterations):
        y = s.x + s.run.residual(y)
    return y


def passes_fixed(n):
    """For architectures whose layers run the same number of passes whatever `iterations`."""
    return lambda iterations: n


def _predictor_plus_iterations(iterations):
    return iterations + 1


def no_parameters(config):
    return {}


@dataclass(frozen=True)
class Architecture:
    """One entry of ARCHITECTURES: the step, its passes and the parameters it adds."""

    step: Callable  # StepInputs -> the layer output
    passes: Callable  # a layer's iterations -> its block passes (KV-cache slots)
    uses_history: bool = False  # carries the cross-layer history of spec section 3
    layer_parameters: Callable = no_parameters  # config -> {name: module} of every decoder layer
    model_parameters: Callable = no_parameters  # config -> {name: module or parameter} of `model.`


def rk2_gate(config):
    return {"gate_linear": nn.Linear(2 * config.hidden_size, 1, bias=False)}


def history_parameters(config):
    return {"history": IIETHistory(config)}


def pcformer_parameters(stages):
    def build(config):
        norms = nn.ModuleList(nn.LayerNorm(config.hidden_size, eps=config.history_norm_eps)
                              for _ in range(stages))
        return {**history_parameters(config), "alpha": nn.Parameter(torch.full((1,), 0.5)),
                "RK_norm": norms}

    return build


# Every architecture this code runs, keyed by name, or "name/formulation" for one with several
# formulations (IIET); the keys of megatron's registry (tests/model/test_registry.py checks that
# both sides agree). The config reads its choices and pass counts here too.
ARCHITECTURES = {
    "vanilla": Architecture(_vanilla, passes_fixed(1)),
    "ode_rk2": Architecture(_rk2, passes_fixed(2)),
    "ode_rk2_gated": Architecture(_rk2_gated, passes_fixed(2), layer_parameters=rk2_gate),
    "ode_rk4": Architecture(_rk4, passes_fixed(4)),
    "pcformer_rk2": Architecture(_pcformer, passes_fixed(3), uses_history=True,
                                 model_parameters=pcformer_parameters(2)),
    "pcformer_rk4": Architecture(_pcformer, passes_fixed(5), uses_history=True,
                                 model_parameters=pcformer_parameters(4)),
    "iiet/history": Architecture(_iiet_history, _predictor_plus_iterations, uses_history=True,
                                 model_parameters=history_parameters),
    "iiet/fixed_point": Architecture(_iiet_fixed_point, _predictor_plus_iterations),
}


def architecture_of(config):
    return ARCHITECTURES[architecture_key(config.architecture, config.formulation)]


# ----------------------------------------------------------------------------------------------
# Masks and positions
# ----------------------------------------------------------------------------------------------
def build_attention_mask(padding_mask, query_len, past_len, device):
    """Boolean [batch|1, 1, query, key] mask (True = attend), or None when nothing is masked."""
    key_len = past_len + query_len
    if padding_mask is None and query_len == 1:
        return None
    query_pos = torch.arange(past_len, key_len, device=device)[:, None]
    key_pos = torch.arange(key_len, device=device)[None, :]
    allowed = (key_pos <= query_pos)[None, None]
    if padding_mask is not None:
        if padding_mask.shape[-1] != key_len:
            raise ValueError(
                f"attention_mask covers {padding_mask.shape[-1]} positions, expected {key_len} "
                f"({past_len} cached + {query_len} new)"
            )
        allowed = allowed & padding_mask[:, None, None, :].bool()
        # A padded query still sees itself, so no softmax row is empty (that would give NaN).
        allowed = allowed | (key_pos == query_pos)[None, None]
    return allowed


def effective_padding_mask(padding_mask, query_len, past_len):
    """The 2-D padding mask if it masks anything, else None (generate passes an all-ones mask
    with every step: treating it as absent gives the same positions and the same attention, and
    spares the mask kernels per pass; on GPU the check is one host sync per forward, as in
    transformers' own SDPA mask shortcut). Checks its length like build_attention_mask."""
    if padding_mask is None:
        return None
    key_len = past_len + query_len
    if padding_mask.shape[-1] != key_len:
        raise ValueError(
            f"attention_mask covers {padding_mask.shape[-1]} positions, expected {key_len} "
            f"({past_len} cached + {query_len} new)"
        )
    return None if bool(padding_mask.all()) else padding_mask


def default_position_ids(padding_mask, batch, query_len, past_len, device):
    if padding_mask is not None:
        # Left padding: positions count real tokens only, as they did in training.
        positions = (padding_mask.long().cumsum(-1) - 1).clamp(min=0)
        return positions[:, -query_len:]
    return torch.arange(past_len, past_len + query_len, device=device)[None].expand(batch, -1)


# ----------------------------------------------------------------------------------------------
# Output options (transformers' semantics; a flag left None takes the config's value)
# ----------------------------------------------------------------------------------------------
def hidden_states_kept(flag, config):
    """Indices of the num_hidden_layers + 1 hidden states to return, or None for none. As in
    transformers 5, `output_hidden_states` may be an index or a list of them (negative ones
    count from the end); the others come back as None."""
    flag = getattr(config, "output_hidden_states", False) if flag is None else flag
    count = config.num_hidden_layers + 1
    if isinstance(flag, bool) or not flag:
        return set(range(count)) if flag else None
    wanted = [flag] if isinstance(flag, int) else list(flag)
    return {i % count for i in wanted if -count <= i < count}


def _return_dict(flag, config):
    return getattr(config, "return_dict", True) if flag is None else flag


def refuse_output_attentions(flag, config):
    flag = getattr(config, "output_attentions", False) if flag is None else flag
    if flag:
        # A layer attends once per pass (up to 1 + iterations times), so transformers' one
        # attention map per layer does not exist; refuse rather than return nothing.
        raise ValueError("output_attentions is not supported by IIET models (a layer runs "
                         "several attention passes)")


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------
class IIETPreTrainedModel(PreTrainedModel):
    config_class = IIETConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    """Each block pass is recomputed in the backward (the history's mixing is not: it is small
    and holds the only state shared between passes)."""
    _no_split_modules = ["IIETDecoderLayer"]
    _supports_sdpa = True  # "eager" needs no flag; flash / flex attention are refused below

    @classmethod
    def _can_set_attn_implementation(cls):
        # transformers guesses this from the source (an AttentionInterface lookup); ours reads
        # config._attn_implementation at every forward, so set_attn_implementation works.
        return True

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        # Called by transformers (>= 5) at __init__ / from_pretrained / set_attn_implementation:
        # refuse there, before any weight is loaded, what the forward could not run.
        if requested_attention is not None:
            attention_function(requested_attention)
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # transformers records only the saved class in auto_map; AutoModel (the base model of a
        # causal-LM export) must load from the folder alone too
        self.config.auto_map = {"AutoModel": "modeling_iiet.IIETModel",
                                **(getattr(self.config, "auto_map", None) or {})}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, IIETHistory):
            for matrix in (module.weight, module.weight_c):
                _copy_init(matrix, uniform_lower_triangular(matrix.shape[0]))
        elif isinstance(module, IIETModel) and hasattr(module, "alpha"):
            _copy_init(module.alpha, torch.full_like(module.alpha, 0.5))


def _copy_init(param, value):
    if _init is not None:
        _init.copy_(param, value.to(param.device, param.dtype))
    else:  # pragma: no cover - older transformers
        with torch.no_grad():
            param.copy_(value)


class IIETModel(IIETPreTrainedModel):
    """Embedding, the L layers with their architecture's loop, final RMSNorm (HF prefix `model.`)."""

    def __init__(self, config):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(IIETDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = IIETRMSNorm(d, config.rms_norm_eps)
        for name, value in architecture_of(config).model_parameters(config).items():
            setattr(self, name, value)
        self._rope = RopeTable()  # not a module or buffer: no state-dict entry
        self.gradient_checkpointing = False  # gradient_checkpointing_enable() turns it on
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _resolve_cache(self, cache, use_cache):
        if cache is None and not use_cache:
            return None
        layout = self.config.passes_per_layer()
        if isinstance(cache, IIETCache):
            if cache.passes_per_layer != layout:
                raise ValueError(
                    f"cache holds passes {cache.passes_per_layer} per layer, the model runs {layout}: "
                    "a cache cannot be reused after changing `iterations`"
                )
            return cache
        if cache is None or cache.get_seq_length() == 0:
            # generate() hands over a standard empty cache with one slot per layer; IIET needs
            # one per (layer, pass), so start our own (generate reads it back from the output).
            return IIETCache(layout)
        raise ValueError(f"a non-empty {type(cache).__name__} cannot serve IIET: pass an IIETCache")

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None,
                output_attentions=None, return_dict=None, **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        refuse_output_attentions(output_attentions, self.config)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        cache = self._resolve_cache(cache, use_cache)

        batch, query_len, _ = inputs_embeds.shape
        past_len = cache.get_seq_length() if cache is not None else 0
        device, dtype = inputs_embeds.device, inputs_embeds.dtype
        # Set up once per forward what every (layer, pass) shares: RoPE rows, mask, attention.
        padding = effective_padding_mask(attention_mask, query_len, past_len)
        if position_ids is None and padding is not None:
            position_ids = default_position_ids(padding, batch, query_len, past_len, device)
        cos, signed = self._rope.lookup(position_ids, past_len, query_len,
                                        self.config.hidden_size // self.config.num_attention_heads,
                                        self.config.rope_theta, device, dtype)
        implementation = getattr(self.config, "_attn_implementation", None) or "sdpa"
        attend = attention_function(implementation)
        mask = build_attention_mask(padding, query_len, past_len, device)
        if mask is not None:
            mask = attention_mask_function(implementation)(mask, dtype)
        ctx = PassContext(cos, signed, mask, cache, attend)

        architecture = architecture_of(self.config)
        states = self.history.start(inputs_embeds) if architecture.uses_history else None
        keep = hidden_states_kept(output_hidden_states, self.config)
        all_hidden = []
        x = inputs_embeds
        for layer, iterations in zip(self.layers, self.config.iterations):
            if keep is not None:  # the layer's input: the embeddings, then each layer's output
                all_hidden.append(x if len(all_hidden) in keep else None)

            def block(u, pass_index, layer=layer):
                if self.gradient_checkpointing and self.training:
                    return self._gradient_checkpointing_func(layer.block, u, pass_index, ctx)
                return layer.block(u, pass_index, ctx)

            run = PassRunner(block, architecture.passes(iterations))
            history = self.history.layer(states, layer.layer_index) if states is not None else None
            x = architecture.step(StepInputs(x=x, history=history, run=run, layer=layer,
                                             shared=self, iterations=iterations))
            run.finish()
        x = self.norm(x)
        if keep is not None:  # the last entry is after the final norm, as in LlamaModel
            all_hidden.append(x if len(all_hidden) in keep else None)
        out = BaseModelOutputWithPast(last_hidden_state=x, **{CACHE_FIELD: cache},
                                      hidden_states=tuple(all_hidden) if keep is not None else None)
        return out if _return_dict(return_dict, self.config) else out.to_tuple()


class IIETForCausalLM(IIETPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = IIETModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                output_hidden_states=None, output_attentions=None, return_dict=None, **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states,
                         output_attentions=output_attentions, return_dict=True)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            # Next-token loss: position t predicts labels[t + 1]; -100 is ignored.
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                        **{CACHE_FIELD: getattr(out, CACHE_FIELD)})
        # return_dict=False: transformers' tuple (to_tuple() drops the None fields: loss first
        # only when labels were given).
        return result if _return_dict(return_dict, self.config) else result.to_tuple()


IIETModel.register_for_auto_class("AutoModel")
IIETForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["ARCHITECTURES", "Architecture", "IIETCache", "IIETModel", "IIETForCausalLM",
           "IIETPreTrainedModel", "StepInputs"]
