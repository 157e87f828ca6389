"""Qwen2/Qwen3-style causal LM with MTP draft heads, for the embedded rollout engine; also the
Qwen3.5-style hybrid (``model_type`` qwen3_5 / qwen3_5_text): Gated DeltaNet linear-attention layers
(``linear_attn``: causal depthwise conv1d + gated delta rule recurrence, gated RMSNorm output) between
gated full-attention layers (``q_proj`` rows per head [q_h; gate_h], output * sigmoid(gate)),
zero-centred RMSNorm ((1 + w)·x̂), partial RoPE (the first ``partial_rotary_factor`` of each head);
and its MoE variants Qwen3.5-MoE (``qwen3_5_moe``, every MLP sparse) and Qwen3-Next (``qwen3_next``:
``decoder_sparse_step`` / ``mlp_only_layers`` keep some MLPs dense, ``norm_topk_prob``, and the GDN
input projection fused as per-key-head interleaved ``in_proj_qkvz`` / ``in_proj_ba``): a softmax
top-k router over SwiGLU experts plus a sigmoid-gated shared expert (``SparseMoE``), the MTP layer too.

Weights use the Hugging Face layout (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``,
``lm_head``...) so that any HF export loads. MTP heads load from the layouts found in the wild:

* DeepSeek-V3 style, one module per depth: ``model.layers.{L+k}.{enorm,hnorm,eh_proj,
  shared_head.norm}`` plus that layer's decoder weights (``num_nextn_predict_layers`` = γ);
* Qwen3-Next / Qwen3.5 style, one module: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.layers.J.*``, ``mtp.norm`` (``mtp_num_hidden_layers``).

Depth k uses module ``k mod num_modules`` (a single module is applied recursively, as SGLang's
NEXTN does). Each MTP module computes, like megatron-core's ``MultiTokenPredictionLayer``:
``h_k = norm_k(layers_k(eh_proj([enorm(emb(x_{t+k})), hnorm(h_{k-1})])))`` and the draft logits
``lm_head(h_k)``; ``h_0`` is the trunk's output after its final norm (``mtp_hidden: normed``,
megatron-core's convention) or before it (``prenorm``).

KV caches live in fixed slots ``[slots, kv_heads, max_len, head_dim]`` per layer and per stream
(the trunk and each MTP depth): a forward writes its rows' new K/V at their positions and attends
causally over the slot, so requests of different lengths batch together (continuous batching),
and speculative entries past a request's committed length are simply overwritten later.

A Gated DeltaNet layer keeps, per slot, a conv state (the last K-1 inputs of its conv1d) and a
recurrent state [v_heads, k_dim, v_dim] (float32 for half-precision models) after the slot's last
processed token; a row starting at position 0 starts from zeros. These are not position-indexed, so
speculation needs exact rollback: a forward with ``BatchIndex.keep_states`` also keeps the state
after EVERY fed position (SGLang's extra buffer), and ``KVCache.rollback(slots, idx)`` then sets each
row's live state to the one after its position ``idx`` (the drafts it accepted).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class LMConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True  # qwen3
    qkv_bias: bool = False  # qwen2
    tie_word_embeddings: bool = False
    num_mtp_modules: int = 0
    mtp_layers_per_module: int = 1
    mtp_layout: str = "deepseek"  # deepseek | qwen3_next
    mtp_hidden: str = "normed"  # normed (megatron-core) | prenorm
    mtp_intermediate_size: int = 0  # the MTP layers' dense MLP width (0: intermediate_size)
    eos_token_id: Optional[int] = None
    # Qwen3.5-style hybrid: per-layer "linear_attention" (Gated DeltaNet) | "full_attention"
    layer_types: tuple = ()
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False  # q_proj also yields a per-head output gate
    zero_centered_norm: bool = False  # RMSNorm scales by (1 + w)
    # Qwen3-Next ships the GDN input projection as per-key-head interleaved in_proj_qkvz / in_proj_ba
    gdn_layout: str = "qwen3_5"  # qwen3_5 (in_proj_qkv/z/b/a) | qwen3_next (in_proj_qkvz/ba)
    # MoE MLPs (Qwen3.5-MoE / Qwen3-Next): routed SwiGLU experts + a sigmoid-gated shared expert
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple = ()  # ... and i is not listed here (dense MLP of intermediate_size)
    extra: dict = field(default_factory=dict)

    @property
    def hybrid(self) -> bool:
        return bool(self.layer_types)

    def moe_layer(self, i: int) -> bool:
        """Qwen3-Next's rule (Qwen3.5-MoE: every layer); MTP layers of an MoE model are MoE too."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % max(self.decoder_sparse_step, 1) == 0)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_kind(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    @classmethod
    def from_hf(cls, cfg: dict) -> "LMConfig":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        moe_family = model_type in _MOE_TYPES or any(a.startswith(("Qwen3_5MoeFor", "Qwen3NextFor")) for a in archs)
        if not moe_family and ("moe" in model_type or any("Moe" in a or "Next" in a for a in archs)):
            raise ValueError(f"unsupported model type {model_type or archs!r} (Qwen2/Qwen3, Qwen3.5, "
                             "Qwen3.5-MoE and Qwen3-Next only)")
        if isinstance(cfg.get("text_config"), dict):  # Qwen3_5(Moe)ForConditionalGeneration: the text model's fields
            top = cfg
            cfg = dict(top["text_config"])
            for key in ("tie_word_embeddings", "mtp_num_hidden_layers", "bebop_mtp_hidden", "bebop_mtp_intermediate_size",
                        "eos_token_id"):
                if key in top and key not in cfg:
                    cfg[key] = top[key]
            cfg.setdefault("model_type", "qwen3_5_moe_text" if moe_family else "qwen3_5_text")
            model_type = cfg["model_type"]
        hybrid = (model_type in ("qwen3_5", "qwen3_5_text") + _MOE_TYPES
                  or any(a.startswith(("Qwen3_5For", "Qwen3_5MoeFor", "Qwen3NextFor")) for a in archs))
        next_ = model_type == "qwen3_next" or any(a.startswith("Qwen3NextFor") for a in archs)
        qwen2 = model_type == "qwen2" or any("Qwen2" in a for a in archs)
        heads = cfg["num_attention_heads"]
        n_ds = int(cfg.get("num_nextn_predict_layers", 0) or 0)
        n_q3n = int(cfg.get("mtp_num_hidden_layers", 0) or 0)
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,  # Qwen3.5-MoE has no dense MLP
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            qk_norm=not qwen2,
            qkv_bias=qwen2 or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_mtp_modules=n_ds if n_ds else (1 if n_q3n else 0),
            mtp_layers_per_module=n_q3n if (n_q3n and not n_ds) else 1,
            mtp_layout="deepseek" if n_ds else "qwen3_next",
            mtp_hidden=cfg.get("bebop_mtp_hidden", "normed"),
            mtp_intermediate_size=int(cfg.get("bebop_mtp_intermediate_size") or 0),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            **(_hybrid_fields(cfg) if hybrid else {}),
            **(_moe_fields(cfg, next_) if cfg.get("num_experts") else {}),
            gdn_layout="qwen3_next" if next_ else "qwen3_5",
        )


