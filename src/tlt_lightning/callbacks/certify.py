"""CertifyCallback: periodic certificates that the fit's speculative rollouts stay lossless.

The spot-trained drafter changes every RL step and the policy with it; speculative rollouts must stay
exact throughout (a drafter never changes what is sampled, only how fast). Every ``every_n_steps``
RL steps (and once before the first), this callback runs :func:`~tlt_lightning.certify.certify` on
the *current* rollout policy with the newest published drafter of the
:class:`~tlt_lightning.callbacks.SpotDrafterCallback` (else the module's own drafter), the fit's
sampling settings and probe prompts of its task. It logs ``certify/lossless`` (1 or 0),
``certify/detectable_tv``, ``certify/min_pvalue`` and ``certify/seconds``, and writes each
certificate (``certificate.json`` and ``certificate.png``) under the run's own directory as
``certify/step-XXXXXXXX/``, also an MLflow artifact of the fit's run with an ``MLFlowLogger``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from tlt_lightning.callbacks.spot_drafter import SpotDrafterCallback
from tlt_lightning.certify import Certificate, CertifyConfig, certify, write_certificate
from tlt_lightning.rl.module import GRPOModule
from tlt_lightning.speculative import DraftSpec, arm_key, parse_arm
from tlt_lightning.tracking import log_artifact, run_dir
from tlt_lightning.validation import positive_int

__all__ = ["CertifyCallback"]

_CONFIG_FIELDS = {f.name for f in fields(CertifyConfig)}


class CertifyCallback(L.Callback):
    """Certify the fit's speculative rollouts every few RL steps (a measurement, off the RL path).

    Place it after the :class:`~tlt_lightning.callbacks.SpotDrafterCallback` in the callback list (it
    certifies what that callback published at the end of the step).

    Args:
        config: a :class:`~tlt_lightning.certify.CertifyConfig` or a dict of its fields; sampling
            settings not given (``temperature``, ``top_p``, ``top_k``) are the fit's rollout settings.
            Default: ``{"rows": 2000, "depth": 2, "positions": [0]}`` (a quick check).
        every_n_steps: certify after every this many RL steps (and once before the first).
        arm: the arm under test, a :class:`~tlt_lightning.speculative.DraftSpec` or its key
            (``"chain4"``, ``"tree4x2/8"``; ``"off"``: plain decoding, no drafter needed).
        num_prompts: probe prompts (the last ones of the module's prompt source).

    Attributes:
        history: one dict per certificate: ``step``, ``lossless``, ``detectable_tv``, ``min_pvalue``,
            ``seconds``, ``path`` (its directory).
        last: the last :class:`~tlt_lightning.certify.Certificate`.

    Example:
        >>> # L.Trainer(callbacks=[SpotDrafterCallback(), CertifyCallback(every_n_steps=50)])
    """

    def __init__(
        self,
        config: CertifyConfig | Mapping[str, Any] | None = None,
        every_n_steps: int = 10,
        arm: DraftSpec | str | None = "chain4",
        num_prompts: int = 1,
    ) -> None:
        super().__init__()
        positive_int("every_n_steps", every_n_steps)
        positive_int("num_prompts", num_prompts)
        if config is None:
            config = {"rows": 2000, "depth": 2, "positions": [0]}
        if isinstance(config, CertifyConfig):
            config = {name: getattr(config, name) for name in _CONFIG_FIELDS}
        if not isinstance(config, Mapping):
            raise TypeError(
                f"config must be a CertifyConfig or a dict of its fields, got {type(config).__name__}"
            )
        unknown = set(config) - _CONFIG_FIELDS
        if unknown:
            raise ValueError(
                f"config has unknown fields {sorted(unknown)}; allowed: {sorted(_CONFIG_FIELDS)}"
            )
        CertifyConfig(**config)  # validated now, not at the first certificate
        self.overrides = dict(config)
        self.arm = parse_arm(arm) if isinstance(arm, str) else arm
        self.every_n_steps, self.num_prompts = every_n_steps, num_prompts
        self.history: list[dict[str, Any]] = []
        self.last: Certificate | None = None
        self.config: CertifyConfig | None = None  # with the fit's sampling settings, at fit start
        self._spot: SpotDrafterCallback | None = None
        self.run_dir: Path | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, GRPOModule):
            raise TypeError(f"CertifyCallback needs a GRPOModule, got {type(pl_module).__name__}")
        if len(pl_module.prompt_source) < self.num_prompts:
            raise ValueError(
                f"num_prompts={self.num_prompts} is more than the {len(pl_module.prompt_source)} prompts of "
                f"the module's prompt source"
            )
        spots = [cb for cb in trainer.callbacks if isinstance(cb, SpotDrafterCallback)]
        self._spot = spots[0] if spots else None
        if self.arm is not None and self._spot is None and pl_module.drafter is None:
            raise TypeError(
                f"CertifyCallback arm {arm_key(self.arm)} needs a drafter: add a SpotDrafterCallback"
            )
        rollout = pl_module.rollout_settings
        sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k}
        self.config = CertifyConfig(**{**sampling, **self.overrides})
        self.run_dir = run_dir(trainer)  # on every rank: rank 0's directory, broadcast
        self._certify(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._certify(trainer, pl_module)

    @torch.no_grad()
    def _certify(self, trainer: L.Trainer, module: GRPOModule) -> None:
        if not trainer.is_global_zero:  # one certificate per step; the policy is the same on every rank
            return
        source = module.prompt_source
        prompts = [source.prompt_ids(i) for i in range(len(source) - self.num_prompts, len(source))]
        was_training = module.policy.training
        module.policy.eval()
        lease = self._spot.spot.publisher.acquire() if self._spot is not None else nullcontext()
        try:
            with lease as held:
                drafter = held.drafter if held is not None else module.drafter
                drafter = drafter if self.arm is not None else None
                cert = certify(module.rollout_target, prompts, self.config, drafter=drafter, arm=self.arm)
        finally:
            module.policy.train(was_training)
        step = trainer.global_step
        cert.info.update(rl_step=step, arm=arm_key(self.arm))
        directory = self.run_dir / "certify" / f"step-{step:08d}"
        write_certificate(cert, directory)
        log_artifact(trainer, directory, f"certify/step-{step:08d}")
        self.last = cert
        entry = {
            "step": step,
            "lossless": cert.lossless,
            "detectable_tv": cert.detectable_tv,
            "min_pvalue": min(t["pvalue"] for t in cert.tests),
            "seconds": cert.info["seconds"]["total"],
            "path": str(directory),
        }
        self.history.append(entry)
        if step > 0:  # Lightning logs from the training hooks only
            for key in ("lossless", "detectable_tv", "min_pvalue", "seconds"):
                module.log(f"certify/{key}", float(entry[key]), rank_zero_only=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
