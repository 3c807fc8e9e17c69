"""Model names resolve like vLLM's: a local path, else the Hugging Face hub cache (--download-dir,
$HF_HOME), at a --revision, with a separate --tokenizer. Nothing touches the network: every test builds
its own hub cache folder and runs with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.hub import resolve_model_files

REV_MAIN = "a" * 40
REV_V2 = "b" * 40


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))  # never the user's real cache
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)


def make_hub_cache(root: Path, repo: str, snapshots: dict[str, Path], refs: dict[str, str]) -> Path:
    """root/models--org--name/{snapshots/<commit>/..., refs/<name>}: the layout huggingface_hub writes."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    for commit, source in snapshots.items():
        shutil.copytree(source, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    for ref, commit in refs.items():
        (repo_dir / "refs" / ref).write_text(commit)
    return repo_dir


def test_repo_id_found_in_download_dir_and_hf_home(tmp_path, monkeypatch, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    cache = tmp_path / "dl"
    repo_dir = make_hub_cache(cache, "acme/tiny-llama", {REV_MAIN: Path(path)}, {"main": REV_MAIN})
    assert resolve_model_files("acme/tiny-llama", download_dir=str(cache)) == repo_dir / "snapshots" / REV_MAIN
    # Without --download-dir: huggingface_hub's default cache, $HF_HOME/hub.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    make_hub_cache(tmp_path / "home" / "hub", "acme/tiny-llama", {REV_MAIN: Path(path)}, {"main": REV_MAIN})
    got = resolve_model_files("acme/tiny-llama")
    assert got == tmp_path / "home" / "hub" / "models--acme--tiny-llama" / "snapshots" / REV_MAIN


def test_revision_picks_the_snapshot(tmp_path, tiny_model_factory):
    llama, _ = tiny_model_factory("llama")
    qwen, _ = tiny_model_factory("qwen2")
    cache = tmp_path / "dl"
    repo_dir = make_hub_cache(cache, "acme/m", {REV_MAIN: Path(llama), REV_V2: Path(qwen)},
                              {"main": REV_MAIN, "v2": REV_V2})
    assert resolve_model_files("acme/m", download_dir=str(cache)) == repo_dir / "snapshots" / REV_MAIN
    assert resolve_model_files("acme/m", revision="v2", download_dir=str(cache)) == repo_dir / "snapshots" / REV_V2
    assert resolve_model_files("acme/m", revision=REV_V2, download_dir=str(cache)) == repo_dir / "snapshots" / REV_V2


def test_not_found_lists_every_place_tried(tmp_path):
    cache = tmp_path / "dl"
    with pytest.raises(ValueError) as e:
        resolve_model_files("Qwen/Qwen3-8B", download_dir=str(cache))
    msg = str(e.value)
    assert "'Qwen/Qwen3-8B' was not found" in msg
    assert "local path 'Qwen/Qwen3-8B': does not exist" in msg
    assert f"hub cache {str(cache)!r} (repo 'Qwen/Qwen3-8B', revision 'main')" in msg
    assert "skipped, HF_HUB_OFFLINE is set" in msg
    with pytest.raises(ValueError, match="local path '/no/such/dir': does not exist"):
        resolve_model_files("/no/such/dir")


def test_engine_loads_a_repo_id_with_same_tokens(tmp_path, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    cache = tmp_path / "dl"
    # The tokenizer lives in its own repo, given by --tokenizer (also resolved through the cache).
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(path) / f, weights_only / f)
    make_hub_cache(cache, "acme/weights", {REV_MAIN: weights_only}, {"main": REV_MAIN})
    make_hub_cache(cache, "acme/tok", {REV_V2: Path(path)}, {"v2": REV_V2})
    prompts = [[5, 17, 300, 41], [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    args = dict(max_model_len=128, kv_cache_memory_bytes=8 << 20)
    direct = [o.outputs[0].token_ids for o in LLM(path, **args).generate(prompts, params, use_tqdm=False)]
    llm = LLM("acme/weights", tokenizer="acme/tok", tokenizer_revision="v2", download_dir=str(cache), **args)
    assert llm.llm_engine.config.served_model_name == "acme/weights"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == direct
    assert llm.get_tokenizer().encode("hello world") == LLM(path, **args).get_tokenizer().encode("hello world")


def test_remote_code_architecture_gets_a_message(tmp_path, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    custom = tmp_path / "custom"
    shutil.copytree(path, custom)
    cfg = json.loads((custom / "config.json").read_text())
    cfg["architectures"] = ["FancyForCausalLM"]
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"}
    (custom / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="kvserve never runs code from a model repository, so --trust-remote-code"):
        LLM(str(custom), trust_remote_code=True)


def test_serve_cli_reports_what_was_tried(tmp_path):
    """`kvserve serve NAME` for a model that is nowhere: exit 2 with the list, no traceback, no hang."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "Qwen/Qwen3-8B",
                           "--trust-remote-code"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: Model 'Qwen/Qwen3-8B' was not found. Tried, in order:" in proc.stderr
    assert str(tmp_path / "hf" / "hub") in proc.stderr
    assert "Traceback" not in proc.stderr
