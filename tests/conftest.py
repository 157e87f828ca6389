import warnings

import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory of tiny random HF Qwen checkpoints with MTP heads (tests/tiny_models.py), built once
    per session per argument set and shared: treat the folder as read-only (a test that writes into a
    model folder makes its own with ``make_hf_checkpoint``)."""
    from tests.tiny_models import make_hf_checkpoint

    made: dict[tuple, object] = {}

    def get(arch: str = "qwen3", mtp_layout: str = "deepseek", num_mtp: int = 3, seed: int = 0,
            scale: float = 2.0, **kw):
        key = (arch, mtp_layout, num_mtp, seed, scale, tuple(sorted(kw.items())))
        if key not in made:
            d = tmp_path_factory.mktemp(f"tiny_{arch}_{mtp_layout}_{num_mtp}_s{seed}")
            make_hf_checkpoint(d, arch, mtp_layout, num_mtp=num_mtp, seed=seed, scale=scale, **kw)
            made[key] = d
        return made[key]

    return get


@pytest.fixture(autouse=True)
def _no_distributed_leak():
    """Tests that initialise torch.distributed in-process must tear it down."""
    yield
    from bebop_megatron.parallel import destroy_distributed

    destroy_distributed()


# Markers (registered in pytest.ini), kept in one place: `-m "not multiprocess"` runs the in-process
# tests only (a few minutes), `-m "not slow"` skips the long end-to-end runs.
MULTIPROCESS_MODULES = {  # every test here spawns processes: gloo ranks, `bebop` CLI runs, real servers
    "test_bridge", "test_convert", "test_distributed_weight_sync", "test_launch", "test_local_workers",
    "test_parallel", "test_qwen3_5", "test_qwen3_moe", "test_rl", "test_rl_faults", "test_rl_ppo",
    "test_rl_run", "test_server", "test_server_fuzz", "test_sglang_export", "test_sglang_types", "test_train_mtp",
    "test_weight_sync",
}
SLOW_TESTS = {  # > ~10 s on 2 quiet CPU cores (pytest --durations, whole suite ~9 min)
    "test_rl_run.py::test_rl_improves_reward_on_synthetic_task",
    "test_rl_run.py::test_sync_run_exit_and_resume",
    "test_rl_run.py::test_killed_trainer_resumes_without_duplicated_or_skipped_steps",
    "test_rl_run.py::test_async_run_respects_staleness_bound",
    "test_server_fuzz.py::test_fuzz_server",
    "test_server_fuzz.py::test_load_streaming_and_hostile",
    "test_train_mtp.py::test_kill_and_resume_equals_uninterrupted",
    "test_train_mtp.py::test_train_mtp_raises_acceptance_and_only_touches_mtp",
    "test_launch.py::test_torchrun_two_process_rl_tp2",
    "test_launch.py::test_gpu_check_cpu_smoke",
    "test_convert.py::test_model_without_mtp_gets_fresh_layers_and_says_so",
}
MULTIPROCESS_TESTS = {  # tests that spawn processes in otherwise in-process modules
    "test_engine_hybrid.py::test_policy_to_engine_sync_qwen3_5",
}


def pytest_collection_modifyitems(config, items):
    modules = {it.path.name: it.module for it in items if getattr(it, "module", None) is not None}
    stale = {n for n in SLOW_TESTS | MULTIPROCESS_TESTS
             if n.split("::")[0] in modules and not hasattr(modules[n.split("::")[0]], n.split("::")[1])}
    if stale:  # a renamed test must not silently lose its marker
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS/MULTIPROCESS_TESTS name tests that do not exist: {sorted(stale)}")
    for it in items:
        if it.path.stem in MULTIPROCESS_MODULES or f"{it.path.name}::{it.originalname}" in MULTIPROCESS_TESTS:
            it.add_marker(pytest.mark.multiprocess)
        if f"{it.path.name}::{it.originalname}" in SLOW_TESTS:
            it.add_marker(pytest.mark.slow)
