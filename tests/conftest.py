import os

import pytest
import torch
from hypothesis import settings

# Without a GPU the Triton kernels run in Triton's interpreter (on CPU tensors); the variable must be set
# before a kernel module is imported, since triton.jit reads it when it decorates.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the suite is deterministic: hypothesis draws the same examples on every run (CI included)
settings.register_profile("memplan", derandomize=True)
settings.load_profile("memplan")

import memplan


@pytest.fixture(scope="session")
def bert_large():
    return memplan.resolve_model("bert-large")


@pytest.fixture(scope="session")
def v100():
    return memplan.load_gpu("v100-16g")


@pytest.fixture(scope="session")
def benchmark_module():
    """Imports a script under benchmarks/ by its path (`benchmark_module("throughput/compare.py")`), with its folder
    on sys.path only while it imports (a script may import its neighbours, as published.py does cli_suggest), so no
    test leaves the benchmarks' folders on the path of the tests after it."""
    import importlib.util
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

    def load(relative: str):
        path = root / relative
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.parent))
        return module

    return load


@pytest.fixture()
def memplan_cli(capsys):
    """`memplan ARGS` in this process (what `python -m memplan` runs, without a fresh interpreter that
    imports torch and transformers again): a CompletedProcess with the exit code, stdout and stderr.
    tests/test_cli.py keeps the subprocess entry point covered."""
    import subprocess

    from memplan.cli.commands import main

    def invoke(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return invoke


# pytest-xdist's --dist loadfile (scripts/test.sh) hands whole files to the two workers in collection order, so a
# long file collected late runs alone at the end. The longest files go first (longest-processing-time-first):
# per-file seconds of one run at 468a0d7 (pytest --durations=0): test_verify 120, test_kernels 62, test_traced 44,
# test_attention 43, test_emit_e2e 34, test_cli 33, test_triton_cross_entropy 30; the rest under 22 each.
SLOW_FILES_FIRST = ("test_verify.py", "test_kernels.py", "test_traced.py", "test_attention.py", "test_emit_e2e.py",
                    "test_cli.py", "test_triton_cross_entropy.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
