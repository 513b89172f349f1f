"""vLLM's ``--revision`` / ``--download-dir`` / ``--tokenizer-revision`` (and the same keywords of
``Engine.from_pretrained``): a hub id is read at a branch, tag or commit from a Hugging Face
cache folder of the caller's choosing, offline unless downloads are allowed.

The cache here is laid out as huggingface_hub lays it out (``models--owner--name/refs/<branch>``
naming a commit, ``snapshots/<commit>/`` its files), with two revisions of a tiny Llama whose
weights differ, so that which revision loaded is visible in the weights.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from radixkv import models
from radixkv.errors import ConfigError

pytestmark = pytest.mark.model

MAIN, V2 = "a" * 40, "b" * 40   # commit hashes (40 hex digits, as the hub's)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding ``org/tiny`` at main (commit MAIN) and at tag v2 (commit V2)."""
    import transformers

    try:   # the embedded model's tokenizer (a copy: load_tokenizer's object is the process's)
        tok = copy.deepcopy(models.load_tokenizer())
    except ConfigError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"embedded model unavailable: {exc}")
    root = tmp_path_factory.mktemp("hub")
    repo = root / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    for seed, commit in ((1, MAIN), (2, V2)):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, max_position_embeddings=256)
        snap = repo / "snapshots" / commit
        transformers.LlamaForCausalLM(cfg).save_pretrained(str(snap))
        tok.save_pretrained(str(snap))
    return root


def _embedding(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]


def test_a_revision_is_read_from_the_cache_folder_offline(hub: Path, tmp_path: Path) -> None:
    snaps = hub / "models--org--tiny" / "snapshots"
    assert models.hub_snapshot("org/tiny", cache_dir=hub) == snaps / MAIN
    assert models.hub_snapshot("org/tiny", cache_dir=hub, revision="v2") == snaps / V2
    assert models.hub_snapshot("org/tiny", cache_dir=hub, revision=V2) == snaps / V2
    with pytest.raises(ConfigError, match="'v3' is not in the Hugging Face cache.*allow"):
        models.hub_snapshot("org/tiny", cache_dir=hub, revision="v3")
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        models.hub_snapshot("org/tiny", cache_dir=tmp_path)          # another, empty cache
    with pytest.raises(ConfigError, match="is not a hub id"):
        models.hub_snapshot(str(snaps / MAIN), cache_dir=hub)        # a local path


def test_the_engine_loads_the_revision_asked_for(hub: Path) -> None:
    from radixkv.api.engine import Engine
    from radixkv.config import CacheConfig
    from radixkv.engine.sampling import SamplingParams

    snaps = hub / "models--org--tiny" / "snapshots"
    small = CacheConfig(num_device_blocks=16)
    for revision, commit in ((None, MAIN), ("v2", V2)):
        engine = Engine.from_pretrained("org/tiny", cache_config=small, download_dir=str(hub),
                                        revision=revision, progress=False)
        try:
            weight = engine.model.get_input_embeddings().weight.detach()
            want = _embedding(snaps / commit).to(weight.dtype)
            other = _embedding(snaps / (V2 if commit == MAIN else MAIN)).to(weight.dtype)
            assert torch.equal(weight, want) and not torch.equal(weight, other), revision
            out = engine.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))
            assert len(out[0].outputs[0].token_ids) == 2
        finally:
            engine.close()
    with pytest.raises(ConfigError, match="'v3'"):   # before anything loads
        Engine.from_pretrained("org/tiny", download_dir=str(hub), revision="v3", progress=False)


def test_serve_flags_turn_the_hub_id_into_the_local_revision(hub: Path) -> None:
    from radixkv.server.cli import build_parser, check_flags, served_name

    snaps = hub / "models--org--tiny" / "snapshots"
    args = build_parser().parse_args(["org/tiny", "--download-dir", str(hub), "--revision",
                                      "v2", "--tokenizer", "org/tiny", "--tokenizer-revision",
                                      "main"])
    check_flags(args)
    assert args.model == str(snaps / V2) and args.tokenizer == str(snaps / MAIN)
    assert served_name(args) == "tiny"            # answers keep the hub id's name
    # a local path ignores them (as vLLM's loaders do), and --served-model-name still wins
    args = build_parser().parse_args([str(snaps / MAIN), "--download-dir", str(hub),
                                      "--revision", "v2"])
    check_flags(args)
    assert args.model == str(snaps / MAIN)
    args = build_parser().parse_args(["org/tiny", "--download-dir", str(hub),
                                      "--served-model-name", "mine"])
    check_flags(args)
    assert args.model == str(snaps / MAIN) and served_name(args) == "mine"
    with pytest.raises(ConfigError, match="allow downloads"):
        check_flags(build_parser().parse_args(["org/tiny", "--download-dir", str(hub),
                                               "--revision", "nope"]))
