"""Compile-time failures reach the user with the field or the library's reason, not Dynamo's
``BackendCompilerFailed`` wrapper (``backend='counting_backend' raised: ...``)."""

from __future__ import annotations

import os

import pytest
import torch
from toy_model import CompiledToyModel

from forwardkit.compilation.cache import UnsafeCacheDirError


def test_unknown_backend_is_rejected_at_config_time(make_config):
    with pytest.raises(ValueError, match="Invalid backend 'no_such_backend'"):
        make_config(mode=2, backend="no_such_backend")


def test_failing_user_backend_is_a_value_error_naming_the_field(make_config):
    model = CompiledToyModel(engine_config=make_config(mode=1, backend="os.path.join"), num_layers=1, hidden=16)
    with pytest.raises(ValueError, match=r"compilation_config.backend='os.path.join' failed .*TypeError"):
        model(torch.randn(4, 16))


def test_unsafe_cache_dir_reason_is_not_wrapped(make_config, tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", str(root))
    monkeypatch.delenv("FORWARDKIT_DISABLE_COMPILE_CACHE", raising=False)
    model = CompiledToyModel(engine_config=make_config(mode=3, backend="inductor"), num_layers=1, hidden=16)
    with pytest.raises(UnsafeCacheDirError, match="refusing to use compile cache directory") as info:
        model(torch.randn(4, 16))
    assert "counting_backend" not in str(info.value)
