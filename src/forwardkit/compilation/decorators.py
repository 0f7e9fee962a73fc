"""``@support_torch_compile``: compile a model class's ``forward`` per ``CompilationConfig.mode``.

* ``NONE`` (0) / ``enforce_eager``: the decorator is inert; ``forward`` runs eagerly.
* ``STOCK_TORCH_COMPILE`` (1): ``torch.compile(forward, backend=<backend>, dynamic=True)`` with
  guards kept (forwardkit applies it here; in vLLM the runner does it).
* ``DYNAMO_TRACE_ONCE`` (2): trace once with the token dims dynamic and every guard dropped;
  the graph goes to the plain backend named by ``backend`` (Inductor gets
  ``inductor_compile_config``).
* ``VLLM_COMPILE`` (3): as 2, but the graph goes to a fresh
  :class:`~forwardkit.compilation.backend.ForwardkitBackend` (split, piecewise compile, cache).

The decorated class reads its config from ``get_current_engine_config()`` at construction, or
from an ``engine_config=`` (or ``vllm_config=``) keyword.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from forwardkit.compilation.counters import compilation_counter
from forwardkit.compilation.wrapper import TraceOnceCompiler, collect_traced_files
from forwardkit.config.compilation_enums import DynamicShapesType
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = ["ignore_torch_compile", "infer_dynamic_arg_dims", "support_torch_compile"]

logger = init_logger(__name__)

T = TypeVar("T", bound=type)

_TENSOR_ANNOTATIONS = {
    "Tensor", "torch.Tensor", "Tensor | None", "torch.Tensor | None", "Optional[torch.Tensor]",
    "Optional[Tensor]", "IntermediateTensors", "IntermediateTensors | None",
}


def infer_dynamic_arg_dims(forward: Callable[..., Any]) -> dict[str, int]:
    """Every parameter annotated as a tensor (optionally ``| None``) gets dynamic dim 0."""
    dims: dict[str, int] = {}
    for name, p in inspect.signature(forward).parameters.items():
        ann = p.annotation
        text = ann if isinstance(ann, str) else getattr(ann, "__name__", None) or str(ann)
        if ann is torch.Tensor or text.replace("typing.", "") in _TENSOR_ANNOTATIONS or (
            not isinstance(ann, str) and str(ann) in ("torch.Tensor | None", "typing.Optional[torch.Tensor]")
        ):
            dims[name] = 0
    return dims


def ignore_torch_compile(cls: T) -> T:
    """Make a subclass of a decorated class run eagerly (decorated submodules still compile)."""
    marked: Any = cls  # the marker is a class attribute added here, unknown to the type
    marked._forwardkit_ignore_compile = True
    return cls


def _mode_of(engine_config: EngineConfig) -> int:
    mode = engine_config.compilation_config.mode
    return 0 if mode is None else int(mode)


def _evaluate_guards(engine_config: EngineConfig) -> bool:
    return engine_config.compilation_config.dynamic_shapes_config.evaluate_guards


def _mark_dynamic(bound: inspect.BoundArguments, dims: dict[str, int | list[int]],
                  unbacked: dict[str, int | list[int]], dyn_type: str) -> None:
    """Mark the configured dims dynamic (unbacked for size 0/1 or UNBACKED type)."""
    from torch._dynamo.decorators import mark_unbacked

    def as_list(d: int | list[int]) -> list[int]:
        return [d] if isinstance(d, int) else list(d)

    for table, force_unbacked in ((dims, False), (unbacked, True)):
        for name, ds in table.items():
            value = bound.arguments.get(name)
            if value is None:
                continue
            tensors = list(value.tensors.values()) if hasattr(value, "tensors") else [value]
            for t in tensors:
                if not isinstance(t, torch.Tensor):
                    raise ValueError(
                        f"argument {name!r} is listed in dynamic_arg_dims but is a "
                        f"{type(t).__name__}; only tensors can have dynamic dims"
                    )
                for d in as_list(ds):
                    d = d % t.ndim
                    # A backed symbol of size 0/1 specialises to a constant (a static graph), so
                    # a first call with one token marks that dim unbacked instead.
                    if force_unbacked or dyn_type == "unbacked" or t.shape[d] < 2:
                        mark_unbacked(t, d, hint_override=t.shape[d])
                    else:
                        torch._dynamo.mark_dynamic(t, d)


def support_torch_compile(
    cls: T | None = None,
    *,
    dynamic_arg_dims: dict[str, int | list[int]] | None = None,
    mark_unbacked_dims: dict[str, int | list[int]] | None = None,
    enable_if: Callable[[Any], bool] | None = None,
) -> Any:
    """Class decorator (bare or with arguments) that compiles ``forward`` per the engine config.

    ``dynamic_arg_dims`` maps forward parameter names to their dynamic dim(s); by default every
    tensor-annotated parameter gets dim 0 (the token dimension). ``enable_if(engine_config)``
    returning False keeps the model eager.
    """

    def decorate(klass: T) -> T:
        if "forward" not in dir(klass):
            raise TypeError(f"{klass.__name__} has no forward(); support_torch_compile needs one")
        if klass.__dict__.get("_forwardkit_compile_decorated", False):
            return klass  # decorating twice is a no-op
        forward = klass.forward  # type: ignore[attr-defined]  # checked with dir() above
        dims: dict[str, int | list[int]] | None = dynamic_arg_dims
        if dims is None:
            dims = dict(infer_dynamic_arg_dims(forward))
            if not dims and not mark_unbacked_dims:
                raise ValueError(
                    f"cannot infer dynamic_arg_dims for {klass.__name__}.forward: no parameter is "
                    "annotated torch.Tensor; pass dynamic_arg_dims={'input_ids': 0, ...}"
                )
        params = inspect.signature(forward).parameters
        for name in [*dims, *(mark_unbacked_dims or {})]:
            if name not in params:
                raise ValueError(
                    f"dynamic dim given for {name!r}, which is not a parameter of "
                    f"{klass.__name__}.forward {list(params)[1:]}"
                )
        _install(klass, dict(dims), dict(mark_unbacked_dims or {}), enable_if)
        return klass

    return decorate(cls) if cls is not None else decorate


def _install(klass: Any, dims: dict[str, Any], unbacked: dict[str, Any],
             enable_if: Callable[[Any], bool] | None) -> None:
    """Record the per-class settings; wrap ``__init__``/``__call__`` unless a base already is.

    The wrappers look everything up on ``type(self)``, so a subclass of a decorated class (or a
    decorated subclass, e.g. ``MixtralModel(LlamaModel)``) compiles its own ``forward`` with
    its own dims, and is never wrapped twice. (``klass`` is ``Any``: the settings and the
    wrappers are class attributes added here.)
    """
    inherited = getattr(klass, "_forwardkit_compile_decorated", False)
    klass._fk_dims = dims
    klass._fk_unbacked = unbacked
    klass._fk_enable_if = enable_if
    klass._forwardkit_ignore_compile = False
    klass._forwardkit_compile_decorated = True
    if inherited:
        return
    original_init = klass.__init__
    original_call = klass.__call__
    init_params = inspect.signature(original_init).parameters

    def __init__(self: Any, *args: Any, engine_config: EngineConfig | None = None,
                 vllm_config: EngineConfig | None = None,
                 prefix: str = "", **kwargs: Any) -> None:
        cfg = engine_config if engine_config is not None else vllm_config
        if cfg is None:
            from forwardkit.config.engine import get_current_engine_config

            cfg = get_current_engine_config()
        if "engine_config" in init_params:
            kwargs["engine_config"] = cfg
        elif "vllm_config" in init_params:
            kwargs["vllm_config"] = cfg
        if "prefix" in init_params:
            kwargs["prefix"] = prefix
        original_init(self, *args, **kwargs)
        cls = type(self)
        mode = _mode_of(cfg)
        gate = cls._fk_enable_if
        skip = (
            not cfg.compiles_model
            or getattr(cls, "_forwardkit_ignore_compile", False)
            or (gate is not None and not gate(cfg))
        )
        self._fk_engine_config = cfg
        self._fk_do_not_compile = skip
        self._fk_compiler = None
        self._fk_mode = mode
        self._fk_prefix = prefix
        if not skip:
            compilation_counter.num_models_seen += 1

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._fk_do_not_compile or torch.compiler.is_compiling():
            return original_call(self, *args, **kwargs)
        compiler = self._fk_compiler
        if compiler is not None:
            return compiler(*args, **kwargs)
        return _first_call(self, args, kwargs)

    klass.__init__ = __init__
    klass.__call__ = __call__


def _make_backend(module: Any, cfg: EngineConfig, mode: int) -> Any:
    """The Dynamo backend callable for mode 1/2/3."""
    cc = cfg.compilation_config
    if mode == 3:
        from forwardkit.compilation.backend import ForwardkitBackend

        backend = cc.init_backend(cfg)
        if isinstance(backend, ForwardkitBackend):
            if module._fk_prefix:
                backend.prefix = module._fk_prefix
            backend.piece_wrapper = getattr(module, "_fk_piece_wrapper", None)
        module._fk_backend = backend
        return backend
    name = cc.init_backend(cfg)
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        options = {k: v for k, v in dict(cc.inductor_compile_config or {}).items()
                   if k in torch._inductor.config._config}  # type: ignore[attr-defined]

        def inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            return compile_fx(gm, example_inputs, config_patches=options)

        return inductor
    if isinstance(name, str):
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(name)
    return name


def _first_call(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    klass = type(module)
    cfg = module._fk_engine_config
    mode = module._fk_mode
    forward = klass.forward
    with _backend_errors_unwrapped(cfg, klass, mode):
        if mode == 1:
            compilation_counter.stock_torch_compile_count += 1
            backend = _make_backend(module, cfg, mode)
            compiled = torch.compile(forward.__get__(module), backend=backend, fullgraph=True, dynamic=True)
            module._fk_compiler = compiled
            return compiled(*args, **kwargs)
        if mode == 3:
            from forwardkit.compilation.aot import aot_enabled

            if aot_enabled(cfg) and not _evaluate_guards(cfg):  # AOT entries hold no guards
                return _first_call_aot(module, forward, args, kwargs)
        return _trace(module, forward, args, kwargs)


@contextlib.contextmanager
def _backend_errors_unwrapped(cfg: EngineConfig, klass: type, mode: int) -> Any:
    """Turn Dynamo's ``BackendCompilerFailed`` wrapper into the error a user can act on.

    Mode 3: forwardkit's own backend raised, so its exception (with the library's reason,
    e.g. an unsafe cache directory) is raised as it is. Modes 1/2: the user's
    ``compilation_config.backend`` failed, so a ``ValueError`` names that field and the cause.
    """
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        yield
    except BackendCompilerFailed as e:
        inner = getattr(e, "inner_exception", None)
        if not isinstance(inner, Exception):
            raise
        if mode == 3:
            raise inner from e
        backend = cfg.compilation_config.backend
        reason = (str(inner).strip().splitlines() or [""])[0]
        raise ValueError(
            f"compilation_config.backend={backend!r} failed while compiling {klass.__name__} "
            f"(mode {mode}): {type(inner).__name__}: {reason}; use a registered torch.compile "
            "backend or a dotted name of a backend function"
        ) from e


def _trace(module: Any, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
           entry: Any = None) -> Any:
    """Mark the dynamic dims and trace once (through ``entry`` for AOT precompile)."""
    klass = type(module)
    cfg = module._fk_engine_config
    cc = cfg.compilation_config
    bound = inspect.signature(forward).bind(module, *args, **kwargs)
    _mark_dynamic(bound, klass._fk_dims, klass._fk_unbacked, cc.dynamic_shapes_config.type.value)
    traced: set[str] = {inspect.getsourcefile(forward) or forward.__code__.co_filename}
    backend = _make_backend(module, cfg, module._fk_mode)
    compiler = TraceOnceCompiler(module, forward, backend, _evaluate_guards(cfg),
                                 backed_shapes=cc.dynamic_shapes_config.type == DynamicShapesType.BACKED)
    with collect_traced_files(traced):
        if hasattr(backend, "traced_files"):
            backend.traced_files = traced  # hashed into the cache key when the backend runs
        if entry is not None:
            backend.aot = True
            out = compiler.aot_first_call(entry, *args, **kwargs)
        else:
            out = compiler.first_call(*args, **kwargs)
    cc.compile_state.traced_files = set(traced)
    module._fk_compiler = compiler
    if entry is not None:
        entry.save_after_first_call(traced)
    return out


def _first_call_aot(module: Any, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Load the saved Dynamo result if there is a usable one, else trace and save it."""
    from forwardkit.compilation.aot import AotCompileError, AotEntry, model_fingerprint

    cfg = module._fk_engine_config
    klass = type(module)
    try:
        bound = inspect.signature(forward).bind(module, *args, **kwargs)
        arguments = dict(list(bound.arguments.items())[1:])  # without self
        fingerprint = model_fingerprint(module, arguments, {**klass._fk_dims, **klass._fk_unbacked})
        entry = AotEntry(module, forward, cfg, module._fk_prefix, fingerprint)
    except Exception as e:  # e.g. an unsafe cache directory: trace as without AOT
        _check_force_load(None, f"{type(e).__name__}: {e}")
        logger.warning_once("AOT precompile unavailable (%s: %s); tracing", type(e).__name__, str(e))
        return _trace(module, forward, args, kwargs)
    files: set[str] = set()

    def make_backend() -> Any:
        backend = _make_backend(module, cfg, 3)
        backend.traced_files = files
        return backend

    loaded = entry.load(make_backend)
    if loaded is None:
        _check_force_load(entry.cache.local_dir, "no usable saved entry (missing, stale or corrupt)")
    if loaded is not None:
        fn, saved_files = loaded
        files.update(saved_files)
        try:
            out = fn(module, *args, **kwargs)
        except Exception as e:  # a loaded graph that does not run: trace instead
            compilation_counter.num_cache_errors += 1
            _check_force_load(entry.cache.local_dir, f"the loaded entry failed: {type(e).__name__}: {e}")
            logger.warning("the AOT-compiled %s failed on its first call (%s: %s); tracing again",
                           type(module).__name__, type(e).__name__, e)
        else:
            cfg.compilation_config.compile_state.traced_files = set(files)
            module._fk_compiler = lambda *a, **k: fn(module, *a, **k)
            return out
    try:
        return _trace(module, forward, args, kwargs, entry)
    except AotCompileError as e:
        logger.warning("AOT compile of %s failed (%s: %s); tracing without it",
                       type(module).__name__, type(e).__name__, e)
        return _trace(module, forward, args, kwargs)


def _check_force_load(path: str | None, reason: str) -> None:
    """Under ``FORWARDKIT_FORCE_AOT_LOAD=1`` a start that would trace raises instead."""
    from forwardkit import envs

    if envs.FORWARDKIT_FORCE_AOT_LOAD:
        raise FileNotFoundError(
            f"FORWARDKIT_FORCE_AOT_LOAD=1 but the AOT compile cache {path or '(unavailable)'} has "
            f"no loadable entry: {reason}. Run once without FORWARDKIT_FORCE_AOT_LOAD to populate it."
        )
