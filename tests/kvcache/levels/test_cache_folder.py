"""The persistent cache's folder: refused unless private; its files never opened through a link
(a link is replaced by a new file, never followed) and created 0600."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache.levels.cache_folder import KEY_NAME, CacheFolder
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.quant import Codec

LAYERS, HEADS, BS, DIM = 2, 2, 8, 16


def _persistent(folder) -> DiskPool:
    return DiskPool(Codec(2, BS, 16), 4, LAYERS, HEADS, BS, DIM, folder, b"model", persistent=True)


@pytest.mark.parametrize("link", [os.symlink, os.link])
def test_symlinked_cold_file_is_refused_not_followed(tmp_path, caplog, link):
    folder, victim = tmp_path / "kv", tmp_path / "victim.txt"
    folder.mkdir(mode=0o700)
    victim.write_bytes(b"precious data!")  # 14 bytes outside the cache's folder
    link(victim, folder / "kv-cache.cold")
    with caplog.at_level(logging.WARNING):
        pool = _persistent(folder)  # starts: the link is not the cache's file
    pool.put(0, pool.codec.encode(*[torch.randn(LAYERS, HEADS, BS, DIM)] * 2))
    pool.close()
    assert victim.read_bytes() == b"precious data!" and "is refused" in caplog.text
    cold = os.lstat(folder / "kv-cache.cold")
    assert stat.S_ISREG(cold.st_mode) and cold.st_nlink == 1 and cold.st_mode & 0o777 == 0o600
    assert pool.counters()["files_refused"] == 1


def test_a_folder_where_the_cold_file_should_be_is_a_clear_error(tmp_path):
    (tmp_path / "kv-cache.cold").mkdir()
    with pytest.raises(ConfigError, match="not a plain file of yours and cannot be removed"):
        _persistent(tmp_path)


def test_symlinked_cache_key_is_replaced_not_read(tmp_path):
    folder, secret = tmp_path / "kv", tmp_path / "elsewhere"
    folder.mkdir(mode=0o700)
    secret.write_bytes(b"k" * 32)
    os.symlink(secret, folder / KEY_NAME)
    _persistent(folder).close()
    assert not (folder / KEY_NAME).is_symlink() and (folder / KEY_NAME).read_bytes() != b"k" * 32
    assert secret.read_bytes() == b"k" * 32


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_a_folder_others_can_write_is_refused_with_the_fix(tmp_path, mode):
    folder = tmp_path / "kv"
    folder.mkdir()
    os.chmod(folder, mode)
    with pytest.raises(ConfigError, match=f"writable by other users .*chmod go-w {folder}"):
        _persistent(folder)
    assert not (folder / "kv-cache.cold").exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a folder away needs root")
def test_a_folder_of_another_user_is_refused_with_the_fix(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    os.chown(folder, 12345, 12345)
    fix = f"chown {os.geteuid()} {folder}"
    with pytest.raises(ConfigError, match=f"belongs to another user .*{fix}"):
        _persistent(folder)


def test_a_new_folder_is_made_private(tmp_path):
    pool = _persistent(tmp_path / "new" / "kv")
    pool.close()
    assert (tmp_path / "new" / "kv").stat().st_mode & 0o777 == 0o700


def test_a_cold_file_others_could_read_is_made_owner_only(tmp_path):
    pool = _persistent(tmp_path)
    pool.close()
    os.chmod(tmp_path / "kv-cache.cold", 0o644)  # e.g. written by an older version, or copied in
    _persistent(tmp_path).close()
    assert (tmp_path / "kv-cache.cold").stat().st_mode & 0o777 == 0o600


def test_a_stale_temporary_file_is_replaced_by_a_new_one(tmp_path):
    folder = CacheFolder(tmp_path)
    (tmp_path / "x.tmp").write_bytes(b"left by a crash")
    fd = folder.create_temp("x.tmp")
    os.write(fd, b"new")
    os.close(fd)
    folder.close()
    temp = tmp_path / "x.tmp"
    assert temp.read_bytes() == b"new" and temp.stat().st_mode & 0o777 == 0o600
