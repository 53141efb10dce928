"""One request's tokens and progress through the engine."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from chunklocal.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch


class Status(enum.Enum):
    WAITING = "waiting"    # no KV blocks (new, or preempted and to be recomputed)
    RUNNING = "running"    # holds KV blocks for its computed tokens
    FINISHED = "finished"


class Sequence:
    """Prompt plus generated tokens; ``num_computed`` of them have KV in the cache.

    ``block_tables[g]`` lists the pages of KV group ``g`` by logical page index
    (position // block_size).  A chunked group frees the pages before the
    current chunk; their entries stay as placeholders (page 0) that no
    attention row ever reads, so a column index is always a logical page.

    ``params.max_tokens`` must be an int here (the engine core resolves None); it is
    ``max_tokens``.
    ``finish_reason`` / ``stop_reason`` are set by whoever finishes it (scheduler:
    EOS, stop token, length; engine core: stop string, abort).
    """

    def __init__(self, seq_id: int, prompt: list[int], params: SamplingParams,
                 num_groups: int):
        self.seq_id = seq_id
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        if params.max_tokens is None:
            raise ValueError(f"sequence {seq_id}: max_tokens None must be resolved to the "
                             "room left in max_model_len first (the engine core does)")
        self.max_tokens: int = params.max_tokens
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_tables: list[list[int]] = [[] for _ in range(num_groups)]
        #: First logical page still owned, per group (pages before it were freed).
        self.first_owned_page = [0] * num_groups
        #: Row of the block manager's numpy tables while the request holds pages.
        self.row: int | None = None
        #: Prefix caching (engine/prefix_cache.py): hashes of the full blocks, the
        #: prompt's (shared by the samples of one request) and then its generated
        #: tokens' (each sample's own), how many of them are registered in
        #: the cache, the extra hash key (cache_salt), and the prompt tokens found
        #: cached at the first admission (None before it).
        self.block_hashes: list[int] = []
        self.num_registered = 0
        self.cache_key = 0
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        #: float64 row of sampling parameters (engine/sampler.py), set by the engine core.
        self.sampling_row: np.ndarray | None = None
        #: The seeded request's own torch.Generator (made by the sampler on first use).
        self.generator: torch.Generator | None = None
        #: "all" / "last": the runner keeps this request's prompt logits (prompt_logits).
        self.capture: str | None = None
        self.captured: list = []
        #: The engine core's Request this is sample ``index`` of (engine/stream.py, which
        #: imports this module: typed Any so that the import graph stays acyclic); its
        #: output state is ``request.samples[index]``.
        self.request: Any = None
        self.index = 0
        #: Overlapped steps (engine/overlap.py): index in token_ids of the token still on
        #: the device, and its row in that step's samples.
        self.placeholder_index: int | None = None
        self.placeholder_row = 0

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """More than the newest token lacks KV: a (re)prefill is in progress."""
        return self.num_uncomputed > 1

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_tokens - self.num_generated
