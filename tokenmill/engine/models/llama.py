"""The Llama family, written for the ragged batch: Llama 2/3/3.x, Mistral, Qwen2/2.5 and Qwen3.

One forward takes the step's flat tokens `[T]` and positions `[T]` and returns the logits of the sampled rows only
(and, when asked, the final hidden states of the pooled rows, for embeddings).
Per decoder layer: one matmul for Q, K and V together, one for gate and up together, the residual added inside the
norm that follows it, rotary with the step's cos/sin (computed once per step, for every layer), and the paged
attention of `tokenmill.kernels` called with device tensors; the norms, the rotary and SiLU-and-mul are the step's
backend's too (`tokenmill.kernels.layers`; one kernel each in the Triton backend). On a CPU the matmuls run on oneDNN
with their weights packed once, the residual adds fused into the matmuls before them, and gate and up as two matmuls
with SiLU-and-mul fused in (`PackedLinear`, `PackedGateUp`; in float32 the unfused ops' bits, see there). The weights
come from the transformers model that loaded the checkpoint (safetensors, shards, tied embeddings, rope scaling as its
config says), merged layer by layer while that model's copy of each layer is freed.

Numerics follow transformers' modules: RMSNorm in float32 then cast back, cos/sin computed in float32 from
`position * inv_freq` as transformers' rotary embedding does, so greedy tokens match `generate` in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.engine.attention import AttentionMetadata
from tokenmill.kernels import AttentionBackend

#: transformers architectures this module implements, and whether their attention has Q/K norms.
ARCHITECTURES = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen2ForCausalLM": False,
                 "Qwen3ForCausalLM": True}


@dataclass(frozen=True)
class Shape:
    """What the forward needs of a config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tied: bool

    @property
    def qkv_sizes(self) -> list[int]:
        return [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]


def unsupported(model: nn.Module) -> str | None:
    """Why this module cannot run transformers' `model` exactly as it runs (None: it can)."""
    config, architecture = model.config, type(model).__name__
    if architecture not in ARCHITECTURES:
        return f"architecture {architecture} is not implemented natively"
    if not type(model).__module__.startswith("transformers.models."):
        return f"{architecture} comes from {type(model).__module__}, not transformers (remote code)"
    if getattr(config, "quantization_config", None) is not None:
        return "a quantized checkpoint"
    try:
        projections = [getattr(part, name) for layer in model.model.layers
                       for part, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                           (layer.mlp, ("gate_proj", "up_proj", "down_proj"))) for name in names]
    except AttributeError as missing:
        return f"a layer without the family's modules ({missing})"
    if any(type(p) is not nn.Linear for p in projections):
        return "projections that are not plain linear layers"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        return f"rope_type {rope['rope_type']!r} (its frequencies depend on the sequence length)"
    return None


def shape_of(model: nn.Module) -> Shape:
    config, attention = model.config, model.model.layers[0].self_attn
    return Shape(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        eps=config.rms_norm_eps, qkv_bias=attention.q_proj.bias is not None, o_bias=attention.o_proj.bias is not None,
        qk_norm=ARCHITECTURES[type(model).__name__],
        tied=model.lm_head.weight is model.get_input_embeddings().weight,  # tied only where transformers tied them
    )


class RMSNorm(nn.Module):
    """transformers' RMSNorm, run by the step's backend (`add_rms_norm`): with `residual`, the residual is added first
    and the sum is the new residual."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ops: AttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Rotary(nn.Module):
    """The step's cos and sin, as transformers' rotary embedding computes them."""

    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type == "default":
            base = config.rope_parameters["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", torch.cat((inv_freq, inv_freq)).float(), persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, head_dim]` of the step's positions."""
        angles = positions[:, None].float() * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


