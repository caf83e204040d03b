"""tlt-lightning: lossless speculative decoding of RL rollouts with a spot-trained drafter.

Subpackages (imports only go downward): ``speculative`` (pure math), ``models``, ``drafter``,
``rollout``, ``scheduling``, ``rl``, ``tracking``; the ``tlt-lightning`` CLI sits on top.
Import what you need from the subpackages; nothing heavy is imported here.
"""

__version__ = "0.1.0.dev0"
__all__ = ["__version__"]
