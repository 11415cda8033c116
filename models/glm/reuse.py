"""Prefix reuse in the serving loop (``serve.py``): prefill a prompt's suffix on top of a prefix already in a
batch-1 model's caches (reloaded from a KV store, or prefilled before), and the multi-turn / shared-prefix
workload whose prompts share long prefixes.

The suffix prefill (:func:`prefill_from`) attends to every earlier position through the caches themselves:
MLA in absorbed form (the query mapped into the latent space by ``kv_b_proj``'s K half, scores against the
cached latent + rope, the latent output mapped back by the V half), so a reloaded prefix costs no
``kv_b_proj`` over its tokens. Every key is read back from the caches (in the cache dtype), the suffix's own
too: the result depends on the prefix only through the cached bytes, which is what makes a reloaded prefix
and a recomputed one with the same boundaries give the same bits.

Models never import the store: the serving loop receives a duck-typed object (``Server(store=...)``).
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from .modeling import GlmMoeDsaForCausalLM, GlmMoeDsaMoE, rope_cos_sin

log = logging.getLogger("offload_passes.models.reuse")


#: Query rows x keys per block of scores: bounds what a long suffix materialises.
_SCORES_PER_BLOCK = 1 << 24


def _latent_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, rope: torch.Tensor, start: int,
                      scale: float) -> torch.Tensor:
    """Causal attention of queries ``q_abs [H, L, C]`` / ``q_pe [H, L, R]`` at positions ``start..start+L-1``
    over the cached latent ``lat [N, C]`` and rope keys ``rope [N, R]``, which every head shares (MLA's absorbed
    form is multi-query): the heads are folded into the query rows, so the cache is read once, not expanded per
    head, and the scores are the two products summed (no concatenated key). Long suffixes go in query blocks
    that see only the keys before their last position; a block's mask exists only where it cuts. Scores and
    softmax in fp32. Returns ``[1, H, L, C]``."""
    H, L, C = q_abs.shape
    step = max(1, _SCORES_PER_BLOCK // (H * lat.size(0)))
    outs = []
    for l0 in range(0, L, step):
        l1 = min(L, l0 + step)
        n = start + l1  # keys this block sees
        s = (q_abs[:, l0:l1].reshape(-1, C) @ lat[:n].t()).float()
        s += (q_pe[:, l0:l1].reshape(H * (l1 - l0), -1) @ rope[:n].t()).float()
        s = s.view(H, l1 - l0, n)
        if l1 - l0 > 1:  # row l sees keys <= start + l0 + l
            cut = torch.arange(n, device=s.device) > torch.arange(start + l0, n, device=s.device).unsqueeze(1)
            s.masked_fill_(cut, float("-inf"))
        p = (s * scale).softmax(dim=-1).to(lat.dtype)
        outs.append(p.view(-1, n) @ lat[:n])
    o = outs[0] if len(outs) == 1 else torch.cat([t.view(H, -1, C) for t in outs], dim=1)
    return o.view(1, H, L, C)


def _attend_from(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 valid: tuple, all_slots: torch.Tensor, start: int) -> torch.Tensor:
    """One layer's attention of the suffix ``x [1, L, hidden]`` over cache positions ``0..start+L-1``."""
    L = x.size(1)
    q_resid, q_nope, q_pe, c, k_pe = attn._q_and_latent(x, cos, sin)
    attn.write_kv_cache(slots, c[valid].to(attn.kv_cache.dtype), k_pe[valid].to(attn.k_rope_cache.dtype))
    if attn.indexer is not None:
        attn.indexer.prefill(x, q_resid, cos, sin, slots, valid)
    C, R, H = attn.kv_lora_rank, attn.rope_dim, attn.num_heads
    lat = attn.kv_cache.view(-1, C)[all_slots].to(x.dtype)  # [N, C]: the prefix and this suffix, as cached
    rope = attn.k_rope_cache.view(-1, R)[all_slots].to(x.dtype)
    w_uk, w_uv = attn._absorb_weights()
    q_abs = torch.einsum("blhn,hnc->bhlc", q_nope, w_uk)
    o = _latent_attention(q_abs[0], q_pe[0].transpose(0, 1), lat, rope, start, attn.scale)  # [1, H, L, C]
    o = torch.einsum("bhlc,hvc->blhv", o, w_uv)
    return attn.o_proj(o.reshape(1, L, H * attn.v_head_dim))


