"""The CPU as read from /proc/cpuinfo: the flags line native builds are keyed by, what reports
record."""

from __future__ import annotations

from flashmemory import cpu_features


def test_the_flags_are_the_flags_line_split():
    line = cpu_features.flags_line()
    assert line
    if ":" in line:  # a Linux /proc/cpuinfo
        assert cpu_features.flags() == frozenset(line.partition(":")[2].split())


def test_describe_names_only_reported_flags_this_cpu_has():
    record = cpu_features.describe()
    assert record["model"]
    assert set(record["flags"]) <= set(cpu_features.REPORTED_FLAGS) & cpu_features.flags()
    assert cpu_features.has_amx() == ("amx_tile" in cpu_features.flags())
