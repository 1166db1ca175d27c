"""A pipeline stage of the guide's encoder-decoder (docs/user-guide.md, ``encdec.py``) written by
hand, as a user writes a manual ``torch.distributed.pipelining.PipelineStage`` module with several
inputs and outputs: the oracle of tests/test_pipeline_stacks.py and tests/data/pp_stacks_rank.py.

The encoder's and the decoder's blocks are cut as one list (encoder blocks first) into stages of
``cut(L_enc, L_dec, pp)`` blocks (the even split: L // pp each, the first L mod pp one more). A
stage that starts inside the encoder receives its hidden state; the stage that holds the
decoder's first block embeds the target tokens (a copy of the shared table, as Megatron-LM's
split rank holds the decoder's embedding); every stage after the encoder receives the encoder's
output (``memory``) and sends it on with the decoder's hidden state.
"""
from __future__ import annotations

from torch import nn


def cut(L_enc: int, L_dec: int, pp: int, stage: int) -> tuple[int, int, int, int]:
    """(e0, e1, d0, d1): the encoder blocks [e0, e1) and decoder blocks [d0, d1) of ``stage``."""
    L = L_enc + L_dec
    per = [L // pp + (1 if s < L % pp else 0) for s in range(pp)]
    lo = sum(per[:stage])
    hi = lo + per[stage]
    return min(lo, L_enc), min(hi, L_enc), max(lo - L_enc, 0), max(hi - L_enc, 0)


class Stage(nn.Module):
    """Stage ``stage`` of ``pp`` of ``model`` (an ``EncoderDecoder`` of the guide's example):
    ``forward(*received, src, tgt)``; returns the encoder's hidden state (a stage ending inside the
    encoder), the encoder's output (a stage ending with it), ``(x, memory)`` (a stage ending in the
    decoder) or the logits (the last)."""

    def __init__(self, model, L_enc: int, L_dec: int, pp: int, stage: int):
        super().__init__()
        e0, e1, d0, d1 = cut(L_enc, L_dec, pp, stage)
        self.has_enc, self.has_dec = e1 > e0, d1 > d0
        self.first = stage == 0
        self.ends_enc = self.has_enc and e1 == L_enc
        self.starts_dec = self.has_dec and d0 == 0
        self.last = stage == pp - 1
        if self.first or self.starts_dec:
            self.embed = model.embed
        self.enc = nn.Sequential(*list(model.encoder)[e0:e1])
        self.dec = nn.Sequential(*list(model.decoder)[d0:d1])
        if self.last:
            self.norm, self.lm_head = model.norm, model.lm_head

    def forward(self, *received, src=None, tgt=None):
        received = list(received)
        memory = None
        if self.has_enc:
            h = self.embed(src) if self.first else received.pop(0)
            h = self.enc(h)
            if not self.ends_enc:
                return h
            memory = h
            if not self.has_dec:
                return memory
        if self.starts_dec:
            x = self.embed(tgt)
            if memory is None:
                memory = received.pop(0)
        else:
            x, memory = received.pop(0), received.pop(0)
        x, _ = self.dec((x, memory))
        if self.last:
            return self.lm_head(self.norm(x))
        return x, memory
