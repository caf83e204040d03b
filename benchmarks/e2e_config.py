"""``python -m benchmarks e2e --config FILE [--devices N]``: a fit config with TLT against it without TLT.

Runs exactly ``tlt-lightning fit --config FILE`` twice, as separate processes (DDP ranks included), on
the same seeds: once as written (``tlt``) and once with TLT removed (``baseline``: no
:class:`~tlt_lightning.callbacks.SpotDrafterCallback`, no
:class:`~tlt_lightning.callbacks.BanditCallback`, ``model.speculative.enabled: false``). Both get a
:class:`RankRecorder`, which writes one JSON line per rank and step as it goes (nothing is lost when a
run dies): wall and CPU seconds, the rollout / reward / policy-training seconds the module measured,
the spot drafter's tail, idle and paid seconds, the rollout's tokens and response lengths, the share
of the rollout's time spent with fewer than ``speculative.threshold`` requests active, reward,
accuracy and the process's peak memory.

A step's time is its slowest rank's (DDP ranks meet in every step). The speedup is the ratio of the
runs' median step times after ``--skip-steps``; the baseline's rollout share of the step is reported
next to it (what a faster rollout can give at most). Rollout graphs compile once,
right before the first rollout (``compile_s`` of a rank's first step, taken out of its wall time);
the second run reuses Inductor's on-disk cache, so its compile seconds show a warm start.

``--peers vllm trl`` adds the same job on peers in the same command (:mod:`benchmarks.e2e_peers`): our
fit without TLT with its rollouts on vLLM, and TRL's ``GRPOTrainer``; ``vs_peers`` holds the ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import yaml

from benchmarks.common import machine_info, median, new_figure, save_figure, write_json
from benchmarks.e2e_peers import PeerUnavailable, peer_ratios, trl_peer, vllm_python, with_vllm
from benchmarks.memory import MemoryProbe, tensor_breakdown
from tlt_lightning.callbacks import SpotDrafterCallback
from tlt_lightning.efficiency.host_memory import peak_rss_mb
from tlt_lightning.speculative.arms import arm_key

__all__ = [
    "RankRecorder",
    "compare",
    "compiled_seconds",
    "core_share",
    "decode_buckets",
    "decode_table",
    "equal_work_speedup",
    "fit_config",
    "frozen_drafter",
    "measure",
    "read_records",
    "run",
    "summarise",
    "without_tlt",
]

TLT_CALLBACKS = ("SpotDrafterCallback", "BanditCallback")
BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 1 << 30))
"""Active-request ranges the decode rates are reported in (inclusive)."""
CONTENDED = 0.9
"""A step is contended when a rank's decode got less than this share of a core (thread CPU / wall seconds)."""


def compiled_seconds(module: L.LightningModule) -> float:
    """Seconds ``module``'s rollout target and drafter have spent compiling graphs so far."""
    parts = (getattr(module, "rollout_target", None), getattr(module, "drafter", None))
    return float(sum(getattr(part, "compile_seconds", 0.0) for part in parts))


def decode_table(stats: Any, by_arm: bool = False) -> dict[str, dict[str, list[float]]]:
    """A rollout's decode steps by active requests and mode: ``{n: {"plain" | "spec": [steps, wall s,
    thread CPU s, tokens]}}`` (``by_arm``: by arm instead, ``"off"``, ``"chain4"``, ...). CPU seconds
    below wall seconds mean the step waited for a core."""
    table: dict[str, dict[str, list[float]]] = {}
    steps = (stats.step_batch_sizes, stats.step_times, stats.step_cpu_times, stats.step_tokens)
    for n, wall, cpu, tokens, arm in zip(*steps, stats.step_arms):
        mode = arm_key(arm) if by_arm else "plain" if arm is None else "spec"
        row = table.setdefault(str(n), {}).setdefault(mode, [0, 0.0, 0.0, 0])
        for i, value in enumerate((1, wall, cpu, tokens)):
            row[i] += value
    return table


