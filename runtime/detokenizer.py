"""Incremental detokenization and stop-string matching for one request (vLLM V1 semantics).

Text is emitted only up to the last complete character: a window decode that ends in U+FFFD is
held back until more tokens complete it (byte-level BPE splits characters across tokens). Each
window starts where the previous emission ended, at a character boundary, so for byte-level
tokenizers the emitted text is always a prefix of decode(output ids), and equal to it once the
request finishes. A few prompt tokens seed the window so tokenizers that strip a leading space on
the first decoded token (SentencePiece) still space the first output token correctly.

The window is bounded, so each token costs a bounded amount of decoding. vLLM 0.33's offsets (and
tokenizers' DecodeStream) hold every token while the text ends in U+FFFD, so a model emitting a
run of bytes that never completes a character gets its whole run re-decoded at every step
(quadratic). Here a held run longer than _MAX_HELD tokens is cut _CUT_TAIL tokens from its end
when nothing straddles the cut (see _cut); skipped special tokens, which decode to nothing, never
enter the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5
_INCOMPLETE = "\ufffd"
# A character is at most 4 bytes, so 4 tokens after a cut (each at least a byte) always decide
# the character the cut may split.
_CUT_TAIL = 4
# Held tokens before a cut is tried; a few more than _CUT_TAIL so a cut emits a batch of text.
_MAX_HELD = 16


def find_stop_string(
    text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """The first stop string that ends in the last `new_char_count` characters of `text`, and the
    length to cut the text to (-1: no cut needed), or None."""
    if not new_char_count or not stop:
        return None
    for s in stop:
        # Only matches that end in the new text are new: earlier text was already searched.
        index = text.find(s, max(0, len(text) - new_char_count - len(s) + 1))
        if index == -1:
            continue
        if include_in_output:
            index += len(s)
            if index >= len(text):
                return s, -1
        return s, index
    return None


class IncrementalDetokenizer:
    """Turns one request's output token ids into text as they arrive."""

    def __init__(
        self, tokenizer: Tokenizer, params: Any, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        # decode(skip_special_tokens=True) drops these before decoding: the window can too.
        self._skipped = tokenizer.all_special_ids if self._skip_special else frozenset()
        # vLLM's FastIncrementalDetokenizer under spaces_between_special_tokens=False (and
        # skip_special_tokens=False): an added token right after another added token emits its
        # own text, without the space the decoder puts between them (WordPiece's "[CLS] [SEP]").
        # Its output text then differs from decode(ids), as vLLM's does.
        raw = not self._skip_special and not params.spaces_between_special_tokens
        self._added = tokenizer.added_token_contents if raw else None
        self._after_added = False
        self._stop = tuple(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        if self._decode(context).endswith(_INCOMPLETE):
            context = []  # a prompt ending mid-character would shift the first output's text
        self._window = context  # ids decoded together; [prefix, read) is already emitted
        self._prefix = 0
        self._read = len(context)
        # Output tokens seen (their ids live in the core's Request; min_tokens needs the count).
        self.num_tokens = 0
        self.output_text = ""
        self._sent = 0  # characters of output_text returned by next_output_text(delta=True)
        # While streaming, hold back text a stop string could still cut away.
        longest = max(map(len, self._stop), default=0)
        self._hold = 0 if self._include_stop else max(0, longest - 1)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _next_text(self, flush: bool) -> str:
        prefix_text = self._decode(self._window[self._prefix : self._read])
        text = self._decode(self._window[self._prefix :])
        if len(text) > len(prefix_text) and (flush or not text.endswith(_INCOMPLETE)):
            return self._emit(len(self._window), text, prefix_text)
        if len(self._window) - self._read > _MAX_HELD:
            return self._cut(text, prefix_text)
        return ""

    def _cut(self, text: str, prefix_text: str) -> str:
        """Emit a long held run up to _CUT_TAIL tokens from its end, if that part's text is final:
        the tail decodes to text of its own and head + tail decode to exactly the whole window.
        A character split by the cut would decode differently in two halves (a completed one, or
        one still open, shows up as extra U+FFFDs), so equality means the tail's first bytes
        ended the head's last character, and no later token can change the head's text."""
        cut = len(self._window) - _CUT_TAIL
        head = self._decode(self._window[self._prefix : cut])
        tail = self._decode(self._window[cut:])
        if not tail or head + tail != text or not head.startswith(prefix_text):
            return ""
        return self._emit(cut, head, prefix_text)

    def _emit(self, end: int, text: str, prefix_text: str) -> str:
        """The text of window[read:end], which then becomes the only decode context: the window
        keeps one emitted segment and what is still held."""
        self._window = self._window[self._read :]
        self._prefix, self._read = 0, end - self._read
        return text[len(prefix_text) :]

    def update(
        self, new_token_ids: Sequence[int], stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        """Add sampled tokens; returns the stop string they completed, if any (the request then
        finishes with that stop reason and the text is cut). `stop_terminated`: the last token is
        an EOS / stop token, whose text is left out unless include_stop_str_in_output.
        `finished`: the request ends now, so trailing incomplete bytes are emitted as U+FFFD."""
        new_token_ids = list(new_token_ids)
        skipped = None
        if stop_terminated and new_token_ids and not self._include_stop:
            skipped = new_token_ids.pop()
        check_from = len(self.output_text)
        for token in new_token_ids:
            self.num_tokens += 1
            if token in self._skipped:
                continue
            self._window.append(token)
            text = self._next_text(flush=False)
            if self._added:
                content = self._added.get(token)
                if content is not None and self._after_added:
                    text = content
                self._after_added = content is not None
            self.output_text += text
            if self.num_tokens <= self._min_tokens:
                check_from = len(self.output_text)
        if finished or stop_terminated:
            self.output_text += self._next_text(flush=True)
        if skipped is not None:
            self.num_tokens += 1
        if not self._stop or self.num_tokens <= self._min_tokens:
            return None
        found = find_stop_string(
            self.output_text, len(self.output_text) - check_from, self._stop, self._include_stop
        )
        if found is None:
            return None
        stop, cut = found
        if cut != -1:
            self.output_text = self.output_text[:cut]
        return stop

    def next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now: everything (delta=False) or what is new since the last delta call;
        while unfinished, the last characters a stop string could still remove are held back."""
        end = len(self.output_text) if finished else max(0, len(self.output_text) - self._hold)
        if not delta:
            return self.output_text[:end]
        end = max(end, self._sent)
        text, self._sent = self.output_text[self._sent : end], end
        return text
