"""The EAGLE-style drafter: one Llama-architecture decoder layer on top of the target's features.

The drafter borrows the target's frozen token embedding and LM head (by reference: they are not
its parameters, not in its ``state_dict`` and never receive gradients), so it costs about one
target layer. Parameter names are the EAGLE export names vLLM loads (``fc.weight``,
``layers.0.*`` for EAGLE-1; ``midlayer.*``, ``norm.weight`` for EAGLE-3), so exporting is writing
the ``state_dict`` plus a config.

Data flow for a batch of ``n`` rows of ``q`` new positions::

    g   = lift(features)                     # [n, q, H] from the target's [n, q, C, H] features
    h   = drafter(tokens, g, positions, mask) # [n, q, H] predicted next feature (EAGLE-1) or
                                             #           pre-norm state (EAGLE-3); fed back as g
    p   = logits(h)                          # [n, q, V_draft]; draft_to_target() maps ids back
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tlt_lightning.drafter.compiled import CompiledDrafterStep
from tlt_lightning.drafter.config import DrafterConfig
from tlt_lightning.drafter.hub import DrafterHubMixin
from tlt_lightning.drafter.layers import ARCH, AttentionCache, Eagle1Layer, Eagle3Layer, hf_config
from tlt_lightning.drafter.target_refs import target_refs
from tlt_lightning.models.compiled import CompileConfig
from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.layout import PackedWeight, set_weight_layout
from tlt_lightning.models.target import TargetModel

__all__ = ["DRAFTER_QUERY_BUCKETS", "AttentionCache", "Drafter"]

DRAFTER_QUERY_BUCKETS = (1, 2, 4, 8, 16)
"""Query buckets of :meth:`Drafter.use_compiled_steps` by default (the target's are every count up to 16)."""


class Drafter(nn.Module, DrafterHubMixin):
    """An EAGLE-1 / EAGLE-3 drafter for ``target``, sized by ``config``.

    Args:
        config: the drafter's shape; must match ``target`` (checked here).
        target: the target whose embedding and LM head the drafter reads (by reference).
        token_counts: ``[V]`` token frequencies choosing the draft vocabulary (the
            ``draft_vocab_size`` most frequent tokens) when ``config.draft_vocab_size`` is set; without
            them the draft vocabulary is the first ``draft_vocab_size`` ids until
            :meth:`set_draft_vocab` or a checkpoint sets it.
        dtype: parameter dtype (default: the target's).

    Raises:
        ValueError: ``config`` does not match ``target`` (the message names the field).

    ``save_pretrained(DIR)``, ``from_pretrained(DIR_OR_REPO, target=target)`` and ``push_to_hub(REPO)``
    are huggingface_hub's (:class:`~tlt_lightning.drafter.hub.DrafterHubMixin`).

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> drafter = Drafter(DrafterConfig.from_target(target), target)
        >>> sorted(drafter.state_dict())[:2]
        ['fc.weight', 'layers.0.mlp.down_proj.weight']
        >>> drafter.save_pretrained("/tmp/tiny-drafter")  # doctest: +SKIP
        >>> Drafter.from_pretrained("/tmp/tiny-drafter", target=target)  # doctest: +SKIP
    """

    def __init__(
        self,
        config: DrafterConfig,
        target: TargetModel,
        token_counts: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config.check_target(target)
        refs = target_refs(target)
        H, V = config.hidden_size, config.vocab_size
        for name, module in (("embedding", refs.embedding), ("LM head", refs.head)):
            if tuple(module.weight.shape) != (V, H):
                raise ValueError(
                    f"target {name} weight is {list(module.weight.shape)}, "
                    f"expected [vocab_size={V}, hidden_size={H}]"
                )
        self.config = config
        self._refs = refs
        self._head_cache: tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None] | None = None
        self.weight_layout = "out_in"
        self._packed_head = PackedWeight()
        self._compiled: CompiledDrafterStep | None = None
        arch_config = hf_config(config)
        self.rotary_emb = ARCH[config.model_type].rotary(config=arch_config)  # fp32 inv_freq, not persistent
        if config.kind == "eagle1":
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.layers = nn.ModuleList([Eagle1Layer(config, arch_config)])
            trained: list[nn.Module] = [self.fc, self.layers]
        else:
            self.fc = nn.Linear(config.num_features * H, H, bias=False)
            self.midlayer = Eagle3Layer(config, arch_config)
            self.norm = ARCH[config.model_type].norm(H, eps=config.rms_norm_eps)
            trained = [self.fc, self.midlayer, self.norm]
        weight = refs.embedding.weight
        for module in trained:
            module.to(device=weight.device, dtype=dtype or weight.dtype)
        self.rotary_emb.to(device=weight.device)
        if config.reduced_vocab:
            Vd = config.draft_vocab
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long, device=weight.device))
            self.register_buffer("t2d", torch.arange(V, device=weight.device) < Vd)
            if token_counts is not None:
                self.set_draft_vocab(token_counts)
        elif token_counts is not None:
            raise ValueError(
                "token_counts given but config.draft_vocab_size is None (the full vocabulary is used)"
            )

    # ------------------------------------------------------------------------------ properties
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def num_trainable_parameters(self) -> int:
        """Parameters the drafter trains (the embedding and LM head are the target's).

        About one target layer plus ``fc`` (eagle1: ``2H x H``, eagle3: ``3H x H`` and q/k/v over 2H):

        ============ ====== ====== ============ ==========================
        target       eagle1 eagle3 target total target w/o embeddings
        ============ ====== ====== ============ ==========================
        tiny-llama   45.1k  57.6k  156.2k       148.0k (1/3.3 for eagle1)
        SmolLM2-135M 4.20M  5.09M  134.5M       106.2M (1/25, 1/21)
        ============ ====== ====== ============ ==========================

        One SmolLM2 layer has 3.54M parameters: the eagle1 drafter is 1.19 layers (1/L = 1/30).
        """
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def for_target(self, target: TargetModel, dtype: torch.dtype | None = None) -> Drafter:
        """A copy (same config, weights and draft vocabulary) reading ``target``'s embedding and LM head.

        For example the bf16 serving copy of a drafter trained in fp32 on the fp32 policy, for
        rollouts on the policy's bf16 mirror. ``dtype``: parameter dtype (default: ``target``'s).
        """
        copy = Drafter(self.config, target, dtype=dtype)
        copy.load_state_dict(self.state_dict())  # copy_ casts and moves
        return copy.train(self.training)

    # ------------------------------------------------------------------------------ vocabulary
    def set_draft_vocab(self, token_counts: torch.Tensor) -> None:
        """Use the ``draft_vocab_size`` most frequent target tokens (ties: lower id first).

        Args:
            token_counts: ``[V]`` counts (or any scores) per target token.
        """
        c = self.config
        if not c.reduced_vocab:
            raise ValueError("set_draft_vocab needs config.draft_vocab_size; it is None (full vocabulary)")
        counts = torch.as_tensor(token_counts)
        if counts.shape != (c.vocab_size,):
            raise ValueError(f"token_counts must have shape [{c.vocab_size}], got {list(counts.shape)}")
        order = torch.argsort(-counts.double().cpu(), stable=True)[: c.draft_vocab]
        ids = order.sort().values.to(self.d2t.device)  # ascending: draft id order = target id order
        self.d2t.copy_(ids - torch.arange(c.draft_vocab, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """``[V_draft]`` int64 target id of each draft id (ascending)."""
        if not self.config.reduced_vocab:
            return torch.arange(self.config.vocab_size, device=self.device)
        return torch.arange(self.config.draft_vocab, device=self.d2t.device) + self.d2t

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` draft token ids -> target token ids (identity with the full vocabulary)."""
        return ids + self.d2t[ids] if self.config.reduced_vocab else ids

    def to_target_vocab(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter ``[..., V_draft]`` values (probabilities, logits) into ``[..., V]``, ``fill`` elsewhere.

        Use ``fill=0`` for probabilities and ``fill=-inf`` for logits: the verifier works in the
        target vocabulary.
        """
        if not self.config.reduced_vocab:
            return x
        out = x.new_full((*x.shape[:-1], self.config.vocab_size), fill)
        out[..., self.draft_ids] = x
        return out

    # ------------------------------------------------------------------------------ compute
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[...]`` token ids -> ``[..., H]`` target input embeddings (frozen, no gradient)."""
        with torch.no_grad():
            return self._refs.embedding(tokens).to(self.dtype)

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, q, C, H]`` target features -> ``[n, q, H]`` drafter input ``g``.

        EAGLE-1: the single feature (the target's final state). EAGLE-3: ``fc`` of the three features
        concatenated in ``feature_layers`` order.
        """
        c = self.config
        if features.shape[-2:] != (c.num_features, c.hidden_size):
            raise ValueError(
                f"features must be [..., C={c.num_features}, H={c.hidden_size}], got {list(features.shape)}"
            )
        features = features.to(self.dtype)
        if c.kind == "eagle1":
            return features[..., 0, :]
        return self.fc(features.flatten(-2))

    def forward(
        self,
        tokens: torch.Tensor,
        hidden_in: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: AttentionCache | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One drafter pass over ``q`` new positions of ``n`` rows.

        Args:
            tokens: ``[n, q]`` int64 input tokens (the token following each input feature).
            hidden_in: ``[n, q, H]`` :meth:`lift` of the target features, or the drafter's own
                previous output (later draft steps).
            positions: ``[n, q]`` int64 rotary positions (with a cache also the cache slots,
                unless ``slots`` is given).
            attention_mask: ``[n, 1, q, kv_len]`` bool, True where a query may attend a key;
                ``kv_len = q`` without a cache, ``positions.max() + 1`` with a :class:`KVCache`.
                Every query must see at least one key (e.g. itself).
            cache: the drafter's cache (:meth:`new_cache`); ``None`` in training.
            slots: ``[n, q]`` int64 cache slots when they differ from ``positions`` (tree drafting:
                siblings share a position but not a slot).

        Returns:
            ``[n, q, H]`` output hidden: the predicted next feature (EAGLE-1) or the pre-norm state
            (EAGLE-3); :meth:`logits` reads it out, and it is the next step's ``hidden_in``.
        """
        n, q = tokens.shape
        H = self.config.hidden_size
        if hidden_in.shape != (n, q, H):
            raise ValueError(f"hidden_in must be [n, q, H] = {[n, q, H]}, got {list(hidden_in.shape)}")
        if positions.shape != (n, q):
            raise ValueError(f"positions must be [n, q] = {[n, q]}, got {list(positions.shape)}")
        kv_len = cache.begin_step(n, positions if slots is None else slots) if cache is not None else q
        if attention_mask.shape != (n, 1, q, kv_len):
            raise ValueError(
                f"attention_mask must be [n, 1, q, kv_len] = {[n, 1, q, kv_len]}, "
                f"got {list(attention_mask.shape)}"
            )
        # Drafting (cached, no autograd) may run compiled; training stays eager by design.
        if (
            self._compiled is not None
            and isinstance(cache, KVCache)
            and attention_mask.dtype == torch.bool
            and not torch.is_grad_enabled()
        ):
            out = self._compiled(tokens, hidden_in, positions, attention_mask, cache, slots)
            if out is not None:
                return out
        return self.layers_forward(tokens, hidden_in, positions, attention_mask, cache)

    def layers_forward(
        self,
        tokens: torch.Tensor,
        hidden_in: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: AttentionCache | None,
    ) -> torch.Tensor:
        """:meth:`forward` after its checks (``cache.begin_step`` done): embed, rotate, the layer;
        ``[n, q, H]``."""
        embeds = self.embed(tokens)
        hidden_in = hidden_in.to(self.dtype)
        cos, sin = self.rotary_emb(embeds, positions)
        if self.config.kind == "eagle1":
            return self.layers[0](
                self.fc(torch.cat([embeds, hidden_in], -1)), cos, sin, attention_mask, cache
            )
        return self.midlayer(embeds, hidden_in, cos, sin, attention_mask, cache)

    def use_compiled_steps(self, config: CompileConfig | None = None) -> Drafter:
        """Run cached forwards (drafting) through graphs compiled per shape bucket (opt-in; returns ``self``).

        See :mod:`tlt_lightning.drafter.compiled`: same buckets and fallback as
        ``HFTarget(decode="compiled")``; caches from :meth:`new_cache` get the room padding needs.
        Training forwards (no cache, autograd) stay eager. ``config=None``: the default buckets, but queries
        padded to 1, 2, 4, 8 or 16 (:data:`DRAFTER_QUERY_BUCKETS`): a catch-up feeds any count of new
        positions, and for one layer a padded query costs less than compiling a graph for each count.

        Example:
            >>> from tlt_lightning.models import HFTarget, load_model
            >>> target = HFTarget(load_model("tiny-llama").model)
            >>> drafter = Drafter(DrafterConfig.from_target(target), target).use_compiled_steps()
            >>> drafter.compile_seconds
            0.0
        """
        self._compiled = CompiledDrafterStep(
            self, config or CompileConfig(query_buckets=DRAFTER_QUERY_BUCKETS)
        )
        return self

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling drafter graphs so far (0 without :meth:`use_compiled_steps`)."""
        return 0.0 if self._compiled is None else self._compiled.compile_seconds

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` output hidden -> ``[..., V_draft]`` logits through the target's frozen LM head."""
        if self.config.kind == "eagle3":
            hidden_out = self.norm(hidden_out)
        weight, bias = self._head()
        if self.weight_layout == "packed":
            return self._packed_head.linear(hidden_out.to(weight.dtype), weight, bias)
        return F.linear(hidden_out.to(weight.dtype), weight, bias)

    def set_weight_layout(self, layout: str) -> int:
        """Lay out the drafter's linear weights as ``layout`` (see :mod:`tlt_lightning.models.layout`).

        ``"packed"`` also multiplies by a packed copy of its LM-head rows when drafting on a CPU.
        Returns how many linears changed.
        """
        changed = set_weight_layout(self, layout)
        self.weight_layout = layout
        return changed

    def target_logits(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` target final states -> ``[..., V_draft]`` the target's logits on the draft vocabulary.

        The training targets of the soft cross-entropy: with a reduced vocabulary this reads only
        the LM-head rows of draft tokens (SmolLM2: 8k of 49k rows, 6x less work).
        """
        weight, bias = self._head()
        with torch.no_grad():
            return F.linear(target_hidden.to(weight.dtype), weight, bias)

    def _head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's weight (rows of the draft vocabulary), detached; cached until either changes."""
        head = self._refs.head
        weight, bias = head.weight, getattr(head, "bias", None)
        if not self.config.reduced_vocab:
            return weight.detach(), None if bias is None else bias.detach()
        # The target's weights change in place during RL: key the copy on their storage and version.
        key = (weight.data_ptr(), weight._version, self.d2t.data_ptr(), self.d2t._version)
        if self._head_cache is None or self._head_cache[0] != key:
            # Normal tensors even under inference_mode, so a later training step can use them.
            with torch.inference_mode(False), torch.no_grad():
                ids = self.draft_ids.clone()
                rows = weight.detach().index_select(0, ids)
                rows_bias = None if bias is None else bias.detach().index_select(0, ids)
            self._head_cache = (key, rows, rows_bias)
        return self._head_cache[1], self._head_cache[2]

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        """A one-layer :class:`KVCache` for this drafter (``cache.update(k, v, 0)``)."""
        c = self.config
        if self._compiled is not None:  # room for the buckets' padding
            return self._compiled.new_cache(
                1, max_batch, c.num_key_value_heads, max_len, c.head_dim, self.dtype, self.device
            )
        return KVCache(1, max_batch, c.num_key_value_heads, max_len, c.head_dim, self.dtype, self.device)