_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def _moe_fields(cfg: dict, qwen3_next: bool) -> dict:
    """transformers' Qwen3.5-MoE has no ``decoder_sparse_step`` / ``mlp_only_layers`` (every layer is
    MoE) and always renormalises the top-k; ``norm_topk_prob`` is still read when present, as SGLang
    and our megatron policy (``moe_norm_topk_prob``) honour it and our export writes it."""
    out = dict(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
               moe_intermediate_size=int(cfg["moe_intermediate_size"]),
               shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
               norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    if qwen3_next:
        out.update(decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))
    return out


def _hybrid_fields(cfg: dict) -> dict:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:
        k = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    rp = cfg.get("rope_parameters") or {}
    return dict(
        layer_types=tuple(types), linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"], linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"],
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
        partial_rotary_factor=float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        attn_output_gate=True, zero_centered_norm=True,
    )


def _rope_theta(cfg: dict) -> float:
    """transformers >= 5 nests it in ``rope_parameters``; older configs have ``rope_theta``."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"unsupported RoPE scaling {rp.get('rope_type')!r} (only plain RoPE)")
    theta = cfg.get("rope_theta") or rp.get("rope_theta")
    return float(theta) if theta is not None else 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.zero_centered = zero_centered  # Qwen3.5: (1 + w) * x̂, with w stored around 0
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        if self.zero_centered:  # transformers' Qwen3_5RMSNorm: x̂ * (1 + w) in float32 (float64 stays), then cast
            xf = x if dtype == torch.float64 else x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (xf * (1.0 + self.weight.to(xf.dtype))).to(dtype)
        if dtype in (torch.float32, torch.float64):  # fused kernel, same arithmetic as below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _norm(c: "LMConfig", dim: int) -> RMSNorm:
    return RMSNorm(dim, c.rms_norm_eps, c.zero_centered_norm)


def _rotate_half(x: Tensor) -> Tensor:
    """The textbook RoPE rotation [-x2, x1] (the reference ``_rope_apply`` is pinned against)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _swap_halves(x: Tensor) -> Tensor:
    """[x2, x1]: one copy kernel (``_rotate_half`` is a negation and a concat)."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def _rope_apply(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head: x·cos + rotate_half(x)·sin, with the
    rotation's sign folded into the table (``sin_signed`` = [-sin, sin] over the two halves), so
    that rotate_half(x)·sin = swap_halves(x)·sin_signed exactly (a negation is exact)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + _swap_halves(x) * sin_signed
    r = x[..., :rd]
    return torch.cat([r * cos + _swap_halves(r) * sin_signed, x[..., rd:]], dim=-1)


FAST_WEIGHTS_MAX_BYTES = 8 << 20  # a module's weights up to this size get a fused, transposed CPU copy
_PARAM_EPOCH = [0]  # bumped whenever any module registers a parameter (assignment, load_state_dict(assign=True))


def _on_parameter_registered(module: nn.Module, name: str, param) -> None:
    _PARAM_EPOCH[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registered)


def _weights_key(ws) -> tuple:
    """What a cache built from the tensors ``ws`` is keyed on: their storages, dtype and version counters.
    Version counters only grow, so their sum changes with any in-place write (``copy_``); a move or a
    cast changes the storages. One key for every cache of derived weights (``_fast_weights``,
    ``CausalLMWithMTP._mtp_fold``): it is checked once per layer or draft step."""
    v = ptr = 0
    for t in ws:
        v += t._version
        ptr += t.data_ptr()
    return ptr, ws[0].dtype, v


def _fast_weights(owner: nn.Module, weights, build) -> Optional[tuple]:
    """``build()``'s fused, transposed copies of the tensors ``weights()`` lists, cached on ``owner`` until
    one of them changes, for small modules on a CPU without autograd; None elsewhere (the modules' own
    layers then run).

    On a CPU a forward of a few tokens is bound by per-op cost: one matmul over the concatenated
    q/k/v (or gate/up) weights replaces three (two) linears, and MKL multiplies a few rows by a
    [in, out] weight about 40% faster than by the transposed view ``F.linear`` passes it (12.9 µs ->
    7.7 µs at 4 x 128 -> 384, one thread). The copies cost the module's weight memory again, hence the
    cap (``FAST_WEIGHTS_MAX_BYTES``: the CPU models; a real model's layer is larger and runs on a GPU,
    where ``F.linear`` is the fast path). They are keyed on each weight's storage and version counter,
    as ``CausalLMWithMTP._mtp_fold`` is: in-place updates (``copy_``, as ``load_hf_state_dict`` and the
    RL weight sync do) and moves rebuild them; writes through ``.data`` would not. The weights are
    listed once per owner (the check runs in every layer of every forward: 5 µs, not 16) and again
    after any parameter is registered anywhere (a global registration hook bumps ``_PARAM_EPOCH``), so
    replaced parameters (``module.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``) are seen."""
    d = owner.__dict__
    ws = d.get("_fast_ws")
    if ws is None or d.get("_fast_epoch") != _PARAM_EPOCH[0]:  # first call, or parameters (re)registered somewhere
        ws = tuple(weights())
        if d.get("_fast_ws") is None or any(a is not b for a, b in zip(ws, d["_fast_ws"])):
            d.pop("_fast", None)
        d["_fast_ws"], d["_fast_epoch"] = ws, _PARAM_EPOCH[0]
        d["_fast_inference"] = any(t.is_inference() for t in ws)  # fixed for a tensor's life (no version counter)
    w0 = ws[0]
    if torch.is_grad_enabled() or w0.device.type != "cpu" or w0.dtype not in (torch.float32, torch.float64) \
            or d["_fast_inference"]:
        return None
    key = _weights_key(ws)
    ent = d.get("_fast")
    if ent is None or ent[0] != key:
        small = sum(t.numel() * t.element_size() for t in ws) <= FAST_WEIGHTS_MAX_BYTES
        with torch.no_grad():
            ent = (key, build() if small else None)
        d["_fast"] = ent
    return ent[1]


MANUAL_ATTENTION_MIN_ROWS = 12  # on a CPU, batches of this many rows attend by matmul + softmax


def _attend(q: Tensor, keys: Tensor, values: Tensor, b: "BatchIndex") -> Tensor:
    """Causal attention of q [B, N, nh, hd] over a slot's keys / values [B, nkv, L, hd] -> [B, N, nh·hd],
    scaled by hd^-0.5, query head h reading kv head h // (nh / nkv) (grouped-query attention).

    SDPA's CPU kernel (flash attention, with the boolean mask) is the fast path for a few rows; from
    ``MANUAL_ATTENTION_MIN_ROWS`` rows on, two batched matmuls and a softmax with the additive mask beat
    it by 15-30% on one thread (tiny model, 80 keys: 94 µs against 110 at 12 rows, 523 against 743 at
    128), and a rollout batch of an RL step is 128 rows. The query heads of one kv head are stacked as
    rows of one matmul, so the keys are never repeated. Equal up to float rounding."""
    B, N, nh, hd = q.shape
    nkv, L = keys.shape[1], keys.shape[2]
    # half precision stays on SDPA, whose CPU kernel keeps the scores and the softmax in float32
    if q.device.type != "cpu" or B < MANUAL_ATTENTION_MIN_ROWS or q.dtype not in (torch.float32, torch.float64):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=b.attn_mask,
                                             enable_gqa=nh != nkv)
        return out.transpose(1, 2).reshape(B, N, nh * hd)
    g = nh // nkv
    qq = q.reshape(B, N, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, nkv, g * N, hd)
    scores = torch.matmul(qq, keys.transpose(-1, -2)).view(B, nkv, g, N, L)
    probs = torch.softmax(scores.mul_(hd ** -0.5).add_(b.additive_mask(scores.dtype)), dim=-1)
    out = torch.matmul(probs.view(B, nkv, g * N, L), values).view(B, nkv, g, N, hd)
    return out.permute(0, 3, 1, 2, 4).reshape(B, N, nh * hd)


class Attention(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.c = c
        h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(h, nh * hd * (2 if c.attn_output_gate else 1), bias=c.qkv_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=c.qkv_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=c.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.no_fused = c.attn_output_gate or c.zero_centered_norm  # layouts ``_fused`` does not cover
        if c.qk_norm:
            self.q_norm = _norm(c, hd)
            self.k_norm = _norm(c, hd)

    def _fused(self) -> Optional[tuple]:
        """(W_qkvᵀ [h, (nh + 2·nkv)·hd], its bias or None, W_oᵀ, the q/k norm weights per head
        [nh + nkv, hd] or None), for ``forward``'s fused path (``_fast_weights``); None where the
        layout does not allow one (an output gate interleaves q_proj's rows; zero-centred norms)."""
        return None if self.no_fused else _fast_weights(self, self._fused_weights, self._build_fused)

    def _fused_weights(self) -> list:
        c, lin = self.c, (self.q_proj, self.k_proj, self.v_proj)
        return ([m.weight for m in lin] + [self.o_proj.weight] + ([m.bias for m in lin] if c.qkv_bias else [])
                + ([self.q_norm.weight, self.k_norm.weight] if c.qk_norm else []))

    def _build_fused(self) -> tuple:
        c, lin = self.c, (self.q_proj, self.k_proj, self.v_proj)
        w_qkv = torch.cat([m.weight for m in lin]).t().contiguous()
        b_qkv = torch.cat([m.bias for m in lin]) if c.qkv_bias else None
        w_qk = (torch.cat([self.q_norm.weight.expand(c.num_attention_heads, -1),
                           self.k_norm.weight.expand(c.num_key_value_heads, -1)]) if c.qk_norm else None)
        return w_qkv, b_qkv, self.o_proj.weight.t().contiguous(), w_qk

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: "LayerCache", batch: "BatchIndex") -> Tensor:
        B, N, _ = x.shape
        c = self.c
        fused = self._fused()
        if fused is not None:  # the same arithmetic in fewer ops: q and k normed and rotated together
            w_qkv, b_qkv, w_o, w_qk = fused
            nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            x2 = x.reshape(B * N, -1)
            qkv = (torch.mm(x2, w_qkv) if b_qkv is None else torch.addmm(b_qkv, x2, w_qkv)).view(B, N, nh + 2 * nkv, hd)
            qk, v = qkv[:, :, : nh + nkv], qkv[:, :, nh + nkv:]
            if w_qk is not None:
                qk = F.rms_norm(qk, (hd,), None, c.rms_norm_eps) * w_qk
            qk = _rope_apply(qk, cos, sin)
            keys, values = cache.write_and_read(qk[:, :, nh:], v, batch)  # [B, nkv, L, hd]
            return torch.mm(_attend(qk[:, :, :nh], keys, values, batch).view(B * N, -1), w_o).view(B, N, -1)
        gate = None
        if c.attn_output_gate:  # per head [q_h; gate_h]
            q, gate = self.q_proj(x).view(B, N, c.num_attention_heads, 2 * c.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, N, -1)
        else:
            q = self.q_proj(x).view(B, N, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(B, N, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).view(B, N, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # partial RoPE (cos narrower than a head): the first rd dims of each head rotate, the rest pass
        q, k = _rope_apply(q, cos, sin), _rope_apply(k, cos, sin)
        keys, values = cache.write_and_read(k, v, batch)  # [B, nkv, L, hd]
        out = _attend(q, keys, values, batch)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


CHUNKED_MIN_TOKENS = 8  # forwards this long (prefill) use the chunked delta rule


def chunked_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor,
                             chunk: int = 64) -> tuple[Tensor, Tensor]:
    """The gated delta rule over chunks (the WY/UT form): equal to the token-by-token recurrence
    S_t = e^{g_t} S_{t-1} + k_t u_tᵀ, u_t = β_t (v_t - e^{g_t} S_{t-1}ᵀ k_t), o_t = S_tᵀ q_t.

    q, k [B, N, H, dk] (q already scaled), v [B, N, H, dv], g (log decay), beta [B, N, H], S [B, H, dk, dv].
    Within a chunk with cumulative log decay Γ: (I + A) U = βV - (β e^Γ K) S_0 with
    A_ij = β_i e^{Γ_i-Γ_j} k_iᵀk_j (j < i); o = e^Γ Q S_0 + (QKᵀ ⊙ e^{Γ_i-Γ_j})_{j≤i} U and
    S_C = e^{Γ_C} S_0 + Σ_j e^{Γ_C-Γ_j} k_j u_jᵀ. A position with g = 0 and β = 0 leaves the
    state as it is (padding). Returns (o [B, N, H, dv], final S)."""
    B, N, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-N) % chunk
    n = (N + pad) // chunk
    q, k, v = (F.pad(t.transpose(1, 2), (0, 0, 0, pad)).reshape(B, H, n, chunk, -1) for t in (q, k, v))
    g, beta = (F.pad(t.transpose(1, 2), (0, pad)).reshape(B, H, n, chunk) for t in (g, beta))
    G = g.cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(upper, float("-inf")).exp()  # e^{Γi-Γj}, j <= i
    T = (beta[..., None] * (k @ k.transpose(-1, -2)) * D).tril(-1)  # unit diagonal implied
    Uv = torch.linalg.solve_triangular(T, beta[..., None] * v, upper=False, unitriangular=True)
    Wk = torch.linalg.solve_triangular(T, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * D
    qd = q * G.exp()[..., None]
    kd = k * (G[..., -1:] - G).exp()[..., None]
    out = torch.empty(B, H, n, chunk, dv, dtype=q.dtype, device=q.device)
    for c in range(n):
        U = Uv[:, :, c] - Wk[:, :, c] @ S
        out[:, :, c] = qd[:, :, c] @ S + attn[:, :, c] @ U
        S = S * G[:, :, c, -1].exp()[..., None, None] + kd[:, :, c].transpose(-1, -2) @ U
    return out.reshape(B, H, n * chunk, dv)[:, :, :N].transpose(1, 2), S


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's ``linear_attn``: in_proj -> causal depthwise conv1d (SiLU) over [q; k; v] -> gated
    delta rule recurrence per value head (decay exp(g), write strength β, L2-normed q/k, q scaled
    by 1/sqrt(d_k)) -> gated RMSNorm (plain gain, * SiLU(z)) -> out_proj.

    The recurrence runs token by token in pure torch (exact, simple; prefill cost is linear in the
    prompt's length with a Python loop), on the slot's conv and recurrent states.

    Qwen3-Next (``gdn_layout`` qwen3_next) projects with two fused matrices instead, ``in_proj_qkvz``
    and ``in_proj_ba``, their rows interleaved per key head; the engine holds them with the rows
    already grouped [q; k; v; z] and [b; a] (``gdn_hf_row_order`` permutes them at load), so that the
    forward splits contiguous slices as for Qwen3.5 and a weight update stays one tensor per name."""

    def __init__(self, c: LMConfig):
        super().__init__()
        self.c = c
        h = c.hidden_size
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = nk * dk, nv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        if c.gdn_layout == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(h, self.conv_dim + self.value_dim, bias=False)  # rows [q; k; v; z]
            self.in_proj_ba = nn.Linear(h, 2 * nv, bias=False)  # rows [b; a]
        else:
            self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, nv, bias=False)
            self.in_proj_a = nn.Linear(h, nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.linear_conv_kernel_dim, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.zeros(nv))
        self.norm = RMSNorm(dv, c.rms_norm_eps)  # plain gain (not zero-centred), applied in float32
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(qkv [B, N, conv_dim], z, b, a [B, N, nv]) from either projection layout."""
        if self.c.gdn_layout == "qwen3_next":
            qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
            b_, a_ = self.in_proj_ba(x).chunk(2, dim=-1)
            return qkv, z, b_, a_
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: Tensor, cache: "LinearStateCache", b: "BatchIndex") -> Tensor:
        c = self.c
        B, N, _ = x.shape
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        K = c.linear_conv_kernel_dim
        fresh = (b.start == 0)  # a row from position 0 starts from zero states (slot reuse)
        qkv, z, b_proj, a_proj = self._project(x)
        # ---- causal conv1d over [conv state; new inputs]
        conv_state = cache.conv[b.slots].masked_fill(fresh[:, None, None], 0)  # [B, C, K-1]
        xs = torch.cat([conv_state, qkv.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # [B, C, K-1+N]
        # depthwise causal conv as K multiply-adds over the windows (F.conv1d with groups=C is slow on CPU)
        w = self.conv1d.weight.to(xs.dtype)[:, 0]  # [C, K]
        mixed = F.silu(torch.einsum("bcnk,ck->bnc", xs.unfold(2, K, 1), w))  # [B, N, C]
        win = b.lengths.clamp(max=N)[:, None, None] + torch.arange(K - 1, device=x.device)[None, None, :]
        cache.conv[b.slots] = xs.gather(2, win.expand(B, self.conv_dim, K - 1))  # last K-1 valid inputs
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        sd = cache.rec.dtype
        q = q.reshape(B, N, nk, dk).to(sd)
        k = k.reshape(B, N, nk, dk).to(sd)
        v = v.reshape(B, N, nv, dv).to(sd)
        if nv != nk:
            q = q.repeat_interleave(nv // nk, dim=2)
            k = k.repeat_interleave(nv // nk, dim=2)
        q = _l2norm(q) / math.sqrt(dk)
        k = _l2norm(k)
        beta = b_proj.sigmoid().to(sd)  # [B, N, nv]
        g = -self.A_log.to(sd).exp() * F.softplus(a_proj.to(sd) + self.dt_bias.to(sd))
        decay = g.exp()
        S = cache.rec[b.slots].masked_fill(fresh[:, None, None, None], 0)  # [B, nv, dk, dv]
        if N >= CHUNKED_MIN_TOKENS and not b.keep_states:  # prefill: chunked form, padding made a no-op
            pad = torch.arange(N, device=x.device)[None, :] >= b.lengths[:, None]  # [B, N]
            out, S = chunked_gated_delta_rule(q, k, v, g.masked_fill(pad[..., None], 0),
                                              beta.masked_fill(pad[..., None], 0), S)
            cache.rec[b.slots] = S
            return self._out(out, z)
        # ---- gated delta rule, token by token; padded positions leave the state as it is
        out = torch.empty(B, N, nv, dv, dtype=sd, device=x.device)
        snaps = cache.snapshot_buffer(N) if b.keep_states else None
        full = bool((b.lengths >= N).all())
        kept = []
        for t in range(N):
            S_new = S * decay[:, t, :, None, None]
            kt = k[:, t, :, None, :]  # [B, nv, 1, dk]
            delta = (v[:, t] - (kt @ S_new).squeeze(-2)) * beta[:, t, :, None]
            S_new = S_new + kt.transpose(-1, -2) * delta[:, :, None, :]
            out[:, t] = (q[:, t, :, None, :] @ S_new).squeeze(-2)
            if full:
                S = S_new
            else:
                S = torch.where((t < b.lengths)[:, None, None, None], S_new, S)
            if snaps is not None:
                kept.append(S)
        if snaps is not None:
            snaps[b.slots, :N] = torch.stack(kept, dim=1)
        cache.rec[b.slots] = S
        if snaps is not None:
            cache.snap_xs_store(b.slots, xs)
        return self._out(out, z)

    def _out(self, out: Tensor, z: Tensor) -> Tensor:
        """Gated RMSNorm (float32, like transformers) and out_proj."""
        B, N, _ = z.shape
        dtype = z.dtype
        z = z.reshape(B, N, self.c.linear_num_value_heads, self.c.linear_value_head_dim)
        o = out.float() if out.dtype != torch.float64 else out
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        o = (self.norm.weight * o.to(dtype)) * F.silu(z.to(o.dtype))
        return self.out_proj(o.to(dtype).reshape(B, N, -1))


class MLP(nn.Module):
    """SwiGLU: the dense MLP, one routed expert, or the shared expert (``size``: its width)."""

    def __init__(self, c: LMConfig, size: Optional[int] = None):
        super().__init__()
        size = c.intermediate_size if size is None else size
        self.gate_proj = nn.Linear(c.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, c.hidden_size, bias=False)

    def _fused_weights(self) -> tuple:
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight

    def _build_fused(self) -> tuple:
        return (torch.cat([self.gate_proj.weight, self.up_proj.weight]).t().contiguous(),
                self.down_proj.weight.t().contiguous())

    def forward(self, x: Tensor) -> Tensor:
        fused = _fast_weights(self, self._fused_weights, self._build_fused)
        if fused is not None:  # one matmul for gate and up, weights as [in, out] (``_fast_weights``)
            w_gu, w_d = fused
            g, u = torch.mm(x.reshape(-1, x.shape[-1]), w_gu).chunk(2, dim=-1)
            return torch.mm(F.silu(g) * u, w_d).view(*x.shape[:-1], -1)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Qwen3.5-MoE / Qwen3-Next MLP: a softmax router (float32) picks the top-k experts per token
    (probabilities renormalised over the k when ``norm_topk_prob``), each a SwiGLU MLP; their
    weighted sum plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

    Experts are per-expert modules named as HF checkpoints and our export store them
    (``mlp.experts.E.{gate,up,down}_proj``), so loading and weight updates stay one tensor per name.
    A forward gathers each hit expert's tokens (assignments sorted by expert), runs the expert once
    on them and scatters the weighted rows back: one matmul chain per hit expert, no per-token loop."""

    def __init__(self, c: LMConfig):
        super().__init__()
        self.top_k, self.norm_topk = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList([MLP(c, c.moe_intermediate_size) for _ in range(c.num_experts)])
        self.shared_expert = MLP(c, c.shared_expert_intermediate_size) if c.shared_expert_intermediate_size else None
        if self.shared_expert is not None:
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weight, expert = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        weight = weight.to(x.dtype)
        flat = expert.reshape(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert, ascending
        tokens = order // self.top_k
        w_sorted = weight.reshape(-1)[order, None]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start: start + n]
                out.index_add_(0, rows, self.experts[e](x.index_select(0, rows)) * w_sorted[start: start + n])
                start += n
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, c: LMConfig, kind: str = "full_attention", moe: bool = False, mlp_size: Optional[int] = None):
        super().__init__()
        self.kind = kind
        self.input_layernorm = _norm(c, c.hidden_size)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = Attention(c)
        self.post_attention_layernorm = _norm(c, c.hidden_size)
        self.mlp = SparseMoE(c) if moe else MLP(c, mlp_size)

    def forward(self, x, cos, sin, cache, batch):
        if self.kind == "linear_attention":
            x = x + self.linear_attn(self.input_layernorm(x), cache, batch)
        else:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


MTP_FOLD_MAX_BYTES = 64 << 20  # fold an MTP module's embedding half into a table up to this size


class MTPModule(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.enorm = _norm(c, c.hidden_size)
        self.hnorm = _norm(c, c.hidden_size)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        # full attention; MoE in an MoE model (as Qwen3.5-MoE / Qwen3-Next ship mtp.layers.0)
        self.layers = nn.ModuleList([DecoderLayer(c, moe=c.num_experts > 0, mlp_size=c.mtp_intermediate_size or None)
                                     for _ in range(c.mtp_layers_per_module)])
        self.final_norm = _norm(c, c.hidden_size)


# --------------------------------------------------------------------------- caches


@dataclass
class BatchIndex:
    """Where a padded batch of rows reads and writes: slot, first position, valid tokens per row.

    Padded positions (past a row's length) are written too: they lie past every valid entry of
    that row's stream and are overwritten before they are ever read as context."""

    slots: Tensor  # [B]
    start: Tensor  # [B]
    lengths: Tensor  # [B] new tokens per row (<= N)
    positions: Tensor  # [B, N]
    attn_mask: Tensor  # [B, 1, N, L] bool, True = attend
    span: int  # L: keys read per row
    slot_range: Optional[tuple[int, int]] = None  # (first, count) when slots are consecutive: caches read as views
    keep_states: bool = False  # linear-attention layers keep their state after every position (rollback)
    host_max_position: Optional[int] = None  # the largest position, when the host knows it
    single_start: Optional[int] = None  # one row, built on the host: its first position (RoPE rows are a slice)
    _writes: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # cache length -> (slots, positions) to write at
    _additive: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # dtype -> additive mask

    def additive_mask(self, dtype) -> Tensor:
        """``attn_mask`` as [B, 1, 1, N, L] scores to add (0 / -inf), built once per forward for
        ``_attend``'s matmul path (every layer of the forward reads it)."""
        m = self._additive.get(dtype)
        if m is None:
            m = self._additive[dtype] = torch.zeros(self.attn_mask.shape, dtype=dtype, device=self.attn_mask.device
                                                    ).masked_fill_(~self.attn_mask, float("-inf")).unsqueeze(1)
        return m

    def write_index(self, max_len: int) -> tuple[Tensor, Tensor]:
        """(slots [B, N], positions [B, N] clamped to the cache): where every layer of a forward
        writes its new keys and values, worked out once per forward, not once per layer."""
        w = self._writes.get(max_len)
        if w is None:
            fits = self.host_max_position is not None and self.host_max_position < max_len
            pos = self.positions if fits else self.positions.clamp(max=max_len - 1)
            w = self._writes[max_len] = (self.slots[:, None].expand_as(pos), pos)
        return w


_ARANGE: dict = {}  # device -> arange(n): positions and keys are slices of it


def _arange(n: int, device) -> Tensor:
    key = str(device) if device is not None else "cpu"
    a = _ARANGE.get(key)
    if a is None or a.shape[0] < n:
        a = _ARANGE[key] = torch.arange(max(n, 8192, 2 * (a.shape[0] if a is not None else 0)), device=device)
    return a[:n]


def make_batch_index(slots, starts, lengths, device=None, N: Optional[int] = None) -> BatchIndex:
    """Lists or tensors (on the model's device) of slots, first positions and new tokens per row.

    Host lists are the fast path (the engine's): span, N, the slot range and the positions are
    worked out on the host and go to the device as one tensor."""
    host_max = None
    if not any(isinstance(t, Tensor) for t in (slots, starts, lengths)):
        slot_list, start_l, len_l = [int(x) for x in slots], [int(x) for x in starts], [int(x) for x in lengths]
        B = len(slot_list)
        N = max(len_l) if N is None else N
        span = max(s + n for s, n in zip(start_l, len_l))
        flat = slot_list + start_l + len_l
        for s in start_l:
            flat.extend(range(s, s + N))
        meta = torch.tensor(flat, dtype=torch.long, device=device)
        slots, start, lens = meta[:B], meta[B: 2 * B], meta[2 * B: 3 * B]
        positions = meta[3 * B:].view(B, N)
        host_max = max(start_l) + N - 1
    else:
        if device is None:
            device = next((t.device for t in (slots, starts, lengths) if isinstance(t, Tensor)), None)
        if not isinstance(slots, Tensor):
            slot_list = [int(x) for x in slots]
            slots = torch.tensor(slot_list, dtype=torch.long, device=device)
        else:
            slot_list = None
            device = slots.device
        start = starts if isinstance(starts, Tensor) else torch.tensor(starts, dtype=torch.long, device=device)
        lens = lengths if isinstance(lengths, Tensor) else torch.tensor(lengths, dtype=torch.long, device=device)
        if N is None:
            N = int(lens.max())
        span = int((start + lens).max())
        positions = start[:, None] + _arange(N, device)[None, :]
    single = host_max is not None and B == 1
    if single and N <= _CAUSAL_ROWS and span <= start_l[0] + N:
        mask = _causal_window(start_l[0], N, span, device)  # a view: nothing computed
    else:
        mask = (_arange(span, device)[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # causal within the slot
    rng = None
    if slot_list is not None and slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list))):
        rng = (slot_list[0], len(slot_list))
    return BatchIndex(slots, start, lens, positions, mask, span, rng, host_max_position=host_max,
                      single_start=start_l[0] if single else None)


_CAUSAL_ROWS = 64  # one row's forwards of at most this many positions read their mask from a table
_CAUSAL: dict = {}  # device -> (C, table [rows, C + rows]) with table[i, j] = j <= i + C


def _causal_window(start: int, n: int, span: int, device) -> Tensor:
    """[1, 1, n, span] mask of positions start..start+n-1 over keys 0..span-1 (key j <= position),
    as a view of a cached table: row i of the table shifted by C - start columns is
    j <= start + i. Decoding one row builds this mask every forward (4 per speculative round)."""
    key = str(device) if device is not None else "cpu"
    ent = _CAUSAL.get(key)
    if ent is None or ent[0] < start:
        C = max(4096, 2 * start, 2 * ent[0] if ent is not None else 0)
        rows, cols = _arange(_CAUSAL_ROWS, device), _arange(C + _CAUSAL_ROWS, device)
        ent = _CAUSAL[key] = (C, cols[None, :] <= rows[:, None] + C)
    C, tab = ent
    return tab[:n, C - start: C - start + span][None, None]


class LayerCache:
    def __init__(self, slots: int, max_len: int, kv_heads: int, head_dim: int, dtype, device):
        self.k = torch.zeros(slots, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write_and_read(self, k: Tensor, v: Tensor, b: BatchIndex) -> tuple[Tensor, Tensor]:
        """Write every row's N new entries (padding included, clamped to the cache), read the
        first ``span`` keys of each row's slot: a view when the slots are consecutive."""
        sl, pos = b.write_index(self.k.shape[2])
        # k: [B, N, kv, hd] -> cache[slot, :, pos] takes [B, N, kv, hd] with advanced indices first
        self.k.permute(0, 2, 1, 3).index_put_((sl, pos), k.to(self.k.dtype))
        self.v.permute(0, 2, 1, 3).index_put_((sl, pos), v.to(self.v.dtype))
        if b.slot_range is not None:
            s0, n = b.slot_range
            return self.k[s0: s0 + n, :, : b.span], self.v[s0: s0 + n, :, : b.span]
        return self.k[b.slots, :, : b.span], self.v[b.slots, :, : b.span]


class LinearStateCache:
    """A Gated DeltaNet layer's per-slot states: conv [slots, C, K-1] (the last K-1 conv inputs)
    and recurrent [slots, v_heads, k_dim, v_dim], after the slot's last processed token.

    With ``BatchIndex.keep_states`` a forward also keeps, per slot, the recurrent state after each
    fed position and the conv input window of that forward; ``rollback`` restores the ones after
    a given position (exact: no recomputation)."""

    def __init__(self, slots: int, c: LMConfig, dtype, device):
        C = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        K = c.linear_conv_kernel_dim
        sd = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        self.conv = torch.zeros(slots, C, K - 1, dtype=sd, device=device)
        self.rec = torch.zeros(slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                               dtype=sd, device=device)
        self.K = K
        self.snap_rec: Optional[Tensor] = None  # [slots, n, v_heads, k_dim, v_dim]
        self.snap_xs: Optional[Tensor] = None  # [slots, C, K-1+n]
        self.snap_n = torch.zeros(slots, dtype=torch.long, device=device)  # positions fed in the kept forward

    def snapshot_buffer(self, n: int) -> Tensor:
        if self.snap_rec is None or self.snap_rec.shape[1] < n:
            S = self.rec.shape[0]
            self.snap_rec = torch.zeros(S, n, *self.rec.shape[1:], dtype=self.rec.dtype, device=self.rec.device)
            self.snap_xs = torch.zeros(S, self.conv.shape[1], self.K - 1 + n, dtype=self.conv.dtype,
                                       device=self.conv.device)
        return self.snap_rec

    def snap_xs_store(self, slots: Tensor, xs: Tensor) -> None:
        self.snap_xs[slots, :, : xs.shape[2]] = xs

    def rollback(self, slots: Tensor, idx: Tensor) -> None:
        """Live state of each slot := the one after position ``idx`` of its last kept forward."""
        self.rec[slots] = self.snap_rec[slots, idx]
        win = (idx + 1)[:, None, None] + torch.arange(self.K - 1, device=idx.device)[None, None, :]
        xs = self.snap_xs[slots]
        self.conv[slots] = xs.gather(2, win.expand(xs.shape[0], xs.shape[1], self.K - 1))


class KVCache:
    """One cache per layer of a stream (the trunk, or one MTP depth): a LayerCache (KV) for an
    attention layer, a LinearStateCache for a Gated DeltaNet layer."""

    def __init__(self, num_layers: int, slots: int, max_len: int, c: LMConfig, dtype, device,
                 kinds: Optional[list] = None):
        kinds = kinds or ["full_attention"] * num_layers
        self.layers = [LinearStateCache(slots, c, dtype, device) if kind == "linear_attention"
                       else LayerCache(slots, max_len, c.num_key_value_heads, c.head_dim, dtype, device)
                       for kind in kinds]
        self.linear = [lc for lc in self.layers if isinstance(lc, LinearStateCache)]
        self.max_len = max_len

    def rollback(self, slots: Tensor, idx: Tensor) -> None:
        """After a forward with ``keep_states``: each slot's linear-attention state := the one after
        its position ``idx`` (KV entries need nothing: later writes overwrite them)."""
        for lc in self.linear:
            lc.rollback(slots, idx)


# ---------------------------------------------------------------------------- model


class CausalLMWithMTP(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c, c.layer_kind(i), c.moe_layer(i))
                                     for i in range(c.num_hidden_layers)])
        self.norm = _norm(c, c.hidden_size)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.mtp = nn.ModuleList([MTPModule(c) for _ in range(c.num_mtp_modules)])
        self._mtp_folds: dict = {}  # module -> (weights' key, folded embedding-half table, W_hᵀ)
        rd = c.rotary_dim  # partial RoPE: the first rd dims of each head
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self._rope_tables: dict = {}  # (dtype, device) -> (cos, signed sin) [positions, hd]

    @property
    def has_mtp(self) -> bool:
        return len(self.mtp) > 0

    def _rope(self, positions: Tensor, dtype, need: Optional[int] = None,
              start: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """cos / signed sin [B, N, 1, hd] (``_rope_apply``) from a table precomputed (in float64, then cast) per dtype/device;
        ``need`` (table rows, e.g. a BatchIndex's padded span) saves reading max(positions); one row
        whose first position ``start`` the host knows (positions start..start+N-1) reads a slice."""
        if need is None:
            need = int(positions.max()) + 1 if positions.numel() else 1
        key = (dtype, positions.device)
        tab = self._rope_tables.get(key)
        if tab is None or tab[0].shape[0] < need:
            n = max(need, 4096, 2 * (tab[0].shape[0] if tab is not None else 0))
            pos = torch.arange(n, dtype=torch.float64, device=positions.device)
            freqs = pos[:, None] * self.inv_freq.to(positions.device).double()
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = freqs.sin()
            tab = (emb.cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype))  # sin signed for _rope_apply
            self._rope_tables[key] = tab
        if start is not None:
            n = positions.shape[1]
            return tab[0][start: start + n][None, :, None, :], tab[1][start: start + n][None, :, None, :]
        return tab[0][positions][:, :, None, :], tab[1][positions][:, :, None, :]

    def _rope_for(self, b: BatchIndex, dtype) -> tuple[Tensor, Tensor]:
        return self._rope(b.positions, dtype, b.span + b.positions.shape[1], b.single_start)

    def _head_weights(self) -> tuple:
        return (self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight,)

    def logits(self, hidden: Tensor) -> Tensor:
        w = self._head_weights()[0]
        fused = _fast_weights(self, self._head_weights, lambda: (w.t().contiguous(),))  # a small vocabulary's head as [h, V]
        if fused is not None:
            return torch.mm(hidden.reshape(-1, hidden.shape[-1]), fused[0]).view(*hidden.shape[:-1], -1)
        return F.linear(hidden, w)

    def new_cache(self, slots: int, max_len: int, stream: str) -> KVCache:
        dtype = self.embed_tokens.weight.dtype
        device = self.embed_tokens.weight.device
        c = self.config
        if stream == "trunk":
            kinds = [c.layer_kind(i) for i in range(c.num_hidden_layers)]
        else:
            kinds = ["full_attention"] * c.mtp_layers_per_module
        return KVCache(len(kinds), slots, max_len, c, dtype, device, kinds)

    @torch.no_grad()
    def trunk(self, ids: Tensor, cache: KVCache, b: BatchIndex) -> tuple[Tensor, Tensor]:
        """Returns (normed hidden, hidden fed to MTP) [B, N, h]."""
        x = self.embed_tokens(ids)
        cos, sin = self._rope_for(b, x.dtype)
        for layer, lc in zip(self.layers, cache.layers):
            x = layer(x, cos, sin, lc, b)
        normed = self.norm(x)
        return normed, (normed if self.config.mtp_hidden == "normed" else x)

    @torch.no_grad()
    def mtp_step(self, depth: int, hidden: Tensor, ids: Tensor, cache: KVCache, b: BatchIndex) -> Tensor:
        """MTP depth ``depth`` (0-based): previous-depth hidden + embedding of the token k ahead."""
        i = depth % len(self.mtp)
        m = self.mtp[i]
        x = self.mtp_input(i, hidden, ids)
        cos, sin = self._rope_for(b, x.dtype)
        for layer, lc in zip(m.layers, cache.layers):
            x = layer(x, cos, sin, lc, b)
        return m.final_norm(x)

    def mtp_input(self, i: int, hidden: Tensor, ids: Tensor) -> Tensor:
        """MTP module ``i``'s input eh_proj([enorm(emb(ids)), hnorm(hidden)]) [B, N, h].

        The embedding half depends on the token only. Where its table enorm(E)·W_eᵀ [V, h] is small
        (at most ``MTP_FOLD_MAX_BYTES``: small vocabularies, as the CPU models'), it is computed once
        per weight version and the input is one gather plus one addmm with W_h, instead of an
        embedding, a norm, a concat and a 2h-wide projection: a draft step runs at per-op cost on
        a CPU, and a speculative round runs γ of them. A real vocabulary's table (V·h, as large as
        the embedding) is not built: the unfolded path runs there, as it does with autograd on (the table is
        detached) and for inference-mode weights (no version counter). Equal up to float rounding. Weight
        updates must be in place (``copy_``, as ``load_hf_state_dict`` does): writes through ``.data`` do not
        bump the version the table is keyed on."""
        m = self.mtp[i]
        fold = self._mtp_fold(i, m)
        if fold is None:
            e = m.enorm(self.embed_tokens(ids))
            return m.eh_proj(torch.cat([e, m.hnorm(hidden)], dim=-1))
        table, w_h = fold
        h = table.shape[1]
        x = F.embedding(ids, table)
        return torch.addmm(x.view(-1, h), m.hnorm(hidden).reshape(-1, h), w_h).view(x.shape)

    def _mtp_fold(self, i: int, m: "MTPModule") -> Optional[tuple[Tensor, Tensor]]:
        """(enorm(E)·W_eᵀ [V, h], W_hᵀ [h, h]) for module i, rebuilt when a weight it reads
        changes (an in-place update bumps the parameter's version; a move changes its storage);
        None when the table would exceed ``MTP_FOLD_MAX_BYTES``."""
        if torch.is_grad_enabled():
            return None
        E, w, we = self.embed_tokens.weight, m.eh_proj.weight, m.enorm.weight
        if E.numel() * E.element_size() > MTP_FOLD_MAX_BYTES or E.is_inference() or w.is_inference() or we.is_inference():
            return None
        key = _weights_key((E, w, we))
        ent = self._mtp_folds.get(i)
        if ent is None or ent[0] != key:
            h = E.shape[1]
            with torch.no_grad():
                table = F.linear(m.enorm(E.detach()), w.detach()[:, :h]).contiguous()
                w_h = w.detach()[:, h:].t().contiguous()
            ent = self._mtp_folds[i] = (key, (table, w_h))
        return ent[1]

    # ------------------------------------------------------------------ weights
    def hf_state_dict_names(self) -> dict[str, str]:
        """Our parameter name -> Hugging Face tensor name."""
        c = self.config
        out = {}
        for name, _ in self.named_parameters():
            out[name] = _to_hf_name(name, c)
        return out

    def validate_hf_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Raise ValueError (naming the tensor) if ``tensors`` could not be loaded; loads nothing."""
        tensors = canonical_hf_names(tensors)
        by_hf = {v: k for k, v in self.hf_state_dict_names().items()}
        params = dict(self.named_parameters())
        for n, t in tensors.items():
            if n not in by_hf:
                if not _ignorable(n):
                    raise ValueError(f"unexpected tensor for this model: {n}")
                continue
            p = params[by_hf[n]]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"tensor {n}: shape {tuple(t.shape)} != expected {tuple(p.shape)}")
            if not (t.is_floating_point() and bool(torch.isfinite(t).all())):
                raise ValueError(f"tensor {n}: not a finite floating-point tensor")

    def load_hf_state_dict(self, tensors: dict[str, Tensor], strict: bool = True) -> list[str]:
        """Load HF-named tensors (a subset is fine with strict=False: weight updates).

        Returns the names that were loaded. Raises ValueError naming the tensor on a shape
        mismatch, an unknown name, or (strict) a missing one.
        """
        tensors = canonical_hf_names(tensors)
        self.validate_hf_tensors(tensors)  # names, shapes, finite values: all checked before any copy
        by_hf = {v: k for k, v in self.hf_state_dict_names().items()}
        params = dict(self.named_parameters())
        todo = [(n, t) for n, t in tensors.items() if n in by_hf]
        if strict:
            missing = sorted(set(by_hf) - {n for n, _ in todo})
            if missing:
                raise ValueError(f"missing tensor(s): {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for hf_name, t in todo:
                order = gdn_hf_row_order(hf_name, self.config)
                if order is not None:
                    t = t.index_select(0, order.to(t.device))
                params[by_hf[hf_name]].copy_(t.to(params[by_hf[hf_name]].dtype))
        return [n for n, _ in todo]

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype=torch.float32, device="cpu") -> "CausalLMWithMTP":
        from safetensors.torch import load_file

        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{path}: no config.json")
        hf_cfg = json.loads(cfg_file.read_text())
        model = cls(LMConfig.from_hf(hf_cfg)).to(dtype=dtype, device=device)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors weights")
        tensors: dict[str, Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        model.load_hf_state_dict(tensors, strict=True)
        model.eval()
        return model


def canonical_hf_names(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Qwen3.5 ``ForConditionalGeneration`` checkpoints prefix the text model with
    ``model.language_model.`` and carry a vision tower: map to the text model's names, drop the tower.
    Experts stored fused (transformers' in-memory ``mlp.experts.gate_up_proj`` [E, 2I, H] = per expert
    [gate; up], ``mlp.experts.down_proj`` [E, H, I]) become the per-expert tensors the engine holds."""
    pre = "model.language_model."
    if any(k.startswith(pre) for k in tensors):
        tensors = {("model." + k[len(pre):] if k.startswith(pre) else k): v for k, v in tensors.items()
                   if not k.startswith(("model.visual.", "model.vision"))}
    if not any(k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for k in tensors):
        return tensors
    out = {}
    for k, v in tensors.items():
        if k.endswith(".mlp.experts.gate_up_proj") and v.dim() == 3:
            base = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = v[e].chunk(2, dim=0)
        elif k.endswith(".mlp.experts.down_proj") and v.dim() == 3:
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def gdn_hf_row_order(hf_name: str, c: LMConfig) -> Optional[Tensor]:
    """For Qwen3-Next's ``linear_attn.in_proj_qkvz`` (rows per key head h: [q_h, k_h, v_h.., z_h..]) and
    ``in_proj_ba`` ([b_h.., a_h..] per key head): the HF rows in the engine's order [q; k; v; z] /
    [b; a] (``ours = hf[order]``), else None. The value heads of key head h are h*r .. h*r + r - 1."""
    if c.gdn_layout != "qwen3_next" or not hf_name.endswith(("linear_attn.in_proj_qkvz.weight",
                                                             "linear_attn.in_proj_ba.weight")):
        return None
    nk, r, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads, \
        c.linear_key_head_dim, c.linear_value_head_dim
    sizes = [dk, dk, r * dv, r * dv] if "qkvz" in hf_name else [r, r]
    rows = torch.arange(nk * sum(sizes)).view(nk, sum(sizes))
    return torch.cat([part.reshape(-1) for part in rows.split(sizes, dim=1)])


def _ignorable(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq") or name.endswith("shared_head.head.weight")


def _to_hf_name(name: str, c: LMConfig) -> str:
    if name == "embed_tokens.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return "lm_head.weight"
    if name.startswith("layers."):
        return "model." + name
    if name.startswith("mtp."):
        _, k, rest = name.split(".", 2)
        k = int(k)
        if c.mtp_layout == "deepseek":
            base = f"model.layers.{c.num_hidden_layers + k}."
            if rest.startswith("layers."):
                return base + rest.split(".", 2)[2]  # layers.0.<x> -> <x>
            return base + {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                           "eh_proj.weight": "eh_proj.weight", "final_norm.weight": "shared_head.norm.weight"}[rest]
        base = "mtp."
        if rest.startswith("layers."):
            return base + rest
        return base + {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
                       "eh_proj.weight": "fc.weight", "final_norm.weight": "norm.weight"}[rest]
    raise KeyError(name)
