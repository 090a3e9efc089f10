"""The example CI job (examples/ci/gpu-regression-gate.yml) names only options that exist: each
`bin/dslab gate` command parses with the gate's own parser, and each `--kernel-*` option of the
kernel benchmarks' run is one benchmarks/kernels/conftest.py defines."""

import argparse
import re
import shlex
from pathlib import Path

from dslab.gate.command import add_arguments

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "examples" / "ci" / "gpu-regression-gate.yml"


def commands(prefix: str) -> list[list[str]]:
    """Every shell command of the job that starts with ``prefix``, continuation lines joined,
    split as the shell would, without the redirection that ends it."""
    text = JOB.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(prefix):
            words = shlex.split(line.split(">", 1)[0])
            found.append(words[len(prefix.split()):])
    return found


def test_every_gate_command_of_the_ci_example_parses():
    gate = commands("bin/dslab gate")
    assert len(gate) >= 3
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    for words in gate:
        args = parser.parse_args(words)  # an unknown option or a bad value raises
        if args.pytest_benchmark:
            assert args.threshold == 0.03 and args.run_noise == 0.003


def test_the_kernel_benchmark_options_of_the_ci_example_exist():
    runs = commands("bin/test benchmarks/kernels")
    assert runs
    conftest = (REPO / "benchmarks" / "kernels" / "conftest.py").read_text()
    defined = set(re.findall(r'"(--kernel-[a-z-]+)"', conftest))
    defined |= {f"--kernel-{name.replace('_', '-')}" for name in re.findall(r'"(\w+)": "', conftest)}
    used = {word for words in runs for word in words if word.startswith("--kernel-")}
    assert used and used <= defined, used - defined
