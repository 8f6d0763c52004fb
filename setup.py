"""hyflow: a HybridFlow-style single-controller engine for RL post-training of language models."""

from setuptools import find_packages, setup

PACKAGES = ["dataproto", "resource_pools", "controller", "algorithms", "workers", "recipes"]

setup(
    name="hyflow",
    version="0.1.0",
    description="Single-controller RL post-training with Ray WorkerGroups and RLM-REPL environments",
    python_requires=">=3.11",
    packages=find_packages(include=[name for p in PACKAGES for name in (p, f"{p}.*")]),
    include_package_data=True,
    package_data={"recipes": ["*.yaml", "config/*.yaml"]},
    install_requires=[
        # torch is installed first by the Makefile from the local CPU wheel (torch==2.13.0);
        # a range that it satisfies keeps pip from pulling a CUDA build.
        "torch>=2.6",
        "numpy>=1.26",
        "ray[default]==2.60.0",  # [default]: dashboard + job server for `ray job submit`
        "transformers>=4.51",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "xxhash>=3",  # checkpoint content hashes (workers/engine/checkpoint.py)
        "omegaconf>=2.3",
        "pyarrow>=15",
        "pandas>=2.1",
        "tqdm>=4.66",
        "tensorboard>=2.15",
        "matplotlib>=3.8",
        # LM clients of the RLM inference API (workers/agents/clients.py): the official libraries
        "openai>=1.40",
        "anthropic>=0.40",
        # the OpenAI-compatible endpoint (workers/agents/gateway.py, recipes/serve.py): an ASGI app and its server
        "fastapi>=0.110",
        "uvicorn>=0.30",
        "rich>=13",  # RLM(verbose=True) console output
        # LoRA (actor.lora): the adapters users load elsewhere; small (with accelerate) and pure Python
        "peft>=0.17",
    ],
    extras_require={
        # GPU cluster only: SGLang's kernels are CUDA wheels.
        "sglang": ["sglang>=0.5"],
        # megatron-core: a 2.6 MB wheel (deps: torch, numpy, packaging); hyflow's Megatron engine runs on CPU
        # through workers/engine/megatron/cpu_compat.py and is tested against 0.16.0.
        "megatron": ["megatron-core>=0.16,<0.17"],
        "wandb": ["wandb"],
        # the documentation site (mkdocs.yml; `make docs`)
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings-python==2.0.11"],
        # megatron-core in dev: installs in seconds without touching torch, so CI runs the Megatron tests.
        "dev": [
            # pytest 9.1 keeps a node's id where pytest-xdist 3.8's --dist loadgroup cannot rename it (groups ignored)
            "pytest>=8,<9.1",
            "pytest-timeout>=2.3",
            "pytest-xdist==3.8.0",
            "ruff==0.17.6",
            "mypy==2.4.1",
            "megatron-core==0.16.0",
            # tests/test_docs_site.py builds the site
            "mkdocs==1.6.1",
            "mkdocs-material==9.8.2",
            "mkdocstrings-python==2.0.11",
        ],
    },
)
