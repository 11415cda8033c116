"""Batch buckets of the serving loop (``serve.py``): a smaller-batch decode model over the same weights, caches
and per-row buffers, as engines capture one graph per batch size."""
from __future__ import annotations

import dataclasses

from .modeling import GlmMoeDsaForCausalLM

#: the per-row buffers of a decode model that a batch bucket takes as rows 0..b-1 of the largest model's
_ROW_BUFFERS = ("sel_kv", "sel_rope", "sel_block_table", "sel_status")


def bucket_model(model: GlmMoeDsaForCausalLM, batch_size: int) -> GlmMoeDsaForCausalLM:
    """A decode model of ``batch_size`` rows for a batch bucket of ``model`` (the largest bucket): the same
    parameters and the same KV / indexer caches (the paged caches do not depend on the batch: any block
    table row may address any block), its own block table ``[batch_size, cache_len]`` (initially rows
    ``0..batch_size-1`` of ``model``'s), and selection buffers / ledgers that are views of ``model``'s rows
    ``0..batch_size-1`` (``sel_kv`` / ``sel_rope`` are row-major ``[B*S*K/BS, ...]``), so a request keeps
    its ledger when the bucket changes. Only the decode step is meant to run on it: prefill and
    ``reset_rows`` belong to ``model`` (the caches are sized by its batch)."""
    if model.parallel is not None:
        raise ValueError("bucket_model: model must be a single-process model (parallel layout given)")
    if not model.runner.enable_offload:
        raise ValueError("bucket_model: model must be built with enable_offload=True (selection ledger)")
    if not 1 <= batch_size < model.batch_size:
        raise ValueError(f"bucket_model: batch_size must be in [1, {model.batch_size}) (the model's batch), "
                         f"got {batch_size}")
    # built on the meta device (no memory, no weight init), then every tensor re-pointed at model's
    small = GlmMoeDsaForCausalLM(model.config, dataclasses.replace(model.runner, batch_size=batch_size),
                                 device="meta", seed=None)
    big = dict(model.named_modules())
    for name, mod in small.named_modules():
        src = big[name]
        for pname in list(mod._parameters):
            mod._parameters[pname] = src._parameters[pname]
        for bname, t in list(mod._buffers.items()):
            full = src._buffers[bname]
            if bname in _ROW_BUFFERS:
                mod._buffers[bname] = full[: t.size(0)]
            elif name == "" and bname == "block_table":
                mod._buffers[bname] = full[:batch_size].clone()
            else:
                mod._buffers[bname] = full
    small.return_internals = model.return_internals
    return small.train(model.training)
