"""Settings metadata on EngineConfig and ServerConfig: every field is documented, and its bounds and choices are
enforced with a ConfigError that names the field."""

from __future__ import annotations

import pytest

from flashmemory.config import EngineConfig
from flashmemory.errors import ConfigError
from flashmemory.serve.config import ServerConfig
from flashmemory.settings import describe_bounds, field_names, field_type, setting_of

CLASSES = (EngineConfig, ServerConfig)
FIELDS = [(cls, name) for cls in CLASSES for name in field_names(cls)]
BOUNDED = [(cls, name) for cls, name in FIELDS if describe_bounds(setting_of(cls, name))]
CHOSEN = [(cls, name) for cls, name in FIELDS if setting_of(cls, name).choices]


def ids(cases: list[tuple[type, str]]) -> list[str]:
    return [f"{cls.__name__}.{name}" for cls, name in cases]


def build(cls: type, **changes: object) -> object:
    # Partners that keep cross-field rules out of the value under test: block_size="auto"
    # (active_window >= block_size), a draft model for speculative_method="draft", the shortest
    # n-gram for the longest.
    base = {"block_size": "auto"} if cls is EngineConfig and "block_size" not in changes else {}
    if cls is EngineConfig and changes.get("speculative_method") == "draft":
        base["draft_model_path"] = "draft.gguf"
    if cls is EngineConfig and "prompt_lookup_max" in changes:
        base["prompt_lookup_min"] = 1
    return cls(**{**base, **changes})


def outside(cls: type, name: str) -> list[float]:
    """Values just past each bound of the field."""
    s, step = setting_of(cls, name), 1 if field_type(cls, name).numeric is int else 0.5
    return [v for v in (s.ge - step if s.ge is not None else None, s.gt, s.le + step if s.le is not None else None,
                        s.lt) if v is not None]


@pytest.mark.parametrize(("cls", "name"), FIELDS, ids=ids(FIELDS))
def test_every_setting_has_help_text(cls, name):
    assert len(setting_of(cls, name).help) > 10


@pytest.mark.parametrize(("cls", "name"), BOUNDED, ids=ids(BOUNDED))
def test_a_value_outside_its_bounds_is_a_config_error_naming_the_setting(cls, name):
    values = outside(cls, name)
    assert values
    for value in values:
        with pytest.raises(ConfigError, match=rf"^{name}={value!r} must be "):
            build(cls, **{name: value})


@pytest.mark.parametrize(("cls", "name"), BOUNDED, ids=ids(BOUNDED))
def test_an_inclusive_bound_is_accepted(cls, name):
    s = setting_of(cls, name)
    for value in (s.ge, s.le):
        if value is not None:
            assert getattr(build(cls, **{name: value}), name) == value


@pytest.mark.parametrize(("cls", "name"), BOUNDED, ids=ids(BOUNDED))
def test_a_setting_of_the_wrong_type_is_a_config_error(cls, name):
    with pytest.raises(ConfigError, match=name):
        build(cls, **{name: "12"})
    with pytest.raises(ConfigError, match=name):
        build(cls, **{name: True})


@pytest.mark.parametrize(("cls", "name"), CHOSEN, ids=ids(CHOSEN))
def test_a_value_outside_its_choices_is_a_config_error_listing_them(cls, name):
    with pytest.raises(ConfigError) as e:
        build(cls, **{name: "no-such-choice"})
    message = str(e.value)
    assert message.startswith(f"{name}='no-such-choice': use ")
    assert all(repr(choice) in message for choice in setting_of(cls, name).choices)


@pytest.mark.parametrize(("cls", "name"), CHOSEN, ids=ids(CHOSEN))
def test_every_choice_is_accepted(cls, name):
    for choice in setting_of(cls, name).choices:
        changes = {name: choice}
        if name == "block_size" and isinstance(choice, int):
            changes["active_window"] = max(choice, 2048)
        assert getattr(build(cls, **changes), name) == choice


def test_block_size_takes_whole_numbers_only():
    with pytest.raises(ConfigError, match="block_size=16.0"):
        EngineConfig(block_size=16.0)


def test_optional_settings_accept_none():
    optional = [(cls, name) for cls, name in FIELDS if field_type(cls, name).optional]
    assert ("max_seq_len" in [n for _, n in optional]) and ("max_num_batched_tokens" in [n for _, n in optional])
    for cls, name in optional:
        assert getattr(build(cls, **{name: None}), name) is None


def test_cross_field_rules_still_hold():
    with pytest.raises(ConfigError, match="active_window=8 must be at least block_size=16"):
        EngineConfig(active_window=8, block_size=16)
    with pytest.raises(ConfigError, match="device_staging_mb=8 needs a prefetcher"):
        EngineConfig(device_staging_mb=8)
    with pytest.raises(ConfigError, match="refusing to listen on 10.0.0.1 without an API key"):
        ServerConfig(host="10.0.0.1")
    with pytest.raises(ConfigError, match="log_level='loud'"):
        ServerConfig(log_level="loud")
    assert ServerConfig(log_level="WARNING").log_level == "WARNING"  # any case, as uvicorn takes it
