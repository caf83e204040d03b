"""What a certificate writes: its JSON and a picture of observed against expected frequencies."""

from __future__ import annotations

from pathlib import Path

from tlt_lightning.certify.certificate import Certificate
from tlt_lightning.reports import draw_or_skip, machine_info, new_figure, save_figure, write_json

__all__ = ["plot_certificate", "write_certificate"]


def plot_certificate(cert: Certificate, path: str | Path) -> Path:
    """Observed against expected count of every bin of every test (log-log; the diagonal is exact).

    A lossless stack keeps every point within a few ``sqrt(expected)`` of the diagonal (the band);
    the bins of rejected tests are drawn in red.
    """
    fig, ax = new_figure(figsize=(6, 5))
    top = 1.0
    for test, (obs, exp) in zip(cert.tests, cert.bins):
        if exp.numel() == 0:
            continue
        colour = "tab:red" if test["rejected"] else ("tab:blue" if test["depth"] == 1 else "tab:green")
        ax.scatter(exp.numpy(), obs.clamp(min=0.5).numpy(), s=8, alpha=0.5, color=colour)
        top = max(top, float(exp.max()), float(obs.max()))
    import numpy as np

    line = np.geomspace(1, top * 1.2, 100)
    ax.plot(line, line, color="black", lw=0.8)
    ax.fill_between(line, np.maximum(line - 3 * np.sqrt(line), 0.5), line + 3 * np.sqrt(line), alpha=0.15)
    ax.set(xscale="log", yscale="log", xlabel="expected count (target's exact law)", ylabel="observed count")
    ax.set_title(f"{cert.info['stack']}: {'lossless' if cert.lossless else 'NOT lossless'}", fontsize=10)
    ax.scatter([], [], color="tab:blue", label="next token (depth 1)")
    ax.scatter([], [], color="tab:green", label="later tokens, joint")
    ax.scatter([], [], color="tab:red", label="rejected test")
    ax.legend(fontsize=8, loc="upper left")
    return save_figure(fig, path)


def write_certificate(cert: Certificate, directory: str | Path) -> Path:
    """``certificate.json`` (with the machine) and ``certificate.png`` (skipped with a warning without
    matplotlib) in ``directory``; returns the JSON's path."""
    directory = Path(directory)
    path = write_json(directory / "certificate.json", {**cert.to_dict(), "machine": machine_info()})
    draw_or_skip(plot_certificate, cert, directory / "certificate.png")
    return path