class PackedLinear(nn.Module):
    """A CPU `nn.Linear` whose weight oneDNN reordered once for its own matmul kernels: what a plain `F.linear` (MKL)
    repacks on every call. Float32 and, where the CPU has bf16 instructions, bfloat16. `forward(x, add=t)` is
    `linear(x) + t` and `forward(x, mul=t)` is `linear(x) * t`, each one kernel (oneDNN's post-op, applied to the
    float32 accumulator: in float32 the two ops' bits, except a biased linear, whose bias oneDNN adds its own way on
    some CPUs: within float32 rounding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_hint: int = 64) -> None:
        super().__init__()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                                               batch_hint), persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None, mul: torch.Tensor | None = None
                ) -> torch.Tensor:
        if add is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, add, self.packed, self.bias, "add")
        if mul is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, mul, self.packed, self.bias, "mul")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedGateUp(nn.Module):
    """The MLP's gate and up projections and SiLU-and-mul on a CPU: SiLU of the gate's matmul in place, then the up
    matmul with the product fused into it; no `[T, 2 * intermediate]` tensor and no separate multiply."""

    def __init__(self, gate_up: nn.Linear, intermediate_size: int) -> None:
        super().__init__()
        gate, up = gate_up.weight.split(intermediate_size)
        self.gate, self.up = PackedLinear(gate), PackedLinear(up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x, mul=F.silu(self.gate(x), inplace=True))


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class DecoderLayer(nn.Module):
    def __init__(self, shape: Shape, index: int) -> None:
        super().__init__()
        self.shape, self.index = shape, index
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.eps)
        self.qkv_proj = nn.Linear(shape.hidden_size, sum(shape.qkv_sizes), bias=shape.qkv_bias)
        # Qwen3's per-head norms of Q and K: their weights, one row per query head then per KV head
        self.qk_weight = nn.Parameter(torch.ones(shape.num_heads + shape.num_kv_heads, shape.head_dim)) \
            if shape.qk_norm else None
        self.o_proj = nn.Linear(shape.num_heads * shape.head_dim, shape.hidden_size, bias=shape.o_bias)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.eps)
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)
        self.scale = shape.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the layer's output, the residual still to add to it); None: added already (the CPU's fused matmuls)."""
        shape, tokens, ops = self.shape, hidden.shape[0], meta.backend
        hidden, residual = self.input_layernorm(hidden, residual, ops)
        qkv = self.qkv_proj(hidden)
        q_size, kv_size, _ = shape.qkv_sizes
        qk = qkv[:, :q_size + kv_size].view(tokens, shape.num_heads + shape.num_kv_heads, shape.head_dim)
        if self.qk_weight is not None:  # Qwen3: each head normalised, Q's and K's weights side by side
            qk = F.rms_norm(qk, qk.shape[-1:], None, shape.eps) * self.qk_weight if qk.dtype == torch.float32 else \
                self.qk_weight * F.rms_norm(qk.float(), qk.shape[-1:], None, shape.eps).to(qk.dtype)
        qk = ops.rotary(qk, cos, sin)  # queries and keys in one pass
        q, k = qk[:, :shape.num_heads], qk[:, shape.num_heads:]
        v = qkv[:, q_size + kv_size:].view(tokens, shape.num_kv_heads, shape.head_dim)
        k_cache, v_cache = meta.kv_caches[self.index]
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.padded_decode:
            attended = ops.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
                                            self.scale)
        else:
            attended = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
                                           self.scale, meta.max_seqlen_q, meta.max_seq_len)
        attended = attended.reshape(tokens, shape.num_heads * shape.head_dim)
        if isinstance(self.o_proj, PackedLinear):  # the residual adds fused into the matmuls before them
            hidden, residual = self.post_attention_layernorm(self.o_proj(attended, add=residual), None, ops)
            return self.down_proj(self._mlp(hidden, ops), add=residual), None
        hidden, residual = self.post_attention_layernorm(self.o_proj(attended), residual, ops)
        return self.down_proj(self._mlp(hidden, ops)), residual

    def _mlp(self, hidden: torch.Tensor, ops: AttentionBackend) -> torch.Tensor:
        if isinstance(self.gate_up_proj, PackedGateUp):
            return self.gate_up_proj(hidden)
        return ops.silu_and_mul(self.gate_up_proj(hidden))


