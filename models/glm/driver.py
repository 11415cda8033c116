"""Prefill + N decode steps with a deterministic token source.

The token stream does not depend on the logits (a seeded generator draws every prompt and decode
token up front), so two models that differ only in how they attend (offload vs non-offload, eager
vs compiled vs rewritten) see exactly the same inputs. Every step feeds S = 1 + next_n tokens per row
(all accepted, MTP style) at positions ``cur_len[b] .. cur_len[b] + S - 1``.

Top-k trace (``Driver.trace()`` / ``save_trace(path)``) for tools: a dict
``{"format": "offload_passes.topk_trace", "version": 1, "B", "S", "K", "num_layers", "groups": [[layers]],
"kv_len": int32 [steps, B], "topk": int32 [steps, G, B, S, K]}`` where ``topk[step, g]`` is the
indexer output of group g's owner at that step (-1 padded) and ``kv_len`` the cache length including
that step's tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from .config import RunnerConfig
from .modeling import GlmMoeDsaForCausalLM

log = logging.getLogger("offload_passes.models.driver")


@dataclass
class StepOutput:
    logits: torch.Tensor                     # [B, S, V]
    positions: torch.Tensor                  # [B, S]
    attn: Optional[list] = None              # per layer [T, H, kv_lora_rank]
    topk: Optional[list] = None              # per group [B, S, K]
    act: Optional[list] = None               # per layer [T] (offload)


@dataclass
class RunResult:
    prefill_logits: Optional[torch.Tensor] = None
    steps: list = field(default_factory=list)

    @property
    def logits(self) -> list:
        return [s.logits for s in self.steps]


class Driver:
    """Drive a :class:`GlmMoeDsaForCausalLM`.

    ``step_fn`` (default: the model itself) is what runs a decode step, e.g. ``torch.compile(model)``;
    it must return what the model returns. ``prefill_lens`` (per row) defaults to ``prefill_len`` for
    every row; shorter rows make the batch ragged.
    """

    def __init__(
        self,
        model: GlmMoeDsaForCausalLM,
        runner: Optional[RunnerConfig] = None,
        *,
        seed: Optional[int] = None,
        prefill_lens: Optional[Sequence[int]] = None,
        max_steps: Optional[int] = None,
        global_batch: Optional[int] = None,
        row_offset: int = 0,
    ) -> None:
        """``global_batch`` / ``row_offset`` (attention data parallel): the token stream is drawn for the
        global batch and this driver feeds rows ``[row_offset, row_offset + B)``, so every rank sees its
        own rows of the same stream (and the same rows as a single process with the global batch)."""
        self.model = model
        self.runner = runner or model.runner
        r = self.runner
        self.B, self.S = model.batch_size, model.seq_per_step
        self.K = model.config.index_topk
        self.groups = model.config.groups()
        self.seed = r.seed if seed is None else seed
        self.prefill_lens = torch.tensor(
            [r.prefill_len] * self.B if prefill_lens is None else list(prefill_lens), dtype=torch.int64
        )
        if self.prefill_lens.shape != (self.B,) or int(self.prefill_lens.min()) < 1:
            raise ValueError(f"prefill_lens must be {self.B} positive lengths, got {self.prefill_lens.tolist()}")
        self.max_steps = r.decode_steps if max_steps is None else max_steps
        cap = r.pa_max_length
        need = int(self.prefill_lens.max()) + self.max_steps * self.S
        if need > cap:
            raise ValueError(f"pa_max_length={cap} cannot hold prefill + {self.max_steps} steps x S={self.S} "
                             f"= {need} tokens")
        V = model.config.vocab_size
        g = torch.Generator().manual_seed(self.seed)
        GB = self.B if global_batch is None else global_batch
        if not 0 <= row_offset <= GB - self.B:
            raise ValueError(f"row_offset must be in [0, global_batch - B = {GB - self.B}], got {row_offset}")
        rows = slice(row_offset, row_offset + self.B)
        self.prompt = torch.randint(0, V, (GB, int(self.prefill_lens.max())), generator=g)[rows].contiguous()
        self.tokens = torch.randint(0, V, (self.max_steps, GB, self.S), generator=g)[:, rows].contiguous()
        self.cur_len = self.prefill_lens.clone()
        self.step_idx = 0
        self._trace_topk: list[torch.Tensor] = []
        self._trace_len: list[torch.Tensor] = []

    # ---------------------------------------------------------------- prefill / inputs
    def prefill(self) -> torch.Tensor:
        """Prefill every row (resets caches and ledgers); returns last-token logits ``[B, V]``."""
        self.cur_len = self.prefill_lens.clone()
        self.step_idx = 0
        self._trace_topk.clear()
        self._trace_len.clear()
        return self.model.prefill(self.prompt, self.prefill_lens)

    def next_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [B,S] int64, positions [B,S] int64)`` of the next decode step."""
        if self.step_idx >= self.max_steps:
            raise RuntimeError(f"Driver: token source exhausted after max_steps={self.max_steps} steps")
        pos = self.cur_len.unsqueeze(1) + torch.arange(self.S, dtype=torch.int64)
        return self.tokens[self.step_idx].clone(), pos

    # ---------------------------------------------------------------- decode
    @torch.no_grad()
    def step(self, step_fn: Optional[Callable] = None) -> StepOutput:
        ids, pos = self.next_inputs()
        dev = self.model.block_table.device  # the token stream is drawn on the host; the step runs on the model's device
        ids, pos = ids.to(dev), pos.to(dev)
        out = (step_fn if step_fn is not None else self.model)(ids, pos)
        res = StepOutput(logits=out, positions=pos)
        if isinstance(out, tuple):
            logits, attn, topk, act = out
            res = StepOutput(
                logits=logits, positions=pos, attn=[a.clone() for a in attn],
                topk=[t.view(self.B, self.S, self.K).clone() for t in topk],
                act=[a.clone() for a in act],
            )
            self._trace_topk.append(torch.stack(res.topk))
            self._trace_len.append((pos[:, -1] + 1).to(torch.int32))
        self.cur_len += self.S
        self.step_idx += 1
        return res

    def run(self, steps: Optional[int] = None, step_fn: Optional[Callable] = None,
            collect: bool = False) -> RunResult:
        """Prefill, then ``steps`` (default ``decode_steps``) decode steps.

        ``collect=True`` switches the model to ``return_internals`` (per-layer attention outputs, top-k,
        gather lengths) for the run. A compiled ``step_fn`` must have been compiled with the same
        setting (``model.return_internals`` is a guarded attribute).
        """
        steps = self.max_steps if steps is None else steps
        prev = self.model.return_internals
        self.model.return_internals = collect or prev
        try:
            result = RunResult(prefill_logits=self.prefill())
            for _ in range(steps):
                result.steps.append(self.step(step_fn))
        finally:
            self.model.return_internals = prev
        return result

    # ---------------------------------------------------------------- rows / trace
    def reset_row(self, b: int, prompt_len: Optional[int] = None) -> torch.Tensor:
        """Row ``b`` starts a new request: re-prefill it (caches + ledger reset) with a fresh prompt."""
        n = int(self.prefill_lens[b]) if prompt_len is None else prompt_len
        g = torch.Generator().manual_seed(self.seed * 1000003 + 7919 * (b + 1) + self.step_idx)
        prompt = torch.randint(0, self.model.config.vocab_size, (1, n), generator=g)
        self.cur_len[b] = n
        return self.model.prefill(prompt, torch.tensor([n]), rows=[b])

    def trace(self) -> dict:
        if not self._trace_topk:
            raise RuntimeError("Driver.trace: no top-k recorded (run with collect=True)")
        return {
            "format": "offload_passes.topk_trace",
            "version": 1,
            "B": self.B,
            "S": self.S,
            "K": self.K,
            "num_layers": self.model.config.num_hidden_layers,
            "groups": self.groups,
            "kv_len": torch.stack(self._trace_len),
            "topk": torch.stack(self._trace_topk),
        }

    def save_trace(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        torch.save(self.trace(), path)
        return path
