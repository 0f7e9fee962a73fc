"""Data-parallel + expert-parallel generation with a Mixtral MoE, 2 ranks on CPU (gloo).

    python examples/dp_moe.py                      # tiny random Mixtral, 2 local ranks
    python examples/dp_moe.py --model DIR          # your own Mixtral-family checkpoint

The same script under torchrun (any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT works the same way):

    torchrun --nproc-per-node 2 examples/dp_moe.py --model DIR

How the ranks find each other:

* With ``python examples/dp_moe.py`` the script creates the checkpoint once and starts the
  ranks with ``forwardkit.distributed.launch.spawn``, which runs ``rank_main(rank, nprocs,
  port, ...)`` in N fresh processes and hands each a free loopback port; ``rank_main`` calls
  ``init_dp_group(world_size=..., rank=..., master_port=port)``.
* Under torchrun each process calls ``init_dp_group()`` with no arguments: when RANK,
  WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set, forwardkit takes the ranks from them.
  (``LLM(..., data_parallel_size=N)`` would also create the group by itself from those
  variables; the script creates it first only to share the checkpoint path from rank 0.)

Every rank builds its own ``LLM(model, data_parallel_size=N, enable_expert_parallel=True)``
and generates for its own prompt list; the lists are uneven (rank 0 has three prompts, the
others one each, with fewer tokens), so a rank that runs out of work keeps joining the steps
with dummy batches until every rank is done. With expert parallelism each rank holds only
its slice of every MoE layer's experts; the tokens of all ranks are gathered for the expert
computation (``DPMetadata`` in the forward context carries the per-rank token counts).
Each rank also runs a plain single-process ``LLM`` on its prompts and checks that the
data-parallel run produced exactly the same tokens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

import torch.distributed as dist

NUM_EXPERTS = 4


def make_tiny_mixtral(directory: str) -> str:
    """Save a tiny random Mixtral checkpoint (4 experts, top-2) in ``directory``."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.1,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def prompts_for(rank: int) -> tuple[list[list[int]], int]:
    """Uneven work: rank 0 gets three prompts and 10 tokens each, other ranks one prompt, 4."""
    if rank == 0:
        return [[1, 5, 9, 13, 17], [1, 200], [1] + [30 + i for i in range(20)]], 10
    return [[1, 40 + rank, 7, 7]], 4


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of each prompt (``ignore_eos``: exactly ``max_tokens`` each)."""
    from forwardkit.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_rank(model: str | None, compile_backend: str, world_size: int | None = None,
             rank: int | None = None, port: int | None = None) -> dict[str, Any]:
    """One DP rank: join the group, generate, compare with a single-process run, report."""
    from forwardkit.distributed import destroy_dp_group, init_dp_group
    from forwardkit.engine import LLM

    # Explicit ranks (spawn) or, when all are None, RANK/WORLD_SIZE/MASTER_* (torchrun).
    group = init_dp_group(world_size=world_size, rank=rank, master_port=port, backend="gloo",
                          timeout_s=120)
    made_here = None
    try:
        if model is None:  # torchrun without --model: rank 0 makes it, the others get the path
            if group.rank == 0:
                made_here = tempfile.mkdtemp(prefix="forwardkit-tiny-mixtral-")
                model = make_tiny_mixtral(made_here)
            box = [model]
            dist.broadcast_object_list(box, src=0, group=group.cpu_group)
            model = box[0]
        prompts, max_tokens = prompts_for(group.rank)
        engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      dtype="float32")

        # The reference: this rank's prompts on one process, no DP, no compile.
        reference = generate(LLM(model, enforce_eager=True, **engine), prompts, max_tokens)

        llm = LLM(
            model,
            data_parallel_size=group.world_size,  # must equal the number of ranks
            enable_expert_parallel=True,          # split the experts across the DP ranks
            # On CPU eager is the quick choice; "eager"/"inductor" trace and compile the model
            # (a GPU run would also capture CUDA graphs, padded to the same size on all ranks).
            enforce_eager=compile_backend == "none",
            compilation_config=None if compile_backend == "none" else {"backend": compile_backend},
            **engine,
        )
        moe = [m for m in llm.runner.model.modules() if type(m).__name__ == "FusedMoE"]
        tokens = generate(llm, prompts, max_tokens)
        report = {
            "rank": group.rank,
            "experts": [moe[0].expert_start, moe[0].expert_start + moe[0].num_local_experts],
            "prompts": prompts,
            "tokens": tokens,
            "match": tokens == reference,
        }
        reports: list[Any] = [None] * group.world_size
        dist.all_gather_object(reports, report, group=group.cpu_group)
        if group.rank == 0:
            for r in reports:
                print(f"rank {r['rank']}: experts {list(range(*r['experts']))} of "
                      f"{NUM_EXPERTS}, {len(r['prompts'])} prompt(s)", flush=True)
                for p, t in zip(r["prompts"], r["tokens"]):
                    print(f"  {p} -> {t}", flush=True)
            if all(r["match"] for r in reports):
                print(f"OK: DP tokens match the single-process run on all "
                      f"{group.world_size} ranks", flush=True)
        bad = [r["rank"] for r in reports if not r["match"]]
        if bad:
            raise RuntimeError(f"DP tokens differ from the single-process run on ranks {bad}")
        group.barrier()  # nobody deletes the checkpoint while another rank still reads it
        return report
    finally:
        destroy_dp_group()
        if made_here:
            shutil.rmtree(made_here, ignore_errors=True)


def rank_main(rank: int, nprocs: int, port: int, model: str, compile_backend: str) -> dict:
    """Entry point of a rank started by ``spawn``: fn(rank, nprocs, port, *args)."""
    return run_rank(model, compile_backend, world_size=nprocs, rank=rank, port=port)


def main(argv: list[str] | None = None) -> int:
    """Launch the ranks (or be one, under torchrun) and check the tokens."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local Mixtral-family checkpoint (default: tiny random)")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks to spawn (not torchrun)")
    parser.add_argument("--compile", dest="compile_backend", default="none",
                        choices=["none", "eager", "inductor"],
                        help="none = enforce_eager (default); else the piecewise backend")
    args = parser.parse_args(argv)

    if all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        run_rank(args.model, args.compile_backend)  # torchrun started us: we are one rank
        return 0

    from forwardkit.distributed.launch import spawn

    with tempfile.TemporaryDirectory(prefix="forwardkit-tiny-mixtral-") as tmp:
        model = args.model or make_tiny_mixtral(tmp)  # created once, read by every rank
        # Each rank is a fresh process; a failing or hanging rank stops all the others and
        # raises here with its traceback.
        reports = spawn(rank_main, args.nprocs, args=(model, args.compile_backend), timeout_s=300)
    print(f"spawned {len(reports)} ranks; all returned matching tokens: "
          f"{all(r['match'] for r in reports)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
