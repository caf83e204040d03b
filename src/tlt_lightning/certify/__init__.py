"""Certificates that a rollout stack is lossless: samples through it against the target's exact laws.

:func:`certify` draws many short continuations of fixed prefixes through the stack under test (our
engine plain or speculative with any arm and drafter, or any rollout backend such as vLLM) and tests
them against the target's next-token and joint laws, with Holm's correction and the smallest
deviation each test detects (:mod:`~tlt_lightning.certify.stats`). ``tlt-lightning certify`` runs it
on a registry model, a drafter checkpoint and a task's prompts; docs/certify.md says how to read it.
"""

from tlt_lightning.certify.certificate import Certificate, CertifyConfig, certify
from tlt_lightning.certify.report import plot_certificate, write_certificate
from tlt_lightning.certify.stats import binned_chi_square, detectable_tv, holm

__all__ = [
    "Certificate",
    "CertifyConfig",
    "binned_chi_square",
    "certify",
    "detectable_tv",
    "holm",
    "plot_certificate",
    "write_certificate",
]
