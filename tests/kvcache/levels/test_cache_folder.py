"""The persistent cache's folder: refused unless private, its files never opened through a link,
created 0600."""

from __future__ import annotations

import os

import pytest

from flashmemory.errors import ConfigError
from flashmemory.kvcache.levels.cache_folder import KEY_NAME, CacheFolder
from flashmemory.kvcache.levels.disk_pool import DiskPool
from flashmemory.kvcache.quant import Codec

LAYERS, HEADS, BS, DIM = 2, 2, 8, 16


def _persistent(folder) -> DiskPool:
    return DiskPool(Codec(2, BS, 16), 4, LAYERS, HEADS, BS, DIM, folder, b"model", persistent=True)


def test_symlinked_cold_file_is_refused_not_followed(tmp_path):
    folder, victim = tmp_path / "kv", tmp_path / "victim.txt"
    folder.mkdir(mode=0o700)
    victim.write_bytes(b"precious data!")  # 14 bytes outside the cache's folder
    os.symlink(victim, folder / "kv-cache.cold")
    with pytest.raises(ConfigError, match="symbolic link.*remove it"):
        _persistent(folder)
    assert victim.read_bytes() == b"precious data!"


def test_hard_linked_cold_file_is_refused(tmp_path):
    folder, victim = tmp_path / "kv", tmp_path / "victim.txt"
    folder.mkdir(mode=0o700)
    victim.write_bytes(b"precious data!")
    os.link(victim, folder / "kv-cache.cold")
    with pytest.raises(ConfigError, match="hard link"):
        _persistent(folder)
    assert victim.read_bytes() == b"precious data!"


def test_symlinked_cache_key_is_refused(tmp_path):
    folder, secret = tmp_path / "kv", tmp_path / "elsewhere"
    folder.mkdir(mode=0o700)
    secret.write_bytes(os.urandom(32))
    os.symlink(secret, folder / KEY_NAME)
    with pytest.raises(ConfigError, match="cache key .* refused"):
        _persistent(folder)


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
