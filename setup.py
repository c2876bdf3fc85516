"""Installs the `nanosched` package and its `nanosched` console script."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="nanosched",
    version="0.1.0",
    description=(
        "Profile a GPU, search nano-batch pipelines with OR-Tools and replay them on CUDA "
        "streams to overlap compute-, memory- and network-bound work in LLM inference."
    ),
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["nanosched", "nanosched.*"]),
    package_data={"nanosched": ["profiler/profiles/*.json", "schedules/shipped/*.json",
                               "kernels/*.cu", "models/tokenizers/*.json.gz"]},
    install_requires=[
        "torch>=2.4",
        "ortools>=9.10",
        "pandas>=2.0",
        "typer>=0.12",
        "safetensors>=0.4",
        "tqdm>=4.60",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5", "transformers>=5.0",
                 "ruff>=0.5", "triton>=3.0", "fastapi>=0.160", "pydantic>=2.7", "uvicorn>=0.50",
                 "httpx>=0.27",
                 "matplotlib>=3.7", "jinja2>=3.1", "openai>=1.0", "sglang-router>=0.3.2,<0.4"],
        # transformers and jinja2: tokenizers and chat templates (stories15m ships one);
        # sglang-router: tests/runtime/server/test_router.py puts two replicas behind it
        "serve": ["fastapi>=0.160", "pydantic>=2.7", "uvicorn>=0.50", "transformers>=5.0",
                  "jinja2>=3.1"],
        "plot": ["matplotlib>=3.7"],
        "gpu": ["triton>=3.0"],
        "cuda12": ["triton>=3.0", "cupy-cuda12x>=13", "cuda-bindings>=12.3,<13"],
        "cuda13": ["triton>=3.0", "cupy-cuda13x>=13", "cuda-bindings>=13"],
    },
    entry_points={"console_scripts": ["nanosched=nanosched.cli:main"]},
)
