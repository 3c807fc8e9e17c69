"""Every flag of vLLM 0.26.0's `vllm serve` (tests/data/vllm_serve_flags_0.26.0.txt, read from vLLM's
source) is answered by `kvserve serve`: implemented, ignored with a warning, or refused with a reason.
None ends in argparse's "unrecognized arguments"."""

from __future__ import annotations

import argparse
import functools
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import kvserve
from kvserve.entrypoints import vllm_flags
from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.openai.cli_args import add_server_args
from kvserve.entrypoints.cli_args import add_engine_args

VLLM_FLAGS = [line.strip() for line in (Path(__file__).parents[1] / "data" / "vllm_serve_flags_0.26.0.txt").read_text()
              .splitlines() if line.strip()]


@functools.cache
def kvserve_parser() -> argparse.ArgumentParser:
    return build_parser()  # parsing does not change a parser: one serves every case


def serve_parser() -> argparse.ArgumentParser:
    sub = kvserve_parser()._subparsers._group_actions[0]  # noqa: SLF001
    return sub.choices["serve"]


@functools.cache
def real_flags() -> set[str]:
    """What kvserve's own serve parser defines, before the vLLM table is added."""
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    add_server_args(p)
    add_engine_args(p)
    return set(p._option_string_actions)  # noqa: SLF001


def sample_args(parser: argparse.ArgumentParser, flag: str) -> list[str]:
    """The flag with a value of the kind vLLM takes (a valid choice where our parser has choices)."""
    action = parser._option_string_actions[flag]  # noqa: SLF001
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(list(action.choices)[0])]
    if action.type in (int, float):
        return [flag, "1"]
    return [flag, "x"]


def test_list_is_vllms():
    assert len(VLLM_FLAGS) == 300 and "--tensor-parallel-size" in VLLM_FLAGS and "-tp" in VLLM_FLAGS


@pytest.mark.parametrize("flag", VLLM_FLAGS)
def test_every_vllm_flag_is_answered(flag, caplog, capsys):
    parser = kvserve_parser()
    serve = serve_parser()
    ours = real_flags()
    long = vllm_flags.ALIASES.get(flag, flag)
    args = ["serve", "some-model", *sample_args(serve, flag)]
    status = None if long in ours else vllm_flags.status_of(flag)
    if long in ours:
        ns = parser.parse_args(args)  # implemented: parses into the same dest as our own flag
        assert ns.command == "serve"
        return
    assert status is not None, f"{flag} is neither in kvserve's parser nor in the vLLM flag table"
    caplog.set_level(logging.WARNING, logger="kvserve.flags")
    if status == "ignored":
        parser.parse_args(args)
        assert f"{flag} has no effect in kvserve: " in caplog.text
        return
    with pytest.raises(SystemExit) as e:
        parser.parse_args(args)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "unrecognized arguments" not in err
    assert f"error: {flag} (a vLLM flag) is not supported by kvserve: " in err


def test_table_is_consistent():
    tables = [vllm_flags.IGNORED, vllm_flags.REFUSED]
    listed = set(VLLM_FLAGS)
    for i, table in enumerate(tables):
        assert set(table) <= listed, set(table) - listed  # no stale names
        for other in tables[i + 1:]:
            assert not set(table) & set(other)
    # (A table entry for a flag our parser defines is inert -- the parser wins -- so a branch that implements
    # a flag needs no edit here; see test_a_flag_implemented_later_needs_no_table_edit.)
    assert all(vllm_flags.ALIASES[a] in listed for a in vllm_flags.ALIASES)


def test_values_are_consumed_and_neutral_values_pass(caplog):
    parser = build_parser()
    caplog.set_level(logging.WARNING, logger="kvserve.flags")
    # vLLM flag values must not be taken for the model, and a multi-value flag takes all its values.
    ns = parser.parse_args(["serve", "--compilation-config", '{"level": 3}', "my-model",
                            "--cudagraph-capture-sizes", "1", "2", "4", "--enable-dbo", "-tp", "1", "-q", "none"])
    assert (ns.model_tag, ns.tensor_parallel_size, ns.quantization) == ("my-model", 1, "none")
    # Refused flags at their neutral value, or turned off, are fine and silent.
    caplog.clear()
    ns = parser.parse_args(["serve", "m", "-dp", "1", "--no-enable-lora", "--scheduling-policy", "fcfs",
                            "--no-enable-auto-tool-choice", "--no-disable-cascade-attn"])
    assert ns.model_tag == "m" and caplog.text == ""


def test_a_flag_implemented_later_needs_no_table_edit():
    """When another branch adds e.g. --max-logprobs to the real parser, the table steps aside."""
    p = argparse.ArgumentParser()
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    vllm_flags.add_vllm_flags(p)
    ns = p.parse_args(["m", "--max-logprobs", "5", "-q", "fp8", "-tp", "2"])
    assert (ns.max_logprobs, ns.quantization, ns.tensor_parallel_size) == (5, "fp8", 2)


def test_tensor_parallel_alias_reaches_engine_args():
    ns = build_parser().parse_args(["serve", "m", "-tp", "2"])
    from kvserve.entrypoints.cli_args import engine_args_from_namespace

    assert engine_args_from_namespace(ns, ns.model_tag).tensor_parallel_size == 2


def test_version_and_collect_env():
    out = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == kvserve.__version__
    out = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "collect-env"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import torch
    import transformers

    lines = dict(line.split(" : ", 1) for line in out.stdout.splitlines() if " : " in line)
    lines = {k.strip(): v for k, v in lines.items()}
    assert lines["kvserve"] == kvserve.__version__
    assert lines["torch"] == torch.__version__
    assert lines["transformers"] == transformers.__version__
    assert lines["Python"].startswith(sys.version.split()[0])
    for key in ("triton", "CUDA available", "GPUs", "NCCL", "NVIDIA driver / GPUs (nvidia-smi)", "OS", "CPU"):
        assert lines[key]


def test_collect_env_survives_missing_pieces(monkeypatch):
    from kvserve.entrypoints import collect_env

    monkeypatch.setattr(collect_env.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "torch", None)  # "import torch" now fails
    info = collect_env.collect()
    assert info["torch"].startswith("not importable")
    assert info["NVIDIA driver / GPUs (nvidia-smi)"] == "nvidia-smi not found"
    assert collect_env._version("surely-not-installed-pkg") == "not found"