def decode_buckets(
    records: list[dict[str, Any]], table: str = "decode"
) -> dict[str, dict[str, dict[str, float]]]:
    """Decode rates of ``records`` (rank-steps with a ``table``: ``decode``, or ``decode_arms`` for rates
    per arm) per bucket of :data:`BUCKETS` and mode: steps, tokens per wall second and per thread-CPU
    second, tokens per step."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    modes_seen = sorted({m for r in records for modes in r.get(table, {}).values() for m in modes})
    for lo, hi in BUCKETS:
        name = f"{lo}" if lo == hi else f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}"
        for mode in modes_seen:
            sums = [0.0] * 4
            for record in records:
                for n, modes in record.get(table, {}).items():
                    if lo <= int(n) <= hi and mode in modes:
                        sums = [a + b for a, b in zip(sums, modes[mode])]
            steps, wall, cpu, tokens = sums
            if steps:
                out.setdefault(name, {})[mode] = {
                    "steps": int(steps),
                    "tokens_per_s": tokens / max(wall, 1e-9),
                    "tokens_per_cpu_s": tokens / max(cpu, 1e-9),
                    "tokens_per_step": tokens / steps,
                }
    return out


class RankRecorder(L.Callback):
    """Appends this rank's record of every training step to ``<directory>/rank<R>.jsonl``."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self._start = (0.0, 0.0, 0.0)
        self.memory = MemoryProbe()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.add_rollout_listener(self.memory)
        self._write(trainer, {"event": "start"})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.memory.close()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = (time.perf_counter(), time.process_time(), compiled_seconds(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        wall, cpu = time.perf_counter() - self._start[0], time.process_time() - self._start[1]
        result, rewards = outputs["rollout"], outputs["rewards"]
        stats = result.stats
        threshold = pl_module.speculative_config.threshold
        tail = sum(t for n, t in zip(stats.step_batch_sizes, stats.step_times) if n < threshold)
        spot = next((c.spot for c in trainer.callbacks if isinstance(c, SpotDrafterCallback)), None)
        spot_stats = dict(spot.local_stats) if spot is not None else {}
        record = {
            "step": trainer.global_step,
            "wall_s": wall - outputs["times"]["compile_s"],  # compiling (first step) is not stepping
            "cpu_s": cpu,
            # Seconds graphs compiled in the step (step 1: the warm-up's too; later: late compiles).
            "graph_compile_s": compiled_seconds(pl_module) - self._start[2],
            **{k: float(v) for k, v in outputs["times"].items()},
            # The spot drafter's training: in the other ranks' tail (tail_s) or paid for (paid_s); idle_s:
            # tail time it did not train in.
            "drafter_s": float(spot_stats.get("tail_s", 0.0) + spot_stats.get("paid_s", 0.0)),
            "drafter_paid_s": float(spot_stats.get("paid_s", 0.0)),
            "drafter_steps": int(spot_stats.get("tail_steps", 0) + spot_stats.get("paid_steps", 0)),
            "idle_s": float(spot_stats.get("idle_s", 0.0)),
            "tail_share": tail / max(sum(stats.step_times), 1e-9),
            "tokens": stats.generated_tokens,
            "forward_tokens": outputs.get("forward_tokens"),  # the training's work (padded tokens forwarded)
            "decode": decode_table(stats),
            "decode_arms": decode_table(stats, by_arm=True),
            "lengths": [int(n) for n in result.lengths],
            "accept_length": stats.mean_accept_length,
            "reward": float(rewards.total.mean()),
            "accuracy": float((rewards.correctness >= 1).float().mean()),
            "phase_peak_mb": self.memory.take(),  # before the peak below, which bounds every sample in it
            "peak_rss_mb": peak_rss_mb(),
        }
        if trainer.global_step == 1 or trainer.global_step % 4 == 0:  # a walk over every live tensor
            record["tensors"] = tensor_breakdown(pl_module, trainer, spot)
        self._write(trainer, record)

    def _write(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"rank": trainer.global_rank, **record}) + "\n")


