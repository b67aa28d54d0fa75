"""Strategy and OuterStrategy: the values code asks instead of comparing names."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

import funcshard as fs
from funcshard.layout.strategy import OuterStrategy, Strategy

PREDICATES = {
    # name: (shards_optim, shards_grads, shards_params)
    "no_shard": (False, False, False),
    "optim": (True, False, False),
    "optim_grads": (True, True, False),
    "optim_grads_params": (True, True, True),
}


@pytest.mark.parametrize("name", list(PREDICATES))
def test_predicates_are_the_zero_stages(name: str) -> None:
    s = Strategy.parse(name)
    assert (s.shards_optim, s.shards_grads, s.shards_params) == PREDICATES[name]
    assert s.runs_units == s.shards_grads
    assert s.keeps_full_compute == (not s.shards_params)


def test_a_strategy_is_its_name_for_users_and_files() -> None:
    s = Strategy.OPTIM_GRADS
    assert s == "optim_grads" and str(s) == "optim_grads" and f"{s}" == "optim_grads"
    assert json.dumps({"strategy": s}) == '{"strategy": "optim_grads"}'
    assert fs.STRATEGIES == tuple(PREDICATES)
    assert Strategy.parse(s) is s


def test_an_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'.*optim_grads_params"):
        Strategy.parse("zero3")
    with pytest.raises(ValueError, match=r"unknown outer strategy 'optim_grads'"):
        OuterStrategy.parse("optim_grads", what="outer strategy")


def test_outer_strategy_room() -> None:
    assert not OuterStrategy.parse("no_shard").shards_optim
    assert OuterStrategy.OPTIM.shards_optim


def test_no_strategy_name_is_compared_outside_its_definition() -> None:
    """The reader's rule of the step's shape: code asks predicates, never names."""
    root = pathlib.Path(fs.__file__).parent
    names = "|".join(PREDICATES)
    compare = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']""")
    offenders = [
        f"{path.relative_to(root)}:{i}"
        for path in root.rglob("*.py")
        if path.name != "strategy.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if compare.search(line)
    ]
    assert not offenders, f"strategy names compared in {offenders}"
