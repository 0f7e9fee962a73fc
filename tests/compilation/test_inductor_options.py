"""``inductor_passes`` reach Inductor and ``compilation_time`` is recorded (mode 3, Inductor)."""

from __future__ import annotations

import torch
import toy_model
from toy_model import CompiledToyModel, ToyModel


def test_user_inductor_pass_runs_and_compile_time_is_recorded(make_config):
    toy_model.PASS_SEEN.clear()
    # Compile for real: no forwardkit cache and no Inductor FX-graph cache (a graph loaded from
    # either one ran its passes when it was first compiled, maybe in another process).
    cfg = make_config(mode=3, backend="inductor", compile_ranges_split_points=[],
                      inductor_compile_config={"force_disable_caches": True},
                      inductor_passes={"post_grad_custom_post_pass": "toy_model.count_nodes_pass"})
    model, ref = CompiledToyModel(engine_config=cfg, num_layers=1), ToyModel(num_layers=1)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
    assert toy_model.PASS_SEEN, "the user's post-grad pass never ran"
    assert all(n > 0 for n in toy_model.PASS_SEEN)
    assert cfg.compilation_config.compilation_time > 0
