"""Disk-tier faults found by the hardening pass (issue 18): a FIFO under a block-file name must
not hang a scan or a read (item 2); a block whose payload was swapped and whose checksums were
recomputed must not be served by an authenticated store (item 7)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import xxhash

from radixkv.errors import ConfigError
from radixkv.storage.disk import DiskStore
from radixkv.storage.disk_format import decode_header, encode_header
from radixkv.storage.integrity import SECRET_ENV, BlockSigner, signer_from

SECRET = "sixteen+ byte test secret"


def _in_thread(fn, timeout=10.0):
    """Run ``fn`` in a daemon thread; fail (instead of hanging the suite) if it blocks."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (harness: re-raised in the test thread)
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"blocked for more than {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_under_a_block_name_does_not_hang_scan_or_read(store, make_block, rand_hash):
    good = rand_hash()
    assert store.put(good, None, range(4), make_block(1))
    h = rand_hash()
    fifo = store.path_of(h)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    fresh = _in_thread(lambda: DiskStore(store.root, store.layout, store.namespace))
    assert [e.block_hash for e in fresh.entries()] == [good]
    assert fresh.stats().foreign == 1 and fifo.exists()        # not ours: left in place
    assert _in_thread(lambda: fresh.get(h)) is None              # a read is a miss, at once
    report = _in_thread(lambda: fresh.scan(verify_payload=True))
    assert report.foreign == 1 and len(report.entries) == 1
    assert torch.equal(fresh.get(good), make_block(1))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_non_directories_among_the_fan_out_folders_are_skipped(store, make_block, rand_hash):
    good = rand_hash()
    assert store.put(good, None, range(4), make_block(1))
    os.mkfifo(store.dir / "zz")                 # a FIFO and a file where a fan-out folder goes
    (store.dir / "yy").write_bytes(b"x")
    fresh = _in_thread(lambda: DiskStore(store.root, store.layout, store.namespace))
    assert [e.block_hash for e in fresh.entries()] == [good]
    assert (store.dir / "zz").exists() and (store.dir / "yy").exists()


def test_directory_under_a_block_name_is_skipped(store, rand_hash):
    h = rand_hash()
    store.path_of(h).mkdir(parents=True)
    fresh = DiskStore(store.root, store.layout, store.namespace)
    assert len(fresh) == 0 and fresh.get(h) is None


def _swap_payloads(store, h1, h2):
    """The attack: exchange the payloads of two block files and rewrite both headers with
    checksums recomputed (as anyone with write access to the directory can)."""
    files = {}
    for h in (h1, h2):
        raw = store.path_of(h).read_bytes()
        hdr = decode_header(raw)
        files[h] = (hdr, raw[hdr.header_len:])
    for h, other in ((h1, h2), (h2, h1)):
        hdr, _ = files[h]
        payload = files[other][1]
        header = encode_header(hdr.namespace, hdr.block_hash, hdr.parent_hash, hdr.token_ids,
                               store.layout, xxhash.xxh3_64_intdigest(payload))
        if hdr.key_id is not None:   # the forger has no key: replay the old key id and MAC
            header = _resign_with(hdr, store, payload)
        store.path_of(h).write_bytes(header + payload)


def _resign_with(hdr, store, payload):
    """A version-2 header carrying the original key id and MAC, checksums fixed up."""
    class Fake:   # a "signer" that replays the old key id and MAC
        key_id = hdr.key_id

        @staticmethod
        def mac(*parts):
            return hdr.mac
    return encode_header(hdr.namespace, hdr.block_hash, hdr.parent_hash, hdr.token_ids,
                         store.layout, xxhash.xxh3_64_intdigest(payload), Fake, payload)


def test_unsigned_store_serves_swapped_payloads(store, make_block, rand_hash):
    """Why the option exists: checksums alone accept the swap."""
    h1, h2 = rand_hash(), rand_hash()
    store.put(h1, None, range(4), make_block(1))
    store.put(h2, None, range(4), make_block(2))
    _swap_payloads(store, h1, h2)
    fresh = DiskStore(store.root, store.layout, store.namespace)
    assert torch.equal(fresh.get(h1), make_block(2))


def test_signed_store_refuses_forged_blocks(tmp_path, layout, namespace, make_block, rand_hash):
    store = DiskStore(tmp_path, layout, namespace, signer=BlockSigner(SECRET))
    h1, h2, h3 = rand_hash(), rand_hash(), rand_hash()
    for i, h in enumerate((h1, h2, h3)):
        assert store.put(h, None, range(4), make_block(i))
    assert torch.equal(store.get(h1), make_block(0))
    _swap_payloads(store, h1, h2)
    fresh = DiskStore(tmp_path, layout, namespace, signer=BlockSigner(SECRET))
    assert len(fresh) == 3               # the cheap scan reads headers only: key id is ours
    assert fresh.get(h1) is None and fresh.get(h2) is None   # forged: misses
    assert fresh.stats().forged == 2 and not fresh.path_of(h1).exists()
    assert torch.equal(fresh.get(h3), make_block(2))         # untouched blocks still served
    assert len(fresh.scan(verify_payload=True).entries) == 1


def test_deep_scan_counts_forged_files(tmp_path, layout, namespace, make_block, rand_hash):
    signer = BlockSigner(SECRET)
    store = DiskStore(tmp_path, layout, namespace, signer=signer)
    h1, h2 = rand_hash(), rand_hash()
    store.put(h1, None, range(4), make_block(1))
    store.put(h2, None, range(4), make_block(2))
    _swap_payloads(store, h1, h2)
    report = DiskStore(tmp_path, layout, namespace, signer=signer, scan=False).scan(
        verify_payload=True)
    assert report.forged == 2 and report.entries == ()


def test_keys_and_versions(tmp_path, layout, namespace, make_block, rand_hash):
    """Unsigned (v1) files stay readable by unsigned stores; a signed store serves only its own
    key's blocks; an unsigned store reads signed blocks (checksums only)."""
    plain = DiskStore(tmp_path, layout, namespace)
    h_plain, h_signed, h_other = rand_hash(), rand_hash(), rand_hash()
    plain.put(h_plain, None, range(4), make_block(1))
    DiskStore(tmp_path, layout, namespace, signer=BlockSigner(SECRET)).put(
        h_signed, None, range(4), make_block(2))
    DiskStore(tmp_path, layout, namespace, signer=BlockSigner("another key, long enough")).put(
        h_other, None, range(4), make_block(3))
    signed = DiskStore(tmp_path, layout, namespace, signer=BlockSigner(SECRET))
    assert {e.block_hash for e in signed.entries()} == {h_signed}
    assert signed.get(h_plain) is None and signed.get(h_other) is None
    assert signed.stats().foreign >= 2 and signed.stats().forged == 0
    assert plain.path_of(h_plain).exists() and plain.path_of(h_other).exists()  # left alone
    reader = DiskStore(tmp_path, layout, namespace)
    for h, seed in ((h_plain, 1), (h_signed, 2), (h_other, 3)):
        assert torch.equal(reader.get(h), make_block(seed))


def test_signer_from_config_and_environment(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert signer_from(None) is None
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert signer_from(None).key_id == BlockSigner(SECRET).key_id
    assert signer_from("an explicit secret!!").key_id != BlockSigner(SECRET).key_id
    assert SECRET not in repr(signer_from(None))
    with pytest.raises(ConfigError):
        BlockSigner("short")
