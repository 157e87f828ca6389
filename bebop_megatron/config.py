"""Run configuration: dataclasses loaded from YAML, overridable from the command line.

One YAML file maps onto :class:`Config` section by section (``model``, ``parallel``, ``mtp``,
``data``, ``train``, ``rl``). Overrides use dotted keys, e.g. ``--set model.mtp_num_layers=3``; values
are parsed as YAML scalars. :meth:`Config.validate` checks the arithmetic Megatron would
otherwise fail on deep inside a run (head/vocab/layer divisibility by TP/PP, batch sizes).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending field."""


MTP_LOSSES = ("ce", "kl", "tv", "e2e_tv")
FP8_FORMATS = (None, "hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")
ARCHS = ("qwen2", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next")
MOE_ARCHS = ("qwen3_5_moe", "qwen3_next")  # routed experts + a sigmoid-gated shared expert
HYBRID_ARCHS = ("qwen3_5",) + MOE_ARCHS  # Gated DeltaNet + gated full attention (Qwen3.5 / Qwen3-Next family)
DTYPES = ("float32", "bfloat16", "float16")


class MTPStrategy(str, enum.Enum):
    """What RL does with the MTP (draft) heads: the value of ``rl.mtp_strategy``.

    A ``str`` enum: members compare equal to their YAML/CLI spelling (``MTPStrategy.OCC == "occ"``),
    so configs, ``--set rl.mtp_strategy=occ`` and saved JSON keep their plain strings; code asks
    the member's properties instead of comparing names.
    """

    def __new__(cls, value: str, doc: str):
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.__doc__ = doc
        return obj

    FROZEN = ("frozen", "The Bebop recipe: the heads are trained before RL (`bebop train-mtp`) and stay frozen; "
                        "rollouts speculate with them.")
    ONLINE = ("online", "Each RL step also trains the heads with the pre-RL MTP objective (rl.online_mtp_loss) on "
                        "the rollout tokens, on the detached trunk.")
    GROWMTP = ("growmtp", "A detached draft head trained from the verifier's records (top-k target distribution "
                          "at each verify step, gated at the first rejection); needs rl.speculative.")
    OCC = ("occ", "Optimal Coefficient Calibration: a joint MTP policy loss with an online-calibrated coefficient; "
                  "the trunk is not detached, so the policy gradient and the MTP loss both move it.")
    NONE = ("none", "No MTP anywhere: plain GRPO without speculative rollouts (the baseline).")

    def __str__(self) -> str:  # the config spelling, in messages and f-strings
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value) -> "MTPStrategy":
        """``value`` (a member or its spelling) as a member; a clear ConfigError otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"rl.mtp_strategy must be one of {MTP_STRATEGIES}, got {value!r}") from None

    @property
    def trains_mtp(self) -> bool:
        """The MTP heads get gradients (and are in the optimizer's trainable set) during RL."""
        return self in (MTPStrategy.ONLINE, MTPStrategy.GROWMTP, MTPStrategy.OCC)

    @property
    def detaches_trunk(self) -> bool:
        """The MTP layers read the trunk's hidden states detached (MTP losses do not move the trunk)."""
        return self is not MTPStrategy.OCC

    @property
    def speculates(self) -> bool:
        """Rollouts may use MTP speculative decoding (when rl.speculative)."""
        return self is not MTPStrategy.NONE

    @property
    def needs_speculation(self) -> bool:
        """The strategy learns from speculative verification: rl.speculative must be true."""
        return self is MTPStrategy.GROWMTP

    @property
    def records_topk(self) -> bool:
        """Rollout servers return the verifier's top-k records (rl.growmtp_topk) with each sample."""
        return self is MTPStrategy.GROWMTP


MTP_STRATEGIES = tuple(s.value for s in MTPStrategy)
REWARDS = ("synthetic", "synthetic_partial", "math", "code")


@dataclass
class ModelConfig:
    """Qwen2/Qwen3-style dense decoder, or a Qwen3.5-style hybrid (Gated DeltaNet + gated full
    attention), with γ MTP layers (or ONE MTP layer applied γ times: ``mtp_recurrent``)."""

    arch: str = "qwen3"  # qwen2 (QKV bias) | qwen3 (QK-norm) | qwen3_5 (hybrid GDN/gated attention)
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 192
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: Optional[int] = None  # head_dim; default hidden_size // heads
    vocab_size: int = 64  # true vocabulary (tokenizer) size
    make_vocab_size_divisible_by: int = 64
    padded_vocab: Optional[int] = None  # fixed padded size (converted checkpoints keep it at any TP)
    max_position_embeddings: int = 512
    rotary_base: float = 1_000_000.0
    norm_epsilon: float = 1e-6
    qk_layernorm: Optional[bool] = None  # default: arch == qwen3
    add_qkv_bias: Optional[bool] = None  # default: arch == qwen2
    tie_word_embeddings: bool = False
    mtp_num_layers: int = 2  # γ
    init_method_std: float = 0.02
    params_dtype: str = "float32"
    transformer_impl: str = "auto"  # auto: Transformer Engine when importable
    fp8: Optional[str] = None  # hybrid | e4m3 (needs Transformer Engine)
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_mtp: bool = False  # False: MTP layers run in bf16 outside FP8 (acceptance is sensitive to them)
    # One MTP layer applied γ = mtp_num_layers times, each step fed the previous step's hidden and
    # the next ground-truth token (Qwen3-Next / Qwen3.5 / GLM; megatron-core 0.17 mtp_use_repeated_layer)
    mtp_recurrent: bool = False
    # Width of the MTP layers' dense MLP (None: ffn_hidden_size, as every Qwen/DeepSeek MTP layer ships).
    # A narrower draft layer is cheaper to run and has less capacity: the setting where how the
    # objective spends that capacity matters most (issue #11's "smaller heads"). Exported to HF as
    # ``bebop_mtp_intermediate_size``, which `bebop serve` reads; SGLang builds its MTP layer at
    # intermediate_size and cannot load such heads.
    mtp_ffn_hidden_size: Optional[int] = None
    # ---- Qwen3.5-style hybrid (arch qwen3_5): Gated DeltaNet layers + gated full attention,
    # zero-centred RMSNorm ((1+w)·x̂), partial RoPE. layer_types wins over full_attention_interval.
    layer_types: Optional[list] = None  # per layer "linear_attention" | "full_attention"
    full_attention_interval: int = 4  # every N-th layer is full attention (layers N-1, 2N-1, ...)
    partial_rotary_factor: Optional[float] = None  # default 0.25 for qwen3_5, else 1.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # ---- MoE (arch qwen3_5_moe / qwen3_next): megatron-core MoELayer, softmax router, top-k,
    # a shared expert scaled by sigmoid(x·g) (HF's shared_expert_gate). The MTP layer is MoE too.
    num_moe_experts: Optional[int] = None  # HF num_experts
    moe_router_topk: int = 2  # HF num_experts_per_tok
    moe_ffn_hidden_size: Optional[int] = None  # HF moe_intermediate_size (per expert)
    moe_shared_expert_intermediate_size: Optional[int] = None  # HF shared_expert_intermediate_size
    moe_norm_topk_prob: bool = True  # renormalise the top-k probabilities (always on in Qwen3.5-MoE)
    moe_layer_freq: int = 1  # HF decoder_sparse_step: layer i is MoE when (i+1) % freq == 0 ...
    mlp_only_layers: Optional[list] = None  # ... and i is not listed here (dense MLP, ffn_hidden_size)
    moe_aux_loss_coeff: float = 0.0  # load-balancing aux loss (HF router_aux_loss_coef); 0: none
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather (both run on CPU with EP=1)
    moe_grouped_gemm: bool = True  # Transformer Engine grouped GEMM experts (GPU); local spec: sequential

    @property
    def hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHS

    @property
    def moe(self) -> bool:
        return self.arch in MOE_ARCHS

    def moe_layer_pattern(self) -> list:
        """Per decoder layer: True where the MLP is MoE (HF Qwen3-Next's rule)."""
        skip = set(self.mlp_only_layers or ())
        freq = max(int(self.moe_layer_freq), 1)
        return [self.moe and i not in skip and (i + 1) % freq == 0 for i in range(self.num_layers)]

    def resolved_layer_types(self) -> list:
        """Per-layer token mixer of a hybrid model (HF's ``layer_types``)."""
        if self.layer_types:
            return list(self.layer_types)
        n = max(int(self.full_attention_interval), 1)
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_layers)]

    def __post_init__(self) -> None:
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = 0.25 if self.arch in HYBRID_ARCHS else 1.0
        if self.qk_layernorm is None:
            self.qk_layernorm = self.arch in ("qwen3",) + HYBRID_ARCHS
        if self.add_qkv_bias is None:
            self.add_qkv_bias = self.arch == "qwen2"
        if self.kv_channels is None and self.num_attention_heads > 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``
        (unless ``padded_vocab`` fixes it, e.g. for a checkpoint resharded to another TP)."""
        if self.padded_vocab:
            return self.padded_vocab
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1  # EP (MoE archs): experts split over this many DP ranks
    micro_batch_size: int = 4
    global_batch_size: int = 8
    force_cpu: bool = False


@dataclass
class MTPConfig:
    loss: str = "e2e_tv"  # ce | kl | tv | e2e_tv
    detach_trunk: bool = True  # no MTP gradient into trunk, embedding or output layer
    loss_scaling_factor: float = 1.0
    kl_warmup_steps: int = 0  # mix in forward KL, weight 1 -> 0 over these steps (TV/e2e_tv only)
    # Two-stage recipe: the first ``warmup_steps`` MTP steps train with ``warmup_loss`` (e.g. kl),
    # the rest with ``loss``. TV's gradient q(m - Σqm) vanishes where a fresh head puts no mass and
    # e2e-TV weights depth k by Π_{i<k} α_i, so e2e-TV from scratch starves its later depths; a
    # KL/CE start gives it heads with mass on the target's support (issue #11's measurements).
    warmup_loss: Optional[str] = None  # ce | kl | tv; None: no warm-up stage
    warmup_steps: int = 0
    # Share of the MTP phase's tokens that are the frozen trunk's own answers to the RL training
    # prompts, sampled as the RL job samples them (training/rollout_data.py); the rest is ``data``.
    # Heads trained on SFT answers alone never see the policy's own mistakes, after which RL rollouts
    # draft (0.5 on the default: +0.28 E[accepted] on the RL answers, the SFT mixture unchanged)
    rollout_share: float = 0.0

    def loss_at(self, step: int) -> str:
        """The objective for 0-based MTP step ``step`` (a pure function of the step: resumable)."""
        return self.warmup_loss if self.warmup_loss and step < self.warmup_steps else self.loss


@dataclass
class DataConfig:
    path: Optional[str] = None  # JSONL with "input_ids" or "text"; None: synthetic
    tokenizer: str = "char"  # "char" (built-in) or a local Hugging Face tokenizer folder
    text_key: str = "text"
    seq_length: int = 64
    synthetic_samples: int = 4096
    synthetic_task: str = "mixed"  # mixed | arithmetic | sorting | counting


@dataclass
class TrainConfig:
    seed: int = 1234
    steps: int = 100
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    trunk_warmup_steps: int = 0  # CE steps on the trunk before MTP training (random-init models)
    trunk_lr: float = 3e-3
    log_interval: int = 10
    save_interval: int = 0  # 0: only at the end
    exit_interval: int = 0  # stop (checkpointed) after this many steps in one invocation, like Megatron-LM
    output_dir: str = "outputs/train_mtp"
    load: Optional[str] = None  # checkpoint folder to start from (model only unless resuming)
    resume: bool = True  # continue from output_dir/checkpoints/latest if present
    progress: bool = True


@dataclass
class RLConfig:
    """``bebop rl``: asynchronous GRPO with speculative rollouts (see bebop_megatron/rl/trainer.py)."""

    init: Optional[str] = None  # train-mtp output dir (or a checkpoint folder) to start the policy from
    output_dir: str = "outputs/rl"
    steps: int = 20
    lr: float = 1e-5
    warmup_steps: int = 0
    # ---- rollouts
    prompts_per_step: int = 8
    group_size: int = 8  # samples per prompt (GRPO group)
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list = field(default_factory=list)  # stop strings (besides EOS)
    reward: str = "synthetic"  # synthetic (exact) | synthetic_partial (dense) | math | code
    prompts_path: Optional[str] = None  # JSONL {"prompt", "answer"} (math/synthetic) or {"prompt", "tests"} (code)
    task: str = "mixed"  # synthetic task family when prompts_path is None
    eval_prompts: int = 64  # held-out prompts scored before and after RL
    # ---- async loop
    mode: str = "async"  # async (rollouts overlap training) | sync
    max_staleness: int = 1  # async: a batch may be generated up to this many policy versions early
    servers: list = field(default_factory=list)  # URLs of running SGLang / `bebop serve` servers
    num_local_servers: int = 1  # when `servers` is empty: `bebop serve` processes started by the trainer
    server_threads: int = 1  # torch threads per local server
    server_max_running: int = 64
    # sequences per /generate request (SGLang's batch form). 0: a step's samples split evenly over the
    # healthy servers, in whole groups, at most 256 per request; 1: one request per sample, as slime
    # sends them. On `bebop serve` many small requests cost rollout time: its HTTP loop shares the GIL
    # with the engine thread, so 128 one-sample requests arrive over many engine steps and the batch
    # is admitted piecemeal (docs/rollout_speed.md, stop 41)
    samples_per_request: int = 0
    api_key: Optional[str] = None
    speculative: bool = True  # MTP speculative decoding in the rollout servers (γ = model.mtp_num_layers)
    verify: str = "rejection"  # rejection | target_only
    # bebop serve only (SGLang servers keep a fixed γ): choose γ per round from measured costs, so that
    # speculation never slows a large batch and still pays in its tail; off by default so that every
    # round verifies drafts and the acceptance metrics cover the whole batch
    adaptive_gamma: bool = False
    # tensor (update_weights_from_tensor) | disk (shared file system) | distributed
    # (init_weights_update_group + update_weights_from_distributed: NCCL on GPUs, gloo on CPUs)
    weight_sync: str = "tensor"
    sync_bucket_mb: int = 256
    # ---- GRPO
    clip_low: float = 0.2
    clip_high: float = 0.28  # clip-higher (DAPO)
    kl_coef: float = 0.0  # > 0: k3 KL to the initial policy (a frozen reference copy)
    tis_cap: float = 2.0  # truncated importance sampling cap (rollout vs trainer log-probs); 0: off
    normalize_adv_std: bool = True
    # PPO as slime/verl run it: the rollout batch is split into num_minibatches optimizer steps, repeated
    # ppo_epochs times; old (proximal) log-probs come from a forward-only pass before the first one
    num_minibatches: int = 1
    ppo_epochs: int = 1
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    overlong_filter: bool = False  # no loss on samples cut at max_new_tokens
    # ---- MTP heads during RL
    mtp_strategy: str = "frozen"  # frozen | online | growmtp | occ | none: see MTPStrategy (and .strategy)
    online_mtp_loss: str = "e2e_tv"  # objective for mtp_strategy=online
    growmtp_topk: int = 8  # target distribution recorded by the verifier as top-k + residual
    occ_lambda: float = 1.0
    occ_ema: float = 0.9  # smoothing of the fallback coefficient (used before the policy has moved) across steps
    occ_max: float = 10.0  # |coefficient| bound (the proxy is a ratio of small differences)
    # ---- entropy control
    entropy_control: str = "none"  # none | entrocraft
    entrocraft_low: list = field(default_factory=lambda: [0.6, 0.4])  # band low: start -> end
    entrocraft_high: list = field(default_factory=lambda: [0.7, 0.5])  # band high: start -> end
    entrocraft_anneal_steps: int = 1000
    # ---- bookkeeping
    save_interval: int = 5
    exit_interval: int = 0  # stop (checkpointed) after this many steps in one invocation
    bench_speculation: bool = True  # end of run: rollout tokens/s with vs without speculation
    bench_prompts: int = 32  # prompts in that benchmark; 0 skips it

    @property
    def strategy(self) -> MTPStrategy:
        """``mtp_strategy`` as an :class:`MTPStrategy` (ConfigError for an unknown spelling)."""
        return MTPStrategy.parse(self.mtp_strategy)


@dataclass
class LaunchConfig:
    """Cluster layout for launch/slurm.py and launch/torchrun.sh (ignored by single-process runs)."""

    gpus_per_node: int = 8
    trainer_nodes: int = 1  # Megatron TP/PP/DP over NCCL across these nodes
    rollout_nodes: int = 0  # 0: rollout servers share the trainer node(s) (rollout_gpus of them)
    rollout_gpus: int = 4  # single node (rollout_nodes 0): GPUs for rollout servers, the trainer gets the rest
    rollout_tp: int = 1  # GPUs per SGLang server
    rollout_engine: str = "sglang"  # sglang | bebop (the embedded engine)
    rollout_port: int = 30000
    rollout_mem_fraction: float = 0.85
    partition: Optional[str] = None
    account: Optional[str] = None
    time: str = "24:00:00"
    job_name: str = "bebop-rl"
    log_dir: str = "logs"
    master_port: int = 29500
    container: Optional[str] = None  # a srun --container-image, e.g. an NGC PyTorch image with SGLang

    @property
    def trainer_world_size(self) -> int:
        return self.trainer_nodes * self.gpus_per_node - (self.rollout_gpus if self.rollout_nodes == 0 else 0)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Config":
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(raw) - set(sections)
        if unknown:
            raise ConfigError(f"unknown config section(s): {sorted(unknown)}; known: {sorted(sections)}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            section_cls = f.default_factory  # type: ignore[misc]
            values = raw.get(f.name) or {}
            if not isinstance(values, dict):
                raise ConfigError(f"section '{f.name}' must be a mapping")
            known = {sf.name for sf in dataclasses.fields(section_cls)}
            bad = set(values) - known
            if bad:
                raise ConfigError(f"unknown key(s) in '{f.name}': {sorted(bad)}")
            values = {k: _numeric(f.name, k, v, types[k]) for k, v in values.items()
                      for types in [{sf.name: sf.type for sf in dataclasses.fields(section_cls)}]}
            try:
                kwargs[f.name] = section_cls(**values)
            except TypeError as e:
                raise ConfigError(f"section '{f.name}': {e}") from e
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | Path, overrides: Optional[list[str]] = None) -> "Config":
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        raw = load_yaml_with_base(path)
        apply_overrides(raw, overrides or [])
        cfg = cls.from_dict(raw)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # --------------------------------------------------------------- validation
    def validate(self, world_size: Optional[int] = None) -> None:
        m, p, t = self.model, self.parallel, self.train
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        errors: list[str] = []
        if m.arch not in ARCHS:
            errors.append(f"model.arch must be one of {ARCHS}, got {m.arch!r}")
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size"):
            if getattr(m, name) < 1:
                errors.append(f"model.{name} must be >= 1, got {getattr(m, name)}")
        if tp < 1 or pp < 1:
            errors.append("parallel sizes must be >= 1")
        if errors:
            raise ConfigError("; ".join(errors))
        if m.mtp_num_layers < 1:
            errors.append(f"model.mtp_num_layers (γ) must be >= 1, got {m.mtp_num_layers}")
        if m.num_attention_heads % m.num_query_groups:
            errors.append(f"num_attention_heads {m.num_attention_heads} not divisible by "
                          f"num_query_groups {m.num_query_groups}")
        if m.num_attention_heads % tp:
            errors.append(f"num_attention_heads {m.num_attention_heads} not divisible by TP {tp}")
        if m.num_query_groups % tp:
            errors.append(f"num_query_groups {m.num_query_groups} not divisible by TP {tp}")
        if m.ffn_hidden_size % tp:
            errors.append(f"ffn_hidden_size {m.ffn_hidden_size} not divisible by TP {tp}")
        if m.mtp_ffn_hidden_size is not None:
            if not isinstance(m.mtp_ffn_hidden_size, int) or m.mtp_ffn_hidden_size < 1:
                errors.append(f"model.mtp_ffn_hidden_size must be null or >= 1, got {m.mtp_ffn_hidden_size!r}")
            elif m.mtp_ffn_hidden_size % tp:
                errors.append(f"model.mtp_ffn_hidden_size {m.mtp_ffn_hidden_size} not divisible by TP {tp}")
            if m.moe:
                errors.append("model.mtp_ffn_hidden_size is for dense MTP layers; an MoE model's MTP layer is "
                              "MoE (its width is moe_ffn_hidden_size)")
        if m.padded_vocab is not None and m.padded_vocab < m.vocab_size:
            errors.append(f"model.padded_vocab {m.padded_vocab} < vocab_size {m.vocab_size}")
        if m.padded_vocab_size(tp) % tp:
            errors.append(f"padded vocab {m.padded_vocab_size(tp)} not divisible by TP {tp}")
        if m.num_layers % pp:
            errors.append(f"num_layers {m.num_layers} not divisible by PP {pp}")
        if m.hybrid:
            errors += _validate_hybrid(m, tp)
        errors += _validate_moe(m, p, world_size)
        if p.sequence_parallel and tp == 1:
            errors.append("sequence_parallel needs TP > 1")
        if self.data.seq_length > m.max_position_embeddings:
            errors.append(f"data.seq_length {self.data.seq_length} > model.max_position_embeddings "
                          f"{m.max_position_embeddings}")
        if self.data.seq_length <= m.mtp_num_layers + 1:
            errors.append(f"data.seq_length {self.data.seq_length} too short for γ={m.mtp_num_layers}")
        if self.mtp.loss not in MTP_LOSSES:
            errors.append(f"mtp.loss must be one of {MTP_LOSSES}, got {self.mtp.loss!r}")
        if self.mtp.warmup_loss is not None and self.mtp.warmup_loss not in MTP_LOSSES:
            errors.append(f"mtp.warmup_loss must be null or one of {MTP_LOSSES}, got {self.mtp.warmup_loss!r}")
        if not 0.0 <= self.mtp.rollout_share < 1.0:
            errors.append(f"mtp.rollout_share must be in [0, 1), got {self.mtp.rollout_share}")
        if self.mtp.warmup_steps < 0:
            errors.append(f"mtp.warmup_steps must be >= 0, got {self.mtp.warmup_steps}")
        if self.mtp.warmup_loss and self.mtp.warmup_steps >= self.train.steps:
            errors.append(f"mtp.warmup_steps ({self.mtp.warmup_steps}) must be < train.steps "
                          f"({self.train.steps}), or the main loss {self.mtp.loss!r} never trains")
        if m.fp8 not in FP8_FORMATS:
            errors.append(f"model.fp8 must be one of {FP8_FORMATS}, got {m.fp8!r}")
        if m.fp8_recipe not in FP8_RECIPES:
            errors.append(f"model.fp8_recipe must be one of {FP8_RECIPES}, got {m.fp8_recipe!r}")
        if m.fp8 and m.transformer_impl == "local":
            errors.append("model.fp8 needs Transformer Engine: set model.transformer_impl to auto or "
                          "transformer_engine (or model.fp8=null)")
        if m.fp8 and m.params_dtype != "bfloat16":
            errors.append("model.fp8 runs with bf16 parameters: set model.params_dtype=bfloat16")
        if m.transformer_impl not in TRANSFORMER_IMPLS:
            errors.append(f"model.transformer_impl must be one of {TRANSFORMER_IMPLS}")
        if m.params_dtype not in DTYPES:
            errors.append(f"model.params_dtype must be one of {DTYPES}")
        if p.micro_batch_size < 1 or p.global_batch_size < 1:
            errors.append("micro_batch_size and global_batch_size must be >= 1")
        if world_size is not None:
            if world_size % (tp * pp):
                errors.append(f"world size {world_size} not divisible by TP*PP = {tp * pp}")
            else:
                dp = world_size // (tp * pp)
                if p.global_batch_size % (p.micro_batch_size * dp):
                    errors.append(f"global_batch_size {p.global_batch_size} not divisible by "
                                  f"micro_batch_size*DP = {p.micro_batch_size}*{dp}")
        elif p.global_batch_size % p.micro_batch_size:
            errors.append(f"global_batch_size {p.global_batch_size} not divisible by "
                          f"micro_batch_size {p.micro_batch_size}")
        if t.steps < 0 or t.lr <= 0:
            errors.append("train.steps must be >= 0 and train.lr > 0")
        errors += self._validate_rl(world_size)
        errors += self._validate_launch()
        if errors:
            raise ConfigError("; ".join(errors))


    def _validate_launch(self) -> list[str]:
        ln, p = self.launch, self.parallel
        errors = []
        if ln.rollout_engine not in ("sglang", "bebop"):
            errors.append(f"launch.rollout_engine must be sglang or bebop, got {ln.rollout_engine!r}")
        if ln.gpus_per_node < 1 or ln.trainer_nodes < 1 or ln.rollout_nodes < 0 or ln.rollout_tp < 1:
            errors.append("launch: gpus_per_node, trainer_nodes, rollout_tp must be >= 1, rollout_nodes >= 0")
            return errors
        if ln.gpus_per_node % ln.rollout_tp:
            errors.append(f"launch.rollout_tp {ln.rollout_tp} does not divide gpus_per_node {ln.gpus_per_node}")
        if ln.rollout_nodes == 0:
            if not (0 < ln.rollout_gpus < ln.gpus_per_node) or ln.trainer_nodes != 1:
                errors.append("launch: without rollout_nodes, rollout servers share one trainer node: set "
                              "trainer_nodes=1 and 0 < rollout_gpus < gpus_per_node")
            elif ln.rollout_gpus % ln.rollout_tp:
                errors.append(f"launch.rollout_gpus {ln.rollout_gpus} not divisible by rollout_tp {ln.rollout_tp}")
        trainer_gpus = ln.trainer_world_size
        mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        if trainer_gpus > 0 and trainer_gpus % mp:
            errors.append(f"launch: {trainer_gpus} trainer GPUs not divisible by TP*PP = {mp}")
        if p.tensor_model_parallel_size > ln.gpus_per_node:
            errors.append(f"TP {p.tensor_model_parallel_size} exceeds gpus_per_node {ln.gpus_per_node} "
                          f"(TP must stay inside a node's NVLink domain)")
        return errors

    def _validate_rl(self, world_size: Optional[int]) -> list[str]:
        r, p = self.rl, self.parallel
        errors = []
        try:
            MTPStrategy.parse(r.mtp_strategy)
        except ConfigError as e:
            errors.append(str(e))
        if r.online_mtp_loss not in MTP_LOSSES:
            errors.append(f"rl.online_mtp_loss must be one of {MTP_LOSSES}, got {r.online_mtp_loss!r}")
        if r.reward not in REWARDS:
            errors.append(f"rl.reward must be one of {REWARDS}, got {r.reward!r}")
        if r.mode not in ("async", "sync"):
            errors.append(f"rl.mode must be async or sync, got {r.mode!r}")
        if r.entropy_control not in ("none", "entrocraft"):
            errors.append(f"rl.entropy_control must be none or entrocraft, got {r.entropy_control!r}")
        if r.weight_sync not in ("tensor", "disk", "distributed"):
            errors.append(f"rl.weight_sync must be tensor, disk or distributed, got {r.weight_sync!r}")
        if r.verify not in ("rejection", "target_only"):
            errors.append(f"rl.verify must be rejection or target_only, got {r.verify!r}")
        for name in ("steps", "max_staleness", "eval_prompts", "save_interval", "exit_interval", "bench_prompts",
                     "samples_per_request"):
            if getattr(r, name) < 0:
                errors.append(f"rl.{name} must be >= 0")
        if r.samples_per_request > 1024:
            errors.append("rl.samples_per_request must be <= 1024 (bebop serve's limit per request)")
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "num_local_servers", "growmtp_topk",
                     "num_minibatches", "ppo_epochs"):
            if getattr(r, name) < 1:
                errors.append(f"rl.{name} must be >= 1")
        if r.group_size < 2:
            errors.append("rl.group_size must be >= 2 (group-normalised advantages)")
        if not (r.temperature > 0):
            errors.append("rl.temperature must be > 0 (RL samples from the policy)")
        if not (0 < r.top_p <= 1):
            errors.append("rl.top_p must be in (0, 1]")
        if r.lr <= 0 or r.clip_low < 0 or r.clip_high < 0 or r.kl_coef < 0 or r.tis_cap < 0:
            errors.append("rl.lr must be > 0 and clip_low/clip_high/kl_coef/tis_cap >= 0")
        for name in ("entrocraft_low", "entrocraft_high"):
            v = getattr(r, name)
            if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)):
                errors.append(f"rl.{name} must be [start, end]")
        if self.rl.max_new_tokens + 2 > self.data.seq_length:
            errors.append(f"rl.max_new_tokens {r.max_new_tokens} leaves no room for a prompt in "
                          f"data.seq_length {self.data.seq_length}")
        samples = r.prompts_per_step * r.group_size
        dp = 1
        if world_size is not None and world_size % (p.tensor_model_parallel_size * p.pipeline_model_parallel_size) == 0:
            dp = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
        if samples % (p.micro_batch_size * dp * max(r.num_minibatches, 1)):
            errors.append(f"rl.prompts_per_step*rl.group_size = {samples} samples per step not divisible by "
                          f"micro_batch_size*DP*rl.num_minibatches = {p.micro_batch_size}*{dp}*{r.num_minibatches}")
        return errors


def _validate_hybrid(m: ModelConfig, tp: int) -> list[str]:
    errors = []
    types = m.resolved_layer_types()
    if len(types) != m.num_layers or set(types) - {"linear_attention", "full_attention"}:
        errors.append(f"model.layer_types must list {m.num_layers} of linear_attention|full_attention, got {types}")
    if "full_attention" not in types:
        errors.append("model.layer_types has no full_attention layer (the MTP layer is one)")
    if m.linear_num_value_heads % m.linear_num_key_heads:
        errors.append(f"linear_num_value_heads {m.linear_num_value_heads} not a multiple of "
                      f"linear_num_key_heads {m.linear_num_key_heads}")
    if m.linear_num_key_heads % tp or m.linear_num_value_heads % tp:
        errors.append(f"linear_num_key_heads/linear_num_value_heads not divisible by TP {tp}")
    if not 0 < m.partial_rotary_factor <= 1:
        errors.append(f"model.partial_rotary_factor must be in (0, 1], got {m.partial_rotary_factor}")
    if m.fp8:
        errors.append("model.fp8 is not supported for the hybrid (Gated DeltaNet) archs yet")
    return errors


def _validate_moe(m: ModelConfig, p: "ParallelConfig", world_size: Optional[int]) -> list[str]:
    errors = []
    ep = p.expert_model_parallel_size
    if ep < 1:
        errors.append(f"parallel.expert_model_parallel_size must be >= 1, got {ep}")
        return errors
    if not m.moe:
        if ep != 1:
            errors.append(f"parallel.expert_model_parallel_size {ep} needs an MoE arch {MOE_ARCHS}")
        return errors
    if not m.num_moe_experts or m.num_moe_experts < 1:
        errors.append(f"model.num_moe_experts must be >= 1 for arch {m.arch}")
        return errors
    if not 1 <= m.moe_router_topk <= m.num_moe_experts:
        errors.append(f"model.moe_router_topk {m.moe_router_topk} not in [1, {m.num_moe_experts}]")
    if not m.moe_ffn_hidden_size or m.moe_ffn_hidden_size % p.tensor_model_parallel_size:
        errors.append(f"model.moe_ffn_hidden_size {m.moe_ffn_hidden_size} must be set and divisible by TP")
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and shared % p.tensor_model_parallel_size:
        errors.append(f"model.moe_shared_expert_intermediate_size {shared} not divisible by TP")
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        errors.append("MoE with TP > 1 needs parallel.sequence_parallel: true (megatron-core's MoELayer refuses "
                      "to train without it)")
    if m.num_moe_experts % ep:
        errors.append(f"model.num_moe_experts {m.num_moe_experts} not divisible by EP {ep}")
    if world_size is not None:
        mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        if world_size % mp == 0 and (world_size // mp) % ep:
            errors.append(f"data-parallel size {world_size // mp} not divisible by EP {ep}")
    if m.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        errors.append(f"model.moe_token_dispatcher_type must be alltoall|allgather, got {m.moe_token_dispatcher_type!r}")
    if m.moe_router_topk == 1 and m.moe_norm_topk_prob:
        errors.append("model.moe_router_topk 1 with moe_norm_topk_prob: megatron-core refuses softmax after a "
                      "top-1 selection; set moe_norm_topk_prob false")
    return errors


def load_yaml_with_base(path: Path, _seen: Optional[set] = None) -> dict[str, Any]:
    """A YAML config; ``base: other.yaml`` (relative to this file) is loaded first and this file's
    sections are merged over it key by key (presets: same model, another cluster layout)."""
    path = Path(path).resolve()
    seen = _seen or set()
    if path in seen:
        raise ConfigError(f"config base cycle through {path}")
    seen.add(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config must be a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = load_yaml_with_base(path.parent / base, seen)
    for section, values in raw.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **values}
        else:
            merged[section] = values
    return merged


def _numeric(section: str, key: str, value: Any, annotation: Any) -> Any:
    """Numbers as numbers: PyYAML reads ``5e-5`` (no dot) as a string, in files and in ``--set``
    alike, so a float field takes a numeric string; any other non-number there is a config error."""
    ann = str(annotation).replace("typing.", "")
    if ann in ("float", "Optional[float]", "int", "Optional[int]") and isinstance(value, str):
        try:
            return float(value) if "float" in ann else int(value)
        except ValueError:
            raise ConfigError(f"{section}.{key} must be a number, got {value!r}") from None
    if ann in ("float", "int") and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{section}.{key} must be a number, got {value!r}")
    return value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> None:
    """Apply ``section.key=value`` overrides in place; values are YAML scalars."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2:
            raise ConfigError(f"override key {key!r} must be section.key")
        section, name = parts
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        raw[section][name] = yaml.safe_load(value) if value != "" else None