def without_tlt(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a fit config as a dict) with TLT removed: its callbacks gone, speculation off."""
    out = copy.deepcopy(config)
    trainer = out.setdefault("trainer", {})
    trainer["callbacks"] = [
        c
        for c in trainer.get("callbacks") or []
        if str(c.get("class_path", "")).rpartition(".")[2] not in TLT_CALLBACKS
    ]
    out.setdefault("model", {}).setdefault("speculative", {})["enabled"] = False
    return out


def frozen_drafter(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its drafter frozen: speculation and the bandit as written, no spot training.

    The module drafts with the drafter the :class:`~tlt_lightning.callbacks.SpotDrafterCallback` would
    have started from (its ``drafter_path``, else a fresh one of its ``kind``), never updated: the TLT
    run less the drafter's training in the other ranks' tail.
    """
    out = copy.deepcopy(config)
    trainer = out.setdefault("trainer", {})
    callbacks = trainer.get("callbacks") or []
    spot = [c for c in callbacks if str(c.get("class_path", "")).endswith("SpotDrafterCallback")]
    if not spot:
        raise ValueError("--frozen needs a config with a SpotDrafterCallback (its drafter is the one frozen)")
    spot_config = (spot[0].get("init_args") or {}).get("config") or {}
    trainer["callbacks"] = [c for c in callbacks if c not in spot]
    speculative = out.setdefault("model", {}).setdefault("speculative", {})
    if spot_config.get("drafter_path"):
        speculative["drafter_path"] = spot_config["drafter_path"]
    else:
        speculative["drafter_kind"] = spot_config.get("kind", "eagle1")
    return out


def absolute_drafter_paths(config: dict[str, Any], base: Path) -> dict[str, Any]:
    """``config`` with each relative ``drafter_path`` found under ``base`` (the config file's directory)
    made absolute, as ``tlt-lightning fit`` resolves it: the runs' rewritten configs live elsewhere."""
    out = copy.deepcopy(config)
    callbacks = (out.get("trainer") or {}).get("callbacks") or []
    holders = [(out.get("model") or {}).get("speculative") or {}]
    holders += [(c.get("init_args") or {}).get("config") or {} for c in callbacks if isinstance(c, dict)]
    for holder in holders:
        path = holder.get("drafter_path")
        if isinstance(path, str) and not Path(path).is_absolute() and (base / path).is_dir():
            holder["drafter_path"] = str((base / path).resolve())
    return out


def fit_config(
    config: dict[str, Any], name: str, args: argparse.Namespace, python: str | None = None
) -> tuple[Path, float]:
    """Run one fit of ``config`` in a child process of ``python`` (default: this one); its records'
    directory and wall seconds."""
    out = Path(args.out) / name
    records = out / "records"
    for stale in records.glob("rank*.jsonl"):
        stale.unlink()
    config = copy.deepcopy(config)
    trainer = config.setdefault("trainer", {})
    trainer.update(max_steps=int(args.steps), default_root_dir=str(out / "fit"))
    if args.devices is not None:
        trainer["devices"] = int(args.devices)
    recorder = {"class_path": "benchmarks.e2e_config.RankRecorder", "init_args": {"directory": str(records)}}
    trainer["callbacks"] = [*(trainer.get("callbacks") or []), recorder]
    if isinstance(trainer.get("logger"), dict):  # each run in its own experiment, beside the config's
        init = trainer["logger"].setdefault("init_args", {})
        init["experiment_name"] = f"{init.get('experiment_name', 'tlt-lightning')}-bench-{name}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    command = [python or sys.executable, "-m", "tlt_lightning.cli", "--threads", str(args.threads or 1)]
    command += ["fit", "--config", str(path)]
    print(f"[bench e2e] {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(out / "fit.log", "w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"the {name} fit failed (exit status {code}); its output: {out / 'fit.log'}")
    return records, time.perf_counter() - start


