"""The placement mode (path / tree) has one home, ``kvstate.prefix.placement.Placement``: both configurations
parse through it, keep reading and writing the strings "path" / "tree", and refuse anything else in one line."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from kvstate.errors import BudgetError, KVStateError
from kvstate.prefix.config import PrefixCacheConfig
from kvstate.prefix.placement import Placement
from kvstate.prefix.store_types import StoreConfig


@pytest.mark.parametrize("value,mode", [("path", Placement.PATH), ("tree", Placement.TREE),
                                        (Placement.TREE, Placement.TREE)])
def test_parse_takes_the_exact_names_and_members(value, mode):
    assert Placement.parse(value) is mode


@pytest.mark.parametrize("bad", ["forest", "TREE", " tree", "", None, 1, ["tree"]])
def test_parse_refuses_anything_else_naming_value_option_and_choices(bad):
    with pytest.raises(KVStateError) as info:
        Placement.parse(bad, option="--placement")
    msg = str(info.value)
    assert msg.startswith(f"--placement={bad!r} ") and "path, tree" in msg and "\n" not in msg


def test_both_configs_normalise_to_the_mode_and_json_keeps_the_string():
    cfg = PrefixCacheConfig(1 << 20, placement="tree")
    store_cfg = StoreConfig(1 << 20, placement="tree")
    assert cfg.placement is Placement.TREE and store_cfg.placement is Placement.TREE
    assert PrefixCacheConfig(1 << 20).placement is Placement.PATH and StoreConfig(1 << 20).placement is Placement.PATH
    assert json.loads(json.dumps(asdict(cfg)))["placement"] == "tree"
    assert f"{cfg.placement}" == "tree"


def test_each_config_raises_its_own_error_class():
    with pytest.raises(KVStateError, match=r"^placement='forest' "):
        PrefixCacheConfig(1 << 20, placement="forest")
    with pytest.raises(BudgetError, match=r"^placement='forest' "):
        StoreConfig(1 << 20, placement="forest")