class LlamaFamily(nn.Module):
    """`forward(input_ids [T], positions [T], meta, sample_rows [R]) -> logits [R, vocab]`; with `pool_rows [P]`,
    `(logits, hidden [P, hidden_size])`: those rows' final hidden states (after the final norm, before the head)."""

    native = True

    def __init__(self, config: Any, shape: Shape) -> None:
        super().__init__()
        self.shape = shape
        self.config = config
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rotary = Rotary(config, shape.head_dim)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                sample_rows: torch.Tensor, pool_rows: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        logits = self.lm_head(self._final_norm(hidden, residual, sample_rows, meta.backend))
        if pool_rows is None:
            return logits
        return logits, self._final_norm(hidden, residual, pool_rows, meta.backend)

    def _final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor,
                    ops: AttentionBackend) -> torch.Tensor:
        """The final norm of `rows`; `residual` None: the last layer added it already."""
        return self.norm(hidden[rows], None if residual is None else residual[rows], ops)[0]


@torch.no_grad()
def from_transformers(model: nn.Module) -> LlamaFamily:
    """The native model holding `model`'s weights, on its device and dtype: the embedding, final norm and head shared,
    each layer's merged while `model`'s copy of that layer is freed, so the peak is the weights plus one layer."""
    config = model.config
    weight = model.get_input_embeddings().weight
    with torch.device("meta"):
        native = LlamaFamily(config, shape_of(model))
    native.rotary = Rotary(config, native.shape.head_dim).to(weight.device)
    native.generation_config = getattr(model, "generation_config", None)  # its eos tokens end requests too
    body = model.model

    def take(target: nn.Module, name: str, *sources: torch.Tensor) -> None:
        value = sources[0].detach() if len(sources) == 1 else torch.cat(sources)
        setattr(target, name, nn.Parameter(value.to(weight.dtype), requires_grad=False))

    take(native.embed_tokens, "weight", body.embed_tokens.weight)
    take(native.norm, "weight", body.norm.weight)
    if native.shape.tied:
        native.lm_head.weight = native.embed_tokens.weight
    else:
        take(native.lm_head, "weight", model.lm_head.weight)
    for i, (mine, theirs) in enumerate(zip(native.layers, body.layers)):
        attn, mlp = theirs.self_attn, theirs.mlp
        take(mine.qkv_proj, "weight", attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        if native.shape.qkv_bias:
            take(mine.qkv_proj, "bias", attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
        take(mine.o_proj, "weight", attn.o_proj.weight)
        if native.shape.o_bias:
            take(mine.o_proj, "bias", attn.o_proj.bias)
        if native.shape.qk_norm:
            shape = native.shape
            take(mine, "qk_weight", attn.q_norm.weight.expand(shape.num_heads, -1),
                 attn.k_norm.weight.expand(shape.num_kv_heads, -1))
        take(mine.input_layernorm, "weight", theirs.input_layernorm.weight)
        take(mine.post_attention_layernorm, "weight", theirs.post_attention_layernorm.weight)
        take(mine.gate_up_proj, "weight", mlp.gate_proj.weight, mlp.up_proj.weight)
        take(mine.down_proj, "weight", mlp.down_proj.weight)
        body.layers[i] = nn.Identity()  # its weights go with it
        if can_pack(weight):
            for name in ("qkv_proj", "o_proj", "down_proj"):
                linear = getattr(mine, name)
                setattr(mine, name, PackedLinear(linear.weight, linear.bias))
            mine.gate_up_proj = PackedGateUp(mine.gate_up_proj, native.shape.intermediate_size)
    if can_pack(weight):  # tied too: a second copy of the embedding, but the head is a decode step's largest matmul
        native.lm_head = PackedLinear(native.lm_head.weight)
    return native.eval()
