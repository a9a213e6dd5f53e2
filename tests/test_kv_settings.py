"""Each KV setting is declared once (KVSettings): EngineConfig and the cache's config include
it rather than copy it, the engine hands every one to its cache, and the caches that tests and
MATS build without the engine run the product's defaults except where they say why."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from flashmemory.config import EngineConfig, RunSettings
from flashmemory.engine.sizing import plan_device, tiered_config
from flashmemory.errors import ConfigError
from flashmemory.guardrail_settings import GuardrailSettings
from flashmemory.kv_settings import MIB, KVSettings
from flashmemory.spec_settings import SpeculativeSettings
from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.serve.config import ServerConfig
from flashmemory.settings import default_of
from flashmemory.tools.mats import coherence, temporal
from tests.engine.test_sizing import QWEN, WEIGHTS
from tests.kvcache.synthetic import TINY_SETTINGS, tiny_config

PACKAGE = Path(__file__).resolve().parents[1] / "flashmemory"
CONFIG_CLASSES = (RunSettings, KVSettings, SpeculativeSettings, GuardrailSettings, EngineConfig,
                  TieredCacheConfig, ServerConfig)
# NOTE: the one name in two classes, on purpose: the user's spelling ("auto", "cuda:1") and
# the device start-up resolved it to (what the cache allocates on). The types differ.
RESOLVED = {"device": {RunSettings: "str", TieredCacheConfig: "torch.device"}}


def own_fields(cls: type) -> dict[str, str]:
    """The fields `cls` declares itself (its own annotations, not inherited), with their types."""
    annotations = cls.__dict__.get("__annotations__", {})
    return {f.name: str(annotations[f.name])
            for f in dataclasses.fields(cls) if f.name in annotations}


def declared_twice(classes: tuple[type, ...]) -> dict[str, dict[type, str]]:
    """Each field name that more than one of `classes` declares, with each declarer's type."""
    by_name: dict[str, dict[type, str]] = {}
    for cls in classes:
        for name, kind in own_fields(cls).items():
            by_name.setdefault(name, {})[cls] = kind
    return {name: owners for name, owners in by_name.items() if len(owners) > 1}


def test_no_kv_field_is_declared_in_two_dataclasses():
    assert declared_twice(CONFIG_CLASSES) == RESOLVED
    kv = [f.name for f in dataclasses.fields(KVSettings)]
    engine = [f.name for f in dataclasses.fields(EngineConfig)]
    speculative = [f.name for f in dataclasses.fields(SpeculativeSettings)]
    guardrail = [f.name for f in dataclasses.fields(GuardrailSettings)]
    # the order of old
    assert engine == list(own_fields(RunSettings)) + kv + speculative + guardrail
    assert own_fields(EngineConfig) == {}  # everything it has, it includes
    assert [f.name for f in dataclasses.fields(TieredCacheConfig)][:len(kv)] == kv


def test_a_setting_declared_again_in_a_subclass_is_caught():
    @dataclasses.dataclass
    class Copied(KVSettings):
        """A cache config copying a setting with its own default: what the test above forbids."""

        active_window: int = 16

    assert set(declared_twice((KVSettings, Copied))) == {"active_window"}


def _classes_with_settings() -> set[str]:
    """module.Class of each class in the package with a field declared by setting(...)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            calls = [c for stmt in node.body if isinstance(stmt, ast.AnnAssign)
                     for c in ast.walk(stmt) if isinstance(c, ast.Call)]
            if any(getattr(c.func, "id", None) == "setting" for c in calls):
                found.add(f"{module}.{node.name}")
    return found


def test_every_dataclass_of_settings_is_checked_for_copies():
    checked = {f"{cls.__module__}.{cls.__name__}" for cls in CONFIG_CLASSES}
    assert _classes_with_settings() <= checked


def test_the_engine_gives_its_cache_every_kv_setting_as_set():
    changed = dict(active_window=1024, recent_fp16_tokens=64, selection_box_tokens=8,
                   warm_budget_fraction=0.5, warm_budget_tokens=512, max_num_seqs=2,
                   prefetch_strategy="adaptive", prefetch_budget_mb=8.5, device_staging_mb=2.0,
                   prefix_cache_host_mb=12.25, prefix_cache_disk_mb=0, block_size="auto")
    cfg = EngineConfig(**changed)
    block = cfg.resolve_block_size(32768)
    plan = plan_device(cfg, QWEN, WEIGHTS, torch.float32, block)
    cache_cfg = tiered_config(cfg, QWEN, plan, block, torch.device("cpu"), "qwen")
    given = {n: getattr(cache_cfg, n) for n in KVSettings.kv_field_names()}
    assert given == {**cfg.kv_settings(), "block_size": 32}  # "auto" at 32K
    assert cache_cfg.prefetch_budget_bytes == int(8.5 * MIB)
    assert cache_cfg.device_staging_bytes == 2 * MIB == plan.device_staging_bytes
    assert cache_cfg.prefix_cache_host_bytes == int(12.25 * MIB)
    assert cache_cfg.prefix_cache_disk_bytes == 0


def test_the_cache_config_refuses_what_the_engine_refuses():
    with pytest.raises(ConfigError, match="warm_budget_fraction"):
        tiny_config(warm_budget_fraction=0)
    with pytest.raises(ConfigError, match="needs a prefetcher"):
        tiny_config(device_staging_mb=1.0)
    with pytest.raises(ConfigError, match="resolve 'auto'"):
        tiny_config(block_size="auto")


def _varied(cfg: KVSettings) -> set[str]:
    """The KV settings of `cfg` that differ from the product's defaults."""
    names = KVSettings.kv_field_names()
    return {n for n in names if getattr(cfg, n) != default_of(KVSettings, n)}


# What each MATS suite sets on purpose; the reason is in a comment where it sets them.
MATS_1 = {"kv_precision", "cold_zone_enabled", "selection", "attention_backend",
          "active_window", "warm_tokens", "block_size", "max_num_seqs", "cold_zone_dir",
          "semantic_truncate_threshold", "warm_budget_tokens"}
MATS_2 = {"kv_precision", "attention_backend", "prefetch_strategy", "prefetch_ranker",
          "active_window", "warm_tokens", "block_size", "max_num_seqs", "cold_zone_dir",
          "semantic_truncate_threshold", "warm_budget_tokens", "selection_min_tokens",
          "prefetch_budget_mb", "device_staging_mb"}
# Defaults these builders once had their own of, which changed what they tested: no FP16
# recent rows, one digest box per block, no cap on the share of L1 a step reads.
ONCE_DIFFERENT = {"recent_fp16_tokens", "selection_box_tokens", "warm_budget_fraction"}


def test_synthetic_and_mats_caches_use_the_product_defaults(tmp_path):
    cpu = torch.device("cpu")
    assert _varied(tiny_config()) == set(TINY_SETTINGS)
    for config in temporal.CONFIGS:
        cfg = config.cache_config(temporal.GEOMETRY, str(tmp_path), cpu)
        assert _varied(cfg) <= MATS_1, config.name
    for config in coherence.CONFIGS:
        assert _varied(config.cache_config(str(tmp_path), cpu)) <= MATS_2, config.name
    assert not ONCE_DIFFERENT & (MATS_1 | MATS_2 | set(TINY_SETTINGS))
