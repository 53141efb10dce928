"""Overlap the host's work for step n+1 with the device's step n (``async_scheduling``).

Loop order with step n launched and not collected::

    provisional(n)  -> every request that samples in step n gets a placeholder token (-1)
                       and its progress, so the scheduler sees it one token longer
    schedule(n+1)   -> as usual (placeholders count as tokens)
    launch(n+1)     -> placeholders in its inputs are read from step n's tokens on the
                       device (model_runner.launch), so nothing waits for step n
    collect(n)      -> wait for step n's tokens only
    resolve(n)      -> fill the placeholders; EOS / stop tokens finish requests now
    publish(n)      -> text, stop strings, streams, exactly as the synchronous loop

Outputs equal the synchronous loop's: every token is sampled from the same logits with
the same generators, and a request that finished in step n (EOS, stop token, stop
string, abort) has its step n+1 row dropped: nothing is emitted past it.  Its pages are
freed when it finishes; step n+1 may still write them, which is safe because device
work runs in order (a later owner's writes come after).

When it is used (``overlappable``): ``LLM(async_scheduling=True)``, no speculative
decoding (step n+1's drafts and query lengths depend on how many of step n's drafts are
accepted, known only on the host after step n), no live request with penalties (their
token history is read on the host), and step n replayed a CUDA graph, ran on the CPU, or
ran eagerly on backends that allow it (``overlaps_eager_steps``: FlashInfer stages each
plan() in a pinned buffer whose copy to the device runs later, so it alternates two
wrappers per kind; on by default, ``CHUNKLOCAL_OVERLAP_EAGER=0`` turns it off).
Otherwise the loop collects step n first.
"""

from __future__ import annotations

from chunklocal.engine.sequence import Status


def overlappable(core, launched) -> bool:
    llm = core.llm
    return (llm.async_scheduling and llm.num_speculative_tokens == 0
            and core.num_penalised == 0
            and (launched.overlap_safe or llm.device.type == "cpu"))


def provisional(scheduler, launched) -> None:
    """Advance step n's requests as if their tokens were known (placeholders)."""
    batch, bounds = launched.batch, launched.row_bounds
    for i, seq in enumerate(batch.seqs):
        if seq.status is Status.FINISHED:
            continue  # aborted or stopped since it was launched: its row is dropped
        seq.num_computed += batch.num_new[i]
        if bounds[i + 1] == bounds[i]:
            continue  # a prefill piece that does not reach the prompt's end
        seq.token_ids.append(-1)
        seq.placeholder_index, seq.placeholder_row = len(seq.token_ids) - 1, int(bounds[i])
        if seq.remaining_new_tokens == 0 or len(seq) >= scheduler.max_model_len:
            seq.finish_reason = "length"  # whatever the token is (EOS overrides in resolve)
            scheduler.abort(seq)


def resolve(scheduler, launched, out, eos_ids) -> None:
    """Fill step n's placeholders; finish requests whose token is EOS or a stop id."""
    for i, seq in enumerate(launched.batch.seqs):
        if seq.placeholder_index is None or len(out.tokens[i]) == 0:
            continue
        token = int(out.tokens[i][0])
        seq.token_ids[seq.placeholder_index] = token
        seq.placeholder_index = None
        scheduler.steps_without_token = 0  # progress, for the scheduler's guard
        if token in eos_ids and not seq.params.ignore_eos:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in seq.params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        else:
            continue
        scheduler.abort(seq)  # frees its pages (no-op if length already finished it)
