"""Config loading/validation and data loading: clear errors for bad input."""

import json
from pathlib import Path

import pytest

from bebop_megatron.config import MTP_STRATEGIES, Config, ConfigError, MTPStrategy
from bebop_megatron.data import CharTokenizer, DataError, TokenWindows, load_jsonl_tokens, microbatches_for_step

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = Config.load(path)
    world = 1 if path.name == "tiny_cpu.yaml" else cfg.launch.trainer_world_size  # the preset's trainer ranks
    cfg.validate(world_size=world)
    assert cfg.model.mtp_num_layers >= 1


def test_qwen3_shapes():
    cfg = Config.load(Path(CONFIGS[0]).parent / "qwen3_4b.yaml")
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
            m.kv_channels, m.vocab_size) == (36, 2560, 9728, 32, 8, 128, 151936)
    assert m.qk_layernorm and not m.add_qkv_bias  # qwen3 defaults
    assert m.padded_vocab_size(2) % 256 == 0


def test_overrides_and_yaml_types(tmp_path):
    cfg = Config.load(CONFIGS[0], ["model.mtp_num_layers=4", "mtp.loss=tv", "train.load=null"])
    assert cfg.model.mtp_num_layers == 4 and cfg.mtp.loss == "tv" and cfg.train.load is None


@pytest.mark.parametrize("override,needle", [
    ("model.mtp_num_layers=0", "mtp_num_layers"),
    ("parallel.tensor_model_parallel_size=3", "not divisible by TP 3"),
    ("parallel.pipeline_model_parallel_size=3", "not divisible by PP 3"),
    ("mtp.loss=mse", "mtp.loss"),
    ("model.fp8=e5m2", "model.fp8"),
    ("model.arch=llama", "model.arch"),
    ("data.seq_length=100000", "max_position_embeddings"),
    ("parallel.global_batch_size=7", "global_batch_size"),
    ("rl.lr=fast", "rl.lr must be a number"),
    ("rl.steps=ten", "rl.steps must be a number"),
    ("mtp.rollout_share=1.0", r"mtp.rollout_share must be in \[0, 1\)"),
    ("mtp.rollout_share=-0.1", r"mtp.rollout_share must be in \[0, 1\)"),
])
def test_bad_configs_name_the_field(override, needle):
    with pytest.raises(ConfigError, match=needle):
        Config.load(CONFIGS[-1].parent / "tiny_cpu.yaml", [override])


def test_exponent_without_dot_is_a_number(tmp_path):
    """PyYAML reads 5e-5 as a string; float fields take it as the number it means (was a TypeError)."""
    assert Config.load(CONFIGS[-1].parent / "tiny_cpu.yaml", ["rl.lr=5e-5"]).rl.lr == 5e-5
    f = tmp_path / "c.yaml"
    f.write_text("rl:\n  lr: 3e-4\n  steps: '7'\n")
    cfg = Config.load(f)
    assert cfg.rl.lr == 3e-4 and cfg.rl.steps == 7


