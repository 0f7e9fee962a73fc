"""``InductorPass.hash_dict`` / ``hash_source``: the static helpers custom passes use in ``uuid()``
(as vLLM's unit tests call them)."""

from __future__ import annotations

import hashlib
import json

from forwardkit.compilation.passes import InductorPass


class MyPass(InductorPass):
    def __init__(self, settings: dict) -> None:
        self.settings = settings

    def __call__(self, graph) -> None:
        return None

    def uuid(self) -> str:
        return self.hash_source(self, self.hash_dict(self.settings))


def helper(x):
    return x + 1


def test_hash_dict_is_key_order_independent_and_value_sensitive():
    a = InductorPass.hash_dict({"a": 1, "b": [1, 2]})
    assert a == InductorPass.hash_dict({"b": [1, 2], "a": 1})
    assert a == hashlib.sha256(json.dumps({"a": 1, "b": [1, 2]}, sort_keys=True).encode()).hexdigest()
    assert a != InductorPass.hash_dict({"a": 2, "b": [1, 2]})


def test_hash_source_of_strings_functions_classes_and_instances():
    assert InductorPass.hash_source("x", "y") == hashlib.sha256(b"xy").hexdigest()
    assert InductorPass.hash_source(MyPass({})) == InductorPass.hash_source(MyPass)
    assert InductorPass.hash_source(helper) != InductorPass.hash_source(MyPass)
    assert MyPass({"k": 1}).uuid() == MyPass({"k": 1}).uuid() != MyPass({"k": 2}).uuid()
