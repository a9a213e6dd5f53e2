"""Settings whose values name a registry entry list exactly the registry's names.

config.py sits at the bottom layer (tests/test_layering.py) and docs/configuration.md is generated
from its static `choices`, so it cannot read the registries (they import the cache and the engine);
this test keeps the two lists one in fact: a new backend or policy fails here until it is a choice.
"""

from __future__ import annotations

from flashmemory.config import EngineConfig
from flashmemory.engine.scheduling_policy import POLICIES
from flashmemory.kvcache.attention.registry import AUTO_ORDER, BACKENDS
from flashmemory.settings import setting_of


def test_attention_backend_choices_are_the_registry_names():
    choices = setting_of(EngineConfig, "attention_backend").choices
    assert sorted(choices) == sorted(["auto", *BACKENDS]), (
        "EngineConfig.attention_backend's choices must be 'auto' plus the names in "
        "kvcache/attention/registry.py BACKENDS; add or remove the name in config.py")
    assert sorted(AUTO_ORDER) == sorted(BACKENDS), "AUTO_ORDER ranks every backend exactly once"


def test_scheduling_policy_choices_are_the_registry_names():
    choices = setting_of(EngineConfig, "scheduling_policy").choices
    assert sorted(choices) == sorted(POLICIES), (
        "EngineConfig.scheduling_policy's choices must be the names in "
        "engine/scheduling_policy.py POLICIES; add or remove the name in config.py")