def test_unknown_keys_and_files(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("model:\n  hiden_size: 3\n")
    with pytest.raises(ConfigError, match="hiden_size"):
        Config.load(bad)
    bad.write_text("modle: {}\n")
    with pytest.raises(ConfigError, match="modle"):
        Config.load(bad)
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        Config.load(bad)
    with pytest.raises(ConfigError, match="not found"):
        Config.load(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="section.key=value"):
        Config.load(CONFIGS[0], ["oops"])


def test_world_size_batch_arithmetic():
    cfg = Config.load(CONFIGS[-1].parent / "tiny_cpu.yaml", ["parallel.global_batch_size=16",
                                                           "parallel.micro_batch_size=4"])
    cfg.validate(world_size=4)
    with pytest.raises(ConfigError, match="divisible by micro_batch_size\\*DP"):
        cfg.validate(world_size=8)
    with pytest.raises(ConfigError, match="world size 3"):
        Config.load(CONFIGS[-1].parent / "tiny_cpu.yaml", ["parallel.tensor_model_parallel_size=2"]).validate(3)


def test_fp8_without_transformer_engine_is_a_clear_error():
    from bebop_megatron.model.spec import MissingOptionalDependency, transformer_engine_available, use_transformer_engine

    if transformer_engine_available():
        pytest.skip("Transformer Engine is installed here")
    cfg = Config.load(CONFIGS[-1].parent / "tiny_cpu.yaml", ["model.fp8=hybrid", "model.transformer_impl=auto",
                                                              "model.params_dtype=bfloat16"])
    with pytest.raises(MissingOptionalDependency, match="Transformer Engine"):
        use_transformer_engine(cfg.model)
    with pytest.raises(ConfigError, match="model.fp8 needs Transformer Engine"):
        Config.load(CONFIGS[-1].parent / "tiny_cpu.yaml", ["model.fp8=e4m3", "model.params_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="fp8_recipe must be one of"):
        Config.load(CONFIGS[-1].parent / "tiny_cpu.yaml", ["model.fp8_recipe=fp4"])


@pytest.mark.parametrize("overrides,message", [
    (["launch.rollout_tp=3"], "rollout_tp 3 does not divide gpus_per_node 8"),
    (["launch.trainer_nodes=2"], "rollout servers share one trainer node"),
    (["launch.rollout_nodes=1", "launch.trainer_nodes=1", "parallel.tensor_model_parallel_size=16"],
     "exceeds gpus_per_node"),
    (["launch.rollout_gpus=5"], "3 trainer GPUs not divisible by TP\\*PP = 4"),
    (["rl.group_size=1"], "group_size must be >= 2"),
    (["rl.mtp_strategy=greedy"], "rl.mtp_strategy must be one of"),
    (["rl.bench_prompts=-1"], "rl.bench_prompts must be >= 0"),
    (["rl.prompts_per_step=3", "rl.group_size=3"], "9 samples per step not divisible by micro_batch_size"),
    (["model.num_attention_heads=30"], "not divisible by TP 4"),
])
def test_bad_cluster_configs_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cfg = Config.load(CONFIGS[0].parent / "qwen3_8b.yaml", overrides)
        cfg.validate(world_size=cfg.launch.trainer_world_size)


def test_mtp_strategy_enum_properties():
    S = MTPStrategy
    assert MTP_STRATEGIES == ("frozen", "online", "growmtp", "occ", "none")
    assert {s for s in S if s.trains_mtp} == {S.ONLINE, S.GROWMTP, S.OCC}
    assert {s for s in S if not s.detaches_trunk} == {S.OCC}
    assert {s for s in S if s.needs_speculation} == {S.GROWMTP}
    assert {s for s in S if not s.speculates} == {S.NONE}
    assert {s for s in S if s.records_topk} == {S.GROWMTP}
    assert all(s.__doc__ and s.__doc__ != S.__doc__ for s in S)  # each member says what it means
    # a str enum: the YAML/CLI spelling round-trips and compares equal
    assert S("occ") is S.OCC and S.OCC == "occ" and f"{S.GROWMTP}" == "growmtp" and json.dumps(S.NONE) == '"none"'
    cfg = Config.load(CONFIGS[0].parent / "tiny_cpu.yaml", ["rl.mtp_strategy=occ"])
    assert cfg.rl.strategy is S.OCC and cfg.rl.mtp_strategy == "occ"
    cfg.rl.mtp_strategy = "greedy"
    with pytest.raises(ConfigError, match=r"rl.mtp_strategy must be one of \('frozen', 'online', 'growmtp'"):
        cfg.rl.strategy


def test_config_base_inheritance(tmp_path):
    (tmp_path / "a.yaml").write_text("model: {num_layers: 4, hidden_size: 64}\ntrain: {lr: 0.5}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nmodel: {num_layers: 6}\n")
    cfg = Config.load(tmp_path / "b.yaml")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.lr) == (6, 64, 0.5)
    (tmp_path / "c.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        Config.load(tmp_path / "c.yaml")


def test_jsonl_errors_name_file_and_line(tmp_path):
    tok = CharTokenizer()
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "1+1=2;"}) + "\n" + "{not json\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: invalid JSON"):
        load_jsonl_tokens(f, tok)
    f.write_text(json.dumps({"input_ids": [1, 2, 999]}) + "\n")
    with pytest.raises(DataError, match=r":1: token id 999 >= vocab_size 64"):
        load_jsonl_tokens(f, tok, vocab_size=64)
    f.write_text(json.dumps({"text": "héllo"}) + "\n")
    with pytest.raises(DataError, match=r":1: characters not in"):
        load_jsonl_tokens(f, tok)
    f.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(DataError, match="needs 'input_ids' or 'text'"):
        load_jsonl_tokens(f, tok)
    with pytest.raises(DataError, match="not found"):
        load_jsonl_tokens(tmp_path / "nope.jsonl", tok)
    f.write_text(json.dumps({"text": "1+1=2;"}) + "\n" + json.dumps({"input_ids": [3, 4]}) + "\n")
    assert load_jsonl_tokens(f, tok) == [tok.encode("1+1=2;") + [tok.eos_id], [3, 4, tok.eos_id]]

    class NoEos:  # a tokenizer without an EOS id: packed documents would run together
        encode = tok.encode

    with pytest.raises(DataError, match="no EOS id"):
        load_jsonl_tokens(f, NoEos())


