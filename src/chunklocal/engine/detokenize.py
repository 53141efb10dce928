"""Incremental detokenization and stop strings, one sample at a time.

Invariants (tested in tests/test_engine_sampling_stream.py):
- ``text`` only grows and never ends inside a UTF-8 character: a token that decodes to
  an incomplete character (U+FFFD at the end) waits for the tokens that complete it.
- ``visible_text`` never ends with a proper prefix of a stop string while the sample is
  running, so a stream never shows half a stop string that is later cut.
- Once finished, the text is ``tokenizer.decode(token_ids[:k], skip_special_tokens)`` cut
  at the first stop string, where ``k`` leaves out a final EOS or stop token id (unless
  ``include_stop_str_in_output``).

The decode window covers only the sample's own tokens (no prompt context), so its text
equals decoding the output token ids alone, as ``LLM.generate`` always returned.

Two ways, one contract: with a Rust ("fast") tokenizer, ``tokenizers``' DecodeStream keeps
the window in Rust (one call per token); otherwise two Python-level decodes per token over
a window that restarts at each complete character.  Either way the cost per token stays
constant, not growing with the output.  ``finish()`` then decodes the whole output once,
so the final text is the decode itself whatever the streaming held back.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.max_stop = max(map(len, self.stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are in ``text``
        self.read_offset = 0    # tokens before it are in ``text`` (window's decoded head)
        self.text = ""
        self.stopped_on: str | None = None
        self.finished = False
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        # transformers' decode post-processes what the Rust decoder gives only when it
        # cleans up tokenization spaces; then the stream would not match it.
        if self._backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces",
                                                     False):
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed (then finished), or None."""
        if self.finished:
            raise RuntimeError("add() after the sample finished")
        self.ids.append(int(token_id))
        if self._stream is not None:
            piece = self._stream.step(self._backend, self.ids[-1])
            if not piece:
                return None  # no complete new character yet
            before = len(self.text)
            self.text += piece
            return self._check_stop(before)
        head = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) <= len(head) or window.endswith(REPLACEMENT):
            return None  # no complete new character yet
        before = len(self.text)
        self.text += window[len(head):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop(before)

    def _check_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        start = max(0, before - self.max_stop + 1)
        found = None
        for s in self.stop:
            at = self.text.find(s, start)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, s)
        if found is None:
            return None
        at, s = found
        self.text = self.text[:at + len(s) if self.include_stop else at]
        self.stopped_on = s
        self.finished = True
        return s

    def finish(self) -> None:
        """End of the sample (length, EOS, stop token, abort): release everything held."""
        if self.finished:
            return
        if self._stream is not None:
            whole = self._decode(self.ids)
            if whole.startswith(self.text):  # the stream's text is always a prefix of it
                self.text = whole
            self.finished = True
            return
        tail = self._decode(self.ids[self.prefix_offset:])
        head = self._decode(self.ids[self.prefix_offset:self.read_offset])
        if len(tail) > len(head):
            self.text += tail[len(head):]
        self.finished = True

    @property
    def visible_text(self) -> str:
        """What a stream may show now: all of ``text`` once finished, else ``text`` less
        its longest suffix that could still grow into a stop string."""
        if self.finished or not self.stop or self.include_stop:
            return self.text
        hold = 0
        text = self.text
        for s in self.stop:
            for length in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:length]):
                    hold = length
                    break
        return text[:len(text) - hold] if hold else text
