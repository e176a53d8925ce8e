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