#: model -> {parameter name: ((storage, version), the parameter in the compute dtype)}
_WIDE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _weights_as(model: GlmMoeDsaForCausalLM, dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Run ``model`` with its floating parameters in ``dtype`` (None: unchanged). The cast copies are made once
    per model and reused while a parameter keeps its storage and version: casting every weight at every call
    cost more than a short suffix's compute. Same values as ``_params_as`` (the cast is the same); the price is
    one wide copy of the weights kept beside a CPU prefill model."""
    if dtype is None:
        yield
        return
    wide = _WIDE.setdefault(model, {})
    saved = []
    try:
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            stamp = (p.data_ptr(), p._version)
            hit = wide.get(name)
            if hit is None or hit[0] != stamp or hit[1].dtype != dtype:
                hit = wide[name] = (stamp, p.data.to(dtype))
            saved.append((p, p.data))
            p.data = hit[1]
        yield
    finally:
        for p, d in saved:
            p.data = d


@torch.no_grad()
def prefill_from(model: GlmMoeDsaForCausalLM, input_ids: torch.Tensor, start: int) -> torch.Tensor:
    """Prefill tokens ``start..P-1`` of ``input_ids [P]`` into row 0 of a batch-1 ``model`` whose caches hold
    positions ``0..start-1`` already (reloaded or prefilled); returns the last token's logits ``[1, V]``.
    Computes as ``prefill``'s ``compute_dtype="auto"`` does (fp32 on the CPU for a bf16 model)."""
    if model.batch_size != 1 or model.parallel is not None:
        raise ValueError("prefill_from: model must be a single-process batch-1 model (the serving loop's prefill "
                         f"model), got batch_size={model.batch_size}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype != torch.int64:
        raise TypeError("prefill_from: input_ids must be a 1-D int64 tensor")
    P = input_ids.numel()
    cap = model.block_table.size(1) * model.block_size
    if not (isinstance(start, int) and 1 <= start < P <= cap):
        raise ValueError(f"prefill_from: start must be an int with 1 <= start < len(input_ids)={P} <= "
                         f"pa_max_length={cap}, got {start!r}")
    cpu = model.lm_head.weight.device.type == "cpu"
    cd = torch.float32 if cpu and model.config.dtype != torch.float32 else None
    dev, BS, L = model.block_table.device, model.block_size, P - start
    pos = torch.arange(start, P, dtype=torch.int64, device=dev)
    every = torch.arange(P, dtype=torch.int64, device=dev)
    table = model.block_table[0].to(torch.int64)
    slots = table[pos // BS] * BS + pos % BS
    all_slots = table[every // BS] * BS + every % BS
    valid = (torch.zeros(L, dtype=torch.int64, device=dev), torch.arange(L, dtype=torch.int64, device=dev))
    cos, sin = rope_cos_sin(pos.view(1, L), model.inv_freq)
    x = model._embed(input_ids[start:].to(dev)).view(1, L, -1)
    if cd is not None:
        x = x.to(cd)
    with _weights_as(model, cd):
        for layer in model.model.layers:
            x = x + _attend_from(layer.self_attn, layer.input_layernorm(x), cos, sin, slots, valid, all_slots, start)
            h = layer.post_attention_layernorm(x)
            x = x + (layer.mlp.forward_sparse(h) if isinstance(layer.mlp, GlmMoeDsaMoE) else layer.mlp(h))
        return model._logits(model.model.norm(x[0, -1:])).to(model.config.dtype)


# ------------------------------------------------------------------------------------------ workload


@dataclass
class Branch:
    """One conversation of the multi-turn workload: its history (every token so far) and its next turn."""

    index: int
    turn: int = 0
    history: Optional[torch.Tensor] = None  # prompt + generated tokens of its last finished turn
    ready: bool = True
    done: bool = False


@dataclass
class MultiTurn:
    """Conversations that share one prefix (a system prompt): ``branches`` of them, ``turns`` turns each; turn
    ``t``'s prompt = turn ``t-1``'s prompt + its generated tokens + new user tokens (turn 0: the shared prefix +
    user tokens). A branch's next turn is ready when its previous one finished; a conversation ends early when
    its next prompt would not fit the cache (``fits``). Every draw comes from the loop's seeded generator."""

    shared_prefix: int
    branches: int
    turns: int
    user_len: tuple
    prefix: Optional[torch.Tensor] = None
    state: list = field(default_factory=list)

    def start(self, gen: torch.Generator, vocab: int) -> None:
        self.prefix = torch.randint(0, vocab, (self.shared_prefix,), generator=gen)
        self.state = [Branch(i) for i in range(self.branches)]

    def next_turn(self, gen: torch.Generator, vocab: int, fits) -> Optional[tuple[int, torch.Tensor]]:
        """``(branch, prompt)`` of the first ready branch, or None (every branch is running or done)."""
        for b in self.state:
            if b.done or not b.ready:
                continue
            lo, hi = self.user_len
            n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            user = torch.randint(0, vocab, (n,), generator=gen)
            prompt = torch.cat([self.prefix if b.history is None else b.history, user])
            if not fits(prompt.numel()):
                b.done = True
                log.debug("multi-turn: branch %d ends at turn %d (a %d-token prompt does not fit)", b.index,
                          b.turn, prompt.numel())
                continue
            b.ready = False
            return b.index, prompt
        return None

    def finished(self, branch: int, tokens: torch.Tensor) -> None:
        b = self.state[branch]
        b.history, b.turn = tokens, b.turn + 1
        b.ready = True
        b.done = b.turn >= self.turns

    @property
    def exhausted(self) -> bool:
        return bool(self.state) and all(b.done for b in self.state)


# ------------------------------------------------------------------------------------------ the loop's side


class PrefixReuse:
    """What the serving loop does with a store (duck-typed: ``reload(model, tokens, limit) -> n``,
    ``save(model, blocks, tokens) -> written keys``, ``stats``) and a reference (``reload(model, tokens, n)``,
    ``save(model, blocks, tokens, written)``): reload at admission, prefill the rest, store at leaving."""

    def __init__(self, store, reference=None) -> None:
        for name in ("reload", "save"):
            if not callable(getattr(store, name, None)):
                raise TypeError(f"Server: store must have a {name}() method (offload_passes.store.paged.PagedStore), "
                                f"got {type(store).__name__}")
        self.store, self.reference = store, reference
        self.tokens_total = 0
        self.tokens_computed = 0
        self.admitted_with_hit = 0

    @staticmethod
    def _compute(model: GlmMoeDsaForCausalLM, prompt: torch.Tensor, n: int) -> None:
        if n:
            prefill_from(model, prompt, n)
        else:
            P = prompt.numel()
            model.prefill(prompt.view(1, P), torch.tensor([P]))

    def admit(self, model: GlmMoeDsaForCausalLM, prompt: torch.Tensor, transfer) -> int:
        """Reload the longest stored prefix (at least one prompt token is left to compute: the logits),
        prefill the rest and ``transfer(False)`` (``None`` when the two kinds of lane get the same); then, with
        a reference, recompute that prefix with the same boundary and ``transfer(True)``."""
        P = prompt.numel()
        n = int(self.store.reload(model, prompt, P - 1))
        self._compute(model, prompt, n)
        self.tokens_total += P
        self.tokens_computed += P - n
        self.admitted_with_hit += n > 0
        if self.reference is None or n == 0:
            transfer(None)
            return n
        transfer(False)
        self.reference.reload(model, prompt, n)
        prefill_from(model, prompt, n)
        transfer(True)
        return n

    def leave(self, model: GlmMoeDsaForCausalLM, reference_model: Optional[GlmMoeDsaForCausalLM], blocks: list,
              tokens: torch.Tensor) -> None:
        written = self.store.save(model, blocks, tokens)
        if self.reference is not None:
            self.reference.save(reference_model, blocks, tokens, written)

    def stats(self) -> dict:
        out = {"prefill_tokens_total": self.tokens_total, "prefill_tokens_computed": self.tokens_computed,
               "admitted_with_hit": self.admitted_with_hit}
        st = getattr(self.store, "stats", None)
        if st is not None:
            d = st.as_dict() if hasattr(st, "as_dict") else dict(st)
            out.update(chunks_loaded=d.get("chunks_loaded", {}), chunks_rejected=d.get("chunks_rejected", 0),
                       chunks_stored=d.get("chunks_stored", {}), tier_faults=d.get("tier_faults", {}))
        return out
