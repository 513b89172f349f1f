"""The remote value format alone (no server): any damage to a value is BadValue, never a wrong
block and never another exception."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.storage.layout import KVLayout
from radixkv.storage.remote_format import (BadValue, decode_value, encode_value, header_len,
                                           key_prefix)
from test_remote import HmacSigner

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16")
NS = LAY.fingerprint("m")
H, PARENT = bytes(range(16)), bytes(range(16, 32))
PAYLOAD = os.urandom(LAY.bytes_per_block)
SIGNER = HmacSigner(b"x" * 32)


def _value(signer=None) -> bytes:
    return encode_value(NS, H, PARENT, (1, 2, 3, 2**31 - 1), LAY, memoryview(PAYLOAD), signer)


@pytest.mark.parametrize("signer", [None, SIGNER])
def test_round_trip(signer):
    b = decode_value(_value(signer), NS, H, LAY, signer)
    assert (bytes(b.payload), b.token_ids, b.parent_hash) == (PAYLOAD, (1, 2, 3, 2**31 - 1),
                                                              PARENT)
    assert len(_value(signer)) == header_len(4) + len(PAYLOAD) + (32 if signer else 0)


def test_keys_separate_signers_and_namespaces():
    assert len({key_prefix("p", NS, None), key_prefix("p", NS, SIGNER),
                key_prefix("p", LAY.fingerprint("m", salt="t"), None),
                key_prefix("q", NS, None)}) == 4


@given(data=st.data(), signed=st.booleans())
def test_any_damage_is_bad_value(data, signed):
    signer = SIGNER if signed else None
    good = _value(signer)
    v = bytearray(good)
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "splice"]))
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(v) - 1))
            v[i] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        v = v[:data.draw(st.integers(0, len(v) - 1))]
    elif op == "insert":
        i = data.draw(st.integers(0, len(v)))
        v[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        i = data.draw(st.integers(0, len(v) - 1))
        v = v[:i] + bytearray(os.urandom(len(v) - i))
    if bytes(v) == good:
        return
    with pytest.raises(BadValue):
        decode_value(bytes(v), NS, H, LAY, signer)
