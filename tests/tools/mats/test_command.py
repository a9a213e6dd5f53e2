"""The `flashmemory-test mats` command line refuses what it cannot run, with a message that says why."""

from __future__ import annotations

import pytest

from flashmemory.tools import testing_cli


@pytest.mark.parametrize("argv, message", [
    (["mats", "--level", "4"], "invalid choice: 4"),
    (["mats", "--duration", "0"], "--duration must be > 0"),
    (["mats", "--duration", "soon"], "--duration takes a number of seconds, got 'soon'"),
    (["mats", "--duration", "nan"], "--duration must be > 0"),
    (["mats", "--seed", "-1"], "--seed must be at least 0"),
    (["mats", "--level", "1", "--model", "x.gguf"], "--model applies to --level 2 (its engine case) and 3 only"),
    (["mats", "--level", "2", "--concurrency", "2"], "--concurrency apply to --level 3 only"),
    (["mats", "--json", "/no/such/folder/r.json"], "--json /no/such/folder/r.json: the folder"),
    (["mats", "--level", "3", "--model", "/no/such/model.gguf"], "--model /no/such/model.gguf: no such file"),
    (["mats", "--workdir", "/no/such/folder"], "--workdir /no/such/folder: not a writable folder"),
    ([], "the following arguments are required: SUITE"),
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        testing_cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_names_every_level(capsys):
    with pytest.raises(SystemExit) as e:
        testing_cli.main(["mats", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(f"MATS-{n}" in out for n in (1, 2, 3)) and "--duration S" in out