def test_windows_deterministic_and_dp_sharded():
    tok = CharTokenizer()
    docs = [tok.encode("12+30=42; sort 3 1 2:1 2 3;") + [tok.eos_id] for _ in range(20)]
    data = TokenWindows(docs, seq_length=16, seed=3)
    a = list(microbatches_for_step(data, 8, 8, 2, dp_rank=0, dp_size=2))
    b = list(microbatches_for_step(data, 8, 8, 2, dp_rank=1, dp_size=2))
    whole = list(microbatches_for_step(data, 8, 8, 2, dp_rank=0, dp_size=1))
    assert len(a) == len(b) == 2 and len(whole) == 4
    import torch

    assert torch.equal(torch.cat([x.tokens for x in a + b]), torch.cat([x.tokens for x in whole]))
    assert torch.equal(a[0].labels[:, :-1], a[0].tokens[:, 1:])
    again = TokenWindows(docs, seq_length=16, seed=3)
    assert torch.equal(again.batch(range(8, 10)).tokens, a[0].tokens)
    assert tok.decode(tok.encode("count a in abca:2;")) == "count a in abca:2;"


def test_rollout_share_checks_the_rl_prompts_before_any_work(tmp_path):
    """train-mtp checks the prompts the trunk will answer before its trunk phase, not after it."""
    from bebop_megatron.data import DataError
    from bebop_megatron.training.rollout_data import check_rollout_settings

    tiny = CONFIGS[-1].parent / "tiny_cpu.yaml"
    check_rollout_settings(Config.load(tiny))
    with pytest.raises(DataError, match="prompt file not found"):
        check_rollout_settings(Config.load(tiny, [f"rl.prompts_path={tmp_path / 'none.jsonl'}"]))
    with pytest.raises(DataError, match="does not fit data.seq_length 64"):
        check_rollout_settings(Config.load(tiny, ["rl.max_new_tokens=60"]))
    check_rollout_settings(Config.load(tiny, ["rl.max_new_tokens=60", "mtp.rollout_share=0"]))  # not read
    # an MoE trunk with its experts split over ranks cannot be gathered for the in-process engine
    moe = [f"model.{k}" for k in ("arch=qwen3_5_moe", "num_moe_experts=4", "moe_ffn_hidden_size=64")] + \
        ["mtp.rollout_share=0.5"]
    qwen3p5 = CONFIGS[-1].parent / "tiny_qwen3p5_cpu.yaml"
    check_rollout_settings(Config.load(qwen3p5, moe + ["parallel.expert_model_parallel_size=1"]))
    with pytest.raises(ConfigError, match="needs expert_model_parallel_size 1"):
        check_rollout_settings(Config.load(qwen3p5, moe + ["parallel.expert_model_parallel_size=2"]))


def test_mix_documents_keeps_the_tokens_and_spreads_the_extra_share():
    """``mtp.rollout_share``'s mix: the data cut to (1 - share) of its tokens, the extra documents
    (EOS appended) spread evenly, the total about the data's own (the same windows per epoch)."""
    from bebop_megatron.data import mix_documents

    docs = [[5, k] + [5] * 8 for k in range(100)]  # 1000 tokens; k numbers them
    extra = [[7] * 4 for _ in range(100)]  # 5 tokens each with the EOS
    out = mix_documents(docs, extra[:60], 0.3, eos=1)
    n_docs = sum(len(d) for d in out if d[0] == 5)
    n_extra = sum(len(d) for d in out if d[0] == 7)
    assert n_docs == 700 and n_extra == 300 and all(d[-1] == 1 for d in out if d[0] == 7)
    kept = [d[1] for d in out if d[0] == 5]
    assert kept == sorted(kept) and max(kept) >= 95  # taken through the whole list, not a prefix
    assert extra[0] == [7] * 4  # the caller's lists are not changed
    half = out[: len(out) // 2]  # evenly spread: each half holds about its share
    share_first_half = sum(len(d) for d in half if d[0] == 7) / sum(len(d) for d in half)
    assert abs(share_first_half - 0.3) < 0.05, share_first_half
    assert len(mix_documents(docs, [], 0.3, eos=1)) == 70