def read_records(directory: Path) -> tuple[dict[int, dict[str, Any]], list[list[dict[str, Any]]]]:
    """``({rank: start record}, steps)``: ``steps[i]`` holds every rank's record of step ``i + 1``."""
    starts, by_step = {}, {}
    for path in sorted(directory.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "start":
                starts[record["rank"]] = record
            else:
                by_step.setdefault(record["step"], []).append(record)
    return starts, [sorted(by_step[s], key=lambda r: r["rank"]) for s in sorted(by_step)]


def equal_work_speedup(
    base: dict[str, Any], other: dict[str, Any], rate: str = "tokens_per_s"
) -> float | None:
    """How much faster ``other``'s decoding is on ``base``'s work: the seconds ``base``'s tokens take at its
    own rates over what they would take at ``other``'s, bucket by bucket (:func:`decode_buckets` of two
    runs' summaries; ``rate``: ``"tokens_per_s"`` or ``"tokens_per_cpu_s"``). The runs sample different
    responses once their policies part, so their step times also differ by how long those are; this
    ratio compares their decoding on the same mix of batch sizes. ``None``: ``other`` lacks a bucket.
    """

    def seconds(buckets: dict[str, dict[str, float]], tokens: float) -> float:
        pooled = sum(m["steps"] * m["tokens_per_step"] for m in buckets.values())
        spent = sum(m["steps"] * m["tokens_per_step"] / m[rate] for m in buckets.values())
        return tokens * spent / pooled

    mine, theirs = base["decode_buckets"], other["decode_buckets"]
    if not mine or not set(mine) <= set(theirs):
        return None
    work = {b: sum(m["steps"] * m["tokens_per_step"] for m in modes.values()) for b, modes in mine.items()}
    return sum(seconds(mine[b], n) for b, n in work.items()) / sum(
        seconds(theirs[b], n) for b, n in work.items()
    )


def core_share(record: dict[str, Any]) -> float | None:
    """The share of a core a rank-step's decode got: its thread CPU seconds over its wall seconds (``None``
    without a decode table or under a second of decoding)."""
    rows = [row for modes in record.get("decode", {}).values() for row in modes.values()]
    wall, cpu = sum(row[1] for row in rows), sum(row[2] for row in rows)
    return cpu / wall if wall >= 1.0 else None


def summarise(steps: list[list[dict[str, Any]]], skip: int) -> dict[str, Any]:
    """Medians over the steps after the first ``skip``: a step's time is its slowest rank's.

    ``contended_steps`` lists the steps where some rank's decode waited for a core (:func:`core_share`
    below :data:`CONTENDED`): on a machine shared with other work they are what the medians cannot hide.
    """
    kept = steps[skip:] or steps
    step_s = [max(r["wall_s"] for r in ranks) for ranks in kept]
    rollout_s = [max(r["rollout_s"] for r in ranks) for ranks in kept]
    train_s = [median([r["train_s"] for r in ranks]) for ranks in kept]
    tokens = [sum(r["tokens"] for r in ranks) for ranks in kept]
    lengths = sorted(n for ranks in kept for r in ranks for n in r["lengths"])

    def quantile(q: float) -> float:
        return float(lengths[min(len(lengths) - 1, int(q * len(lengths)))]) if lengths else 0.0

    # Training on equal work: ms per padded token forwarded (the runs' samples differ, and with them the
    # zero-advantage groups that training skips); records without the count are left out.
    per_token = [
        1e3 * r["train_s"] / r["forward_tokens"] for ranks in kept for r in ranks if r.get("forward_tokens")
    ]

    return {
        "steps": len(kept),
        "step_s": median(step_s),
        "rollout_s": median(rollout_s),
        "train_s": median(train_s),
        "drafter_s": median([median([r["drafter_s"] for r in ranks]) for ranks in kept]),
        "rollout_share": median([r / s for r, s in zip(rollout_s, step_s)]),
        "tail_share": median([r["tail_share"] for ranks in kept for r in ranks]),
        "rollout_tokens_per_s": median([t / r for t, r in zip(tokens, rollout_s)]),
        "train_ms_per_forward_token": median(per_token) if per_token else None,
        "length_p50": quantile(0.5),
        "length_p90": quantile(0.9),
        "length_max": lengths[-1] if lengths else 0,
        "peak_rss_mb": max(r["peak_rss_mb"] for ranks in steps for r in ranks),
        "reward": [median([r["reward"] for r in ranks]) for ranks in steps],
        "accuracy": [median([r["accuracy"] for r in ranks]) for ranks in steps],
        "decode_buckets": decode_buckets([r for ranks in kept for r in ranks]),
        "arm_buckets": decode_buckets([r for ranks in kept for r in ranks], "decode_arms"),
        "contended_steps": [
            ranks[0]["step"]
            for ranks in kept
            if any((share := core_share(r)) is not None and share < CONTENDED for r in ranks)
        ],
    }


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The runs' ratios to the baseline: per step, rollout, equal-work decoding (:func:`equal_work_speedup`).

    With ``baseline_again`` (``--bracket``: the baseline run again after the others) the baseline is the
    mean of both, which cancels a machine that drifts steadily over the runs, and ``drift`` is the second
    baseline's median step over the first's (1.0: no drift; the two did the same work where the fit is
    deterministic).
    """
    bases = [runs[name] for name in ("baseline", "baseline_again") if name in runs]
    step, rollout = (statistics.fmean(b[key] for b in bases) for key in ("step_s", "rollout_s"))
    out = {"speedup": step / runs["tlt"]["step_s"], "rollout_speedup": rollout / runs["tlt"]["rollout_s"]}
    if "frozen" in runs:
        out["frozen_speedup"] = step / runs["frozen"]["step_s"]
    if len(bases) == 2:
        out["drift"] = bases[1]["step_s"] / bases[0]["step_s"]

    def equal_work(summary: dict[str, Any], rate: str) -> float | None:
        ratios = [equal_work_speedup(b, summary, rate) for b in bases]
        return None if None in ratios else statistics.fmean(ratios)

    base_train = [b["train_ms_per_forward_token"] for b in bases]
    out["train_speedup_equal_work"] = {
        name: statistics.fmean(base_train) / summary["train_ms_per_forward_token"]
        for name, summary in runs.items()
        if not name.startswith("baseline")
        and None not in base_train
        and summary["train_ms_per_forward_token"]
    }
    out["decode_speedup_equal_work"] = {
        name: {rate: equal_work(summary, rate) for rate in ("tokens_per_s", "tokens_per_cpu_s")}
        for name, summary in runs.items()
        if not name.startswith("baseline")
    }
    return out


def plot(payload: dict[str, Any], steps: dict[str, list[list[dict[str, Any]]]], path: Path) -> Path:
    """Left: the reward of both runs per step. Right: one step's parts per rank, with and without TLT."""
    fig, (ax, bx) = new_figure(1, 2, figsize=(13, 4.5))
    for name, summary in payload["runs"].items():
        ax.plot(range(1, len(summary["reward"]) + 1), summary["reward"], marker="o", label=name)
    for name, peer in payload.get("peers", {}).items():
        rewards = [float("nan") if r is None else r for r in peer["reward"]]
        ax.plot(range(1, len(rewards) + 1), rewards, marker="x", ls="--", label=f"{name} (1 worker)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.legend()
    colors = {
        "rollout_s": "tab:blue",
        "drafter_s": "tab:green",
        "reward_s": "tab:gray",
        "train_s": "tab:orange",
    }
    row = 0
    labels = []
    for name, run_steps in steps.items():
        ranks = run_steps[min(len(run_steps) - 1, payload["skip_steps"])]
        for r in ranks:
            left = 0.0
            for part in ("rollout_s", "reward_s", "train_s"):  # one after the other
                bx.barh(row, r[part], left=left, color=colors[part], label=part if row == 0 else None)
                left += r[part]
            # The drafter trains while the other ranks are still in their rollouts: a thin bar over them.
            label = "drafter_s" if row == 0 else None
            bx.barh(
                row, r["drafter_s"], left=r["rollout_s"], height=0.3, color=colors["drafter_s"], label=label
            )
            bx.plot([r["wall_s"]], [row], "k|", markersize=14)
            labels.append(f"{name} rank {r['rank']}")
            row += 1
    bx.set_yticks(range(row), labels)
    bx.set_xlabel(f"seconds of step {payload['skip_steps'] + 1} (|: the rank's whole step)")
    bx.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{payload['config']}: TLT {payload['speedup']:.2f}x per step (median)")
    return save_figure(fig, path)


def measure(
    name: str,
    config: dict[str, Any],
    args: argparse.Namespace,
    payload: dict[str, Any],
    steps: dict[str, list[list[dict[str, Any]]]],
    python: str | None = None,
) -> None:
    """Run ``name`` of :func:`run`'s order on ``config`` into ``payload`` and ``steps``: a fit (in
    ``python``), or the TRL peer. A peer that cannot run here, or whose fit fails, is recorded in
    ``payload["peers_skipped"]`` and the other runs go on; a failed fit of our own raises."""
    if name == "trl":  # not a fit: TRL's own trainer, one worker (benchmarks/e2e_peers.py)
        try:
            payload["peers"]["trl"] = trl_peer(config, args)
        except PeerUnavailable as err:
            payload["peers_skipped"]["trl"] = str(err)
        return
    try:
        records, wall = fit_config(config, name, args, python)
    except RuntimeError as err:
        if name != "vllm":
            raise
        payload["peers_skipped"]["vllm"] = str(err)
        return
    starts, steps[name] = read_records(records)
    payload["runs"][name] = summarise(steps[name], args.skip_steps)
    payload["compile_s"][name] = {r: sum(s[r]["compile_s"] for s in steps[name]) for r in starts}
    payload["wall_s"][name] = wall


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both fits of ``args.config``, summarised; writes ``args.json`` and a plot beside it."""
    config = absolute_drafter_paths(yaml.safe_load(Path(args.config).read_text()), Path(args.config).parent)
    runs = {"baseline": without_tlt(config), "tlt": config}
    order = ["baseline", "tlt"] if args.baseline_first else ["tlt", "baseline"]
    if getattr(args, "frozen", False):  # TLT without spot training: what the drafter's training costs
        runs["frozen"] = frozen_drafter(config)
        order.append("frozen")
    peers = list(getattr(args, "peers", None) or [])
    skipped: dict[str, str] = {}
    python = None
    if "vllm" in peers:  # our fit with its rollouts on vLLM (plain sampling): the strongest rollout peer
        try:
            python = vllm_python(getattr(args, "vllm_python", None))
            runs["vllm"] = with_vllm(
                runs["baseline"], args.vllm_config, Path(args.out) / "vllm" / "mlflow.db"
            )
            order.append("vllm")
        except PeerUnavailable as err:
            skipped["vllm"] = str(err)
    if "trl" in peers:
        order.append("trl")
    if getattr(args, "bracket", False):  # the baseline again, last: the machine's drift over the runs
        runs["baseline_again"] = runs["baseline"]
        order.append("baseline_again")
    payload: dict[str, Any] = {
        "config": args.config,
        "machine": machine_info(),
        "devices": args.devices or config.get("trainer", {}).get("devices", 1),
        "skip_steps": args.skip_steps,
        "order": order,
        "runs": {},
        "peers": {},
        "peers_skipped": skipped,
        "compile_s": {},
        "wall_s": {},
    }
    steps: dict[str, list[list[dict[str, Any]]]] = {}
    for name in order:
        measure(name, runs.get(name, config), args, payload, steps, python if name == "vllm" else None)
        write_json(args.json, {**payload, "complete": False, "steps": steps})  # a crash keeps the runs so far
    payload["complete"] = True
    # BEG-MAB's view of each batch bucket at the end of the TLT run: plain vs its best speculative arm.
    tables = sorted((Path(args.out) / "tlt" / "fit").rglob("bandit/best_arms.json"), key=os.path.getmtime)
    payload["buckets"] = json.loads(tables[-1].read_text()).get("buckets") if tables else None
    payload.update(compare(payload["runs"]))
    payload["vs_peers"] = peer_ratios(payload["runs"], payload["peers"])
    payload["steps"] = steps
    write_json(args.json, payload)
    figure = plot(payload, steps, Path(args.json).with_suffix(".png"))
    base, tlt = payload["runs"]["baseline"], payload["runs"]["tlt"]
    drift = f", baseline drift {payload['drift']:.2f}" if "drift" in payload else ""
    print(
        f"[bench e2e] TLT {payload['speedup']:.2f}x per step (median {tlt['step_s']:.1f} s vs "
        f"{base['step_s']:.1f} s), rollout {payload['rollout_speedup']:.2f}x; baseline rollout share "
        f"{base['rollout_share']:.2f}{drift}; wrote {args.json} and {figure}"
    )
    decode, train = (
        payload["decode_speedup_equal_work"]["tlt"]["tokens_per_s"],
        payload["train_speedup_equal_work"].get("tlt"),
    )
    if decode is not None and train is not None:  # the runs' samples differ: the same work compared
        print(
            f"[bench e2e] equal work: TLT's decode {decode:.2f}x, training per forwarded token {train:.2f}x"
        )
    for peer, ratios in payload["vs_peers"].items():
        print(f"[bench e2e] vs {peer}: TLT {ratios['tlt']['step']:.2f}x per step, without TLT "
              f"{ratios['baseline']['step']:.2f}x", flush=True)  # fmt: skip
    for peer, why in skipped.items():
        print(f"[bench e2e] peer {peer} skipped: {why}")
    for name, summary in payload["runs"].items():
        if summary["contended_steps"]:
            print(
                f"[bench e2e] warning: {name} steps {summary['contended_steps']} waited for a core (decode "
                f"CPU / wall < {CONTENDED}): other work ran on this machine"
            )
    return payload
