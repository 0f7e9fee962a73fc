"""Micro-batching (dual-batch overlap, DBO): one step's tokens split into micro-batches that take
turns, so one computes while the other's collectives are in flight.

* :mod:`~forwardkit.microbatching.slices`: where a step is split (``UBatchSlice``,
  ``maybe_create_ubatch_slices``, the token thresholds);
* :mod:`~forwardkit.microbatching.overlap`: running the micro-batches on threads that take
  turns (``run_ubatches``) and the ``dbo_*`` helpers layers call.

The decision to micro-batch a step is the DP vote (``distributed.dp_utils.coordinate_batch_across_dp``)
read through the step planner (``runner/planner.py``: ``StepPlan.should_ubatch``, and which sizes
have micro-batched graphs); the graphs themselves are ``cudagraph/ubatch_graphs.py``; the
runner's micro-batched forward is ``runner/microbatched.py`` (``MicrobatchedForward``: it builds
attention metadata, replays graphs and calls the model, all layers below this package, so it
sits with the runner). Nothing is imported here: import the submodule you need.
"""
