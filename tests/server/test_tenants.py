"""API keys -> cache salts (radixkv/server/tenants.py): the rules behind the tenant guarantee."""

from __future__ import annotations

import pytest

from radixkv.errors import ConfigError
from radixkv.server.tenants import Tenants, read_keys


def test_keys_authenticate_and_get_distinct_salts_that_never_contain_the_key():
    t = Tenants.create(["sk-a", "sk-b"], secret="s")
    assert t.authenticate("Bearer sk-a") == "sk-a"
    assert t.authenticate("Bearer sk-c") is None
    assert t.authenticate(None) is None and t.authenticate("sk-a") is None
    a, b = t.cache_salt("sk-a", None), t.cache_salt("sk-b", None)
    assert a != b and "sk-a" not in a
    # a request salt narrows within its key and never reaches another key's namespace
    assert t.cache_salt("sk-a", "u1").startswith(a + "|")
    assert t.cache_salt("sk-a", "u1") != t.cache_salt("sk-b", "u1")
    # the same secret derives the same salts (a restarted server reuses its disk cache)
    assert Tenants.create(["sk-a"], secret="s").cache_salt("sk-a", None) == a
    assert Tenants.create(["sk-a"], secret="other").cache_salt("sk-a", None) != a


def test_without_keys_everyone_is_one_tenant_and_request_salts_choose():
    t = Tenants.create([])
    assert t.authenticate(None) == ""
    assert t.cache_salt("", None) is None and t.cache_salt("", "x") == "x"


def test_key_files(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nsk-1\n\n  sk-2  \n")
    assert read_keys(["sk-0"], [str(f)]) == ["sk-0", "sk-1", "sk-2"]
    with pytest.raises(ConfigError):
        read_keys([], [str(tmp_path / "missing")])
    with pytest.raises(ConfigError):
        read_keys(["has space"], [])


def test_vllm_api_key_from_the_environment_unless_keys_are_given(tmp_path):
    """vllm serve reads VLLM_API_KEY when --api-key is not given; a deployment that sets it
    must not get an open radixkv server. Keys on the command line or in a file win."""
    env = {"VLLM_API_KEY": " sk-env "}
    assert read_keys([], [], env) == ["sk-env"]
    assert read_keys(["sk-cli"], [], env) == ["sk-cli"]
    f = tmp_path / "keys.txt"
    f.write_text("sk-file\n")
    assert read_keys([], [str(f)], env) == ["sk-file"]
    assert read_keys([], [], {"VLLM_API_KEY": "  "}) == []   # empty: no key, as vLLM
    assert read_keys([], [], {}) == []
