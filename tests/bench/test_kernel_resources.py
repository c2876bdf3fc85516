"""bench/tools/kernel_resources.py on the CPU: a kernel compiled for sm_90a without a GPU, its
cubin's registers and stack read back (the merge kernel: small, no spills). In a subprocess:
tests/conftest.py sets TRITON_INTERPRET=1, under which kernels do not compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path, *args, interpret=False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path), PYTHONPATH=str(ROOT), **({"TRITON_INTERPRET": "1"}
                                                           if interpret else {}))
    return subprocess.run([sys.executable, "bench/tools/kernel_resources.py", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not os.path.exists(TOOL), reason="this Triton ships no cuobjdump")
def test_merge_kernel_resources_compile_without_a_gpu(tmp_path):
    done = run(tmp_path, "--only", "merge 16")
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = tmp_path.glob("kernel_resources-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["kernel"] == "merge 16 head(s) x 2 splits"
    assert 0 < row["registers"] <= 255 and row["stack_bytes"] == 0 and row["warps"] == 4


def test_refuses_the_interpreter_and_unknown_names(tmp_path):
    done = run(tmp_path, interpret=True)
    assert done.returncode == 2 and "unset it" in done.stderr
    done = run(tmp_path, "--only", "no such kernel")
    assert done.returncode == 2 and "no kernel's name contains 'no such kernel'" in done.stderr
