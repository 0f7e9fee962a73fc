"""The forward context is per thread and per asyncio task (a ContextVar), nests, restores."""

from __future__ import annotations

import asyncio
import threading

import pytest

from forwardkit.config.engine import EngineConfig
from forwardkit.forward_context import (
    create_forward_context,
    get_forward_context,
    is_forward_context_available,
    override_forward_context,
    set_forward_context,
)

CFG = EngineConfig()


def test_threads_see_only_their_own_context():
    n_threads, steps = 4, 50
    barrier = threading.Barrier(n_threads)
    errors: list[str] = []
    seen_outside: list[bool] = []
    finished: list[int] = []

    def body(i: int) -> None:
        seen_outside.append(is_forward_context_available())
        for step in range(steps):
            with set_forward_context({"worker": i, "step": step}, CFG, num_tokens=i + 1):
                if step == 0:
                    barrier.wait(timeout=10)  # all threads inside a context at once
                md = get_forward_context().attn_metadata
                if md != {"worker": i, "step": step}:
                    errors.append(f"thread {i} step {step} saw {md}")
        if is_forward_context_available():
            errors.append(f"thread {i} still has a context after its blocks")

    def worker(i: int) -> None:
        # An exception in a thread only reaches pytest as a warning: record it as an error.
        try:
            body(i)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the assertions
            errors.append(f"thread {i} raised {type(e).__name__}: {e}")
            barrier.abort()  # the others fail fast instead of waiting out the timeout
        else:
            finished.append(i)

    with set_forward_context({"worker": "main"}, CFG):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert [t.name for t in threads if t.is_alive()] == []  # none hung
        assert get_forward_context().attn_metadata == {"worker": "main"}
    assert errors == []
    assert sorted(finished) == list(range(n_threads))  # every thread ran to the end
    assert seen_outside == [False] * n_threads  # a new thread starts without a context
    assert not is_forward_context_available()


def test_asyncio_tasks_see_only_their_own_context():
    async def step(i: int) -> list[object]:
        seen = []
        for j in range(5):
            with set_forward_context({"task": i, "step": j}, CFG):
                await asyncio.sleep(0)  # let the other tasks run inside their contexts
                seen.append(get_forward_context().attn_metadata)
        seen.append(is_forward_context_available())
        return seen

    async def main() -> list[list[object]]:
        return await asyncio.gather(*(step(i) for i in range(3)))

    results = asyncio.run(main())
    for i, seen in enumerate(results):
        assert seen[:-1] == [{"task": i, "step": j} for j in range(5)]
        assert seen[-1] is False


def test_asyncio_child_task_inherits_but_does_not_leak():
    async def child() -> object:
        inherited = get_forward_context().attn_metadata
        with set_forward_context({"who": "child"}, CFG):
            await asyncio.sleep(0)
        return inherited

    async def main() -> tuple[object, object]:
        with set_forward_context({"who": "parent"}, CFG):
            task = asyncio.create_task(child())
            await asyncio.sleep(0)
            mine = get_forward_context().attn_metadata
            return await task, mine

    inherited, mine = asyncio.run(main())
    assert inherited == {"who": "parent"}
    assert mine == {"who": "parent"}


def test_nesting_restores_each_level():
    a = create_forward_context({"l": "a"}, CFG)
    b = create_forward_context({"l": "b"}, CFG)
    with override_forward_context(a):
        with set_forward_context({"l": "s"}, CFG):
            with override_forward_context(b):
                assert get_forward_context() is b
            assert get_forward_context().attn_metadata == {"l": "s"}
        assert get_forward_context() is a
    assert not is_forward_context_available()


def test_restore_on_exception_at_every_level():
    outer = create_forward_context({"l": "outer"}, CFG)
    with override_forward_context(outer):
        with pytest.raises(RuntimeError, match="inner"), \
                set_forward_context({"l": "mid"}, CFG), override_forward_context(None):
            raise RuntimeError("inner")
        assert get_forward_context() is outer
    with pytest.raises(KeyError), override_forward_context(outer):
        raise KeyError("x")
    assert not is_forward_context_available()
