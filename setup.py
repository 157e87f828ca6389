from setuptools import find_packages, setup

setup(
    name="bebop_megatron",
    version="0.1.0",
    description="MTP speculative rollouts (rejection sampling + end-to-end TV-trained drafts) "
    "for RL post-training of Qwen-style LLMs on Megatron-Core",
    packages=find_packages(include=["bebop_megatron", "bebop_megatron.*"]),
    package_data={"bebop_megatron": ["data/*.jsonl"]},
    python_requires=">=3.10",
    install_requires=[
        "megatron-core==0.16.1",
        # CPU machines: torch==2.13.0 (a local CPU wheel); GPU clusters bring their own CUDA build.
        "torch>=2.4",
        "numpy",
        "psutil",  # megatron-core's checkpoint writer needs it (a worker dies without it)
        "pyyaml",
        "safetensors",
        "transformers",
        "sentencepiece",
        "tensorboard",
        "tqdm",
        "matplotlib",  # PNG plots of benchmark and RL curves (Agg backend, no display needed)
        "fastapi",  # bebop serve: the SGLang-compatible HTTP API
        "uvicorn",
        "httpx",  # the rollout bridge's async client
        "regex",  # stop_regex searched with a timeout (a pathological pattern fails its request alone)
    ],
    extras_require={
        # GPU-only; never the unrelated PyPI package named "apex".
        "gpu": ["transformer-engine[pytorch]"],
        "sglang": ["sglang"],
        "test": ["pytest", "hypothesis", "openai"],  # openai: the official client drives /v1/*
    },
    entry_points={"console_scripts": ["bebop=bebop_megatron.cli:main"]},
)
