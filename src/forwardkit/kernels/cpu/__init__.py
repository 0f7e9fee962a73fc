"""CPU kernels as one unit: :mod:`.native_linear` (the native few-row linear, built and
verified into the cache root), :mod:`.native_attention` (the native paged decode attention,
built the same way), :mod:`.native_build` (how both are built, verified and loaded),
:mod:`.router` (the ``forwardkit::linear`` op and the per-model ``CpuLinearRouter`` it reads
at run time), :mod:`.linear_routes` (timed path choices per weight shape) and
:mod:`.hugepages` (huge pages and lazily zeroed buffers).

Nothing is imported here, so ``from forwardkit.kernels.cpu import router`` has no import
cycle through this package."""
